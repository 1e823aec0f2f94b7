// AVX2 matmul kernels over the kInterleaved16 layout (see matmul.h), for CPUs without
// AVX-512 VNNI. A 64-byte weight vector is two 32-byte halves (outputs 0-7 and 8-15); the
// vpdpbusd of the AVX-512 kernel becomes vpmaddubsw + vpmaddwd. One row (decode at batch 1)
// runs `tile`; batches run `tile_nib` (4-bit formats, Q5_0) and `tile_q8` (Q8_0, Q6_K), laid
// out so that their sums fit the 16 ymm registers. Same integer sums, same float steps: the
// output is bit-identical to the scalar and AVX-512 kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/matmul.h"

namespace kv::matmul_detail {

namespace {

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Hides v from the optimizer at this point: GCC otherwise reassociates a tile's integer sums
// into trees, computes every product of a block first and spills them to the stack.
inline void opaque(__m256i& v) { __asm__("" : "+x"(v)); }

constexpr int64_t kPrefetch = 2048;  // bytes ahead in the weight stream (see matmul_avx512.cpp)

// 0x10 in byte k of the result where bit k of bits is set (Q5_0's fifth bit).
inline __m256i bit4_from_mask(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), spread), sel);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

// Half h (outputs 8h..8h+7) of weight vector j of the record at blk, nibble formats: the
// elements 4j+t (lo) and 16+4j+t (hi) as bytes, Q5_0's fifth bit added.
template <QFmt F>
inline void unpack_nibbles(const uint8_t* blk, int j, int h, __m256i m4, __m256i* lo, __m256i* hi) {
  const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + quant_offset(F) + 64 * j + 32 * h));
  *lo = _mm256_and_si256(v, m4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if constexpr (F == QFmt::kQ5_0) {
    uint32_t klo, khi;
    std::memcpy(&klo, blk + 32 + 16 * j + 4 * h, 4);
    std::memcpy(&khi, blk + 40 + 16 * j + 4 * h, 4);
    *lo = _mm256_or_si256(*lo, bit4_from_mask(klo));
    *hi = _mm256_or_si256(*hi, bit4_from_mask(khi));
  }
}

