#include "server/http_util.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include <chrono>

#include <httplib.h>

#include "server/openai_request.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kv {

void write_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump_json(e.to_json()), "application/json");
}

void write_json(httplib::Response& res, const nlohmann::ordered_json& j) {
  res.status = 200;
  res.set_content(dump_json(j), "application/json");
}

namespace {
// The value for Access-Control-Allow-Origin, or "" when `origin` is not allowed.
std::string allowed_origin(const std::string& origin, const std::vector<std::string>& origins) {
  if (origin.empty()) return "";
  for (const std::string& o : origins)
    if (o == "*" || o == origin) return origin;  // echoed (with Vary): also right for credentialed requests
  return "";
}
}  // namespace

std::string origin_problem(const std::string& origin) {
  if (origin == "*") return "";
  const std::string want = "' is not an origin: want * or scheme://host[:port] as a browser sends it (http or https, lower case, "
                           "no path or trailing slash), e.g. http://localhost:3000";
  std::string shown;  // the value as given, printable on one line
  for (unsigned char c : origin) shown += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  const size_t sep = origin.find("://");
  if (sep == std::string::npos) return "'" + shown + want;
  const std::string scheme = origin.substr(0, sep);
  if (scheme != "http" && scheme != "https")
    return "'" + shown + "': the scheme must be http or https, in lower case (what a browser sends for a web page)";
  std::string host = origin.substr(sep + 3), port;
  if (const size_t path = host.find_first_of("/?#"); path != std::string::npos)
    return path + 1 == host.size() && host[path] == '/'
               ? "'" + shown + "': no trailing slash (a browser's Origin has none): " + shown.substr(0, shown.size() - 1)
               : "'" + shown + "': an origin has no path, query or fragment";
  if (host.find('@') != std::string::npos) return "'" + shown + "': an origin has no user name or password";
  // The port: after the last ':' outside an IPv6 literal's brackets.
  const size_t close = host.rfind(']');
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos && (close == std::string::npos || colon > close)) {
    port = host.substr(colon + 1);
    host.resize(colon);
    if (port.empty() || port.size() > 5 || port[0] == '0' || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(port) > 65535)
      return "'" + shown + "': the port must be a number in [1, 65535] without leading zeros";
    if ((scheme == "http" && port == "80") || (scheme == "https" && port == "443"))
      return "'" + shown + "': a browser leaves the default port out of its Origin; write " + scheme + "://" + host;
  }
  if (host.empty()) return "'" + shown + want;
  const bool v6 = host.front() == '[';
  const std::string_view allowed = v6 ? "[]0123456789abcdef:." : "abcdefghijklmnopqrstuvwxyz0123456789.-_";
  if (v6 && (host.back() != ']' || host.size() < 3 || host.find('[', 1) != std::string::npos || host.find(']') != host.size() - 1))
    return "'" + shown + want;
  for (char c : host)
    if (allowed.find(c) == std::string_view::npos)
      return c >= 'A' && c <= 'Z' ? "'" + shown + "': a browser sends the host in lower case; write it so"
                                  : "'" + shown + want;
  return "";
}

void install_cors(httplib::Server& svr, std::vector<std::string> origins) {
  if (origins.empty()) return;
  svr.set_post_routing_handler([origins = std::move(origins)](const httplib::Request& req, httplib::Response& res) {
    const std::string allow = allowed_origin(req.get_header_value("Origin"), origins);
    if (allow.empty()) return;
    res.set_header("Access-Control-Allow-Origin", allow);
    res.set_header("Vary", "Origin");
    res.set_header("Access-Control-Expose-Headers", "Retry-After");
  });
}

bool cors_preflight(const httplib::Request& req, httplib::Response& res, const std::vector<std::string>& origins) {
  if (req.method != "OPTIONS") return false;
  res.status = 204;
  res.set_header("Allow", "GET, POST, DELETE, OPTIONS");
  if (allowed_origin(req.get_header_value("Origin"), origins).empty()) return true;  // no CORS headers: refused
  res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
  const std::string asked = req.get_header_value("Access-Control-Request-Headers");
  res.set_header("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type" : asked);
  res.set_header("Access-Control-Max-Age", "600");
  return true;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void install_json_errors(httplib::Server& svr, size_t max_body_bytes) {
  svr.set_error_handler(httplib::Server::HandlerWithResponse([max_body_bytes](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e{res.status, "", error_type_for_status(res.status), "", ""};
    switch (res.status) {
      case 404: e.message = "Not found: " + req.method + " " + req.path; e.code = "not_found"; break;
      case 413: e = payload_too_large(max_body_bytes); break;
      case 414: e.message = "The request URI is too long."; break;
      default: e.message = "The HTTP request could not be handled (status " + std::to_string(res.status) + ")."; break;
    }
    write_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  }));

  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    write_error(res, ApiError{500, "Internal server error: " + what, "server_error", "", ""});
  });
}

