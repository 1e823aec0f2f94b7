// The ops built for AVX-512 (CMakeLists.txt flags *_avx512.cpp): intrinsics for the exp-bound
// and reduction ops; RoPE and add_inplace are ops_impl.h's loops, vectorised 16 wide. Tails use
// masked loads/stores, so every n works without a scalar epilogue.
// GCC 12 warns that _mm512_undefined_ps()'s deliberate self-initialisation is uninitialised at
// every inlined intrinsic that uses it (GCC bug 105593); nothing here reads undefined lanes.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only group (clang warns that it does not know it)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "ops_avx512.cpp needs the AVX-512 flags (CMakeLists.txt gives them to *_avx512.cpp)"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#define KV_ISA_NS avx512
#include "kernels/ops_impl.h"
#include "kernels/prefetch.h"

namespace kv::avx512 {

namespace {

__mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x), 16 lanes. Cephes expf scheme: x = n·ln2 + r with |r| ≤ ln2/2, a degree-6 minimax
// polynomial for e^r (≈1 ulp), and scalef for 2^n, which saturates to 0 / inf on its own.
// Max relative error measured 1.2e-7 (1 ulp) over [-87, 88.5]; the op tests bound it. The clamp keeps
// r finite for ±inf inputs; min/max take x as the second operand so NaN propagates.
__m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 split in two so n·ln2_hi is exact (ln2_hi has 9 significant bits, |n| < 2^8).
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// g / (1 + e^(-k·g)): the sigmoid-weighted form of both silu (k = 1) and, with k·g replaced by
// 2z, gelu_tanh. Large negative arguments give e^.. = inf and then -0, the correct limit.
__m512 times_sigmoid(__m512 g, __m512 neg_arg) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(neg_arg)));
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  // Two float accumulators per lane: 32 partial sums, so even n = 8192 sums only 256 terms
  // per partial (error ~1e-6 relative, far inside what a norm needs).
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  for (; i < n; i += 16) {
    const __m512 a = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
  }
  const double ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const __m512 scale =
      _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps)));
  for (i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale);
    if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
    _mm512_mask_storeu_ps(y + i, m, v);  // y may alias x: each chunk is read before written
  }
}

void silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 s = times_sigmoid(g, _mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

void gelu_mul(const float* gate, const float* up, float* y, int64_t n) {
  // gelu_tanh(g) = 0.5·g·(1 + tanh z) = g·sigmoid(2z), z = sqrt(2/pi)·(g + 0.044715·g³).
  const __m512 k2 = _mm512_set1_ps(-2.0f * 0.7978845608028654f);
  const __m512 a = _mm512_set1_ps(0.044715f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(a, g), g, _mm512_set1_ps(1.0f));
    const __m512 neg2z = _mm512_mul_ps(_mm512_mul_ps(k2, g), inner);
    const __m512 s = times_sigmoid(g, neg2z);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}

float softmax(float* x, int64_t n) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 vmax = _mm512_set1_ps(ninf);
  for (int64_t i = 0; i < n; i += 16)
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), tail_mask(n - i), x + i));
  const float max = _mm512_reduce_max_ps(vmax);
  if (n == 0 || max == ninf) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;  // as softmax_ref: no mass anywhere
    return ninf;
  }
  // The partition sums up to a context length of terms: accumulate in float64 lanes.
  const __m512 vm = _mm512_set1_ps(max);
  __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm)));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum0 = _mm512_add_pd(sum0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    sum1 = _mm512_add_pd(sum1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  const double sum = _mm512_reduce_add_pd(_mm512_add_pd(sum0, sum1));
  const __m512 inv = _mm512_set1_ps(static_cast<float>(1.0 / sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
  return max + static_cast<float>(std::log(sum));
}

float max_value(const float* x, int64_t n) {
  // max_ps(a, b) returns b when a is NaN: the running max stays the second operand.
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 m0 = _mm512_set1_ps(ninf), m1 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
    m1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), m1);
  }
  for (; i < n; i += 16) m0 = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(ninf), tail_mask(n - i), x + i), m0);
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums) {
  const __m512 vm = _mm512_set1_ps(mx), vs = _mm512_set1_ps(scale);
  double total = 0;
  for (int64_t b = 0; b * kExpBlock < n; ++b) {
    const int64_t end = std::min(n, (b + 1) * kExpBlock);
    // Float lanes: each sums ≤ 64 terms in [0, 1] per block.
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = b * kExpBlock; i < end; i += 16) {
      const __mmask16 m = tail_mask(end - i);
      const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm), vs)));
      _mm512_mask_storeu_ps(x + i, m, e);
      acc = _mm512_add_ps(acc, e);
    }
    block_sums[b] = _mm512_reduce_add_ps(acc);
    total += block_sums[b];
  }
  return total;
}

