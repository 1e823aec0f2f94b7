// The ops built for AVX2 + FMA + F16C (CMakeLists.txt flags *_avx2.cpp): the portable loops,
// vectorised 8 wide by the compiler, and in intrinsics what the compiler cannot vectorise: exp
// (silu_mul, gelu_mul, exp_scaled), the sampler's row scans (max_value, collect_ge, first_gt),
// Quest's key_score_pages, and rms_norm's float64 reduction.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "ops_avx2.cpp needs -mavx2 -mfma -mf16c (CMakeLists.txt gives them to *_avx2.cpp)"
#endif
#define KV_ISA_NS avx2
#include <immintrin.h>

#include <cstring>

#include "kernels/ops_impl.h"

namespace kv::avx2 {

namespace {

// exp(x), 8 lanes: ops_avx512.cpp's exp16 (Cephes scheme, degree-6 polynomial, ≈1 ulp) with
// 2^n built in the exponent field in two halves, n = n1 + n2 with both in [-75, 64], so the
// results that underflow to subnormals or zero, or overflow to inf, round once as scalef's do.
// min/max take x as the second operand so NaN propagates.
__m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);  // exact: n is an integer in [-150, 128]
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// rms_norm_portable's float64 sum of squares in four accumulators of four doubles: the
// portable loop's single running sum is a chain of dependent adds the compiler may not reorder
// (0.89 µs for a 576-wide row on Zen 3, ~4 cycles an element), and the engine thread runs
// 61 norms per token of a step alone. The scaling loop is the portable one.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    const __m256d x2 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 8)), x3 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 12));
    a0 = _mm256_fmadd_pd(x0, x0, a0);
    a1 = _mm256_fmadd_pd(x1, x1, a1);
    a2 = _mm256_fmadd_pd(x2, x2, a2);
    a3 = _mm256_fmadd_pd(x3, x3, a3);
  }
  const __m256d a = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  double ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  if (w) {
    for (i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
  } else {
    for (i = 0; i < n; ++i) y[i] = x[i] * scale;
  }
}

// g / (1 + e^(-k·g)), as ops_avx512.cpp: silu (k = 1) and gelu_tanh (k·g → 2z). Large negative
// arguments give e^.. = inf and then -0, the correct limit.
__m256 times_sigmoid(__m256 g, __m256 neg_arg) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg_arg)));
}

void silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = times_sigmoid(g, _mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  if (i < n) silu_mul_portable(gate + i, up + i, y + i, n - i);
}

void gelu_mul(const float* gate, const float* up, float* y, int64_t n) {
  // gelu_tanh(g) = g·sigmoid(2z), z = sqrt(2/pi)·(g + 0.044715·g³).
  const __m256 k2 = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
  const __m256 a = _mm256_set1_ps(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(a, g), g, _mm256_set1_ps(1.0f));
    const __m256 s = times_sigmoid(g, _mm256_mul_ps(_mm256_mul_ps(k2, g), inner));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  if (i < n) gelu_mul_portable(gate + i, up + i, y + i, n - i);
}

// The sampler's row scans (sampling.cpp), 8 lanes; tails run the reference's scalar loop.
float max_value(const float* x, int64_t n) {
  // max_ps(a, b) returns b when a is NaN: the running max stays the second operand.
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 m0 = _mm256_set1_ps(ninf), m1 = m0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
  }
  float m = hmax(_mm256_max_ps(m0, m1));
  for (; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
}

double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums) {
  const __m256 vm = _mm256_set1_ps(mx), vs = _mm256_set1_ps(scale);
  double total = 0;
  for (int64_t b = 0; b * kExpBlock < n; ++b) {
    const int64_t end = n < (b + 1) * kExpBlock ? n : (b + 1) * kExpBlock;
    __m256 acc = _mm256_setzero_ps();  // float lanes: each sums ≤ 128 terms in [0, 1] per block
    int64_t i = b * kExpBlock;
    for (; i + 8 <= end; i += 8) {
      const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), vs));
      _mm256_storeu_ps(x + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    float s = hsum(acc);
    for (; i < end; ++i) s += (x[i] = std::exp((x[i] - mx) * scale));
    block_sums[b] = s;
    total += s;
  }
  return total;
}