std::function<void(const httplib::Request&, httplib::Response&)> safe_handler(
    std::function<void(const httplib::Request&, httplib::Response&)> fn) {
  return [fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
    try {
      fn(req, res);
    } catch (const ApiError& e) {
      write_error(res, e);
    } catch (const std::exception& e) {
      write_error(res, ApiError{500, std::string("Internal server error: ") + e.what(), "server_error", "", ""});
    } catch (...) {
      write_error(res, ApiError{500, "Internal server error.", "server_error", "", ""});
    }
  };
}

ApiError payload_too_large(size_t max_body_bytes) {
  return ApiError{413, "The request body is too large: the limit is " + std::to_string(max_body_bytes) + " bytes.",
                  error_type_for_status(413), "", "payload_too_large"};
}

void post_with_body_limit(httplib::Server& svr, const std::string& pattern, size_t max_body_bytes,
                          std::function<void(const httplib::Request&, httplib::Response&)> fn, double body_timeout_s) {
  svr.Post(pattern, [max_body_bytes, body_timeout_s, fn = safe_handler(std::move(fn))](
                        const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
    std::string body;
    bool over = false, late = false;
    const auto deadline = body_timeout_s > 0 ? std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                                    std::chrono::duration<double>(body_timeout_s))
                                             : std::chrono::steady_clock::time_point::max();
    // The receiver gets the body as decoded (chunks joined, gzip / deflate inflated).
    const bool ok = read([&](const char* data, size_t n) {
      if (n > max_body_bytes - body.size()) {
        over = true;
        return false;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        late = true;
        return false;
      }
      body.append(data, n);
      return true;
    });
    if (!ok || over || late) {
      // httplib sets 413 itself when a Content-Length is over its own limit (the same number).
      if (late) {
        char secs[32];
        std::snprintf(secs, sizeof secs, "%g", body_timeout_s);
        write_error(res, ApiError{408, std::string("The request body took longer than ") + secs + " s to arrive.",
                                  "invalid_request_error", "", "request_timeout"});
      } else if (over || res.status == 413)
        write_error(res, payload_too_large(max_body_bytes));
      else
        write_error(res, ApiError{400, "The request body could not be read (a broken chunked or compressed encoding).",
                                  "invalid_request_error", "", "invalid_body"});
      res.set_header("Connection", "close");  // what is left of the body is not a request
      return;
    }
    // httplib owns the request (not a const object); the handlers read req.body as for a
    // route that httplib reads itself.
    const_cast<httplib::Request&>(req).body = std::move(body);
    fn(req, res);
  });
}

bool refuse_wrong_method(const httplib::Request& req, httplib::Response& res, const std::map<std::string, std::string>& allowed) {
  std::string path = req.path;
  if (path.rfind("/v1/models/", 0) == 0) path = "/v1/models";
  auto it = allowed.find(path);
  if (it == allowed.end() || req.method == it->second || (req.method == "HEAD" && it->second == "GET")) return false;
  write_error(res, ApiError{405, "Method " + req.method + " is not allowed on " + req.path + "; use " + it->second + ".",
                            "invalid_request_error", "", "method_not_allowed"});
  res.set_header("Allow", it->second);
  return true;
}

void install_model_routes(httplib::Server& svr, const ApiContext& ctx) {
  // A card per served name (vLLM lists each of --served-model-name's); a file-name alias gets the first's.
  auto card = [&ctx](const std::string& id) {
    return nlohmann::ordered_json{{"id", id}, {"object", "model"}, {"created", unix_now()}, {"owned_by", "kvserve"},
                                  {"max_model_len", ctx.max_model_len}, {"chat_template", ctx.chat_template != nullptr}};
  };
  svr.Get("/v1/models", safe_handler([&ctx, card](const httplib::Request&, httplib::Response& res) {
            auto data = nlohmann::ordered_json::array();
            for (int32_t i = 0; i < ctx.n_served_names; ++i) data.push_back(card(ctx.model_names.at(i)));
            write_json(res, nlohmann::ordered_json{{"object", "list"}, {"data", data}});
          }));
  svr.Get(R"(/v1/models/(.+))", safe_handler([&ctx, card](const httplib::Request& req, httplib::Response& res) {
            const std::string id = req.matches[1];
            if (std::find(ctx.model_names.begin(), ctx.model_names.end(), id) == ctx.model_names.end())
              throw ApiError{404, "The model `" + id + "` does not exist.", "invalid_request_error", "model", "model_not_found"};
            const auto k = std::find(ctx.model_names.begin(), ctx.model_names.end(), id) - ctx.model_names.begin();
            write_json(res, card(k < ctx.n_served_names ? id : ctx.model_names.at(0)));
          }));
}