int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass) {
  // Compare 16 at a time; the (rare) lanes that pass are compressed into idx.
  const __m512 vt = _mm512_set1_ps(t);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc = _mm512_setzero_ps();
  double m = 0;
  int64_t k = 0;
  for (int64_t i = 0; i < n; i += 16, ids = _mm512_add_epi32(ids, step)) {
    const __mmask16 tm = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(tm, x + i);
    const __mmask16 ge = _mm512_mask_cmp_ps_mask(tm, v, vt, _CMP_GE_OQ);
    if (ge) {
      // Compress in a register and store all 16 lanes (idx has 16 entries of slack):
      // vpcompressd straight to memory is microcoded and ~20x slower on Zen 4.
      _mm512_storeu_si512(idx + k, _mm512_maskz_compress_epi32(ge, ids));
      k += __builtin_popcount(ge);
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(ge, v));
    }
    if ((i & 1023) == 1008) {  // float lanes hold at most 64 terms before going to double
      m += _mm512_reduce_add_ps(acc);
      acc = _mm512_setzero_ps();
    }
  }
  *mass = m + _mm512_reduce_add_ps(acc);
  return k;
}

int64_t first_gt(const float* x, int64_t from, int64_t n, float t) {
  const __m512 vt = _mm512_set1_ps(t);
  int64_t i = from;
  for (; i + 32 <= n; i += 32) {  // two vectors a turn: the common case is "none of them"
    const __mmask16 a = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GT_OQ);
    const __mmask16 b = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i + 16), vt, _CMP_GT_OQ);
    if (a | b) return a ? i + __builtin_ctz(a) : i + 16 + __builtin_ctz(b);
  }
  for (; i < n; i += 16) {
    const __mmask16 tm = tail_mask(n - i);
    const __mmask16 a = _mm512_mask_cmp_ps_mask(tm, _mm512_maskz_loadu_ps(tm, x + i), vt, _CMP_GT_OQ);
    if (a) return i + __builtin_ctz(a);
  }
  return n;
}

