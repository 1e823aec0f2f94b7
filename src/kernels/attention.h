// Paged attention: queries of one sequence against K/V read straight from pages,
// FlashAttention-style (one page tile at a time, online softmax, no score matrix).
// Knows pages only as pointers and strides; the page pool lives in kv/.
#pragma once
#include <cstdint>

namespace kv {

enum class KvElem { kF32, kF16 };

// Limits of the tile buffers: block_size and head_dim must not exceed these.
inline constexpr int kAttnMaxBlockSize = 64;
inline constexpr int kAttnMaxHeadDim = 256;

// One layer's view of one sequence's KV pages.
struct PagedKvView {
  const uint8_t* k_base = nullptr;  // layer's K storage: [n_pages_pool][n_head_kv][block_size][head_dim]
  const uint8_t* v_base = nullptr;  // same shape for V
  int64_t page_bytes = 0;           // bytes of one page in one layer: n_head_kv*block_size*head_dim*elem
  const int32_t* pages = nullptr;   // the sequence's block table
  int32_t n_head_kv = 0;
  int32_t block_size = 0;
  int32_t head_dim = 0;
  KvElem elem = KvElem::kF16;
};

// For one KV head `kv_head` and its n_group query heads, n_q consecutive query tokens at
// positions [pos0, pos0 + n_q): each attends causally to key positions [0, pos] of the
// sequence (which must already be written into the pages).
//   q:   [n_q][q_stride] floats; head h of token t at q + t*q_stride + h*head_dim
//   out: [n_q][o_stride] floats, same head layout; heads kv_head*n_group .. +n_group written
void paged_attention(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                     int64_t pos0, int n_q, float scale, float* out, int64_t o_stride);
// Naive reference: materialises the scores of one query row at a time, plain softmax.
void paged_attention_ref(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                         int64_t pos0, int n_q, float scale, float* out, int64_t o_stride);

// Writes one token's K or V ([n_head_kv][head_dim] floats) into slot `slot` of a page
// ([n_head_kv][block_size][head_dim] of elem).
void write_kv_token(uint8_t* page, KvElem elem, int n_head_kv, int block_size, int head_dim, int slot, const float* src);

}  // namespace kv