int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass) {
  // Compare 8 at a time; the (rare) lanes that pass are taken one by one.
  const __m256 vt = _mm256_set1_ps(t);
  double m = 0;
  int64_t k = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    unsigned ge = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ)));
    for (; ge; ge &= ge - 1) {
      const int64_t j = i + __builtin_ctz(ge);
      idx[k++] = static_cast<int32_t>(j);
      m += x[j];
    }
  }
  for (; i < n; ++i)
    if (x[i] >= t) {
      idx[k++] = static_cast<int32_t>(i);
      m += x[i];
    }
  *mass = m;
  return k;
}

int64_t first_gt(const float* x, int64_t from, int64_t n, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  int64_t i = from;
  for (; i + 16 <= n; i += 16) {  // two vectors a turn: the common case is "none of them"
    const int a = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GT_OQ));
    const int b = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vt, _CMP_GT_OQ));
    if (a | b) return a ? i + __builtin_ctz(a) : i + 8 + __builtin_ctz(b);
  }
  for (; i < n; ++i)
    if (x[i] > t) return i;
  return n;
}

// Quest's page scores, 8 channels at a time: q·mu and Σ q²·var, two FMAs per channel and row.
// Rows go in groups of G so that 2G accumulators hide the FMA latency.
template <int G>
void rows_score(const float* const* q, int nc, const __m256* mu, const __m256* var, float spread, float* best) {
  __m256 a[G], b[G];
  for (int g = 0; g < G; ++g) a[g] = b[g] = _mm256_setzero_ps();
  for (int c = 0; c < nc; ++c) {
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q[g] + 8 * c);
      a[g] = _mm256_fmadd_ps(qv, mu[c], a[g]);
      b[g] = _mm256_fmadd_ps(_mm256_mul_ps(qv, qv), var[c], b[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const float m = hsum(a[g]), s2 = std::max(0.f, hsum(b[g]));
    const float row = m + spread * std::sqrt(s2);
    if (*best < row) *best = row;
  }
}

void key_score_pages(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                     float spread, float* out) {
  constexpr int kMaxChunks = 32;  // head_dim ≤ 256
  if (hd % 8 != 0 || hd > 8 * kMaxChunks) return key_score_pages_ref(q, n_rows, n_heads, b, n, hd, spread, out);
  const int nc = hd / 8;
  __m256 mu[kMaxChunks], var[kMaxChunks];
  constexpr int64_t kAhead = 8;  // pages are scattered: the hardware prefetcher cannot guess the next one
  const int64_t page_bytes = int64_t(n_heads) * key_summary_bytes(hd);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n)
      for (int64_t off = 0; off < page_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(b[i + kAhead]) + off, _MM_HINT_T0);
    for (int h = 0; h < n_heads; ++h) {
      const uint8_t* sm = b[i] + int64_t(h) * key_summary_bytes(hd);
      float ms, vs;
      std::memcpy(&ms, sm, 4);
      std::memcpy(&vs, sm + 4, 4);
      const __m256 vms = _mm256_set1_ps(ms), vvs = _mm256_set1_ps(vs);
      for (int c = 0; c < nc; ++c) {
        const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8 + 8 * c));
        const __m128i v8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8 + hd + 8 * c));
        mu[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(m8)), vms);
        var[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v8)), vvs);
      }
      const float* const* qh = q + int64_t(h) * n_rows;
      float best = -std::numeric_limits<float>::infinity();
      int r = 0;
      for (; r + 4 <= n_rows; r += 4) rows_score<4>(qh + r, nc, mu, var, spread, &best);
      switch (n_rows - r) {
        case 3: rows_score<3>(qh + r, nc, mu, var, spread, &best); break;
        case 2: rows_score<2>(qh + r, nc, mu, var, spread, &best); break;
        case 1: rows_score<1>(qh + r, nc, mu, var, spread, &best); break;
        default: break;
      }
      out[i * n_heads + h] = best;
    }
  }
}

}  // namespace

const OpsKernels kOps = {rms_norm,          rope_portable,        silu_mul,          gelu_mul,
                         softmax_portable,  add_inplace_portable, max_value,         exp_scaled,
                         collect_ge,        first_gt,             key_score_pages};

}  // namespace kv::avx2
