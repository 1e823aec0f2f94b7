#include "router/router.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>

#include <httplib.h>

#include "server/http_util.h"
#include "server/openai_response.h"
#include "server/responses_api.h"

namespace kv {

using json = nlohmann::ordered_json;

struct Router::Backend {
  std::string url, host;
  int port = 0;
  std::atomic<bool> up{true};
  std::atomic<int64_t> down_since_ns{0};  // steady clock when it went down; 0 while up
  std::atomic<int32_t> in_flight{0};
  std::atomic<uint64_t> requests{0}, failures{0};
  std::string other_model;  // the health thread's: the model it serves when not the router's (told once)
};

struct Router::Pool {
  const char* role = "replica";
  std::vector<std::unique_ptr<Backend>> backends;
  HashRing ring;
  std::mutex map_mu;
  std::unique_ptr<PrefixMap> map;  // cache-aware routing's memory of where each key went
  bool empty() const { return backends.empty(); }
  std::vector<bool> up() const {
    std::vector<bool> v;
    for (const auto& b : backends) v.push_back(b->up.load());
    return v;
  }
  std::vector<int32_t> load() const {
    std::vector<int32_t> v;
    for (const auto& b : backends) v.push_back(b->in_flight.load());
    return v;
  }
};

namespace {

// Counts a request in flight on a backend for as long as it lives.
// Counts one request in flight while it lives: at a backend, or at the router (a stream's until
// its response ends).
struct InFlight {
  std::atomic<int32_t>& n;
  explicit InFlight(std::atomic<int32_t>& n) : n(n) { n.fetch_add(1); }
  ~InFlight() { n.fetch_sub(1); }
};

httplib::Headers upstream_headers(const std::string& auth) {
  httplib::Headers h;
  if (!auth.empty()) h.emplace("Authorization", auth);
  return h;
}

void set_timeouts(httplib::Client& c, const RouterOptions& o) {
  const auto secs = [](double s) { return std::chrono::microseconds(static_cast<int64_t>(s * 1e6)); };
  c.set_connection_timeout(secs(o.connect_timeout_s));
  c.set_read_timeout(secs(o.read_timeout_s));
  c.set_write_timeout(secs(o.read_timeout_s));
  c.set_keep_alive(false);
  c.set_tcp_nodelay(true);  // the request's body must not wait for the ACK of its headers
}

}  // namespace

// One streamed upstream response, handed from its own thread to the client's connection thread.
struct Router::Pipe {
  std::mutex mu;
  std::condition_variable cv;
  int status = -1;  // -1: no answer yet; 0: no answer at all (connection failed)
  std::string content_type;
  std::string retry_after;  // the backend's Retry-After, if it sent one
  std::deque<std::string> chunks;
  bool done = false;
  bool failed_midway = false;     // the backend went away after answering
  bool stalled = false;           // ... or froze: down and silent for --stall-timeout
  std::atomic<bool> cancel{false};  // the client went away, or the router stops
  std::atomic<int64_t> last_byte_ns{0};  // steady clock of the upstream's last byte (or its start)
  std::atomic<bool> gone_counted{false};  // router_client_disconnects_total has this client (watch_loop or a failed write)
};

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

// Up or down, and since when (the stall check needs how long a backend has been down).
bool set_up(Router::Backend& b, bool ok) {
  const bool was = b.up.exchange(ok);
  if (was && !ok) b.down_since_ns.store(now_ns());
  if (ok) b.down_since_ns.store(0);
  return was;
}

// A backend that did not answer: down until its health check passes; the request goes elsewhere.
void gave_no_answer(Router::Backend& b, int32_t index, std::vector<int32_t>& tried, std::atomic<uint64_t>& retries) {
  b.failures.fetch_add(1);
  set_up(b, false);
  tried.push_back(index);
  retries.fetch_add(1);
}

// A backend that refused the request without starting it: its queue is full (429), or it is
// draining or stopping (503: a rolling restart). The request goes to another backend; a
// draining one is down until its health check passes again.
bool refused(Router::Backend& b, int status) {
  if (status == 503) set_up(b, false);
  return status == 429 || status == 503;
}

ApiError draining_error() {
  return ApiError{503, "The router is shutting down and takes no new requests; retry on another router or later.", "server_error", "",
                  "server_shutting_down"};
}

ApiError stopped_error() {
  return ApiError{503, "The router shut down before this request finished; it was cancelled.", "server_error", "", "server_shutting_down"};
}

ApiError unavailable(const char* what) {
  return ApiError{503, std::string("No ") + what + " instance is available; retry later.", "server_error", "", "service_unavailable"};
}

}  // namespace

// A key the ring gives to backend turn % n (round-robin routing reuses the ring and its
// failover): found once per backend by probing keys.
uint64_t Router::round_robin_key(const Pool& pool, uint64_t turn) {
  const int32_t n = static_cast<int32_t>(pool.backends.size());
  const int32_t want = static_cast<int32_t>(turn % static_cast<uint64_t>(n));
  for (uint64_t k = want;; k += 0x9E3779B97F4A7C15ull)
    if (pool.ring.order(k)[0] == want) return k;
}

