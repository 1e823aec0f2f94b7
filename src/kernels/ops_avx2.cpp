// The ops built for AVX2 + FMA + F16C (CMakeLists.txt flags *_avx2.cpp): the portable loops,
// vectorised 8 wide by the compiler, and Quest's key_bound_pages in intrinsics (the reference converts
// f16 one value at a time). The row scans (max_value, collect_ge, first_gt) are the references.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "ops_avx2.cpp needs -mavx2 -mfma -mf16c (CMakeLists.txt gives them to *_avx2.cpp)"
#endif
#define KV_ISA_NS avx2
#include <immintrin.h>

#include <algorithm>

#include "kernels/ops_impl.h"

namespace kv::avx2 {

namespace {

// Quest's page bounds, 8 channels at a time, in the centre/radius form
// max(q·lo, q·hi) = q·(lo + hi)/2 + |q|·(hi − lo)/2: two FMAs per channel and row, no compare.
// Rows go in groups of G so that 2G accumulators hide the FMA latency.
template <int G>
void rows_bound(const float* const* q, int nc, const __m256* cen, const __m256* rad, float* best) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 a[G], b[G];
  for (int g = 0; g < G; ++g) a[g] = b[g] = _mm256_setzero_ps();
  for (int c = 0; c < nc; ++c) {
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q[g] + 8 * c);
      a[g] = _mm256_fmadd_ps(qv, cen[c], a[g]);
      b[g] = _mm256_fmadd_ps(_mm256_andnot_ps(sign, qv), rad[c], b[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 v = _mm256_add_ps(a[g], b[g]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    *best = std::max(*best, _mm_cvtss_f32(s));
  }
}

void key_bound_pages(const float* const* q, int n_rows, int n_heads, const uint16_t* const* b, int64_t n, int hd,
                     float* out) {
  constexpr int kMaxChunks = 32;  // head_dim ≤ 256
  if (hd % 8 != 0 || hd > 8 * kMaxChunks) return key_bound_pages_ref(q, n_rows, n_heads, b, n, hd, out);
  const int nc = hd / 8;
  const __m256 half = _mm256_set1_ps(0.5f);
  __m256 cen[kMaxChunks], rad[kMaxChunks];
  constexpr int64_t kAhead = 8;  // pages are scattered: the hardware prefetcher cannot guess the next one
  const int64_t page_bytes = int64_t(n_heads) * 2 * hd * 2;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n)
      for (int64_t off = 0; off < page_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(b[i + kAhead]) + off, _MM_HINT_T0);
    for (int h = 0; h < n_heads; ++h) {
      const uint16_t *mn = b[i] + int64_t(h) * 2 * hd, *mx = mn + hd;
      for (int c = 0; c < nc; ++c) {  // one f32 rounding at most (none when lo, hi are within 2^13 of each other)
        const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + 8 * c)));
        const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mx + 8 * c)));
        cen[c] = _mm256_mul_ps(_mm256_add_ps(lo, hi), half);
        rad[c] = _mm256_mul_ps(_mm256_sub_ps(hi, lo), half);
      }
      const float* const* qh = q + int64_t(h) * n_rows;
      float best = -std::numeric_limits<float>::infinity();
      int r = 0;
      for (; r + 4 <= n_rows; r += 4) rows_bound<4>(qh + r, nc, cen, rad, &best);
      switch (n_rows - r) {
        case 3: rows_bound<3>(qh + r, nc, cen, rad, &best); break;
        case 2: rows_bound<2>(qh + r, nc, cen, rad, &best); break;
        case 1: rows_bound<1>(qh + r, nc, cen, rad, &best); break;
        default: break;
      }
      out[i * n_heads + h] = best;
    }
  }
}

}  // namespace

const OpsKernels kOps = {rms_norm_portable, rope_portable,       silu_mul_portable, gelu_mul_portable,
                         softmax_portable,  add_inplace_portable, max_value_ref,     exp_scaled_portable,
                         collect_ge_ref,    first_gt_ref,         key_bound_pages};

}  // namespace kv::avx2
