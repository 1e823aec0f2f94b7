// Packing, ISA dispatch, threading, the scalar kernels and the exact reference of matmul.
//
// The scalar kernels here follow the fast kernels' arithmetic step for step (same integer
// sums, same float operations in the same order), so every ISA gives bit-identical output;
// the unit tests check that.
#include "kernels/matmul.h"

#include <algorithm>
#include <atomic>
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
    case GgmlType::Q5_0: *f = QFmt::kQ5_0; return true;
    case GgmlType::Q4_K: *f = QFmt::kQ4_K; return true;
    case GgmlType::Q6_K: *f = QFmt::kQ6_K; return true;
    default: return false;
  }
}

// One 32-element block of one output row, decoded: the unsigned quants the kernels multiply
// and the scales the record keeps (which of them a format uses: see PackedMatrix).
struct DecodedBlock {
  uint8_t u[kQK];
  uint8_t d16[2], m16[2];  // f16 bits of d and (Q4_1) m, copied as they are
  float d32[2];            // Q4_K: d, m; Q6_K: da, db
};

// ggml's get_scale_min_k4 (as in quant_ref.cpp): 6-bit scale and min of Q4_K sub-block j.
void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Block b (elements 32b..32b+31) of a raw row of format f.
void decode_block(QFmt f, const uint8_t* row, int64_t b, DecodedBlock* out) {
  switch (f) {
    case QFmt::kQ4_0:
    case QFmt::kQ4_1:
    case QFmt::kQ5_0: {
      const uint8_t* blk = row + b * (f == QFmt::kQ4_0 ? 18 : f == QFmt::kQ4_1 ? 20 : 22);
      std::memcpy(out->d16, blk, 2);
      const uint8_t* qs = blk + (f == QFmt::kQ4_0 ? 2 : f == QFmt::kQ4_1 ? 4 : 6);
      if (f == QFmt::kQ4_1) std::memcpy(out->m16, blk + 2, 2);
      uint32_t qh = 0;
      if (f == QFmt::kQ5_0) std::memcpy(&qh, blk + 2, 4);
      for (int e = 0; e < 16; ++e) {
        out->u[e] = static_cast<uint8_t>((qs[e] & 15) | (((qh >> e) & 1) << 4));
        out->u[16 + e] = static_cast<uint8_t>((qs[e] >> 4) | (((qh >> (16 + e)) & 1) << 4));
      }
      break;
    }
    case QFmt::kQ8_0: {
      const uint8_t* blk = row + b * 34;
      std::memcpy(out->d16, blk, 2);
      for (int e = 0; e < kQK; ++e) out->u[e] = static_cast<uint8_t>(blk[2 + e] ^ 0x80);
      break;
    }
    case QFmt::kQ4_K: {
      const uint8_t* blk = row + (b / 8) * 144;
      const int sub = static_cast<int>(b % 8);
      uint16_t dh, mh;
      std::memcpy(&dh, blk, 2);
      std::memcpy(&mh, blk + 2, 2);
      int sc, m;
      scale_min_k4(sub, blk + 4, &sc, &m);
      // f16 (11 significant bits) times 6 bits: exact in f32, as in dequantize_row_ref.
      out->d32[0] = half_to_float(dh) * static_cast<float>(sc);
      out->d32[1] = -(half_to_float(mh) * static_cast<float>(m));
      // Sub-blocks 2k and 2k+1 are the low and high nibbles of the same 32 bytes.
      const uint8_t* qs = blk + 16 + 32 * (sub / 2);
      for (int e = 0; e < kQK; ++e) out->u[e] = sub % 2 ? qs[e] >> 4 : qs[e] & 15;
      break;
    }
    case QFmt::kQ6_K: {
      const uint8_t* blk = row + (b / 8) * 210;
      const int sub = static_cast<int>(b % 8);
      uint16_t dh;
      std::memcpy(&dh, blk + 208, 2);
      const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
      // f16 times int8: ≤ 19 significant bits, exact in f32.
      out->d32[0] = half_to_float(dh) * static_cast<float>(sc[2 * sub]);
      out->d32[1] = half_to_float(dh) * static_cast<float>(sc[2 * sub + 1]);
      // Element l + 32k of a 128-element half: nibble k/2 of ql[l + 32(k%2)], bits 2k of qh[l].
      const int half = sub / 4, k = sub % 4;
      const uint8_t* ql = blk + 64 * half;
      const uint8_t* qh = blk + 128 + 32 * half;
      for (int l = 0; l < kQK; ++l) {
        const uint8_t lo = ql[l + 32 * (k % 2)];
        out->u[l] = static_cast<uint8_t>((k < 2 ? lo & 15 : lo >> 4) | (((qh[l] >> (2 * k)) & 3) << 4));
      }
      break;
    }
  }
}

