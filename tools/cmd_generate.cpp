// kvserve generate: stream a continuation of a prompt to stdout.
#include <chrono>
#include <cstdio>

#include "commands.h"
#include "engine/sampler.h"
#include "engine/sequence_runner.h"
#include "loaded_model.h"

namespace kvtools {

namespace {
struct GenerateOptions {
  std::string model = kDefaultModel;
  std::string prompt;
  int n_predict = 64;
  int threads = 0;
  int chunk = 512;
  int ctx = 0;
  bool no_special = false;
  kv::SamplingParams sp;
  KvOptions kvo;
};

void run_generate(const GenerateOptions& o) {
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, false);
  const auto& cfg = lm.model->config();
  std::vector<int32_t> toks = lm.tokenizer->encode(o.prompt, true, !o.no_special);
  if (toks.empty()) fail("the prompt is empty after tokenization");
  const int64_t ctx = o.ctx > 0 ? o.ctx : cfg.n_ctx_train;
  if (static_cast<int64_t>(toks.size()) >= ctx)
    fail("prompt is " + std::to_string(toks.size()) + " tokens, the context is " + std::to_string(ctx) + " (use a shorter prompt or --ctx)");
  const int64_t max_new = std::min<int64_t>(o.n_predict, ctx - static_cast<int64_t>(toks.size()));

  kv::SequenceRunner seq(*lm.model, *lm.pool, lm.pool_g1.get(), *lm.threads, o.chunk);
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
  auto t2 = std::chrono::steady_clock::now();
  double pf = std::chrono::duration<double>(t1 - t0).count(), dc = std::chrono::duration<double>(t2 - t1).count();
  std::fprintf(stderr, "prompt: %zu tokens in %.3f s (%.1f tok/s); generated: %lld tokens in %.3f s (%.1f tok/s)\n", toks.size(), pf,
               toks.size() / pf, static_cast<long long>(n_gen), dc, n_gen > 0 ? n_gen / dc : 0.0);
  seq.reset();
  if (kv::Status st = lm.pool->check_integrity(); !st || lm.pool->n_used() != 0) fail("KV pool integrity: " + st.message());
}
}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "generate a continuation of a prompt, streamed to stdout");
  cmd->add_option("-m,--model", o->model, "GGUF model path")->capture_default_str();
  cmd->add_option("-p,--prompt", o->prompt, "prompt text")->required();
  cmd->add_option("-n,--n-predict", o->n_predict, "tokens to generate")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  cmd->add_option("--temp", o->sp.temperature, "temperature (0 = greedy)")->check(CLI::Range(0.0, 100.0))->capture_default_str();
  cmd->add_option("--top-k", o->sp.top_k, "top-k (0 = off)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o->sp.top_p, "top-p (1 = off)")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--min-p", o->sp.min_p, "min-p (0 = off)")->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--repeat-penalty", o->sp.repetition_penalty, "repetition penalty (1 = off)")->check(CLI::Range(0.01, 10.0));
  cmd->add_option("--seed", o->sp.seed, "sampling seed");
  cmd->add_option("-t,--threads", o->threads, "threads (default: all cores)")->check(CLI::Range(1, 256));
  cmd->add_option("--chunk", o->chunk, "prefill chunk size in tokens")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  cmd->add_option("--ctx", o->ctx, "context length (default: the model's)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-special", o->no_special, "treat special-token text in the prompt as plain text");
  add_kv_options(cmd, &o->kvo);
  cmd->callback([o] { run_generate(*o); });
}

}  // namespace kvtools
