// matmul micro-benchmarks on SmolLM2-135M and Gemma 3 270M shapes (random weights, no model
// file needed).
//
//   BM_Matmul/<shape>/<type>/rows/threads   one matrix; GB/s of packed weights, GFLOP/s
//   BM_Model/<type>/rows/threads            the 121 matmuls of one forward pass (30 layers ×
//                                           QKV, O, gate+up, down; then the Q8_0 output matrix
//                                           for one row): tokens/s for the matmuls alone
//   BM_Matmul/gemma_<shape>/<type>/...      Gemma 3 270M's shapes in the types its Q4_K_M file
//                                           uses (Q5_0, Q4_K, Q6_K, Q8_0)
//   BM_MatmulCached/<type>/rows/threads     576×128 weights in cache, 16 rows, one thread: the
//                                           batch kernel's issue rate (20 runs; min time)
//   BM_ModelWalk/Q4_1/rows/threads/walk/distinct  BM_Model's 120 layer matmuls as a run per
//                                           matmul (walk 0) or one run with barriers (walk 1),
//                                           from RAM (distinct 30) or cache (distinct 1)
//   BM_GemmaModel/rows/threads              its 18 layers (QKV: Q5_0,Q5_0,Q5_0|Q8_0; O: Q4_K;
//                                           gate+up: Q5_0; down: Q6_K|Q4_K, alternating) and
//                                           the tied 262144×640 Q8_0 output for one row
//
// GB/s counts the raw GGUF bytes of the matrix (not the packed bytes, which differ by layout),
// so numbers compare across layouts: the rate at which model weights are consumed.
//
// Weights are replicated so that every pass reads at least 160 MB: more than the 32 MiB L3,
// so rows=1 measures RAM streaming as decode does, not cache.
// KV_ISA=scalar|avx2|avx512 picks the kernel family; KV_ACT_QUANT=q8 the single-level
// activation quantization (default q8x2: two 8-bit levels), for before/after comparisons.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/matmul.h"
#include "kernels/quant.h"

namespace {

using namespace kv;

struct Shape {
  const char* name;
  int64_t n_in, n_out;
};
constexpr Shape kShapes[] = {
    {"qkv", 576, 960}, {"attn_out", 576, 576}, {"gate_up", 576, 3072}, {"down", 1536, 576},
    {"output", 576, 49152},
};
constexpr Shape kGemmaShapes[] = {
    {"gemma_q", 640, 1024},   {"gemma_kv", 640, 256},   {"gemma_o", 1024, 640},
    {"gemma_gate", 640, 2048}, {"gemma_down", 2048, 640}, {"gemma_output", 640, 262144},
};
constexpr int kLayers = 30;
constexpr int kGemmaLayers = 18;
constexpr int64_t kMinBytes = 160ll << 20;

ThreadPool& pool(int n) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[n];
  if (!p) p = std::make_unique<ThreadPool>(n);
  return *p;
}

const char* act_name() { return act_quant() == ActQuant::kQ8 ? "act=q8" : "act=q8x2"; }

// Random bytes with finite f16 scales where the format keeps them.
std::vector<uint8_t> random_raw(GgmlType type, int64_t n_in, int64_t n_out, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  const int64_t bb = type_block_bytes(type), nblk = n_in / type_block_elems(type) * n_out;
  std::vector<uint8_t> buf(static_cast<size_t>(nblk * bb));
  for (auto& v : buf) v = static_cast<uint8_t>(byte(rng));
  for (int64_t b = 0; b < nblk; ++b) {
    uint16_t d = fp32_to_fp16(scale(rng));
    uint8_t* blk = buf.data() + b * bb;
    if (type == GgmlType::Q6_K) {
      std::memcpy(blk + 208, &d, 2);
    } else {
      std::memcpy(blk, &d, 2);
      if (type == GgmlType::Q4_1 || type == GgmlType::Q4_K) std::memcpy(blk + 2, &d, 2);
    }
  }
  return buf;
}

