#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>

#include "kernels/attention.h"
#include "kernels/kv_tile.h"
#include "kernels/quant.h"
#include "kv/page_pool.h"
#include "isa_param.h"

// The PagedAttention* tests run once per ISA build (isa_param.h).
// Tolerance: float accumulation with an online softmax against a double reference over the
// same stored K/V (whatever the page type, both read the same bytes); a few float ulps of the
// output scale. Built for AVX-512 (16 lanes) the worst case measured 1.6e-6; the AVX2 build
// (8 lanes, another summation order) measured 2.7e-6.
constexpr double kTol = 4e-6;

using namespace kv;

namespace {

constexpr KvElem kAll[] = {KvElem::kF32, KvElem::kF16, KvElem::kBF16, KvElem::kFp8E4M3,
                           KvElem::kFp8E5M2, KvElem::kInt8, KvElem::kInt4};

// One sequence of n_ctx positions in a one-layer pool, pages in shuffled order. The first
// n_ctx - n_last positions are written one at a time as decoding does (a filled page's staging
// freed at once); the last n_last are written as one prefill pass, whose filled pages keep
// their staging until the pass's attention ran — both of the kernel's page-copy rules run.
struct Store {
  std::unique_ptr<PagePool> pool;
  std::vector<int32_t> table;
  PagedKvView view;
  Store(int n_head_kv, int head_dim, int block_size, KvElem elem, int64_t n_ctx, uint32_t seed, float kv_offset = 0.f,
        int64_t n_last = 0) {
    KvLayout l;
    l.n_layer = 1;
    l.n_head_kv = n_head_kv;
    l.head_dim = head_dim;
    l.block_size = block_size;
    l.dtype = elem;
    EXPECT_TRUE(l.validate().is_ok());
    const int n_pages = static_cast<int>((n_ctx + block_size - 1) / block_size);
    pool = std::make_unique<PagePool>(l, n_pages + 5, static_cast<int32_t>(n_last / block_size + 3));
    std::vector<int32_t> got;
    pool->allocate(n_pages + 5, &got);
    std::mt19937 rng(seed);
    std::shuffle(got.begin(), got.end(), rng);
    table.assign(got.begin(), got.begin() + n_pages);
    for (size_t i = n_pages; i < got.size(); ++i) pool->release(got[i]);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> k(n_head_kv * head_dim), v(k.size());
    for (int64_t pos = 0; pos < n_ctx; ++pos) {
      // keys with a per-channel offset, as real keys have (what per-channel quantization is for)
      for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) + kv_offset * float(i % 7);
      for (auto& x : v) x = nd(rng);
      EXPECT_TRUE(pool->write_token(0, table[pos / block_size], static_cast<int>(pos % block_size), k.data(), v.data()));
      if (pos < n_ctx - n_last) pool->release_filled(0);
    }
    view = pool->view(0);
    view.pages = table.data();
  }
};

double rel_err(const std::vector<float>& out, const std::vector<float>& ref) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    worst = std::max(worst, double(std::abs(out[i] - ref[i])));
    scale = std::max(scale, double(std::abs(ref[i])));
  }
  return scale > 0 ? worst / scale : worst;
}

// paged_attention vs the reference over the same pages; max error relative to the output scale.
double run_case(int n_head_kv, int n_group, int head_dim, int block_size, KvElem elem, int64_t pos0, int n_q,
                uint32_t seed, int32_t window = 0) {
  Store st(n_head_kv, head_dim, block_size, elem, pos0 + n_q, seed, 0.5f, /*n_last=*/n_q);
  st.view.window = window;
  std::mt19937 rng(seed + 1000);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n_head = n_head_kv * n_group;
  const int64_t stride = int64_t(n_head) * head_dim + 5;  // padded rows, like a fused QKV buffer
  std::vector<float> q(n_q * stride);
  for (auto& x : q) x = nd(rng) * 2.f;
  std::vector<float> out(n_q * stride, 0.f), ref(n_q * stride, 0.f);
  const float scale = 1.f / std::sqrt(float(head_dim));
  for (int h = 0; h < n_head_kv; ++h) {
    paged_attention(st.view, h, n_group, q.data(), stride, pos0, n_q, scale, out.data(), stride);
    paged_attention_ref(st.view, h, n_group, q.data(), stride, pos0, n_q, scale, ref.data(), stride);
  }
  return rel_err(out, ref);
}

}  // namespace

class PagedAttention : public kvtest::IsaTest {};
class PagedAttentionMla : public kvtest::IsaTest {};
KV_INSTANTIATE_FOR_EVERY_ISA(PagedAttention);
KV_INSTANTIATE_FOR_EVERY_ISA(PagedAttentionMla);

TEST_P(PagedAttention, MatchesReferenceAcrossShapesAndDtypes) {
  uint32_t seed = 1;
  for (KvElem elem : kAll)
    for (int bs : {1, 4, 16, 32, 64}) {
      if (kv_tile_shape_error(elem, bs, 64)) continue;
      for (auto [hkv, grp] : {std::pair{3, 3}, std::pair{1, 4}, std::pair{2, 1}, std::pair{1, 16}})
        for (auto [pos0, nq] : {std::pair<int64_t, int>{0, 1}, {0, 17}, {5, 1}, {31, 9}, {100, 3}, {0, 40}, {47, 1}}) {
          double err = run_case(hkv, grp, 64, bs, elem, pos0, nq, seed++);
          // Same stored bytes, only summation order and float vs double differ.
          EXPECT_LT(err, kTol) << kv_elem_name(elem) << " bs=" << bs << " hkv=" << hkv << " grp=" << grp
                               << " pos0=" << pos0 << " nq=" << nq;
        }
    }
}

