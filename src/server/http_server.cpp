#include "server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string_view>
#include <thread>

#include "engine/engine.h"
#include "engine/metrics.h"
#include "server/api_error.h"
#include "server/dashboard.h"
#include "server/http_util.h"
#include "server/openai_response.h"
#include "server/response_store.h"
#include "server/responses_api.h"
#include "server/sse_writers.h"
#include "web_assets.h"

namespace kv {

using json = nlohmann::ordered_json;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(50);

// Counts a generation request in flight until its answer is done (drain waits for zero).
struct InFlight {
  std::atomic<int32_t>* n;
  bool armed = true;
  explicit InFlight(std::atomic<int32_t>* count) : n(count) { n->fetch_add(1); }
  InFlight(const InFlight&) = delete;
  ~InFlight() {
    if (armed) n->fetch_sub(1);
  }
};

ApiError draining_error() {
  return ApiError{503, "The server is shutting down and takes no new requests; retry on another instance or later.", "server_error",
                  "", "server_shutting_down"};
}

ApiError stopped_error() {
  return ApiError{503, "The server shut down before this request finished; it was cancelled.", "server_error", "",
                  "server_shutting_down"};
}

ApiError timeout_error(double limit_s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", limit_s);
  return ApiError{504, std::string("The request ran longer than this server's limit of ") + buf + " s (--request-timeout); it was cancelled.",
                  "server_error", "", "request_timeout"};
}

constexpr const char* kRetryAfterSeconds = "5";

// The cancel reason of why_end's error: its 504 is the deadline, its 503 the shutdown.
CancelReason end_reason(const ApiError& e) { return e.status == 504 ? CancelReason::kTimeout : CancelReason::kShutdown; }

// parse(): a request parsed; a refusal the parser makes at admission (ApiError::too_long) is
// counted in the engine's rejections, as the ones Engine::submit makes.
template <class Parse>
auto counting_refusals(Engine& engine, Parse&& parse) {
  try {
    return parse();
  } catch (const ApiError& e) {
    if (e.too_long) engine.count_rejection();
    throw;
  }
}

}  // namespace

// The engine requests of one HTTP request: one per prompt (completions' batch form has
// several), each of n choices. Events come out with the response's choice index,
// prompt * n + choice, as OpenAI and vLLM number a batch's choices.
class RequestGroup {
 public:
  RequestGroup(std::vector<std::shared_ptr<RequestStream>> streams, int32_t n) : streams_(std::move(streams)), n_(n), done_(streams_.size()) {
    if (streams_.size() > 1) {
      waiter_ = std::make_shared<StreamWaiter>();
      for (size_t k = 0; k < streams_.size(); ++k) streams_[k]->set_waiter(waiter_, k);  // before submit
    }
  }
  int32_t n_choices() const { return static_cast<int32_t>(streams_.size()) * n_; }

  // Waits up to `timeout` for events; appends them (choice indices as above; an index out of
  // range becomes -1) to out. Returns false once every request is done.
  bool pop(std::vector<StreamEvent>* out, std::chrono::milliseconds timeout) {
    if (streams_.size() == 1) return streams_[0]->pop(out, timeout);
    // Wait for news from any stream, then take every stream's events: a push after a stream was
    // read leaves its key in the waiter, so the next wait returns at once and nothing is missed.
    ready_.clear();
    waiter_->wait(&ready_, timeout);
    bool more = false;
    for (size_t k = 0; k < streams_.size(); ++k) {
      if (done_[k]) continue;
      const size_t from = out->size();
      done_[k] = !streams_[k]->pop(out, std::chrono::milliseconds(0));
      for (size_t e = from; e < out->size(); ++e) {
        StreamEvent& ev = (*out)[e];
        ev.index = ev.index >= 0 && ev.index < n_ ? static_cast<int32_t>(k) * n_ + ev.index : -1;
      }
      more = more || !done_[k];
    }
    return more;
  }

  void cancel(CancelReason why = CancelReason::kClient) {
    for (auto& s : streams_) s->cancel(why);
  }

