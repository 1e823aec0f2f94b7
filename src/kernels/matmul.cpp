// Packing, ISA dispatch, threading, the scalar kernels and the exact reference of matmul.
//
// The scalar kernels here follow the fast kernels' arithmetic step for step (same integer
// sums, same float operations in the same order), so every ISA gives bit-identical output;
// the unit tests check that.
#include "kernels/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kernels/quant.h"

namespace kv {

using namespace matmul_detail;

namespace {

// Exact half -> float (every half is a float); local so packing needs nothing else.
float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

bool cpu_has(Isa isa) {
#if defined(KV_SCALAR_ONLY) || !(defined(__x86_64__) || defined(__i386__))
  return isa == Isa::kScalar;
#else
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }
  return false;
#endif
}

struct Kernels {
  void (*quantize)(const float*, int64_t, int64_t, const QAct&);
  void (*q_gemm)(const QWeights&, const QAct&, int64_t, int64_t, int64_t, float*);
  float (*dot)(const float*, const float*, int64_t);
};

Kernels kernels_for(Isa isa) {
#ifndef KV_SCALAR_ONLY
  if (isa == Isa::kAvx512) return {quantize_rows_avx512, q_gemm_avx512, dot_f32_avx512};
  if (isa == Isa::kAvx2) return {quantize_rows_avx2, q_gemm_avx2, dot_f32_avx2};
#endif
  (void)isa;
  return {quantize_rows_scalar, q_gemm_scalar, dot_f32_scalar};
}

bool quant_fmt(GgmlType t, QFmt* f) {
  switch (t) {
    case GgmlType::Q4_0: *f = QFmt::kQ4_0; return true;
    case GgmlType::Q4_1: *f = QFmt::kQ4_1; return true;
    case GgmlType::Q8_0: *f = QFmt::kQ8_0; return true;
    default: return false;
  }
}

// Writes the 16-output records of one group. rows[c] is output c's raw blocks, or null for
// padding (all-zero record: d = 0, so it contributes exactly 0).
void pack_group(QFmt f, const uint8_t* const rows[kGroup], int64_t nb, uint8_t* dst) {
  const int64_t rec = record_bytes(f), qoff = quant_offset(f);
  const int64_t raw = f == QFmt::kQ4_1 ? 20 : f == QFmt::kQ4_0 ? 18 : 34;
  const int raw_qoff = f == QFmt::kQ4_1 ? 4 : 2;
  const int n_vec = f == QFmt::kQ8_0 ? 8 : 4;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* r = dst + b * rec;
    std::memset(r, 0, static_cast<size_t>(rec));
    for (int c = 0; c < kGroup; ++c) {
      if (!rows[c]) continue;
      const uint8_t* blk = rows[c] + b * raw;
      std::memcpy(r + 2 * c, blk, 2);                                // d
      if (f == QFmt::kQ4_1) std::memcpy(r + 32 + 2 * c, blk + 2, 2);  // m
      for (int j = 0; j < n_vec; ++j)
        for (int t = 0; t < 4; ++t) {
          uint8_t q = blk[raw_qoff + 4 * j + t];
          r[qoff + 64 * j + 4 * c + t] = f == QFmt::kQ8_0 ? static_cast<uint8_t>(q ^ 0x80) : q;
        }
    }
  }
}

// Per-call activation scratch, grown only when a call needs more (no allocation on the
// steady-state path). One per thread: the calling thread's is shared by the whole pool when
// rows are split between threads; small calls use each worker's own.
struct ActScratch {
  std::vector<uint8_t, AlignedAllocator<uint8_t>> buf;
  QAct view(int64_t n_rows, int64_t n_in, bool two) {
    const int64_t nb = n_in / kQK;
    auto up = [](int64_t v) { return (v + 63) & ~int64_t{63}; };
    const int64_t q_bytes = up(n_rows * n_in), f_bytes = up(n_rows * nb * 4);
    const size_t need = static_cast<size_t>(2 * q_bytes + 3 * f_bytes);
    if (buf.size() < need) buf.resize(need);
    uint8_t* p = buf.data();
    uint8_t* f = p + 2 * q_bytes;
    return QAct{reinterpret_cast<int8_t*>(p), reinterpret_cast<int8_t*>(p + q_bytes),
                reinterpret_cast<float*>(f), reinterpret_cast<float*>(f + f_bytes),
                reinterpret_cast<int32_t*>(f + 2 * f_bytes), n_in, nb, two};
  }
};