TEST_P(PagedAttention, HeadDimsAndLongContext) {
  for (KvElem elem : kAll) {
    EXPECT_LT(run_case(1, 2, 48, 16, elem, 1000, 2, 99), kTol) << kv_elem_name(elem);  // int4 V groups of 16
    EXPECT_LT(run_case(2, 2, 128, 64, elem, 300, 33, 98), kTol) << kv_elem_name(elem);
    EXPECT_LT(run_case(1, 4, 256, 16, elem, 200, 5, 97), kTol) << kv_elem_name(elem);  // Gemma 3: MQA, hd 256
  }
}

TEST_P(PagedAttention, SlidingWindowMatchesReference) {
  for (KvElem elem : {KvElem::kF16, KvElem::kFp8E4M3, KvElem::kFp8E5M2, KvElem::kInt8, KvElem::kInt4})
    for (auto [pos0, nq, win] : {std::tuple<int64_t, int, int>{0, 40, 8}, {100, 3, 16}, {500, 20, 37}, {63, 1, 64}})
      EXPECT_LT(run_case(1, 4, 64, 16, elem, pos0, nq, 5, win), kTol)
          << kv_elem_name(elem) << " pos0=" << pos0 << " nq=" << nq << " window=" << win;
}

// Flash-decoding: page-aligned parts merged by log-sum-exp equal one pass.
TEST_P(PagedAttention, SplitPartsMergeToTheFullResult) {
  for (KvElem elem : {KvElem::kF16, KvElem::kFp8E4M3, KvElem::kFp8E5M2, KvElem::kInt4}) {
    const int hkv = 3, grp = 3, hd = 64, bs = 16;
    for (auto [pos0, nq] : {std::pair<int64_t, int>{1000, 1}, {700, 8}, {64, 1}}) {
      Store st(hkv, hd, bs, elem, pos0 + nq, 11, 0.f, nq);
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.f, 1.f);
      const int64_t stride = hkv * grp * hd;
      std::vector<float> q(nq * stride), full(nq * stride), merged(nq * stride);
      for (auto& x : q) x = nd(rng);
      const int64_t ctx = pos0 + nq;
      for (int64_t part : {16, 64, 256}) {
        const int n_parts = static_cast<int>((ctx + part - 1) / part);
        const int rows = nq * grp;
        std::vector<float> acc(size_t(n_parts) * rows * hd), m(size_t(n_parts) * rows), l(m.size());
        for (int h = 0; h < hkv; ++h) {
          paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, full.data(), stride);
          for (int p = 0; p < n_parts; ++p)
            paged_attention_partial(st.view, h, grp, q.data(), stride, pos0, nq, p * part, std::min(ctx, (p + 1) * part),
                                    0.125f, acc.data() + size_t(p) * rows * hd, m.data() + p * rows, l.data() + p * rows);
          attention_merge(n_parts, grp, nq, hd, acc.data(), m.data(), l.data(), h, merged.data(), stride);
        }
        // Both are float sums of the same terms in different orders (parts vs groups of pages),
        // each within kTol of the double reference; measured up to 1.0e-6 apart (int4).
        EXPECT_LT(rel_err(merged, full), kTol) << kv_elem_name(elem) << " pos0=" << pos0 << " part=" << part;
      }
    }
  }
}

// Quantized pages against the same data kept in f32: the price of each format, bounded.
TEST_P(PagedAttention, QuantizedPagesStayCloseToF32) {
  const int hkv = 2, grp = 3, hd = 64, bs = 16;
  const int64_t pos0 = 400;
  const int nq = 4;
  Store ref(hkv, hd, bs, KvElem::kF32, pos0 + nq, 21, 0.5f, nq);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t stride = hkv * grp * hd;
  std::vector<float> q(nq * stride), base(nq * stride), out(nq * stride);
  for (auto& x : q) x = nd(rng);
  for (int h = 0; h < hkv; ++h) paged_attention(ref.view, h, grp, q.data(), stride, pos0, nq, 0.125f, base.data(), stride);
  const std::pair<KvElem, double> bounds[] = {{KvElem::kF16, 2e-3}, {KvElem::kBF16, 1e-2}, {KvElem::kInt8, 1e-2},
                                              {KvElem::kFp8E4M3, 8e-2}, {KvElem::kFp8E5M2, 1.3e-1}, {KvElem::kInt4, 1.5e-1}};
  double err_of[kKvElemCount] = {};
  for (auto [elem, bound] : bounds) {
    Store st(hkv, hd, bs, elem, pos0 + nq, 21, 0.5f, nq);  // same seed: same K/V values
    for (int h = 0; h < hkv; ++h) paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, out.data(), stride);
    const double err = rel_err(out, base);
    EXPECT_LT(err, bound) << kv_elem_name(elem);
    EXPECT_GT(err, 0.0) << kv_elem_name(elem) << ": a lossy format must differ from f32";
    err_of[int(elem)] = err;
  }
  // more bits, less error
  EXPECT_LT(err_of[int(KvElem::kInt8)], err_of[int(KvElem::kFp8E4M3)]);
  EXPECT_LT(err_of[int(KvElem::kFp8E4M3)], err_of[int(KvElem::kFp8E5M2)]);
  EXPECT_LT(err_of[int(KvElem::kInt8)], err_of[int(KvElem::kInt4)]);
}