  // The requests' usage, summed (each prompt's tokens, every choice's completion).
  Usage usage() const {
    Usage sum;
    for (size_t k = 0; k < streams_.size(); ++k) {
      const Usage u = streams_[k]->usage();
      if (k == 0) {
        sum = u;
        continue;
      }
      sum.prompt_tokens += u.prompt_tokens;
      sum.completion_tokens += u.completion_tokens;
      sum.cached_tokens += u.cached_tokens;
      sum.kv_tokens_kept += u.kv_tokens_kept;
      sum.kv_tokens_evicted += u.kv_tokens_evicted;
      sum.kv_tokens_reindexed += u.kv_tokens_reindexed;
    }
    return sum;
  }

 private:
  std::vector<std::shared_ptr<RequestStream>> streams_;
  int32_t n_;
  std::vector<bool> done_;
  std::shared_ptr<StreamWaiter> waiter_;  // several streams only
  std::vector<uint64_t> ready_;
};

// Cancels the requests if the handler leaves early (an exception, a vanished client).
struct CancelGuard {
  std::shared_ptr<RequestGroup> group;
  bool armed = true;
  ~CancelGuard() {
    if (armed) group->cancel();
  }
};


const char* role_name(ServerRole r) {
  switch (r) {
    case ServerRole::kPrefill: return "prefill";
    case ServerRole::kDecode: return "decode";
    default: return "both";
  }
}

HttpServer::HttpServer(Engine& engine, ApiContext ctx, ServerOptions opts)
    : engine_(engine), ctx_(std::move(ctx)), opts_(std::move(opts)), svr_(std::make_unique<httplib::Server>()),
      store_(opts_.max_stored_responses, opts_.stored_responses_bytes) {
  // A thread per request the engine may hold (running or waiting in its queue: a request keeps
  // its connection's thread until answered), 8 for the rest (health, metrics, refusals), and one
  // per dashboard that may be open. With fewer, the threads ran out before the engine's queue
  // filled: --max-queue's 429 was never reached and connections past the threads waited unseen
  // (and the watchdog took them for slow clients). Beyond kMaxDefaultThreads connections wait for
  // a thread (never dropped: ConnectionWatchdog leaves a complete request alone).
  constexpr int32_t kMaxDefaultThreads = 1024;
  const auto n_keys = static_cast<int32_t>(opts_.api_keys.size());
  const int32_t n_dashboards = std::max(opts_.max_dashboard_clients, n_keys);
  const int64_t n_default = int64_t(engine_.config().max_num_seqs) + engine_.config().max_queue + 8 + n_dashboards;
  const int32_t n_threads = opts_.http_threads > 0 ? opts_.http_threads : static_cast<int32_t>(std::min<int64_t>(n_default, kMaxDefaultThreads));
  svr_->new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
  svr_->set_payload_max_length(opts_.max_body_bytes);
  svr_->set_keep_alive_max_count(1000);
  // Small writes go out at once. A stream is a run of small writes (the role chunk, then one
  // per token); with Nagle's algorithm on (httplib's default), a write waits for the ACK of the
  // one before, and on a kept-alive connection the client's delayed ACK holds it ~40 ms: every
  // streamed answer's first token, and a plain answer's body after its headers, came ~40 ms
  // late to clients that reuse connections (measured with Python's requests / http.client;
  // the OpenAI SDK's httpx did not show it for streams).
  svr_->set_tcp_nodelay(true);
  routes();
}

HttpServer::~HttpServer() = default;


bool HttpServer::bind(const std::string& host, int port) {
  if (!bind_exclusive(*svr_, host, port)) return false;
  if (opts_.http_read_timeout_s > 0) watchdog_ = std::make_unique<ConnectionWatchdog>(port, opts_.http_read_timeout_s);
  return true;
}

void HttpServer::run() { svr_->listen_after_bind(); }

std::optional<ApiError> HttpServer::why_end(std::chrono::steady_clock::time_point deadline) const {
  if (stopping_.load()) return stopped_error();
  if (std::chrono::steady_clock::now() > deadline) return timeout_error(opts_.request_timeout_s);
  return std::nullopt;
}

bool HttpServer::wait_idle(double timeout_s) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return in_flight_.load() == 0;
}

bool HttpServer::drain(double timeout_s) {
  draining_.store(true);
  return wait_idle(timeout_s);
}

