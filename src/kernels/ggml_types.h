// Tensor element types as GGUF numbers them (ggml_type), and their block geometry.
// Knows nothing of models.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kv {

enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  BF16 = 30,
};

struct TypeTraits {
  std::string_view name;
  int64_t block_elems;   // elements per block (1 for plain types)
  int64_t block_bytes;   // bytes per block
  bool supported;        // kvserve can dequantize / compute with it
};

// Traits for a raw type number read from a file; known == false for numbers GGUF does not
// define (a hostile file). Never aborts.
bool type_traits(uint32_t raw_type, TypeTraits* out);
const char* type_name(GgmlType t);
int64_t type_block_elems(GgmlType t);
int64_t type_block_bytes(GgmlType t);
// Bytes of one row of n elements; n must be a multiple of the block size (checked by callers).
inline int64_t row_bytes(GgmlType t, int64_t n) {
  return n / type_block_elems(t) * type_block_bytes(t);
}

}  // namespace kv
