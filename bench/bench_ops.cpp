// Micro-benchmarks of the per-token operators and paged attention at SmolLM2's shapes.
//   build/bench_ops [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/attention.h"
#include "kv/page_pool.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

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

// RoPE of one decode step as the model runs it: n_seq sequences at their own positions, 30
// layers, q (9 heads) and k (3 heads) per token; every position moves on by one per step.
void BM_RopeDecodeStep(benchmark::State& st) {
  const int n_seq = static_cast<int>(st.range(0));
  auto q = randn(9 * 64, 3), k = randn(3 * 64, 4);
  int64_t step = 0;
  for (auto _ : st) {
    for (int l = 0; l < 30; ++l)
      for (int s = 0; s < n_seq; ++s) {
        const int64_t pos = 100 * s + (step & 4095);
        rope(q.data(), 9, 64, 64, pos, 100000.f, 1.f, RopeStyle::kNorm);
        rope(k.data(), 3, 64, 64, pos, 100000.f, 1.f, RopeStyle::kNorm);
      }
    ++step;
    benchmark::DoNotOptimize(q.data());
    benchmark::DoNotOptimize(k.data());
  }
}
BENCHMARK(BM_RopeDecodeStep)->Arg(1)->Arg(16);

void BM_Softmax(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto x = randn(n, 4);
  for (auto _ : st) {
    auto y = x;
    benchmark::DoNotOptimize(softmax(y.data(), n));
  }
}
BENCHMARK(BM_Softmax)->Arg(49152);