TEST(KvTile, Fp8ConversionsRoundTripEveryCode) {
  for (int b = 0; b < 256; ++b) {
    const uint8_t u = static_cast<uint8_t>(b);
    if ((u & 0x7F) != 0x7F) {
      const float x = fp8_e4m3_to_fp32(u);
      if (x == 0.f) EXPECT_EQ(fp32_to_fp8_e4m3(x) & 0x7F, 0);
      else EXPECT_EQ(fp32_to_fp8_e4m3(x), u) << b;
    }
    if ((u & 0x7C) != 0x7C) {  // e5m2 inf / NaN codes excluded
      const float x = fp8_e5m2_to_fp32(u);
      if (x == 0.f) EXPECT_EQ(fp32_to_fp8_e5m2(x) & 0x7F, 0);
      else EXPECT_EQ(fp32_to_fp8_e5m2(x), u) << b;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_fp32(0x7E), 448.f);
  EXPECT_EQ(fp8_e4m3_to_fp32(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(fp8_e5m2_to_fp32(0x7B), 57344.f);
  EXPECT_EQ(fp32_to_fp8_e4m3(1e9f), 0x7E);       // saturates
  EXPECT_EQ(fp32_to_fp8_e4m3(-1e9f), 0xFE);
  EXPECT_EQ(fp32_to_fp8_e4m3(1.0625f), 0x38);    // tie 1 + 1/16 → even (1.0)
  EXPECT_EQ(fp32_to_fp8_e4m3(1.1875f), 0x3A);    // tie 1 + 3/16 → even (1.25)
  EXPECT_EQ(fp32_to_fp8_e5m2(1.125f), 0x3C);     // tie → 1.0
}

// Per-channel keys / per-token values: the reconstruction error of each element is within
// half a quantization step (plus f16 rounding of the scale and zero point).
TEST(KvTile, IntQuantizationErrorWithinHalfAStep) {
  const int bs = 32, hd = 64;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> kst(bs * hd), vst(bs * hd);
  std::vector<float> kf(bs * hd), vf(bs * hd);  // token-major originals
  for (int j = 0; j < bs; ++j)
    for (int d = 0; d < hd; ++d) {
      kst[d * bs + j] = fp32_to_fp16(nd(rng) * (1 + d % 5) + 3.f * (d % 3));  // channel-major
      vst[j * hd + d] = fp32_to_fp16(nd(rng));
      kf[j * hd + d] = fp16_to_fp32(kst[d * bs + j]);
      vf[j * hd + d] = fp16_to_fp32(vst[j * hd + d]);
    }
  for (KvElem e : {KvElem::kInt8, KvElem::kInt4}) {
    const int levels = e == KvElem::kInt8 ? 255 : 15;
    std::vector<uint8_t> kt(kv_k_tile_bytes(e, bs, hd)), vt(kv_v_tile_bytes(e, bs, hd));
    kv_quantize_k(kst.data(), e, bs, hd, kt.data());
    kv_quantize_v(vst.data(), e, bs, hd, vt.data());
    std::vector<float> kr(bs * hd), vr(bs * hd);
    kv_read_k(kt.data(), e, bs, hd, bs, kr.data());
    kv_read_v(vt.data(), e, bs, hd, bs, vr.data());
    for (int d = 0; d < hd; ++d) {  // keys: range per channel
      float mn = 1e9, mx = -1e9;
      for (int j = 0; j < bs; ++j) mn = std::min(mn, kf[j * hd + d]), mx = std::max(mx, kf[j * hd + d]);
      const float step = (mx - mn) / levels;
      for (int j = 0; j < bs; ++j) ASSERT_LE(std::abs(kr[j * hd + d] - kf[j * hd + d]), 0.5f * step * 1.01f + 2e-3f * std::abs(mn) + 1e-6f);
    }
    const int G = kv_v_group(e, hd);
    for (int j = 0; j < bs; ++j)  // values: range per token group
      for (int g = 0; g < hd / G; ++g) {
        float mn = 1e9, mx = -1e9;
        for (int d = g * G; d < (g + 1) * G; ++d) mn = std::min(mn, vf[j * hd + d]), mx = std::max(mx, vf[j * hd + d]);
        const float step = (mx - mn) / levels;
        for (int d = g * G; d < (g + 1) * G; ++d)
          ASSERT_LE(std::abs(vr[j * hd + d] - vf[j * hd + d]), 0.5f * step * 1.01f + 2e-3f * std::abs(mn) + 1e-6f);
      }
  }
}

// fp8 keys: per channel zero point = the midpoint (f16), one tile scale for the residuals.
// Each key is off by at most half an fp8 step of its residual |key - zero| (3 mantissa bits for
// e4m3, 2 for e5m2; the subnormal step below), so a channel with a large constant offset costs
// no more than its spread — and the bound is tight: the worst error reaches a good part of it.
TEST(KvTile, Fp8KeysZeroPointErrorWithinHalfAStep) {
  const int bs = 16, hd = 64;
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> kst(bs * hd);
  std::vector<float> kf(bs * hd);  // token-major originals
  for (int j = 0; j < bs; ++j)
    for (int d = 0; d < hd; ++d) {
      const float offset = d % 9 == 0 ? 12.f * (d % 2 ? -1.f : 1.f) : 0.f;  // outlier channels
      kst[d * bs + j] = fp32_to_fp16(offset + nd(rng) * (1 + d % 3));
      kf[j * hd + d] = fp16_to_fp32(kst[d * bs + j]);
    }
  for (KvElem e : {KvElem::kFp8E4M3, KvElem::kFp8E5M2}) {
    const bool e4 = e == KvElem::kFp8E4M3;
    std::vector<uint8_t> kt(kv_k_tile_bytes(e, bs, hd));
    kv_quantize_k(kst.data(), e, bs, hd, kt.data());
    std::vector<float> kr(bs * hd);
    kv_read_k(kt.data(), e, bs, hd, bs, kr.data());
    float scale;
    std::memcpy(&scale, kt.data() + bs * hd, 4);
    float rmax = 0.f;
    double worst_ratio = 0, sq_err = 0, sq_off_err = 0;
    for (int d = 0; d < hd; ++d) {
      float mn = 1e9, mx = -1e9;
      for (int j = 0; j < bs; ++j) mn = std::min(mn, kf[j * hd + d]), mx = std::max(mx, kf[j * hd + d]);
      uint16_t z16;
      std::memcpy(&z16, kt.data() + bs * hd + 4 + 2 * d, 2);
      const float z = fp16_to_fp32(z16);
      EXPECT_EQ(z16, fp32_to_fp16((mn + mx) / 2)) << d;
      for (int j = 0; j < bs; ++j) {
        const float r = std::abs(kf[j * hd + d] - z);
        rmax = std::max(rmax, r);
        // half a step: relative 2^-(m+1) in the normal range, half the subnormal step below
        const float bound = std::max(r * (e4 ? 0.0625f : 0.125f), scale * (e4 ? 0x1p-10f : 0x1p-17f)) * 1.0001f + 1e-6f;
        const float err = std::abs(kr[j * hd + d] - kf[j * hd + d]);
        ASSERT_LE(err, bound) << kv_elem_name(e) << " d=" << d << " j=" << j;
        worst_ratio = std::max(worst_ratio, double(err) / bound);
        sq_err += double(err) * err;
        // what the bare tile scale (no zero point) would have to meet: half a step of |key|
        const float k = std::abs(kf[j * hd + d]);
        sq_off_err += double(k * (e4 ? 0.0625f : 0.125f)) * (k * (e4 ? 0.0625f : 0.125f));
      }
    }
    EXPECT_FLOAT_EQ(scale, rmax / (e4 ? kFp8E4M3Max : kFp8E5M2Max));
    EXPECT_GT(worst_ratio, 0.5) << kv_elem_name(e) << ": the bound should be nearly reached";
    EXPECT_LT(sq_err, 0.25 * sq_off_err) << kv_elem_name(e) << ": the zero point must take the offsets out";
  }
}

TEST(KvTile, BytesPerTileAndShapeRules) {
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kF16, 16, 64), 2048);
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kInt8, 16, 64), 1024 + 64 * 4);   // + {scale, min} per channel
  EXPECT_EQ(kv_v_tile_bytes(KvElem::kInt8, 16, 64), 1024 + 16 * 4);   // + {scale, min} per token
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kInt4, 32, 64), 1024 + 64 * 4);
  EXPECT_EQ(kv_v_tile_bytes(KvElem::kInt4, 32, 64), 1024 + 32 * 2 * 4);  // groups of 32 channels
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kFp8E4M3, 16, 64), 1024 + 4 + 64 * 2);  // + tile scale + f16 zero per channel
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kFp8E5M2, 16, 64), 1024 + 4 + 64 * 2);
  EXPECT_EQ(kv_v_tile_bytes(KvElem::kFp8E4M3, 16, 64), 1024 + 4);           // + tile scale
  EXPECT_EQ(kv_k_tile_bytes(KvElem::kFp8E4M3, 16, 64) % 4, 0);              // next tile's scale stays aligned
  EXPECT_NE(kv_tile_shape_error(KvElem::kInt8, 8, 64), nullptr);
  EXPECT_EQ(kv_tile_shape_error(KvElem::kF16, 8, 64), nullptr);
  EXPECT_NE(kv_tile_shape_error(KvElem::kF16, 16, 40), nullptr);
}

