// The shape of one layer group's KV storage and the element types pages can hold.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/kv_tile.h"

namespace kv {

// The element type of a KV page (f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4); the tile
// formats are in kernels/kv_tile.h.
using KvDtype = KvElem;
const char* kv_dtype_name(KvDtype d);
// "auto" = f16. Names as in kv_elem_name(), plus "fp8" = fp8_e4m3 and the spellings fp16/float16/half,
// fp32/float32, bfloat16, fp8_e4m3fn/e4m3, e5m2, i8, i4 (any case). kv-size takes the same names.
Result<KvDtype> parse_kv_dtype(const std::string& s);
// Per-layer overrides, "0-1:f16,28-29:f16" (ranges or single layers, comma-separated), applied
// over `base` for n_layer layers. Overlaps: the later entry wins. Empty string: all `base`.
Result<std::vector<KvDtype>> parse_kv_dtype_layers(const std::string& spec, int32_t n_layer, KvDtype base);

// One layer group: n_layer layers that share page ids (a page id indexes every layer).
struct KvLayout {
  int32_t n_layer = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;  // token positions per page
  KvDtype dtype = KvDtype::kF16;
  std::vector<KvDtype> layer_dtypes;  // per layer; empty = every layer `dtype`
  // > 0: K tiles only (MLA). A token's cached row is the K row (latent ‖ rope key,
  // head_dim values); the values are its first v_from_k channels, read from the K tile, so no
  // V tile is stored (v_layer_page_bytes() = 0, no V staging).
  int32_t v_from_k = 0;

  KvDtype dtype_of(int32_t layer) const { return layer_dtypes.empty() ? dtype : layer_dtypes[layer]; }
  bool mixed() const;  // layers do not all share one dtype
  // Why this layout cannot hold pages (tile shape rules, layer_dtypes size), or ok.
  Status validate() const;

  // Bytes of one (layer, page) for K (or V): n_head_kv tiles, metadata included.
  int64_t k_layer_page_bytes(int32_t layer) const { return n_head_kv * kv_k_tile_bytes(dtype_of(layer), block_size, head_dim); }
  int64_t v_layer_page_bytes(int32_t layer) const {
    return v_from_k > 0 ? 0 : n_head_kv * kv_v_tile_bytes(dtype_of(layer), block_size, head_dim);
  }
  // Bytes of one page across all layers, K and V.
  int64_t page_bytes() const;
  // KV bytes per token of context (page bytes / block size; metadata included).
  double bytes_per_token() const { return double(page_bytes()) / block_size; }
  // Layers whose pages are quantized on fill (fp8 / int8 / int4) and so need staging.
  bool staged(int32_t layer) const { return kv_elem_staged(dtype_of(layer)); }
  // Bytes of one staging slot of one layer: K and V (K only when v_from_k) of every head at f16.
  int64_t stage_layer_bytes() const { return (v_from_k > 0 ? 1 : 2) * int64_t(n_head_kv) * kv_stage_tile_bytes(block_size, head_dim); }
  int32_t n_staged_layers() const;
  // "f16", or "int4 (f16: 0-1,28-29)" when layers differ.
  std::string describe() const;
  // 32 bits naming the byte format of a page: XXH3-64 (low half) of kKvPageFormatVersion, the
  // shape (n_layer, n_head_kv, head_dim, block_size, v_from_k) and every layer's dtype. Two
  // layouts with equal tags store a page identically; it feeds the prefix cache's chain hash,
  // so pages of one layout are never read as another's (per-layer overrides included).
  uint32_t format_tag() const;
  // Bump when a tile format's bytes change (e.g. fp8 keys gained zero points: 2).
  static constexpr uint32_t kKvPageFormatVersion = 2;
};

}  // namespace kv
