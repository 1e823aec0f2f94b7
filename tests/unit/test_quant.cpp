// Reference dequantizers on hand-built blocks (expected values computed from the format's
// definition, packed by test-side packers written from the layout description), and
// quantize -> dequantize round trips with their error bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/quant.h"

namespace kv {
namespace {

// ---- hand-built blocks ----------------------------------------------------------------------

TEST(QuantRef, Q4_0Block) {
  BlockQ4_0 b{};
  b.d = fp32_to_fp16(0.5f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  float y[32];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q4_0, &b, y, 32));
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], (j - 8) * 0.5f) << j;             // low nibbles: elements 0..15
    EXPECT_EQ(y[j + 16], (15 - j - 8) * 0.5f) << j;   // high nibbles: elements 16..31
  }
}

TEST(QuantRef, Q4_1Block) {
  BlockQ4_1 b{};
  b.d = fp32_to_fp16(0.25f);
  b.m = fp32_to_fp16(-1.0f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(((j * 7) & 15) | (j << 4));
  float y[32];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q4_1, &b, y, 32));
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], ((j * 7) & 15) * 0.25f - 1.0f) << j;
    EXPECT_EQ(y[j + 16], j * 0.25f - 1.0f) << j;
  }
}

TEST(QuantRef, Q8_0TwoBlocks) {
  BlockQ8_0 b[2]{};
  b[0].d = fp32_to_fp16(0.125f);
  b[1].d = fp32_to_fp16(-3.0f);
  for (int j = 0; j < 32; ++j) {
    b[0].qs[j] = static_cast<int8_t>(j * 8 - 128);  // -128 .. 120: full int8 range
    b[1].qs[j] = static_cast<int8_t>(j - 16);
  }
  float y[64];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q8_0, b, y, 64));
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(y[j], (j * 8 - 128) * 0.125f);
    EXPECT_EQ(y[32 + j], (j - 16) * -3.0f);
  }
}

TEST(QuantRef, Q5_0Block) {
  BlockQ5_0 b{};
  b.d = fp32_to_fp16(0.5f);
  int q[32];  // 0..31 each
  for (int j = 0; j < 32; ++j) q[j] = (j * 13 + 5) % 32;
  uint32_t qh = 0;
  for (int j = 0; j < 32; ++j) qh |= static_cast<uint32_t>(q[j] >> 4) << j;  // bit j: element j
  std::memcpy(b.qh, &qh, 4);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>((q[j] & 15) | ((q[j + 16] & 15) << 4));
  float y[32];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q5_0, &b, y, 32));
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], (q[j] - 16) * 0.5f) << j;
}

// Packs 8 six-bit scales and mins the way the Q4_K layout comment in ggml describes:
// bytes 0-3: sc[0..3] | (sc[4..7] >> 4) << 6; bytes 4-7: the same for mins;
// bytes 8-11: (sc[4..7] & 15) | (m[4..7] & 15) << 4.
void pack_k4_scales(const int sc[8], const int m[8], uint8_t out[12]) {
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
    out[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
  }
}

TEST(QuantRef, Q4_KBlock) {
  // Scales and mins use all 6 bits (values ≥ 32 exercise the high-bit unpacking).
  const int sc[8] = {1, 63, 17, 32, 48, 5, 60, 33};
  const int mn[8] = {62, 0, 31, 47, 16, 63, 2, 40};
  BlockQ4_K b{};
  b.d = fp32_to_fp16(0.0625f);
  b.dmin = fp32_to_fp16(0.03125f);
  pack_k4_scales(sc, mn, b.scales);
  int q[256];
  for (int e = 0; e < 256; ++e) q[e] = (e * 5 + e / 32) % 16;
  // Element e: 64-element chunk c = e / 64; first 32 of a chunk are low nibbles of
  // qs[32c .. 32c+31], next 32 the high nibbles of the same bytes.
  for (int e = 0; e < 256; ++e) {
    const int c = e / 64, r = e % 64;
    uint8_t& byte = b.qs[32 * c + r % 32];
    byte = static_cast<uint8_t>(r < 32 ? (byte & 0xF0) | q[e] : (byte & 0x0F) | (q[e] << 4));
  }
  float y[256];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q4_K, &b, y, 256));
  for (int e = 0; e < 256; ++e) {
    const int s = e / 32;
    const double want = 0.0625 * sc[s] * q[e] - 0.03125 * mn[s];
    EXPECT_EQ(y[e], static_cast<float>(want)) << e;
  }
}