// Packs the parts as one matrix (nullopt if pack refuses them). raw_bytes += their GGUF size.
std::optional<PackedMatrix> try_pack(const std::vector<std::pair<GgmlType, int64_t>>& parts, int64_t n_in,
                                     uint32_t seed, int64_t* raw_bytes) {
  std::vector<std::vector<uint8_t>> raws;
  std::vector<RawMatrix> ms;
  int64_t raw = 0;
  for (const auto& [type, n_out] : parts) {
    raws.push_back(random_raw(type, n_in, n_out, seed++));
    ms.push_back(RawMatrix{type, raws.back().data(), n_in, n_out});
    raw += row_bytes(type, n_in) * n_out;
  }
  auto p = PackedMatrix::pack(ms, detect_isa());
  if (!p) return std::nullopt;
  if (raw_bytes) *raw_bytes += raw;
  return std::move(*p);
}

PackedMatrix make(GgmlType type, int64_t n_in, int64_t n_out, uint32_t seed, int64_t* raw_bytes = nullptr) {
  auto p = try_pack({{type, n_out}}, n_in, seed, raw_bytes);
  if (!p) {
    std::fprintf(stderr, "pack %s failed\n", type_name(type));
    std::abort();
  }
  return std::move(*p);
}

std::vector<float> random_x(int64_t n) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = nd(rng);
  return x;
}

void BM_Matmul(benchmark::State& st, Shape s, GgmlType type) {
  const int64_t rows = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  int64_t raw_bytes = 0;
  PackedMatrix one = make(type, s.n_in, s.n_out, 1, &raw_bytes);
  const int64_t copies = rows == 1 ? std::max<int64_t>(1, kMinBytes / one.bytes()) : 1;
  std::vector<PackedMatrix> ws;
  ws.push_back(std::move(one));
  for (int64_t i = 1; i < copies; ++i) ws.push_back(ws[0]);
  std::vector<float> x = random_x(rows * s.n_in), y(static_cast<size_t>(rows * s.n_out));
  ThreadPool& tp = pool(threads);
  size_t i = 0;
  for (auto _ : st) {
    matmul(ws[i], x.data(), rows, y.data(), tp);
    benchmark::DoNotOptimize(y.data());
    if (++i == ws.size()) i = 0;
  }
  const double n = static_cast<double>(st.iterations());
  st.counters["GB/s"] = benchmark::Counter(n * static_cast<double>(raw_bytes) * 1e-9,
                                           benchmark::Counter::kIsRate);
  st.counters["GFLOP/s"] = benchmark::Counter(n * 2.0 * rows * s.n_in * s.n_out * 1e-9,
                                              benchmark::Counter::kIsRate);
  st.SetLabel(std::string(isa_name(ws[0].isa())) + " " + type_name(type) + " " + act_name());
}

// One forward pass of the matmuls: rows tokens through 30 layers, then logits for one row.
void BM_Model(benchmark::State& st, GgmlType type) {
  const int64_t rows = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  std::vector<PackedMatrix> layers;
  int64_t bytes = 0;
  for (int l = 0; l < kLayers; ++l)
    for (int k = 0; k < 4; ++k) {
      layers.push_back(make(type, kShapes[k].n_in, kShapes[k].n_out, 100 + 4 * l + k));
      bytes += layers.back().bytes();
    }
  PackedMatrix out = make(GgmlType::Q8_0, 576, 49152, 7);
  bytes += out.bytes();
  std::vector<float> x = random_x(rows * 1536), y(static_cast<size_t>(rows * 3072)), logits(49152);
  ThreadPool& tp = pool(threads);
  for (auto _ : st) {
    for (int l = 0; l < kLayers; ++l)
      for (int k = 0; k < 4; ++k) matmul(layers[static_cast<size_t>(4 * l + k)], x.data(), rows, y.data(), tp);
    matmul(out, x.data(), 1, logits.data(), tp);
    benchmark::DoNotOptimize(logits.data());
  }
  const double n = static_cast<double>(st.iterations());
  st.counters["tok/s"] = benchmark::Counter(n * static_cast<double>(rows), benchmark::Counter::kIsRate);
  st.counters["GB/s"] = benchmark::Counter(n * static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsRate);
  st.SetLabel(std::string(isa_name(out.isa())) + " " + type_name(type) + " " + act_name() + " weights " +
              std::to_string(bytes >> 20) + " MiB");
}