// One row (decode at batch 1) × the 16 outputs of group g, prefetching ahead in the weight
// stream (its first and only pass, from RAM). T: two-level activations (see QAct).
template <QFmt F, bool T>
inline void tile(const QWeights& w, const QAct& a, int64_t g, float* y) {
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  constexpr bool kF32 = F == QFmt::kQ4_K || F == QFmt::kQ6_K;
  const uint8_t* base = w.data + (g - w.g_base) * w.nb * kRec;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));

  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};

  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * kRec;
    const uint8_t* qs = blk + kQo;
    const int8_t* xb = a.q + b * 32;
    const int8_t* xb2 = T ? a.q2 + b * 32 : nullptr;
    for (int64_t l = 0; l < kRec; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + l), _MM_HINT_T0);
    __m256 dw[2], mw[2];  // Q6_K: da, db
    for (int h = 0; h < 2; ++h) {
      if constexpr (kF32) {
        dw[h] = _mm256_load_ps(reinterpret_cast<const float*>(blk) + 8 * h);
        mw[h] = _mm256_load_ps(reinterpret_cast<const float*>(blk + 64) + 8 * h);
      } else {
        dw[h] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        if constexpr (F == QFmt::kQ4_1)
          mw[h] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
        else if constexpr (F == QFmt::kQ4_0)
          mw[h] = _mm256_mul_ps(dw[h], _mm256_set1_ps(-8.0f));
        else
          mw[h] = dw[h];
      }
    }
    // Per 8-output half h: the block's integer sum (Q6_K: of elements 0-15; isb: 16-31).
    __m256i is[2], is2[2], isb[2], isb2[2];
    for (int h = 0; h < 2; ++h) is[h] = is2[h] = isb[h] = isb2[h] = _mm256_setzero_si256();
    if constexpr (F == QFmt::kQ8_0) {
      for (int j = 0; j < 8; ++j)
        for (int h = 0; h < 2; ++h) {
          // Signed weight; |w|·sign(x, w) keeps vpmaddubsw pairs within int16.
          const __m256i ws = _mm256_xor_si256(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32 * h)), flip);
          const __m256i wa = _mm256_sign_epi8(ws, ws);
          const __m256i xs = _mm256_sign_epi8(bcast4(xb + 4 * j), ws);
          is[h] = _mm256_add_epi32(is[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones16));
          if constexpr (T) {
            const __m256i xs2 = _mm256_sign_epi8(bcast4(xb2 + 4 * j), ws);
            is2[h] = _mm256_add_epi32(is2[h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs2), ones16));
          }
        }
    } else if constexpr (F == QFmt::kQ6_K) {
      // u ≤ 63: a vpmaddubsw pair is ≤ 2·63·127 < 32768; widened to int32 at once. Vectors 0-3
      // (elements 0-15) sum into is, 4-7 into isb: two loops, so the sums stay in registers.
      auto vectors = [&](int j0, __m256i (&s1)[2], __m256i (&s2)[2]) {
        for (int j = j0; j < j0 + 4; ++j)
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32 * h));
            s1[h] = _mm256_add_epi32(s1[h], _mm256_madd_epi16(_mm256_maddubs_epi16(v, bcast4(xb + 4 * j)), ones16));
            if constexpr (T)
              s2[h] = _mm256_add_epi32(s2[h], _mm256_madd_epi16(_mm256_maddubs_epi16(v, bcast4(xb2 + 4 * j)), ones16));
          }
      };
      vectors(0, is, is2);
      vectors(4, isb, isb2);
    } else {
      // Nibbles: 16 products per int16 lane of one block, |sum| ≤ 16·15·127 < 32768. Q5_0's
      // 5-bit values would overflow that: widened after every vector (≤ 4·31·127).
      constexpr bool kWiden = F == QFmt::kQ5_0;
      __m256i s16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, s16b[2] = {s16[0], s16[0]};
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h) {
          __m256i lo, hi;
          unpack_nibbles<F>(blk, j, h, m4, &lo, &hi);
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb + 4 * j)),
                                       _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * j)));
          if constexpr (kWiden)
            is[h] = _mm256_add_epi32(is[h], _mm256_madd_epi16(p, ones16));
          else
            s16[h] = _mm256_add_epi16(s16[h], p);
          if constexpr (T) {
            __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb2 + 4 * j)),
                                          _mm256_maddubs_epi16(hi, bcast4(xb2 + 16 + 4 * j)));
            if constexpr (kWiden)
              is2[h] = _mm256_add_epi32(is2[h], _mm256_madd_epi16(p2, ones16));
            else
              s16b[h] = _mm256_add_epi16(s16b[h], p2);
          }
        }
      if constexpr (!kWiden)
        for (int h = 0; h < 2; ++h) {
          is[h] = _mm256_madd_epi16(s16[h], ones16);
          if constexpr (T) is2[h] = _mm256_madd_epi16(s16b[h], ones16);
        }
    }
    if constexpr (T)
      for (int h = 0; h < 2; ++h) {
        is[h] = _mm256_add_epi32(_mm256_mullo_epi32(is[h], _mm256_set1_epi32(kLevel2)), is2[h]);
        if constexpr (F == QFmt::kQ6_K)
          isb[h] = _mm256_add_epi32(_mm256_mullo_epi32(isb[h], _mm256_set1_epi32(kLevel2)), isb2[h]);
      }
    const __m256 dx = _mm256_set1_ps(a.d[b]);
    const __m256 sx = _mm256_set1_ps(a.s[b]);
    const int32_t s128 = a.s128[b];
    for (int h = 0; h < 2; ++h) {
      __m256 t;
      if constexpr (F == QFmt::kQ6_K) {
        const int32_t* s16 = a.s16 + 2 * b;
        const __m256i ia = _mm256_sub_epi32(is[h], _mm256_set1_epi32(32 * s16[0]));
        const __m256i ib = _mm256_sub_epi32(isb[h], _mm256_set1_epi32(32 * s16[1]));
        t = _mm256_fmadd_ps(mw[h], _mm256_cvtepi32_ps(ib), _mm256_mul_ps(dw[h], _mm256_cvtepi32_ps(ia)));
      } else {
        __m256i i = is[h];
        // (Q8_0 needs no offset: its sums above use the signed weights.)
        if constexpr (F == QFmt::kQ5_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(s128 / 8));
        t = _mm256_mul_ps(dw[h], _mm256_cvtepi32_ps(i));
        if constexpr (F == QFmt::kQ4_0 || F == QFmt::kQ4_1 || F == QFmt::kQ4_K) t = _mm256_fmadd_ps(mw[h], sx, t);
      }
      acc[h] = _mm256_fmadd_ps(t, dx, acc[h]);
    }
  }

  const int64_t o = g * kGroup, rem = w.n_out - o;
  float* yp = y + o;
  if (rem >= kGroup) {
    _mm256_storeu_ps(yp, acc[0]);
    _mm256_storeu_ps(yp + 8, acc[1]);
  } else {
    alignas(32) float tmp[kGroup];
    _mm256_store_ps(tmp, acc[0]);
    _mm256_store_ps(tmp + 8, acc[1]);
    std::memcpy(yp, tmp, static_cast<size_t>(rem) * sizeof(float));
  }
}

