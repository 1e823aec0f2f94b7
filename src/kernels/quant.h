// Quantized block formats as GGUF lays them out, and their scalar reference dequantizers.
// These references are the ground truth every fast kernel is tested against; they are
// themselves tested against the `gguf` Python package on real tensors.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/ggml_types.h"

namespace kv {

// IEEE half <-> float, exact for every half value (round-to-nearest-even on the way down).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t fp32_to_bf16(float f);  // round-to-nearest-even, NaN preserved

// Block layouts (packed, little-endian, exactly as in the file).
#pragma pack(push, 1)
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };             // x = d * (q - 8)
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[16]; }; // x = d * q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };              // x = d * q
// Not a kvserve compute format, but gemma-3 Q4_K_M files store most attention/FFN weights in it,
// so the reference dequantizer reads it (q = low nibble | bit j of qh << 4).
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; }; // x = d * (q - 16)
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
#pragma pack(pop)
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ6_K) == 210);

// Dequantizes n elements (a multiple of the type's block size) of `type` from src into dst.
// Returns false (and writes nothing) for a type kvserve does not support.
bool dequantize_row_ref(GgmlType type, const void* src, float* dst, int64_t n);

// Reference quantizers (used by tests and by activation quantization references).
void quantize_row_q8_0_ref(const float* x, BlockQ8_0* y, int64_t n);
void quantize_row_q4_0_ref(const float* x, BlockQ4_0* y, int64_t n);
void quantize_row_q4_1_ref(const float* x, BlockQ4_1* y, int64_t n);

}  // namespace kv
