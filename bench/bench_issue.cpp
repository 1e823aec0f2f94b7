// How many AVX2 vpmaddubsw a core issues per cycle in the loop shapes the batch kernels
// (src/kernels/matmul_avx2.cpp) can take: the ceiling their measured rate is compared with in
// docs/ARCHITECTURE.md. No model, no weights: register loops over a 4 KiB buffer.
//
//   BM_IssueClock          a chain of dependent adds: the core's clock (GHz = adds per ns)
//   BM_IssueRate/bcast     vpbroadcastd from memory + vpmaddubsw + vpaddw (the kernels' shape:
//                          4 activation bytes broadcast for each multiply)
//   BM_IssueRate/mem       vpmaddubsw with a 32-byte memory operand + vpaddw (activations stored
//                          pre-broadcast: no broadcast instruction)
//   BM_IssueRate/bcast2    as bcast, but each broadcast feeds two multiplies (two weight vectors:
//                          a tile's two 8-output halves against the same 4 activation bytes)
//
// Each reports `Gops` and `per_cycle` (multiplies per cycle at the clock BM_IssueClock measured
// in this run; on the console and in JSON: `--benchmark_format=json`, `--benchmark_out=F`).
// 8 independent accumulators; 10 runs: read the `_max` rows (each statistic is taken per
// column, so that row has the fastest run's rate; a shared VM's noise only slows a run).
// Skipped on a CPU without AVX2.
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

alignas(64) int8_t g_buf[4096];
double g_ghz = 0;  // set by BM_IssueClock (registered first)

// Hides v from the optimizer: no hoisting of a loop-invariant multiply, no reassociation.
#define KV_OPAQUE(v) __asm__ volatile("" : "+x"(v))

__attribute__((noinline)) int64_t dependent_adds(int64_t n) {
  int64_t x = 0;
  for (int64_t i = 0; i < n; ++i) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return x;
}

enum class Shape { kBcast, kMem, kBcast2 };

template <Shape S>
__attribute__((target("avx2"), always_inline)) inline __m256i operand(const int8_t* p, int k) {
  if constexpr (S == Shape::kMem) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
  } else {
    int32_t v;
    std::memcpy(&v, p + 4 * k, 4);
    return _mm256_set1_epi32(v);
  }
}

// Returns a lane of the sums (kept live), not the vector: callers are not compiled for AVX.
template <Shape S>
__attribute__((target("avx2"), noinline)) int loop(int64_t iters) {
  const __m256i w = _mm256_set1_epi8(3), w2 = _mm256_set1_epi8(5);
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (int64_t it = 0; it < iters; ++it) {
    const int8_t* p = g_buf + (it & 7) * (S == Shape::kMem ? 256 : 32);
    if constexpr (S == Shape::kBcast2) {
#define KV_STEP2(k, sa, sb)                                 \
  {                                                         \
    const __m256i b = operand<Shape::kBcast>(p, k);         \
    sa = _mm256_add_epi16(sa, _mm256_maddubs_epi16(w, b));  \
    sb = _mm256_add_epi16(sb, _mm256_maddubs_epi16(w2, b)); \
    KV_OPAQUE(sa);                                          \
    KV_OPAQUE(sb);                                          \
  }
      KV_STEP2(0, s0, s1) KV_STEP2(1, s2, s3) KV_STEP2(2, s4, s5) KV_STEP2(3, s6, s7)
#undef KV_STEP2
    } else {
#define KV_STEP(k, s)                                                         \
  s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w, operand<S>(p, k))); \
  KV_OPAQUE(s);
      KV_STEP(0, s0) KV_STEP(1, s1) KV_STEP(2, s2) KV_STEP(3, s3) KV_STEP(4, s4) KV_STEP(5, s5) KV_STEP(6, s6)
      KV_STEP(7, s7)
#undef KV_STEP
    }
  }
  const __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)),
                                     _mm256_add_epi16(_mm256_add_epi16(s4, s5), _mm256_add_epi16(s6, s7)));
  return _mm256_extract_epi32(t, 0);
}

void BM_IssueClock(benchmark::State& st) {
  constexpr int64_t kN = 50'000'000;
  for (auto _ : st) benchmark::DoNotOptimize(dependent_adds(kN));
  st.counters["GHz"] = benchmark::Counter(4.0 * kN * static_cast<double>(st.iterations()) / 1e9,
                                          benchmark::Counter::kIsRate);
}

template <Shape S>
void BM_IssueRate(benchmark::State& st) {
  if (!__builtin_cpu_supports("avx2")) {
    st.SkipWithError("no AVX2 on this CPU");
    return;
  }
  constexpr int64_t kIters = 10'000'000;  // 8 multiplies each
  for (int i = 0; i < 4096; ++i) g_buf[i] = static_cast<int8_t>(i * 7);
  for (auto _ : st) benchmark::DoNotOptimize(loop<S>(kIters));
  st.counters["Gops"] = benchmark::Counter(8.0 * kIters * static_cast<double>(st.iterations()) / 1e9,
                                           benchmark::Counter::kIsRate);
}

// The clock's fastest run (max GHz) sets g_ghz; every aggregate of the rates gets per_cycle.
// On the console and in JSON (`--benchmark_format=json`, `--benchmark_out=F`).
void add_per_cycle(std::vector<benchmark::BenchmarkReporter::Run>& runs) {
  for (auto& r : runs) {
    if (r.run_name.function_name == "BM_IssueClock" && r.aggregate_name == "max") {
      const auto it = r.counters.find("GHz");
      if (it != r.counters.end()) g_ghz = it->second.value;
    }
    if (r.run_name.function_name.rfind("BM_IssueRate", 0) == 0 && g_ghz > 0) {
      const auto it = r.counters.find("Gops");
      if (it != r.counters.end()) r.counters["per_cycle"] = it->second.value / g_ghz;
    }
  }
}

template <class Base>
class CycleReporter : public Base {
 public:
  void ReportRuns(const std::vector<benchmark::BenchmarkReporter::Run>& runs) override {
    std::vector<benchmark::BenchmarkReporter::Run> out = runs;
    add_per_cycle(out);
    Base::ReportRuns(out);
  }
};

}  // namespace

int main(int argc, char** argv) {
  auto stats = [](benchmark::internal::Benchmark* b) {
    b->UseRealTime()->Repetitions(10)->ReportAggregatesOnly(true)->Unit(benchmark::kMillisecond)
        ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
        ->ComputeStatistics("max", [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); });
  };
  stats(benchmark::RegisterBenchmark("BM_IssueClock", BM_IssueClock));
  stats(benchmark::RegisterBenchmark("BM_IssueRate/bcast", BM_IssueRate<Shape::kBcast>));
  stats(benchmark::RegisterBenchmark("BM_IssueRate/mem", BM_IssueRate<Shape::kMem>));
  stats(benchmark::RegisterBenchmark("BM_IssueRate/bcast2", BM_IssueRate<Shape::kBcast2>));
  bool json = false, out = false;
  for (int i = 1; i < argc; ++i) {
    json |= std::strcmp(argv[i], "--benchmark_format=json") == 0;
    out |= std::strncmp(argv[i], "--benchmark_out=", 16) == 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  CycleReporter<benchmark::ConsoleReporter> console;
  CycleReporter<benchmark::JSONReporter> json_display, json_file;
  benchmark::RunSpecifiedBenchmarks(json ? static_cast<benchmark::BenchmarkReporter*>(&json_display) : &console,
                                    out ? &json_file : nullptr);
  benchmark::Shutdown();
  return 0;
}
