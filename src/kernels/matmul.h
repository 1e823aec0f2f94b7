// Weight matrices prepared for fast multiplication, and the matmul that uses them.
//
// A weight is packed once at model load (repacked into the layout the micro-kernel wants,
// e.g. several output rows interleaved). Several same-type matrices with the same input
// width may be packed as one (Q, K and V; gate and up) so one pass over the activations
// serves them all. The packed matrix is immutable afterwards and shared by all threads.
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

#include "common/status.h"
#include "common/thread_pool.h"
#include "kernels/ggml_types.h"

namespace kv {

// A raw matrix as stored in GGUF: n_out rows of n_in elements of `type`.
struct RawMatrix {
  GgmlType type;
  const void* data;
  int64_t n_in;
  int64_t n_out;
};

// std::allocator gives only 16-byte alignment; packed weights want whole cache lines.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
};

enum class Isa { kScalar, kAvx2, kAvx512 };
Isa detect_isa();          // best ISA this CPU supports (KV_ISA=scalar|avx2|avx512 overrides)
const char* isa_name(Isa);

class PackedMatrix {
 public:
  // Packs parts (same type, same n_in) stacked along n_out. Errors for unsupported types or
  // mismatched parts. `isa` selects the kernel family the layout is made for.
  static Result<PackedMatrix> pack(const std::vector<RawMatrix>& parts, Isa isa);
  static Result<PackedMatrix> pack(const RawMatrix& m, Isa isa) { return pack(std::vector<RawMatrix>{m}, isa); }

  GgmlType type() const { return type_; }
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
  // Layouts (matmul_detail::Layout). kInterleaved16 (Q4_0, Q4_1, Q8_0): output rows in groups
  // of 16 (n_out padded with zero rows), group-major, then one record per 32-element block:
  //   f16 d[16] | (Q4_1 only) f16 m[16] | quants
  // where quants is an array of 64-byte vectors; byte 4*c+t of vector j holds, for output c of
  // the group, Q4: the raw qs[4j+t] (low nibble = element 4j+t, high = element 16+4j+t),
  // j = 0..3; Q8_0: raw qs[4j+t] + 128 as unsigned (element 4j+t), j = 0..7. One 64-byte load
  // is then 4 consecutive elements of 16 outputs: the operand vpdpbusd wants.
  // kF32Rows (F32, F16): rows of f32 padded to a multiple of 16 elements.
  // kRawRows (Q4_K, Q6_K, BF16): the GGUF bytes as they are; dequantized a row at a time.
  int layout_ = 0;
  int64_t row_stride_ = 0;  // kF32Rows: floats per padded row; kRawRows: bytes per row
  std::vector<uint8_t, AlignedAllocator<uint8_t>> data_;
  friend void matmul(const PackedMatrix&, const float*, int64_t, float*, ThreadPool&);
};

// Y[n_rows, n_out] = X[n_rows, n_in] · Wᵀ, parallel over pool. X and Y rows are contiguous;
// Y must not overlap X. Q4_0/Q4_1/Q8_0 weights: each X row is quantized per 32-block to two
// int8 levels (ActQuant::kQ8x2, the default; see QAct): x ≈ D·(254·q1 + q2), D = amax/32258,
// so |error| ≤ ~amax_b/64516 per element and Σ_blocks amax_b/64516 · Σ_b|w| per output
// (single-level kQ8: amax_b/254). The scalar, AVX2 and AVX-512 kernels give bit-identical Y.
// Threads split the outputs (whole groups of 16). Scratch is thread-local and only grows:
// no allocation once warm.
void matmul(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, ThreadPool& pool);

// How quantized matmuls quantize their activations. kQ8x2 (default): two 8-bit levels per
// element (~15-bit precision; a second vpdpbusd per weight vector). kQ8: one level (the
// llama.cpp-style q8 activations, ~0.4% of the block range per element): for comparison only.
// The initial mode comes from KV_ACT_QUANT=q8|q8x2; set_act_quant is for tests and
// benchmarks and must not race with running matmuls.
enum class ActQuant { kQ8, kQ8x2 };
ActQuant act_quant();
void set_act_quant(ActQuant);

// Scalar reference on the unpacked matrix: dequantize W with dequantize_row_ref and
// accumulate in double (no activation quantization: it is the exact answer).
void matmul_ref(const RawMatrix& w, const float* x, int64_t n_rows, float* y);

// Internals shared by matmul.cpp and the per-ISA kernel files; not for callers.
namespace matmul_detail {

enum Layout { kInterleaved16 = 1, kF32Rows = 2, kRawRows = 3 };
enum class QFmt { kQ4_0, kQ4_1, kQ8_0 };
constexpr int kGroup = 16;  // outputs interleaved per group
constexpr int kQK = 32;     // elements per quant block
// Bytes of one 16-output record of one 32-element block.
constexpr int64_t record_bytes(QFmt f) {
  return f == QFmt::kQ4_1 ? 64 + 256 : f == QFmt::kQ4_0 ? 32 + 256 : 32 + 512;
}
constexpr int64_t quant_offset(QFmt f) { return f == QFmt::kQ4_1 ? 64 : 32; }

// Activations quantized per 32-element block, with the float steps (identical in every ISA):
//   amax = max|x|, d = amax/127, id = amax > 0 ? 127/amax : 0
//   q1 = nearbyint(x·id)                                  (|q1| ≤ 127)
// two-level (kQ8x2) also:
//   id2 = amax > 0 ? 32258/amax : 0 (32258 = 127·254), r = fma(−d, q1, x)  (|r| ≲ d/2)
//   q2 = clamp(nearbyint(r·id2), −127, 127),  D = amax/32258 (≈ d/254)
// so x ≈ D·Q with the exact integer Q = 254·q1 + q2. Kernels form the integer block sum
// I = 254·Σ w·q1 + Σ w·q2 (exact in int32) and need one float scale per block:
//   two-level: d[] = D, s[] = float(S), S = 254·Σq1 + Σq2; single-level: d[] = d, S = Σq1, q2
//   unused. Rows are n_in bytes / nb entries apart.
struct QAct {
  int8_t* q;        // [n_rows, n_in] first level q1
  int8_t* q2;       // [n_rows, n_in] second level (two-level only)
  float* d;         // [n_rows, nb] block scale applied to the combined integer sum
  float* s;         // [n_rows, nb] S of the block, as float (Q4 min / offset term)
  int32_t* s128;    // [n_rows, nb] 128·S (Q8_0: removes the +128 weight offset)
  int64_t n_in, nb;
  bool two;         // two-level (kQ8x2)
};
constexpr int32_t kLevel2 = 254;  // weight of q1 relative to q2

// Weight side of a quantized matmul: the packed records of groups [0, n_groups).
struct QWeights {
  QFmt fmt;
  const uint8_t* data;
  int64_t nb;        // blocks per output row
  int64_t n_out;     // real outputs (the last group may be partial)
};

// Per-ISA kernels. Every one computes each output with the same sequence of float
// operations, so all ISAs give bit-identical results:
//   for each block b in order:
//     i = Σ u·q1 (single-level) or 254·Σ u·q1 + Σ u·q2 (two-level); exact int32
//         (Q8_0: minus s128). Bounds: Q4 |i| ≤ 255·15·127·32 < 2^24 (so float(i) is exact);
//         Q8_0 |i| ≤ 255·128·127·32 < 2^28.
//     Q4: t = fma(m_w, s_x, d_w * float(i));  Q8_0: t = d_w * float(i)
//     acc = fma(t, d_x, acc)
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

}  // namespace matmul_detail

}  // namespace kv