Result<std::pair<std::string, int>> parse_backend_url(const std::string& url) {
  std::string s = url;
  if (s.rfind("http://", 0) == 0) s = s.substr(7);
  else if (s.find("://") != std::string::npos) return Status::error("backend " + url + ": only http:// is supported");
  while (!s.empty() && s.back() == '/') s.pop_back();
  if (const size_t slash = s.find('/'); slash != std::string::npos)
    return Status::error("backend " + url + ": a path is not allowed (the router adds /v1/...): give http://HOST:PORT");
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size())
    return Status::error("backend " + url + ": expected http://HOST:PORT");
  std::string host = s.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  for (char c : s.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) return Status::error("backend " + url + ": bad port");
    port = port * 10 + (c - '0');
  }
  if (port < 1 || port > 65535) return Status::error("backend " + url + ": bad port");
  return std::make_pair(host, port);
}

Result<std::unique_ptr<Router>> Router::create(RouterOptions opts, ApiContext ctx) {
  const bool pd = !opts.prefill.empty() || !opts.decode.empty();
  if (pd && !opts.replicas.empty()) return Status::error("give either --replica, or --prefill and --decode, not both");
  if (pd && (opts.prefill.empty() || opts.decode.empty())) return Status::error("prefill/decode needs at least one --prefill and one --decode");
  if (!pd && opts.replicas.empty()) return Status::error("no backend: give --replica URL (repeat), or --prefill URL and --decode URL");
  for (const auto* list : {&opts.replicas, &opts.prefill, &opts.decode})
    for (const auto& u : *list)
      if (auto p = parse_backend_url(u); !p) return p.status();
  return std::unique_ptr<Router>(new Router(std::move(opts), std::move(ctx)));
}

Router::Router(RouterOptions opts, ApiContext ctx)
    : opts_(std::move(opts)), ctx_(std::move(ctx)), serve_(std::make_unique<Pool>()), prefill_(std::make_unique<Pool>()),
      svr_(std::make_unique<httplib::Server>()) {
  auto fill = [](Pool& p, const std::vector<std::string>& urls, const char* role) {
    p.role = role;
    for (const auto& u : urls) {
      auto b = std::make_unique<Backend>();
      auto hp = parse_backend_url(u);
      b->url = "http://" + (hp->first.find(':') != std::string::npos ? "[" + hp->first + "]" : hp->first) + ":" + std::to_string(hp->second);
      b->host = hp->first;
      b->port = hp->second;
      p.backends.push_back(std::move(b));
    }
    p.ring = HashRing(static_cast<int32_t>(p.backends.size()));
    p.map = std::make_unique<PrefixMap>(static_cast<int32_t>(p.backends.size()));
  };
  if (opts_.replicas.empty()) {
    fill(*serve_, opts_.decode, "decode");
    fill(*prefill_, opts_.prefill, "prefill");
  } else {
    fill(*serve_, opts_.replicas, "replica");
  }
  svr_->new_task_queue = [n = opts_.http_threads] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
  svr_->set_payload_max_length(opts_.max_body_bytes);
  svr_->set_keep_alive_max_count(1000);
  svr_->set_tcp_nodelay(true);  // streamed chunks go out at once (HttpServer says why)
  routes();
  health_ = std::thread([this] { health_loop(); });
  watch_ = std::thread([this] { watch_loop(); });
}