TEST(KvTile, F16WriteRoundsToNearest) {
  std::vector<uint8_t> tile(2 * 4 * 2);
  float src[2] = {1.0009765625f /* 1 + 2^-10, exact in f16 */, -3.14159f};
  kv_write_k(tile.data(), KvElem::kF16, 4, 2, 1, src);  // channel-major: [d][slot]
  const uint16_t* h = reinterpret_cast<const uint16_t*>(tile.data());
  EXPECT_EQ(fp16_to_fp32(h[0 * 4 + 1]), 1.0009765625f);
  EXPECT_NEAR(fp16_to_fp32(h[1 * 4 + 1]), -3.14159f, 1e-3);
}

// The f16 K/V writes (F16C when the kernels run AVX2 or better, else the portable conversion)
// give fp32_to_fp16's bits exactly: ties to even, subnormals, overflow to inf, quiet NaNs.
class KvTileWrite : public kvtest::IsaTest {};
KV_INSTANTIATE_FOR_EVERY_ISA(KvTileWrite);

TEST_P(KvTileWrite, F16RowsMatchTheScalarConversionBitForBit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float specials[] = {0.f, -0.f, 1.0009765625f, 1.00048828125f /* tie: to even */, 65504.f, 65520.f /* → inf */,
                            -1e9f, 6e-8f, 3e-5f /* subnormal */, 1e-10f, INFINITY, -INFINITY, NAN, -NAN};
  for (int hd = 1; hd <= 40; ++hd) {
    std::vector<float> src(hd);
    for (int i = 0; i < hd; ++i) src[i] = i < int(std::size(specials)) && hd > 20 ? specials[i] : nd(rng) * 100.f;
    const int bs = 4, slot = 3;
    std::vector<uint8_t> kt(size_t(bs) * hd * 2), vt(kt.size());
    kv_write_k(kt.data(), KvElem::kF16, bs, hd, slot, src.data());
    kv_write_v(vt.data(), KvElem::kF16, bs, hd, slot, src.data());
    const uint16_t* k = reinterpret_cast<const uint16_t*>(kt.data());
    const uint16_t* v = reinterpret_cast<const uint16_t*>(vt.data());
    for (int d = 0; d < hd; ++d) {
      ASSERT_EQ(k[d * bs + slot], fp32_to_fp16(src[d])) << "K hd=" << hd << " d=" << d << " x=" << src[d];
      ASSERT_EQ(v[slot * hd + d], fp32_to_fp16(src[d])) << "V hd=" << hd << " d=" << d << " x=" << src[d];
    }
  }
}

// ---- MLA: a K-only (latent) cache whose values are the first C channels of each key row.