// Stores R rows' accumulators of group g (a partial last group through a local copy).
template <int R>
inline void store_rows(const __m256 (&acc)[R][2], float* y, int64_t n_out, int64_t g) {
  const int64_t o = g * kGroup, n = std::min<int64_t>(n_out - o, kGroup);
  for (int r = 0; r < R; ++r) {
    float* yp = y + r * n_out + o;
    if (n == kGroup) {
      _mm256_storeu_ps(yp, acc[r][0]);
      _mm256_storeu_ps(yp + 8, acc[r][1]);
    } else if (n > 0) {
      alignas(32) float tmp[kGroup];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(yp, tmp, static_cast<size_t>(n) * sizeof(float));
    }
  }
}

// Rows per tile_nib in a batch (3 measured the same; 6 slower).
constexpr int kNibRows = 4;
static_assert(kNibRows == kMatmulRowTile, "the engine sizes drafts by this tile (matmul.h)");

// The nibble formats whose int16 sums take a whole block (all but Q5_0) keep the first tile's
// unpacked weight vectors (uw: 16 vectors a block, after isum's nb · 2 · kNibRows), and the
// group's later tiles, from them, run both 8-output halves against the same broadcast
// activations: a broadcast feeds two multiplies (BM_IssueRate/bcast2), two rows a tile (four
// int16 sums a row with two levels, in registers with the four weight vectors).
template <QFmt F>
constexpr bool kShared = F != QFmt::kQ5_0;
constexpr int kSharedRows = 2;

