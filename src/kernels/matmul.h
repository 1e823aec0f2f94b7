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
#include <cstdint>
#include <memory>
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
  int layout_ = 0;                 // kernel-defined
  std::vector<uint8_t> data_;      // 64-byte aligned start is guaranteed by the allocator used
  friend void matmul(const PackedMatrix&, const float*, int64_t, float*, ThreadPool&);
};

// Y[n_rows, n_out] = X[n_rows, n_in] · Wᵀ, parallel over pool. X and Y rows are contiguous.
void matmul(const PackedMatrix& w, const float* x, int64_t n_rows, float* y, ThreadPool& pool);
// Scalar reference on the unpacked matrix: dequantize W with dequantize_row_ref and
// accumulate in double (no activation quantization: it is the exact answer).
void matmul_ref(const RawMatrix& w, const float* x, int64_t n_rows, float* y);

}  // namespace kv
