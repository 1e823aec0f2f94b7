// kvserve serve: the OpenAI-compatible server (src/server/) over the batching engine.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "commands.h"
#include "common/thread_pool.h"
#include "common/units.h"
#include "engine/engine.h"
#include "gguf/gguf.h"
#include "kv/redis_store.h"
#include "kernels/matmul.h"
#include "loaded_model.h"
#include "server/http_server.h"
#include "server/http_util.h"
#include "tokenizer/chat_template.h"

namespace kvtools {

namespace {
struct ServeOptions {
  std::string model = kDefaultModel;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::vector<std::string> api_keys;
  std::vector<std::string> served_model_name;
  std::string chat_template;
  std::string allowed_origins = "[\"*\"]";
  bool trust_request_chat_template = false;
  bool enable_auto_tool_choice = false;
  std::string tool_call_parser;
  int max_num_batched_tokens = 512;
  int long_prefill_tokens = -1;  // -1: 0, or a quarter of max_num_batched_tokens on a prefill instance
  int max_num_seqs = 64;
  int max_model_len = 0;  // 0: the model's training context
  bool past_trained_context = false;  // a --max-model-len past the training context is meant: no warning
  int max_queue = 256;
  int max_n = 16;
  int threads = 0;
  int http_threads = 0;
  int max_dashboards = 8;
  int max_stored_responses = 1000;
  std::string stored_responses_memory = "256MiB";
  double shutdown_timeout = 30;
  double request_timeout = 600;
  double http_read_timeout = 30;
  std::string max_body = "8MiB";
  bool debug = false;
  bool prefix_caching = true;
  std::string policy = "fcfs";
  KvOptions kvo;
  EvictionOptions evo;
  // KV tiers below RAM
  std::string kv_disk_dir;
  std::string kv_disk_bytes = "8GiB";
  std::vector<std::string> kv_redis;
  int kv_redis_ttl = 0;
  int kv_redis_timeout_ms = 1000;
  std::string kv_tier_write = "back";
  int kv_tier_min_tokens = 32;
  std::string preemption_mode = "recompute";
  std::string speculative_config;
  int32_t jump_forward_tokens = kv::EngineConfig{}.jump_forward_tokens;
  std::string role = "both";
};


void run_serve(const ServeOptions& o) {
  // SIGINT/SIGTERM are taken by one watcher thread (sigwait) and SIGPIPE is ignored (a client
  // that hangs up must not kill the process): block them before any thread exists so every
  // thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (auto b = kv::parse_kv_cache_memory(o.kvo.memory); !b) fail(b.message());  // before the weights, as generate
  if (auto b = kv::parse_byte_size(o.kv_disk_bytes); !b) fail("--kv-disk-bytes: " + b.message());
  auto max_body = kv::parse_byte_size(o.max_body);
  if (!max_body) fail("--max-body-size: " + max_body.message());
  auto stored_memory = kv::parse_memory_size(o.stored_responses_memory);
  if (!stored_memory) fail("--stored-responses-memory: " + stored_memory.message());
  // vLLM's pair: tool_choice "auto" parses the answer with the parser, which alone does nothing.
  if (o.enable_auto_tool_choice && o.tool_call_parser.empty()) fail("--enable-auto-tool-choice needs --tool-call-parser (hermes)");
  if (!o.enable_auto_tool_choice && !o.tool_call_parser.empty())
    fail("--tool-call-parser is used by tool_choice \"auto\", which needs --enable-auto-tool-choice");
  // --chat-template before the weights: one that does not load fails at once.
  std::optional<kv::ChatTemplate> chat;
  if (!o.chat_template.empty()) {
    auto t = kv::load_chat_template(o.chat_template);
    if (!t) fail("--chat-template " + t.message());
    chat = std::move(*t);
  }

  if (std::string why = kv::listen_problem(o.host, o.port); !why.empty())
    fail("cannot listen on " + o.host + ":" + std::to_string(o.port) + ": " + why);
  // Weights and tokenizer only: the engine allocates the KV pool itself from EngineConfig.
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, false, /*with_runtime=*/false);
  auto* file = &lm.file;
  auto* tok = &lm.tokenizer;
  auto* model = &lm.model;
  const auto& mc = (*model)->config();

