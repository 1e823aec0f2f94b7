// Weight matrices prepared for fast multiplication, and the matmul that uses them.
//
// A weight is packed once at model load (repacked into the layout the micro-kernel wants,
// e.g. several output rows interleaved). Several matrices with the same input width may be
// packed as one (Q, K and V; gate and up) so one pass over the activations serves them all;
// quantized parts may even differ in type (see pack). The packed matrix is immutable
// afterwards and shared by all threads.
//
// matmul computes Y[n_rows, n_out] = X[n_rows, n_in] · Wᵀ. Quantized weights multiply
// against activations quantized once per call to 8-bit blocks (integer dot products, block
// scales applied in float). Batch invariance: row r of Y is bit-identical whatever n_rows
// is and whichever thread computes it (each output is reduced in the same fixed order).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common/huge_alloc.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "kernels/ggml_types.h"
#include "kernels/isa.h"

namespace kv {

// A raw matrix as stored in GGUF: n_out rows of n_in elements of `type`.
struct RawMatrix {
  GgmlType type;
  const void* data;
  int64_t n_in;
  int64_t n_out;
};

class PackedMatrix {
 public:
  // Packs parts (same n_in) stacked along n_out. Errors for unsupported types or mismatched
  // parts. Parts usually share one type. Quantized parts (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
  // may mix types if every change of type falls on a multiple of 16 outputs (a group of the
  // interleaved layout holds one type); otherwise pack them separately. `isa` selects the
  // kernel family the layout is made for.
  static Result<PackedMatrix> pack(const std::vector<RawMatrix>& parts, Isa isa);
  static Result<PackedMatrix> pack(const RawMatrix& m, Isa isa) { return pack(std::vector<RawMatrix>{m}, isa); }

  // The first part's type (with mixed parts, see segment_types).
  GgmlType type() const { return type_; }
  // One type per run of outputs of one type, in output order (one entry unless mixed).
  std::vector<GgmlType> segment_types() const;
  int64_t n_in() const { return n_in_; }
  int64_t n_out() const { return n_out_; }
  Isa isa() const { return isa_; }
  // Bytes a full pass over this matrix reads (for effective-bandwidth reporting).
  int64_t bytes() const { return static_cast<int64_t>(data_.size()); }
  const uint8_t* data() const { return data_.data(); }