TEST(QuantRef, Q6_KBlock) {
  BlockQ6_K b{};
  b.d = fp32_to_fp16(0.01f);
  const float d = fp16_to_fp32(b.d);
  for (int s = 0; s < 16; ++s) b.scales[s] = static_cast<int8_t>(s % 2 ? -(s * 8) : s * 8 + 7);
  b.scales[3] = -128;
  b.scales[12] = 127;
  int q[256];  // 0..63, stored value; x = d * scale * (q - 32)
  for (int e = 0; e < 256; ++e) q[e] = (e * 11 + 3) % 64;
  // Element e: half h = e / 128, r = e % 128, k = r / 32, l = r % 32. Low 4 bits are nibble
  // k / 2 of ql[64h + l + 32 (k % 2)]; high 2 bits are bits 2k..2k+1 of qh[32h + l].
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
    uint8_t& lo = b.ql[64 * h + l + 32 * (k % 2)];
    lo = static_cast<uint8_t>(k / 2 ? (lo & 0x0F) | ((q[e] & 15) << 4) : (lo & 0xF0) | (q[e] & 15));
    b.qh[32 * h + l] |= static_cast<uint8_t>((q[e] >> 4) << (2 * k));
  }
  float y[256];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::Q6_K, &b, y, 256));
  for (int e = 0; e < 256; ++e) {
    // One scale per 16 elements, in element order.
    const float want = d * static_cast<float>(b.scales[e / 16]) * static_cast<float>(q[e] - 32);
    EXPECT_EQ(y[e], want) << e;
  }
}

TEST(QuantRef, PlainTypes) {
  const float f[3] = {1.5f, -0.0f, 65504.0f};
  const uint16_t h[3] = {0x3E00, 0x8000, 0x7BFF};  // 1.5, -0, 65504 as fp16
  const uint16_t bf[3] = {0x3FC0, 0x8000, 0x477F};  // 1.5, -0, 65280 as bf16
  float y[3];
  ASSERT_TRUE(dequantize_row_ref(GgmlType::F32, f, y, 3));
  EXPECT_EQ(std::memcmp(y, f, sizeof f), 0);
  ASSERT_TRUE(dequantize_row_ref(GgmlType::F16, h, y, 3));
  EXPECT_EQ(y[0], 1.5f);
  EXPECT_TRUE(y[1] == 0.0f && std::signbit(y[1]));
  EXPECT_EQ(y[2], 65504.0f);
  ASSERT_TRUE(dequantize_row_ref(GgmlType::BF16, bf, y, 3));
  EXPECT_EQ(y[0], 1.5f);
  EXPECT_TRUE(y[1] == 0.0f && std::signbit(y[1]));
  EXPECT_EQ(y[2], 65280.0f);
}

TEST(QuantRef, UnsupportedTypesWriteNothing) {
  uint8_t src[512] = {};
  for (GgmlType t : {GgmlType::Q5_1, GgmlType::Q8_1, GgmlType::Q2_K, GgmlType::Q3_K,
                     GgmlType::Q5_K, GgmlType::Q8_K, GgmlType::I8, GgmlType::F64}) {
    std::vector<float> y(256, 42.0f);
    EXPECT_FALSE(dequantize_row_ref(t, src, y.data(), 256)) << type_name(t);
    for (float v : y) ASSERT_EQ(v, 42.0f);
  }
}