namespace {

// One layer of rows [c (C) ‖ k_pe (hd - C)] in a K-only pool (KvLayout::v_from_k = C), written
// as Store writes them (decode one at a time, then the last n_last as one prefill pass).
struct MlaStore {
  std::unique_ptr<PagePool> pool;
  std::vector<int32_t> table;
  PagedKvView view;
  std::vector<float> rows;  // [n_ctx][hd] as written
  MlaStore(int hd, int C, int bs, KvElem elem, int64_t n_ctx, uint32_t seed, int64_t n_last) {
    KvLayout l;
    l.n_layer = 1;
    l.n_head_kv = 1;
    l.head_dim = hd;
    l.block_size = bs;
    l.dtype = elem;
    l.v_from_k = C;
    EXPECT_TRUE(l.validate().is_ok());
    const int n_pages = static_cast<int>((n_ctx + bs - 1) / bs);
    pool = std::make_unique<PagePool>(l, n_pages + 3, static_cast<int32_t>(n_last / bs + 3));
    std::vector<int32_t> got;
    pool->allocate(n_pages + 3, &got);
    std::mt19937 rng(seed);
    std::shuffle(got.begin(), got.end(), rng);
    table.assign(got.begin(), got.begin() + n_pages);
    for (size_t i = n_pages; i < got.size(); ++i) pool->release(got[i]);
    std::normal_distribution<float> nd(0.f, 1.f);
    rows.resize(size_t(n_ctx) * hd);
    for (int64_t pos = 0; pos < n_ctx; ++pos) {
      float* k = rows.data() + pos * hd;
      for (int i = 0; i < hd; ++i) k[i] = nd(rng) + 0.3f * float(i % 5);
      EXPECT_TRUE(pool->write_token(0, table[pos / bs], static_cast<int>(pos % bs), k, nullptr));
      if (pos < n_ctx - n_last) pool->release_filled(0);
    }
    view = pool->view(0);
    view.pages = table.data();
  }
};

// H query heads of width hd against the latent rows; outputs C per head.
double run_mla_case(int H, int hd, int C, int bs, KvElem elem, int64_t pos0, int n_q, uint32_t seed) {
  MlaStore st(hd, C, bs, elem, pos0 + n_q, seed, n_q);
  EXPECT_EQ(st.view.value_dim(), C);
  std::mt19937 rng(seed + 7);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t q_stride = int64_t(H) * hd + 3, o_stride = int64_t(H) * C + 5;
  std::vector<float> q(n_q * q_stride), out(n_q * o_stride, 0.f), ref(n_q * o_stride, 0.f);
  for (auto& x : q) x = nd(rng) * 1.5f;
  const float scale = 1.f / std::sqrt(48.f);
  paged_attention(st.view, 0, H, q.data(), q_stride, pos0, n_q, scale, out.data(), o_stride);
  paged_attention_ref(st.view, 0, H, q.data(), q_stride, pos0, n_q, scale, ref.data(), o_stride);
  for (int t = 0; t < n_q; ++t)  // padding between rows untouched
    for (int64_t i = int64_t(H) * C; i < o_stride; ++i) EXPECT_EQ(out[t * o_stride + i], 0.f);
  if (elem == KvElem::kF32) {  // f32 pages: the reference against the written rows directly
    for (int t = 0; t < n_q; ++t)
      for (int h = 0; h < H; ++h) {
        const int64_t qpos = pos0 + t;
        std::vector<double> sc(qpos + 1);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= qpos; ++j) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += double(q[t * q_stride + h * hd + i]) * st.rows[j * hd + i];
          mx = std::max(mx, sc[j] = d * scale);
        }
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int c = 0; c < C; ++c) {
          double o = 0;
          for (int64_t j = 0; j <= qpos; ++j) o += sc[j] / sum * st.rows[j * hd + c];
          EXPECT_NEAR(ref[t * o_stride + h * C + c], o, 1e-5);
        }
      }
  }
  return rel_err(out, ref);
}

}  // namespace

TEST_P(PagedAttentionMla, KOnlyLayoutStoresOnlyTheLatent) {
  KvLayout l;
  l.n_layer = 4;
  l.n_head_kv = 1;
  l.head_dim = 80;  // C 64 + rope 16
  l.block_size = 16;
  l.dtype = KvDtype::kF16;
  l.v_from_k = 64;
  ASSERT_TRUE(l.validate().is_ok());
  EXPECT_EQ(l.v_layer_page_bytes(0), 0);
  EXPECT_EQ(l.k_layer_page_bytes(0), 80 * 16 * 2);
  EXPECT_DOUBLE_EQ(l.bytes_per_token(), 4.0 * 80 * 2);  // (C + rope) f16 values per layer
  l.dtype = KvDtype::kInt8;
  EXPECT_EQ(l.stage_layer_bytes(), 80 * 16 * 2);  // K staging only
  PagePool pool(l, 8);
  EXPECT_EQ(pool.page_store_bytes(), 8 * 4 * kv_k_tile_bytes(KvElem::kInt8, 16, 80));
  l.v_from_k = 72;  // not a multiple of 16
  EXPECT_FALSE(l.validate().is_ok());
  l.v_from_k = 96;  // more than head_dim
  EXPECT_FALSE(l.validate().is_ok());
}

TEST_P(PagedAttentionMla, MatchesReferenceAllDtypes) {
  uint32_t seed = 300;
  for (KvElem elem : kAll)
    for (int bs : {16, 32})
      for (auto [pos0, nq] : {std::pair<int64_t, int>{0, 1}, {0, 19}, {7, 1}, {40, 9}, {300, 1}, {129, 4}}) {
        const double err = run_mla_case(8, 80, 64, bs, elem, pos0, nq, seed++);
        EXPECT_LT(err, kTol) << kv_elem_name(elem) << " bs=" << bs << " pos0=" << pos0 << " nq=" << nq;
      }
  // other shapes: 16 heads (kAttnMaxGroup), DeepSeek-like widths within the kernel's limits
  for (KvElem elem : {KvElem::kF16, KvElem::kFp8E4M3, KvElem::kFp8E5M2, KvElem::kInt8, KvElem::kInt4}) {
    EXPECT_LT(run_mla_case(16, 80, 64, 16, elem, 50, 3, 9), kTol) << kv_elem_name(elem);
    EXPECT_LT(run_mla_case(4, 160, 128, 16, elem, 70, 2, 10), kTol) << kv_elem_name(elem);
  }
}

