// The portable (plain-loop) versions of ops.h's fast entry points, compiled once per ISA:
// included by ops_scalar.cpp, ops_avx2.cpp and ops_avx512.cpp, each defining KV_ISA_NS and
// compiled with that ISA's flags, so the compiler vectorises the loops for it (SSE2 in the
// baseline build, AVX2 + FMA in ops_avx2.cpp). ops_avx512.cpp replaces most of them with
// intrinsics. Not an ordinary header: no include guard, and nothing else may include it.
// Everything here is in namespace kv::KV_ISA_NS (see isa_kernels.h for the ODR rules).
#ifndef KV_ISA_NS
#error "ops_impl.h is included by ops_{scalar,avx2,avx512}.cpp only"
#endif

#include <cassert>
#include <cmath>
#include <limits>

#include "kernels/isa_kernels.h"
#include "kernels/ops.h"

namespace kv::KV_ISA_NS {

void rms_norm_portable(const float* x, const float* w, float* y, int64_t n, float eps) {
  // float64 sum: one multiply-add per element either way, and n·eps_f32 drift would otherwise
  // show at the 4k-wide rows of bigger models.
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  if (w) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
  }
}

void rope_portable(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base, float freq_scale,
                   RopeStyle style) {
  assert(n_rot % 2 == 0 && n_rot <= head_dim);
  const RopeAngles a = rope_angles(n_rot, pos, freq_base, freq_scale);
  const float* c = a.cos;
  const float* s = a.sin;
  const int half = n_rot / 2;
  // The rotation itself is a few hundred flops per token: plain loops, vectorised by the
  // compiler where the layout allows (neox halves are contiguous).
  for (int h = 0; h < n_head; ++h) {
    float* v = x + static_cast<int64_t>(h) * head_dim;  // [head_dim]
    if (style == RopeStyle::kNeox) {
      for (int i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * c[i] - x1 * s[i];
        v[i + half] = x0 * s[i] + x1 * c[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * c[i] - x1 * s[i];
        v[2 * i + 1] = x0 * s[i] + x1 * c[i];
      }
    }
  }
}

void silu_mul_portable(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];  // exp overflow -> inf -> -0: the right limit
  }
}

void gelu_mul_portable(const float* gate, const float* up, float* y, int64_t n) {
  // 0.5·g·(1 + tanh z) = g · sigmoid(2z): one exp, and no cancellation in 1 + tanh z for
  // negative g, where tanh z ≈ -1.
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kCoefA = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float z = kSqrt2OverPi * g * (1.0f + kCoefA * g * g);
    y[i] = g / (1.0f + std::exp(-2.0f * z)) * up[i];
  }
}

float softmax_portable(float* x, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::fmax(max, x[i]);
  if (n == 0 || max == -std::numeric_limits<float>::infinity()) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;  // as softmax_ref: no mass anywhere
    return -std::numeric_limits<float>::infinity();
  }
  double sum = 0;  // n reaches the context length: keep the partition accurate
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  return max + static_cast<float>(std::log(sum));
}

double exp_scaled_portable(float* x, int64_t n, float mx, float scale, double* block_sums) {
  double total = 0;
  for (int64_t b = 0; b * kExpBlock < n; ++b) {
    float s = 0;  // ≤ 1024 terms in [0, 1]: float loses < 1e-4 relative, far below sampling noise
    const int64_t end = n < (b + 1) * kExpBlock ? n : (b + 1) * kExpBlock;
    for (int64_t i = b * kExpBlock; i < end; ++i) s += (x[i] = std::exp((x[i] - mx) * scale));
    block_sums[b] = s;
    total += s;
  }
  return total;
}

void add_inplace_portable(float* y, const float* x, int64_t n) {
  // Memory-bound and trivially vectorised by the compiler.
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace kv::KV_ISA_NS
