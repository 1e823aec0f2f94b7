// KV tiles: the bytes of one (layer, page, KV head) for K or for V, in every element type a
// page can hold, and the conversions into and out of them. Knows nothing of pools or models.
//
// Layouts (bs = block size = token slots per page, hd = head_dim):
//   K is channel-major: [hd][bs] values, so one channel of a page is contiguous and the
//     attention kernel computes 16 keys' scores with one vector FMA per channel; per-channel
//     quantization (KIVI's keys) scales one contiguous run.
//   V is token-major: [bs][hd] values, so p_j · v_j is a vector FMA over channels; per-token
//     quantization (KIVI's values) scales one contiguous run.
//   f32 / f16 / bf16: the values only.
//   fp8_e4m3 / fp8_e5m2 (OCP 8-bit formats): 1 byte per value, then one f32 scale for the
//     tile (per page, per head).
//     V: value = decode(byte) · scale; scale = amax / max_finite.
//     K: then f16 zero[hd] (at byte bs·hd + 4): key = zero[d] + decode(byte) · scale, zero[d]
//     = channel d's midpoint (min + max) / 2 over the page's tokens (rounded to f16), scale =
//     max |key - zero| / max_finite over the tile. Real keys have a few channels with a large
//     constant offset; without the zero point fp8's relative error applies to the whole offset.
//   int8: uint8 q, then metadata as f16 pairs {scale, min}: value = min + scale · q.
//     K: one pair per channel (over the page's bs tokens). V: one pair per token per group of
//     kv_v_group() channels.
//   int4: 4-bit q, same metadata as int8.
//     K: [hd][bs/2] bytes; in each run of 16 tokens, byte i holds token i (low nibble) and
//     token i+8 (high nibble). V: [bs][hd/2] bytes; in each group of 32 channels, byte i holds
//     channel i (low) and channel i+16 (high).
// fp8 / int8 / int4 are "staged": while a page fills, its tile lives at f16 in a staging tile
// (same layout as an f16 tile) and is quantized once, when the page's last slot is written —
// KIVI's full-precision residual window at page granularity.
#pragma once
#include <cstdint>

namespace kv {

enum class KvElem : int32_t { kF32, kF16, kBF16, kFp8E4M3, kFp8E5M2, kInt8, kInt4 };
inline constexpr int kKvElemCount = 7;

const char* kv_elem_name(KvElem e);  // "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"
inline bool kv_elem_staged(KvElem e) { return e >= KvElem::kFp8E4M3; }
inline bool kv_elem_is_int(KvElem e) { return e == KvElem::kInt8 || e == KvElem::kInt4; }

// Channels per V scale group (int8: the whole head; int4: 32, or 16 when hd is not a multiple of 32).
int kv_v_group(KvElem e, int head_dim);
// nullptr when (e, block_size, head_dim) is a valid tile shape, else why not.
const char* kv_tile_shape_error(KvElem e, int block_size, int head_dim);
int64_t kv_k_tile_bytes(KvElem e, int block_size, int head_dim);
int64_t kv_v_tile_bytes(KvElem e, int block_size, int head_dim);
// An f16 staging tile (K or V): bs · hd · 2 bytes.
inline int64_t kv_stage_tile_bytes(int block_size, int head_dim) { return int64_t(block_size) * head_dim * 2; }

// Writes one token (hd floats) into slot `slot` of a K / V tile of type f32, f16 or bf16 (for
// staged types, write into the f16 staging tile with e = kF16).
void kv_write_k(uint8_t* tile, KvElem e, int block_size, int head_dim, int slot, const float* src);
void kv_write_v(uint8_t* tile, KvElem e, int block_size, int head_dim, int slot, const float* src);

// Quantizes a full f16 staging tile into a tile of staged type e.
void kv_quantize_k(const uint16_t* stage, KvElem e, int block_size, int head_dim, uint8_t* tile);
void kv_quantize_v(const uint16_t* stage, KvElem e, int block_size, int head_dim, uint8_t* tile);

// Reads the first n tokens of a tile of any type as floats, token-major [n][hd] for both K and
// V. The reference path of the attention kernels, the tests, and the un-quantizing of a page
// whose slots are rewritten.
void kv_read_k(const uint8_t* tile, KvElem e, int block_size, int head_dim, int n, float* out);
void kv_read_v(const uint8_t* tile, KvElem e, int block_size, int head_dim, int n, float* out);

// Scalar OCP fp8 conversions (round to nearest even, saturating to ±max finite).
uint8_t fp32_to_fp8_e4m3(float x);
uint8_t fp32_to_fp8_e5m2(float x);
float fp8_e4m3_to_fp32(uint8_t b);
float fp8_e5m2_to_fp32(uint8_t b);
inline constexpr float kFp8E4M3Max = 448.f;
inline constexpr float kFp8E5M2Max = 57344.f;

}  // namespace kv