void HttpServer::stop() {
  draining_.store(true);
  stopping_.store(true);
  // Handlers now cancel their requests and write the ends (abort finishes, error event, [DONE]);
  // httplib cuts chunked responses once it is stopped, so they get a moment to finish first.
  wait_idle(5);
  // Dashboard streams end themselves once draining (an end chunk: a browser then sees the stream
  // close, not ERR_INCOMPLETE_CHUNKED_ENCODING); each looks at most once a second (wait_newer).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  for (;;) {
    {
      std::lock_guard<std::mutex> l(dashboards_mu_);
      if (dashboards_.empty()) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  svr_->stop();
}

bool HttpServer::authorized(const httplib::Request& req) const { return kv::authorized(req, opts_.api_keys); }

void HttpServer::routes() {
  // Which methods each path answers; another method on a known path is a 405, not a 404.
  static const std::map<std::string, std::string> kAllowed = {
      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"},
      {"/health", "GET"},          {"/metrics", "GET"},              {"/debug/kv", "GET"},
      {"/tokenize", "POST"},       {"/detokenize", "POST"},          {"/", "GET"},
      {"/dashboard", "GET"},       {"/dashboard/events", "GET"},    {"/v1/responses", "POST"},
      {"/marked.min.js", "GET"},
  };

  install_cors(*svr_, opts_.allowed_origins);
  svr_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (watchdog_) watchdog_->begin(req);  // ends in the logger, once the response is written
    if (cors_preflight(req, res, opts_.allowed_origins)) return httplib::Server::HandlerResponse::Handled;
    std::string path = req.path;
    if (path == "/debug/kv" && !opts_.debug) return httplib::Server::HandlerResponse::Unhandled;  // → 404
    // Everything but the liveness and metrics probes and the two pages (which ask for the key)
    // and their script needs the key.
    if (path != "/health" && path != "/metrics" && path != "/" && path != "/dashboard" && path != "/marked.min.js" && !authorized(req)) {
      refuse_unauthorized(req, res);
      return httplib::Server::HandlerResponse::Handled;
    }
    return refuse_wrong_method(req, res, kAllowed) ? httplib::Server::HandlerResponse::Handled
                                                   : httplib::Server::HandlerResponse::Unhandled;
  });

  install_json_errors(*svr_, opts_.max_body_bytes);

  svr_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (watchdog_) watchdog_->end(req);
    if (opts_.debug) std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
  });

  auto safe = [](auto fn) { return safe_handler(fn); };

  post_with_body_limit(*svr_, "/v1/completions", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, false); }, opts_.http_read_timeout_s);
  post_with_body_limit(*svr_, "/v1/chat/completions", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, true); }, opts_.http_read_timeout_s);

  post_with_body_limit(*svr_, "/v1/responses", opts_.max_body_bytes, [this](const httplib::Request& req, httplib::Response& res) { handle_responses(req, res); }, opts_.http_read_timeout_s);
  svr_->Get(R"(/v1/responses/([^/]+))", safe([this](const httplib::Request& req, httplib::Response& res) { handle_stored_response(req, res, false); }));
  svr_->Get(R"(/v1/responses/([^/]+)/input_items)",
            safe([this](const httplib::Request& req, httplib::Response& res) { handle_input_items(req, res); }));
  svr_->Delete(R"(/v1/responses/([^/]+))", safe([this](const httplib::Request& req, httplib::Response& res) { handle_stored_response(req, res, true); }));

  install_model_routes(*svr_, ctx_);
  // The chat page (web/chat.html, compiled in).
  svr_->Get("/", safe([](const httplib::Request&, httplib::Response& res) {
              res.set_header("Cache-Control", "no-cache");
              res.set_content(web::k_chat_html, "text/html; charset=utf-8");
            }));
  svr_->Get("/marked.min.js", safe([](const httplib::Request&, httplib::Response& res) {
              res.set_header("Cache-Control", "max-age=86400");
              res.set_content(web::k_marked_js, "text/javascript; charset=utf-8");
            }));
  svr_->Get("/dashboard", safe([](const httplib::Request&, httplib::Response& res) {
              res.set_header("Cache-Control", "no-cache");
              res.set_content(web::k_dashboard_html, "text/html; charset=utf-8");
            }));
  svr_->Get("/dashboard/events", safe([this](const httplib::Request& req, httplib::Response& res) { handle_dashboard_events(req, res); }));
  install_tokenize_routes(*svr_, ctx_, opts_.max_body_bytes, opts_.http_read_timeout_s);
  svr_->Get("/health", safe([this](const httplib::Request&, httplib::Response& res) {
              if (draining_.load()) {  // load balancers take this instance out of rotation
                res.set_header("Retry-After", kRetryAfterSeconds);
                write_json(res, json{{"status", "draining"}, {"role", role_name(opts_.role)}, {"model", ctx_.model_names.at(0)}, {"in_flight", in_flight_.load()}});
                res.status = 503;
                return;
              }
              write_json(res, json{{"status", "ok"}, {"role", role_name(opts_.role)}, {"model", ctx_.model_names.at(0)}});
            }));
  svr_->Get("/metrics", safe([this](const httplib::Request&, httplib::Response& res) {
              res.set_content(render_prometheus(engine_.metrics()), "text/plain; version=0.0.4; charset=utf-8");
            }));
  if (opts_.debug)
    svr_->Get("/debug/kv", safe([this](const httplib::Request&, httplib::Response& res) { handle_debug_kv(res); }));
}