// Writes the 16-output records of one group. rows[c] is output c's raw row, or null for
// padding (all-zero record: zero scales, so it contributes exactly 0).
void pack_group(QFmt f, const uint8_t* const rows[kGroup], int64_t nb, uint8_t* dst) {
  const int64_t rec = record_bytes(f), qoff = quant_offset(f);
  const bool nibbles = f != QFmt::kQ8_0 && f != QFmt::kQ6_K;
  DecodedBlock blk;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* r = dst + b * rec;
    std::memset(r, 0, static_cast<size_t>(rec));
    for (int c = 0; c < kGroup; ++c) {
      if (!rows[c]) continue;
      decode_block(f, rows[c], b, &blk);
      if (f == QFmt::kQ4_K || f == QFmt::kQ6_K) {
        std::memcpy(r + 4 * c, &blk.d32[0], 4);
        std::memcpy(r + 64 + 4 * c, &blk.d32[1], 4);
      } else {
        std::memcpy(r + 2 * c, blk.d16, 2);
        if (f == QFmt::kQ4_1) std::memcpy(r + 32 + 2 * c, blk.m16, 2);
      }
      uint8_t* q = r + qoff;
      for (int j = 0; j < (nibbles ? 4 : 8); ++j)
        for (int t = 0; t < 4; ++t) {
          const int e = 4 * j + t, lane = 4 * c + t;
          if (!nibbles) {
            q[64 * j + lane] = blk.u[e];
            continue;
          }
          q[64 * j + lane] = static_cast<uint8_t>((blk.u[e] & 15) | (blk.u[16 + e] & 15) << 4);
          if (f == QFmt::kQ5_0) {
            uint64_t lo, hi;
            std::memcpy(&lo, r + 32 + 16 * j, 8);
            std::memcpy(&hi, r + 40 + 16 * j, 8);
            lo |= static_cast<uint64_t>(blk.u[e] >> 4) << lane;
            hi |= static_cast<uint64_t>(blk.u[16 + e] >> 4) << lane;
            std::memcpy(r + 32 + 16 * j, &lo, 8);
            std::memcpy(r + 40 + 16 * j, &hi, 8);
          }
        }
    }
  }
}

// Per-call activation scratch, grown only when a call needs more (no allocation on the
// steady-state path). One per thread: the calling thread's is shared by the whole pool when
// rows are split between threads; small calls use each worker's own.
struct ActScratch {
  HugeVector<uint8_t> buf;
  QAct view(int64_t n_rows, int64_t n_in, bool two) {
    const int64_t nb = n_in / kQK;
    auto up = [](int64_t v) { return (v + 63) & ~int64_t{63}; };
    const int64_t q_bytes = up(n_rows * n_in), f_bytes = up(n_rows * nb * 4);
    const size_t need = static_cast<size_t>(2 * q_bytes + 5 * f_bytes);  // s16: 2 per block
    if (buf.size() < need) buf.resize(need);
    uint8_t* p = buf.data();
    uint8_t* f = p + 2 * q_bytes;
    return QAct{reinterpret_cast<int8_t*>(p),         reinterpret_cast<int8_t*>(p + q_bytes),
                reinterpret_cast<float*>(f),          reinterpret_cast<float*>(f + f_bytes),
                reinterpret_cast<int32_t*>(f + 2 * f_bytes), reinterpret_cast<int32_t*>(f + 3 * f_bytes),
                n_in, nb, two};
  }
};