void install_tokenize_routes(httplib::Server& svr, const ApiContext& ctx, size_t max_body_bytes, double body_timeout_s) {
  using ojson = nlohmann::ordered_json;
  post_with_body_limit(svr, "/tokenize", max_body_bytes, [&ctx](const httplib::Request& req, httplib::Response& res) {
    const TokenizeRequest t = parse_tokenize_request(parse_json_body(req.body, ctx), ctx);
    ojson out{{"tokens", t.ids}, {"count", t.ids.size()}, {"max_model_len", ctx.max_model_len}};
    if (t.with_pieces) {  // llama-server's: each token with its text, or its bytes when they are not UTF-8 alone
      ojson pieces = ojson::array();
      for (int32_t id : t.ids) {
        const std::string b = ctx.tok->token_bytes(id, /*special=*/true);
        ojson piece = ojson::array();
        if (utf8::is_valid(b)) piece = b;
        else
          for (unsigned char c : b) piece.push_back(c);
        pieces.push_back({{"id", id}, {"piece", std::move(piece)}});
      }
      out["tokens"] = std::move(pieces);
    }
    if (t.token_strs) {  // the vocabulary's spelling (byte-level "Ġworld"), as HF's convert_ids_to_tokens
      ojson strs = ojson::array();
      for (int32_t id : t.ids) strs.push_back(ctx.tok->token_text(id));
      out["token_strs"] = std::move(strs);
    }
    write_json(res, out);
  }, body_timeout_s);
  // Special tokens are rendered (<|im_start|>, <|endoftext|>), as vLLM's (tokenizer.decode with
  // skip_special_tokens=False) and llama-server's; completions' text skips them.
  post_with_body_limit(svr, "/detokenize", max_body_bytes, [&ctx](const httplib::Request& req, httplib::Response& res) {
    const std::string text = ctx.tok->decode(parse_detokenize_request(parse_json_body(req.body, ctx), ctx), /*special=*/true);
    write_json(res, ojson{{"prompt", text}, {"content", text}});
  }, body_timeout_s);
}

// Linux lets listen() be called again on a listening socket to change the backlog, so find the
// socket bound to `port` among this process's descriptors and raise it.
void raise_listen_backlog(int port) {
  for (int fd = 0; fd < 4096; ++fd) {
    int accepting = 0;
    socklen_t len = sizeof accepting;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting) continue;
    sockaddr_storage addr{};
    socklen_t alen = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) continue;
    int bound = -1;
    if (addr.ss_family == AF_INET) bound = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (addr.ss_family == AF_INET6) bound = ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
    if (bound == port) ::listen(fd, SOMAXCONN);
  }
}

std::string listen_problem(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    return "'" + host + "' is not an address this machine resolves";
  std::string why = "no usable address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));  // as bind_exclusive: a TIME_WAIT port is free
    const int rc = ::bind(fd, a->ai_addr, a->ai_addrlen);
    const int err = errno;
    close(fd);
    if (rc == 0) {
      why.clear();
      break;
    }
    why = err == EADDRINUSE ? "the port is in use (another server?)" : std::string(std::strerror(err));
  }
  freeaddrinfo(res);
  return why;
}

bool bind_exclusive(httplib::Server& svr, const std::string& host, int port) {
  svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  if (!svr.bind_to_port(host, port)) return false;
  raise_listen_backlog(port);
  return true;
}

namespace {
// addr's port and numeric address, as cpp-httplib writes them into Request::remote_addr.
bool endpoint(const sockaddr_storage& addr, std::string* host, int* port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    *port = ntohs(a->sin_port);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    *port = ntohs(a->sin6_port);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
  } else {
    return false;
  }
  *host = buf;
  return true;
}

// Calls fn(fd, peer host, peer port) for each of this process's connected sockets whose local
// port is local_port, until fn returns false.
void each_connection(int local_port, const std::function<bool(int, const std::string&, int)>& fn) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    if (fd == dirfd(dir)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t plen = sizeof peer, llen = sizeof local;
    std::string host;
    int port = -1;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0 || !endpoint(local, &host, &port) || port != local_port) continue;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0 || !endpoint(peer, &host, &port)) continue;
    if (!fn(fd, host, port)) break;
  }
  closedir(dir);
}

// Constant-time comparison: the key check must not leak how many leading bytes matched.
bool same_secret(const std::string& given, const std::string& key) {
  if (given.size() != key.size() || key.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ key[i]);
  return diff == 0;
}

}  // namespace

std::string bearer_key(const httplib::Request& req) {
  const std::string h = req.get_header_value("Authorization");
  constexpr std::string_view kScheme = "bearer";
  if (h.size() <= kScheme.size() || h[kScheme.size()] != ' ') return "";
  for (size_t i = 0; i < kScheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(h[i])) != kScheme[i]) return "";
  const size_t k = h.find_first_not_of(' ', kScheme.size());
  return k == std::string::npos ? "" : h.substr(k);
}