// The 4-bit formats (and Q5_0) for rows [r0, r0 + R) × group g, in two passes. First the
// integer sums: per block, one 8-output half at a time, the int16 sums for R rows and both
// levels, the unpacked weight vector and a temporary fit the 16 ymm registers (the tile above,
// run for one row only, spilled with two); each block's exact int32 sum goes to isum. Then the
// float pass over isum, the R × 2 accumulators in registers. Applying the block scales as each
// block ended (accumulators in y, loaded and stored per block) cost a third of the kernel's
// time on Zen 3 (measured). Same integer sums, same float steps in the same order as tile:
// bit-identical output. isum: per-thread scratch of nb · 2 · kNibRows vectors, then uw's
// nb · 16 (kShared). kPf: the group's first tile (streams the weights from RAM); kKeep: it
// leaves the unpacked vectors in uw for the later tiles.
template <QFmt F, int R, bool kPf, bool T, bool kKeep = false, bool kNext = false>
inline void tile_nib(const QWeights& w, const QAct& a, int64_t r0, int64_t g, __m256i* isum, float* y) {
  static_assert(F == QFmt::kQ4_0 || F == QFmt::kQ4_1 || F == QFmt::kQ4_K || F == QFmt::kQ5_0);
  constexpr int64_t kRec = record_bytes(F);
  constexpr bool kF32 = F == QFmt::kQ4_K;
  // Q5_0's 5-bit values would overflow the int16 sums over a block: widened after every vector.
  constexpr bool kWiden = F == QFmt::kQ5_0;
  const uint8_t* base = w.data + (g - w.g_base) * w.nb * kRec;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i lv2 = _mm256_set1_epi16(static_cast<int16_t>(kLevel2));
  __m256i* const uw = isum + w.nb * 2 * kNibRows;

  const int8_t* xq[R];
  // The second level is at a fixed distance from the first (fewer live pointers).
  const std::ptrdiff_t d2 = T ? a.q2 - a.q : 0;
  for (int r = 0; r < R; ++r) xq[r] = a.q + (r0 + r) * a.n_in;

  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * kRec;
    if constexpr (kPf || kNext)  // kNext: the next group's block (see run)
      for (int64_t l = 0; l < kRec; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + (kNext ? w.nb * kRec : kPrefetch) + l), _MM_HINT_T0);
    if constexpr (kShared<F> && !kPf) {
      // A later tile: both halves at once from the first tile's unpacked vectors.
      static_assert(R <= kSharedRows);
      __m256i s1[R][2], s2[R][2];
      for (int r = 0; r < R; ++r) s1[r][0] = s1[r][1] = s2[r][0] = s2[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i* u = uw + (b * 4 + j) * 4;
        const __m256i lo0 = _mm256_load_si256(u), hi0 = _mm256_load_si256(u + 1);
        const __m256i lo1 = _mm256_load_si256(u + 2), hi1 = _mm256_load_si256(u + 3);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq[r] + b * 32 + 4 * j;
          for (int lev = 0; lev < (T ? 2 : 1); ++lev) {
            const int8_t* xl = lev ? xb + d2 : xb;
            __m256i(&s)[2] = lev ? s2[r] : s1[r];
            const __m256i xa = bcast4(xl), xc = bcast4(xl + 16);
            s[0] = _mm256_add_epi16(s[0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xa), _mm256_maddubs_epi16(hi0, xc)));
            opaque(s[0]);
            s[1] = _mm256_add_epi16(s[1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xa), _mm256_maddubs_epi16(hi1, xc)));
            opaque(s[1]);
          }
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) {
          const __m256i i = T ? _mm256_add_epi32(_mm256_madd_epi16(s1[r][h], lv2), _mm256_madd_epi16(s2[r][h], ones16))
                              : _mm256_madd_epi16(s1[r][h], ones16);
          _mm256_store_si256(isum + (b * 2 + h) * R + r, i);
        }
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      __m256i s1[R], s2[R];  // int16 sums per level (kWiden: the int32 combined sum in s1)
      for (int r = 0; r < R; ++r) s1[r] = s2[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        unpack_nibbles<F>(blk, j, h, m4, &lo, &hi);
        if constexpr (kShared<F> && kKeep) {
          _mm256_store_si256(uw + (b * 4 + j) * 4 + 2 * h, lo);
          _mm256_store_si256(uw + (b * 4 + j) * 4 + 2 * h + 1, hi);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xq[r] + b * 32 + 4 * j;
          __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb)), _mm256_maddubs_epi16(hi, bcast4(xb + 16)));
          if constexpr (kWiden)
            s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(p, T ? lv2 : ones16));
          else
            s1[r] = _mm256_add_epi16(s1[r], p);
          opaque(s1[r]);
          if constexpr (T) {
            const int8_t* xb2 = xb + d2;
            __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb2)), _mm256_maddubs_epi16(hi, bcast4(xb2 + 16)));
            if constexpr (kWiden) {
              s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(p2, ones16));
              opaque(s1[r]);
            } else {
              s2[r] = _mm256_add_epi16(s2[r], p2);
              opaque(s2[r]);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        // The exact block sum: 254·Σq1·u + Σq2·u (two-level) or Σq1·u.
        __m256i i;
        if constexpr (kWiden)
          i = s1[r];
        else if constexpr (T)
          i = _mm256_add_epi32(_mm256_madd_epi16(s1[r], lv2), _mm256_madd_epi16(s2[r], ones16));
        else
          i = _mm256_madd_epi16(s1[r], ones16);
        _mm256_store_si256(isum + (b * 2 + h) * R + r, i);
      }
    }
  }

  // The float pass: acc = Σ_b (dw·i + mw·s)·d over the blocks in order, as tile.
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * kRec;
    for (int h = 0; h < 2; ++h) {
      __m256 dw, mw;
      if constexpr (kF32) {
        dw = _mm256_load_ps(reinterpret_cast<const float*>(blk) + 8 * h);
        mw = _mm256_load_ps(reinterpret_cast<const float*>(blk + 64) + 8 * h);
      } else {
        dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        if constexpr (F == QFmt::kQ4_1)
          mw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
        else if constexpr (F == QFmt::kQ4_0)
          mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
        else
          mw = dw;
      }
      for (int r = 0; r < R; ++r) {
        __m256i i = _mm256_load_si256(isum + (b * 2 + h) * R + r);
        const int64_t xb = (r0 + r) * a.nb + b;
        if constexpr (F == QFmt::kQ5_0) i = _mm256_sub_epi32(i, _mm256_set1_epi32(a.s128[xb] / 8));
        __m256 t = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(i));
        if constexpr (F != QFmt::kQ5_0) t = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[xb]), t);
        acc[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(a.d[xb]), acc[r][h]);
      }
    }
  }
  store_rows<R>(acc, y + r0 * w.n_out, w.n_out, g);
}