  if (!chat) {
    std::string no_chat;
    chat = *kv::model_chat_template(**file, "", &no_chat);  // the GGUF's: never an error
    if (!chat)
      std::fprintf(stderr, "warning: %s; /v1/chat/completions is off (--chat-template picks one: chatml, gemma3, a file)\n",
                   no_chat.c_str());
  }

  kv::EngineConfig ec;
  ec.max_num_batched_tokens = o.max_num_batched_tokens;
  ec.max_num_seqs = o.max_num_seqs;
  ec.max_model_len = o.max_model_len > 0 ? o.max_model_len : (mc.n_ctx_train > 0 ? mc.n_ctx_train : 4096);
  // Past the training context: a warning, once (the Python API's too).
  if (const std::string w = kv::max_model_len_warning(ec.max_model_len, mc.n_ctx_train, o.past_trained_context, "--max-model-len",
                                                      "--past-trained-context");
      !w.empty())
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  ec.max_queue = o.max_queue;
  ec.max_n = o.max_n;
  ec.block_size = o.kvo.block_size;
  auto bytes = kv::parse_kv_cache_memory(o.kvo.memory);
  if (!bytes) fail(bytes.message());
  ec.kv_cache_bytes = *bytes;
  ec.n_threads = o.threads > 0 ? o.threads : kv::default_thread_count();
  ec.enable_prefix_caching = o.prefix_caching;
  ec.policy = o.policy == "lpm" ? kv::EngineConfig::Policy::kLpm : kv::EngineConfig::Policy::kFcfs;

  ec.kv_policy = make_eviction(o.evo, o.kvo.block_size);
  ec.kv_offload_dir = o.evo.offload_dir;
  if (ec.kv_policy.active() && mc.mla) fail("--kv-eviction / --kv-sparse are not supported for MLA models");
  kv::KvLayout layout = make_kv_layout(**model, o.kvo);
  ec.kv_dtype = layout.dtype;
  ec.kv_layer_dtypes = model_layer_dtypes(**model, o.kvo);

  ec.tiers.disk_dir = o.kv_disk_dir;
  ec.tiers.disk_bytes = *kv::parse_byte_size(o.kv_disk_bytes);  // checked above; at least one page: TierManager::create
  for (const auto& r : o.kv_redis) {  // several addresses: repeat the flag or separate by commas
    size_t a = 0;
    while (a <= r.size()) {
      const size_t b = std::min(r.find(',', a), r.size());
      if (b > a) ec.tiers.redis.push_back(r.substr(a, b - a));
      a = b + 1;
    }
  }
  ec.tiers.redis_ttl_s = o.kv_redis_ttl;
  ec.tiers.redis_timeout_ms = o.kv_redis_timeout_ms;
  ec.tiers.write_through = o.kv_tier_write == "through";
  // Disaggregation (docs/disaggregation.md): prompt pages travel through the shared tier.
  const kv::ServerRole role = o.role == "prefill" ? kv::ServerRole::kPrefill : o.role == "decode" ? kv::ServerRole::kDecode : kv::ServerRole::kBoth;
  if (role != kv::ServerRole::kBoth && ec.tiers.redis.empty())
    fail(std::string("--role ") + o.role + " hands prompt pages over through a shared KV tier: give --kv-redis redis://HOST:PORT");
  // The prompt's partly filled last page goes through the tier too: decode computes one token.
  if (role != kv::ServerRole::kBoth)
    ec.tier_prompt_tails = role == kv::ServerRole::kPrefill ? kv::EngineConfig::PromptTails::kStore : kv::EngineConfig::PromptTails::kFetch;
  // A long prompt's chunk leaves room for the prompts waiting behind it. A prefill instance's
  // steps hold no decodes, so that costs nothing there; where decodes share the step, it moves
  // the wait from a request's first token into the others' inter-token gaps (docs/disaggregation.md).
  ec.long_prefill_tokens = o.long_prefill_tokens >= 0                ? o.long_prefill_tokens
                           : role == kv::ServerRole::kPrefill ? std::max(1, o.max_num_batched_tokens / 4)
                                                               : 0;
  if (role == kv::ServerRole::kPrefill) {
    ec.tiers.write_through = true;  // a page goes down as soon as it is full, before the answer
    ec.tiers.max_pending_bytes = std::max<int64_t>(ec.tiers.max_pending_bytes, int64_t(1) << 30);
  }
  ec.tiers.min_pages = std::max(1, (o.kv_tier_min_tokens + o.kvo.block_size - 1) / o.kvo.block_size);
  ec.spec = parse_speculative_option(o.speculative_config);
  ec.jump_forward_tokens = o.jump_forward_tokens;
  ec.preemption = o.preemption_mode == "swap" ? kv::EngineConfig::Preemption::kSwap : kv::EngineConfig::Preemption::kRecompute;
  if (ec.preemption == kv::EngineConfig::Preemption::kSwap && !ec.tiers.enabled())
    fail("--preemption-mode swap writes pages to a KV tier: give --kv-disk-dir or --kv-redis");

