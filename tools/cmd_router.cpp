// kvserve router: an OpenAI-compatible front over kvserve instances (src/router/): replicas with
// prefix affinity, or prefill and decode instances (docs/disaggregation.md).
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <optional>
#include <thread>

#include "commands.h"
#include "common/units.h"
#include "gguf/gguf.h"
#include "kv/kv_eviction.h"
#include "loaded_model.h"
#include "model/config.h"
#include "router/router.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kvtools {

namespace {
struct RouterCliOptions {
  std::string model = kDefaultModel;
  std::vector<std::string> served_model_name;
  std::string chat_template;
  std::string allowed_origins = "[\"*\"]";
  bool trust_request_chat_template = false;
  std::string listen = "127.0.0.1:8000";
  int max_model_len = 0;
  bool past_trained_context = false;  // as on the backends: a --max-model-len past the training context is meant
  int max_n = 16;
  std::string max_body = "8MiB";
  double http_read_timeout = 30;
  std::string routing = "cache-aware";
  std::string kv_eviction = "none";
  double shutdown_timeout = 30;
  kv::RouterOptions ro;
};

void run_router(RouterCliOptions o) {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // The tokenizer and chat template only: the router has no engine and loads no weights.
  if (std::string hint = missing_model_hint(o.model); !hint.empty()) fail(hint);
  auto file = kv::GgufFile::open(o.model);
  if (!file) fail(o.model + ": " + file.message());
  auto tok = kv::Tokenizer::from_gguf(**file);
  if (!tok) fail(o.model + ": tokenizer: " + tok.message());
  auto mc = kv::ModelConfig::from_gguf(**file);
  if (!mc) fail(o.model + ": " + mc.message());
  auto chat = kv::model_chat_template(**file, o.chat_template, nullptr);
  if (!chat) fail("--chat-template " + chat.message());

  kv::ApiContext ctx = kv::make_api_context(**tok, *chat ? &**chat : nullptr, o.model, o.served_model_name,
                                            o.max_model_len > 0 ? o.max_model_len : (mc->n_ctx_train > 0 ? mc->n_ctx_train : 4096), o.max_n);
  if (const std::string w = kv::max_model_len_warning(ctx.max_model_len, mc->n_ctx_train, o.past_trained_context, "--max-model-len",
                                                      "--past-trained-context");
      !w.empty())
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  // The backends' default policy: an evicting one lets a request's max_tokens pass max_model_len
  // (the backend re-indexes); the router validates requests as the backends will.
  auto policy = kv::parse_eviction_policy(o.kv_eviction);
  if (!policy) fail("--kv-eviction: " + policy.message());
  ctx.default_policy_evicts = *policy != kv::EvictionPolicy::kNone;
  ctx.trust_request_chat_template = o.trust_request_chat_template;
  ctx.constraints_forwarded = true;  // structured outputs: the backends compile them
  auto max_body = kv::parse_byte_size(o.max_body);
  if (!max_body) fail("--max-body-size: " + max_body.message());
  o.ro.max_body_bytes = static_cast<size_t>(*max_body);
  o.ro.http_read_timeout_s = o.http_read_timeout;
  o.ro.allowed_origins = parse_allowed_origins(o.allowed_origins);
  for (const auto* urls : {&o.ro.replicas, &o.ro.prefill, &o.ro.decode})  // one backend counted twice would take twice its share
    for (size_t i = 0; i < urls->size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if ((*urls)[i] == (*urls)[j]) fail("backend " + (*urls)[i] + " is given twice");
  // "affinity" is the ring's name from before cache-aware routing: a deployment that asked for it
  // keeps the stateless ring (several routers behind a load balancer agree only on the ring).
  if (o.routing == "affinity") {
    std::fprintf(stderr, "--routing affinity is the old name of --routing ring (the default is now cache-aware)\n");
    o.routing = "ring";
  }
  o.ro.routing = o.routing == "round-robin" ? kv::RouterOptions::Routing::kRoundRobin
                 : o.routing == "ring"      ? kv::RouterOptions::Routing::kRing
                                            : kv::RouterOptions::Routing::kCacheAware;

  const size_t colon = o.listen.rfind(':');
  if (colon == std::string::npos) fail("--listen " + o.listen + ": expected HOST:PORT");
  std::string host = o.listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);  // [::1]:8000
  const int port = std::atoi(o.listen.c_str() + colon + 1);
  if (port < 1 || port > 65535) fail("--listen " + o.listen + ": bad port");

  auto router = kv::Router::create(o.ro, ctx);
  if (!router) fail(router.message());
  if (!(*router)->bind(host, port)) fail("cannot listen on " + o.listen + " (address in use or invalid)");
  // First SIGINT/SIGTERM: drain (503 to new requests, in-flight ones get --shutdown-timeout to
  // finish, then end with an error event), exit 0. A second signal exits at once.
  std::atomic<bool> run_returned{false};
  std::thread watcher([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (run_returned.load()) return;
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    std::fprintf(stderr, "\n%s: draining: new requests get 503; %d in flight get up to %g s (--shutdown-timeout); a second signal exits now\n",
                 name, (*router)->in_flight(), o.shutdown_timeout);
    std::thread([stop_signals] {
      int again = 0;
      sigwait(&stop_signals, &again);
      std::fprintf(stderr, "%s again: exiting now\n", again == SIGINT ? "SIGINT" : "SIGTERM");
      std::_Exit(128 + again);
    }).detach();
    if ((*router)->drain(o.shutdown_timeout)) std::fprintf(stderr, "drained: every request finished\n");
    else std::fprintf(stderr, "shutdown timeout: ended the requests still in flight\n");
    (*router)->stop();
  });
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& u : v) s += (s.empty() ? "" : ", ") + u;
    return s;
  };
  if (!o.ro.replicas.empty())
    std::fprintf(stderr, "router at http://%s: %zu replicas (%s), %s\n", o.listen.c_str(), o.ro.replicas.size(), list(o.ro.replicas).c_str(),
                 o.routing == "round-robin"
                     ? "round-robin"
                     : ("prefix affinity (" + std::string(o.routing == "ring" ? "consistent-hash ring" : "cache-aware") + ") on the first " +
                        std::to_string(o.ro.affinity_tokens) + " tokens")
                           .c_str());
  else
    std::fprintf(stderr, "router at http://%s: prefill %s; decode %s; prompts of %d+ tokens are prefilled\n", o.listen.c_str(),
                 list(o.ro.prefill).c_str(), list(o.ro.decode).c_str(), o.ro.prefill_min_tokens);
  std::fflush(stderr);
  (*router)->run();
  run_returned.store(true);
  pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  router->reset();
  std::fprintf(stderr, "stopped\n");
}
}  // namespace

