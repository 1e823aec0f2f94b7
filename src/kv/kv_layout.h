// The shape of one layer group's KV storage and the element types pages can hold.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kv {

enum class KvDtype { kF32, kF16 };
const char* kv_dtype_name(KvDtype d);
Result<KvDtype> parse_kv_dtype(const std::string& s);  // "auto" = f16
inline int64_t kv_dtype_bytes(KvDtype d) { return d == KvDtype::kF32 ? 4 : 2; }

// One layer group: n_layer layers that share page ids (a page id indexes every layer).
struct KvLayout {
  int32_t n_layer = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;  // token positions per page
  KvDtype dtype = KvDtype::kF16;

  // Bytes of one (layer, page) K tile set: [n_head_kv][block_size][head_dim].
  int64_t layer_page_bytes() const { return int64_t(n_head_kv) * block_size * head_dim * kv_dtype_bytes(dtype); }
  // Bytes of one page across all layers, K and V.
  int64_t page_bytes() const { return 2 * int64_t(n_layer) * layer_page_bytes(); }
  // KV bytes per token of context: 2 × n_layer × n_head_kv × head_dim × bytes.
  int64_t bytes_per_token() const { return 2 * int64_t(n_layer) * n_head_kv * head_dim * kv_dtype_bytes(dtype); }
};

}  // namespace kv