  kv::Engine engine(**model, **tok, ec);
  if (!engine.init_status()) fail(engine.init_status().message());
  const int64_t n_pages = engine.pool().n_pages();
  const int64_t n_tokens = n_pages * ec.block_size;
  const int64_t pages_per_seq = (ec.max_model_len + ec.block_size - 1) / ec.block_size;
  std::fprintf(stderr, "model: %s (%s, %d layers, %s %d/%d heads), kernels: %s, threads: %d\n", mc.name.c_str(), mc.arch.c_str(),
               mc.n_layer, mc.attention_kind(), mc.n_head, mc.n_head_kv, kv::isa_name(kv::detect_isa()), ec.n_threads);
  // Quantized layers' pages fill in f16 staging tiles (a slot per filling page and layer), held
  // apart from the pages: shown on its own so that the pages' figure adds up.
  const kv::PagePool& pool = engine.pool();
  const std::string staging = pool.stage_store_bytes() > 0
                                  ? " + " + kv::format_bytes(double(pool.stage_store_bytes())) + " f16 staging (" +
                                        std::to_string(pool.n_staging()) + " filling pages per quantized layer)"
                                  : std::string();
  std::fprintf(stderr, "KV cache: %s %s, %lld pages of %d tokens = %lld tokens (%s per token)%s; %lld sequences of max_model_len %d fit\n",
               kv::format_bytes(double(pool.total_bytes() - pool.stage_store_bytes())).c_str(), layout.describe().c_str(),
               static_cast<long long>(n_pages), ec.block_size, static_cast<long long>(n_tokens),
               kv::format_bytes(layout.bytes_per_token()).c_str(), staging.c_str(), static_cast<long long>(n_pages / pages_per_seq),
               ec.max_model_len);
  if (n_tokens < ec.max_model_len && !ec.kv_policy.evicts())
    std::fprintf(stderr, "note: the KV cache holds %lld tokens, less than one sequence of max_model_len %d: a chat request without "
                 "max_tokens gets at most what the cache leaves after its prompt (raise --kv-cache-memory or lower --max-model-len)\n",
                 static_cast<long long>(n_tokens), ec.max_model_len);
  if (ec.kv_policy.evicts() && ec.kv_policy.budget >= ec.max_model_len)  // a user test read "0 sequences of 99999999999 tokens fit"
    std::fprintf(stderr, "note: --kv-budget %lld is not below max_model_len %d: no sequence grows past it, so --kv-eviction %s never evicts\n",
                 static_cast<long long>(ec.kv_policy.budget), ec.max_model_len, kv::eviction_policy_name(ec.kv_policy.policy));
  else if (ec.kv_policy.evicts())  // a sequence holds its prompt, then at most the budget
    std::fprintf(stderr, "KV cache under --kv-eviction %s: %lld sequences of %lld tokens (the budget, once their prompts are cut down to it) fit\n",
                 kv::eviction_policy_name(ec.kv_policy.policy), static_cast<long long>(n_pages / ((ec.kv_policy.budget + ec.block_size - 1) / ec.block_size + 1)),
                 static_cast<long long>(ec.kv_policy.budget));
  if (const kv::PagePool* g1 = engine.pool_g1())
    std::fprintf(stderr, "KV cache, sliding-window layers (window %d): %s, %d pages (the window of %lld sequences); the prefix cache keeps these pages too while they fit\n",
                 (*model)->kv_groups()[1].window, kv::format_bytes(g1->total_bytes()).c_str(), g1->n_pages(),
                 static_cast<long long>(g1->n_pages() / ((*model)->kv_groups()[1].window / ec.block_size + 2)));
  std::fprintf(stderr, "engine: max_num_seqs %d, max_num_batched_tokens %d, long_prefill_token_threshold %d, max_queue %d, prefix caching %s, policy %s, KV policy %s, speculative %s\n",
               ec.max_num_seqs, ec.max_num_batched_tokens, ec.long_prefill_tokens, ec.max_queue, ec.enable_prefix_caching ? "on" : "off", o.policy.c_str(),
               ec.kv_policy.describe(ec.block_size).c_str(), ec.spec.describe().c_str());