// The byte formats (Q8_0, Q6_K) against the activations as one int16 per element,
// Q = 254·q1 + q2 (two-level; |Q| ≤ 32385) or q1: vpmaddwd multiplies the stored unsigned
// weights u by both levels at once (Q8_0: u = w + 128, |u·Q| ≤ 255·32385, a block's sum < 2^31,
// 128·S off at the end; Q6_K: u = q ≤ 63, a sum per 16 elements, 32·S16 off each, as in tile).
// A 16-byte quarter of a weight vector (4 outputs × 4 elements) widens to 16 words; its
// products land in two int32 lanes per output, added pairwise (vphaddd) at the end of the
// block (Q6_K: of each half-block, the first half's product with da kept for the second's fma).
// q16: this tile's first row, rows n_in apart. Rows [r0, r0 + R) × group g. As tile_nib, two
// passes: the exact integer sums of every block into isum (nb · kParts · 2 · R vectors), then
// the scales in float with the accumulators in registers.
template <QFmt F, int R, bool kPf, bool kNext = false>
inline void tile_q8(const QWeights& w, const QAct& a, const int16_t* q16, int64_t r0, int64_t g, __m256i* isum,
                    float* y) {
  static_assert(F == QFmt::kQ8_0 || F == QFmt::kQ6_K);
  constexpr bool kQ6 = F == QFmt::kQ6_K;
  constexpr int kParts = kQ6 ? 2 : 1, kVecs = 8 / kParts;  // vectors per integer sum
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  const uint8_t* base = w.data + (g - w.g_base) * w.nb * kRec;
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * kRec;
    if constexpr (kPf || kNext)  // kNext: the next group's block (see run)
      for (int64_t l = 0; l < kRec; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + (kNext ? w.nb * kRec : kPrefetch) + l), _MM_HINT_T0);
    for (int p = 0; p < kParts; ++p) {
      __m256i is[R][4];  // [row][quarter k: outputs 4k..4k+3, two lanes each]
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < 4; ++k) is[r][k] = _mm256_setzero_si256();
      for (int j = p * kVecs; j < (p + 1) * kVecs; ++j) {
        __m256i xv[R];
        for (int r = 0; r < R; ++r) {
          int64_t v;
          std::memcpy(&v, q16 + r * a.n_in + b * 32 + 4 * j, 8);
          xv[r] = _mm256_set1_epi64x(v);
        }
        for (int k = 0; k < 4; ++k) {
          const __m256i u = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + kQo + 64 * j + 16 * k)));
          for (int r = 0; r < R; ++r) {
            is[r][k] = _mm256_add_epi32(is[r][k], _mm256_madd_epi16(u, xv[r]));
            opaque(is[r][k]);
          }
        }
      }
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) {
          // [o0 o1 o4 o5 | o2 o3 o6 o7] of this half → output order; the weights' offset off.
          __m256i i = _mm256_permute4x64_epi64(_mm256_hadd_epi32(is[r][2 * h], is[r][2 * h + 1]), 0xD8);
          if constexpr (kQ6)
            i = _mm256_sub_epi32(i, _mm256_set1_epi32(32 * a.s16[(r0 + r) * (a.n_in / 16) + 2 * b + p]));
          else
            i = _mm256_sub_epi32(i, _mm256_set1_epi32(a.s128[(r0 + r) * a.nb + b]));
          _mm256_store_si256(isum + ((b * kParts + p) * 2 + h) * R + r, i);
        }
    }
  }

  // The float pass, in tile's order (Q6_K: da·i_a, then fma with db·i_b).
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk = base + b * kRec;
    for (int h = 0; h < 2; ++h) {
      const __m256i* is = isum + (b * kParts * 2 + h) * R;
      __m256 t[R];
      if constexpr (kQ6) {
        const __m256 da = _mm256_load_ps(reinterpret_cast<const float*>(blk) + 8 * h);
        const __m256 db = _mm256_load_ps(reinterpret_cast<const float*>(blk + 64) + 8 * h);
        for (int r = 0; r < R; ++r)
          t[r] = _mm256_fmadd_ps(db, _mm256_cvtepi32_ps(_mm256_load_si256(is + 2 * R + r)),
                                 _mm256_mul_ps(da, _mm256_cvtepi32_ps(_mm256_load_si256(is + r))));
      } else {
        const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        for (int r = 0; r < R; ++r) t[r] = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_load_si256(is + r)));
      }
      for (int r = 0; r < R; ++r)
        acc[r][h] = _mm256_fmadd_ps(t[r], _mm256_set1_ps(a.d[(r0 + r) * a.nb + b]), acc[r][h]);
    }
  }
  store_rows<R>(acc, y + r0 * w.n_out, w.n_out, g);
}