bool authorized(const httplib::Request& req, const std::vector<std::string>& keys) {
  if (keys.empty()) return true;
  const std::string given = bearer_key(req);
  bool ok = false;
  for (const std::string& key : keys) ok |= same_secret(given, key);  // every key compared
  return ok;
}

void refuse_unauthorized(const httplib::Request& req, httplib::Response& res) {
  // No header, or one not in the Bearer form (the key alone, Basic): OpenAI's "didn't provide".
  const bool missing = bearer_key(req).empty();
  write_error(res, ApiError{401,
                            missing ? "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                                      "(i.e. Authorization: Bearer YOUR_KEY)."
                                    : "Incorrect API key provided.",
                            "invalid_request_error", "", "invalid_api_key"});
  res.set_header("WWW-Authenticate", "Bearer");
}

int find_client_socket(const httplib::Request& req) {
  if (req.remote_port <= 0 || req.local_port <= 0) return -1;
  int found = -1;
  each_connection(req.local_port, [&](int fd, const std::string& host, int port) {
    if (port != req.remote_port || host != req.remote_addr) return true;
    found = fd;
    return false;
  });
  return found;
}

bool peer_closed(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;
  if (n == 0) return true;
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

ConnectionWatchdog::ConnectionWatchdog(int port, double limit_s)
    : port_(port), limit_s_(limit_s), thread_([this] { loop(); }) {}

ConnectionWatchdog::~ConnectionWatchdog() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ConnectionWatchdog::begin(const httplib::Request& req) {
  std::lock_guard<std::mutex> l(mu_);
  ++conns_[{req.remote_addr, req.remote_port}].active;
}

void ConnectionWatchdog::end(const httplib::Request& req) {
  std::lock_guard<std::mutex> l(mu_);
  Conn& c = conns_[{req.remote_addr, req.remote_port}];  // a request refused before routing never began
  c.active = std::max(0, c.active - 1);
  c.since = std::chrono::steady_clock::now();
}

void ConnectionWatchdog::loop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, std::chrono::seconds(1), [this] { return stop_; });
    if (stop_) break;
    l.unlock();
    check();
    l.lock();
  }
}

namespace {

// Whether the unread bytes of socket fd hold a request's line and headers ("\r\n\r\n"), as
// a client waiting for a connection thread has sent them. Never blocks, reads nothing.
bool holds_request_headers(int fd) {
  char buf[16384];
  const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 && std::string_view(buf, static_cast<size_t>(n)).find("\r\n\r\n") != std::string_view::npos;
}

}  // namespace

void ConnectionWatchdog::check() {
  // This process's connected sockets on the port (the listening one has no peer).
  std::vector<std::pair<int, Peer>> open;
  each_connection(port_, [&](int fd, const std::string& host, int port) {
    open.push_back({fd, {host, port}});
    return true;
  });
  const auto now = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(limit_s_));
  std::vector<std::pair<int, Peer>> idle;
  int64_t waiting = 0;  // complete requests no thread has taken yet
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [peer, c] : conns_) c.seen = false;
    for (const auto& [fd, peer] : open) {
      auto [it, fresh] = conns_.try_emplace(peer);
      if (fresh) it->second.since = now;
      it->second.seen = true;
      if (it->second.active == 0 && now - it->second.since > limit) {
        if (holds_request_headers(fd)) ++waiting;
        else idle.push_back({fd, peer});
      }
    }
    for (auto it = conns_.begin(); it != conns_.end();) it = it->second.seen ? std::next(it) : conns_.erase(it);
  }
  for (const auto& [fd, peer] : idle) {
    // Still that connection (its descriptor was not closed and reused meanwhile): shut it down;
    // its thread's next read fails and httplib closes it.
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    std::string host;
    int port = -1;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !endpoint(addr, &host, &port) || Peer{host, port} != peer)
      continue;
    ::shutdown(fd, SHUT_RDWR);
    closed_.fetch_add(1);
  }
  if (waiting > 0 && (told_waiting_at_ == std::chrono::steady_clock::time_point{} || now - told_waiting_at_ > std::chrono::minutes(1))) {
    std::fprintf(stderr, "http: %lld connections with a complete request have waited over %g s for a connection thread (--http-threads)\n",
                 static_cast<long long>(waiting), limit_s_);
    told_waiting_at_ = now;
  }
  const int64_t closed = closed_.load();
  if (closed > told_ && (told_ == 0 || now - told_at_ > std::chrono::minutes(1))) {
    std::fprintf(stderr, "http: closed %lld connections that sent no complete request within %g s (--http-read-timeout)\n",
                 static_cast<long long>(closed - told_), limit_s_);
    told_ = closed;
    told_at_ = now;
  }
}

}  // namespace kv
