// AVX-512 VNNI matmul kernels over the kInterleaved16 layout (see matmul.h).
//
// One 64-byte load holds 4 consecutive elements of 16 outputs as unsigned bytes; vpdpbusd
// multiplies it by 4 activation bytes broadcast to every lane. A tile of R rows × C groups
// (16·C outputs) keeps R·C float accumulators in registers, so each weight vector, once
// loaded and unpacked, serves R rows. Integer block sums are exact, so how they are split
// between registers does not matter; the float steps per block follow matmul.h exactly.
// GCC 12 warns about the undefined-register idiom inside its own AVX-512 intrinsics.
#if !defined(__clang__)  // a GCC-only group (clang warns that it does not know it)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/matmul.h"
#include "kernels/prefetch.h"

namespace kv::matmul_detail {

namespace {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Bytes ahead in each weight stream; the cache level is kernels/prefetch.h's per-vendor choice.
constexpr int64_t kPrefetch = 2048;
enum Pf { kPfNone = 0, kPfT0 = 1, kPfT1 = 2 };

// Rows [r0, r0 + R) × outputs of groups [g, g + C). T: two-level activations (a second
// vpdpbusd per loaded weight vector, against q2, into its own accumulator). kPf prefetches
// kPrefetch bytes ahead in each group's own records, or with kNext the same block of the
// strip after this tile's (groups [g + C, g + 2C)).
template <QFmt F, int R, int C, int kPf, bool T, bool kNext = false>
inline void tile(const QWeights& w, const QAct& a, int64_t r0, int64_t g, float* y) {
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  // Byte-wide quants (8 vectors per block) or nibble pairs (4 vectors, two elements a byte).
  constexpr bool kBytes = F == QFmt::kQ8_0 || F == QFmt::kQ6_K;
  constexpr bool kHalves = F == QFmt::kQ6_K;  // a scale per 16 elements: two sums per block
  constexpr bool kF32 = F == QFmt::kQ4_K || F == QFmt::kQ6_K;
  // Few accumulators → split each block's sum over two registers to shorten the chain
  // (two-level already has two independent chains). Q6_K always keeps its halves apart.
  constexpr int S = kHalves ? 2 : (R * C <= (T ? 2 : 4)) ? 2 : 1;
  constexpr int S2 = kHalves ? 2 : (T && R * C <= 2) ? 2 : 1;
  const int64_t gstride = w.nb * kRec;
  const uint8_t* base = w.data + (g - w.g_base) * gstride;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i b16 = _mm512_set1_epi8(0x10);

  const int8_t* xq[R];
  const int8_t* xq2[R];
  const float* xd[R];
  const float* xs[R];
  const int32_t* xs128[R];
  const int32_t* xs16[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q + (r0 + r) * a.n_in;
    xq2[r] = a.q2 + (r0 + r) * a.n_in;
    xd[r] = a.d + (r0 + r) * a.nb;
    xs[r] = a.s + (r0 + r) * a.nb;
    xs128[r] = a.s128 + (r0 + r) * a.nb;
    xs16[r] = a.s16 + (r0 + r) * (a.n_in / 16);
  }
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();

  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* blk[C];
    __m512 dw[C], mw[C];  // Q6_K: da, db
    for (int c = 0; c < C; ++c) {
      blk[c] = base + c * gstride + b * kRec;
      const char* pf = reinterpret_cast<const char*>(blk[c] + (kNext ? C * gstride : kPrefetch));
      if constexpr (kPf == kPfT0) {
        for (int64_t l = 0; l < kRec; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
      } else if constexpr (kPf == kPfT1) {
        for (int64_t l = 0; l < kRec; l += 64) _mm_prefetch(pf + l, _MM_HINT_T1);
      }
      if constexpr (kF32) {
        dw[c] = _mm512_load_ps(blk[c]);
        mw[c] = _mm512_load_ps(blk[c] + 64);
      } else {
        dw[c] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk[c])));
        if constexpr (F == QFmt::kQ4_1)
          mw[c] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk[c] + 32)));
        else if constexpr (F == QFmt::kQ4_0)
          mw[c] = _mm512_mul_ps(dw[c], _mm512_set1_ps(-8.0f));
        else
          mw[c] = dw[c];
      }
    }
    __m512i is[R][C][S], is2[R][C][S2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        for (int s = 0; s < S; ++s) is[r][c][s] = _mm512_setzero_si512();
        if constexpr (T)
          for (int s = 0; s < S2; ++s) is2[r][c][s] = _mm512_setzero_si512();
      }

    if constexpr (kBytes) {
      // Q6_K: vectors 0-3 (elements 0-15) into sum 0, 4-7 into sum 1. Two loops with a constant
      // sum index each, so the sums stay in registers.
      auto vectors = [&](auto half) {
        constexpr int h = decltype(half)::value;
        constexpr int j0 = kHalves ? 4 * h : 0, j1 = kHalves ? j0 + 4 : 8;
        for (int j = j0; j < j1; ++j)
          for (int c = 0; c < C; ++c) {
            const __m512i v = _mm512_loadu_si512(blk[c] + kQo + 64 * j);
            const int s = kHalves ? h : j % S;
            for (int r = 0; r < R; ++r) {
              is[r][c][s] = _mm512_dpbusd_epi32(is[r][c][s], v, bcast4(xq[r] + b * 32 + 4 * j));
              if constexpr (T) {
                const int s2 = kHalves ? h : j % S2;
                is2[r][c][s2] = _mm512_dpbusd_epi32(is2[r][c][s2], v, bcast4(xq2[r] + b * 32 + 4 * j));
              }
            }
          }
      };
      vectors(std::integral_constant<int, 0>{});
      if constexpr (kHalves) vectors(std::integral_constant<int, 1>{});
    } else {
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < C; ++c) {
          const __m512i v = _mm512_loadu_si512(blk[c] + kQo + 64 * j);
          __m512i lo = _mm512_and_si512(v, m4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          if constexpr (F == QFmt::kQ5_0) {
            // Bit 4 of each element from its mask: one bit per byte lane.
            uint64_t klo, khi;
            std::memcpy(&klo, blk[c] + 32 + 16 * j, 8);
            std::memcpy(&khi, blk[c] + 40 + 16 * j, 8);
            lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(klo), lo, b16);
            hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(khi), hi, b16);
          }
          for (int r = 0; r < R; ++r) {
            is[r][c][0] = _mm512_dpbusd_epi32(is[r][c][0], lo, bcast4(xq[r] + b * 32 + 4 * j));
            is[r][c][S - 1] =
                _mm512_dpbusd_epi32(is[r][c][S - 1], hi, bcast4(xq[r] + b * 32 + 16 + 4 * j));
            if constexpr (T) {
              is2[r][c][0] = _mm512_dpbusd_epi32(is2[r][c][0], lo, bcast4(xq2[r] + b * 32 + 4 * j));
              is2[r][c][S2 - 1] = _mm512_dpbusd_epi32(is2[r][c][S2 - 1], hi, bcast4(xq2[r] + b * 32 + 16 + 4 * j));
            }
          }
        }
    }

    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r][b]);
      for (int c = 0; c < C; ++c) {
        __m512 t;
        if constexpr (kHalves) {
          __m512i ia = is[r][c][0], ib = is[r][c][1];
          if constexpr (T) {
            ia = _mm512_add_epi32(_mm512_mullo_epi32(ia, _mm512_set1_epi32(kLevel2)), is2[r][c][0]);
            ib = _mm512_add_epi32(_mm512_mullo_epi32(ib, _mm512_set1_epi32(kLevel2)), is2[r][c][1]);
          }
          ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(32 * xs16[r][2 * b]));
          ib = _mm512_sub_epi32(ib, _mm512_set1_epi32(32 * xs16[r][2 * b + 1]));
          t = _mm512_fmadd_ps(mw[c], _mm512_cvtepi32_ps(ib), _mm512_mul_ps(dw[c], _mm512_cvtepi32_ps(ia)));
        } else {
          __m512i i = is[r][c][0];
          if constexpr (S == 2) i = _mm512_add_epi32(i, is[r][c][1]);
          if constexpr (T) {
            __m512i i2 = is2[r][c][0];
            if constexpr (S2 == 2) i2 = _mm512_add_epi32(i2, is2[r][c][1]);
            i = _mm512_add_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32(kLevel2)), i2);
          }
          if constexpr (F == QFmt::kQ8_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(xs128[r][b]));
          if constexpr (F == QFmt::kQ5_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(xs128[r][b] / 8));
          t = _mm512_mul_ps(dw[c], _mm512_cvtepi32_ps(i));
          if constexpr (F == QFmt::kQ4_0 || F == QFmt::kQ4_1 || F == QFmt::kQ4_K)
            t = _mm512_fmadd_ps(mw[c], _mm512_set1_ps(xs[r][b]), t);
        }
        acc[r][c] = _mm512_fmadd_ps(t, dx, acc[r][c]);
      }
    }
  }

  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t o = (g + c) * kGroup;
      float* yp = y + (r0 + r) * w.n_out + o;
      const int64_t rem = w.n_out - o;
      if (rem >= kGroup)
        _mm512_storeu_ps(yp, acc[r][c]);
      else if (rem > 0)
        _mm512_mask_storeu_ps(yp, static_cast<__mmask16>((1u << rem) - 1), acc[r][c]);
    }
}

