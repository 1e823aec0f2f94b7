// Micro-benchmarks of the per-token operators and paged attention at SmolLM2's shapes.
//   build/bench_ops [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/attention.h"
#include "kernels/ops.h"

using namespace kv;

namespace {
std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

void BM_RmsNorm(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto x = randn(n, 1), w = randn(n, 2), y = x;
  for (auto _ : st) {
    rms_norm(x.data(), w.data(), y.data(), n, 1e-5f);
    benchmark::DoNotOptimize(y.data());
  }
  st.SetBytesProcessed(st.iterations() * n * 12);
}
BENCHMARK(BM_RmsNorm)->Arg(576)->Arg(2048);

void BM_SiluMul(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto g = randn(n, 1), u = randn(n, 2), y = g;
  for (auto _ : st) {
    silu_mul(g.data(), u.data(), y.data(), n);
    benchmark::DoNotOptimize(y.data());
  }
  st.SetItemsProcessed(st.iterations() * n);
}
BENCHMARK(BM_SiluMul)->Arg(1536);

void BM_Rope(benchmark::State& st) {
  auto q = randn(9 * 64, 3);
  int64_t pos = 0;
  for (auto _ : st) {
    rope(q.data(), 9, 64, 64, pos++ & 8191, 100000.f, 1.f, RopeStyle::kNorm);
    benchmark::DoNotOptimize(q.data());
  }
}
BENCHMARK(BM_Rope);

void BM_Softmax(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto x = randn(n, 4);
  for (auto _ : st) {
    auto y = x;
    benchmark::DoNotOptimize(softmax(y.data(), n));
  }
}
BENCHMARK(BM_Softmax)->Arg(49152);

// One decode token of one layer: 3 KV heads × 3 query heads each, head_dim 64, f16 pages,
// context of range(0) tokens. Counters: KV bytes read per second.
template <bool kRef>
void BM_PagedAttentionDecode(benchmark::State& st) {
  const int64_t n_ctx = st.range(0);
  const int hkv = 3, grp = 3, hd = 64, bs = 16;
  const int64_t n_pages = (n_ctx + bs - 1) / bs;
  const int64_t page_bytes = int64_t(hkv) * bs * hd * 2;
  std::vector<uint8_t> k(n_pages * page_bytes), v(n_pages * page_bytes);
  auto tok = randn(hkv * hd, 5);
  for (int64_t p = 0; p < n_ctx; ++p) {
    write_kv_token(k.data() + (p / bs) * page_bytes, KvElem::kF16, hkv, bs, hd, p % bs, tok.data());
    write_kv_token(v.data() + (p / bs) * page_bytes, KvElem::kF16, hkv, bs, hd, p % bs, tok.data());
  }
  std::vector<int32_t> table(n_pages);
  for (int64_t i = 0; i < n_pages; ++i) table[i] = static_cast<int32_t>(i);
  auto q = randn(hkv * grp * hd, 6);
  std::vector<float> out(q.size());
  PagedKvView view{k.data(), v.data(), page_bytes, table.data(), hkv, bs, hd, KvElem::kF16};
  for (auto _ : st) {
    for (int h = 0; h < hkv; ++h) {
      if (kRef)
        paged_attention_ref(view, h, grp, q.data(), hkv * grp * hd, n_ctx - 1, 1, 0.125f, out.data(), hkv * grp * hd);
      else
        paged_attention(view, h, grp, q.data(), hkv * grp * hd, n_ctx - 1, 1, 0.125f, out.data(), hkv * grp * hd);
    }
    benchmark::DoNotOptimize(out.data());
  }
  st.SetBytesProcessed(st.iterations() * 2 * n_pages * page_bytes);
}
BENCHMARK_TEMPLATE(BM_PagedAttentionDecode, false)->RangeMultiplier(4)->Range(256, 16384);
BENCHMARK_TEMPLATE(BM_PagedAttentionDecode, true)->RangeMultiplier(4)->Range(256, 4096);
}  // namespace

BENCHMARK_MAIN();