TEST(QuantRef, Fp16Conversions) {
  EXPECT_EQ(fp32_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(fp32_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(65519.0f), 0x7BFF);  // below the tie with 65536
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);  // the tie rounds to even = inf
  EXPECT_EQ(fp32_to_fp16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(fp32_to_fp16(0x1p-25f), 0x0000);  // tie between 0 and it: even
  EXPECT_EQ(fp32_to_fp16(0x1.8p-24f), 0x0002);  // tie between 1 and 2 subnormal units: even
  EXPECT_EQ(fp32_to_fp16(0x1.ffcp-15f), 0x0400);  // rounds up into the smallest normal
  EXPECT_EQ(fp32_to_fp16(-2.0f), 0xC000);
  EXPECT_EQ(fp16_to_fp32(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_to_fp32(0x03FF), 0x1.ff8p-15f);
  EXPECT_EQ(fp16_to_fp32(0x7C00), INFINITY);
  EXPECT_TRUE(std::isnan(fp16_to_fp32(0x7E00)));
  EXPECT_EQ(fp32_to_bf16(1.0f + 0x1p-8f), 0x3F80);   // tie, even stays
  EXPECT_EQ(fp32_to_bf16(1.0f + 0x3p-8f), 0x3F82);   // tie, odd rounds up
  EXPECT_EQ(fp32_to_bf16(NAN) & 0x7FC0, 0x7FC0);
}

// ---- quantizers -------------------------------------------------------------------------------

std::vector<float> random_row(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));  // [n]
  for (auto& v : x) v = nd(rng);
  // Outliers: the case that sets each block's scale.
  for (int64_t i = 5; i < n; i += 97) x[i] *= 8.0f;
  return x;
}

TEST(QuantRef, Q8_0Exact) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j * 4 - 62);  // amax 62 -> d = 62/127
  x[31] = 127.0f;                                                        // amax 127 -> d = 1
  x[1] = 2.5f;   // roundf: half away from zero
  x[2] = -2.5f;
  BlockQ8_0 b;
  quantize_row_q8_0_ref(x, &b, 32);
  EXPECT_EQ(fp16_to_fp32(b.d), 1.0f);
  EXPECT_EQ(b.qs[1], 3);
  EXPECT_EQ(b.qs[2], -3);
  EXPECT_EQ(b.qs[31], 127);
  EXPECT_EQ(b.qs[0], -62);
}

TEST(QuantRef, Q4_0Exact) {
  // Largest magnitude is negative (-4): d = -4 / -8 = 0.5 and it maps to q = 0.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = 0.5f * static_cast<float>((j % 16) - 8);
  BlockQ4_0 b;
  quantize_row_q4_0_ref(x, &b, 32);
  EXPECT_EQ(fp16_to_fp32(b.d), 0.5f);
  float y[32];
  dequantize_row_ref(GgmlType::Q4_0, &b, y, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], x[j]) << j;
  // Largest magnitude positive: d is negative, +max maps to q = 0 too.
  for (int j = 0; j < 32; ++j) x[j] = -x[j];
  quantize_row_q4_0_ref(x, &b, 32);
  EXPECT_EQ(fp16_to_fp32(b.d), -0.5f);
  dequantize_row_ref(GgmlType::Q4_0, &b, y, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], x[j]) << j;
}

TEST(QuantRef, Q4_1Exact) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = -1.0f + 0.25f * static_cast<float>((j * 3) % 16);
  BlockQ4_1 b;
  quantize_row_q4_1_ref(x, &b, 32);
  EXPECT_EQ(fp16_to_fp32(b.d), 0.25f);
  EXPECT_EQ(fp16_to_fp32(b.m), -1.0f);
  float y[32];
  dequantize_row_ref(GgmlType::Q4_1, &b, y, 32);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[j], x[j]) << j;
}