// BM_Model's 120 layer matmuls (no output matrix) run as the forward runs them, with the
// activations a thread would have in between: walk 0, a ThreadPool::run per matmul (the
// engine's way for 8 rows or more); walk 1, one run for all of them, matmul_share and a
// barrier after each (the forward's walk, fewer than 8 rows). distinct 30: every layer its own
// weights (66 MB of Q4_1, streamed from RAM); distinct 1: one layer's 4 matrices 30 times
// (2.2 MB, cache-resident), which leaves mostly what the two ways' synchronisation costs.
void BM_ModelWalk(benchmark::State& st, GgmlType type) {
  const int64_t rows = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  const bool walk = st.range(2) != 0;
  const int distinct = static_cast<int>(st.range(3));
  std::vector<PackedMatrix> layers;
  for (int l = 0; l < distinct; ++l)
    for (int k = 0; k < 4; ++k) layers.push_back(make(type, kShapes[k].n_in, kShapes[k].n_out, 100 + 4 * l + k));
  std::vector<float> x = random_x(rows * 1536), y(static_cast<size_t>(rows * 3072));
  ThreadPool& tp = pool(threads);
  for (auto _ : st) {
    if (!walk) {
      for (int l = 0; l < kLayers; ++l)
        for (int k = 0; k < 4; ++k) matmul(layers[static_cast<size_t>(4 * (l % distinct) + k)], x.data(), rows, y.data(), tp);
    } else {
      tp.run([&](int ith, int nth) {
        for (int l = 0; l < kLayers; ++l)
          for (int k = 0; k < 4; ++k) {
            matmul_share(layers[static_cast<size_t>(4 * (l % distinct) + k)], x.data(), rows, y.data(), ith, nth);
            tp.barrier();
          }
      });
    }
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["tok/s"] = benchmark::Counter(static_cast<double>(st.iterations()) * static_cast<double>(rows),
                                            benchmark::Counter::kIsRate);
  st.SetLabel(std::string(isa_name(layers[0].isa())) + " " + type_name(type) + " " + act_name() +
              (walk ? " one run, barriers" : " a run per matmul") + (distinct == 1 ? ", cached" : ", from RAM"));
}

// Gemma 3 270M: the matmuls of one forward pass over rows tokens, weights typed as in
// gemma-3-270m-Q4_K_M.gguf. QKV and gate+up are packed as one matrix each when pack accepts
// the mix of types, else as separate matrices.
void BM_GemmaModel(benchmark::State& st) {
  const int64_t rows = st.range(0);
  const int threads = static_cast<int>(st.range(1));
  using P = std::vector<std::pair<GgmlType, int64_t>>;
  std::vector<PackedMatrix> ms;
  int64_t bytes = 0;
  auto add = [&](const P& parts, int64_t n_in, uint32_t seed) {
    if (auto fused = try_pack(parts, n_in, seed, &bytes)) {
      ms.push_back(std::move(*fused));
      return;
    }
    for (const auto& part : parts) {
      auto one = try_pack({part}, n_in, seed++, &bytes);
      if (!one) std::abort();
      ms.push_back(std::move(*one));
    }
  };
  for (int l = 0; l < kGemmaLayers; ++l) {
    const uint32_t seed = 1000 + 16 * l;
    add({{GgmlType::Q5_0, 1024}, {GgmlType::Q5_0, 256}, {l % 2 ? GgmlType::Q8_0 : GgmlType::Q5_0, 256}}, 640, seed);
    add({{GgmlType::Q4_K, 640}}, 1024, seed + 4);
    add({{GgmlType::Q5_0, 2048}, {GgmlType::Q5_0, 2048}}, 640, seed + 5);
    add({{l % 2 ? GgmlType::Q4_K : GgmlType::Q6_K, 640}}, 2048, seed + 7);
  }
  int64_t out_raw = 0;
  PackedMatrix out = make(GgmlType::Q8_0, 640, 262144, 7, &out_raw);
  bytes += out_raw;
  std::vector<float> x = random_x(rows * 2048), y(static_cast<size_t>(rows * 4096)), logits(262144);
  ThreadPool& tp = pool(threads);
  for (auto _ : st) {
    for (const PackedMatrix& m : ms) matmul(m, x.data(), rows, y.data(), tp);
    matmul(out, x.data(), 1, logits.data(), tp);
    benchmark::DoNotOptimize(logits.data());
  }
  const double n = static_cast<double>(st.iterations());
  st.counters["tok/s"] = benchmark::Counter(n * static_cast<double>(rows), benchmark::Counter::kIsRate);
  st.counters["GB/s"] = benchmark::Counter(n * static_cast<double>(bytes) * 1e-9, benchmark::Counter::kIsRate);
  st.SetLabel(std::string(isa_name(out.isa())) + " " + act_name() + " " + std::to_string(ms.size()) +
              " layer matrices, weights " + std::to_string(bytes >> 20) + " MiB (GGUF)");
}

void register_all() {
  const std::pair<const char*, GgmlType> gemma[] = {
      {"gemma_q", GgmlType::Q5_0},    {"gemma_kv", GgmlType::Q5_0},   {"gemma_kv", GgmlType::Q8_0},
      {"gemma_o", GgmlType::Q4_K},    {"gemma_gate", GgmlType::Q5_0}, {"gemma_down", GgmlType::Q6_K},
      {"gemma_down", GgmlType::Q4_K}, {"gemma_output", GgmlType::Q8_0},
  };
  for (const auto& [shape_name, type] : gemma) {
    for (const Shape& s : kGemmaShapes) {
      if (std::strcmp(s.name, shape_name) != 0) continue;
      std::string name = std::string("BM_Matmul/") + s.name + "/" + type_name(type);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Matmul, s, type);
      for (int64_t rows : {1, 64, 256})
        for (int64_t th : {1, 2})
          if (rows <= 64 || s.n_out < 100000) b->Args({rows, th});  // output: y alone would be 268 MB
      b->ArgNames({"rows", "threads"})->UseRealTime()->MinTime(0.3);
    }
  }
  {
    auto* b = benchmark::RegisterBenchmark("BM_GemmaModel", BM_GemmaModel);
    for (int64_t rows : {1, 64})
      for (int64_t th : {1, 2}) b->Args({rows, th});
    b->ArgNames({"rows", "threads"})->UseRealTime()->MinTime(0.5)->Repetitions(3)->ReportAggregatesOnly(true)
        ->Unit(benchmark::kMillisecond);
  }
  {
    auto* b = benchmark::RegisterBenchmark("BM_ModelWalk/Q4_1", BM_ModelWalk, GgmlType::Q4_1);
    for (int64_t distinct : {1, 30})
      for (int64_t rows : {1, 4})
        for (int64_t walk : {0, 1}) b->Args({rows, 2, walk, distinct});
    b->ArgNames({"rows", "threads", "walk", "distinct"})->UseRealTime()->MinTime(0.3)->Repetitions(5)
        ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
        ->ReportAggregatesOnly(true)->Unit(benchmark::kMicrosecond);
  }
  // The batch kernels on cached weights (576 inputs × 128 outputs, 16 rows, one thread): their
  // issue rate without memory. 20 runs; read the time's min (and the rate's max): this VM's
  // noise only ever slows a run.
  for (GgmlType type : {GgmlType::Q4_1, GgmlType::Q8_0}) {
    std::string name = std::string("BM_MatmulCached/") + type_name(type);
    auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Matmul, Shape{"cached", 576, 128}, type);
    b->Args({16, 1})->ArgNames({"rows", "threads"})->UseRealTime()->MinTime(0.05)->Repetitions(20)
        ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
        ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); })
        ->ReportAggregatesOnly(true)->Unit(benchmark::kMicrosecond);
  }
  for (GgmlType type : {GgmlType::Q4_1, GgmlType::Q8_0}) {
    for (const Shape& s : kShapes) {
      if (std::strcmp(s.name, "output") == 0 && type != GgmlType::Q8_0) continue;
      std::string name = std::string("BM_Matmul/") + s.name + "/" + type_name(type);
      auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Matmul, s, type);
      for (int64_t rows : {1, 16, 64, 512})
        for (int64_t th : {1, 2}) b->Args({rows, th});
      b->ArgNames({"rows", "threads"})->UseRealTime()->MinTime(0.3);
    }
    std::string name = std::string("BM_Model/") + type_name(type);
    auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Model, type);
    // 2-28 rows: a decode step with speculative drafts, a narrow batch, AMX's tile remainders.
    for (int64_t rows : {1, 2, 4, 6, 8, 12, 16, 20, 28, 64, 512})
      for (int64_t th : {1, 2}) b->Args({rows, th});
    // Medians of repetitions: these shared VMs are noisy.
    b->ArgNames({"rows", "threads"})->UseRealTime()->MinTime(0.5)->Repetitions(3)->ReportAggregatesOnly(true)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
