#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/attention.h"
#include "kernels/quant.h"

// Tolerance: float accumulation with an online softmax against a double reference over the
// same stored K/V; a few float ulps of the output scale.
constexpr double kTol = 2e-6;

using namespace kv;

namespace {
// Builds a paged KV store for one sequence of n_ctx positions with a shuffled page order,
// runs paged_attention and the reference, and returns the max relative error.
double run_case(int n_head_kv, int n_group, int head_dim, int block_size, KvElem elem, int64_t pos0, int n_q,
                uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t n_ctx = pos0 + n_q;
  const int n_pages = static_cast<int>((n_ctx + block_size - 1) / block_size);
  const int64_t elem_bytes = elem == KvElem::kF32 ? 4 : 2;
  const int64_t page_bytes = int64_t(n_head_kv) * block_size * head_dim * elem_bytes;
  const int pool_pages = n_pages + 3;
  std::vector<uint8_t> kbuf(pool_pages * page_bytes), vbuf(pool_pages * page_bytes);
  std::vector<int32_t> table(n_pages);
  for (int i = 0; i < n_pages; ++i) table[i] = (i * 7 + 3) % pool_pages;  // non-contiguous
  // distinct page ids required
  std::vector<int> used(pool_pages, 0);
  for (auto& p : table) {
    while (used[p]) p = (p + 1) % pool_pages;
    used[p] = 1;
  }
  std::vector<float> tok(n_head_kv * head_dim);
  for (int64_t pos = 0; pos < n_ctx; ++pos) {
    for (auto& x : tok) x = nd(rng);
    write_kv_token(kbuf.data() + table[pos / block_size] * page_bytes, elem, n_head_kv, block_size, head_dim,
                   pos % block_size, tok.data());
    for (auto& x : tok) x = nd(rng);
    write_kv_token(vbuf.data() + table[pos / block_size] * page_bytes, elem, n_head_kv, block_size, head_dim,
                   pos % block_size, tok.data());
  }
  const int n_head = n_head_kv * n_group;
  const int64_t stride = int64_t(n_head) * head_dim + 5;  // padded rows, like a fused QKV buffer
  std::vector<float> q(n_q * stride);
  for (auto& x : q) x = nd(rng) * 2.f;
  std::vector<float> out(n_q * stride, 0.f), ref(n_q * stride, 0.f);
  PagedKvView v;
  v.k_base = kbuf.data();
  v.v_base = vbuf.data();
  v.page_bytes = page_bytes;
  v.pages = table.data();
  v.n_head_kv = n_head_kv;
  v.block_size = block_size;
  v.head_dim = head_dim;
  v.elem = elem;
  const float scale = 1.f / std::sqrt(float(head_dim));
  for (int h = 0; h < n_head_kv; ++h) {
    paged_attention(v, h, n_group, q.data(), stride, pos0, n_q, scale, out.data(), stride);
    paged_attention_ref(v, h, n_group, q.data(), stride, pos0, n_q, scale, ref.data(), stride);
  }
  // Normalized error: worst |fast - ref| over the largest |ref| (outputs are convex mixtures of
  // V rows, so this is the error relative to the values' scale).
  double worst = 0, scale_ref = 0;
  for (int t = 0; t < n_q; ++t)
    for (int i = 0; i < n_head * head_dim; ++i) {
      double a = out[t * stride + i], b = ref[t * stride + i];
      worst = std::max(worst, std::abs(a - b));
      scale_ref = std::max(scale_ref, std::abs(b));
    }
  return worst / scale_ref;
}
}  // namespace

TEST(PagedAttention, MatchesReferenceAcrossShapes) {
  uint32_t seed = 1;
  for (KvElem elem : {KvElem::kF32, KvElem::kF16})
    for (int bs : {1, 4, 16, 32})
      for (auto [hkv, grp] : {std::pair{3, 3}, std::pair{1, 4}, std::pair{2, 1}})
        for (auto [pos0, nq] : {std::pair<int64_t, int>{0, 1}, {0, 17}, {5, 1}, {31, 9}, {100, 3}, {0, 40}}) {
          double err = run_case(hkv, grp, 64, bs, elem, pos0, nq, seed++);
          // Same inputs, only summation order and float vs double differ.
          EXPECT_LT(err, kTol) << "elem=" << int(elem) << " bs=" << bs << " hkv=" << hkv << " grp=" << grp
                               << " pos0=" << pos0 << " nq=" << nq;
        }
}

TEST(PagedAttention, OddHeadDimAndLongContext) {
  EXPECT_LT(run_case(1, 2, 40, 16, KvElem::kF16, 1000, 2, 99), kTol);
  EXPECT_LT(run_case(2, 2, 128, 64, KvElem::kF32, 300, 33, 98), kTol);
}

TEST(PagedAttention, F16WriteRoundsToNearest) {
  std::vector<uint8_t> page(2 * 4 * 2);
  float src[2] = {1.0009765625f /* 1 + 2^-10, exact in f16 */, -3.14159f};
  write_kv_token(page.data(), KvElem::kF16, 1, 4, 2, 1, src);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(page.data());
  EXPECT_EQ(fp16_to_fp32(h[2]), 1.0009765625f);
  EXPECT_NEAR(fp16_to_fp32(h[3]), -3.14159f, 1e-3);
}