// Rows [r, r + n) with 0 < n < RT, as one tile of n rows.
template <QFmt F, int C, bool T, int kPf, int RT, bool kNext = false, int N = 1>
inline void rest_tile(const QWeights& w, const QAct& a, int64_t r, int64_t n, int64_t g, float* y) {
  if constexpr (N < RT) {
    if (n == N) return tile<F, N, C, kPf, T, kNext>(w, a, r, g, y);
    rest_tile<F, C, T, kPf, RT, kNext, N + 1>(w, a, r, n, g, y);
  }
}

// The first row tile over a weight strip streams it from RAM and prefetches ahead in it (P);
// the others find it in L1. The second tile prefetches the next strip, so that its first
// tile finds it in cache too, and the stream from RAM overlaps the later tiles' compute
// (on AMD Zen 5 the streaming tile was 1.7× the cost of a cached one). RT rows per full tile.
template <QFmt F, int C, bool T, int RT, int P>
void row_tiles(const QWeights& w, const QAct& a, int64_t r0, int64_t r1, int64_t g, float* y) {
  int64_t r = r0;
  int k = 0;  // tiles done
  for (; r + RT <= r1; r += RT, ++k) {
    if (k == 0)
      tile<F, RT, C, P, T>(w, a, r, g, y);
    else if (k == 1)
      tile<F, RT, C, P, T, true>(w, a, r, g, y);
    else
      tile<F, RT, C, kPfNone, T>(w, a, r, g, y);
  }
  if (r < r1) {
    if (k == 0)
      rest_tile<F, C, T, P, RT>(w, a, r, r1 - r, g, y);
    else if (k == 1)
      rest_tile<F, C, T, P, RT, true>(w, a, r, r1 - r, g, y);
    else
      rest_tile<F, C, T, kPfNone, RT>(w, a, r, r1 - r, g, y);
  }
}

