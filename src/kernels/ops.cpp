// Fast entry points of ops.h: runtime choice between the AVX-512 kernels (ops_avx512.cpp,
// compiled with AVX-512 flags, only ever called on a CPU that has them) and the portable float
// versions below, which are also what KV_ISA=scalar selects.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/ops.h"
#include "kernels/prefetch.h"

namespace kv {

namespace avx512_ops {  // ops_avx512.cpp
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);
void silu_mul(const float* gate, const float* up, float* y, int64_t n);
void gelu_mul(const float* gate, const float* up, float* y, int64_t n);
float softmax(float* x, int64_t n);
float max_value(const float* x, int64_t n);
double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums);
int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass);
int64_t first_gt(const float* x, int64_t from, int64_t n, float t);
float key_bound(const float* const* q, int n_rows, const uint16_t* mn, const uint16_t* mx, int hd);
}  // namespace avx512_ops

namespace {

bool cpu_has_avx512() {
#if defined(KV_SCALAR_ONLY) || !(defined(__x86_64__) || defined(__i386__))
  return false;
#else
  return __builtin_cpu_supports("avx512f");
#endif
}

OpsPath detect_path() {
  const char* env = std::getenv("KV_ISA");
  if (env && (std::strcmp(env, "scalar") == 0 || std::strcmp(env, "avx2") == 0))
    return OpsPath::kScalar;
  return cpu_has_avx512() ? OpsPath::kAvx512 : OpsPath::kScalar;
}

// -1 until first use. Relaxed is enough: every thread computes the same answer.
std::atomic<int> g_path{-1};

bool use_avx512() {
  int p = g_path.load(std::memory_order_relaxed);
  if (p < 0) {
    p = static_cast<int>(detect_path());
    g_path.store(p, std::memory_order_relaxed);
  }
  return p == static_cast<int>(OpsPath::kAvx512);
}

// ---- portable versions ------------------------------------------------------------------------

void rms_norm_scalar(const float* x, const float* w, float* y, int64_t n, float eps) {
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

void silu_mul_scalar(const float* gate, const float* up, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];  // exp overflow -> inf -> -0: the right limit
  }
}

void gelu_mul_scalar(const float* gate, const float* up, float* y, int64_t n) {
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

float softmax_scalar(float* x, int64_t n) {
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

double exp_scaled_scalar(float* x, int64_t n, float mx, float scale, double* block_sums) {
  double total = 0;
  for (int64_t b = 0; b * kExpBlock < n; ++b) {
    float s = 0;  // ≤ 1024 terms in [0, 1]: float loses < 1e-4 relative, far below sampling noise
    const int64_t end = std::min(n, (b + 1) * kExpBlock);
    for (int64_t i = b * kExpBlock; i < end; ++i) s += (x[i] = std::exp((x[i] - mx) * scale));
    block_sums[b] = s;
    total += s;
  }
  return total;
}

// cos/sin of every rotation angle for one (n_rot, base, scale, pos). The model ropes Q and then
// K of the same token with the same position, so the second call is free; the angles are
// formed in float64 because pos·freq at pos ~ 10^4 loses ~10^-3 rad in float32.
struct RopeTable {
  int n_rot = -1;
  float base = 0, scale = 0;
  int64_t pos = std::numeric_limits<int64_t>::min();
  std::vector<double> inv_freq;  // [n_rot / 2] freq_scale · base^(-2i/n_rot)
  std::vector<float> cos, sin;   // [n_rot / 2] at pos
};

const RopeTable& rope_table(int n_rot, int64_t pos, float base, float scale) {
  thread_local RopeTable t;  // per thread: no locking, and each pool thread keeps its own
  const int half = n_rot / 2;
  if (t.n_rot != n_rot || t.base != base || t.scale != scale) {
    t.n_rot = n_rot;
    t.base = base;
    t.scale = scale;
    t.inv_freq.resize(half);
    t.cos.resize(half);
    t.sin.resize(half);
    for (int i = 0; i < half; ++i)
      t.inv_freq[i] = static_cast<double>(scale) * std::pow(static_cast<double>(base), -2.0 * i / n_rot);
    t.pos = std::numeric_limits<int64_t>::min();
  }
  if (t.pos != pos) {
    for (int i = 0; i < half; ++i) {
      const double theta = static_cast<double>(pos) * t.inv_freq[i];
      t.cos[i] = static_cast<float>(std::cos(theta));
      t.sin[i] = static_cast<float>(std::sin(theta));
    }
    t.pos = pos;
  }
  return t;
}

}  // namespace

PrefetchLevel prefetch_level() {
  static const PrefetchLevel level = [] {
    if (const char* e = std::getenv("KV_PREFETCH_HINT")) {
      if (std::strcmp(e, "t0") == 0) return PrefetchLevel::kT0;
      if (std::strcmp(e, "t1") == 0) return PrefetchLevel::kT1;
      if (std::strcmp(e, "none") == 0) return PrefetchLevel::kNone;
    }
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_is("amd")) return PrefetchLevel::kT1;
#endif
    return PrefetchLevel::kT0;
  }();
  return level;
}

OpsPath ops_path() { return use_avx512() ? OpsPath::kAvx512 : OpsPath::kScalar; }

void set_ops_path_for_testing(OpsPath p) {
  if (p == OpsPath::kAvx512 && !cpu_has_avx512()) p = OpsPath::kScalar;
  g_path.store(static_cast<int>(p), std::memory_order_relaxed);
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  if (use_avx512()) return avx512_ops::rms_norm(x, w, y, n, eps);
  rms_norm_scalar(x, w, y, n, eps);
}

void rope(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base,
          float freq_scale, RopeStyle style) {
  assert(n_rot % 2 == 0 && n_rot <= head_dim);
  const RopeTable& t = rope_table(n_rot, pos, freq_base, freq_scale);
  const float* c = t.cos.data();
  const float* s = t.sin.data();
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

void silu_mul(const float* gate, const float* up, float* y, int64_t n) {
  if (use_avx512()) return avx512_ops::silu_mul(gate, up, y, n);
  silu_mul_scalar(gate, up, y, n);
}

void gelu_mul(const float* gate, const float* up, float* y, int64_t n) {
  if (use_avx512()) return avx512_ops::gelu_mul(gate, up, y, n);
  gelu_mul_scalar(gate, up, y, n);
}

float softmax(float* x, int64_t n) {
  if (use_avx512()) return avx512_ops::softmax(x, n);
  return softmax_scalar(x, n);
}

float max_value(const float* x, int64_t n) {
  if (use_avx512()) return avx512_ops::max_value(x, n);
  return max_value_ref(x, n);
}

double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums) {
  if (use_avx512()) return avx512_ops::exp_scaled(x, n, mx, scale, block_sums);
  return exp_scaled_scalar(x, n, mx, scale, block_sums);
}

int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass) {
  if (use_avx512()) return avx512_ops::collect_ge(x, n, t, idx, mass);
  return collect_ge_ref(x, n, t, idx, mass);
}

int64_t first_gt(const float* x, int64_t from, int64_t n, float t) {
  if (use_avx512()) return avx512_ops::first_gt(x, from, n, t);
  return first_gt_ref(x, from, n, t);
}

float key_bound(const float* const* q, int n_rows, const uint16_t* mn, const uint16_t* mx, int hd) {
  if (use_avx512() && hd % 16 == 0) return avx512_ops::key_bound(q, n_rows, mn, mx, hd);
  return key_bound_ref(q, n_rows, mn, mx, hd);
}

void add_inplace(float* y, const float* x, int64_t n) {
  // Memory-bound and trivially vectorised by the compiler; no ISA variant needed.
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace kv
