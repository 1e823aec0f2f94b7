// kvserve router: one OpenAI-compatible front over several kvserve instances
// (docs/disaggregation.md).
//
//   replicas:  each request goes to the replica that holds its prefix: the router tokenizes the
//              prompt (the model's own tokenizer and chat template, the same parser as the
//              server) and keys it on its first full KV pages (affinity.h). Cache-aware routing
//              (the default) sends a new key to the least loaded replica and remembers it;
//              `ring` routing puts keys on a consistent-hash ring instead (no state: routers
//              behind a load balancer agree). A replica that is down or far busier than the
//              others loses the request to another.
//   prefill + decode: a prompt of at least prefill_min_tokens goes first to a prefill instance
//              (`serve --role prefill`), which stores its pages in the shared KV tier and
//              answers one token; then the unchanged request goes to a decode instance, which
//              finds those pages as a prefix hit and streams the answer. A prefill that fails
//              costs nothing but time: the decode instance computes the prompt itself.
//
// Requests are validated here first (400s come from the router, in the server's words);
// everything else, streaming included, passes through. Backends are health-checked
// (GET /health) every health_interval_s; a connection that fails marks its backend down at
// once, and the request is retried on another backend while nothing has been sent to the
// client. With no backend up the router answers 503 with Retry-After.
//
// Shutdown (as the server's): drain() stops admitting (generation requests get 503 with
// Retry-After, /health answers 503 "draining"), waits up to a timeout for the requests in flight,
// then ends what is left: a stream gets an error event and [DONE], a non-streamed request a 503
// (its upstream connection is closed, which cancels it on the backend); stop() after it.
//
// Threading: construct, bind(), run() on one thread; drain() and stop() from any thread. Each
// streamed request has one upstream thread; the destructor waits for them.
#pragma once
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "router/affinity.h"
#include "server/openai_request.h"

namespace kv {
class ConnectionWatchdog;  // server/http_util.h
}  // namespace kv