template <QFmt F, bool T, int P>
void run(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  if (n_rows == 1) {
    int64_t g = g0;
    if (gemv_one_stream()) {
      // One group at a time: one sequential stream for the hardware prefetcher, no software
      // prefetch (kernels/prefetch.h); its sums split over two accumulators per level.
      for (; g < g1; ++g) tile<F, 1, 1, kPfNone, T>(w, a, 0, g, y);
      return;
    }
    // 4 groups at once for independent chains, 4 memory streams, software prefetch.
    for (; g + 4 <= g1; g += 4) tile<F, 1, 4, P, T>(w, a, 0, g, y);
    switch (g1 - g) {
      case 3: tile<F, 1, 3, P, T>(w, a, 0, g, y); break;
      case 2: tile<F, 1, 2, P, T>(w, a, 0, g, y); break;
      case 1: tile<F, 1, 1, P, T>(w, a, 0, g, y); break;
      default: break;
    }
    return;
  }
  // GEMM: a 32-output weight strip stays in L1 while a chunk of rows (in L2) passes over it.
  // Two-level: 16-output strips (4 rows × 2 groups × 2 levels of accumulators would spill).
  constexpr int64_t kRowChunk = 64;
  constexpr int kRT = 4;  // rows per tile (two-level: 5, 6 and 8 measured no faster)
  static_assert(kRT == kMatmulRowTile, "the engine sizes drafts by this tile (matmul.h)");
  for (int64_t rc = 0; rc < n_rows; rc += kRowChunk) {
    const int64_t re = std::min(n_rows, rc + kRowChunk);
    if constexpr (T) {
      for (int64_t g = g0; g < g1; ++g) row_tiles<F, 1, T, kRT, P>(w, a, rc, re, g, y);
    } else {
      for (int64_t g = g0; g < g1; g += 2) {
        if (g + 2 <= g1)
          row_tiles<F, 2, T, kRT, P>(w, a, rc, re, g, y);
        else
          row_tiles<F, 1, T, kRT, P>(w, a, rc, re, g, y);
      }
    }
  }
}