ActQuant initial_act_quant() {
  const char* e = std::getenv("KV_ACT_QUANT");
  return e && std::strcmp(e, "q8") == 0 ? ActQuant::kQ8 : ActQuant::kQ8x2;
}
ActQuant g_act_quant = initial_act_quant();
thread_local ActScratch tl_act;
thread_local std::vector<float> tl_row;  // kRawRows: one dequantized weight row

// Rows up to this count are quantized by every thread for itself: cheaper than a barrier.
constexpr int64_t kPrivateQuantRows = 2;

}  // namespace

Isa detect_isa() {
  Isa best = cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
  if (const char* e = std::getenv("KV_ISA")) {
    Isa want = best;
    if (std::strcmp(e, "scalar") == 0) want = Isa::kScalar;
    if (std::strcmp(e, "avx2") == 0) want = Isa::kAvx2;
    if (std::strcmp(e, "avx512") == 0) want = Isa::kAvx512;
    if (cpu_has(want)) best = want;
  }
  return best;
}

ActQuant act_quant() { return g_act_quant; }
void set_act_quant(ActQuant q) { g_act_quant = q; }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Result<PackedMatrix> PackedMatrix::pack(const std::vector<RawMatrix>& parts, Isa isa) {
  if (parts.empty()) return Result<PackedMatrix>::error("pack: no matrices given");
  if (!cpu_has(isa))
    return Result<PackedMatrix>::error(std::string("pack: this CPU cannot run ") + isa_name(isa));
  const GgmlType type = parts[0].type;
  const int64_t n_in = parts[0].n_in;
  int64_t n_out = 0;
  for (const RawMatrix& m : parts) {
    if (m.type != type)
      return Result<PackedMatrix>::error(std::string("pack: mixed types ") + type_name(type) +
                                         " and " + type_name(m.type));
    if (m.n_in != n_in)
      return Result<PackedMatrix>::error("pack: parts have different input widths");
    if (m.n_in <= 0 || m.n_out <= 0 || !m.data)
      return Result<PackedMatrix>::error("pack: empty matrix");
    n_out += m.n_out;
  }
  const int64_t be = type_block_elems(type);
  if (be <= 0 || n_in % be != 0)
    return Result<PackedMatrix>::error(std::string("pack: input width not a multiple of the ") +
                                       type_name(type) + " block");

  PackedMatrix p;
  p.type_ = type;
  p.n_in_ = n_in;
  p.n_out_ = n_out;
  p.isa_ = isa;
  // Row pointers of every output in order, across parts.
  const int64_t rb = row_bytes(type, n_in);
  std::vector<const uint8_t*> rows;
  rows.reserve(static_cast<size_t>(n_out));
  for (const RawMatrix& m : parts)
    for (int64_t i = 0; i < m.n_out; ++i) rows.push_back(static_cast<const uint8_t*>(m.data) + i * rb);

  QFmt f;
  if (quant_fmt(type, &f)) {
    p.layout_ = kInterleaved16;
    const int64_t nb = n_in / kQK, n_groups = (n_out + kGroup - 1) / kGroup;
    const int64_t group_bytes = nb * record_bytes(f);
    p.data_.resize(static_cast<size_t>(n_groups * group_bytes));
    for (int64_t g = 0; g < n_groups; ++g) {
      const uint8_t* grp[kGroup];
      for (int c = 0; c < kGroup; ++c) {
        int64_t o = g * kGroup + c;
        grp[c] = o < n_out ? rows[static_cast<size_t>(o)] : nullptr;
      }
      pack_group(f, grp, nb, p.data_.data() + g * group_bytes);
    }
  } else if (type == GgmlType::F32 || type == GgmlType::F16) {
    p.layout_ = kF32Rows;
    p.row_stride_ = (n_in + 15) / 16 * 16;
    p.data_.assign(static_cast<size_t>(n_out * p.row_stride_ * 4), 0);
    float* dst = reinterpret_cast<float*>(p.data_.data());
    for (int64_t o = 0; o < n_out; ++o) {
      const uint8_t* src = rows[static_cast<size_t>(o)];
      float* d = dst + o * p.row_stride_;
      if (type == GgmlType::F32) {
        std::memcpy(d, src, static_cast<size_t>(n_in * 4));
      } else {
        for (int64_t i = 0; i < n_in; ++i) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          d[i] = half_to_float(h);
        }
      }
    }
  } else if (type == GgmlType::Q4_K || type == GgmlType::Q6_K || type == GgmlType::BF16) {
    // TODO: repacked integer kernels for the K-quants; until then a row is dequantized per call.
    p.layout_ = kRawRows;
    p.row_stride_ = rb;
    p.data_.resize(static_cast<size_t>(n_out * rb));
    for (int64_t o = 0; o < n_out; ++o)
      std::memcpy(p.data_.data() + o * rb, rows[static_cast<size_t>(o)], static_cast<size_t>(rb));
  } else {
    return Result<PackedMatrix>::error(std::string("pack: no matmul for weight type ") +
                                       type_name(type));
  }
  return p;
}

