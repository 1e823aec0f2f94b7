// Scalar reference conversions, dequantizers and quantizers for the GGUF block formats.
//
// Every dequantizer evaluates the same float32 expression, in the same order, as ggml's
// dequantize_row_* (ggml-quants.c) and the `gguf` Python package. Each product there is exact
// in float32 (an fp16 scale has 11 significant bits; times a ≤6-bit sub-block scale and a
// ≤6-bit quant it stays ≤ 24 bits), so the only rounding is the final add of a min, and the
// result is bit-identical to ggml's whether or not the compiler contracts it into an FMA.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/quant.h"

namespace kv {

namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even right shift of a non-negative integer by s (1 ≤ s ≤ 31).
uint32_t shift_rne(uint32_t v, int s) {
  const uint32_t q = v >> s;
  const uint32_t rem = v & ((1u << s) - 1);
  const uint32_t half = 1u << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1))) ? 1 : 0);
}

// ggml's get_scale_min_k4: Q4_K/Q5_K pack 8 six-bit scales and 8 six-bit mins in 12 bytes.
// Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
// for the mins; bytes 8-11 hold the low nibbles of scale j (low) and min j (high) for j = 4..7.
void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Block formats: elements per block fixed by ggml.
constexpr int kQK = 32;    // Q4_0, Q4_1, Q5_0, Q8_0
constexpr int kQKK = 256;  // K-quants

void dequant_q4_0(const BlockQ4_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    // Low nibbles are elements 0..15, high nibbles 16..31 (not interleaved).
    for (int j = 0; j < kQK / 2; ++j) {
      y[i * kQK + j] = static_cast<float>((x[i].qs[j] & 0xF) - 8) * d;
      y[i * kQK + j + kQK / 2] = static_cast<float>((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const float m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[i * kQK + j] = static_cast<float>(x[i].qs[j] & 0xF) * d + m;
      y[i * kQK + j + kQK / 2] = static_cast<float>(x[i].qs[j] >> 4) * d + m;
    }
  }
}

void dequant_q5_0(const BlockQ5_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    uint32_t qh;
    std::memcpy(&qh, x[i].qh, 4);  // bit j is the 5th bit of element j
    for (int j = 0; j < kQK / 2; ++j) {
      const int h0 = ((qh >> j) << 4) & 0x10;
      const int h1 = (qh >> (j + 12)) & 0x10;
      y[i * kQK + j] = static_cast<float>(((x[i].qs[j] & 0xF) | h0) - 16) * d;
      y[i * kQK + j + kQK / 2] = static_cast<float>(((x[i].qs[j] >> 4) | h1) - 16) * d;
    }
  }
}

void dequant_q8_0(const BlockQ8_0* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK; ++j) y[i * kQK + j] = static_cast<float>(x[i].qs[j]) * d;
  }
}

void dequant_q4_k(const BlockQ4_K* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const float dmin = fp16_to_fp32(x[i].dmin);
    const uint8_t* q = x[i].qs;
    float* out = y + i * kQKK;
    // 4 chunks of 64 elements; each chunk's 32 bytes give sub-block 2c (low nibbles) and
    // sub-block 2c+1 (high nibbles).
    for (int c = 0; c < 4; ++c) {
      uint8_t sc, m;
      get_scale_min_k4(2 * c, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      get_scale_min_k4(2 * c + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *out++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *out++ = d2 * static_cast<float>(q[l] >> 4) - m2;
      q += 32;
    }
  }
}

void dequant_q6_k(const BlockQ6_K* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    const int8_t* sc = x[i].scales;
    float* out = y + i * kQKK;
    // Two halves of 128 elements; each uses 64 ql bytes, 32 qh bytes and 8 scales (one per 16
    // elements). Element l + 32k takes nibble (k / 2) of ql[l + 32 (k % 2)] and bit pair k of qh[l].
    for (int half = 0; half < 2; ++half) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        out[l + 0] = d * sc[is + 0] * static_cast<float>(q1);
        out[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
        out[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
        out[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
      }
      out += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

}  // namespace

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  const uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf, NaN payload kept
  if (exp == 0) {
    // Zero or subnormal: mant · 2^-24, exact in float32 (a normal number there).
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return bits_float(sign | float_bits(mag));
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));  // rebias 15 -> 127
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {
    // NaN: keep the top payload bits and force the quiet bit so it cannot collapse into inf
    // (what F16C's vcvtps2ph does).
    return static_cast<uint16_t>(sign | 0x7E00 | ((a >> 13) & 0x3FF));
  }
  const int exp_f = static_cast<int>(a >> 23);
  const int e = exp_f - 127 + 15;  // half exponent field if normal
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7C00);  // also covers inf
  if (e >= 1) {
    // Normal: drop 13 mantissa bits with RNE. A carry out of the mantissa bumps the exponent,
    // which is still correct, up to and including rounding 65520 to inf (0x7C00).
    const uint32_t h = shift_rne(a - (static_cast<uint32_t>(112) << 23), 13);
    return static_cast<uint16_t>(sign | h);
  }
  // Half subnormal: value / 2^-24 = mant24 · 2^(exp_f - 126). A carry into 0x400 yields the
  // smallest normal, again correct.
  const int shift = 126 - exp_f;  // ≥ 14
  if (shift > 24) return sign;    // below half of the smallest subnormal (ties go to even 0)
  const uint32_t mant24 = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint16_t>(sign | shift_rne(mant24, shift));
}

