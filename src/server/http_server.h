// The OpenAI-compatible HTTP front end over one Engine (cpp-httplib, one thread per
// connection from a fixed pool).
//
//   POST /v1/completions        POST /v1/chat/completions     (JSON, or SSE with "stream")
//   GET  /v1/models             GET  /health                  GET /metrics (Prometheus text)
//   GET  /debug/kv              only with ServerOptions::debug: pool pages and integrity
//   GET  /                      the chat page (web/chat.html)
//   GET  /dashboard             the KV dashboard (web/dashboard.html)
//   GET  /dashboard/events      its SSE feed (server/dashboard.h): at most max_dashboard_clients at
//                               once (429 beyond), each a snapshot at most every 250 ms
//   POST /tokenize              POST /detokenize
//   POST /v1/responses          OpenAI's Responses API over the chat path (server/responses_api.h)
//   GET  /v1/responses/{id}     DELETE /v1/responses/{id}: stored responses (server/response_store.h),
//                               each visible only to the API key that made it
//
// Every error is an OpenAI-shaped JSON body with a 4xx/5xx status; no exception escapes a
// handler. A streaming client that goes away cancels its request, so the engine frees its
// pages within one step.
//
// Shutdown (docs/ARCHITECTURE.md §4): drain() stops admitting (new generation requests get 503
// with Retry-After, /health answers 503 "draining"), waits up to a timeout for the requests in
// flight to finish, then stop() ends what is left: a stream gets its choices' finish chunks
// (finish_reason "abort"), an error event and [DONE]; a non-streamed request a 503.
// A client that disconnects cancels its request within one poll (50 ms), streamed or not; a
// request past --request-timeout is cancelled and answered 504 (a stream: finish "abort", the
// error event, [DONE]).
//
// Threading: construct, bind(), then run() on one thread; drain() and stop() from any thread
// (a signal watcher); run() returns after in-flight handlers end. The Engine must be started
// and outlive the server.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/openai_request.h"
#include "server/openai_response.h"
#include "server/response_store.h"

