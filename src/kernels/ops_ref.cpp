// Scalar references for ops.h: plain loops, float64 arithmetic throughout, so that the fast
// versions' tolerances measure their own error and not the reference's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/ops.h"
#include "kernels/quant.h"

namespace kv {

void rms_norm_ref(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double scale = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<float>(x[i] * scale * (w ? static_cast<double>(w[i]) : 1.0));
}

void rope_ref(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base,
              float freq_scale, RopeStyle style) {
  const int half = n_rot / 2;
  for (int h = 0; h < n_head; ++h) {
    float* v = x + static_cast<int64_t>(h) * head_dim;  // [head_dim]
    for (int i = 0; i < half; ++i) {
      const double theta = static_cast<double>(pos) * freq_scale *
                           std::pow(static_cast<double>(freq_base), -2.0 * i / n_rot);
      const double c = std::cos(theta), s = std::sin(theta);
      const int i0 = style == RopeStyle::kNorm ? 2 * i : i;
      const int i1 = style == RopeStyle::kNorm ? 2 * i + 1 : i + half;
      const double x0 = v[i0], x1 = v[i1];
      v[i0] = static_cast<float>(x0 * c - x1 * s);
      v[i1] = static_cast<float>(x0 * s + x1 * c);
    }
  }
}

void silu_mul_ref(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    y[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void gelu_mul_ref(const float* gate, const float* up, float* y, int64_t n) {
  // ggml's gelu (tanh approximation), the one Gemma was trained with:
  // 0.5·g·(1 + tanh z), z = sqrt(2/pi)·(g + 0.044715·g³). Evaluated as g·sigmoid(2z), the same
  // value: spelled with tanh, 1 + tanh z cancels catastrophically for z < -10 even in float64
  // (0.3% error at g = -6.6).
  constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
  constexpr double kCoefA = 0.044715;
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double z = kSqrt2OverPi * g * (1.0 + kCoefA * g * g);
    y[i] = static_cast<float>(g / (1.0 + std::exp(-2.0 * z)) * up[i]);
  }
}

float softmax_ref(float* x, int64_t n) {
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::fmax(max, x[i]);
  if (n == 0 || max == -std::numeric_limits<double>::infinity()) {
    // No finite score (e.g. every position masked): no probability mass anywhere. Zeros keep
    // a weighted sum over values at zero instead of spreading NaN.
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    return -std::numeric_limits<float>::infinity();
  }
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - max);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(std::exp(x[i] - max) / sum);
  return static_cast<float>(max + std::log(sum));
}

float max_value_ref(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
}

double exp_scaled_ref(float* x, int64_t n, float mx, float scale, double* block_sums) {
  double total = 0;
  for (int64_t b = 0; b * kExpBlock < n; ++b) {
    double s = 0;
    for (int64_t i = b * kExpBlock; i < std::min(n, (b + 1) * kExpBlock); ++i) {
      x[i] = static_cast<float>(std::exp((static_cast<double>(x[i]) - mx) * scale));
      s += x[i];
    }
    block_sums[b] = s;
    total += s;
  }
  return total;
}

int64_t collect_ge_ref(const float* x, int64_t n, float t, int32_t* idx, double* mass) {
  int64_t k = 0;
  double m = 0;
  for (int64_t i = 0; i < n; ++i)
    if (x[i] >= t) {
      idx[k++] = static_cast<int32_t>(i);
      m += x[i];
    }
  *mass = m;
  return k;
}

int64_t first_gt_ref(const float* x, int64_t from, int64_t n, float t) {
  for (int64_t i = from; i < n; ++i)
    if (x[i] > t) return i;
  return n;
}

void encode_key_summary(const float* mean, const float* var, int hd, uint8_t* out) {
  float amax = 0, vmax = 0;
  for (int d = 0; d < hd; ++d) {
    amax = std::max(amax, std::fabs(mean[d]));
    vmax = std::max(vmax, var[d]);
  }
  const float ms = amax / 127.f, vs = vmax / 255.f;
  std::memcpy(out, &ms, 4);
  std::memcpy(out + 4, &vs, 4);
  for (int d = 0; d < hd; ++d) {
    const float m = amax > 0 ? std::nearbyint(mean[d] * (127.f / amax)) : 0.f;
    const float v = vmax > 0 ? std::nearbyint(std::max(0.f, var[d]) * (255.f / vmax)) : 0.f;
    out[8 + d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(m, -127.f, 127.f)));
    out[8 + hd + d] = static_cast<uint8_t>(std::clamp(v, 0.f, 255.f));
  }
}

float key_summary_mean(const uint8_t* s, int, int d) {
  float ms;
  std::memcpy(&ms, s, 4);
  return ms * static_cast<float>(static_cast<int8_t>(s[8 + d]));
}

float key_summary_var(const uint8_t* s, int hd, int d) {
  float vs;
  std::memcpy(&vs, s + 4, 4);
  return vs * static_cast<float>(s[8 + hd + d]);
}

void key_score_pages_ref(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                         float spread, float* out) {
  for (int64_t i = 0; i < n; ++i)
    for (int h = 0; h < n_heads; ++h) {
      const uint8_t* sm = b[i] + int64_t(h) * key_summary_bytes(hd);
      const float* const* qh = q + int64_t(h) * n_rows;
      double best = -std::numeric_limits<double>::infinity();
      for (int r = 0; r < n_rows; ++r) {
        double m = 0, s2 = 0;
        for (int d = 0; d < hd; ++d) {
          m += double(qh[r][d]) * key_summary_mean(sm, hd, d);
          s2 += double(qh[r][d]) * qh[r][d] * key_summary_var(sm, hd, d);
        }
        best = std::max(best, m + spread * std::sqrt(s2));
      }
      out[i * n_heads + h] = static_cast<float>(best);
    }
}

}  // namespace kv
