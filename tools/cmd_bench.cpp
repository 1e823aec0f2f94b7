// kvserve bench: prefill and decode speed on one sequence, medians over repeats, as JSON.
// Mirrors llama-bench: pp = a prompt of random tokens in one pass (chunked), tg = tokens
// decoded one at a time after `--context` tokens already in the cache. The context is
// prefilled once; after each tg repeat the sequence is rolled back to it (truncate).
// --measure-bandwidth also times a plain read loop over a large buffer on the same threads:
// the machine's read bandwidth, the ceiling of decode's effective GB/s. It runs just before
// each decode repeat (decode_bandwidth_fraction: the median of each repeat's fraction of its
// own moment's bandwidth, for hosts whose bandwidth moves) and once more at the end.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "commands.h"
#include "common/units.h"
#include "engine/engine.h"
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
  int batch = 0;  // > 0: that many sequences decode together through the engine
  kv::SamplingParams sp;
  KvOptions kvo;
  EvictionOptions evo;
  std::string speculative_config;  // --batch: speculative decoding for every sequence
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
  alignas(64) uint64_t lanes[8];  // a store, not _mm512_reduce_add_epi64 (GCC 12 warns inside it)
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  uint64_t sum = 0;
  for (uint64_t x : lanes) sum += x;
  return sum;
}
// The same with 256-bit loads (hosts without AVX-512).
__attribute__((target("avx2"))) uint64_t read_sum_avx2(const uint8_t* p, int64_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t l[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return l[0] + l[1] + l[2] + l[3];
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

// A plain read loop on these threads: each thread sums its contiguous share of a buffer far
// larger than the caches. The machine's read bandwidth, the ceiling of decode's effective GB/s.
class ReadLoop {
 public:
  ReadLoop(kv::ThreadPool& tp, int64_t bytes) : tp_(tp), bytes_(std::max<int64_t>(bytes / 4096 * 4096, 4096)) {
    buf_ = static_cast<uint8_t*>(std::aligned_alloc(4096, static_cast<size_t>(bytes_)));
    if (!buf_) fail("cannot allocate the bandwidth buffer");
    std::memset(buf_, 1, static_cast<size_t>(bytes_));  // real pages, not the shared zero page
    sums_.assign(tp.size() * 8, 0);                     // one cache line per thread
    pass();                                             // untimed: first touch done, caches warm
  }
  ~ReadLoop() { std::free(buf_); }
  ReadLoop(const ReadLoop&) = delete;
  ReadLoop& operator=(const ReadLoop&) = delete;

  double pass() {  // GB/s of one pass over the buffer
    const auto t0 = std::chrono::steady_clock::now();
    tp_.run([&](int ith, int nth) {
      int64_t b, e;
      kv::ThreadPool::split(bytes_, ith, nth, 4096, &b, &e);
      sums_[ith * 8] += avx512_ ? read_sum_avx512(buf_ + b, e - b) : avx2_ ? read_sum_avx2(buf_ + b, e - b) : read_sum_scalar(buf_ + b, e - b);
    });
    return bytes_ / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
  }
  std::vector<double> passes(int n) {
    std::vector<double> gbs;
    for (int i = 0; i < n; ++i) gbs.push_back(pass());
    return gbs;
  }
  // The summary of `n` passes, as --measure-bandwidth reports it.
  nlohmann::json measure(int n, bool quiet) {
    const std::vector<double> gbs = passes(n);
    const Stats st = stats(gbs);
    if (!quiet)
      std::fprintf(stderr, "machine read bandwidth: %.1f GB/s (median of %d passes over %.0f MiB, %d threads)\n", st.median, n,
                   bytes_ / 1048576.0, tp_.size());
    uint64_t total = 0;
    for (uint64_t x : sums_) total += x;
    nlohmann::json j;
    j["gb_s"] = st.median;
    j["gb_s_min"] = st.min;
    j["gb_s_max"] = st.max;
    j["passes"] = gbs;
    j["buffer_bytes"] = bytes_;
    j["threads"] = tp_.size();
    j["loads"] = avx512_ ? "avx512" : avx2_ ? "avx2" : "scalar";
    j["checksum"] = total;  // keeps the sums live
    return j;
  }
 private:
  kv::ThreadPool& tp_;
  const int64_t bytes_;
  uint8_t* buf_ = nullptr;
  std::vector<uint64_t> sums_;
  const bool avx512_ = __builtin_cpu_supports("avx512f");
  const bool avx2_ = !avx512_ && __builtin_cpu_supports("avx2");
};

// --batch N: N sequences of random prompts decode together through the engine (continuous
// batching, the server's path, with the sampling parameters given), each for gen_tokens.
// Decode throughput counts from the step where every sequence has its first token to the end;
// the step profile (kvserve:step_phase_seconds) over the same steps says where the time went.
void run_bench_batch(const BenchOptions& o) {
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, o.json, /*with_runtime=*/false);
  const auto& cfg = lm.model->config();
  const int n_seq = o.batch;
  // A sequence's prompt is its context before decoding: -p tokens, plus -d (depth) ones.
  const int n_prompt = std::max(o.prompt_tokens + o.context, 1);
  kv::EngineConfig ec;
  ec.max_num_seqs = n_seq;
  ec.max_num_batched_tokens = std::max(o.chunk, n_seq);
  ec.max_model_len = n_prompt + o.gen_tokens + 1;
  ec.max_queue = n_seq;
  ec.block_size = o.kvo.block_size;
  auto bytes = kv::parse_kv_cache_memory(o.kvo.memory);
  if (!bytes) fail(bytes.message());
  ec.kv_cache_bytes = *bytes;
  ec.n_threads = o.threads > 0 ? o.threads : kv::default_thread_count();
  ec.enable_prefix_caching = false;  // distinct random prompts: nothing to share
  ec.kv_policy = make_eviction(o.evo, o.kvo.block_size);  // --kv-eviction / --kv-sparse for every sequence
  ec.kv_offload_dir = o.evo.offload_dir;
  ec.spec = parse_speculative_option(o.speculative_config);
  const kv::KvLayout layout = make_kv_layout(*lm.model, o.kvo);
  ec.kv_dtype = layout.dtype;
  ec.kv_layer_dtypes = model_layer_dtypes(*lm.model, o.kvo);
  kv::Engine engine(*lm.model, *lm.tokenizer, ec);
  if (int64_t(engine.pool().n_pages()) * ec.block_size < int64_t(n_seq) * (ec.max_model_len + ec.block_size))
    fail("--kv-cache-memory " + o.kvo.memory + " does not hold " + std::to_string(n_seq) + " sequences of " +
         std::to_string(ec.max_model_len) + " tokens");
  uint64_t rng = 12345;
  auto random_prompt = [&] {
    std::vector<int32_t> p(n_prompt);
    for (auto& t : p) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      t = static_cast<int32_t>(100 + (rng >> 33) % (cfg.n_vocab - 100));
    }
    return p;
  };
  using clock = std::chrono::steady_clock;
  std::vector<double> tok_s, step_ms;
  std::vector<std::vector<double>> share(kv::kNumStepPhases);  // [phase][repeat] fraction of decode time
  for (int r = 0; r <= o.repeat; ++r) {  // round 0 warms up (pages touched, scratch sized)
    std::vector<std::shared_ptr<kv::RequestStream>> streams;
    for (int i = 0; i < n_seq; ++i) {
      kv::Request req;
      req.id = engine.next_request_id();
      req.prompt = random_prompt();
      req.params.max_tokens = o.gen_tokens;
      req.params.ignore_eos = true;
      req.params.sampling = o.sp;
      req.params.sampling.seed = o.sp.seed + static_cast<uint64_t>(r) * 1000 + i;
      req.stream = std::make_shared<kv::RequestStream>();
      if (kv::Rejection rej = engine.submit(req); rej.http_status) fail("submit: " + rej.message);
      streams.push_back(req.stream);
    }
    const kv::MetricsSnapshot mb = engine.metrics();
    const int64_t gen0 = mb.generation_tokens_total;
    // Prompts and first tokens: until every prompt is computed (a long prompt takes several
    // chunked steps while the sequences done with theirs already decode).
    auto prefilling = [&] {
      const kv::MetricsSnapshot m = engine.metrics();
      return m.prompt_tokens_total - mb.prompt_tokens_total < int64_t(n_seq) * n_prompt || m.generation_tokens_total - gen0 < n_seq;
    };
    while (prefilling())
      if (!engine.step()) fail("the engine stopped before every prompt was computed");
    const kv::MetricsSnapshot m0 = engine.metrics();
    const auto t0 = clock::now();
    while (engine.step()) {
    }
    const double secs = std::chrono::duration<double>(clock::now() - t0).count();
    const kv::MetricsSnapshot m1 = engine.metrics();
    const double n_tok = static_cast<double>(m1.generation_tokens_total - m0.generation_tokens_total);
    // Every sequence made all its tokens. (With long prompts prefilled over several steps, a
    // sequence whose prompt finished early decodes while the last ones still prefill: those
    // tokens fall before t0, so n_tok can be under n_seq · (gen_tokens − 1).)
    const int64_t made = m1.generation_tokens_total - gen0;
    if (made != int64_t(n_seq) * o.gen_tokens)
      fail("generated " + std::to_string(made) + " tokens, expected " + std::to_string(int64_t(n_seq) * o.gen_tokens));
    if (r == 0) continue;
    tok_s.push_back(n_tok / secs);
    const double n_steps = static_cast<double>(m1.steps_total - m0.steps_total);
    double total = 0;
    std::vector<double> ph(kv::kNumStepPhases);
    for (int i = 0; i < kv::kNumStepPhases; ++i) total += (ph[i] = m1.step_phase[i].sum() - m0.step_phase[i].sum());
    for (int i = 0; i < kv::kNumStepPhases; ++i) share[i].push_back(ph[i] / total);
    step_ms.push_back(1e3 * total / n_steps);
    if (!o.json)
      std::fprintf(stderr, "repeat %d/%d: %d sequences, decode %.1f tok/s aggregate (%.2f ms a step, sample %.1f%%)\n", r, o.repeat,
                   n_seq, tok_s.back(), step_ms.back(), 100 * share[static_cast<int>(kv::StepPhase::kSample)].back());
  }
  if (engine.pages_in_use() != 0) fail("pages still in use after every sequence ended");
  if (kv::Status st = engine.check_integrity(); !st) fail("engine integrity: " + st.message());
  nlohmann::json j;
  j["model"] = o.model;
  j["mode"] = "batch";
  {
    const kv::MetricsSnapshot ms = engine.metrics();
    j["speculative"] = ec.spec.describe();
    j["spec_draft_tokens"] = ms.spec_draft_tokens_total;
    j["spec_accepted_tokens"] = ms.spec_accepted_tokens_total;
  }
  j["batch"] = n_seq;
  j["threads"] = ec.n_threads;
  j["isa"] = kv::isa_name(kv::detect_isa());
  j["kv_cache_dtype"] = layout.describe();
  j["prompt_tokens"] = n_prompt;
  j["context"] = o.context;
  j["gen_tokens"] = o.gen_tokens;
  j["repeat"] = o.repeat;
  j["sampling"] = {{"temperature", o.sp.temperature}, {"top_k", o.sp.top_k}, {"top_p", o.sp.top_p}, {"min_p", o.sp.min_p}};
  const Stats d = stats(tok_s);
  j["decode_tok_s"] = d.median;
  j["decode_tok_s_min"] = d.min;
  j["decode_tok_s_max"] = d.max;
  j["decode_tok_s_per_sequence"] = d.median / n_seq;
  j["step_ms"] = stats(step_ms).median;
  nlohmann::json phases;
  for (int i = 0; i < kv::kNumStepPhases; ++i) phases[kv::step_phase_name(static_cast<kv::StepPhase>(i))] = stats(share[i]).median;
  j["step_phase_share"] = phases;  // median over repeats of each phase's fraction of decode-step time
  std::printf("%s\n", j.dump(o.json ? -1 : 2).c_str());
}