void HttpServer::handle_debug_kv(httplib::Response& res) {
  // Counters first: the integrity check waits for the engine's state lock, and the caller wants
  // the page count as of its request, not as of whenever that lock came free.
  const int32_t pages_in_use = engine_.pages_in_use();
  MetricsSnapshot m = engine_.metrics();
  Status st = engine_.check_integrity();
  write_json(res, json{{"pages_total", engine_.pool().n_pages()},
                       {"pages_in_use", pages_in_use},
                       {"pages_cached", engine_.pages_cached()},
                       {"window_pages_cached", engine_.window_pages_cached()},
                       {"block_size", engine_.config().block_size},
                       {"num_requests_running", m.num_requests_running},
                       {"num_requests_waiting", m.num_requests_waiting},
                       {"integrity", {{"ok", st.is_ok()}, {"message", st.message()}}}});
}

int32_t HttpServer::dashboards_per_tenant() const {
  const auto n_keys = static_cast<int32_t>(opts_.api_keys.size());
  return n_keys == 0 ? opts_.max_dashboard_clients : std::max(1, opts_.max_dashboard_clients / n_keys);
}

void HttpServer::handle_dashboard_events(const httplib::Request& req, httplib::Response& res) {
  // Each viewer holds an HTTP thread for as long as it watches: a few, not the pool; with keys,
  // an equal share per tenant.
  const std::string tenant = tenant_of(req);
  {
    std::lock_guard<std::mutex> l(dashboards_mu_);
    int32_t& open = dashboards_[tenant];
    if (open >= dashboards_per_tenant()) {
      res.set_header("Retry-After", kRetryAfterSeconds);
      const std::string who = opts_.api_keys.empty() ? "" : " for this API key";
      throw ApiError{429, "Too many KV dashboards are open" + who + " (at most " + std::to_string(dashboards_per_tenant()) +
                              "); close one or retry later.",
                     "rate_limit_error", "", "rate_limit_exceeded"};
    }
    ++open;
  }
  struct Watch {
    DashboardViewer viewer;
    uint64_t seq = 0;           // last snapshot sent
    double rates_after = -1e9;  // rate points up to here were sent
    bool started = false;
  };
  auto w = std::make_shared<Watch>();
  w->viewer.ns_prefix = tenant;
  SnapshotFeed* feed = &engine_.dashboard_feed();
  feed->subscribe();
  // Only snapshots taken from now on: one published before (while nobody watched) is stale.
  if (auto last = feed->wait_newer(0, std::chrono::milliseconds(0))) w->seq = last->seq;
  const Tokenizer* tok = ctx_.tok;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, w, feed, tok](size_t, httplib::DataSink& sink) -> bool {
        try {
          if (!sink.is_writable()) return false;
          if (draining_.load()) {  // shutting down: the viewer's stream ends
            sink.done();
            return true;
          }
          std::string out;
          if (!w->started) {
            w->started = true;
            out = "retry: 2000\n\n";
          } else if (auto s = feed->wait_newer(w->seq, std::chrono::milliseconds(1000)); s && s->seq > w->seq) {
            w->seq = s->seq;
            out = "data: " + dashboard_json(*s, w->viewer, *tok, w->rates_after) + "\n\n";
            if (!s->rates.empty()) w->rates_after = s->rates.back().t;
          } else {
            out = ": idle\n\n";  // a write per second finds a vanished viewer
          }
          return sink.write(out.data(), out.size());
        } catch (...) {
          return false;
        }
      },
      [this, feed, tenant](bool) {
        feed->unsubscribe();
        std::lock_guard<std::mutex> l(dashboards_mu_);
        if (--dashboards_[tenant] == 0) dashboards_.erase(tenant);
      });
}