namespace kv {
class ConnectionWatchdog;  // server/http_util.h
}  // namespace kv

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace kv {

class Engine;
class RequestGroup;  // the engine requests of one HTTP request (http_server.cpp)
class SseWriter;     // one streamed response's wire format (sse_writers.h)

// What an instance does in prefill/decode disaggregation (docs/disaggregation.md).
//   both:    everything (one instance, or a replica behind the router)
//   prefill: computes prompts and answers with one token, after the prompt's full pages are in
//            the shared KV tier (write-through); the router then sends the request to a decode
//            instance, which finds those pages as a prefix hit
//   decode:  serves everything as `both` does; the role says the router sends it prefilled
//            requests (and it loads their pages from the shared tier)
enum class ServerRole { kBoth, kPrefill, kDecode };
const char* role_name(ServerRole r);

struct ServerOptions {
  // Keys accepted as Bearer tokens; empty: no auth. Each key is a tenant: its requests' prefix
  // cache namespace starts with tenant_prefix(key), and its dashboard shows only those by name.
  std::vector<std::string> api_keys;
  ServerRole role = ServerRole::kBoth;
  double prefill_write_timeout_s = 10;    // prefill role: longest wait for the pages to be stored
  size_t max_body_bytes = size_t(8) << 20;
  // Seconds a client may take to send a request's line and headers (from its connection's
  // opening or its last response), and then its body; slower ones are closed
  // (ConnectionWatchdog, post_with_body_limit). 0: no limit.
  double http_read_timeout_s = 30;
  bool debug = false;                     // /debug/kv and one log line per request
  int32_t http_threads = 0;               // 0: max_num_seqs + 16
  double request_timeout_s = 0;           // > 0: a generation request running longer is cancelled (504)
  // /dashboard/events streams at once (each holds an HTTP thread). With API keys each tenant gets
  // an equal share, at least one: max(1, this / keys), so no tenant can lock out the others.
  int32_t max_dashboard_clients = 8;
  std::vector<std::string> allowed_origins = {"*"};  // CORS (http_util.h install_cors); empty: none
  // Finished Responses API responses kept in memory (LRU) for GET, DELETE and previous_response_id;
  // 0 keeps none (store is then answered false, previous_response_id refused).
  size_t max_stored_responses = 1000;
  size_t stored_responses_bytes = size_t(256) << 20;  // and at most this much of their JSON
};

class HttpServer {
 public:
  // ctx: tokenizer, chat template, model names and limits (see openai_request.h).
  HttpServer(Engine& engine, ApiContext ctx, ServerOptions opts);
  ~HttpServer();

  bool bind(const std::string& host, int port);  // false: the address is taken or invalid
  void run();                                     // serves until stop()
  // Stops admitting, then waits until no generation request is in flight or timeout_s passed;
  // true if none is left. Any thread.
  bool drain(double timeout_s);
  void stop();                                    // any thread
  int32_t in_flight() const { return in_flight_.load(); }

 private:
  void routes();
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat);
  void handle_responses(const httplib::Request& req, httplib::Response& res);
  void handle_input_items(const httplib::Request& req, httplib::Response& res);
  ApiError response_not_found(const std::string& id) const;
  // Prefill role: waits for the prompt's tier writes, then X-KVServe-Prefill-Stored 1 or 0.
  void say_prefill_stored(httplib::Response& res, uint64_t lost_before);
  void handle_stored_response(const httplib::Request& req, httplib::Response& res, bool erase);
  // The generation machinery both APIs share. submit: the request's prompts into the engine
  // (under the caller's cache namespace); throws the rejection. collect: waits for every choice
  // (false: the client left; throws an error event, or the server's end of it); stream_sse: the
  // choices' events through a writer as Server-Sent Events (owns cancellation and the in-flight
  // count from then on).
  std::shared_ptr<RequestGroup> submit(ApiRequest& ar, const httplib::Request& req, httplib::Response& res, bool chat);
  bool collect(const httplib::Request& req, RequestGroup& group, std::chrono::steady_clock::time_point deadline, bool chat,
               int32_t n_per_prompt, std::vector<ChoiceResult>* choices, std::vector<PromptResult>* prompts);
  bool collect_or_retry_after(const httplib::Request& req, httplib::Response& res, RequestGroup& group,
                              std::chrono::steady_clock::time_point deadline, bool chat, int32_t n_per_prompt,
                              std::vector<ChoiceResult>* choices, std::vector<PromptResult>* prompts);
  void stream_sse(httplib::Response& res, std::shared_ptr<RequestGroup> group, std::unique_ptr<SseWriter> writer,
                  std::chrono::steady_clock::time_point deadline);
  std::chrono::steady_clock::time_point request_deadline() const;
  std::string tenant_of(const httplib::Request& req) const;  // tenant_prefix of the request's key; "" without keys
  void handle_debug_kv(httplib::Response& res);
  void handle_dashboard_events(const httplib::Request& req, httplib::Response& res);
  bool authorized(const httplib::Request& req) const;
  bool wait_idle(double timeout_s) const;  // until no generation request is in flight; true if none
  // Why the server ends a running request now (shutting down: 503; past its deadline: 504), if it does.
  std::optional<ApiError> why_end(std::chrono::steady_clock::time_point deadline) const;

  Engine& engine_;
  ApiContext ctx_;
  ServerOptions opts_;
  std::unique_ptr<httplib::Server> svr_;
  std::unique_ptr<ConnectionWatchdog> watchdog_;  // from bind on
  ResponseStore store_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> in_flight_{0};  // generation requests admitted and not yet answered
  int32_t dashboards_per_tenant() const;
  std::mutex dashboards_mu_;
  std::unordered_map<std::string, int32_t> dashboards_;  // /dashboard/events streams open, per tenant prefix ("" without keys)
};

}  // namespace kv