uint16_t fp32_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  // ggml_compute_fp32_to_bf16: NaN keeps its top bits and is forced quiet (bit 6 of the bf16).
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 64);
  return static_cast<uint16_t>((u + (0x7FFFu + ((u >> 16) & 1))) >> 16);
}

bool dequantize_row_ref(GgmlType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return true;
    case GgmlType::F16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
      return true;
    }
    case GgmlType::BF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return true;
    }
    case GgmlType::Q4_0:
      dequant_q4_0(static_cast<const BlockQ4_0*>(src), dst, n / kQK);
      return true;
    case GgmlType::Q4_1:
      dequant_q4_1(static_cast<const BlockQ4_1*>(src), dst, n / kQK);
      return true;
    case GgmlType::Q5_0:
      dequant_q5_0(static_cast<const BlockQ5_0*>(src), dst, n / kQK);
      return true;
    case GgmlType::Q8_0:
      dequant_q8_0(static_cast<const BlockQ8_0*>(src), dst, n / kQK);
      return true;
    case GgmlType::Q4_K:
      dequant_q4_k(static_cast<const BlockQ4_K*>(src), dst, n / kQKK);
      return true;
    case GgmlType::Q6_K:
      dequant_q6_k(static_cast<const BlockQ6_K*>(src), dst, n / kQKK);
      return true;
    default:
      return false;
  }
}

void quantize_row_q8_0_ref(const float* x, BlockQ8_0* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i) {
    const float* b = x + i * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(b[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    // roundf: half away from zero, as ggml (|x·id| ≤ 127 by construction).
    for (int j = 0; j < kQK; ++j) y[i].qs[j] = static_cast<int8_t>(std::roundf(b[j] * id));
  }
}

void quantize_row_q4_0_ref(const float* x, BlockQ4_0* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i) {
    const float* b = x + i * kQK;
    // The signed value of largest magnitude maps to q = 0 (i.e. -8): using its sign, rather
    // than amax/7, spends the asymmetric code (-8..7) on the side that needs it.
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      if (amax < std::fabs(b[j])) {
        amax = std::fabs(b[j]);
        max = b[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      // +8.5 then truncation = round half up into [0, 16]; 16 only for the max itself (-8·id
      // rounding), clamped to 15 as ggml does.
      const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>(b[j] * id + 8.5f)));
      const int q1 =
          std::min(15, static_cast<int>(static_cast<int8_t>(b[j + kQK / 2] * id + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

void quantize_row_q4_1_ref(const float* x, BlockQ4_1* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i) {
    const float* b = x + i * kQK;
    float min = b[0], max = b[0];
    for (int j = 1; j < kQK; ++j) {
      min = std::min(min, b[j]);
      max = std::max(max, b[j]);
    }
    const float d = (max - min) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    y[i].m = fp32_to_fp16(min);
    for (int j = 0; j < kQK / 2; ++j) {
      const int q0 = std::min(15, static_cast<int>(static_cast<int8_t>((b[j] - min) * id + 0.5f)));
      const int q1 =
          std::min(15, static_cast<int>(static_cast<int8_t>((b[j + kQK / 2] - min) * id + 0.5f)));
      y[i].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

}  // namespace kv