std::chrono::steady_clock::time_point HttpServer::request_deadline() const {
  return opts_.request_timeout_s > 0 ? std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                                             std::chrono::duration<double>(opts_.request_timeout_s))
                                     : std::chrono::steady_clock::time_point::max();
}

std::string HttpServer::tenant_of(const httplib::Request& req) const {
  return opts_.api_keys.empty() ? std::string() : tenant_prefix(bearer_key(req));
}

std::shared_ptr<RequestGroup> HttpServer::submit(ApiRequest& ar, const httplib::Request& req, httplib::Response& res, bool chat) {
  // Prefix-cache namespace: the caller's cache_salt, and with auth on, the key itself (hashed,
  // never stored raw), so tenants with different keys never share a page.
  if (!opts_.api_keys.empty()) ar.params.cache_namespace = tenant_of(req) + ar.params.cache_namespace;
  // Without keys a salt is the whole namespace: one spelled as a tenant's prefix would reach that
  // tenant's pages in a disk or Redis tier shared with servers that check keys.
  else if (ar.params.cache_namespace.rfind(kTenantPrefixTag, 0) == 0)
    throw ApiError{400, std::string("Invalid value for 'cache_salt': it may not start with \"") + kTenantPrefixTag +
                            "\", which names the namespaces of API-key tenants.",
                   "invalid_request_error", "cache_salt", "invalid_value"};
  // One engine request per prompt, all queued or none (a bad prompt anywhere in a batch is
  // answered before anything runs).
  std::vector<Request> reqs(ar.prompts.size());
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (size_t k = 0; k < reqs.size(); ++k) {
    reqs[k].id = engine_.next_request_id();
    reqs[k].prompt = std::move(ar.prompts[k]);
    reqs[k].params = ar.params;
    reqs[k].stream = std::make_shared<RequestStream>();
    streams.push_back(reqs[k].stream);
  }
  auto group = std::make_shared<RequestGroup>(std::move(streams), ar.params.n);
  int32_t failed = -1;
  if (Rejection rej = engine_.submit_all(std::move(reqs), &failed); rej.http_status != 0) {
    if (rej.http_status == 429 || rej.http_status == 503) res.set_header("Retry-After", "1");  // the queue is full: soon
    ApiError e = from_rejection(rej, chat);
    if (failed >= 0 && group->n_choices() > ar.params.n) e.message = "prompt[" + std::to_string(failed) + "]: " + e.message;
    throw e;
  }
  return group;
}

bool HttpServer::collect(const httplib::Request& req, RequestGroup& group, std::chrono::steady_clock::time_point deadline, bool chat,
                         int32_t n_per_prompt, std::vector<ChoiceResult>* choices, std::vector<PromptResult>* prompts) {
  const int32_t n = static_cast<int32_t>(choices->size());
  std::vector<StreamEvent> events;
  std::optional<ApiError> error;
  const int client_fd = find_client_socket(req);  // nothing is written until the end: watch the socket
  std::optional<ApiError> ended;  // the server ended it: shutdown or the deadline
  bool client_gone = false;
  for (bool more = true; more;) {
    if (!ended && (ended = why_end(deadline))) group.cancel(end_reason(*ended));
    if (!client_gone && client_fd >= 0 && peer_closed(client_fd)) {
      client_gone = true;
      group.cancel();
    }
    more = group.pop(&events, kPollInterval);
    for (auto& ev : events) {
      if (ev.index < 0 || ev.index >= n) continue;
      ChoiceResult& c = (*choices)[ev.index];
      if (ev.kind == StreamEvent::kText) {
        c.text += ev.text;
        for (auto& lp : ev.logprobs) c.logprobs.push_back(std::move(lp));
        if (!chat)  // completions: the end-of-text token too (eog_logprobs), as vLLM and OpenAI
          for (auto& lp : ev.eog_logprobs) c.logprobs.push_back(std::move(lp));
      } else if (ev.kind == StreamEvent::kPrompt) {
        take_prompt(*prompts, n_per_prompt, ev);
      } else if (ev.kind == StreamEvent::kFinish) {
        c.finish_reason = ev.finish_reason;
        c.stop_string = ev.stop_string;
        c.stop_token = ev.stop_token;
      } else if (!error) {
        error = from_event(ev);
      }
    }
    events.clear();
  }
  if (client_gone) return false;  // nobody to answer; the pages are back
  if (error) throw *error;
  if (ended && std::any_of(choices->begin(), choices->end(), [](const ChoiceResult& c) { return c.finish_reason == "abort"; })) {
    throw *ended;
  }
  return true;
}