Router::~Router() {
  stop();
  health_cv_.notify_all();
  if (health_.joinable()) health_.join();
  if (watch_.joinable()) watch_.join();
  // Streamed requests' upstream threads see stopping_ at their next chunk; wait for them.
  for (int i = 0; i < 2000 && upstreams_.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

bool Router::bind(const std::string& host, int port) {
  if (!bind_exclusive(*svr_, host, port)) return false;
  if (opts_.http_read_timeout_s > 0) watchdog_ = std::make_unique<ConnectionWatchdog>(port, opts_.http_read_timeout_s);
  return true;
}

void Router::run() { svr_->listen_after_bind(); }

void Router::stop() {
  stopping_.store(true);
  {
    std::lock_guard<std::mutex> l(clients_mu_);
    for (const Upstream& u : clients_) u.cli->stop();  // upstream requests end now, not at their timeout
  }
  svr_->stop();
  health_cv_.notify_all();
}

bool Router::drain(double timeout_s) {
  draining_.store(true);
  const auto until = [this](double s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(static_cast<int64_t>(s * 1e6));
    while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  until(timeout_s);
  if (in_flight_.load() == 0) return true;
  // What is left ends now: streams write their error event and [DONE] within one poll (50 ms);
  // non-streamed requests lose their upstream connection and answer 503. Give their handlers a
  // moment to write that before the caller stops the HTTP server, which cuts open responses.
  aborting_.store(true);
  {
    std::lock_guard<std::mutex> l(clients_mu_);
    for (const Upstream& u : clients_)
      if (!u.streamed) u.cli->stop();  // a stream's provider ends it and cancels its upstream itself
  }
  until(5.0);
  return false;
}

// Every 50 ms: a request whose client closed its connection has its upstream request closed,
// which the backend takes as a cancel (its pages come back at once). Streams too: a scoring
// request (echo, prompt_logprobs) sends nothing until its whole prompt is done, so a stream's
// own write would notice the client only then (9-15 s of a 4,000-token prompt, computed for nobody). And an
// upstream request to a backend that has failed its health checks for --stall-timeout and sent
// nothing for as long is closed: a frozen or partitioned backend keeps its TCP connections open,
// so only --timeout (600 s) would end them. A slow backend that still answers its health check,
// or still streams, is never cut. A closed non-streamed request goes to another backend; a
// stream ends with an error event.
void Router::watch_loop() {
  const auto stall_ns = static_cast<int64_t>(opts_.stall_timeout_s * 1e9);
  while (!stopping_.load()) {
    {
      const int64_t now = now_ns();
      std::lock_guard<std::mutex> l(clients_mu_);
      for (Upstream& u : clients_) {
        if (u.client_fd >= 0 && !u.client_gone && !(u.ended && u.ended->load()) && peer_closed(u.client_fd)) {
          u.client_gone = true;
          if (!u.gone_counted || !u.gone_counted->exchange(true)) n_client_gone_.fetch_add(1);
          u.cli->stop();
        }
        if (stall_ns <= 0 || u.backend == nullptr || u.stalled || u.client_gone) continue;
        const int64_t down = u.backend->down_since_ns.load();
        const int64_t last = u.last_byte_ns != nullptr ? u.last_byte_ns->load() : u.started_ns;
        if (down != 0 && now - down >= stall_ns && now - last >= stall_ns) {
          u.stalled = true;
          n_stalled_.fetch_add(1);
          std::fprintf(stderr, "router: %s is down and silent for %.0f s: its request is left\n", u.backend->url.c_str(),
                       opts_.stall_timeout_s);
          u.cli->stop();
        }
      }
    }
    std::unique_lock<std::mutex> l(health_mu_);
    health_cv_.wait_for(l, std::chrono::milliseconds(50), [this] { return stopping_.load(); });
  }
}

void Router::health_loop() {
  while (!stopping_.load()) {
    // Every backend at once: one by one, each frozen backend held the others' checks up for its
    // 2 s timeout (two frozen replicas took 4.4 s to be left; a user test).
    std::vector<std::thread> checks;
    for (Pool* p : {serve_.get(), prefill_.get()})
      for (auto& b : p->backends)
        checks.emplace_back([this, p, b = b.get()] {
          httplib::Client c(b->host, b->port);
          c.set_connection_timeout(std::chrono::milliseconds(500));
          c.set_read_timeout(std::chrono::seconds(2));
          auto r = c.Get("/health");
          bool ok = r && r->status == 200;
          // A backend that serves another model would answer every request with a 404 (a user
          // test: half the traffic went to a Gemma instance behind a SmolLM2 router): left out.
          if (ok) {
            const json h = json::parse(r->body, nullptr, false);
            const std::string model = h.is_object() && h.contains("model") && h["model"].is_string() ? h["model"].get<std::string>() : "";
            const bool same = model.empty() || std::find(ctx_.model_names.begin(), ctx_.model_names.end(), model) != ctx_.model_names.end();
            if (!same && model != b->other_model)
              std::fprintf(stderr, "router: %s %s serves model '%s', not '%s': left out until it serves it\n", p->role, b->url.c_str(),
                           model.c_str(), ctx_.model_names.at(0).c_str());
            b->other_model = same ? "" : model;
            ok = same;
          }
          if (set_up(*b, ok) != ok) std::fprintf(stderr, "router: %s %s is %s\n", p->role, b->url.c_str(), ok ? "up" : "down");
        });
    for (std::thread& t : checks) t.join();
    std::unique_lock<std::mutex> l(health_mu_);
    health_cv_.wait_for(l, std::chrono::microseconds(static_cast<int64_t>(opts_.health_interval_s * 1e6)),
                        [&] { return stopping_.load(); });
  }
}

void Router::routes() {
  install_json_errors(*svr_, opts_.max_body_bytes);
  install_cors(*svr_, opts_.allowed_origins);
  // Which methods each path answers; another method on a known path is a 405, as the server's.
  static const std::map<std::string, std::string> kAllowed = {
      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"}, {"/health", "GET"}, {"/metrics", "GET"},
      {"/tokenize", "POST"},       {"/detokenize", "POST"},         {"/v1/responses", "POST"}};
  svr_->set_logger([this](const httplib::Request& req, const httplib::Response&) {
    if (watchdog_) watchdog_->end(req);
  });
  svr_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (watchdog_) watchdog_->begin(req);  // ends in the logger, once the response is written
    if (cors_preflight(req, res, opts_.allowed_origins)) return httplib::Server::HandlerResponse::Handled;
    // With keys, as the server: everything but the probes needs one, before any validation (a
    // user test: /v1/models and /tokenize answered anyone, and a bad body a 400 before the 401).
    if (req.path != "/health" && req.path != "/metrics" && !authorized(req, opts_.api_keys)) {
      refuse_unauthorized(req, res);
      return httplib::Server::HandlerResponse::Handled;
    }
    return refuse_wrong_method(req, res, kAllowed) ? httplib::Server::HandlerResponse::Handled
                                                   : httplib::Server::HandlerResponse::Unhandled;
  });
  post_with_body_limit(*svr_, "/v1/completions", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, false); }, opts_.http_read_timeout_s);
  post_with_body_limit(*svr_, "/v1/chat/completions", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, true); }, opts_.http_read_timeout_s);
  post_with_body_limit(*svr_, "/v1/responses", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_responses(req, res); }, opts_.http_read_timeout_s);
  svr_->Get(R"(/v1/responses/([^/]+))", safe_handler([this](const httplib::Request& req, httplib::Response& res) { handle_stored_response(req, res, false); }));
  svr_->Delete(R"(/v1/responses/([^/]+))", safe_handler([this](const httplib::Request& req, httplib::Response& res) { handle_stored_response(req, res, true); }));
  svr_->Get(R"(/v1/responses/([^/]+)/input_items)",
            safe_handler([this](const httplib::Request& req, httplib::Response& res) { handle_stored_response(req, res, false); }));
  install_model_routes(*svr_, ctx_);
  install_tokenize_routes(*svr_, ctx_, opts_.max_body_bytes, opts_.http_read_timeout_s);  // the router has the tokenizer and the template
  svr_->Get("/health", safe_handler([this](const httplib::Request&, httplib::Response& res) {
              json backends = json::array();
              bool any = false;
              for (Pool* p : {serve_.get(), prefill_.get()})
                for (auto& b : p->backends) {
                  backends.push_back(json{{"url", b->url}, {"role", p->role}, {"up", b->up.load()}, {"in_flight", b->in_flight.load()}});
                  if (p == serve_.get()) any = any || b->up.load();
                }
              const bool draining = draining_.load();
              json out{{"status", draining ? "draining" : any ? "ok" : "unavailable"}, {"backends", backends}};
              if (draining) out["in_flight"] = in_flight_.load();
              write_json(res, out);
              if (!any || draining) res.status = 503;
            }));
  svr_->Get("/metrics", safe_handler([this](const httplib::Request&, httplib::Response& res) {
              res.set_content(render_metrics(), "text/plain; version=0.0.4; charset=utf-8");
            }));
}