TEST(QuantRef, ZeroBlocks) {
  const float x[64] = {};
  float y[64];
  BlockQ8_0 b8[2];
  quantize_row_q8_0_ref(x, b8, 64);
  dequantize_row_ref(GgmlType::Q8_0, b8, y, 64);
  for (float v : y) EXPECT_EQ(v, 0.0f);
  BlockQ4_0 b40[2];
  quantize_row_q4_0_ref(x, b40, 64);
  dequantize_row_ref(GgmlType::Q4_0, b40, y, 64);
  for (float v : y) EXPECT_EQ(v, 0.0f);
  BlockQ4_1 b41[2];
  quantize_row_q4_1_ref(x, b41, 64);
  dequantize_row_ref(GgmlType::Q4_1, b41, y, 64);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

// Round trip bounds. With d the exact float scale and d16 its stored fp16 value, an element with
// code q reconstructs with error ≤ (rounding step)·|d| + |q|·|d − d16| (+ |m − m16| for Q4_1).
TEST(QuantRef, Q8_0RoundTripBound) {
  for (int64_t n : {32, 64, 576, 1536}) {
    const auto x = random_row(n, static_cast<uint32_t>(n), 0.02f);
    std::vector<BlockQ8_0> b(static_cast<size_t>(n / 32));  // [n / 32]
    std::vector<float> y(static_cast<size_t>(n));           // [n]
    quantize_row_q8_0_ref(x.data(), b.data(), n);
    ASSERT_TRUE(dequantize_row_ref(GgmlType::Q8_0, b.data(), y.data(), n));
    for (int64_t i = 0; i < n; ++i) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[i / 32 * 32 + j]));
      const float d = amax / 127, d16 = fp16_to_fp32(b[i / 32].d);
      const float bound = 0.5f * d + 127 * std::fabs(d - d16) + 1e-7f * amax;
      ASSERT_LE(std::fabs(y[i] - x[i]), bound) << "n=" << n << " i=" << i;
    }
  }
}

TEST(QuantRef, Q4_0RoundTripBound) {
  for (int64_t n : {32, 96, 576, 1536}) {
    const auto x = random_row(n, static_cast<uint32_t>(n) + 1, 0.02f);
    std::vector<BlockQ4_0> b(static_cast<size_t>(n / 32));  // [n / 32]
    std::vector<float> y(static_cast<size_t>(n));           // [n]
    quantize_row_q4_0_ref(x.data(), b.data(), n);
    ASSERT_TRUE(dequantize_row_ref(GgmlType::Q4_0, b.data(), y.data(), n));
    double err2 = 0, ref2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* blk = x.data() + i / 32 * 32;
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j)
        if (std::fabs(blk[j]) > amax) amax = std::fabs(blk[j]), max = blk[j];
      const float d = max / -8, d16 = fp16_to_fp32(b[i / 32].d);
      // Codes run -8..7 with -8 taken by the max itself; an opposite-signed value near amax
      // would need +8 and is clamped to 7, so the step there is a whole |d|.
      const float step = x[i] / d > 7.5f ? 1.0f : 0.5f;
      const float bound = step * std::fabs(d) + 8 * std::fabs(d - d16) + 1e-7f * amax;
      ASSERT_LE(std::fabs(y[i] - x[i]), bound) << "n=" << n << " i=" << i;
      err2 += double(y[i] - x[i]) * (y[i] - x[i]);
      ref2 += double(x[i]) * x[i];
    }
    // 16 levels over the block range: relative RMS error of a Gaussian row is ~10%.
    EXPECT_LT(std::sqrt(err2 / ref2), 0.2) << n;
  }
}

TEST(QuantRef, Q4_1RoundTripBound) {
  for (int64_t n : {32, 160, 576, 1536}) {
    auto x = random_row(n, static_cast<uint32_t>(n) + 2, 0.02f);
    for (int64_t i = 0; i < n; i += 3) x[i] += 0.05f;  // off-centre: the min matters
    std::vector<BlockQ4_1> b(static_cast<size_t>(n / 32));  // [n / 32]
    std::vector<float> y(static_cast<size_t>(n));           // [n]
    quantize_row_q4_1_ref(x.data(), b.data(), n);
    ASSERT_TRUE(dequantize_row_ref(GgmlType::Q4_1, b.data(), y.data(), n));
    for (int64_t i = 0; i < n; ++i) {
      const float* blk = x.data() + i / 32 * 32;
      float mn = blk[0], mx = blk[0];
      for (int j = 0; j < 32; ++j) mn = std::min(mn, blk[j]), mx = std::max(mx, blk[j]);
      const float d = (mx - mn) / 15, d16 = fp16_to_fp32(b[i / 32].d);
      const float m16 = fp16_to_fp32(b[i / 32].m);
      const float bound = 0.5f * d + 15 * std::fabs(d - d16) + std::fabs(mn - m16) +
                          1e-6f * (std::fabs(mx) + std::fabs(mn));
      ASSERT_LE(std::fabs(y[i] - x[i]), bound) << "n=" << n << " i=" << i;
    }
  }
}

}  // namespace
}  // namespace kv