TEST_P(PagedAttentionMla, SplitPartsMergeToTheFullResult) {
  const int H = 8, hd = 80, C = 64, bs = 16;
  for (KvElem elem : {KvElem::kF16, KvElem::kFp8E4M3, KvElem::kFp8E5M2, KvElem::kInt4}) {
    const int64_t pos0 = 700;
    const int nq = 2;
    MlaStore st(hd, C, bs, elem, pos0 + nq, 17, nq);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t qs = H * hd, os = H * C, ctx = pos0 + nq, part = 256;
    std::vector<float> q(nq * qs), full(nq * os), merged(nq * os);
    for (auto& x : q) x = nd(rng);
    paged_attention(st.view, 0, H, q.data(), qs, pos0, nq, 0.144f, full.data(), os);
    const int n_parts = static_cast<int>((ctx + part - 1) / part), rows = nq * H;
    std::vector<float> acc(size_t(n_parts) * rows * C), m(size_t(n_parts) * rows), l(m.size());
    for (int p = 0; p < n_parts; ++p)
      paged_attention_partial(st.view, 0, H, q.data(), qs, pos0, nq, p * part, std::min(ctx, (p + 1) * part), 0.144f,
                              acc.data() + size_t(p) * rows * C, m.data() + p * rows, l.data() + p * rows);
    attention_merge(n_parts, H, nq, C, acc.data(), m.data(), l.data(), 0, merged.data(), os);
    // Float merge of float parts: 1.01e-6 measured on an AVX2-only build, below 1e-6 with AVX-512.
    EXPECT_LT(rel_err(merged, full), 2e-6) << kv_elem_name(elem);
  }
}

// Eviction leaves holes in a block table (-1): the kernel skips them, as the reference does,
// for every page type, decode and prefill tiles, with the query's own page staged.
TEST_P(PagedAttention, EvictedPagesAreSkipped) {
  for (KvElem elem : kAll) {
    const int hkv = 2, grp = 3, hd = 64, bs = 16;
    for (auto [pos0, nq] : {std::pair<int64_t, int>{700, 1}, {300, 9}}) {
      Store st(hkv, hd, bs, elem, pos0 + nq, 21, 0.5f, nq);
      std::vector<int32_t> holes = st.table;
      for (size_t i = 1; i + 2 < holes.size(); ++i)
        if (i % 3 != 0 || i == 5 || i == 6) holes[i] = -1;  // runs of holes, whole groups of 4 included
      st.view.pages = holes.data();
      std::mt19937 rng(5);
      std::normal_distribution<float> nd(0.f, 1.f);
      const int64_t stride = hkv * grp * hd;
      std::vector<float> q(nq * stride), out(nq * stride), ref(nq * stride), full(nq * stride);
      for (auto& x : q) x = nd(rng);
      for (int h = 0; h < hkv; ++h) {
        paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, out.data(), stride);
        paged_attention_ref(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, ref.data(), stride);
      }
      EXPECT_LT(rel_err(out, ref), kTol) << kv_elem_name(elem) << " nq=" << nq;
      // and the holes matter: the full table gives another answer
      st.view.pages = st.table.data();
      for (int h = 0; h < hkv; ++h) paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, full.data(), stride);
      EXPECT_GT(rel_err(full, ref), 1e-3) << kv_elem_name(elem);
    }
  }
}

// The per-page log-sum-exp the kernel emits for eviction scores gives each page's attention
// mass: exp(page_lse − row_lse) against a double softmax over the keys read back from the
// pages; masses over pages sum to 1. Split into parts, as flash-decoding runs it.
TEST_P(PagedAttention, PageLogSumExpGivesEachPagesAttentionMass) {
  for (KvElem elem : {KvElem::kF32, KvElem::kF16, KvElem::kInt8, KvElem::kFp8E4M3}) {
    const int hkv = 1, grp = 3, hd = 64, bs = 16;
    const int64_t pos0 = 200;
    const int nq = 3;
    Store st(hkv, hd, bs, elem, pos0 + nq, 31, 0.5f, 0);
    std::vector<int32_t> holes = st.table;
    holes[2] = holes[7] = -1;
    st.view.pages = holes.data();
    std::mt19937 rng(6);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t stride = hkv * grp * hd, ctx = pos0 + nq;
    const int rows = nq * grp;
    std::vector<float> q(nq * stride);
    for (auto& x : q) x = nd(rng) * 2.f;
    const int64_t part = 64;
    const int n_parts = static_cast<int>((ctx + part - 1) / part);
    const int64_t n_pages = (ctx + bs - 1) / bs;
    std::vector<float> acc(size_t(n_parts) * rows * hd), m(size_t(n_parts) * rows), l(m.size());
    std::vector<float> lse(size_t(n_parts) * rows * (part / bs));
    for (int p = 0; p < n_parts; ++p)
      paged_attention_partial(st.view, 0, grp, q.data(), stride, pos0, nq, p * part, std::min(ctx, (p + 1) * part), 0.125f,
                              acc.data() + size_t(p) * rows * hd, m.data() + p * rows, l.data() + p * rows,
                              lse.data() + size_t(p) * rows * (part / bs), part / bs);
    std::vector<float> kp(bs * hd);
    for (int r = 0; r < rows; ++r) {
      const int t = r / grp, g = r % grp;
      const int64_t qpos = pos0 + t;
      // row lse merged over parts
      double mx = -1e300;
      for (int p = 0; p < n_parts; ++p) mx = std::max(mx, double(m[p * rows + r]));
      double lsum = 0;
      for (int p = 0; p < n_parts; ++p) lsum += std::exp(double(m[p * rows + r]) - mx) * l[p * rows + r];
      const double row_lse = mx + std::log(lsum);
      // reference masses
      std::vector<double> sc(n_pages * bs, -1e300), mass(n_pages, 0.0);
      double rmx = -1e300;
      for (int64_t pg = 0; pg < n_pages; ++pg) {
        if (holes[pg] < 0) continue;
        const int32_t slot = st.pool->stage_of(0, holes[pg]);  // the filling page: its f16 staging copy
        if (slot >= 0) kv_read_k(st.pool->stage_k(0, slot), KvElem::kF16, bs, hd, bs, kp.data());
        else kv_read_k(st.pool->k_data(0, holes[pg]), elem, bs, hd, bs, kp.data());
        for (int j = 0; j < bs && pg * bs + j <= qpos; ++j) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += double(q[t * stride + g * hd + i]) * kp[j * hd + i];
          sc[pg * bs + j] = d * 0.125;
          rmx = std::max(rmx, sc[pg * bs + j]);
        }
      }
      double z = 0;
      for (double& x : sc) z += (x = x > -1e299 ? std::exp(x - rmx) : 0.0);
      for (int64_t k = 0; k < n_pages * bs; ++k) mass[k / bs] += sc[k] / z;
      double total = 0;
      for (int64_t pg = 0; pg < n_pages; ++pg) {
        const int p = static_cast<int>(pg * bs / part), i = static_cast<int>(pg - p * part / bs);
        const float e = lse[size_t(p) * rows * (part / bs) + r * (part / bs) + i];
        const double got = std::isinf(e) ? 0.0 : std::exp(double(e) - row_lse);
        total += got;
        EXPECT_NEAR(got, mass[pg], 1e-5) << kv_elem_name(elem) << " row " << r << " page " << pg;
        if (holes[pg] < 0) {
          EXPECT_TRUE(std::isinf(e) && e < 0);
        }
      }
      EXPECT_NEAR(total, 1.0, 1e-5);
    }
  }
}