void Router::handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  auto guard = std::make_shared<InFlight>(in_flight_);  // a stream's provider keeps it until its end
  if (draining_.load()) {
    res.set_header("Retry-After", "5");
    throw draining_error();
  }
  // Validate and tokenize exactly as the backends will: a bad request is answered here, and a
  // good one gets its prompt tokens for the affinity key.
  nlohmann::json body = parse_json_body(req.body, ctx_);
  const ApiRequest ar = chat ? parse_chat_request(body, ctx_) : parse_completion_request(body, ctx_);
  route(ar, chat ? "/v1/chat/completions" : "/v1/completions", req, res, std::move(guard), -1);
}

void Router::route(const ApiRequest& ar, const std::string& path, const httplib::Request& req, httplib::Response& res,
                   std::shared_ptr<void> guard, int32_t pinned) {
  const std::string auth = req.get_header_value("Authorization");
  // The backends' namespace is the salt, under the API key when they check one: the key (hashed)
  // keys affinity too, so tenants spread as their caches do.
  std::string ns = ar.params.cache_namespace;
  if (!auth.empty()) ns = std::to_string(XXH3_64bits(auth.data(), auth.size())) + "/" + ns;
  // A completions batch (several prompts) goes whole to one backend, the one of its first prompt:
  // its choices come back as one response, and a batch often shares its prefix.
  const std::vector<int32_t>& first = ar.prompts.at(0);
  uint64_t key = affinity_key(ns, first.data(), static_cast<int64_t>(first.size()), opts_.block_size,
                              std::max(1, opts_.affinity_tokens / opts_.block_size));
  if (opts_.routing == RouterOptions::Routing::kRoundRobin) key = round_robin_key(*serve_, rr_.fetch_add(1));
  // No decode instance up: forward answers 503 at once, without loading a prefill instance. A
  // pinned request's pages are on its backend already.
  const std::vector<bool> up = serve_->up();
  if (pinned < 0 && !prefill_->empty() && std::find(up.begin(), up.end(), true) != up.end()) {
    // A batch is prefilled whole (the prefill instance computes every prompt) when its longest
    // prompt is long enough, on the prefill instance of its first prompt.
    size_t longest = 0;
    for (const auto& p : ar.prompts) longest = std::max(longest, p.size());
    if (static_cast<int64_t>(longest) >= opts_.prefill_min_tokens) {
      const Prefilled p = prefill(key, path, req.body, auth, find_client_socket(req), &res);
      if (p == Prefilled::kRefused) return;  // its answer is the client's: decode would give the same
      if (p == Prefilled::kClientGone) {     // nobody to answer: nothing goes to decode
        res.status = 499;
        return;
      }
    } else {
      n_prefill_skipped_.fetch_add(1);
    }
  }
  // The client is watched while the backend answers (watch_loop).
  forward(*serve_, key, path, req.body, auth, ar.stream, res, std::move(guard), find_client_socket(req), pinned);
}

int32_t Router::find_stored(const std::string& id, const std::string& auth, httplib::Response* found, bool erase, const std::string& rest) {
  // Stored responses live on the instance that made them: each backend is asked in turn (a GET,
  // or the DELETE itself), the first that has it answers. Cheap next to a generation, and
  // nothing to keep in step here.
  bool unsure = false;  // a backend that is down, or did not answer, may hold it
  for (size_t k = 0; k < serve_->backends.size(); ++k) {
    Backend& b = *serve_->backends[k];
    if (!b.up.load()) {
      unsure = true;
      continue;
    }
    httplib::Client cli(b.host, b.port);
    set_timeouts(cli, opts_);
    cli.set_read_timeout(std::chrono::seconds(10));
    std::string path = "/v1/responses/";
    for (unsigned char ch : id) {  // percent-encoded but for the unreserved characters (ids are resp_<hex>)
      static const char* kHex = "0123456789ABCDEF";
      if (std::isalnum(ch) || ch == '_' || ch == '-' || ch == '.' || ch == '~') path += static_cast<char>(ch);
      else path += std::string("%") + kHex[ch >> 4] + kHex[ch & 15];
    }
    path += rest;
    auto r = erase ? cli.Delete(path, upstream_headers(auth)) : cli.Get(path, upstream_headers(auth));
    if (!r || r->status >= 500) unsure = true;
    if (!r || r->status == 404 || r->status >= 500) continue;
    if (found) {
      found->status = r->status;
      found->set_content(r->body, r->get_header_value("Content-Type", 0).empty() ? std::string("application/json") : r->get_header_value("Content-Type", 0));
    }
    return static_cast<int32_t>(k);
  }
  return unsure ? -2 : -1;
}