void run_bench(const BenchOptions& o) {
  if (o.batch > 0) return run_bench_batch(o);
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, o.json);
  const auto& cfg = lm.model->config();
  // A context past what the model was trained on still runs (RoPE extrapolates), as serve warns.
  const int64_t ctx_tokens = int64_t(o.prompt_tokens) + o.context + o.gen_tokens;
  if (cfg.n_ctx_train > 0 && ctx_tokens > cfg.n_ctx_train)
    std::fprintf(stderr, "warning: -d + -p + -n = %lld tokens of context, past the %lld this model was trained on: its output there "
                 "is not what the model was made for (speed still measures)\n",
                 static_cast<long long>(ctx_tokens), static_cast<long long>(cfg.n_ctx_train));
  // Deterministic pseudo-random prompt tokens, away from the control-token range.
  std::vector<int32_t> prompt(std::max({o.prompt_tokens, o.context, 1}));
  uint64_t s = 12345;
  for (auto& t : prompt) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int32_t>(100 + (s >> 33) % (cfg.n_vocab - 100));
  }
  using clock = std::chrono::steady_clock;
  std::vector<double> pp, tg;
  std::unique_ptr<kv::ColdStore> cold = make_cold_store(o.evo, *lm.pool);  // outlives seq, which holds its slots
  kv::SequenceRunner seq(*lm.model, *lm.pool, lm.pool_g1.get(), *lm.threads, o.chunk);
  const kv::EvictionConfig evc = make_eviction(o.evo, lm.pool->layout().block_size);
  if (kv::Status st = seq.set_eviction(evc, cold.get()); !st) fail(st.message());
  double kv_tokens_read = -1;  // per decode token under a policy (kept tokens, or Quest's pages)
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
  kv::ColdStats cold_at_decode;  // the cold store's counters when decoding starts
  std::unique_ptr<ReadLoop> read_loop;  // --measure-bandwidth
  std::vector<double> read_before;      // GB/s of the read loop just before decode repeat r
  if (o.gen_tokens > 0) {
    // The context once; every repeat decodes from it and rolls back to it.
    if (o.context > 0) {
      auto t0 = clock::now();
      if (kv::Status st = seq.feed(prompt.data(), o.context, false); !st) fail("-d " + std::to_string(o.context) + ": " + st.message());
      context_prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
      if (!o.json) std::fprintf(stderr, "context: %d tokens prefilled in %.2f s\n", o.context, context_prefill_s);
      if (evc.evicts()) kv_tokens_read = static_cast<double>(seq.kept_tokens());
      if (evc.sparse())
        kv_tokens_read = std::min<double>(o.context, double(evc.quest_pages_read(lm.pool->layout().block_size)) *
                                                         lm.pool->layout().block_size);
      if (!o.json && evc.active())
        std::fprintf(stderr, "KV policy %s: decode reads ~%.0f of %d context tokens\n", evc.describe(lm.pool->layout().block_size).c_str(),
                     kv_tokens_read, o.context);
    }
    if (cold) cold_at_decode = cold->stats();
    if (o.measure_bandwidth) read_loop = std::make_unique<ReadLoop>(*lm.threads, int64_t(o.bandwidth_mib) << 20);
    for (int r = 0; r < o.repeat; ++r) {
      // The read loop just before each repeat: on a host whose bandwidth moves between runs (a
      // shared VM), each repeat is compared with the bandwidth of its own moment.
      if (read_loop) read_before.push_back(stats(read_loop->passes(3)).median);
      int32_t tok = prompt[0];
      auto t0 = clock::now();
      for (int i = 0; i < o.gen_tokens; ++i) {
        if (kv::Status st = seq.feed(&tok, 1); !st) fail(st.message());
        tok = kv::argmax(seq.logits().data(), cfg.n_vocab);
      }
      tg.push_back(o.gen_tokens / std::chrono::duration<double>(clock::now() - t0).count());
      if (!o.json) std::fprintf(stderr, "repeat %d/%d: tg %.1f tok/s at context %d\n", r + 1, o.repeat, tg.back(), o.context);
      if (r + 1 == o.repeat) break;  // no rollback after the last one
      // A hybrid model's sliding-window pages of the context may be gone: then prefill again.
      if (!seq.truncate(o.context))
        if (kv::Status st = seq.feed(prompt.data(), o.context, false); !st) fail(st.message());
      if (seq.n_tokens() != o.context) fail("truncate left " + std::to_string(seq.n_tokens()) + " tokens");
    }
    seq.reset();
  }
  // Bytes one decode token reads: all weights once + the KV of the average context position.
  const double kv_tok = static_cast<double>(lm.pool->layout().bytes_per_token());
  const double avg_ctx = kv_tokens_read >= 0 ? kv_tokens_read : o.context + (o.gen_tokens - 1) / 2.0;
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
  if (evc.active())
    j["kv_eviction"] = {{"policy", kv::eviction_policy_name(evc.policy)}, {"budget", evc.budget}, {"sparse_pages", evc.sparse_pages},
                        {"kv_tokens_read_per_token", kv_tokens_read}};
  if (cold) {
    j["kv_cold"] = cold_store_json(*cold, *lm.pool);
    const kv::ColdStats c = cold->stats();  // decoding alone
    j["kv_cold"]["decode_pages_in"] = c.pages_in - cold_at_decode.pages_in;
    j["kv_cold"]["decode_prefetch_hits"] = c.prefetch_hits - cold_at_decode.prefetch_hits;
    j["kv_cold"]["decode_fetch_seconds"] = c.fetch_seconds - cold_at_decode.fetch_seconds;
  }
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
    if (!read_loop) read_loop = std::make_unique<ReadLoop>(*lm.threads, int64_t(o.bandwidth_mib) << 20);
    nlohmann::json bw = read_loop->measure(o.bandwidth_passes, o.json);
    j["machine_read_gb_s"] = bw["gb_s"];
    j["machine_bandwidth"] = bw;
    if (!tg.empty()) {
      // Each repeat against the read loop run just before it; the median of those fractions.
      nlohmann::json pairs = nlohmann::json::array();
      std::vector<double> frac;
      for (size_t r = 0; r < tg.size() && r < read_before.size(); ++r) {
        frac.push_back(bytes_per_tok * tg[r] / 1e9 / read_before[r]);
        pairs.push_back({{"read_gb_s", read_before[r]}, {"decode_tok_s", tg[r]}, {"fraction", frac.back()}});
      }
      j["decode_bandwidth_fraction"] = stats(frac).median;
      j["decode_bandwidth_pairs"] = pairs;
      j["decode_bandwidth_fraction_after"] = j["decode_effective_gb_s"].get<double>() / bw["gb_s"].get<double>();
      if (!o.json)
        for (size_t r = 0; r < frac.size(); ++r)
          std::fprintf(stderr, "repeat %zu: read loop %.1f GB/s just before, decode %.1f tok/s = %.0f%% of it\n", r + 1,
                       read_before[r], tg[r], 100 * frac[r]);
    }
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
  cmd->add_option("--prompt-tokens,-p", o->prompt_tokens, "prefill test length (0 = skip)")->check(number_in(0, 1 << 20))->capture_default_str();
  cmd->add_option("--gen-tokens,-n", o->gen_tokens, "decode test length (0 = skip)")->check(number_in(0, 1 << 20))->capture_default_str();
  cmd->add_option("--context,-d", o->context, "tokens already in the KV cache before decoding (--batch: added to each sequence's -p prompt tokens)")->check(number_in(0, 1 << 20))->capture_default_str();
  cmd->add_option("-t,--threads", o->threads, "threads (default: all cores)")->check(number_in(1, 256));
  cmd->add_option("--repeat,-r", o->repeat, "repeats (medians reported)")->check(number_in(1, 1000))->capture_default_str();
  cmd->add_option("--chunk", o->chunk, "prefill chunk size")->check(number_in(1, 1 << 16))->capture_default_str();
  cmd->add_flag("--json", o->json, "one JSON object on stdout, no progress");
  cmd->add_flag("--measure-bandwidth", o->measure_bandwidth,
                "also measure the machine's read bandwidth (a read loop over a large buffer, same threads): 3 passes "
                "before each decode repeat (decode_bandwidth_fraction: the median of the repeats' fractions) and "
                "--bandwidth-passes at the end");
  cmd->add_option("--bandwidth-mib", o->bandwidth_mib, "buffer of the bandwidth loop, MiB")->check(number_in(1, 1 << 16))->capture_default_str();
  cmd->add_option("--bandwidth-passes", o->bandwidth_passes, "timed passes of the bandwidth loop (median)")->check(number_in(1, 1000))->capture_default_str();
  cmd->add_option("--batch,-b", o->batch,
                  "sequences decoding together through the engine (continuous batching, sampling, step profile); 0 = one "
                  "sequence, greedy, llama-bench style")
      ->check(number_in(0, 4096))
      ->capture_default_str();
  cmd->add_option("--temp", o->sp.temperature, "--batch: sampling temperature")->check(number_in(0.0, 100.0))->capture_default_str();
  cmd->add_option("--top-k", o->sp.top_k, "--batch: top-k (0 = off)")->check(number_in(0, 1 << 30))->capture_default_str();
  cmd->add_option("--top-p", o->sp.top_p, "--batch: top-p (1 = off)")->check(number_in(0.0, 1.0))->capture_default_str();
  cmd->add_option("--min-p", o->sp.min_p, "--batch: min-p (0 = off)")->check(number_in(0.0, 1.0))->capture_default_str();
  cmd->add_option("--seed", o->sp.seed, "--batch: base seed (sequence i of repeat r uses seed + 1000 r + i)")
      ->check(seed_number(false))
      ->capture_default_str();
  add_kv_options(cmd, &o->kvo);
  cmd->add_option("--speculative-config", o->speculative_config,
                  "--batch: speculative decoding for every sequence, vLLM's JSON (random prompts: drafts only where the output repeats itself)");
  add_eviction_options(cmd, &o->evo);  // single-sequence decode from a context under a KV policy
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace kvtools
