#include "kernels/kv_tile.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/isa.h"
#include "kernels/quant.h"

namespace kv {

const char* kv_elem_name(KvElem e) {
  switch (e) {
    case KvElem::kF32: return "f32";
    case KvElem::kF16: return "f16";
    case KvElem::kBF16: return "bf16";
    case KvElem::kFp8E4M3: return "fp8_e4m3";
    case KvElem::kFp8E5M2: return "fp8_e5m2";
    case KvElem::kInt8: return "int8";
    case KvElem::kInt4: return "int4";
  }
  return "?";
}

int kv_v_group(KvElem e, int head_dim) {
  if (e == KvElem::kInt4) return head_dim % 32 == 0 ? 32 : 16;
  return head_dim;
}

const char* kv_tile_shape_error(KvElem e, int block_size, int head_dim) {
  if (block_size < 1 || head_dim < 1) return "block size and head_dim must be positive";
  if (head_dim % 16 != 0) return "head_dim must be a multiple of 16";
  if (kv_elem_staged(e) && block_size % 16 != 0)
    return "quantized KV pages (fp8, int8, int4) need a block size that is a multiple of 16";
  return nullptr;
}

namespace {

int64_t value_bytes(KvElem e, int64_t n) {
  switch (e) {
    case KvElem::kF32: return 4 * n;
    case KvElem::kF16:
    case KvElem::kBF16: return 2 * n;
    case KvElem::kFp8E4M3:
    case KvElem::kFp8E5M2:
    case KvElem::kInt8: return n;
    case KvElem::kInt4: return n / 2;
  }
  return 0;
}

// Asymmetric quantization of n values (stride apart) to 0..levels; writes the f16 {scale, min}.
// Uses the f16-rounded scale and min, so decoding sees exactly what encoding assumed.
template <typename Put>
void quantize_group(const uint16_t* src, int64_t stride, int n, int levels, uint16_t* meta, Put put) {
  float mn = INFINITY, mx = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float x = fp16_to_fp32(src[i * stride]);
    mn = std::min(mn, x);
    mx = std::max(mx, x);
  }
  const uint16_t s16 = fp32_to_fp16((mx - mn) / levels), z16 = fp32_to_fp16(mn);
  meta[0] = s16;
  meta[1] = z16;
  const float s = fp16_to_fp32(s16), z = fp16_to_fp32(z16);
  const float inv = s > 0 ? 1.f / s : 0.f;
  for (int i = 0; i < n; ++i) {
    const float x = fp16_to_fp32(src[i * stride]);
    const int q = static_cast<int>(std::nearbyint((x - z) * inv));
    put(i, static_cast<uint8_t>(std::clamp(q, 0, levels)));
  }
}

float fp8_tile_scale(const uint16_t* stage, int64_t n, float max_finite) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(fp16_to_fp32(stage[i])));
  return amax > 0 ? amax / max_finite : 1.f;
}

void quantize_fp8(const uint16_t* stage, KvElem e, int64_t n, uint8_t* tile) {
  const bool e4 = e == KvElem::kFp8E4M3;
  const float scale = fp8_tile_scale(stage, n, e4 ? kFp8E4M3Max : kFp8E5M2Max);
  const float inv = 1.f / scale;
  for (int64_t i = 0; i < n; ++i) {
    const float x = fp16_to_fp32(stage[i]) * inv;
    tile[i] = e4 ? fp32_to_fp8_e4m3(x) : fp32_to_fp8_e5m2(x);
  }
  std::memcpy(tile + n, &scale, sizeof scale);
}