template <QFmt F, int P>
void run_pf(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  if (a.two)
    run<F, true, P>(w, a, n_rows, g0, g1, y);
  else
    run<F, false, P>(w, a, n_rows, g0, g1, y);
}

template <QFmt F>
void run_any(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  switch (static_cast<int>(prefetch_level())) {
    case kPfT1: return run_pf<F, kPfT1>(w, a, n_rows, g0, g1, y);
    case kPfNone: return run_pf<F, kPfNone>(w, a, n_rows, g0, g1, y);
    default: return run_pf<F, kPfT0>(w, a, n_rows, g0, g1, y);
  }
}

}  // namespace

namespace {

void q_gemm_vnni(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  switch (w.fmt) {
    case QFmt::kQ4_0: run_any<QFmt::kQ4_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ4_1: run_any<QFmt::kQ4_1>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ8_0: run_any<QFmt::kQ8_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ5_0: run_any<QFmt::kQ5_0>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ4_K: run_any<QFmt::kQ4_K>(w, a, n_rows, g0, g1, y); break;
    case QFmt::kQ6_K: run_any<QFmt::kQ6_K>(w, a, n_rows, g0, g1, y); break;
  }
}

// Rows [r0, ...) of a as a QAct of their own.
QAct rows_from(const QAct& a, int64_t r0) {
  QAct v = a;
  v.q += r0 * a.n_in;
  if (v.q2) v.q2 += r0 * a.n_in;
  v.d += r0 * a.nb;
  v.s += r0 * a.nb;
  v.s128 += r0 * a.nb;
  if (v.s16) v.s16 += r0 * (a.n_in / 16);
  return v;
}

}  // namespace

void q_gemm_avx512(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                   float* y) {
  if (n_rows >= kAmxMinRows && amx_enabled()) {
    // AMX for whole 16-row tiles and for a long remainder; a short remainder costs less on VNNI
    // than a tile pass over the whole group (bench_matmul BM_Model, docs/ARCHITECTURE.md).
    const int64_t rem = n_rows % 16;
    const int64_t amx_rows = rem >= kAmxMinTailRows ? n_rows : n_rows - rem;
    if (q_gemm_amx(w, a, amx_rows, g0, g1, y)) {
      if (amx_rows < n_rows) q_gemm_vnni(w, rows_from(a, amx_rows), n_rows - amx_rows, g0, g1, y + amx_rows * w.n_out);
      return;
    }
  }
  q_gemm_vnni(w, a, n_rows, g0, g1, y);
}

void quantize_rows_avx512(const float* x, int64_t r0, int64_t r1, const QAct& a) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * a.n_in;
    int8_t* qr = a.q + r * a.n_in;
    for (int64_t b = 0; b < a.nb; ++b) {
      const __m512 x0 = _mm512_loadu_ps(xr + b * kQK), x1 = _mm512_loadu_ps(xr + b * kQK + 16);
      const __m512 ax = _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1));
      const float amax = _mm512_reduce_max_ps(ax);
      const float d = amax / 127.0f;
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * kQK), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + b * kQK + 16), _mm512_cvtepi32_epi8(q1));
      int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      if (a.two) {
        // Residual against the first level, then its own 8-bit level (see QAct).
        const __m512 vd = _mm512_set1_ps(d);
        const __m512 vid2 = _mm512_set1_ps(amax > 0 ? 32258.0f / amax : 0.0f);
        const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
        const __m512 r0 = _mm512_fnmadd_ps(vd, _mm512_cvtepi32_ps(q0), x0);
        const __m512 r1 = _mm512_fnmadd_ps(vd, _mm512_cvtepi32_ps(q1), x1);
        const __m512i p0 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(r0, vid2))));
        const __m512i p1 = _mm512_max_epi32(nlim, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(r1, vid2))));
        int8_t* q2r = a.q2 + r * a.n_in;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2r + b * kQK), _mm512_cvtepi32_epi8(p0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2r + b * kQK + 16), _mm512_cvtepi32_epi8(p1));
        sum = sum * kLevel2 + _mm512_reduce_add_epi32(_mm512_add_epi32(p0, p1));
      }
      a.d[r * a.nb + b] = a.two ? amax / 32258.0f : d;
      a.s[r * a.nb + b] = static_cast<float>(sum);
      a.s128[r * a.nb + b] = sum * 128;
    }
  }
}

float dot_f32_avx512(const float* x, const float* w, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), acc);
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, w + i), acc, k);
  }
  // Tree 8, 4, 2, 1 as in dot_f32_scalar.
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

}  // namespace kv::matmul_detail
