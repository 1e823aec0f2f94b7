// kvserve bench: prefill and decode speed on one sequence, medians over repeats, as JSON.
// Mirrors llama-bench: pp = a prompt of random tokens in one pass (chunked), tg = tokens
// decoded one at a time after `--context` tokens already in the cache.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/sampler.h"
#include "engine/sequence_runner.h"
#include "loaded_model.h"

namespace kvtools {

namespace {
struct BenchOptions {
  std::string model = kDefaultModel;
  int prompt_tokens = 512;
  int gen_tokens = 128;
  int context = 0;
  int threads = 0;
  int repeat = 5;
  int chunk = 512;
  bool json = false;
  KvOptions kvo;
};

struct Stats {
  double median, min, max;
};
Stats stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  double med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return {med, v.front(), v.back()};
}

void run_bench(const BenchOptions& o) {
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, o.json);
  const auto& cfg = lm.model->config();
  // Deterministic pseudo-random prompt tokens, away from the control-token range.
  std::vector<int32_t> prompt(std::max({o.prompt_tokens, o.context, 1}));
  uint64_t s = 12345;
  for (auto& t : prompt) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int32_t>(100 + (s >> 33) % (cfg.n_vocab - 100));
  }
  using clock = std::chrono::steady_clock;
  std::vector<double> pp, tg;
  kv::SequenceRunner seq(*lm.model, *lm.pool, *lm.threads, o.chunk);
  // Warm-up: touches every weight page and sizes the scratch buffers.
  if (kv::Status st = seq.feed(prompt.data(), std::min<int64_t>(o.chunk, static_cast<int64_t>(prompt.size()))); !st) fail(st.message());
  seq.reset();
  for (int r = 0; r < o.repeat; ++r) {
    if (o.prompt_tokens > 0) {
      auto t0 = clock::now();
      if (kv::Status st = seq.feed(prompt.data(), o.prompt_tokens); !st) fail(st.message());
      pp.push_back(o.prompt_tokens / std::chrono::duration<double>(clock::now() - t0).count());
      seq.reset();
    }
    if (o.gen_tokens > 0) {
      if (o.context > 0)
        if (kv::Status st = seq.feed(prompt.data(), o.context, false); !st) fail(st.message());
      int32_t tok = prompt[0];
      auto t0 = clock::now();
      for (int i = 0; i < o.gen_tokens; ++i) {
        if (kv::Status st = seq.feed(&tok, 1); !st) fail(st.message());
        tok = kv::argmax(seq.logits().data(), cfg.n_vocab);
      }
      tg.push_back(o.gen_tokens / std::chrono::duration<double>(clock::now() - t0).count());
      seq.reset();
    }
    if (!o.json)
      std::fprintf(stderr, "repeat %d/%d: pp %.1f tok/s, tg %.1f tok/s\n", r + 1, o.repeat, pp.empty() ? 0.0 : pp.back(),
                   tg.empty() ? 0.0 : tg.back());
  }
  // Bytes one decode token reads: all weights once + the KV of the average context position.
  const double kv_tok = static_cast<double>(lm.pool->layout().bytes_per_token());
  const double avg_ctx = o.context + (o.gen_tokens - 1) / 2.0;
  const double bytes_per_tok = static_cast<double>(lm.model->weight_bytes_per_token()) + kv_tok * avg_ctx;
  nlohmann::json j;
  j["model"] = o.model;
  j["threads"] = lm.threads->size();
  j["isa"] = kv::isa_name(kv::detect_isa());
  j["kv_cache_dtype"] = kv::kv_dtype_name(lm.pool->layout().dtype);
  j["prompt_tokens"] = o.prompt_tokens;
  j["gen_tokens"] = o.gen_tokens;
  j["context"] = o.context;
  j["repeat"] = o.repeat;
  if (!pp.empty()) {
    Stats p = stats(pp);
    j["prefill_tok_s"] = p.median;
    j["prefill_tok_s_min"] = p.min;
    j["prefill_tok_s_max"] = p.max;
  }
  if (!tg.empty()) {
    Stats d = stats(tg);
    j["decode_tok_s"] = d.median;
    j["decode_tok_s_min"] = d.min;
    j["decode_tok_s_max"] = d.max;
    j["decode_bytes_per_token"] = bytes_per_tok;
    j["decode_effective_gb_s"] = bytes_per_tok * d.median / 1e9;
  }
  std::printf("%s\n", j.dump(o.json ? -1 : 2).c_str());
  if (kv::Status st = lm.pool->check_integrity(); !st || lm.pool->n_used() != 0) fail("KV pool integrity: " + st.message());
}
}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand("bench", "measure prefill and decode speed (JSON)");
  cmd->add_option("-m,--model", o->model, "GGUF model path")->capture_default_str();
  cmd->add_option("--prompt-tokens,-p", o->prompt_tokens, "prefill test length (0 = skip)")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  cmd->add_option("--gen-tokens,-n", o->gen_tokens, "decode test length (0 = skip)")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  cmd->add_option("--context,-d", o->context, "tokens already in the KV cache before decoding")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  cmd->add_option("-t,--threads", o->threads, "threads (default: all cores)")->check(CLI::Range(1, 256));
  cmd->add_option("--repeat,-r", o->repeat, "repeats (medians reported)")->check(CLI::Range(1, 1000))->capture_default_str();
  cmd->add_option("--chunk", o->chunk, "prefill chunk size")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  cmd->add_flag("--json", o->json, "one JSON object on stdout, no progress");
  add_kv_options(cmd, &o->kvo);
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace kvtools
