// Fast entry points of ops.h: each calls the build for kernel_isa() (ops_scalar.cpp,
// ops_avx2.cpp, ops_avx512.cpp; a table per ISA, isa_kernels.h). Also the per-thread RoPE
// angle table those builds share, and the prefetch level.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <limits>
#include <vector>

#include "kernels/isa_kernels.h"
#include "kernels/ops.h"
#include "kernels/prefetch.h"

namespace kv {

namespace {

const OpsKernels& kernels() {
#ifndef KV_SCALAR_ONLY
  switch (kernel_isa()) {
    case Isa::kAvx512: return avx512::kOps;
    case Isa::kAvx2: return avx2::kOps;
    case Isa::kScalar: break;
  }
#endif
  return scalar::kOps;
}

// cos/sin of the rotation angles of one (n_rot, base, scale), for the positions seen lately:
// a direct-mapped cache by position. A decode step visits the same positions (one per
// sequence) in every layer, and q and k share them: each position's angles are computed once
// per step, not once per layer and call (a double sin and cos per rotated pair).
struct RopeTable {
  static constexpr int kSlots = 1024;  // a prefill chunk's positions fit
  int n_rot = -1;
  float base = 0, scale = 0;
  std::vector<double> inv_freq;  // [n_rot / 2] freq_scale · base^(-2i/n_rot)
  std::vector<int64_t> pos;      // [kSlots] the position slot s holds, or INT64_MIN
  std::vector<float> cs;         // [kSlots][n_rot]: cos of the n_rot / 2 angles, then sin
};

}  // namespace

RopeAngles rope_angles(int n_rot, int64_t pos, float base, float scale) {
  // Per thread: no locking. Two tables: Gemma 3 alternates two bases between layers.
  thread_local RopeTable tables[2];
  thread_local int next_victim = 0;
  const int half = n_rot / 2;
  RopeTable* t = nullptr;
  for (RopeTable& c : tables)
    if (c.n_rot == n_rot && c.base == base && c.scale == scale) t = &c;
  if (!t) {
    t = &tables[next_victim];
    next_victim ^= 1;
    t->n_rot = n_rot;
    t->base = base;
    t->scale = scale;
    t->inv_freq.resize(half);
    for (int i = 0; i < half; ++i)
      t->inv_freq[i] = static_cast<double>(scale) * std::pow(static_cast<double>(base), -2.0 * i / n_rot);
    t->pos.assign(RopeTable::kSlots, std::numeric_limits<int64_t>::min());
    t->cs.resize(static_cast<size_t>(RopeTable::kSlots) * n_rot);
  }
  const size_t slot = static_cast<size_t>(static_cast<uint64_t>(pos) % RopeTable::kSlots);
  float* c = t->cs.data() + slot * n_rot;
  if (t->pos[slot] != pos) {
    for (int i = 0; i < half; ++i) {
      const double theta = static_cast<double>(pos) * t->inv_freq[i];
      c[i] = static_cast<float>(std::cos(theta));
      c[half + i] = static_cast<float>(std::sin(theta));
    }
    t->pos[slot] = pos;
  }
  return {c, c + half};
}

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

PrefetchLevel attention_prefetch_level() {
  static const PrefetchLevel level = [] {
    if (std::getenv("KV_PREFETCH_HINT")) return prefetch_level();
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_is("amd")) {
      unsigned a, b, c, d;
      if (__get_cpuid(1, &a, &b, &c, &d)) {
        const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
        if (family >= 0x1A) return PrefetchLevel::kT0;
      }
    }
#endif
    return prefetch_level();
  }();
  return level;
}

namespace {
bool gemv_default() {
  if (const char* e = std::getenv("KV_GEMV")) {
    if (std::strcmp(e, "one") == 0) return true;
    if (std::strcmp(e, "four") == 0) return false;
  }
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_is("amd") != 0;
#else
  return false;
#endif
}
std::atomic<int> g_gemv_one{-1};  // -1: not yet read
}  // namespace

bool gemv_one_stream() {
  int v = g_gemv_one.load(std::memory_order_relaxed);
  if (v < 0) {
    v = gemv_default() ? 1 : 0;
    g_gemv_one.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

void set_gemv_one_stream_for_testing(bool one) { g_gemv_one.store(one ? 1 : 0, std::memory_order_relaxed); }

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) { kernels().rms_norm(x, w, y, n, eps); }

void rope(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base, float freq_scale,
          RopeStyle style) {
  kernels().rope(x, n_head, head_dim, n_rot, pos, freq_base, freq_scale, style);
}

void silu_mul(const float* gate, const float* up, float* y, int64_t n) { kernels().silu_mul(gate, up, y, n); }

void gelu_mul(const float* gate, const float* up, float* y, int64_t n) { kernels().gelu_mul(gate, up, y, n); }

float softmax(float* x, int64_t n) { return kernels().softmax(x, n); }

void add_inplace(float* y, const float* x, int64_t n) { kernels().add_inplace(y, x, n); }

float max_value(const float* x, int64_t n) { return kernels().max_value(x, n); }

double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums) {
  return kernels().exp_scaled(x, n, mx, scale, block_sums);
}

int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass) {
  return kernels().collect_ge(x, n, t, idx, mass);
}

int64_t first_gt(const float* x, int64_t from, int64_t n, float t) { return kernels().first_gt(x, from, n, t); }

void key_score_pages(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd, float spread,
                     float* out) {
  kernels().key_score_pages(q, n_rows, n_heads, b, n, hd, spread, out);
}

}  // namespace kv