ActQuant initial_act_quant() {
  const char* e = std::getenv("KV_ACT_QUANT");
  return e && std::strcmp(e, "q8") == 0 ? ActQuant::kQ8 : ActQuant::kQ8x2;
}
ActQuant g_act_quant = initial_act_quant();
thread_local ActScratch tl_act;
thread_local std::vector<float> tl_row;  // kRawRows: one dequantized weight row
thread_local std::vector<float> tl_acc;  // q_gemm_scalar: [n_rows][kGroup] accumulators

// Rows up to this count are quantized by every thread for itself: cheaper than a barrier.
constexpr int64_t kPrivateQuantRows = 2;

}  // namespace

ActQuant act_quant() { return g_act_quant; }
void set_act_quant(ActQuant q) { g_act_quant = q; }

namespace {
// -1 until the first matmul asks (not at static initialisation: the CPU-feature queries must not
// run before libgcc's own constructor); then 0 or 1. Relaxed: every thread computes the same.
std::atomic<int> g_amx{-1};
}  // namespace

bool amx_enabled() {
  int v = g_amx.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("KV_AMX");
    v = !(e && std::strcmp(e, "0") == 0) && cpu_has_amx() ? 1 : 0;
    g_amx.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}
bool set_amx_for_testing(bool on) {
  g_amx.store(on && cpu_has_amx() ? 1 : 0, std::memory_order_relaxed);
  return amx_enabled();
}

Result<PackedMatrix> PackedMatrix::pack(const std::vector<RawMatrix>& parts, Isa isa) {
  using R = Result<PackedMatrix>;
  if (parts.empty()) return R::error("pack: no matrices given");
  if (!cpu_has(isa)) return R::error(std::string("pack: this CPU cannot run ") + isa_name(isa));
  const GgmlType type = parts[0].type;
  const int64_t n_in = parts[0].n_in;
  int64_t n_out = 0;
  bool mixed = false;
  QFmt f;
  for (const RawMatrix& m : parts) {
    if (m.n_in != n_in) return R::error("pack: parts have different input widths");
    if (m.n_in <= 0 || m.n_out <= 0 || !m.data) return R::error("pack: empty matrix");
    const int64_t be = type_block_elems(m.type);
    if (be <= 0 || n_in % be != 0)
      return R::error(std::string("pack: input width not a multiple of the ") + type_name(m.type) + " block");
    if (m.type != type) {
      mixed = true;
      // A group of the interleaved layout holds one type, so a change of type must start a group.
      if (!quant_fmt(type, &f) || !quant_fmt(m.type, &f))
        return R::error(std::string("pack: mixed types ") + type_name(type) + " and " + type_name(m.type) +
                        " (only quantized types mix)");
    }
    n_out += m.n_out;
  }
  if (mixed) {
    int64_t o = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      o += parts[i].n_out;
      if (parts[i + 1].type != parts[i].type && o % kGroup != 0)
        return R::error(std::string("pack: mixed types ") + type_name(parts[i].type) + " and " +
                        type_name(parts[i + 1].type) + " meet at output " + std::to_string(o) +
                        ", not a multiple of 16: pack them separately");
    }
  }

  PackedMatrix p;
  p.type_ = type;
  p.n_in_ = n_in;
  p.n_out_ = n_out;
  p.isa_ = isa;
  // Row pointers and types of every output in order, across parts.
  std::vector<const uint8_t*> rows;
  std::vector<GgmlType> row_types;
  rows.reserve(static_cast<size_t>(n_out));
  row_types.reserve(static_cast<size_t>(n_out));
  for (const RawMatrix& m : parts) {
    const int64_t rb = row_bytes(m.type, n_in);
    for (int64_t i = 0; i < m.n_out; ++i) {
      rows.push_back(static_cast<const uint8_t*>(m.data) + i * rb);
      row_types.push_back(m.type);
    }
  }

  if (quant_fmt(type, &f)) {
    p.layout_ = kInterleaved16;
    const int64_t nb = n_in / kQK, n_groups = (n_out + kGroup - 1) / kGroup;
    // Segments: runs of groups of one type (a group takes its first output's type).
    int64_t bytes = 0;
    for (int64_t g = 0; g < n_groups; ++g) {
      const GgmlType t = row_types[static_cast<size_t>(g * kGroup)];
      if (p.segments_.empty() || p.segments_.back().type != t) {
        bytes = (bytes + 63) & ~int64_t{63};
        p.segments_.push_back(Segment{t, g, g, bytes});
      }
      p.segments_.back().g1 = g + 1;
      quant_fmt(t, &f);
      bytes += nb * record_bytes(f);
    }
    p.data_.resize(static_cast<size_t>(bytes));
    for (const Segment& sg : p.segments_) {
      quant_fmt(sg.type, &f);
      const int64_t group_bytes = nb * record_bytes(f);
      for (int64_t g = sg.g0; g < sg.g1; ++g) {
        const uint8_t* grp[kGroup];
        for (int c = 0; c < kGroup; ++c) {
          const int64_t o = g * kGroup + c;
          grp[c] = o < n_out ? rows[static_cast<size_t>(o)] : nullptr;
        }
        pack_group(f, grp, nb, p.data_.data() + sg.offset + (g - sg.g0) * group_bytes);
      }
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
  } else if (type == GgmlType::BF16) {
    // No model we run stores BF16 matmul weights yet: a row is dequantized per call.
    const int64_t rb = row_bytes(type, n_in);
    p.layout_ = kRawRows;
    p.row_stride_ = rb;
    p.data_.resize(static_cast<size_t>(n_out * rb));
    for (int64_t o = 0; o < n_out; ++o)
      std::memcpy(p.data_.data() + o * rb, rows[static_cast<size_t>(o)], static_cast<size_t>(rb));
  } else {
    return R::error(std::string("pack: no matmul for weight type ") + type_name(type));
  }
  return p;
}