// fp8 keys: per channel an f16 zero point (the midpoint of the page's tokens), then one tile
// scale for the residuals key - zero (kv_tile.h). The residual uses the f16-rounded zero, so
// decoding sees exactly what encoding assumed.
void quantize_fp8_k(const uint16_t* stage, KvElem e, int bs, int hd, uint8_t* tile) {
  const bool e4 = e == KvElem::kFp8E4M3;
  const int64_t n = int64_t(bs) * hd;
  uint8_t* zeros = tile + n + 4;  // f16 [hd], written bytewise: the tile is only 4-byte aligned
  float amax = 0.f;
  for (int d = 0; d < hd; ++d) {
    const uint16_t* row = stage + int64_t(d) * bs;
    float mn = INFINITY, mx = -INFINITY;
    for (int j = 0; j < bs; ++j) {
      const float x = fp16_to_fp32(row[j]);
      mn = std::min(mn, x);
      mx = std::max(mx, x);
    }
    const uint16_t z16 = fp32_to_fp16((mn + mx) / 2);
    std::memcpy(zeros + 2 * d, &z16, 2);
    const float z = fp16_to_fp32(z16);
    amax = std::max({amax, std::fabs(mx - z), std::fabs(mn - z)});
  }
  const float scale = amax > 0 ? amax / (e4 ? kFp8E4M3Max : kFp8E5M2Max) : 1.f;
  const float inv = 1.f / scale;
  for (int d = 0; d < hd; ++d) {
    uint16_t z16;
    std::memcpy(&z16, zeros + 2 * d, 2);
    const float z = fp16_to_fp32(z16);
    for (int j = 0; j < bs; ++j) {
      const int64_t i = int64_t(d) * bs + j;
      const float x = (fp16_to_fp32(stage[i]) - z) * inv;
      tile[i] = e4 ? fp32_to_fp8_e4m3(x) : fp32_to_fp8_e5m2(x);
    }
  }
  std::memcpy(tile + n, &scale, sizeof scale);
}

float fp8_value(const uint8_t* tile, KvElem e, int64_t n, int64_t i) {
  float scale;
  std::memcpy(&scale, tile + n, sizeof scale);
  return (e == KvElem::kFp8E4M3 ? fp8_e4m3_to_fp32(tile[i]) : fp8_e5m2_to_fp32(tile[i])) * scale;
}

// Key at channel d, channel-major index i of an fp8 K tile.
float fp8_key(const uint8_t* tile, KvElem e, int64_t n, int d, int64_t i) {
  uint16_t z16;
  std::memcpy(&z16, tile + n + 4 + 2 * int64_t(d), 2);
  return fp16_to_fp32(z16) + fp8_value(tile, e, n, i);
}

float meta_value(const uint16_t* meta, int q) { return fp16_to_fp32(meta[1]) + fp16_to_fp32(meta[0]) * q; }

// Value at channel-major index (d, j) of an unquantized K tile or token-major (j, d) of V.
float plain_value(const uint8_t* tile, KvElem e, int64_t i) {
  switch (e) {
    case KvElem::kF32: {
      float f;
      std::memcpy(&f, tile + 4 * i, 4);
      return f;
    }
    case KvElem::kF16: {
      uint16_t h;
      std::memcpy(&h, tile + 2 * i, 2);
      return fp16_to_fp32(h);
    }
    case KvElem::kBF16: {
      uint16_t h;
      std::memcpy(&h, tile + 2 * i, 2);
      return bf16_to_fp32(h);
    }
    default: return 0.f;
  }
}