void HttpServer::stream_sse(httplib::Response& res, std::shared_ptr<RequestGroup> group, std::unique_ptr<SseWriter> writer,
                            std::chrono::steady_clock::time_point deadline) {
  // The content provider runs on this connection's thread after the handler returns, one poll
  // per call, until the writer's end or the client is gone.
  struct State {
    std::shared_ptr<RequestGroup> stream;
    std::unique_ptr<SseWriter> writer;
    bool started = false;
    bool finished = false;          // the end written
    std::optional<ApiError> ended;  // the server ended it (shutdown, deadline): cancelled, ends with this error
    std::chrono::steady_clock::time_point deadline;
    std::vector<StreamEvent> events;
  };
  auto st = std::make_shared<State>();
  st->stream = std::move(group);
  st->writer = std::move(writer);
  st->deadline = deadline;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st](size_t, httplib::DataSink& sink) -> bool {
        try {
          auto send = [&](const std::string& s) { return s.empty() || sink.write(s.data(), s.size()); };
          if (!sink.is_writable()) {
            st->stream->cancel();
            return false;
          }
          if (!st->ended && (st->ended = why_end(st->deadline)))  // the choices still end: finish "abort", an error, the end
            st->stream->cancel(end_reason(*st->ended));
          if (!st->started) {
            st->started = true;
            return send(st->writer->begin());
          }
          const bool more = st->stream->pop(&st->events, kPollInterval);
          for (auto& ev : st->events) {
            // Nothing to write for a held text (an empty chunk would end the body).
            if (!send(st->writer->event(ev))) {
              st->events.clear();
              return false;  // the releaser cancels
            }
          }
          st->events.clear();
          if (!more) {
            if (!send(st->writer->end(st->ended, st->stream->usage()))) return false;
            st->finished = true;
            sink.done();
          }
          return true;
        } catch (...) {
          st->stream->cancel();
          return false;
        }
      },
      [this, st](bool) {
        if (!st->finished) st->stream->cancel();
        in_flight_.fetch_sub(1);
      });
}

