// kvserve generate: stream a continuation of a prompt to stdout.
#include <charconv>
#include <chrono>
#include <cstdio>
#include <random>

#include "commands.h"
#include "common/units.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/sequence_runner.h"
#include "loaded_model.h"

namespace kvtools {

namespace {
struct GenerateOptions {
  std::string model = kDefaultModel;
  std::string prompt;
  int n_predict = 64;
  int min_tokens = 0;  // vLLM's: no end of text before this many tokens
  int threads = 0;
  int chunk = 512;
  int ctx = 0;
  bool no_special = false;
  kv::SamplingParams sp;
  std::string seed;  // --seed as written: -1 or [0, 2^64) (CLI11's uint64_t took -5 and 2^64 silently)
  KvOptions kvo;
  EvictionOptions evo;
  std::string speculative_config;
};

// --speculative-config: the prompt goes through the engine (speculative decoding lives there),
// as one request; the text streams as it is accepted.
void run_generate_engine(const GenerateOptions& o, const kv::SpecConfig& spec) {
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, false, /*with_runtime=*/false);
  const auto& cfg = lm.model->config();
  std::vector<int32_t> toks = lm.tokenizer->encode(o.prompt, true, !o.no_special);
  if (toks.empty()) fail("the prompt is empty after tokenization");
  kv::EngineConfig ec;
  ec.max_model_len = static_cast<int32_t>(o.ctx > 0 ? o.ctx : cfg.n_ctx_train);
  if (static_cast<int64_t>(toks.size()) >= ec.max_model_len)
    fail("prompt is " + std::to_string(toks.size()) + " tokens, the context is " + std::to_string(ec.max_model_len));
  ec.max_num_batched_tokens = o.chunk;
  ec.max_num_seqs = 1;
  ec.block_size = o.kvo.block_size;
  auto bytes = kv::parse_kv_cache_memory(o.kvo.memory);
  if (!bytes) fail(bytes.message());
  ec.kv_cache_bytes = *bytes;
  ec.n_threads = o.threads > 0 ? o.threads : kv::default_thread_count();
  const kv::KvLayout layout = make_kv_layout(*lm.model, o.kvo);
  ec.kv_dtype = layout.dtype;
  ec.kv_layer_dtypes = model_layer_dtypes(*lm.model, o.kvo);
  ec.spec = spec;
  ec.kv_policy = make_eviction(o.evo, ec.block_size);
  if (ec.kv_policy.active())
    std::fprintf(stderr, "note: %s: sequences under a KV policy do not speculate (the engine's rule), so this runs without drafts\n",
                 ec.kv_policy.describe(ec.block_size).c_str());
  // an evicting policy whose budget leaves room goes on past the context, re-indexing (as without drafts)
  const bool past = ec.kv_policy.evicts() && ec.kv_policy.budget < ec.max_model_len;
  kv::Engine engine(*lm.model, *lm.tokenizer, ec);
  kv::Request req;
  req.id = engine.next_request_id();
  req.prompt = toks;
  req.params.sampling = o.sp;
  req.params.max_tokens = static_cast<int32_t>(
      past ? std::max(o.n_predict, 1) : std::min<int64_t>(std::max(o.n_predict, 1), ec.max_model_len - static_cast<int64_t>(toks.size())));
  req.params.min_tokens = std::min(o.min_tokens, req.params.max_tokens);  // a full context ends it first, as below
  req.stream = std::make_shared<kv::RequestStream>();
  if (kv::Rejection rej = engine.submit(req); rej.http_status) fail(rej.message);
  auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point t1{};
  int64_t n_gen = 0;
  std::vector<kv::StreamEvent> evs;
  bool more = true;
  while (more) {
    engine.step();
    evs.clear();
    more = req.stream->pop(&evs, std::chrono::milliseconds(0));
    for (const auto& ev : evs) {
      if (ev.kind == kv::StreamEvent::kError) fail(ev.error);
      if (ev.kind != kv::StreamEvent::kText) continue;
      if (n_gen == 0 && !ev.tokens.empty()) t1 = std::chrono::steady_clock::now();
      n_gen += static_cast<int64_t>(ev.tokens.size());
      std::fwrite(ev.text.data(), 1, ev.text.size(), stdout);
      std::fflush(stdout);
    }
  }
  std::fputc('\n', stdout);
  auto t2 = std::chrono::steady_clock::now();
  const double pf = std::chrono::duration<double>(t1 - t0).count(), dc = std::chrono::duration<double>(t2 - t1).count();
  const kv::MetricsSnapshot m = engine.metrics();
  std::fprintf(stderr, "prompt: %zu tokens + first token in %.3f s; generated: %lld more tokens in %.3f s (%.1f tok/s); %s: %lld of %lld draft tokens accepted\n",
               toks.size(), pf, static_cast<long long>(n_gen - 1), dc, n_gen > 1 ? (n_gen - 1) / dc : 0.0, spec.describe().c_str(),
               static_cast<long long>(m.spec_accepted_tokens_total), static_cast<long long>(m.spec_draft_tokens_total));
  if (engine.pages_in_use() != 0) fail("pages still in use after the request ended");
  if (kv::Status st = engine.check_integrity(); !st) fail("engine integrity: " + st.message());
}

void run_generate(const GenerateOptions& o) {
  if (!(o.sp.top_p > 0)) fail("--top-p must be more than 0 (as the server's top_p; 1 is off)");
  if (o.min_tokens > o.n_predict)  // as the server's min_tokens against max_tokens
    fail("--min-tokens " + std::to_string(o.min_tokens) + " is more than -n " + std::to_string(o.n_predict));
  // -n 0 only prefills: nothing to draft (the engine's path would produce one token).
  if (const kv::SpecConfig spec = parse_speculative_option(o.speculative_config); spec.enabled() && o.n_predict > 0)
    return run_generate_engine(o, spec);
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, false);
  const auto& cfg = lm.model->config();
  std::vector<int32_t> toks = lm.tokenizer->encode(o.prompt, true, !o.no_special);
  if (toks.empty()) fail("the prompt is empty after tokenization");
  const int64_t ctx = o.ctx > 0 ? o.ctx : cfg.n_ctx_train;
  if (static_cast<int64_t>(toks.size()) >= ctx)
    fail("prompt is " + std::to_string(toks.size()) + " tokens, the context is " + std::to_string(ctx) + " (use a shorter prompt or --ctx)");
  std::unique_ptr<kv::ColdStore> cold = make_cold_store(o.evo, *lm.pool);  // outlives seq, which holds its slots
  kv::SequenceRunner seq(*lm.model, *lm.pool, lm.pool_g1.get(), *lm.threads, o.chunk);
  const kv::EvictionConfig evc = make_eviction(o.evo, lm.pool->layout().block_size);
  if (kv::Status st = seq.set_eviction(evc, cold.get()); !st) fail(st.message());
  // An evicting policy whose budget is below the context goes on past it (re-indexing).
  const bool past_context = evc.evicts() && evc.budget < ctx;
  if (past_context) seq.set_max_positions(ctx);
  const int64_t max_new = past_context ? o.n_predict : std::min<int64_t>(o.n_predict, ctx - static_cast<int64_t>(toks.size()));
  if (ctx > cfg.n_ctx_train)
    std::fprintf(stderr, "note: --ctx %lld is past the model's training context (%lld tokens): expect worse text beyond it\n",
                 static_cast<long long>(ctx), static_cast<long long>(cfg.n_ctx_train));
  kv::Sampler sampler(o.sp);
  kv::IncrementalDetokenizer detok(*lm.tokenizer);
  std::vector<int32_t> history = toks;
  auto t0 = std::chrono::steady_clock::now();
  if (kv::Status st = seq.feed(toks.data(), static_cast<int64_t>(toks.size())); !st) fail(st.message());
  auto t1 = std::chrono::steady_clock::now();
  int64_t n_gen = 0;
  std::vector<float> logits;
  for (; n_gen < max_new; ++n_gen) {
    logits = seq.logits();
    if (n_gen < o.min_tokens) kv::mask_tokens(logits.data(), cfg.n_vocab, lm.tokenizer->eog_ids());  // no end of text yet
    int32_t id = sampler.sample(logits.data(), cfg.n_vocab, history);
    if (lm.tokenizer->is_eog(id)) break;
    history.push_back(id);
    std::string piece = detok.push(id);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (n_gen + 1 == max_new) { ++n_gen; break; }
    if (kv::Status st = seq.feed(&id, 1); !st) fail(st.message());
  }
  std::string rest = detok.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  if (max_new < o.n_predict && n_gen == max_new)  // not -n, not the end of text: say why it stopped
    std::fprintf(stderr, "stopped after %lld tokens: the context (--ctx %lld) is full\n", static_cast<long long>(n_gen),
                 static_cast<long long>(ctx));
  auto t2 = std::chrono::steady_clock::now();
  double pf = std::chrono::duration<double>(t1 - t0).count(), dc = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "prompt: %zu tokens in %.3f s (%.1f tok/s); generated: %lld tokens in %.3f s (%.1f tok/s)\n", toks.size(), pf,
               toks.size() / pf, static_cast<long long>(n_gen), dc, n_gen > 0 ? n_gen / dc : 0.0);
  if (evc.active())
    std::fprintf(stderr, "KV policy %s: %lld tokens kept, %lld evicted, %lld positions re-indexed\n", evc.describe(lm.pool->layout().block_size).c_str(),
                 static_cast<long long>(seq.kept_tokens()), static_cast<long long>(seq.evicted_tokens()), static_cast<long long>(seq.reindexed_tokens()));
  seq.reset();
  if (kv::Status st = lm.pool->check_integrity(); !st || lm.pool->n_used() != 0) fail("KV pool integrity: " + st.message());
}
}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "generate a continuation of a prompt, streamed to stdout");
  cmd->add_option("-m,--model", o->model, "GGUF model path")->capture_default_str();
  cmd->add_option("-p,--prompt", o->prompt, "prompt text")->required();
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate")->check(number_in(0, 1 << 20))->capture_default_str();
  cmd->add_option("--min-tokens", o->min_tokens, "no end of text before this many tokens (vLLM's min_tokens; at most -n)")
      ->check(number_in(0, 1 << 20));
  cmd->add_option("--temp", o->sp.temperature, "temperature (0 = greedy)")->check(number_in(0.0, 100.0))->capture_default_str();
  cmd->add_option("--top-k", o->sp.top_k, "top-k (0 = off)")->check(non_negative());
  cmd->add_option("--top-p", o->sp.top_p, "top-p in (0, 1] (1 = off)")->check(number_in(0.0, 1.0));
  cmd->add_option("--min-p", o->sp.min_p, "min-p (0 = off)")->check(number_in(0.0, 1.0));
  cmd->add_option("--repeat-penalty", o->sp.repetition_penalty, "repetition penalty (1 = off)")->check(number_in(0.01, 10.0));
  cmd->add_option("--seed", o->seed, "sampling seed (default, or -1: a random one, printed)")->check(seed_number(true));
  cmd->add_option("-t,--threads", o->threads, "threads (default: all cores)")->check(number_in(1, 256));
  cmd->add_option("--chunk", o->chunk, "prefill chunk size in tokens")->check(number_in(1, 1 << 16))->capture_default_str();
  cmd->add_option("--ctx", o->ctx, "context length (default: the model's)")->check(non_negative());
  add_eviction_options(cmd, &o->evo);  // --kv-eviction sinks --kv-budget N: past --ctx with re-indexing
  cmd->add_flag("--no-special", o->no_special, "treat special-token text in the prompt as plain text");
  cmd->add_option("--speculative-config", o->speculative_config,
                  "speculative decoding (runs through the engine), vLLM's JSON: '{\"method\": \"ngram\"|\"suffix\", \"num_speculative_tokens\": 5}'");
  add_kv_options(cmd, &o->kvo);
  cmd->callback([o] {
    // As llama.cpp: no seed (or -1) is a fresh one each run, told so that a run can be repeated.
    if (!o->seed.empty() && o->seed != "-1") {
      std::from_chars(o->seed.data(), o->seed.data() + o->seed.size(), o->sp.seed);  // checked above
    } else {
      // below 2^63: the server and the Python API take seeds up to 2^63 - 1 (OpenAI's int64)
      o->sp.seed = ((uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()) >> 1;
      if (o->sp.temperature > 0) std::fprintf(stderr, "seed: %llu (--seed to repeat)\n", static_cast<unsigned long long>(o->sp.seed));
    }
    run_generate(*o);
  });
}

}  // namespace kvtools