// A per-thread scratch of at least n vectors for the tiles' block sums (only grows).
__m256i* block_sums(size_t n) {
  struct alignas(32) Vec {
    int32_t lanes[8];
  };
  thread_local std::vector<Vec> buf;  // (a vector of __m256i would drop its alignment)
  if (buf.size() < n) buf.resize(n);
  return reinterpret_cast<__m256i*>(buf.data());
}

// Rows [0, n_rows) of a as int16 Q (see tile_q8), into a per-thread buffer that only grows.
const int16_t* q16_rows(const QAct& a, int64_t n_rows) {
  thread_local std::vector<int16_t> buf;
  const size_t need = static_cast<size_t>(n_rows * a.n_in);
  if (buf.size() < need) buf.resize(need);
  const __m256i lv2 = _mm256_set1_epi16(static_cast<int16_t>(kLevel2));
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t i = 0; i < a.n_in; i += 16) {
      const int64_t off = r * a.n_in + i;
      __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.q + off)));
      if (a.two)
        q = _mm256_add_epi16(_mm256_mullo_epi16(q, lv2),
                             _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.q2 + off))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.data() + off), q);
    }
  return buf.data();
}

// Rows per tile_q8 in a batch (3 measured slower).
constexpr int kQ8Rows = 2;
// Rows [r, r + n) with 0 < n < kQ8Rows as one tile_q8 of n rows.
template <QFmt F, bool kPf, int N = 1>
inline void q8_rest(const QWeights& w, const QAct& a, const int16_t* q16, int64_t r, int64_t n, int64_t g,
                    __m256i* isum, float* y) {
  if constexpr (N < kQ8Rows) {
    if (n == N) return tile_q8<F, N, kPf>(w, a, q16, r, g, isum, y);
    q8_rest<F, kPf, N + 1>(w, a, q16, r, n, g, isum, y);
  }
}