  if (ec.tiers.enabled()) {
    std::string redis;
    for (const auto& r : ec.tiers.redis) redis += (redis.empty() ? "" : ",") + r;
    const kv::MetricsSnapshot ms = engine.metrics();
    std::fprintf(stderr, "KV tiers: disk %s%s, redis %s%s; write-%s, preemption %s\n",
                 ec.tiers.disk_dir.empty() ? "off" : ec.tiers.disk_dir.c_str(),
                 ec.tiers.disk_dir.empty() ? "" : (" (" + kv::format_bytes(ec.tiers.disk_bytes) + ", " +
                                                   std::to_string(ms.tiers.empty() ? 0 : ms.tiers[0].s.pages_stored) + " pages found)").c_str(),
                 redis.empty() ? "off" : redis.c_str(),
                 ec.tiers.redis_ttl_s > 0 ? (" (ttl " + std::to_string(ec.tiers.redis_ttl_s) + " s)").c_str() : "",
                 ec.tiers.write_through ? "through" : "back", o.preemption_mode.c_str());
  }

  kv::ApiContext ctx = kv::make_api_context(**tok, chat ? &*chat : nullptr, o.model, o.served_model_name, ec.max_model_len, ec.max_n);
  ctx.trust_request_chat_template = o.trust_request_chat_template;
  ctx.tool_call_parser = o.tool_call_parser;
  ctx.default_policy_evicts = ec.kv_policy.evicts();
  ctx.kv_capacity_tokens = n_tokens;
  kv::ConstraintCompiler constraints(**tok, (*model)->config().n_vocab);  // structured outputs
  ctx.constraints = &constraints;

  kv::ServerOptions so;
  so.api_keys = o.api_keys;
  so.max_body_bytes = static_cast<size_t>(*max_body);
  so.debug = o.debug;
  so.http_threads = o.http_threads;
  so.max_dashboard_clients = o.max_dashboards;
  so.max_stored_responses = static_cast<size_t>(o.max_stored_responses);
  so.stored_responses_bytes = static_cast<size_t>(*stored_memory);
  so.allowed_origins = parse_allowed_origins(o.allowed_origins);
  so.request_timeout_s = o.request_timeout;
  so.http_read_timeout_s = o.http_read_timeout;
  so.role = role;
  kv::HttpServer server(engine, ctx, so);
  if (!server.bind(o.host, o.port)) fail("cannot listen on " + o.host + ":" + std::to_string(o.port) + " (address in use or invalid)");