void add_router_command(CLI::App& app) {
  auto o = std::make_shared<RouterCliOptions>();
  CLI::App* cmd = app.add_subcommand("router", "OpenAI-compatible front over kvserve instances: replicas by prefix, or prefill + decode");
  cmd->add_option("-m,--model", o->model, "GGUF model the backends serve (its tokenizer and chat template are used)")->capture_default_str();
  cmd->add_option("--served-model-name", o->served_model_name, "model id in the API (default: the file's stem); several are aliases, as vLLM's: responses and /v1/models name the first")->check(non_empty())->expected(1, -1);
  cmd->add_option("--api-key", o->ro.api_keys,
                  "require Authorization: Bearer <key> on every route but /health and /metrics, before anything else (env "
                  "KVSERVE_API_KEY); repeat for several. The header goes on to the backends: give them the same keys")
      ->envname("KVSERVE_API_KEY")
      ->check(non_empty())
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  add_allowed_origins_option(cmd, &o->allowed_origins);
  cmd->add_flag("--trust-request-chat-template", o->trust_request_chat_template,
                "accept a request's own chat_template, as the backends' flag (vLLM's; off: such a request is a 400)");
  cmd->add_option("--chat-template", o->chat_template,
                  "the backends' --chat-template: give the router the same (it renders chats to check them and to route by "
                  "their prefix; the backends render them again for the answer)");
  cmd->add_option("--listen", o->listen, "HOST:PORT to serve on")->capture_default_str();
  cmd->add_option("--replica", o->ro.replicas, "a kvserve instance (http://HOST:PORT); repeat");
  cmd->add_option("--prefill", o->ro.prefill, "a `serve --role prefill` instance; repeat");
  cmd->add_option("--decode", o->ro.decode, "a `serve --role decode` instance; repeat");
  cmd->add_option("--block-size", o->ro.block_size, "the backends' KV page size")->check(number_in(1, 1024))->capture_default_str();
  cmd->add_option("--affinity-tokens", o->ro.affinity_tokens, "leading prompt tokens (whole pages) that pick the replica")
      ->check(number_in(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--load-factor", o->ro.load_factor,
                  "bounded-load hashing: a backend takes a request only while it has fewer than this × the average requests in flight")
      ->check(number_in(1.0, 100.0))
      ->capture_default_str();
  cmd->add_option("--balance-threshold", o->ro.balance_abs,
                  "cache-aware: a prefix's replica keeps its requests unless it is over --load-factor and this many requests ahead of "
                  "the least loaded (a request sent elsewhere recomputes its prefix there)")
      ->check(number_in(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--routing", o->routing,
                  "cache-aware (a new prefix goes to the least loaded replica, which keeps it), ring (consistent hashing: "
                  "stateless, routers behind a load balancer agree; its old name affinity still works), or round-robin (a baseline)")
      ->check(CLI::IsMember({"cache-aware", "affinity", "ring", "round-robin"}))
      ->capture_default_str();
  cmd->add_option("--prefill-min-tokens", o->ro.prefill_min_tokens, "shorter prompts skip the prefill instance")
      ->check(number_in(0, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--health-interval", o->ro.health_interval_s, "seconds between health checks")->check(number_in(0.05, 3600.0))->capture_default_str();
  cmd->add_option("--timeout", o->ro.read_timeout_s, "seconds a backend may stay silent mid-request")->check(number_in(1.0, 86400.0))->capture_default_str();
  cmd->add_option("--stall-timeout", o->ro.stall_timeout_s,
                  "seconds a backend that fails its health check may stay silent before its requests are left (non-streamed ones "
                  "go to another backend); 0: wait for --timeout")
      ->check(number_in(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("--http-threads", o->ro.http_threads, "connection threads (a request holds one until it is answered, however long its backend queues it)")->check(number_in(1, 4096))->capture_default_str();
  cmd->add_option("--max-model-len", o->max_model_len, "as the backends' (default: the model's context)")->check(number_in(1, 1 << 24));
  cmd->add_flag("--past-trained-context", o->past_trained_context, "as the backends': no warning for a --max-model-len past the training context");
  cmd->add_option("--max-n", o->max_n, "as the backends'")->check(number_in(1, 256))->capture_default_str();
  cmd->add_option("--kv-eviction", o->kv_eviction,
                  "as the backends' default (none|window|sinks|h2o|snapkv): an evicting policy lets max_tokens pass "
                  "--max-model-len, as it does on the backends")
      ->capture_default_str();
  cmd->add_option("--max-body-size", o->max_body, "largest request body (413 above)")->capture_default_str();
  cmd->add_option("--http-read-timeout", o->http_read_timeout, "as the server's")->check(number_in(0.0, 86400.0))->capture_default_str();
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout,
                  "seconds in-flight requests get to finish after SIGTERM/SIGINT (new ones get 503); a second signal exits at once")
      ->check(number_in(0.0, 86400.0))->capture_default_str();
  cmd->callback([o] { run_router(*o); });
}

}  // namespace kvtools