// Rows [r, r + n) with 0 < n < kNibRows as one tile_nib of n rows.
template <QFmt F, bool kPf, bool T, int N = 1>
inline void nib_rest(const QWeights& w, const QAct& a, int64_t r, int64_t n, int64_t g, __m256i* isum, float* y) {
  if constexpr (N < kNibRows) {
    if (n == N) return tile_nib<F, N, kPf, T>(w, a, r, g, isum, y);
    nib_rest<F, kPf, T, N + 1>(w, a, r, n, g, isum, y);
  }
}

template <QFmt F, bool T>
void run(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  if (n_rows == 1) {
    // One row (decode at batch 1): tile, one group after another, prefetching ahead.
    for (int64_t g = g0; g < g1; ++g) tile<F, T>(w, a, g, y);
    return;
  }
  // Batches, 64 rows at a time; the first tile over a group streams it from RAM (prefetch).
  constexpr int64_t kRowChunk = 64;
  if constexpr (F == QFmt::kQ8_0 || F == QFmt::kQ6_K) {
    // Tiles of kQ8Rows rows of tile_q8 over int16 activations made once per call.
    const int16_t* q16 = q16_rows(a, n_rows);
    __m256i* isum = block_sums(static_cast<size_t>(w.nb * 2 * 2 * kQ8Rows));
    for (int64_t rc = 0; rc < n_rows; rc += kRowChunk) {
      const int64_t re = std::min(n_rows, rc + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        int64_t r = rc;
        if (r + kQ8Rows > re) {
          q8_rest<F, true>(w, a, q16 + r * a.n_in, r, re - r, g, isum, y);
          continue;
        }
        tile_q8<F, kQ8Rows, true>(w, a, q16 + r * a.n_in, r, g, isum, y);
        r += kQ8Rows;
        if (r + kQ8Rows <= re) {
          tile_q8<F, kQ8Rows, false, true>(w, a, q16 + r * a.n_in, r, g, isum, y);
          r += kQ8Rows;
        }
        for (; r + kQ8Rows <= re; r += kQ8Rows)
          tile_q8<F, kQ8Rows, false>(w, a, q16 + r * a.n_in, r, g, isum, y);
        if (r < re) q8_rest<F, false>(w, a, q16 + r * a.n_in, r, re - r, g, isum, y);
      }
    }
  } else {
    // Tiles of kNibRows rows of tile_nib; with kShared, the tiles after the first take
    // kSharedRows rows.
    __m256i* isum = block_sums(static_cast<size_t>(w.nb * 2 * kNibRows + (kShared<F> ? w.nb * 16 : 0)));
    for (int64_t rc = 0; rc < n_rows; rc += kRowChunk) {
      const int64_t re = std::min(n_rows, rc + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        int64_t r = rc;
        if (r + kNibRows > re) {
          nib_rest<F, true, T>(w, a, r, re - r, g, isum, y);
          continue;
        }
        if constexpr (kShared<F>) {
          if (r + kNibRows == re) {
            tile_nib<F, kNibRows, true, T>(w, a, r, g, isum, y);
            continue;
          }
          tile_nib<F, kNibRows, true, T, true>(w, a, r, g, isum, y);
          r += kNibRows;
          if (r + kSharedRows <= re) {
            tile_nib<F, kSharedRows, false, T, false, true>(w, a, r, g, isum, y);
            r += kSharedRows;
          }
          for (; r + kSharedRows <= re; r += kSharedRows)
            tile_nib<F, kSharedRows, false, T>(w, a, r, g, isum, y);
          if (r < re) tile_nib<F, 1, false, T>(w, a, r, g, isum, y);
        } else {
          tile_nib<F, kNibRows, true, T>(w, a, r, g, isum, y);
          for (r += kNibRows; r + kNibRows <= re; r += kNibRows) tile_nib<F, kNibRows, false, T>(w, a, r, g, isum, y);
          if (r < re) nib_rest<F, false, T>(w, a, r, re - r, g, isum, y);
        }
      }
    }
  }
}