std::vector<GgmlType> PackedMatrix::segment_types() const {
  if (segments_.empty()) return {type_};
  std::vector<GgmlType> v;
  for (const Segment& s : segments_) v.push_back(s.type);
  return v;
}

namespace {
// Groups [g0, g1) of a kInterleaved16 matrix (segments segs of its packed data) against the
// quantized rows a.
template <class Segments>
void gemm_groups(const Segments& segs, const uint8_t* data, int64_t n_in, int64_t n_out, const Kernels& k, const QAct& a,
                 int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  for (const auto& sg : segs) {
    const int64_t s0 = std::max(g0, sg.g0), s1 = std::min(g1, sg.g1);
    if (s0 >= s1) continue;
    QFmt f = QFmt::kQ4_1;
    quant_fmt(sg.type, &f);
    QWeights qw{f, data + sg.offset, sg.g0, n_in / kQK, n_out};
    k.q_gemm(qw, a, n_rows, s0, s1, y);
  }
}
// Chunks of about 1/16 of a thread's share: fine enough to even out the tail, coarse enough
// that a thread streams long contiguous runs of weights.
int64_t share_chunk(int64_t n_units, int nth) { return std::max<int64_t>(1, n_units / (16 * nth)); }
// Up to this many rows (decode batches) each thread takes exactly its share (ThreadPool::split);
// more rows (prefill) take their shares in chunks with stealing at the tail. A steal, and the
// owner's next chunk after it, each move a cache line between the cores: ~0.25–0.5 µs when
// they sit in different core complexes, a large part of a decode matmul of a few µs a thread,
// nothing beside a prefill matmul's milliseconds (docs/ARCHITECTURE.md, Matmul).
constexpr int64_t kStaticSplitRows = 64;
}  // namespace

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
    bool s16;  // a Q6_K segment needs the per-16 activation sums
    bool steal;  // the threads' shares with stealing at the tail (ThreadPool::deal / next)
    ThreadPool* pool;
  } job{&w, x, n_rows, y, k, {}, false, g_act_quant == ActQuant::kQ8x2, false, n_rows > kStaticSplitRows, &pool};

  std::function<void(int, int)> fn;  // fits the small-buffer: the lambda holds one pointer
  const int nth_max = pool.size();
  int64_t n_units;  // units of output work split between threads

  if (w.layout_ == kInterleaved16) {
    n_units = (n_out + kGroup - 1) / kGroup;
    for (const PackedMatrix::Segment& sg : w.segments_) job.s16 |= sg.type == GgmlType::Q6_K;
    job.split_quant = n_rows > kPrivateQuantRows && nth_max > 1;
    if (job.split_quant) job.shared = tl_act.view(n_rows, n_in, job.two);
    fn = [p = &job](int ith, int nth) {
      const PackedMatrix& w = *p->w;
      auto quantize = [p](int64_t r0, int64_t r1, const QAct& a) {
        p->k.quantize(p->x, r0, r1, a);
        if (p->s16) sum16_rows(r0, r1, a);
      };
      QAct a;
      if (p->split_quant && nth > 1) {
        a = p->shared;
        int64_t r0, r1;
        ThreadPool::split(p->n_rows, ith, nth, 1, &r0, &r1);
        if (r0 < r1) quantize(r0, r1, a);
        p->pool->barrier();
      } else {
        a = p->split_quant ? p->shared : tl_act.view(p->n_rows, w.n_in_, p->two);
        quantize(0, p->n_rows, a);
      }
      if (nth == 1) return gemm_groups(w.segments_, w.data_.data(), w.n_in_, w.n_out_, p->k, a, p->n_rows, 0, (w.n_out_ + kGroup - 1) / kGroup, p->y);
      int64_t g0, g1;
      if (!p->steal) {
        ThreadPool::split((w.n_out_ + kGroup - 1) / kGroup, ith, nth, 1, &g0, &g1);
        if (g0 < g1) gemm_groups(w.segments_, w.data_.data(), w.n_in_, w.n_out_, p->k, a, p->n_rows, g0, g1, p->y);
        return;
      }
      // Each thread's half (pool.deal below), in chunks, then what is left of the other's.
      while (p->pool->next(ith, &g0, &g1)) gemm_groups(w.segments_, w.data_.data(), w.n_in_, w.n_out_, p->k, a, p->n_rows, g0, g1, p->y);
    };
  } else {
    n_units = n_out;
    fn = [p = &job](int ith, int nth) { matmul_share(*p->w, p->x, p->n_rows, p->y, ith, nth); };
  }

  // Tiny matrices are not worth waking the pool.
  const double work = static_cast<double>(n_rows) * static_cast<double>(n_in) * static_cast<double>(n_out);
  if (nth_max == 1 || n_units < 2 || work < 32.0 * 1024) {
    job.split_quant = false;  // the caller quantizes every row into its own buffer
    fn(0, 1);
  } else {
    if (w.layout_ == kInterleaved16 && job.steal) pool.deal(n_units, share_chunk(n_units, nth_max));
    pool.run(fn);
  }
}