// The 16 sums of v[0..15] (lane k = Σ v[k]) in 45 shuffles and adds instead of 16 full
// horizontal reductions: pairs of vectors interleave and add within 128-bit lanes, then the
// lanes fold.
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4];
  for (int j = 0; j < 8; ++j)
    x[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane l: the partial sums of v[4j .. 4j+3] over lane l
    const __m512d a = _mm512_castps_pd(x[2 * j]), b = _mm512_castps_pd(x[2 * j + 1]);
    y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Integer dot products (VNNI), 8 entries at a time per KV head. The summaries are 8-bit
// already; the query rows are quantized once per call instead of converting every summary to
// f32 (what the scores cost before: the conversions, not the multiply-adds):
// - q·mu: q to int8 at its row's absmax/127. vpdpbusd multiplies unsigned by signed bytes, so
//   the means go in as mu + 128 (one xor) and the row's 128·Σq8 comes off afterwards.
// - Σ q²·var: q² in two levels (0..127 at max q²/127, then the remainder in 1/256 steps,
//   signed), against the unsigned variances, combined in int32 (hi·256 + lo).
// A row's error against float q: |q·mu| off by at most Σ_d |mu_d| · absmax(q)/254; the
// variance term within max(q²)/(127·256) · Σ_d var_d (OpsTest.KeyScore holds it to that).
// Per query row and block: 8 entries' two int32 partial vectors, converted and reduced
// together by reduce16 (lanes 0-7: q·mu, 8-15: Σ q²·var) and scored as one vector. The next
// 8 entries' summaries (all heads: contiguous) are prefetched at prefetch_level(): a
// sequence's pages need not be in order for the hardware prefetcher.
template <int nch>  // 64-byte chunks of a summary vector, the last one masked: 1-4 (hd ≤ 256)
void key_score_int8(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                    float spread, float* out) {
  constexpr int kP = 8;
  const int hdp = nch * 64;
  const __mmask64 tail = hd % 64 == 0 ? ~__mmask64(0) : (__mmask64(1) << (hd % 64)) - 1;
  const int64_t sb = key_summary_bytes(hd), page_bytes = int64_t(n_heads) * sb;
  const int n_q = n_heads * n_rows;
  // Per query row: q8, q²-hi, q²-lo (hdp bytes each, zero past hd), and its scales.
  thread_local std::vector<int8_t> qb;
  thread_local std::vector<float> qscale;  // per row: q8 scale, q² scale / 256, 128·Σq8
  qb.assign(size_t(n_q) * 3 * hdp, 0);
  qscale.resize(size_t(n_q) * 3);
  const __m512 zero = _mm512_setzero_ps();
  for (int r = 0; r < n_q; ++r) {
    __m512 amax = zero, q2max = zero;
    for (int c = 0; c < hd; c += 16) {
      const __m512 v = _mm512_loadu_ps(q[r] + c);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      q2max = _mm512_max_ps(q2max, _mm512_mul_ps(v, v));
    }
    const float am = _mm512_reduce_max_ps(amax), m2 = _mm512_reduce_max_ps(q2max);
    const __m512 inv = _mm512_set1_ps(am > 0 ? 127.f / am : 0.f), inv2 = _mm512_set1_ps(m2 > 0 ? 127.f / m2 : 0.f);
    int8_t* q8 = qb.data() + size_t(r) * 3 * hdp;
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < hd; c += 16) {
      const __m512 v = _mm512_loadu_ps(q[r] + c);
      const __m512i i8 = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // |·| ≤ 127
      sum = _mm512_add_epi32(sum, i8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + c), _mm512_cvtepi32_epi8(i8));
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(v, v), inv2);  // 0..127
      const __m512 hi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, hi), _mm512_set1_ps(256.f)));
      lo = _mm512_min_epi32(lo, _mm512_set1_epi32(127));  // a remainder of exactly +1/2
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + hdp + c), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(hi)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + 2 * hdp + c), _mm512_cvtepi32_epi8(lo));
    }
    qscale[3 * r] = am / 127.f;
    qscale[3 * r + 1] = m2 / (127.f * 256.f);
    qscale[3 * r + 2] = 128.f * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
  alignas(64) uint8_t st[kP][2][256];  // entry p's mean + 128, then variance
  alignas(64) float msv[16] = {}, vsv[16] = {};  // entry p's scales in lane p
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), izero = _mm512_setzero_si512();
  const __m512 vspread = _mm512_set1_ps(spread);
  static const PrefetchLevel pf = prefetch_level();
  for (int64_t i0 = 0; i0 < n; i0 += kP) {
    const int np = static_cast<int>(std::min<int64_t>(kP, n - i0));
    if (pf != PrefetchLevel::kNone)
      for (int64_t i = i0 + kP; i < std::min(n, i0 + 2 * kP); ++i)
        for (int64_t off = 0; off < page_bytes; off += 64) {
          const char* a = reinterpret_cast<const char*>(b[i]) + off;
          if (pf == PrefetchLevel::kT1) _mm_prefetch(a, _MM_HINT_T1); else _mm_prefetch(a, _MM_HINT_T0);
        }
    for (int h = 0; h < n_heads; ++h) {
      for (int p = 0; p < kP; ++p) {
        if (p >= np) {  // a short block: zeros, scored but not stored
          for (int c = 0; c < nch; ++c) _mm512_store_si512(st[p][0] + 64 * c, izero), _mm512_store_si512(st[p][1] + 64 * c, izero);
          msv[p] = vsv[p] = 0.f;
          continue;
        }
        const uint8_t* sm = b[i0 + p] + int64_t(h) * sb;
        std::memcpy(&msv[p], sm, 4);
        std::memcpy(&vsv[p], sm + 4, 4);
        for (int c = 0; c < nch; ++c) {
          const __mmask64 m = c == nch - 1 ? tail : ~__mmask64(0);
          _mm512_store_si512(st[p][0] + 64 * c, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, sm + 8 + 64 * c), flip));
          _mm512_store_si512(st[p][1] + 64 * c, _mm512_maskz_loadu_epi8(m, sm + 8 + hd + 64 * c));
        }
      }
      const __m512 ms = _mm512_load_ps(msv), vs = _mm512_load_ps(vsv);
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int r = 0; r < n_rows; ++r) {
        const int qi = h * n_rows + r;
        const int8_t* q8 = qb.data() + size_t(qi) * 3 * hdp;
        __m512 acc[2 * kP];
        for (int p = 0; p < kP; ++p) {  // entry by entry: 3 int32 accumulators live, not 24
          __m512i am = izero, vh = izero, vl = izero;
          for (int c = 0; c < nch; ++c) {
            const __m512i mu = _mm512_load_si512(st[p][0] + 64 * c), var = _mm512_load_si512(st[p][1] + 64 * c);
            am = _mm512_dpbusd_epi32(am, mu, _mm512_loadu_si512(q8 + 64 * c));
            vh = _mm512_dpbusd_epi32(vh, var, _mm512_loadu_si512(q8 + hdp + 64 * c));
            vl = _mm512_dpbusd_epi32(vl, var, _mm512_loadu_si512(q8 + 2 * hdp + 64 * c));
          }
          acc[p] = _mm512_cvtepi32_ps(am);
          acc[kP + p] = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(vh, 8), vl));
        }
        const __m512 sums = reduce16(acc);  // lanes 0-7: Σ (mu+128)·q8; 8-15: Σ var·(256·q²hi + q²lo)
        const __m512 dot = _mm512_mul_ps(_mm512_sub_ps(sums, _mm512_set1_ps(qscale[3 * qi + 2])),
                                         _mm512_mul_ps(ms, _mm512_set1_ps(qscale[3 * qi])));
        const __m512 hi = _mm512_shuffle_f32x4(sums, sums, _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 var = _mm512_max_ps(zero, _mm512_mul_ps(hi, _mm512_mul_ps(vs, _mm512_set1_ps(qscale[3 * qi + 1]))));
        best = _mm512_max_ps(best, _mm512_fmadd_ps(vspread, _mm512_sqrt_ps(var), dot));
      }
      alignas(64) float sc[16];
      _mm512_store_ps(sc, best);
      for (int p = 0; p < np; ++p) out[(i0 + p) * n_heads + h] = sc[p];
    }
  }
}

void key_score_pages(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                     float spread, float* out) {
  if (hd % 16 != 0 || hd > 256) return key_score_pages_ref(q, n_rows, n_heads, b, n, hd, spread, out);
  switch ((hd + 63) / 64) {
    case 1: return key_score_int8<1>(q, n_rows, n_heads, b, n, hd, spread, out);
    case 2: return key_score_int8<2>(q, n_rows, n_heads, b, n, hd, spread, out);
    case 3: return key_score_int8<3>(q, n_rows, n_heads, b, n, hd, spread, out);
    default: return key_score_int8<4>(q, n_rows, n_heads, b, n, hd, spread, out);
  }
}

const OpsKernels kOps = {rms_norm, rope_portable, silu_mul, gelu_mul, softmax, add_inplace_portable, max_value,
                         exp_scaled, collect_ge, first_gt, key_score_pages};

}  // namespace kv::avx512