// Two float arrays equal bit for bit.
static bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The heads tests' case: hkv heads' pages (head_dim 64, 16-key pages) for pos0 + nq tokens,
// the table with holes when asked, a window, and random queries. Built in place (the view
// points into it).
struct HeadsCase {
  Store st;
  std::vector<int32_t> table;
  std::vector<float> q;
  HeadsCase(KvElem elem, int64_t pos0, int nq, int win, bool holes, int hkv, int grp, uint32_t seed, uint32_t q_seed)
      : st(hkv, 64, 16, elem, pos0 + nq, seed, 0.5f, nq), table(st.table) {
    if (holes)
      for (size_t i = 1; i + 2 < table.size(); ++i)
        if (i % 3 == 0 || i == 5) table[i] = -1;
    st.view.pages = table.data();
    st.view.window = win;
    std::mt19937 rng(q_seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    q.resize(size_t(nq) * hkv * grp * 64);
    for (auto& x : q) x = nd(rng) * 2.f;
  }
  HeadsCase(const HeadsCase&) = delete;
};

// Several KV heads in one pass (what split decode runs) give each head's per-head result bit
// for bit: acc, m, l and the pages' log-sum-exps, for every page type, with holes in the table,
// a staged last page, a sliding window, a decode token and a tile of queries.
TEST_P(PagedAttention, HeadsInOnePassEqualOneHeadAtATime) {
  for (KvElem elem : kAll) {
    const int hd = 64, bs = 16;
    // The last case has 2 × 8 × 16 rows, more than one pass holds: the heads go one at a time.
    for (auto [pos0, nq, win, holes_on, hkv, grp] :
         {std::tuple<int64_t, int, int, bool, int, int>{700, 1, 0, false, 3, 3}, {700, 1, 0, true, 3, 3},
          {300, 6, 0, true, 3, 3}, {500, 2, 100, false, 3, 3}, {300, 8, 0, false, 2, 16}}) {
      HeadsCase hc(elem, pos0, nq, win, holes_on, hkv, grp, 41, 7);
      Store& st = hc.st;
      const std::vector<float>& q = hc.q;
      const int64_t stride = hkv * grp * hd, ctx = pos0 + nq, part = 128;
      const int rows = nq * grp, ppp = static_cast<int>(part / bs);
      const int n_parts = static_cast<int>((ctx + part - 1) / part);
      // per head: [n_parts][rows] m/l, [n_parts][rows][hd] acc, [n_parts][rows][ppp] lse
      const size_t acc_h = size_t(n_parts) * rows * hd, ml_h = size_t(n_parts) * rows;
      // (entries for pages past the context's end are never written: the same filler in both)
      std::vector<float> acc1(hkv * acc_h, 7.f), m1(hkv * ml_h, 7.f), l1(hkv * ml_h, 7.f), lse1(hkv * ml_h * ppp, 7.f);
      std::vector<float> acc2 = acc1, m2 = m1, l2 = l1, lse2 = lse1;
      for (int p = 0; p < n_parts; ++p) {
        const int64_t k0 = p * part, k1 = std::min(ctx, (p + 1) * part);
        for (int h = 0; h < hkv; ++h)
          paged_attention_partial(st.view, h, grp, q.data(), stride, pos0, nq, k0, k1, 0.125f,
                                  acc1.data() + h * acc_h + size_t(p) * rows * hd, m1.data() + h * ml_h + p * rows,
                                  l1.data() + h * ml_h + p * rows, lse1.data() + (h * ml_h + p * rows) * ppp, ppp);
        AttnHeads hs;
        hs.n = hkv;
        hs.acc_stride = static_cast<int64_t>(acc_h);
        hs.ml_stride = static_cast<int64_t>(ml_h);
        hs.lse_stride = static_cast<int64_t>(ml_h) * ppp;
        paged_attention_partial_heads(st.view, 0, grp, q.data(), stride, pos0, nq, k0, k1, 0.125f,
                                      acc2.data() + size_t(p) * rows * hd, m2.data() + p * rows, l2.data() + p * rows,
                                      lse2.data() + size_t(p) * rows * ppp, ppp, hs);
      }
      EXPECT_TRUE(bits_equal(acc1, acc2)) << kv_elem_name(elem) << " pos0=" << pos0 << " nq=" << nq;
      EXPECT_TRUE(bits_equal(m1, m2)) << kv_elem_name(elem) << " pos0=" << pos0 << " nq=" << nq;
      EXPECT_TRUE(bits_equal(l1, l2)) << kv_elem_name(elem) << " pos0=" << pos0 << " nq=" << nq;
      EXPECT_TRUE(bits_equal(lse1, lse2)) << kv_elem_name(elem) << " pos0=" << pos0 << " nq=" << nq;
    }
  }
}

// Decode over float pages runs a page group's KV heads page by page (all K tiles, then all V
// tiles, in pool order) on AVX-512; every head's acc, m, l and page log-sum-exps are the bits
// of the head-after-head way, for 1 to 4 rows per head (GQA groups 1-4 at one token, 2 tokens
// × 2), 1 to 3 KV heads, holes, a window, a partial last page and key ranges split in parts.
TEST_P(PagedAttention, PageMajorHeadsGiveTheBitsOfHeadAfterHead) {
  for (KvElem elem : {KvElem::kF16, KvElem::kBF16, KvElem::kF32, KvElem::kInt8}) {
    const int hd = 64, bs = 16;
    for (auto [pos0, nq, win, holes_on, hkv, grp] :
         {std::tuple<int64_t, int, int, bool, int, int>{700, 1, 0, false, 3, 3}, {700, 1, 0, true, 3, 3},
          {517, 1, 0, false, 1, 4}, {333, 1, 60, true, 2, 1}, {250, 2, 0, false, 3, 2}, {901, 1, 0, true, 3, 2}}) {
      HeadsCase hc(elem, pos0, nq, win, holes_on, hkv, grp, 43, 11);
      Store& st = hc.st;
      const std::vector<float>& q = hc.q;
      const int64_t stride = hkv * grp * hd, ctx = pos0 + nq, part = 256;
      const int rows = nq * grp, ppp = static_cast<int>(part / bs);
      const int n_parts = static_cast<int>((ctx + part - 1) / part);
      const size_t acc_h = size_t(n_parts) * rows * hd, ml_h = size_t(n_parts) * rows;
      auto run = [&](bool page_major, std::vector<float>* acc, std::vector<float>* m, std::vector<float>* l,
                     std::vector<float>* lse) {
        set_attention_page_major_for_testing(page_major);
        acc->assign(hkv * acc_h, 7.f);
        m->assign(hkv * ml_h, 7.f);
        l->assign(hkv * ml_h, 7.f);
        lse->assign(hkv * ml_h * ppp, 7.f);
        AttnHeads hs;
        hs.n = hkv;
        hs.acc_stride = static_cast<int64_t>(acc_h);
        hs.ml_stride = static_cast<int64_t>(ml_h);
        hs.lse_stride = static_cast<int64_t>(ml_h) * ppp;
        for (int p = 0; p < n_parts; ++p)
          paged_attention_partial_heads(st.view, 0, grp, q.data(), stride, pos0, nq, p * part,
                                        std::min(ctx, (p + 1) * part), 0.125f, acc->data() + size_t(p) * rows * hd,
                                        m->data() + p * rows, l->data() + p * rows,
                                        lse->data() + size_t(p) * rows * ppp, ppp, hs);
        set_attention_page_major_for_testing(true);
      };
      std::vector<float> acc1, m1, l1, lse1, acc2, m2, l2, lse2;
      run(false, &acc1, &m1, &l1, &lse1);
      run(true, &acc2, &m2, &l2, &lse2);
      const std::string what = std::string(kv_elem_name(elem)) + " pos0=" + std::to_string(pos0) +
                               " hkv=" + std::to_string(hkv) + " grp=" + std::to_string(grp);
      EXPECT_TRUE(bits_equal(acc1, acc2)) << what;
      EXPECT_TRUE(bits_equal(m1, m2)) << what;
      EXPECT_TRUE(bits_equal(l1, l2)) << what;
      EXPECT_TRUE(bits_equal(lse1, lse2)) << what;
      // and both agree with the reference
      std::vector<float> out(nq * stride), ref(nq * stride);
      for (int h = 0; h < hkv; ++h) {
        paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, out.data(), stride);
        paged_attention_ref(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, ref.data(), stride);
      }
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-3f + 2e-3f * std::fabs(ref[i])) << what << " i=" << i;
    }
  }
}