void matmul(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, ThreadPool& pool) {
  if (n_rows <= 0) return;
  const Kernels k = kernels_for(w.isa_);
  const int64_t n_in = w.n_in_, n_out = w.n_out_;

  struct Job {
    const PackedMatrix* w;
    const float* x;
    int64_t n_rows;
    float* y;
    Kernels k;
    QAct shared;  // valid when rows are quantized cooperatively
    bool split_quant;
    bool two;  // two-level activations
    ThreadPool* pool;
  } job{&w, x, n_rows, y, k, {}, false, g_act_quant == ActQuant::kQ8x2, &pool};

  std::function<void(int, int)> fn;  // fits the small-buffer: the lambda holds one pointer
  const int nth_max = pool.size();
  int64_t n_units;  // units of output work split between threads

  if (w.layout_ == kInterleaved16) {
    n_units = (n_out + kGroup - 1) / kGroup;
    job.split_quant = n_rows > kPrivateQuantRows && nth_max > 1;
    if (job.split_quant) job.shared = tl_act.view(n_rows, n_in, job.two);
    fn = [p = &job](int ith, int nth) {
      const PackedMatrix& w = *p->w;
      QFmt f = QFmt::kQ4_1;
      quant_fmt(w.type_, &f);
      QAct a;
      if (p->split_quant && nth > 1) {
        a = p->shared;
        int64_t r0, r1;
        ThreadPool::split(p->n_rows, ith, nth, 1, &r0, &r1);
        if (r0 < r1) p->k.quantize(p->x, r0, r1, a);
        p->pool->barrier();
      } else {
        a = p->split_quant ? p->shared : tl_act.view(p->n_rows, w.n_in_, p->two);
        p->k.quantize(p->x, 0, p->n_rows, a);
      }
      const int64_t n_groups = (w.n_out_ + kGroup - 1) / kGroup;
      int64_t g0, g1;
      ThreadPool::split(n_groups, ith, nth, 1, &g0, &g1);
      if (g0 >= g1) return;
      QWeights qw{f, w.data_.data(), w.n_in_ / kQK, w.n_out_};
      p->k.q_gemm(qw, a, p->n_rows, g0, g1, p->y);
    };
  } else {
    n_units = n_out;
    fn = [p = &job](int ith, int nth) {
      const PackedMatrix& w = *p->w;
      int64_t c0, c1;
      ThreadPool::split(w.n_out_, ith, nth, 16, &c0, &c1);
      const int64_t n_in = w.n_in_, n_out = w.n_out_;
      for (int64_t c = c0; c < c1; ++c) {
        const float* row;
        if (w.layout_ == kF32Rows) {
          row = reinterpret_cast<const float*>(w.data_.data()) + c * w.row_stride_;
        } else {
          if (tl_row.size() < static_cast<size_t>(n_in)) tl_row.resize(static_cast<size_t>(n_in));
          if (!dequantize_row_ref(w.type_, w.data_.data() + c * w.row_stride_, tl_row.data(), n_in))
            std::fill(tl_row.begin(), tl_row.end(), std::numeric_limits<float>::quiet_NaN());
          row = tl_row.data();
        }
        for (int64_t r = 0; r < p->n_rows; ++r) p->y[r * n_out + c] = p->k.dot(p->x + r * n_in, row, n_in);
      }
    };
  }

  // Tiny matrices are not worth waking the pool.
  const double work = static_cast<double>(n_rows) * static_cast<double>(n_in) * static_cast<double>(n_out);
  if (nth_max == 1 || n_units < 2 || work < 32.0 * 1024) {
    job.split_quant = false;  // the caller quantizes every row into its own buffer
    fn(0, 1);
  } else {
    pool.run(fn);
  }
}

void matmul_ref(const RawMatrix& w, const float* x, int64_t n_rows, float* y) {
  std::vector<float> row(static_cast<size_t>(w.n_in));
  const int64_t rb = row_bytes(w.type, w.n_in);
  for (int64_t c = 0; c < w.n_out; ++c) {
    const uint8_t* src = static_cast<const uint8_t*>(w.data) + c * rb;
    bool ok = dequantize_row_ref(w.type, src, row.data(), w.n_in);
    for (int64_t r = 0; r < n_rows; ++r) {
      double acc = 0;
      const float* xr = x + r * w.n_in;
      for (int64_t i = 0; i < w.n_in; ++i) acc += static_cast<double>(xr[i]) * row[static_cast<size_t>(i)];
      y[r * w.n_out + c] = ok ? static_cast<float>(acc) : std::numeric_limits<float>::quiet_NaN();
    }
  }
}