ApiError Router::stored_unreachable(const std::string& id, const char* param) {
  return ApiError{503, "Response with id '" + id + "' was not found on the backends that answered; one that is down may hold it. Try again later.",
                  "server_error", param, "backend_unavailable"};
}

void Router::handle_stored_response(const httplib::Request& req, httplib::Response& res, bool erase) {
  const std::string id = req.matches[1];
  // GET …/input_items: the same path below the id, and the query (limit, order, cursors) as sent
  std::string rest;
  if (const std::string p = req.path; p.size() > 12 && p.compare(p.size() - 12, 12, "/input_items") == 0) {
    rest = "/input_items";
    if (const size_t q = req.target.find('?'); q != std::string::npos) rest += req.target.substr(q);
  }
  const int32_t k = find_stored(id, req.get_header_value("Authorization"), &res, erase, rest);
  if (k == -2) {
    res.set_header("Retry-After", "5");
    throw stored_unreachable(id, "response_id");
  }
  if (k < 0)
    throw ApiError{404, "Response with id '" + id + "' not found on any backend (stored responses are kept by the instance that made them).",
                   "invalid_request_error", "response_id", "response_not_found"};
}

void Router::handle_responses(const httplib::Request& req, httplib::Response& res) {
  auto guard = std::make_shared<InFlight>(in_flight_);
  if (draining_.load()) {
    res.set_header("Retry-After", "5");
    throw draining_error();
  }
  nlohmann::json body = parse_json_body(req.body, ctx_);
  const std::string auth = req.get_header_value("Authorization");
  // A continuation goes to the instance that stored the previous response (it alone has the
  // conversation, and its prefix cache the pages); it is checked here as if that conversation were
  // empty, and there in full.
  int32_t holder = -1;
  const nlohmann::json* prev = body.contains("previous_response_id") && body["previous_response_id"].is_string() ? &body["previous_response_id"] : nullptr;
  if (prev) {
    holder = find_stored(prev->get<std::string>(), auth, nullptr, false);
    if (holder == -2) {
      res.set_header("Retry-After", "5");
      throw stored_unreachable(prev->get<std::string>(), "previous_response_id");
    }
    if (holder < 0)
      throw ApiError{404, "Previous response with id '" + prev->get<std::string>() + "' not found on any backend.", "invalid_request_error",
                     "previous_response_id", "previous_response_not_found"};
  }
  const PreviousLookup placeholder = [](const std::string&) { return std::make_shared<StoredResponse>(); };
  const ResponsesRequest rr = parse_responses_request(body, ctx_, placeholder);
  route(rr.chat, "/v1/responses", req, res, std::move(guard), holder);
}

RouteChoice Router::choose(Pool& pool, uint64_t key, const std::vector<int32_t>& tried) {
  if (opts_.routing != RouterOptions::Routing::kCacheAware)  // ring, and round-robin's keys
    return choose_backend(pool.ring, key, pool.up(), pool.load(), opts_.load_factor, tried);
  std::lock_guard<std::mutex> l(pool.map_mu);
  return pool.map->choose(pool.ring, key, pool.up(), pool.load(), opts_.load_factor, opts_.balance_abs, tried);
}

Router::Prefilled Router::prefill(uint64_t key, const std::string& path, const std::string& body, const std::string& auth, int client_fd,
                                  httplib::Response* answer) {
  // The prefill instance forces one token, one choice, no stream: the body goes as it is. The
  // client is watched meanwhile (watch_loop): one who leaves cancels it (a long document kept the
  // prefill instance busy for 20 s after its client had gone; a user test).
  std::vector<int32_t> tried;
  bool sent = false;  // to some prefill instance
  for (size_t attempt = 0; attempt < prefill_->backends.size(); ++attempt) {
    const RouteChoice c = choose(*prefill_, key, tried);
    if (c.backend < 0) break;
    sent = true;
    Backend& b = *prefill_->backends[c.backend];
    InFlight f(b.in_flight);
    b.requests.fetch_add(1);
    httplib::Client cli(b.host, b.port);
    set_timeouts(cli, opts_);
    {
      std::lock_guard<std::mutex> l(clients_mu_);
      if (aborting_.load()) break;
      clients_.push_back({&cli, false, client_fd, nullptr, false, &b, nullptr, now_ns()});  // stop(), the stall check and a client gone close it
    }
    auto r = cli.Post(path, upstream_headers(auth), body, "application/json");
    bool client_gone = false;
    {
      std::lock_guard<std::mutex> l(clients_mu_);
      auto it = std::find_if(clients_.begin(), clients_.end(), [&](const Upstream& u) { return u.cli == &cli; });
      client_gone = it->client_gone;
      clients_.erase(it);
    }
    if (client_gone) {
      n_prefill_cancelled_.fetch_add(1);
      return Prefilled::kClientGone;
    }
    if (r && r->status == 200) {
      // it ran; its pages are where decode looks only if every write reached the shared tier
      if (r->get_header_value("X-KVServe-Prefill-Stored") == "1") {
        n_prefill_ok_.fetch_add(1);
        return Prefilled::kOk;
      }
      n_prefill_not_stored_.fetch_add(1);
      return Prefilled::kNotStored;
    }
    if (!r) {  // no answer: the instance is gone; try another
      gave_no_answer(b, c.backend, tried, n_retries_);
      continue;
    }
    if (r->status >= 400 && r->status < 500 && r->status != 408 && r->status != 429) {
      // The request's own fault (a bad key, a prompt past the context): not the backend's. Decode
      // would answer the same; this answer goes to the client now.
      n_prefill_refused_.fetch_add(1);
      answer->status = r->status;
      if (r->has_header("WWW-Authenticate")) answer->set_header("WWW-Authenticate", r->get_header_value("WWW-Authenticate"));
      answer->set_content(r->body, r->get_header_value("Content-Type", 0).empty() ? std::string("application/json")
                                                                                     : r->get_header_value("Content-Type", 0));
      return Prefilled::kRefused;
    }
    if (r->status != 429) b.failures.fetch_add(1);  // full is not failed
    break;  // it could not: the decode side computes the prompt and gives the client its answer
  }
  // The decode instance computes the prompt itself: a prefill instance failed, or none was up
  // (then no backend failure is counted either: nothing was sent).
  (sent ? n_prefill_failed_ : n_prefill_no_backend_).fetch_add(1);
  return sent ? Prefilled::kFailed : Prefilled::kNoBackend;
}