void HttpServer::handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  InFlight in_flight(&in_flight_);  // before the draining check: drain() sees this request or it sees drain
  if (draining_.load()) {
    res.set_header("Retry-After", kRetryAfterSeconds);
    throw draining_error();
  }
  nlohmann::json body = parse_json_body(req.body, ctx_);
  ApiRequest ar = counting_refusals(engine_, [&] { return chat ? parse_chat_request(body, ctx_) : parse_completion_request(body, ctx_); });
  const bool prefill = opts_.role == ServerRole::kPrefill;
  if (prefill) {  // the prompt's KV is the product; one token proves the prompt ran
    ar.params.max_tokens = 1;  // echo's max_tokens 0 included
    ar.params.min_tokens = 0;  // the decode instance holds the end off; this token is thrown away
    ar.params.n = 1;
    ar.params.prompt_logprobs = -1;
    ar.echo = ar.prompt_logprobs = false;
    ar.stream = false;
  }
  ResponseMeta meta{make_response_id(chat), unix_now(), ctx_.model_names.at(0), chat, ar.include_usage};
  meta.continuous_usage = ar.continuous_usage;
  meta.echo = ar.echo;
  meta.prompt_logprobs = ar.prompt_logprobs;
  std::vector<PromptResult> prompts;  // what echo and prompt_logprobs show
  if (ar.echo || ar.prompt_logprobs)
    for (size_t k = 0; k < ar.prompts.size(); ++k) prompts.push_back({ar.prompts[k], ar.echo ? ar.prompt_texts.at(k) : "", {}});
  for (const auto& p : ar.prompts) meta.prompt_tokens += static_cast<int32_t>(p.size());

  const int32_t n_per_prompt = ar.params.n;
  const int32_t n = n_per_prompt * static_cast<int32_t>(ar.prompts.size());  // choices in all
  const uint64_t lost_before = engine_.tier_lost_writes();
  std::shared_ptr<RequestGroup> stream = submit(ar, req, res, chat);
  CancelGuard guard{stream};
  const auto deadline = request_deadline();

  if (!ar.stream) {
    std::vector<ChoiceResult> choices(n);
    for (int32_t i = 0; i < n; ++i) choices[i].prompt = i / n_per_prompt;
    const bool answered = collect_or_retry_after(req, res, *stream, deadline, chat, n_per_prompt, &choices, &prompts);
    guard.armed = false;
    if (!answered) {  // the client is gone
      res.status = 499;
      return;
    }
    if (ar.tool_choice.kind != ToolChoice::Kind::kNone)
      for (ChoiceResult& c : choices) {
        if (c.finish_reason == "abort") continue;
        ToolCallStream t(ar.tool_choice);
        t.push(c.text);
        t.finish(&c.finish_reason);
        c.message = t.message();
      }
    if (prefill) say_prefill_stored(res, lost_before);
    write_json(res, full_response(meta, choices, prompts, stream->usage(), ar.logprobs, *ctx_.tok));
    return;
  }

  auto w = std::make_unique<ChatSseWriter>();
  w->meta = meta;
  w->n = n;
  w->with_logprobs = ar.logprobs;
  w->text_offset.assign(n, TextOffset{});
  w->finish_reasons.assign(n, "");
  w->prompts = std::move(prompts);
  w->n_per_prompt = n_per_prompt;
  w->prompt_lp_events = ar.params.prompt_logprobs >= 0;
  w->tok = ctx_.tok;
  if (ar.tool_choice.kind != ToolChoice::Kind::kNone)
    for (int32_t i = 0; i < n; ++i) w->tools.emplace_back(ar.tool_choice);
  guard.armed = false;      // from here the releaser owns cancellation
  in_flight.armed = false;  // and the count
  stream_sse(res, stream, std::move(w), deadline);
}

void HttpServer::say_prefill_stored(httplib::Response& res, uint64_t lost_before) {
  // The prompt's full pages were queued for the tier as they filled (write-through), before the
  // token was sampled: once the writes queued so far are done, a decode instance finds them, unless
  // one of them was dropped or failed in the shared store since the request came (Redis down: the
  // router counted such prefills as done, and decode computed the prompt again; a user test).
  const bool done = engine_.wait_tier_writes(engine_.tier_write_mark(), opts_.prefill_write_timeout_s);
  res.set_header("X-KVServe-Prefill-Stored", done && engine_.tier_lost_writes() == lost_before ? "1" : "0");
}

bool HttpServer::collect_or_retry_after(const httplib::Request& req, httplib::Response& res, RequestGroup& group,
                                        std::chrono::steady_clock::time_point deadline, bool chat, int32_t n_per_prompt,
                                        std::vector<ChoiceResult>* choices, std::vector<PromptResult>* prompts) {
  try {
    return collect(req, group, deadline, chat, n_per_prompt, choices, prompts);
  } catch (ApiError& e) {
    if (e.status == 503 && e.code == "server_shutting_down") res.set_header("Retry-After", kRetryAfterSeconds);
    throw;
  }
}