  engine.start();
  // First SIGINT/SIGTERM: drain (no new requests, in-flight ones get --shutdown-timeout to
  // finish), then stop (what is left ends with finish_reason "abort" and an error event).
  // A second signal exits at once.
  std::atomic<bool> run_returned{false};
  const double shutdown_timeout = o.shutdown_timeout;
  std::thread watcher([&server, &run_returned, stop_signals, shutdown_timeout] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    if (run_returned.load()) return;
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    std::fprintf(stderr, "\n%s: draining: new requests get 503; %d in flight get up to %g s (--shutdown-timeout); a second signal exits now\n",
                 name, server.in_flight(), shutdown_timeout);
    std::thread([stop_signals] {
      int again = 0;
      sigwait(&stop_signals, &again);
      std::fprintf(stderr, "%s again: exiting now\n", again == SIGINT ? "SIGINT" : "SIGTERM");
      std::_Exit(128 + again);
    }).detach();
    const bool idle = server.drain(shutdown_timeout);
    if (idle) std::fprintf(stderr, "drained: every request finished\n");
    else std::fprintf(stderr, "shutdown timeout: ending %d requests in flight (finish_reason \"abort\")\n", server.in_flight());
    server.stop();
  });

  const std::string url = "http://" + (o.host.find(':') != std::string::npos ? "[" + o.host + "]" : o.host) + ":" + std::to_string(o.port);
  std::fprintf(stderr, "serving %s at %s%s%s\n", ctx.model_names[0].c_str(), url.c_str(), o.debug ? " (debug: /debug/kv)" : "",
               role == kv::ServerRole::kBoth ? "" : (std::string(", role ") + o.role).c_str());
  std::fprintf(stderr, "chat in a browser: %s/   KV dashboard: %s/dashboard\n", url.c_str(), url.c_str());
  // The example must work as printed: a model without a chat template gets a completion, and
  // with keys the shell needs KVSERVE_API_KEY (a key is never printed to the log).
  const bool keys_from_env = std::getenv("KVSERVE_API_KEY") != nullptr;
  if (!o.api_keys.empty() && !keys_from_env) std::fprintf(stderr, "(the example reads KVSERVE_API_KEY: set it to one of the --api-key values)\n");
  const char* auth = o.api_keys.empty() ? "" : " -H \"Authorization: Bearer $KVSERVE_API_KEY\"";
  if (ctx.chat_template != nullptr)
    std::fprintf(stderr,
                 "try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s \\\n"
                 "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 64}'\n",
                 url.c_str(), auth, ctx.model_names[0].c_str());
  else
    std::fprintf(stderr,
                 "try:\n  curl %s/v1/completions -H 'Content-Type: application/json'%s \\\n"
                 "    -d '{\"model\": \"%s\", \"prompt\": \"The capital of France is\", \"max_tokens\": 32}'\n",
                 url.c_str(), auth, ctx.model_names[0].c_str());
  std::fflush(stderr);

  server.run();
  // run() also returns if listening fails; wake the watcher so it can be joined.
  run_returned.store(true);
  pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  engine.stop();
  std::fprintf(stderr, "stopped\n");
}
}  // namespace