// A streamed request's upstream half, on its own thread: the backend's answer goes into the pipe.
void Router::run_upstream(Backend* b, const std::string& path, const std::string& body, const std::string& auth, int client_fd, Pipe& pipe) {
  InFlight f(b->in_flight);
  httplib::Client cli(b->host, b->port);
  set_timeouts(cli, opts_);
  pipe.last_byte_ns.store(now_ns());
  {
    std::lock_guard<std::mutex> l(clients_mu_);
    clients_.push_back({&cli, true, client_fd, &pipe.cancel, false, b, &pipe.last_byte_ns, 0, false, &pipe.gone_counted});  // stop(), the stall and client checks close it
  }
  httplib::Request ureq;
  ureq.method = "POST";
  ureq.path = path;
  ureq.headers = upstream_headers(auth);
  ureq.body = body;
  ureq.set_header("Content-Type", "application/json");
  ureq.response_handler = [&](const httplib::Response& r) {
    std::lock_guard<std::mutex> l(pipe.mu);
    pipe.status = r.status;
    pipe.content_type = r.get_header_value("Content-Type", 0);
    pipe.retry_after = r.get_header_value("Retry-After", 0);
    pipe.cv.notify_all();
    return !pipe.cancel.load() && !stopping_.load();
  };
  ureq.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pipe.last_byte_ns.store(now_ns());
    std::lock_guard<std::mutex> l(pipe.mu);
    pipe.chunks.emplace_back(data, n);
    pipe.cv.notify_all();
    return !pipe.cancel.load() && !stopping_.load();
  };
  httplib::Response ures;
  httplib::Error err = httplib::Error::Success;
  const bool ok = cli.send(ureq, ures, err);
  bool stalled = false;
  {
    std::lock_guard<std::mutex> l(clients_mu_);
    auto it = std::find_if(clients_.begin(), clients_.end(), [&](const Upstream& u) { return u.cli == &cli; });
    stalled = it->stalled;
    if (it->client_gone) pipe.cancel.store(true);  // watch_loop closed it: not the backend's failure
    clients_.erase(it);
  }
  {
    std::lock_guard<std::mutex> l(pipe.mu);
    if (pipe.status < 0) pipe.status = 0;
    if (!ok && !pipe.cancel.load()) pipe.failed_midway = true;
    pipe.stalled = stalled;
    pipe.done = true;
    pipe.cv.notify_all();
  }
}