void matmul_share(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, int ith, int nth) {
  if (n_rows <= 0) return;
  const Kernels k = kernels_for(w.isa_);
  if (w.layout_ != kInterleaved16) {  // f32 or raw rows: a static split of the outputs
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
      for (int64_t r = 0; r < n_rows; ++r) y[r * n_out + c] = k.dot(x + r * n_in, row, n_in);
    }
    return;
  }
  bool s16 = false;
  for (const PackedMatrix::Segment& sg : w.segments_) s16 |= sg.type == GgmlType::Q6_K;
  const QAct a = tl_act.view(n_rows, w.n_in_, g_act_quant == ActQuant::kQ8x2);
  k.quantize(x, 0, n_rows, a);
  if (s16) sum16_rows(0, n_rows, a);
  // Exactly this thread's share, as matmul for few rows (kStaticSplitRows).
  int64_t g0, g1;
  ThreadPool::split((w.n_out_ + kGroup - 1) / kGroup, ith, nth, 1, &g0, &g1);
  if (g0 < g1) gemm_groups(w.segments_, w.data_.data(), w.n_in_, w.n_out_, k, a, n_rows, g0, g1, y);
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

void sum16_rows(int64_t r0, int64_t r1, const QAct& a) {
  const int64_t n16 = a.n_in / 16;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t k = 0; k < n16; ++k) {
      const int8_t* q = a.q + r * a.n_in + 16 * k;
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += q[i];
      if (a.two) {
        const int8_t* q2 = a.q2 + r * a.n_in + 16 * k;
        int32_t s2 = 0;
        for (int i = 0; i < 16; ++i) s2 += q2[i];
        s = s * kLevel2 + s2;
      }
      a.s16[r * n16 + k] = s;
    }
}