namespace httplib {
class Client;
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kv {

struct RouterOptions {
  std::vector<std::string> replicas;  // http://HOST:PORT each
  std::vector<std::string> allowed_origins = {"*"};  // CORS, as the server's (http_util.h)
  std::vector<std::string> prefill;   // P/D: prefill instances ...
  std::vector<std::string> decode;    // ... and decode instances (replicas must then be empty)
  int32_t block_size = 16;            // the backends' KV page size
  int32_t affinity_tokens = 128;      // prompt tokens (whole pages) that make the affinity key
  double load_factor = 1.25;          // bounded loads: a backend takes at most this × the average in flight
  int32_t balance_abs = 8;            // cache-aware: ... and the owner of a prefix keeps it until it is this many requests ahead of the least loaded
  int32_t prefill_min_tokens = 64;    // shorter prompts go straight to a decode instance
  enum class Routing { kCacheAware, kRing, kRoundRobin };
  Routing routing = Routing::kCacheAware;  // round-robin ignores prefixes (a baseline)
  double health_interval_s = 1.0;
  double connect_timeout_s = 2.0;
  double read_timeout_s = 600.0;      // longest silence from a backend mid-request
  double stall_timeout_s = 10.0;      // ... once its health check fails: down and silent this long, it is left (0: never)
  std::vector<std::string> api_keys;  // --api-key: checked here before anything else (the backends check theirs)
  int32_t http_threads = 1024;       // a request holds one until answered (the backends queue behind theirs)
  size_t max_body_bytes = size_t(8) << 20;
  double http_read_timeout_s = 30;  // as ServerOptions::http_read_timeout_s
};

// "http://HOST:PORT" or "HOST:PORT" → host and port; an error names what is wrong.
Result<std::pair<std::string, int>> parse_backend_url(const std::string& url);

class Router {
 public:
  // ctx: tokenizer, chat template, model names and limits, as the server's.
  static Result<std::unique_ptr<Router>> create(RouterOptions opts, ApiContext ctx);
  ~Router();

  bool bind(const std::string& host, int port);
  void run();   // serves until stop()
  void stop();  // any thread
  // Stops admitting, waits up to timeout_s for in-flight requests, ends the rest; true if none
  // was left to end. Call stop() after it.
  bool drain(double timeout_s);
  int32_t in_flight() const { return in_flight_.load(); }

  struct Backend;
  struct Pool;
  struct Pipe;

 private:
  Router(RouterOptions opts, ApiContext ctx);
  void routes();
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat);
  // P/D: the prompt computed on a prefill instance first. kRefused: it answered 4xx (the request's
  // own fault: a bad key, a prompt past the context), and that answer is in *answer for the client.
  // kClientGone: the client left while it ran (it was cancelled there).
  enum class Prefilled { kOk, kNotStored, kFailed, kNoBackend, kRefused, kClientGone };
  Prefilled prefill(uint64_t key, const std::string& path, const std::string& body, const std::string& auth, int client_fd,
                    httplib::Response* answer);
  // A parsed request's way to a backend: its affinity key (namespace, first prompt), the prefill
  // instance when long enough (not for a pinned one), then forward.
  void route(const ApiRequest& ar, const std::string& path, const httplib::Request& req, httplib::Response& res,
             std::shared_ptr<void> guard, int32_t pinned);
  // pinned ≥ 0: that backend alone (a continuation of a response it stored), no retry elsewhere.
  void forward(Pool& pool, uint64_t key, const std::string& path, const std::string& body, const std::string& auth, bool stream,
               httplib::Response& res, std::shared_ptr<void> in_flight, int client_fd, int32_t pinned = -1);
  // The Responses API: POST forwarded as chat is (a previous_response_id pinned to the backend that
  // stored it); GET / DELETE /v1/responses/{id} asked of each backend until one has it.
  void handle_responses(const httplib::Request& req, httplib::Response& res);
  void handle_stored_response(const httplib::Request& req, httplib::Response& res, bool erase);
  // The serving backend that holds stored response `id` for this key (its answer to the GET or
  // DELETE copied into *found), or -1.
  // The backend that holds it; -1 none has it, -2 none that answered has it but one that is down
  // or failed may (stored_unreachable: a 503, not the 404 of an unknown id).
  // rest: what follows the id in the path (with its query), e.g. "/input_items?limit=5".
  int32_t find_stored(const std::string& id, const std::string& auth, httplib::Response* found, bool erase, const std::string& rest = "");
  static ApiError stored_unreachable(const std::string& id, const char* param);
  void run_upstream(Backend* b, const std::string& path, const std::string& body, const std::string& auth, int client_fd, Pipe& pipe);
  std::string render_metrics() const;
  static uint64_t round_robin_key(const Pool& pool, uint64_t turn);
  RouteChoice choose(Pool& pool, uint64_t key, const std::vector<int32_t>& tried);
  void health_loop();

  RouterOptions opts_;
  ApiContext ctx_;
  std::unique_ptr<Pool> serve_;    // replicas, or decode instances
  std::unique_ptr<Pool> prefill_;  // empty unless P/D
  std::unique_ptr<httplib::Server> svr_;
  std::unique_ptr<ConnectionWatchdog> watchdog_;  // from bind on
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};  // no new requests
  std::atomic<bool> aborting_{false};  // drain timed out: end what is in flight
  std::atomic<int32_t> in_flight_{0};  // client requests not yet answered (streams until their end)
  // Upstream requests in progress: drain's abort and stop() close them; a non-streamed one is
  // closed too when its client leaves (client_fd, watched by watch_loop), so the backend cancels.
  struct Upstream {
    httplib::Client* cli;
    bool streamed;
    int client_fd = -1;        // the client's connection, -1: not watched
    const std::atomic<bool>* ended = nullptr;  // streams: the pipe's cancel (the client's side is over: its fd may be reused)
    bool client_gone = false;  // watch_loop closed the upstream request because the client left
    Backend* backend = nullptr;
    const std::atomic<int64_t>* last_byte_ns = nullptr;  // streams: the pipe's; else the start counts
    int64_t started_ns = 0;
    bool stalled = false;  // watch_loop closed it: the backend is down and has been silent (--stall-timeout)
    std::atomic<bool>* gone_counted = nullptr;  // streams: the pipe's (its client is counted gone once)
  };
  std::mutex clients_mu_;
  std::vector<Upstream> clients_;
  void watch_loop();
  std::thread health_, watch_;
  std::mutex health_mu_;
  std::condition_variable health_cv_;
  std::atomic<int32_t> upstreams_{0};  // streamed requests' upstream threads alive
  std::atomic<uint64_t> rr_{0};        // round-robin turn

  // Counters for /metrics.
  std::atomic<uint64_t> n_owner_{0}, n_owner_down_{0}, n_owner_busy_{0}, n_new_{0};
  std::atomic<uint64_t> n_retries_{0}, n_unavailable_{0}, n_client_gone_{0}, n_stalled_{0}, n_full_{0};
  std::atomic<uint64_t> n_prefill_ok_{0}, n_prefill_failed_{0}, n_prefill_skipped_{0}, n_prefill_no_backend_{0}, n_prefill_not_stored_{0},
      n_prefill_refused_{0}, n_prefill_cancelled_{0};
};

}  // namespace kv