// Quest's page scores at SmolLM2's decode shape: 3 KV heads of range(0) query rows (3: one
// token), head_dim 64, 64 pages per call (the model's chunk), 8-bit summaries
// (encode_key_summary). range(1) = 0: the same 64 pages every call (in cache); 1: each call 64 pages picked
// at random from 256 MiB of summaries (as a long context's pages come from memory).
void BM_KeyScorePages(benchmark::State& st) {
  constexpr int kHeads = 3, kHd = 64;
  constexpr int64_t kPages = 64, kPageBytes = int64_t(kHeads) * key_summary_bytes(kHd);
  const int n_rows = static_cast<int>(st.range(0));
  const int64_t n_pool = st.range(1) ? (int64_t(256) << 20) / kPageBytes : kPages;
  auto qf = randn(size_t(kHeads) * n_rows * kHd, 5);
  std::vector<const float*> q(size_t(kHeads) * n_rows);
  for (size_t i = 0; i < q.size(); ++i) q[i] = qf.data() + i * kHd;
  auto sf = randn(size_t(2 * kHd), 6);
  std::vector<float> var(kHd);
  for (int d = 0; d < kHd; ++d) var[d] = std::fabs(sf[kHd + d]);
  std::vector<uint8_t> one(key_summary_bytes(kHd)), stats(size_t(n_pool * kPageBytes));
  encode_key_summary(sf.data(), var.data(), kHd, one.data());
  for (size_t i = 0; i < stats.size(); i += one.size()) std::memcpy(stats.data() + i, one.data(), one.size());
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> pick(0, n_pool - 1);
  std::vector<const uint8_t*> b(kPages);
  std::vector<float> out(kPages * kHeads);
  int64_t i0 = 0;
  for (auto _ : st) {
    for (int64_t i = 0; i < kPages; ++i) b[i] = stats.data() + (st.range(1) ? pick(rng) : i0 + i) * kPageBytes;
    key_score_pages(q.data(), n_rows, kHeads, b.data(), kPages, kHd, 1.766f, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  st.SetItemsProcessed(st.iterations() * kPages * kHeads);  // (page, KV head) pairs
}
BENCHMARK(BM_KeyScorePages)->Args({3, 0})->Args({24, 0})->Args({3, 1});

// One decode token of one layer: 3 KV heads × 3 query heads each, head_dim 64, pages of 16,
// context of range(0) tokens, page type range(1) (KvElem), one thread. Counters: KV bytes read
// per second (page bytes, metadata included).
template <bool kRef>
void BM_PagedAttentionDecode(benchmark::State& st) {
  const int64_t n_ctx = st.range(0);
  const KvElem elem = static_cast<KvElem>(st.range(1));
  const int hkv = 3, grp = 3, hd = 64, bs = 16;
  KvLayout l;
  l.n_layer = 1;
  l.n_head_kv = hkv;
  l.head_dim = hd;
  l.block_size = bs;
  l.dtype = elem;
  const int32_t n_pages = static_cast<int32_t>((n_ctx + bs - 1) / bs);
  PagePool pool(l, n_pages, 2);
  std::vector<int32_t> table;
  pool.allocate(n_pages, &table);
  auto k = randn(hkv * hd, 5), v = randn(hkv * hd, 7);
  for (int64_t p = 0; p < n_ctx; ++p) pool.write_token(0, table[p / bs], static_cast<int32_t>(p % bs), k.data(), v.data());
  pool.release_filled(0);
  PagedKvView view = pool.view(0);
  view.pages = table.data();
  auto q = randn(hkv * grp * hd, 6);
  std::vector<float> out(q.size());
  for (auto _ : st) {
    for (int h = 0; h < hkv; ++h) {
      if (kRef)
        paged_attention_ref(view, h, grp, q.data(), hkv * grp * hd, n_ctx - 1, 1, 0.125f, out.data(), hkv * grp * hd);
      else
        paged_attention(view, h, grp, q.data(), hkv * grp * hd, n_ctx - 1, 1, 0.125f, out.data(), hkv * grp * hd);
    }
    benchmark::DoNotOptimize(out.data());
  }
  st.SetBytesProcessed(st.iterations() * int64_t(n_pages) * (l.k_layer_page_bytes(0) + l.v_layer_page_bytes(0)));
  st.SetLabel(kv_elem_name(elem));
}
// Contexts of 40 and 100 keys (a partly filled last page, a part of a 4-page softmax group) as
// well as 256 up: many users' chat turns decode at such contexts, where what does not scale
// with the keys (the group's set-up, the partial pages' masked loads and softmax) weighs most.
void DecodeArgs(benchmark::internal::Benchmark* b, int64_t max_ctx) {
  for (int e : {int(KvElem::kF32), int(KvElem::kF16), int(KvElem::kBF16), int(KvElem::kFp8E4M3), int(KvElem::kInt8), int(KvElem::kInt4)}) {
    for (int64_t n : {40, 100}) b->Args({n, e});
    for (int64_t n = 256; n <= max_ctx; n *= 4) b->Args({n, e});
  }
}
BENCHMARK_TEMPLATE(BM_PagedAttentionDecode, false)->Apply([](benchmark::internal::Benchmark* b) { DecodeArgs(b, 16384); });
BENCHMARK_TEMPLATE(BM_PagedAttentionDecode, true)->Apply([](benchmark::internal::Benchmark* b) { DecodeArgs(b, 1024); });

// One decode token's attention over every layer of SmolLM2-135M (30 layers, 3 KV heads × 3,
// head_dim 64) at a context of range(0) tokens, page type range(1), range(2) threads, split into
// 512-key parts and merged as LlamaModel does; range(3) = 1: a thread's parts with every KV head
// in one pass (the engine's way), 0: one (head, part) per call, head after head. Unlike
// BM_PagedAttentionDecode (one layer, cache-resident), the KV (184 MB at 8k f16) streams from
// RAM as in a real decode step.
// Counter: KV bytes read per second.
void BM_PagedAttentionDecodeModel(benchmark::State& st) {
  const int64_t n_ctx = st.range(0);
  const KvElem elem = static_cast<KvElem>(st.range(1));
  const int n_layer = 30, hkv = 3, grp = 3, hd = 64, bs = 16;
  constexpr int64_t kSplitKeys = 512;
  KvLayout l;
  l.n_layer = n_layer;
  l.n_head_kv = hkv;
  l.head_dim = hd;
  l.block_size = bs;
  l.dtype = elem;
  const int32_t n_pages = static_cast<int32_t>((n_ctx + bs - 1) / bs);
  PagePool pool(l, n_pages, 2);
  std::vector<int32_t> table;
  pool.allocate(n_pages, &table);
  for (int il = 0; il < n_layer; ++il) {
    auto k = randn(n_ctx * hkv * hd, 5 + il), v = randn(n_ctx * hkv * hd, 7 + il);
    for (int64_t p = 0; p < n_ctx; ++p)
      pool.write_token(il, table[p / bs], static_cast<int32_t>(p % bs), k.data() + p * hkv * hd, v.data() + p * hkv * hd);
    pool.release_filled(il);
  }
  const int64_t stride = hkv * grp * hd;
  auto q = randn(stride, 6);
  const int n_parts = static_cast<int>((n_ctx + kSplitKeys - 1) / kSplitKeys);
  std::vector<float> out(stride), acc(int64_t(hkv) * n_parts * grp * hd), m(hkv * n_parts * grp), lsum(m.size());
  ThreadPool tp(static_cast<int>(st.range(2)));
  const bool one_pass = st.range(3) != 0;
  for (auto _ : st) {
    for (int il = 0; il < n_layer; ++il) {
      PagedKvView view = pool.view(il);
      view.pages = table.data();
      tp.run([&](int ith, int nth) {
        int64_t b, e;
        if (one_pass) {  // as the engine runs it: a thread's key ranges, every head in one pass
          ThreadPool::split(n_parts, ith, nth, 1, &b, &e);
          AttnHeads hs;
          hs.n = hkv;
          hs.acc_stride = int64_t(n_parts) * grp * hd;
          hs.ml_stride = int64_t(n_parts) * grp;
          for (int64_t p = b; p < e; ++p)
            paged_attention_partial_heads(view, 0, grp, q.data(), stride, n_ctx - 1, 1, p * kSplitKeys,
                                          std::min<int64_t>(n_ctx, (p + 1) * kSplitKeys), 0.125f,
                                          acc.data() + p * grp * hd, m.data() + p * grp, lsum.data() + p * grp, nullptr, 0, hs);
        } else {  // one (head, key range) per call, head after head: a stride of hkv tiles
          ThreadPool::split(int64_t(hkv) * n_parts, ith, nth, 1, &b, &e);
          for (int64_t u = b; u < e; ++u) {
            const int h = static_cast<int>(u / n_parts), p = static_cast<int>(u % n_parts);
            const int64_t row = (int64_t(h) * n_parts + p) * grp;
            paged_attention_partial(view, h, grp, q.data(), stride, n_ctx - 1, 1, p * kSplitKeys,
                                    std::min<int64_t>(n_ctx, (p + 1) * kSplitKeys), 0.125f, acc.data() + row * hd,
                                    m.data() + row, lsum.data() + row);
          }
        }
        tp.barrier();
        ThreadPool::split(hkv, ith, nth, 1, &b, &e);
        for (int64_t h = b; h < e; ++h) {
          const int64_t row = h * n_parts * grp;
          attention_merge(n_parts, grp, 1, hd, acc.data() + row * hd, m.data() + row, lsum.data() + row,
                          static_cast<int>(h), out.data(), stride);
        }
      });
    }
    benchmark::DoNotOptimize(out.data());
  }
  int64_t bytes = 0;
  for (int il = 0; il < n_layer; ++il) bytes += int64_t(n_pages) * (l.k_layer_page_bytes(il) + l.v_layer_page_bytes(il));
  st.SetBytesProcessed(st.iterations() * bytes);
  st.counters["tok_s"] = benchmark::Counter(st.iterations(), benchmark::Counter::kIsRate);
  st.SetLabel(std::string(kv_elem_name(elem)) + (one_pass ? " heads in one pass" : " one head per call"));
}
BENCHMARK(BM_PagedAttentionDecodeModel)
    ->ArgNames({"ctx", "elem", "threads", "one_pass"})
    ->Args({8192, int(KvElem::kF16), 2, 1})
    ->Args({8192, int(KvElem::kF16), 2, 0})
    ->Args({8192, int(KvElem::kInt8), 2, 1})
    ->Args({8192, int(KvElem::kInt8), 2, 0})
    ->Args({8192, int(KvElem::kInt4), 2, 1})
    ->Args({1024, int(KvElem::kF16), 2, 1})
    ->Args({1024, int(KvElem::kF16), 1, 1})
    ->Args({1024, int(KvElem::kInt8), 1, 1})
    ->Args({8192, int(KvElem::kF16), 1, 1})
    ->Args({8192, int(KvElem::kF16), 1, 0})
    ->Args({8192, int(KvElem::kInt8), 1, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Prefill: a chunk of range(1) query tokens at the end of a range(0)-token context, f16 or
// int8 pages (range(2)), one thread. Counter: attention FLOP/s (QKᵀ and PV, causal).
void BM_PagedAttentionPrefill(benchmark::State& st) {
  const int64_t n_ctx = st.range(0);
  const int n_q = static_cast<int>(st.range(1));
  const KvElem elem = static_cast<KvElem>(st.range(2));
  const int hkv = 3, grp = 3, hd = 64, bs = 16;
  KvLayout l;
  l.n_layer = 1;
  l.n_head_kv = hkv;
  l.head_dim = hd;
  l.block_size = bs;
  l.dtype = elem;
  const int32_t n_pages = static_cast<int32_t>((n_ctx + bs - 1) / bs);
  PagePool pool(l, n_pages, 2);
  std::vector<int32_t> table;
  pool.allocate(n_pages, &table);
  auto k = randn(hkv * hd, 5), v = randn(hkv * hd, 7);
  for (int64_t p = 0; p < n_ctx; ++p) pool.write_token(0, table[p / bs], static_cast<int32_t>(p % bs), k.data(), v.data());
  pool.release_filled(0);
  PagedKvView view = pool.view(0);
  view.pages = table.data();
  const int64_t stride = hkv * grp * hd;
  auto q = randn(n_q * stride, 6);
  std::vector<float> out(q.size());
  for (auto _ : st) {
    for (int h = 0; h < hkv; ++h)
      paged_attention(view, h, grp, q.data(), stride, n_ctx - n_q, n_q, 0.125f, out.data(), stride);
    benchmark::DoNotOptimize(out.data());
  }
  const double keys = double(n_q) * (n_ctx - n_q) + double(n_q) * (n_q + 1) / 2;
  st.counters["flops"] = benchmark::Counter(st.iterations() * keys * hkv * grp * hd * 4, benchmark::Counter::kIsRate);
  st.SetLabel(kv_elem_name(elem));
}
BENCHMARK(BM_PagedAttentionPrefill)->Args({512, 512, int(KvElem::kF16)})->Args({4096, 512, int(KvElem::kF16)})->Args({4096, 512, int(KvElem::kInt8)});
}  // namespace

BENCHMARK_MAIN();
