// HTTP plumbing shared by the server (http_server.h) and the router (router/router.h): JSON
// answers, OpenAI-shaped errors for what cpp-httplib answers itself, the listen backlog.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kv {

struct ApiContext;

void write_error(httplib::Response& res, const ApiError& e);
void write_json(httplib::Response& res, const nlohmann::ordered_json& j);

// Statuses httplib produces itself (no route, body too large, unparsable HTTP) and exceptions
// that escape a handler get an OpenAI-shaped JSON body.
void install_json_errors(httplib::Server& svr, size_t max_body_bytes);

// CORS, for web pages served from another origin (vLLM's --allowed-origins; vLLM and llama-server
// allow any by default). `origins`: exact origins ("http://localhost:3000") or "*"; empty: none.
// install_cors adds Access-Control-Allow-Origin (with Vary: Origin) to every response to an allowed
// origin; cors_preflight answers a browser's OPTIONS preflight (204, the methods and headers it may
// use) and returns true, before any key is checked: a preflight never carries the key.
void install_cors(httplib::Server& svr, std::vector<std::string> origins);
// Empty when `origin` is one the comparison above can ever match: "*", or an origin as a browser
// sends it in its Origin header (scheme://host[:port]: http or https, lower case, no path, no
// trailing slash, no default port); else why not, in one line (--allowed-origins is refused at start).
std::string origin_problem(const std::string& origin);
bool cors_preflight(const httplib::Request& req, httplib::Response& res, const std::vector<std::string>& origins);

// Wraps a handler: ApiError → its status; any other exception → 500. Nothing escapes.
std::function<void(const httplib::Request&, httplib::Response&)> safe_handler(
    std::function<void(const httplib::Request&, httplib::Response&)> fn);

// A POST route (wrapped by safe_handler) whose handler finds the body in req.body, read here
// and never more than max_body_bytes of it as decoded. cpp-httplib 0.11 checks its payload
// limit only against a Content-Length: a chunked body, or a gzip / deflate one that inflates
// past the limit, was read whole into memory (a 400 KB gzip request became 400 MiB). Over the
// limit: 413 payload_too_large (the same answer as a Content-Length over it), and the
// response asks the client to close the connection. A body that cannot be read (a broken
// chunked encoding, a corrupt gzip stream): 400.
// A body still arriving body_timeout_s after its headers (a client trickling it a byte at a time
// holds a connection thread meanwhile): 408 request_timeout, and the connection is closed.
// body_timeout_s <= 0: no limit.
void post_with_body_limit(httplib::Server& svr, const std::string& pattern, size_t max_body_bytes,
                          std::function<void(const httplib::Request&, httplib::Response&)> fn, double body_timeout_s = 30);
ApiError payload_too_large(size_t max_body_bytes);

// A known path asked with another method (`allowed`: path → its method; /v1/models/{id} counts
// as /v1/models): 405 with Allow and an OpenAI-shaped body, and true. HEAD passes for GET.
bool refuse_wrong_method(const httplib::Request& req, httplib::Response& res, const std::map<std::string, std::string>& allowed);

// API keys (--api-key): true when keys is empty or the request's "Authorization: Bearer <key>"
// (the scheme in any case) is one of them, compared in constant time. Otherwise
// refuse_unauthorized writes OpenAI's 401 (its "didn't provide" message when there is no Bearer
// key at all) with WWW-Authenticate.
bool authorized(const httplib::Request& req, const std::vector<std::string>& keys);
// The credentials of an "Authorization: Bearer <key>" header; the scheme's case does not matter
// (RFC 7235), spaces after it do not either. Empty: no key in that form.
std::string bearer_key(const httplib::Request& req);
void refuse_unauthorized(const httplib::Request& req, httplib::Response& res);

// GET /v1/models and GET /v1/models/{id} for the served model (its names: ctx.model_names), as
// the server and the router answer them.
void install_model_routes(httplib::Server& svr, const ApiContext& ctx);

// POST /tokenize and POST /detokenize (vLLM's and llama-server's shapes: both field names in,
// both out; special tokens rendered as both do), as the server and the router answer them.
void install_tokenize_routes(httplib::Server& svr, const ApiContext& ctx, size_t max_body_bytes, double body_timeout_s = 30);

// Debian's cpp-httplib (0.11, compiled into its .so) listens with a backlog of 5: 64 clients
// connecting at once overflow it. Raises the backlog of this process's socket bound to `port`.
void raise_listen_backlog(int port);

// Binds like bind_to_port, but never shares the port: cpp-httplib's default socket options set
// SO_REUSEPORT on Linux, with which a second server on a busy port starts and takes a share of
// its connections. SO_REUSEADDR alone still allows a restart over TIME_WAIT. Raises the backlog.
bool bind_exclusive(httplib::Server& svr, const std::string& host, int port);
// Empty when host:port could be listened on now (a probe bind, closed at once), else why not:
// checked before the weights load, so a taken port is said at once, not after the load.
std::string listen_problem(const std::string& host, int port);

// The socket of the connection `req` arrived on (its peer and local address), or -1. cpp-httplib
// 0.11 gives a handler no way to see that its client left while the response is not being
// written (a non-streamed request); the handler watches the socket itself with peer_closed.
// Looks through this process's open descriptors (/proc/self/fd): call once per request.
int find_client_socket(const httplib::Request& req);
// True when the peer closed or reset the connection (a read would return end-of-file or an
// error); data waiting to be read (a pipelined request) is not a close. Never blocks.
bool peer_closed(int fd);

int64_t unix_now();

// Closes connections that hold a connection thread without a request in progress. cpp-httplib
// 0.11 times out each read (5 s), not a request: a client sending its request line and headers
// a byte every few seconds held its thread for as long as it liked, and ~80 of them took every
// thread, /health's included. A connection to `port` with no request begun (its headers read)
// for limit_s since it opened or since its last response ended is shut down; one inside a
// request (its body being read, with post_with_body_limit's own deadline, or its answer being
// computed or streamed) is never touched. Nor is one whose complete request headers wait unread
// in its socket (peeked): it waits for a free connection thread, it is not slow; it was shut
// down unanswered while every thread was busy. Such waits are logged (once a minute at most). An idle kept-alive connection is closed by httplib
// after 5 s first. begin and end come from the server's pre-routing handler and logger (httplib
// calls both for every routed request, the logger once its response is written); connections
// are matched to requests by their peer address. Looks once a second.
class ConnectionWatchdog {
 public:
  ConnectionWatchdog(int port, double limit_s);
  ~ConnectionWatchdog();
  void begin(const httplib::Request& req);
  void end(const httplib::Request& req);
  int64_t n_closed() const { return closed_.load(); }

 private:
  using Peer = std::pair<std::string, int>;
  struct Conn {
    int active = 0;  // requests begun and not ended
    std::chrono::steady_clock::time_point since;  // opened (first seen), or its last response ended
    bool seen = false;
  };
  void loop();
  void check();
  const int port_;
  const double limit_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<Peer, Conn> conns_;
  std::atomic<int64_t> closed_{0};
  int64_t told_ = 0;
  std::chrono::steady_clock::time_point told_waiting_at_{};
  std::chrono::steady_clock::time_point told_at_{};
  std::thread thread_;
};

}  // namespace kv