 private:
  GgmlType type_ = GgmlType::F32;
  int64_t n_in_ = 0, n_out_ = 0;
  Isa isa_ = Isa::kScalar;
  // Layouts (matmul_detail::Layout).
  // kInterleaved16 (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K): output rows in groups of 16 (n_out
  // padded with zero rows), group-major, then one record per 32-element block. Every record
  // starts with per-output scales, then quants: an array of 64-byte vectors where byte 4*c+t
  // of vector j belongs to output c of the group, so one 64-byte load is 4 consecutive
  // elements of 16 outputs: the operand vpdpbusd wants. Per 32-element block (e = 0..31):
  //   Q4_0:  f16 d[16] | Q4 nibbles                                    w = d·(q − 8)
  //   Q4_1:  f16 d[16] | f16 m[16] | Q4 nibbles                       w = d·q + m
  //   Q8_0:  f16 d[16] | 8 vectors, byte = qs[4j+t] + 128 (unsigned)   w = d·qs
  //   Q5_0:  f16 d[16] | u64 hbit[4][2] | Q4 nibbles (the low 4 bits)  w = d·(q − 16)
  //          bit 4c+t of hbit[j][0] / hbit[j][1]: bit 4 of element 4j+t / 16+4j+t
  //   Q4_K:  f32 d[16] | f32 m[16] | Q4 nibbles                       w = d·q + m
  //          d = d_super·sc, m = −dmin·m_sub of the block's sub-block (both exact in f32)
  //   Q6_K:  f32 da[16] | f32 db[16] | 8 vectors, byte = q (0..63)     w = d·(q − 32)
  //          da / db = d_super·sc of elements 0-15 / 16-31 (exact in f32)
  // where "Q4 nibbles" are 4 vectors, byte = element 4j+t (low nibble) | element 16+4j+t
  // (high nibble). Every conversion is lossless: the packed w equals the GGUF value.
  // Runs of groups of one type are segments; each starts on a 64-byte boundary.
  // kF32Rows (F32, F16): rows of f32 padded to a multiple of 16 elements.
  // kRawRows (BF16): the GGUF bytes as they are; dequantized a row at a time.
  struct Segment {
    GgmlType type;
    int64_t g0, g1;  // groups [g0, g1)
    int64_t offset;  // bytes into data_ of group g0
  };
  int layout_ = 0;
  int64_t row_stride_ = 0;  // kF32Rows: floats per padded row; kRawRows: bytes per row
  std::vector<Segment> segments_;  // kInterleaved16
  HugeVector<uint8_t> data_;  // cache-line aligned, huge pages (decode streams every weight once per token)
  friend void matmul(const PackedMatrix&, const float*, int64_t, float*, ThreadPool&);
  friend void matmul_share(const PackedMatrix&, const float*, int64_t, float*, int, int);
};

// Y[n_rows, n_out] = X[n_rows, n_in] · Wᵀ, parallel over pool. X and Y rows are contiguous;
// Y must not overlap X. Quantized weights: each X row is quantized per 32-block to two
// int8 levels (ActQuant::kQ8x2, the default; see QAct): x ≈ D·(254·q1 + q2), D = amax/32258,
// so |error| ≤ ~amax_b/64516 per element and Σ_blocks amax_b/64516 · Σ_b|w| per output
// (single-level kQ8: amax_b/254). The scalar, AVX2 and AVX-512 kernels give bit-identical Y.
// Threads split the outputs (whole groups of 16). Scratch is thread-local and only grows:
// no allocation once warm.
void matmul(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, ThreadPool& pool);
// Rows a quantized GEMM tile multiplies per pass over a weight strip (the AVX-512 and AVX2
// kernels' Q4 tiles): a step of 5 rows costs about what 8 do (SmolLM2 at batch 4 → 5 on the
// Zen 5 VM: 2.55 → 3.41 ms a step), so the engine fills a tile with drafts it is unsure of
// rather than start one.
inline constexpr int kMatmulRowTile = 4;
// matmul from inside a ThreadPool::run: every thread of the run calls it with the same
// arguments and computes exactly its share of the outputs (ThreadPool::split of the output
// groups; no stealing, see kStaticSplitRows). Each thread quantizes all n_rows rows itself
// (meant for a few rows). Y is complete only after a barrier; a barrier must also separate
// two calls. Bit-identical to matmul.
void matmul_share(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, int ith, int nth);

// How quantized matmuls quantize their activations. kQ8x2 (default): two 8-bit levels per
// element (~15-bit precision; a second vpdpbusd per weight vector). kQ8: one level (the
// llama.cpp-style q8 activations, ~0.4% of the block range per element): for comparison only.
// The initial mode comes from KV_ACT_QUANT=q8|q8x2; set_act_quant is for tests and
// benchmarks and must not race with running matmuls.
enum class ActQuant { kQ8, kQ8x2 };
ActQuant act_quant();
void set_act_quant(ActQuant);

// Whether AVX-512 matmuls of at least kAmxMinRows rows run on Intel AMX tiles
// (matmul_amx_avx512.cpp): cpu_has_amx() and not KV_AMX=0. Bit-identical to the VNNI kernel.
bool amx_enabled();
// Tests and benchmarks: turn the AMX path off (false) or back on where the CPU has it; returns
// whether it is now on. Must not race with running matmuls.
bool set_amx_for_testing(bool on);

// Scalar reference on the unpacked matrix: dequantize W with dequantize_row_ref and
// accumulate in double (no activation quantization: it is the exact answer).
void matmul_ref(const RawMatrix& w, const float* x, int64_t n_rows, float* y);

// Internals shared by matmul.cpp and the per-ISA kernel files; not for callers.
namespace matmul_detail {

enum Layout { kInterleaved16 = 1, kF32Rows = 2, kRawRows = 3 };
enum class QFmt { kQ4_0, kQ4_1, kQ8_0, kQ5_0, kQ4_K, kQ6_K };
constexpr int kGroup = 16;  // outputs interleaved per group
constexpr int kQK = 32;     // elements per quant block
// Bytes of one 16-output record of one 32-element block, and where its quants start.
constexpr int64_t quant_offset(QFmt f) {
  switch (f) {
    case QFmt::kQ4_0: case QFmt::kQ8_0: return 32;
    case QFmt::kQ4_1: return 64;
    case QFmt::kQ5_0: return 96;
    case QFmt::kQ4_K: case QFmt::kQ6_K: return 128;
  }
  return 0;
}
constexpr int64_t record_bytes(QFmt f) {
  return quant_offset(f) + (f == QFmt::kQ8_0 || f == QFmt::kQ6_K ? 512 : 256);
}

// Activations quantized per 32-element block, with the float steps (identical in every ISA):
//   amax = max|x|, d = amax/127, id = amax > 0 ? 127/amax : 0
//   q1 = nearbyint(x·id)                                  (|q1| ≤ 127)
// two-level (kQ8x2) also:
//   id2 = amax > 0 ? 32258/amax : 0 (32258 = 127·254), r = fma(−d, q1, x)  (|r| ≲ d/2)
//   q2 = clamp(nearbyint(r·id2), −127, 127),  D = amax/32258 (≈ d/254)
// so x ≈ D·Q with the exact integer Q = 254·q1 + q2 (|Q| ≤ 32385). Kernels form the integer
// block sum I = 254·Σ w·q1 + Σ w·q2 (exact in int32) and need one float scale per block:
//   two-level: d[] = D, s[] = float(S), S = 254·Σq1 + Σq2; single-level: d[] = d, S = Σq1, q2
//   unused. Rows are n_in bytes / nb entries apart.
struct QAct {
  int8_t* q;        // [n_rows, n_in] first level q1
  int8_t* q2;       // [n_rows, n_in] second level (two-level only)
  float* d;         // [n_rows, nb] block scale applied to the combined integer sum
  float* s;         // [n_rows, nb] S of the block, as float (Q4 min / offset term)
  int32_t* s128;    // [n_rows, nb] 128·S (Q8_0: removes the +128 weight offset; Q5_0: /8)
  int32_t* s16;     // [n_rows, n_in/16] S of each 16 elements (Q6_K, whose scales are per 16;
                    // filled by sum16_rows only when a Q6_K segment needs it)
  int64_t n_in, nb;
  bool two;         // two-level (kQ8x2)
};
constexpr int32_t kLevel2 = 254;  // weight of q1 relative to q2

// Weight side of a quantized matmul: the packed records of groups [g_base, ...) of one format.
struct QWeights {
  QFmt fmt;
  const uint8_t* data;  // records of group g_base
  int64_t g_base;
  int64_t nb;           // blocks per output row
  int64_t n_out;        // real outputs of the whole matrix (the last group may be partial);
                        // also the row stride of y
};

// Fills a.s16 for rows [r0, r1) from a.q (and a.q2): integer, so the same in every ISA.
void sum16_rows(int64_t r0, int64_t r1, const QAct& a);

// Per-ISA kernels. Every one computes each output with the same sequence of float
// operations, so all ISAs give bit-identical results. For each block b in order, with
// u the stored (unsigned) weight value, X = q1 (single-level) or 254·q1 + q2 (two-level):
//   Q4_0, Q4_1, Q4_K:  i = Σ u·X                   t = fma(m_w, s_x, d_w·float(i))
//                      (Q4_0: m_w = −8·d_w)        |i| ≤ 15·32385·32 < 2^24: float(i) exact
//   Q8_0:              i = Σ u·X − 128·S           t = d_w·float(i)     (|i| < 2^28)
//   Q5_0:              i = Σ u·X − 16·S            t = d_w·float(i)     (|i| ≤ 16·32385·32 < 2^24)
//   Q6_K:              i_a = Σ_{e<16} u·X − 32·S16_a,  i_b = Σ_{e≥16} u·X − 32·S16_b
//                      t = fma(db_w, float(i_b), da_w·float(i_a))  (|i_a|, |i_b| ≤ 32·32385·16 < 2^24)
//   acc = fma(t, d_x, acc)
// All integer sums are exact in int32, so how a kernel splits them is free.
// quantize_rows: rows [r0, r1) of x [*, n_in] into a.
// q_gemm: y[r, c] for rows [0, n_rows), outputs of groups [g0, g1).
void quantize_rows_scalar(const float* x, int64_t r0, int64_t r1, const QAct& a);
void q_gemm_scalar(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                   float* y);
// 16-lane fused-multiply-add dot over n elements, reduced by the tree 8,4,2,1.
float dot_f32_scalar(const float* x, const float* w, int64_t n);
void quantize_rows_avx512(const float* x, int64_t r0, int64_t r1, const QAct& a);
void q_gemm_avx512(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                   float* y);
float dot_f32_avx512(const float* x, const float* w, int64_t n);
void quantize_rows_avx2(const float* x, int64_t r0, int64_t r1, const QAct& a);
void q_gemm_avx2(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1,
                 float* y);
float dot_f32_avx2(const float* x, const float* w, int64_t n);
// AMX tiles for batches (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K; false for Q6_K, which stays on VNNI).
// Called by q_gemm_avx512 when amx_enabled(), for batches of at least kAmxMinRows rows: their
// whole 16-row tiles, and the remainder too when it has at least kAmxMinTailRows rows (a tile
// pass costs about the same for 4 rows as for 16; fewer rows run on VNNI).
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxMinTailRows = 12;
bool q_gemm_amx(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y);

}  // namespace matmul_detail

}  // namespace kv