// f16 conversion of a K or V row: F16C's vcvtps2ph when the kernels run AVX2 or better (the
// same RNE, the same quiet NaNs as fp32_to_fp16), else the portable conversion (KV_ISA=scalar
// included, so a forced scalar run executes no AVX instruction). Every KV write of every token
// goes through here. The F16C loop is compiled for that target alone (a function attribute:
// three instructions, not worth a file of their own); tests/check_isa_objects.py knows its name.
constexpr int kMaxF16Row = 1024;
__attribute__((target("avx,f16c"))) void to_f16_f16c(const float* src, uint16_t* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
void to_f16(const float* src, uint16_t* dst, int n) {
  if (kernel_isa() != Isa::kScalar) return to_f16_f16c(src, dst, n);
  for (int i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

void plain_store(uint8_t* tile, KvElem e, int64_t i, float x) {
  switch (e) {
    case KvElem::kF32: std::memcpy(tile + 4 * i, &x, 4); break;
    case KvElem::kF16: {
      const uint16_t h = fp32_to_fp16(x);
      std::memcpy(tile + 2 * i, &h, 2);
      break;
    }
    case KvElem::kBF16: {
      const uint16_t h = fp32_to_bf16(x);
      std::memcpy(tile + 2 * i, &h, 2);
      break;
    }
    default: break;
  }
}

}  // namespace

int64_t kv_k_tile_bytes(KvElem e, int block_size, int head_dim) {
  const int64_t n = int64_t(block_size) * head_dim;
  switch (e) {
    case KvElem::kFp8E4M3:
    case KvElem::kFp8E5M2: return n + 4 + int64_t(head_dim) * 2;  // + scale + f16 zero per channel
    case KvElem::kInt8:
    case KvElem::kInt4: return value_bytes(e, n) + int64_t(head_dim) * 4;
    default: return value_bytes(e, n);
  }
}

int64_t kv_v_tile_bytes(KvElem e, int block_size, int head_dim) {
  const int64_t n = int64_t(block_size) * head_dim;
  switch (e) {
    case KvElem::kFp8E4M3:
    case KvElem::kFp8E5M2: return n + 4;
    case KvElem::kInt8:
    case KvElem::kInt4: return value_bytes(e, n) + int64_t(block_size) * (head_dim / kv_v_group(e, head_dim)) * 4;
    default: return value_bytes(e, n);
  }
}

void kv_write_k(uint8_t* tile, KvElem e, int block_size, int head_dim, int slot, const float* src) {
  if (e == KvElem::kF16 && head_dim <= kMaxF16Row) {
    uint16_t h[kMaxF16Row];
    to_f16(src, h, head_dim);
    for (int d = 0; d < head_dim; ++d) std::memcpy(tile + 2 * (int64_t(d) * block_size + slot), &h[d], 2);
    return;
  }
  for (int d = 0; d < head_dim; ++d) plain_store(tile, e, int64_t(d) * block_size + slot, src[d]);
}

void kv_write_v(uint8_t* tile, KvElem e, int /*block_size*/, int head_dim, int slot, const float* src) {
  const int64_t off = int64_t(slot) * head_dim;
  if (e == KvElem::kF32) {
    std::memcpy(tile + 4 * off, src, 4 * size_t(head_dim));
    return;
  }
  if (e == KvElem::kF16) return to_f16(src, reinterpret_cast<uint16_t*>(tile + 2 * off), head_dim);
  for (int d = 0; d < head_dim; ++d) plain_store(tile, e, off + d, src[d]);
}

void kv_quantize_k(const uint16_t* stage, KvElem e, int bs, int hd, uint8_t* tile) {
  const int64_t n = int64_t(bs) * hd;
  if (e == KvElem::kFp8E4M3 || e == KvElem::kFp8E5M2) return quantize_fp8_k(stage, e, bs, hd, tile);
  uint16_t* meta = reinterpret_cast<uint16_t*>(tile + value_bytes(e, n));
  for (int d = 0; d < hd; ++d) {
    const uint16_t* row = stage + int64_t(d) * bs;
    if (e == KvElem::kInt8) {
      uint8_t* q = tile + int64_t(d) * bs;
      quantize_group(row, 1, bs, 255, meta + 2 * d, [&](int j, uint8_t v) { q[j] = v; });
    } else {
      uint8_t* q = tile + int64_t(d) * (bs / 2);
      std::memset(q, 0, bs / 2);
      quantize_group(row, 1, bs, 15, meta + 2 * d, [&](int j, uint8_t v) {
        const int run = j / 16, i = j % 16;
        q[run * 8 + (i & 7)] |= static_cast<uint8_t>(i < 8 ? v : v << 4);
      });
    }
  }
}

void kv_quantize_v(const uint16_t* stage, KvElem e, int bs, int hd, uint8_t* tile) {
  const int64_t n = int64_t(bs) * hd;
  if (e == KvElem::kFp8E4M3 || e == KvElem::kFp8E5M2) return quantize_fp8(stage, e, n, tile);
  const int G = kv_v_group(e, hd), ng = hd / G;
  uint16_t* meta = reinterpret_cast<uint16_t*>(tile + value_bytes(e, n));
  for (int j = 0; j < bs; ++j)
    for (int g = 0; g < ng; ++g) {
      const uint16_t* src = stage + int64_t(j) * hd + g * G;
      uint16_t* m = meta + 2 * (int64_t(j) * ng + g);
      if (e == KvElem::kInt8) {
        uint8_t* q = tile + int64_t(j) * hd + g * G;
        quantize_group(src, 1, G, 255, m, [&](int i, uint8_t v) { q[i] = v; });
      } else {
        uint8_t* q = tile + int64_t(j) * (hd / 2) + g * (G / 2);
        std::memset(q, 0, G / 2);
        const int half = G / 2;
        quantize_group(src, 1, G, 15, m, [&](int i, uint8_t v) {
          q[i % half] |= static_cast<uint8_t>(i < half ? v : v << 4);
        });
      }
    }
}

void kv_read_k(const uint8_t* tile, KvElem e, int bs, int hd, int n_tok, float* out) {
  const int64_t n = int64_t(bs) * hd;
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(tile + value_bytes(e, n));
  for (int j = 0; j < n_tok; ++j)
    for (int d = 0; d < hd; ++d) {
      const int64_t i = int64_t(d) * bs + j;
      float x;
      switch (e) {
        case KvElem::kFp8E4M3:
        case KvElem::kFp8E5M2: x = fp8_key(tile, e, n, d, i); break;
        case KvElem::kInt8: x = meta_value(meta + 2 * d, tile[i]); break;
        case KvElem::kInt4: {
          const uint8_t b = tile[int64_t(d) * (bs / 2) + (j / 16) * 8 + (j % 8)];
          x = meta_value(meta + 2 * d, (j % 16) < 8 ? (b & 15) : (b >> 4));
          break;
        }
        default: x = plain_value(tile, e, i);
      }
      out[int64_t(j) * hd + d] = x;
    }
}

void kv_read_v(const uint8_t* tile, KvElem e, int bs, int hd, int n_tok, float* out) {
  const int64_t n = int64_t(bs) * hd;
  const uint16_t* meta = reinterpret_cast<const uint16_t*>(tile + value_bytes(e, n));
  const int G = kv_v_group(e, hd), ng = hd / G;
  for (int j = 0; j < n_tok; ++j)
    for (int d = 0; d < hd; ++d) {
      const int64_t i = int64_t(j) * hd + d;
      const uint16_t* m = meta + 2 * (int64_t(j) * ng + d / G);
      float x;
      switch (e) {
        case KvElem::kFp8E4M3:
        case KvElem::kFp8E5M2: x = fp8_value(tile, e, n, i); break;
        case KvElem::kInt8: x = meta_value(m, tile[i]); break;
        case KvElem::kInt4: {
          const int half = G / 2, c = d % G;
          const uint8_t b = tile[int64_t(j) * (hd / 2) + (d / G) * half + c % half];
          x = meta_value(m, c < half ? (b & 15) : (b >> 4));
          break;
        }
        default: x = plain_value(tile, e, i);
      }
      out[i] = x;
    }
}

uint8_t fp32_to_fp8_e4m3(float x) {
  const uint8_t s = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (std::isnan(a)) return s | 0x7F;
  if (a >= kFp8E4M3Max) return s | 0x7E;
  if (a < 0.015625f) return s | static_cast<uint8_t>(std::nearbyint(a * 512.f));  // subnormal (8 → 2^-6)
  int e;
  const float f = std::frexp(a, &e);  // a = f·2^e, f in [0.5, 1)
  int E = e - 1, m = static_cast<int>(std::nearbyint((2.f * f - 1.f) * 8.f));
  if (m == 8) m = 0, ++E;
  if (E > 8 || (E == 8 && m == 7)) return s | 0x7E;
  return static_cast<uint8_t>(s | ((E + 7) << 3) | m);
}

uint8_t fp32_to_fp8_e5m2(float x) {
  const uint8_t s = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (std::isnan(a)) return s | 0x7F;
  if (a >= kFp8E5M2Max) return s | 0x7B;
  if (a < 6.103515625e-05f) return s | static_cast<uint8_t>(std::nearbyint(a * 65536.f));  // subnormal
  int e;
  const float f = std::frexp(a, &e);
  int E = e - 1, m = static_cast<int>(std::nearbyint((2.f * f - 1.f) * 4.f));
  if (m == 4) m = 0, ++E;
  if (E > 15) return s | 0x7B;
  return static_cast<uint8_t>(s | ((E + 15) << 2) | m);
}

float fp8_e4m3_to_fp32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if ((b & 0x7F) == 0x7F) v = NAN;
  else if (e == 0) v = std::ldexp(float(m), -9);
  else v = std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

float fp8_e5m2_to_fp32(uint8_t b) { return fp16_to_fp32(static_cast<uint16_t>(b) << 8); }

}  // namespace kv