void Router::forward(Pool& pool, uint64_t key, const std::string& path, const std::string& body, const std::string& auth, bool stream,
                     httplib::Response& res, std::shared_ptr<void> in_flight, int client_fd, int32_t pinned) {
  std::vector<int32_t> tried;
  std::optional<std::pair<std::string, std::string>> full;  // a 429's body and type, if no other backend answers
  std::string full_retry_after;                             // and its Retry-After
  const size_t attempts = pinned >= 0 ? 1 : pool.backends.size();  // a pinned request has one place to go
  for (size_t attempt = 0; attempt < attempts; ++attempt) {
    RouteChoice c;
    if (pinned >= 0) c.backend = pinned, c.why = RouteChoice::Why::kOwner;
    else c = choose(pool, key, tried);
    if (c.backend < 0) break;
    if (attempt == 0) {
      if (c.why == RouteChoice::Why::kOwner) n_owner_.fetch_add(1);
      else if (c.why == RouteChoice::Why::kOwnerBusy) n_owner_busy_.fetch_add(1);
      else if (c.why == RouteChoice::Why::kNew) n_new_.fetch_add(1);
      else n_owner_down_.fetch_add(1);
    }
    Backend* b = pool.backends[c.backend].get();
    b->requests.fetch_add(1);

    if (!stream) {
      InFlight f(b->in_flight);
      httplib::Client cli(b->host, b->port);
      set_timeouts(cli, opts_);
      {
        std::lock_guard<std::mutex> l(clients_mu_);
        if (aborting_.load()) throw stopped_error();
        clients_.push_back({&cli, false, client_fd, nullptr, false, b, nullptr, now_ns()});
      }
      auto r = cli.Post(path, upstream_headers(auth), body, "application/json");
      bool client_gone = false;
      {
        std::lock_guard<std::mutex> l(clients_mu_);
        auto it = std::find_if(clients_.begin(), clients_.end(), [&](const Upstream& u) { return u.cli == &cli; });
        client_gone = it->client_gone;
        clients_.erase(it);
      }
      if (aborting_.load()) throw stopped_error();
      if (client_gone) {  // nobody to answer, and the backend has cancelled the request
        res.status = 499;
        return;
      }
      if (!r) {
        gave_no_answer(*b, c.backend, tried, n_retries_);
        continue;
      }
      if (refused(*b, r->status) && attempt + 1 < attempts) {  // another replica may take it
        tried.push_back(c.backend), n_retries_.fetch_add(1);
        if (r->status == 429) n_full_.fetch_add(1);
        full.emplace(r->body, r->get_header_value("Content-Type", 0));
        full_retry_after = r->get_header_value("Retry-After", 0);
        continue;
      }
      res.status = r->status;
      if (r->has_header("Retry-After")) res.set_header("Retry-After", r->get_header_value("Retry-After"));
      const std::string ct = r->get_header_value("Content-Type", 0);
      res.set_content(r->body, ct.empty() ? std::string("application/json") : ct);
      return;
    }

    // Streamed: the upstream request runs on its own thread and hands chunks over; the client's
    // status is the backend's, known before the first byte goes out.
    auto pipe = std::make_shared<Pipe>();
    upstreams_.fetch_add(1);
    std::thread([this, pipe, b, path, body, auth, client_fd] {
      run_upstream(b, path, body, auth, client_fd, *pipe);
      upstreams_.fetch_sub(1);  // the last touch of the router: its destructor waits for this
    }).detach();

    std::unique_lock<std::mutex> l(pipe->mu);
    pipe->cv.wait(l, [&] { return pipe->status >= 0; });
    if (pipe->status == 0 && pipe->cancel.load()) {  // the client left first (watch_loop): nobody to answer
      res.status = 499;
      return;
    }
    if (pipe->status == 0) {  // nothing came back: the backend is gone; nothing was sent yet
      l.unlock();
      gave_no_answer(*b, c.backend, tried, n_retries_);
      continue;
    }
    if (refused(*b, pipe->status) && attempt + 1 < attempts) {  // nothing was sent yet: try another
      pipe->cv.wait(l, [&] { return pipe->done; });
      std::string out;
      for (auto& ch : pipe->chunks) out += ch;
      full.emplace(std::move(out), pipe->content_type);
      full_retry_after = pipe->retry_after;
      l.unlock();
      tried.push_back(c.backend), n_retries_.fetch_add(1);
      if (pipe->status == 429) n_full_.fetch_add(1);
      continue;
    }
    if (pipe->status != 200) {  // an error answer: whole, with its status
      pipe->cv.wait(l, [&] { return pipe->done; });
      std::string out;
      for (auto& ch : pipe->chunks) out += ch;
      res.status = pipe->status;
      // The backend's own Retry-After (a draining server says how long), else 1 s for a retryable status.
      if (!pipe->retry_after.empty()) res.set_header("Retry-After", pipe->retry_after);
      else if (pipe->status == 429 || pipe->status == 503) res.set_header("Retry-After", "1");
      res.set_content(out, pipe->content_type.empty() ? std::string("application/json") : pipe->content_type);
      return;
    }
    const std::string ctype = pipe->content_type.empty() ? "text/event-stream" : pipe->content_type;
    l.unlock();
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        ctype,
        [this, pipe, b](size_t, httplib::DataSink& sink) -> bool {
          std::unique_lock<std::mutex> l(pipe->mu);
          pipe->cv.wait_for(l, std::chrono::milliseconds(50), [&] { return pipe->done || !pipe->chunks.empty(); });
          if (aborting_.load() && !pipe->done) {  // the drain timed out: say so, end the stream, cancel upstream
            pipe->cancel.store(true);
            const std::string e = sse_event(stopped_error().to_json()) + "data: [DONE]\n\n";
            sink.write(e.data(), e.size());
            sink.done();
            return true;
          }
          while (!pipe->chunks.empty()) {
            std::string ch = std::move(pipe->chunks.front());
            pipe->chunks.pop_front();
            if (stopping_.load() || !sink.write(ch.data(), ch.size())) {
              if (!stopping_.load() && !pipe->gone_counted.exchange(true)) n_client_gone_.fetch_add(1);  // the client left mid-stream
              pipe->cancel.store(true);
              return false;
            }
          }
          if (pipe->done) {
            if (pipe->failed_midway) {  // the backend died mid-answer: say so, the client cannot tell otherwise
              b->failures.fetch_add(1);
              const std::string why = pipe->stalled ? " stopped answering (down and silent for " + seconds_text(opts_.stall_timeout_s) + ")"
                                                    : " failed";
              const std::string e = sse_event(ApiError{502, "The backend " + b->url + why + " during the response.", "server_error", "", "bad_gateway"}.to_json()) +
                                    "data: [DONE]\n\n";  // the stream ends as the server's own error streams do
              sink.write(e.data(), e.size());
            }
            sink.done();
          }
          return true;
        },
        [this, pipe, in_flight](bool) {
          // Under clients_mu_: watch_loop peeks at the client's socket under it while the stream is
          // not ended, and httplib closes that socket once this returns (TSan saw the close race
          // the peek, and a reused descriptor could have been peeked).
          std::lock_guard<std::mutex> l(clients_mu_);
          pipe->cancel.store(true);
          (void)in_flight;  // held until the response ends
        });
    return;
  }
  if (full) {  // the others were down: the full backend's own answer
    res.status = 429;
    res.set_header("Retry-After", full_retry_after.empty() ? std::string("1") : full_retry_after);
    res.set_content(full->first, full->second.empty() ? std::string("application/json") : full->second);
    return;
  }
  n_unavailable_.fetch_add(1);
  res.set_header("Retry-After", "1");
  throw unavailable(pool.role);
}