// ---- scalar kernels (the specification the SIMD kernels reproduce bit for bit) ----

namespace matmul_detail {

void quantize_rows_scalar(const float* x, int64_t r0, int64_t r1, const QAct& a) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * a.n_in;
    for (int64_t b = 0; b < a.nb; ++b) {
      const float* xb = xr + b * kQK;
      float amax = 0;
      for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float id = amax > 0 ? 127.0f / amax : 0.0f;
      int8_t* q = a.q + r * a.n_in + b * kQK;
      int32_t sum = 0, sum2 = 0;
      for (int i = 0; i < kQK; ++i) {
        int v = static_cast<int>(std::nearbyint(xb[i] * id));
        q[i] = static_cast<int8_t>(v);
        sum += v;
      }
      if (a.two) {
        const float id2 = amax > 0 ? 32258.0f / amax : 0.0f;
        int8_t* q2 = a.q2 + r * a.n_in + b * kQK;
        for (int i = 0; i < kQK; ++i) {
          const float res = std::fma(-d, static_cast<float>(q[i]), xb[i]);
          int v = static_cast<int>(std::nearbyint(res * id2));
          v = std::min(127, std::max(-127, v));
          q2[i] = static_cast<int8_t>(v);
          sum2 += v;
        }
        sum = sum * kLevel2 + sum2;
      }
      a.d[r * a.nb + b] = a.two ? amax / 32258.0f : d;
      a.s[r * a.nb + b] = static_cast<float>(sum);
      a.s128[r * a.nb + b] = sum * 128;
    }
  }
}

void q_gemm_scalar(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                   float* y) {
  const int64_t rec = record_bytes(w.fmt), qoff = quant_offset(w.fmt);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = w.data + g * w.nb * rec;
    for (int64_t r = 0; r < n_rows; ++r) {
      float acc[kGroup] = {};
      const int8_t* xq = a.q + r * a.n_in;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* blk = grp + b * rec;
        const uint8_t* qs = blk + qoff;
        const int8_t* xb = xq + b * kQK;
        const int8_t* xb2 = a.two ? a.q2 + r * a.n_in + b * kQK : nullptr;
        const float dx = a.d[r * a.nb + b], sx = a.s[r * a.nb + b];
        for (int c = 0; c < kGroup; ++c) {
          // Σ u·q for one level.
          auto level = [&](const int8_t* xl) {
            int32_t is = 0;
            if (w.fmt == QFmt::kQ8_0) {
              for (int j = 0; j < 8; ++j)
                for (int t = 0; t < 4; ++t) is += qs[64 * j + 4 * c + t] * xl[4 * j + t];
            } else {
              for (int j = 0; j < 4; ++j)
                for (int t = 0; t < 4; ++t) {
                  const uint8_t u = qs[64 * j + 4 * c + t];
                  is += (u & 15) * xl[4 * j + t] + (u >> 4) * xl[16 + 4 * j + t];
                }
            }
            return is;
          };
          int32_t isum = level(xb);
          if (xb2) isum = isum * kLevel2 + level(xb2);
          if (w.fmt == QFmt::kQ8_0) isum -= a.s128[r * a.nb + b];
          uint16_t dh;
          std::memcpy(&dh, blk + 2 * c, 2);
          const float dw = half_to_float(dh);
          float t = dw * static_cast<float>(isum);
          if (w.fmt != QFmt::kQ8_0) {
            float mw;
            if (w.fmt == QFmt::kQ4_1) {
              uint16_t mh;
              std::memcpy(&mh, blk + 32 + 2 * c, 2);
              mw = half_to_float(mh);
            } else {
              mw = dw * -8.0f;
            }
            t = std::fma(mw, sx, t);
          }
          acc[c] = std::fma(t, dx, acc[c]);
        }
      }
      for (int c = 0; c < kGroup; ++c) {
        const int64_t o = g * kGroup + c;
        if (o < w.n_out) y[r * w.n_out + o] = acc[c];
      }
    }
  }
}

float dot_f32_scalar(const float* x, const float* w, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(x[i + l], w[i + l], acc[l]);
  for (int l = 0; i + l < n; ++l) acc[l] = std::fma(x[i + l], w[i + l], acc[l]);
  for (int s = 8; s >= 1; s /= 2)
    for (int l = 0; l < s; ++l) acc[l] = acc[l] + acc[l + s];
  return acc[0];
}

}  // namespace matmul_detail

}  // namespace kv