// A query row's output does not depend on the tile it is computed in (what batch and chunk
// invariance, and speculative verification, rest on): a tile of many rows equals, bit for bit,
// its tokens one at a time (3 or 4 rows each, another group_rows width). Every page type, bs 16
// and 32, a partial last page, a sliding window, GQA groups of 3 and 4.
TEST_P(PagedAttention, RowsGiveTheSameBitsInAnyTile) {
  for (KvElem elem : kAll)
    for (auto [bs, grp, pos0, nq, win] : {std::tuple<int, int, int64_t, int, int>{16, 3, 300, 8, 0}, {32, 3, 200, 13, 0},
                                          {16, 4, 90, 7, 0}, {16, 3, 400, 8, 100}}) {
      const int hd = 64, hkv = 2;
      if (kv_tile_shape_error(elem, bs, hd)) continue;
      Store st(hkv, hd, bs, elem, pos0 + nq, 77, 0.5f, nq);
      st.view.window = win;
      std::mt19937 rng(9);
      std::normal_distribution<float> nd(0.f, 1.f);
      const int64_t stride = int64_t(hkv) * grp * hd;
      std::vector<float> q(nq * stride);
      for (auto& x : q) x = nd(rng) * 2.f;
      std::vector<float> tile(q.size(), 0.f), one(q.size(), 0.f);
      for (int h = 0; h < hkv; ++h) {
        paged_attention(st.view, h, grp, q.data(), stride, pos0, nq, 0.125f, tile.data(), stride);
        for (int t = 0; t < nq; ++t)
          paged_attention(st.view, h, grp, q.data() + t * stride, stride, pos0 + t, 1, 0.125f, one.data() + t * stride,
                          stride);
      }
      EXPECT_EQ(std::memcmp(tile.data(), one.data(), tile.size() * sizeof(float)), 0)
          << kv_elem_name(elem) << " bs=" << bs << " grp=" << grp << " pos0=" << pos0 << " nq=" << nq << " win=" << win;
    }
}