std::string Router::render_metrics() const {
  std::string out;
  auto line = [&](const std::string& name, const std::string& labels, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    out += "kvserve:" + name + (labels.empty() ? "" : "{" + labels + "}") + " " + buf + "\n";
  };
  auto help = [&](const char* name, const char* type, const char* text) {
    out += std::string("# HELP kvserve:") + name + " " + text + "\n# TYPE kvserve:" + name + " " + type + "\n";
  };
  help("router_requests_total", "counter", "Requests sent to each backend (retries and prefills included).");
  for (const Pool* p : {serve_.get(), prefill_.get()})
    for (const auto& b : p->backends) line("router_requests_total", "backend=\"" + b->url + "\",role=\"" + p->role + "\"", double(b->requests.load()));
  help("router_backend_failures_total", "counter", "Requests a backend did not answer, or answered with an error (prefill).");
  for (const Pool* p : {serve_.get(), prefill_.get()})
    for (const auto& b : p->backends)
      line("router_backend_failures_total", "backend=\"" + b->url + "\",role=\"" + p->role + "\"", double(b->failures.load()));
  help("router_backend_up", "gauge", "1 while the backend answers its health check.");
  for (const Pool* p : {serve_.get(), prefill_.get()})
    for (const auto& b : p->backends) line("router_backend_up", "backend=\"" + b->url + "\",role=\"" + p->role + "\"", b->up.load() ? 1 : 0);
  help("router_in_flight", "gauge", "Requests in flight per backend.");
  for (const Pool* p : {serve_.get(), prefill_.get()})
    for (const auto& b : p->backends) line("router_in_flight", "backend=\"" + b->url + "\",role=\"" + p->role + "\"", b->in_flight.load());
  help("router_affinity_total", "counter",
       "Where requests went: owner = the backend that has its prefix (an affinity hit); new = a prefix not seen before (cache-aware "
       "routing: the least loaded backend); owner_down / owner_busy = elsewhere.");
  line("router_affinity_total", "result=\"owner\"", double(n_owner_.load()));
  line("router_affinity_total", "result=\"new\"", double(n_new_.load()));
  line("router_affinity_total", "result=\"owner_down\"", double(n_owner_down_.load()));
  line("router_affinity_total", "result=\"owner_busy\"", double(n_owner_busy_.load()));
  help("router_retries_total", "counter", "Requests sent again to another backend after one did not answer or refused them (429 full, 503 draining).");
  line("router_retries_total", "", double(n_retries_.load()));
  help("router_client_disconnects_total", "counter",
       "Requests whose client left before the answer ended: their upstream request was closed (the backend cancels it).");
  line("router_client_disconnects_total", "", double(n_client_gone_.load()));
  help("router_stalled_total", "counter",
       "Requests left because their backend failed its health checks and sent nothing for --stall-timeout (non-streamed ones are "
       "retried elsewhere; streams end with an error event).");
  line("router_stalled_total", "", double(n_stalled_.load()));
  help("router_backend_full_total", "counter", "Requests a backend refused with 429 (its queue full) that went to another backend.");
  line("router_backend_full_total", "", double(n_full_.load()));
  help("router_unavailable_total", "counter", "Requests answered 503: no backend up.");
  line("router_unavailable_total", "", double(n_unavailable_.load()));
  help("router_prefills_total", "counter",
       "Prefill/decode: ok = prefilled remotely, its pages in the shared tier; not_stored = prefilled, but some pages did not reach "
       "the shared tier (decode computes them); failed = a prefill instance failed or was full and the decode instance computed the "
       "prompt; refused = the prefill instance answered 4xx (the request's fault), its answer went to the client; cancelled = the "
       "client left during the prefill; no_backend = no prefill instance was up, the decode instance computed it; skipped = prompt too short.");
  line("router_prefills_total", "result=\"ok\"", double(n_prefill_ok_.load()));
  line("router_prefills_total", "result=\"not_stored\"", double(n_prefill_not_stored_.load()));
  line("router_prefills_total", "result=\"refused\"", double(n_prefill_refused_.load()));
  line("router_prefills_total", "result=\"cancelled\"", double(n_prefill_cancelled_.load()));
  line("router_prefills_total", "result=\"failed\"", double(n_prefill_failed_.load()));
  line("router_prefills_total", "result=\"skipped\"", double(n_prefill_skipped_.load()));
  line("router_prefills_total", "result=\"no_backend\"", double(n_prefill_no_backend_.load()));
  return out;
}

}  // namespace kv
