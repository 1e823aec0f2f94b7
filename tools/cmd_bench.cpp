// kvserve bench: prefill and decode speed on one sequence, medians over repeats, as JSON.
// Mirrors llama-bench: pp = a prompt of random tokens in one pass (chunked), tg = tokens
// decoded one at a time after `--context` tokens already in the cache. The context is
// prefilled once; after each tg repeat the sequence is rolled back to it (truncate).
// --measure-bandwidth also times a plain read loop over a large buffer on the same threads:
// the machine's read bandwidth, the ceiling of decode's effective GB/s.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  bool measure_bandwidth = false;
  int bandwidth_mib = 1024;
  int bandwidth_passes = 9;
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

// Sums [p, p + n) (n a multiple of 256 bytes) with 512-bit loads into four accumulators.
__attribute__((target("avx512f"))) uint64_t read_sum_avx512(const uint8_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}
uint64_t read_sum_scalar(const uint8_t* p, int64_t n) {
  uint64_t a[4] = {};
  for (int64_t i = 0; i < n; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t x;
      std::memcpy(&x, p + i + 8 * k, 8);
      a[k] += x;
    }
  return a[0] + a[1] + a[2] + a[3];
}

// The machine's read bandwidth on these threads: each thread sums its contiguous share of a
// buffer far larger than the caches; median GB/s over passes (after one untimed pass).
nlohmann::json measure_bandwidth(kv::ThreadPool& tp, int64_t bytes, int passes, bool quiet) {
  bytes = std::max<int64_t>(bytes / 4096 * 4096, 4096);
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, static_cast<size_t>(bytes)));
  if (!buf) fail("cannot allocate the bandwidth buffer");
  std::memset(buf, 1, static_cast<size_t>(bytes));  // real pages, not the shared zero page
  const bool avx512 = __builtin_cpu_supports("avx512f");
  std::vector<uint64_t> sums(tp.size() * 8, 0);  // one cache line per thread
  std::vector<double> gbs;
  using clock = std::chrono::steady_clock;
  for (int pass = 0; pass <= passes; ++pass) {
    auto t0 = clock::now();
    tp.run([&](int ith, int nth) {
      int64_t b, e;
      kv::ThreadPool::split(bytes, ith, nth, 4096, &b, &e);
      sums[ith * 8] += avx512 ? read_sum_avx512(buf + b, e - b) : read_sum_scalar(buf + b, e - b);
    });
    const double s = std::chrono::duration<double>(clock::now() - t0).count();
    if (pass > 0) gbs.push_back(bytes / s / 1e9);
  }
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  std::free(buf);
  std::vector<double> sorted = gbs;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double med = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  if (!quiet) std::fprintf(stderr, "machine read bandwidth: %.1f GB/s (median of %d passes over %.0f MiB, %d threads)\n", med, passes,
                           bytes / 1048576.0, tp.size());
  nlohmann::json j;
  j["gb_s"] = med;
  j["gb_s_min"] = sorted.front();
  j["gb_s_max"] = sorted.back();
  j["passes"] = gbs;
  j["buffer_bytes"] = bytes;
  j["threads"] = tp.size();
  j["loads"] = avx512 ? "avx512" : "scalar";
  j["checksum"] = total;  // keeps the sums live
  return j;
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
  kv::SequenceRunner seq(*lm.model, *lm.pool, lm.pool_g1.get(), *lm.threads, o.chunk);
  // Warm-up: touches every weight page and sizes the scratch buffers.
  if (kv::Status st = seq.feed(prompt.data(), std::min<int64_t>(o.chunk, static_cast<int64_t>(prompt.size()))); !st) fail(st.message());
  seq.reset();
  for (int r = 0; r < o.repeat && o.prompt_tokens > 0; ++r) {
    auto t0 = clock::now();
    if (kv::Status st = seq.feed(prompt.data(), o.prompt_tokens); !st) fail(st.message());
    pp.push_back(o.prompt_tokens / std::chrono::duration<double>(clock::now() - t0).count());
    seq.reset();
    if (!o.json) std::fprintf(stderr, "repeat %d/%d: pp %.1f tok/s\n", r + 1, o.repeat, pp.back());
  }
  double context_prefill_s = 0;
  if (o.gen_tokens > 0) {
    // The context once; every repeat decodes from it and rolls back to it.
    if (o.context > 0) {
      auto t0 = clock::now();
      if (kv::Status st = seq.feed(prompt.data(), o.context, false); !st) fail(st.message());
      context_prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
      if (!o.json) std::fprintf(stderr, "context: %d tokens prefilled in %.2f s\n", o.context, context_prefill_s);
    }
    for (int r = 0; r < o.repeat; ++r) {
      int32_t tok = prompt[0];
      auto t0 = clock::now();
      for (int i = 0; i < o.gen_tokens; ++i) {
        if (kv::Status st = seq.feed(&tok, 1); !st) fail(st.message());
        tok = kv::argmax(seq.logits().data(), cfg.n_vocab);
      }
      tg.push_back(o.gen_tokens / std::chrono::duration<double>(clock::now() - t0).count());
      // A hybrid model's sliding-window pages of the context may be gone: then prefill again.
      if (!seq.truncate(o.context))
        if (kv::Status st = seq.feed(prompt.data(), o.context, false); !st) fail(st.message());
      if (seq.n_tokens() != o.context) fail("truncate left " + std::to_string(seq.n_tokens()) + " tokens");
      if (!o.json) std::fprintf(stderr, "repeat %d/%d: tg %.1f tok/s at context %d\n", r + 1, o.repeat, tg.back(), o.context);
    }
    seq.reset();
  }
  // Bytes one decode token reads: all weights once + the KV of the average context position.
  const double kv_tok = static_cast<double>(lm.pool->layout().bytes_per_token());
  const double avg_ctx = o.context + (o.gen_tokens - 1) / 2.0;
  const double bytes_per_tok = static_cast<double>(lm.model->weight_bytes_per_token()) + kv_tok * avg_ctx;
  nlohmann::json j;
  j["model"] = o.model;
  j["threads"] = lm.threads->size();
  j["isa"] = kv::isa_name(kv::detect_isa());
  j["kv_cache_dtype"] = lm.pool->layout().describe();
  j["kv_bytes_per_token"] = kv_tok;
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
    j["decode_weight_bytes_per_token"] = lm.model->weight_bytes_per_token();
    j["decode_kv_bytes_per_token"] = kv_tok * avg_ctx;
    if (o.context > 0) j["context_prefill_s"] = context_prefill_s;
  }
  if (o.measure_bandwidth) {
    nlohmann::json bw = measure_bandwidth(*lm.threads, int64_t(o.bandwidth_mib) << 20, o.bandwidth_passes, o.json);
    j["machine_read_gb_s"] = bw["gb_s"];
    j["machine_bandwidth"] = bw;
    if (!tg.empty()) j["decode_bandwidth_fraction"] = j["decode_effective_gb_s"].get<double>() / bw["gb_s"].get<double>();
  }
  std::printf("%s\n", j.dump(o.json ? -1 : 2).c_str());
  if (kv::Status st = lm.pool->check_integrity(); !st || lm.pool->n_used() != 0) fail("KV pool integrity: " + st.message());
  if (lm.pool_g1)
    if (kv::Status st = lm.pool_g1->check_integrity(); !st || lm.pool_g1->n_used() != 0) fail("KV pool integrity (sliding-window layers): " + st.message());
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
  cmd->add_flag("--measure-bandwidth", o->measure_bandwidth,
                "also measure the machine's read bandwidth (a read loop over a large buffer, same threads)");
  cmd->add_option("--bandwidth-mib", o->bandwidth_mib, "buffer of the bandwidth loop, MiB")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  cmd->add_option("--bandwidth-passes", o->bandwidth_passes, "timed passes of the bandwidth loop (median)")->check(CLI::Range(1, 1000))->capture_default_str();
  add_kv_options(cmd, &o->kvo);
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace kvtools