void HttpServer::handle_responses(const httplib::Request& req, httplib::Response& res) {
  InFlight in_flight(&in_flight_);
  if (draining_.load()) {
    res.set_header("Retry-After", kRetryAfterSeconds);
    throw draining_error();
  }
  const std::string tenant = tenant_of(req);
  PreviousLookup previous;
  if (store_.enabled()) previous = [this, tenant](const std::string& id) { return store_.get(id, tenant); };
  nlohmann::json body = parse_json_body(req.body, ctx_);
  ResponsesRequest rr = counting_refusals(engine_, [&] { return parse_responses_request(body, ctx_, previous); });
  const bool prefill = opts_.role == ServerRole::kPrefill;
  if (prefill) {  // as handle_generate: one token, nothing kept
    rr.chat.params.max_tokens = 1;
    rr.chat.params.min_tokens = 0;
    rr.chat.stream = false;
    rr.store = false;
  }
  const uint64_t lost_before = engine_.tier_lost_writes();
  auto builder = std::make_unique<ResponseBuilder>(rr, make_item_id("resp"), unix_now(), ctx_.model_names.at(0), *ctx_.tok);
  // What the store keeps of a finished response (its conversation goes on with its output).
  // False when it was not kept (larger than --stored-responses-memory alone): store then says false.
  auto keep = [this, tenant, conversation = rr.conversation, salt = rr.cache_salt](const ResponseBuilder& b) mutable {
    auto s = std::make_shared<StoredResponse>();
    s->response = b.response();
    s->conversation = std::move(conversation);
    s->n_input = s->conversation.size();
    for (const json& item : b.output()) s->conversation.push_back(item);
    s->tenant = tenant;
    s->cache_salt = salt;
    const std::string id = s->response.at("id").get<std::string>();
    return store_.put(id, std::move(s));
  };
  std::shared_ptr<RequestGroup> stream;
  try {
    stream = submit(rr.chat, req, res, /*chat=*/true);
  } catch (ApiError& e) {
    if (e.param == "messages") e.param = "input";  // the engine's name for the prompt
    throw;
  }
  CancelGuard guard{stream};
  const auto deadline = request_deadline();

  if (!rr.chat.stream) {
    std::vector<ChoiceResult> choices(1);
    std::vector<PromptResult> prompts;
    const bool answered = collect_or_retry_after(req, res, *stream, deadline, /*chat=*/true, 1, &choices, &prompts);
    guard.armed = false;
    if (!answered) {
      res.status = 499;
      return;
    }
    builder->begin();
    builder->push(choices[0].text, rr.logprobs ? choices[0].logprobs : std::vector<TokenLogprob>{});
    builder->finish(choices[0].finish_reason, stream->usage());
    if (rr.store && !keep(*builder)) builder->set_store(false);
    // its pages are the product, as for chat (it answered before they were down: decode found gaps)
    if (prefill) say_prefill_stored(res, lost_before);
    write_json(res, builder->response());
    return;
  }
  std::function<bool(const ResponseBuilder&)> on_done;
  if (rr.store) on_done = keep;
  guard.armed = false;
  in_flight.armed = false;
  stream_sse(res, stream, std::make_unique<ResponsesSseWriter>(std::move(builder), rr.logprobs, std::move(on_done)), deadline);
}

ApiError HttpServer::response_not_found(const std::string& id) const {
  return ApiError{404,
                  "Response with id '" + id + "' not found." + (store_.enabled() ? "" : " This server keeps no responses (--max-stored-responses 0)."),
                  "invalid_request_error", "response_id", "response_not_found"};
}

void HttpServer::handle_input_items(const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches[1];
  InputItemsQuery q;
  if (req.has_param("limit")) {
    const std::string v = req.get_param_value("limit");
    int64_t n = -1;
    if (!v.empty() && v.size() < 10 && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) n = std::stoll(v);
    if (n < 1 || n > 100)
      throw ApiError{400, "Invalid 'limit': '" + v + "'. Expected an integer from 1 to 100.", "invalid_request_error", "limit", "invalid_value"};
    q.limit = static_cast<int32_t>(n);
  }
  if (req.has_param("order")) {
    const std::string v = req.get_param_value("order");
    if (v != "asc" && v != "desc")
      throw ApiError{400, "Invalid 'order': '" + v + "'. Expected 'asc' or 'desc'.", "invalid_request_error", "order", "invalid_value"};
    q.ascending = v == "asc";
  }
  q.after = req.get_param_value("after");
  q.before = req.get_param_value("before");
  std::shared_ptr<const StoredResponse> s = store_.get(id, tenant_of(req));
  if (!s) throw response_not_found(id);
  write_json(res, input_items_page(*s, q));
}

void HttpServer::handle_stored_response(const httplib::Request& req, httplib::Response& res, bool erase) {
  const std::string id = req.matches.size() > 1 ? std::string(req.matches[1]) : std::string();
  const std::string tenant = tenant_of(req);
  if (erase) {
    if (!store_.erase(id, tenant)) throw response_not_found(id);
    write_json(res, json{{"id", id}, {"object", "response"}, {"deleted", true}});
    return;
  }
  std::shared_ptr<const StoredResponse> s = store_.get(id, tenant);
  if (!s) throw response_not_found(id);
  write_json(res, s->response);
}

}  // namespace kv