inline float hsum_tree(__m256 s8) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

template <QFmt F>
void run_any(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  if (a.two)
    run<F, true>(w, a, n_rows, g0, g1, y);
  else
    run<F, false>(w, a, n_rows, g0, g1, y);
}

}  // namespace

void q_gemm_avx2(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                 float* y) {
  switch (w.fmt) {
    case QFmt::kQ4_0: run_any<QFmt::kQ4_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ4_1: run_any<QFmt::kQ4_1>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ8_0: run_any<QFmt::kQ8_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ5_0: run_any<QFmt::kQ5_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ4_K: run_any<QFmt::kQ4_K>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ6_K: run_any<QFmt::kQ6_K>(w, a, n_rows, g0, g1, y); break;
  }
}

void quantize_rows_avx2(const float* x, int64_t r0, int64_t r1, const QAct& a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * a.n_in;
    int8_t* qr = a.q + r * a.n_in;
    for (int64_t b = 0; b < a.nb; ++b) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xr + b * kQK + 8 * i);
      __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const float d = amax / 127.0f;
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
      const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
      int32_t sum = _mm_cvtsi128_si32(s);
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + b * kQK), _mm256_permutevar8x32_epi32(p, perm));
      if (a.two) {
        // Residual against the first level, then its own 8-bit level (see QAct).
        const __m256 vd = _mm256_set1_ps(d);
        const __m256 vid2 = _mm256_set1_ps(amax > 0 ? 32258.0f / amax : 0.0f);
        const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
        __m256i q2[4];
        for (int i = 0; i < 4; ++i) {
          const __m256 res = _mm256_fnmadd_ps(vd, _mm256_cvtepi32_ps(q[i]), v[i]);
          q2[i] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_mul_ps(res, vid2))));
        }
        const __m256i t4 = _mm256_add_epi32(_mm256_add_epi32(q2[0], q2[1]), _mm256_add_epi32(q2[2], q2[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(t4), _mm256_extracti128_si256(t4, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        sum = sum * kLevel2 + _mm_cvtsi128_si32(t);
        const __m256i p2 = _mm256_packs_epi16(_mm256_packs_epi32(q2[0], q2[1]), _mm256_packs_epi32(q2[2], q2[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q2 + r * a.n_in + b * kQK), _mm256_permutevar8x32_epi32(p2, perm));
      }
      a.d[r * a.nb + b] = a.two ? amax / 32258.0f : d;
      a.s[r * a.nb + b] = static_cast<float>(sum);
      a.s128[r * a.nb + b] = sum * 128;
    }
  }
}

float dot_f32_avx2(const float* x, const float* w, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), hi);
  }
  if (i < n) {
    const int64_t rem = n - i;
    alignas(32) int32_t mk[16];
    for (int l = 0; l < 16; ++l) mk[l] = l < rem ? -1 : 0;
    const __m256i k0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(mk));
    const __m256i k1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(mk + 8));
    const __m256 f0 = _mm256_fmadd_ps(_mm256_maskload_ps(x + i, k0), _mm256_maskload_ps(w + i, k0), lo);
    const __m256 f1 = _mm256_fmadd_ps(_mm256_maskload_ps(x + i + 8, k1), _mm256_maskload_ps(w + i + 8, k1), hi);
    lo = _mm256_blendv_ps(lo, f0, _mm256_castsi256_ps(k0));
    hi = _mm256_blendv_ps(hi, f1, _mm256_castsi256_ps(k1));
  }
  return hsum_tree(_mm256_add_ps(lo, hi));
}

}  // namespace kv::matmul_detail