void q_gemm_scalar(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                   float* y) {
  const QFmt f = w.fmt;
  const int64_t rec = record_bytes(f), qoff = quant_offset(f);
  const bool f32_scales = f == QFmt::kQ4_K || f == QFmt::kQ6_K;
  // u of element e (0..31) of output c in the record at blk: the value the kernels multiply.
  auto weight = [f, qoff](const uint8_t* blk, int c, int e) -> int32_t {
    const uint8_t* qs = blk + qoff;
    if (f == QFmt::kQ8_0 || f == QFmt::kQ6_K) return qs[64 * (e / 4) + 4 * c + e % 4];
    const int j = (e % 16) / 4, lane = 4 * c + e % 4;
    const uint8_t byte = qs[64 * j + lane];
    int32_t u = e < 16 ? byte & 15 : byte >> 4;
    if (f == QFmt::kQ5_0) {
      uint64_t bits;
      std::memcpy(&bits, blk + 32 + 16 * j + (e < 16 ? 0 : 8), 8);
      u |= static_cast<int32_t>((bits >> lane) & 1) << 4;
    }
    return u;
  };
  auto f16_at = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
  };
  auto f32_at = [](const uint8_t* p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  };
  if (tl_acc.size() < static_cast<size_t>(n_rows * kGroup)) tl_acc.resize(static_cast<size_t>(n_rows * kGroup));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = w.data + (g - w.g_base) * w.nb * rec;
    float* acc = tl_acc.data();  // [n_rows][kGroup]
    std::fill(acc, acc + n_rows * kGroup, 0.0f);
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* blk = grp + b * rec;
      int32_t u[kGroup][kQK];
      for (int c = 0; c < kGroup; ++c)
        for (int e = 0; e < kQK; ++e) u[c][e] = weight(blk, c, e);
      for (int64_t r = 0; r < n_rows; ++r) {
        const int8_t* xb = a.q + r * a.n_in + b * kQK;
        const int8_t* xb2 = a.two ? a.q2 + r * a.n_in + b * kQK : nullptr;
        const float dx = a.d[r * a.nb + b], sx = a.s[r * a.nb + b];
        const int32_t s128 = a.s128[r * a.nb + b];
        for (int c = 0; c < kGroup; ++c) {
          // Σ u·X over elements [e0, e1): exact integers.
          auto isum = [&](int e0, int e1) {
            int32_t i1 = 0, i2 = 0;
            for (int e = e0; e < e1; ++e) i1 += u[c][e] * xb[e];
            if (!xb2) return i1;
            for (int e = e0; e < e1; ++e) i2 += u[c][e] * xb2[e];
            return i1 * kLevel2 + i2;
          };
          const float dw = f32_scales ? f32_at(blk + 4 * c) : f16_at(blk + 2 * c);
          float t;
          if (f == QFmt::kQ6_K) {
            const int32_t* s16 = a.s16 + r * (a.n_in / 16) + 2 * b;
            const int32_t ia = isum(0, 16) - 32 * s16[0], ib = isum(16, 32) - 32 * s16[1];
            t = std::fma(f32_at(blk + 64 + 4 * c), static_cast<float>(ib), dw * static_cast<float>(ia));
          } else {
            int32_t i = isum(0, kQK);
            if (f == QFmt::kQ8_0) i -= s128;
            if (f == QFmt::kQ5_0) i -= s128 / 8;  // 16·S
            t = dw * static_cast<float>(i);
            if (f == QFmt::kQ4_0) t = std::fma(dw * -8.0f, sx, t);
            if (f == QFmt::kQ4_1) t = std::fma(f16_at(blk + 32 + 2 * c), sx, t);
            if (f == QFmt::kQ4_K) t = std::fma(f32_at(blk + 64 + 4 * c), sx, t);
          }
          acc[r * kGroup + c] = std::fma(t, dx, acc[r * kGroup + c]);
        }
      }
    }
    for (int64_t r = 0; r < n_rows; ++r)
      for (int c = 0; c < kGroup; ++c) {
        const int64_t o = g * kGroup + c;
        if (o < w.n_out) y[r * w.n_out + o] = acc[r * kGroup + c];
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