void add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)");
  cmd->add_option("-m,--model", o->model, "GGUF model path")->capture_default_str();
  cmd->add_option("--host", o->host, "address to bind")->capture_default_str();
  cmd->add_option("--port", o->port, "port")->check(number_in(1, 65535))->capture_default_str();
  cmd->add_option("--api-key", o->api_keys,
                  "require Authorization: Bearer <key> on every route but /, /dashboard, /health and /metrics (env KVSERVE_API_KEY); repeat for several "
                  "tenants, whose prefix-cache pages are never shared and whose dashboards show only their own")
      ->envname("KVSERVE_API_KEY")
      ->check(non_empty())
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--served-model-name", o->served_model_name, "model id in the API (default: the file's stem); several are aliases, as vLLM's: responses and /v1/models name the first")->check(non_empty())->expected(1, -1);
  add_allowed_origins_option(cmd, &o->allowed_origins);
  cmd->add_flag("--trust-request-chat-template", o->trust_request_chat_template,
                "accept a request's own chat_template (vLLM's flag; off: such a request is a 400)");
  cmd->add_option("--chat-template", o->chat_template,
                  "the chat template instead of the model's: a built-in name (chatml, gemma3), a Jinja file, or the template itself");
  cmd->add_flag("--enable-auto-tool-choice", o->enable_auto_tool_choice,
                "accept tool_choice \"auto\" (the default with tools): the answer is parsed for calls by --tool-call-parser (vLLM's flags)");
  cmd->add_option("--tool-call-parser", o->tool_call_parser,
                  "how tool_choice \"auto\" finds calls in an answer: hermes (<tool_call>{\"name\", \"arguments\"}</tool_call>)")
      ->check(CLI::IsMember({"hermes"}));
  cmd->add_option("--max-num-batched-tokens", o->max_num_batched_tokens, "token budget per engine step")
      ->check(number_in(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--long-prefill-token-threshold", o->long_prefill_tokens,
                  "a prompt with more tokens left than this gets at most this many per step before waiting "
                  "requests are admitted, then what the step leaves (default: 0 = no cap; a quarter of --max-num-batched-tokens with --role prefill)")
      ->check(number_in(0, 1 << 20));
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "sequences per engine step (a request of n choices counts n)")->check(number_in(1, 4096))->capture_default_str();
  cmd->add_option("--max-model-len", o->max_model_len,
                  "prompt + completion tokens per sequence (default: the model's context; past it, a warning)")
      ->check(number_in(1, 1 << 24));
  cmd->add_flag("--past-trained-context", o->past_trained_context,
                "a --max-model-len past the model's training context is meant (positions it was never trained on): no warning");
  cmd->add_option("--max-queue", o->max_queue, "requests waiting for a sequence slot (beyond the free ones) before 429")->check(number_in(1, 1 << 20))->capture_default_str();
  cmd->add_option("--max-stored-responses", o->max_stored_responses,
                  "finished /v1/responses answers kept in memory (LRU) for GET, DELETE and previous_response_id; "
                  "0 keeps none (store is answered false, previous_response_id refused)")
      ->check(number_in(0, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--stored-responses-memory", o->stored_responses_memory,
                  "and at most this much of their JSON (each keeps its whole conversation), oldest first: bytes (256MiB) or a fraction of RAM")
      ->capture_default_str();
  cmd->add_option("--max-n", o->max_n, "largest n (choices per request)")->check(number_in(1, 256))->capture_default_str();
  cmd->add_option("-t,--threads", o->threads, "compute threads (default: all cores)")->check(number_in(1, 256));
  cmd->add_option("--http-threads", o->http_threads, "connection threads (default: max-num-seqs + max-queue + 8 + the dashboards that may be open, at most 1024; a request holds one until answered, queued ones too)")
      ->check(number_in(1, 4096));
  cmd->add_option("--max-dashboards", o->max_dashboards,
                  "KV dashboards (/dashboard/events streams) open at once; with API keys each key gets an equal share, at least one")
      ->check(number_in(1, 1024))
      ->capture_default_str();
  cmd->add_option("--max-body-size", o->max_body, "largest request body (413 above)")->capture_default_str();
  cmd->add_option("--shutdown-timeout", o->shutdown_timeout,
                  "seconds in-flight requests get to finish after SIGTERM/SIGINT before they are ended")
      ->check(non_negative())
      ->capture_default_str();
  cmd->add_option("--request-timeout", o->request_timeout,
                  "seconds a generation request may run before it is cancelled (504; streams end with an error event); 0: no limit")
      ->check(non_negative())
      ->capture_default_str();
  cmd->add_option("--http-read-timeout", o->http_read_timeout,
                  "seconds a client may take to send a request's line and headers (counted from its connection's opening or "
                  "last response), and again its body: a slower one is closed (body: 408); 0: no limit")
      ->check(non_negative())
      ->capture_default_str();
  cmd->add_flag("--debug", o->debug, "enable /debug/kv and log one line per request");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->prefix_caching,
                "reuse the KV pages of repeated prompt prefixes (default on)");
  cmd->add_option("--scheduling-policy", o->policy, "fcfs, or lpm: prefer the longest cached prefix (no starvation)")
      ->check(CLI::IsMember({"fcfs", "lpm"}))
      ->capture_default_str();
  add_kv_options(cmd, &o->kvo);
  add_eviction_options(cmd, &o->evo);
  CLI::Option* disk_dir = cmd->add_option("--kv-disk-dir", o->kv_disk_dir, "L2 KV tier: keep prefix pages in this directory (survives restarts)");
  CLI::Option* disk_bytes = cmd->add_option("--kv-disk-bytes", o->kv_disk_bytes, "L2 size, e.g. 20GiB (no fraction of RAM; at least one page); over it, pages no stored page continues go first (unreachable ones, then least recently used)")->capture_default_str();
  CLI::Option* redis = cmd->add_option("--kv-redis", o->kv_redis,
                  "L3 KV tier shared by instances: redis://HOST:PORT (repeat or comma-separate; a Redis Cluster is followed)")
      ->check([](const std::string& s) {  // at start, before the weights: "notaurl" was taken as a host
        size_t n = 0;
        for (size_t a = 0; a <= s.size();) {
          const size_t b = std::min(s.find(',', a), s.size());
          if (b > a) {
            auto e = kv::RedisStore::parse_address(s.substr(a, b - a));
            if (!e) return e.message();
            ++n;
          }
          a = b + 1;
        }
        return n > 0 ? std::string() : std::string("no address; want redis://HOST[:PORT] (port 6379 by default) or HOST:PORT");
      });
  CLI::Option* redis_ttl = cmd->add_option("--kv-redis-ttl", o->kv_redis_ttl, "seconds a page stays in Redis after its last write or read (0: no expiry); a prefix's first pages up to 1.5x that, so that a Redis with maxmemory-policy volatile-ttl evicts tails first")->check(number_in(0, 1 << 30))->capture_default_str();
  CLI::Option* redis_timeout = cmd->add_option("--kv-redis-timeout-ms", o->kv_redis_timeout_ms, "Redis connect / command timeout")
      ->check(number_in(1, 60000))
      ->capture_default_str();
  CLI::Option* tier_write = cmd->add_option("--kv-tier-write", o->kv_tier_write, "back: write a page down when RAM evicts it; through: as soon as it is full")
      ->check(CLI::IsMember({"back", "through"}))
      ->capture_default_str();
  CLI::Option* tier_min = cmd->add_option("--kv-tier-min-tokens", o->kv_tier_min_tokens, "look below RAM only when at least this many prompt tokens could come from there")
      ->check(number_in(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--speculative-config", o->speculative_config,
                  "speculative decoding for every request (a request's \"speculative\": false turns it off), vLLM's JSON: "
                  "'{\"method\": \"ngram\"|\"suffix\", \"num_speculative_tokens\": 5, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}'");
  cmd->add_option("--jump-forward-tokens", o->jump_forward_tokens,
                  "under structured outputs, the text the constraint forces next goes into one step as a draft of at most "
                  "this many tokens, verified as any draft (exact); 0: off")
      ->check(number_in(0, 256))
      ->capture_default_str();
  cmd->add_option("--preemption-mode", o->preemption_mode, "recompute, or swap: a preempted sequence's pages go to the KV tiers and come back")
      ->check(CLI::IsMember({"recompute", "swap"}))
      ->capture_default_str();
  cmd->add_option("--role", o->role,
                  "both; prefill: compute prompts, store their pages in the shared tier, answer one token; decode: take "
                  "prefilled requests from `kvserve router` (both need --kv-redis)")
      ->check(CLI::IsMember({"both", "prefill", "decode"}))
      ->capture_default_str();
  // A tier's settings without that tier did nothing, silently (a user test), where
  // --preemption-mode swap without a tier is refused: refused alike.
  disk_bytes->needs(disk_dir);
  redis_ttl->needs(redis);
  redis_timeout->needs(redis);
  cmd->callback([o, disk_dir, redis, tier_write, tier_min] {
    for (const CLI::Option* opt : {tier_write, tier_min})
      if (opt->count() > 0 && disk_dir->count() == 0 && redis->count() == 0)
        throw CLI::ValidationError(opt->get_name(), "sets how pages reach a KV tier: give --kv-disk-dir or --kv-redis");
    run_serve(*o);
  });
}

}  // namespace kvtools
