// Paged attention: queries of one sequence against K/V read straight from pages, in the
// FlashAttention style — one page tile at a time, online softmax, no score matrix — for every
// page element type (kv_tile.h), dequantizing inside the kernel: nothing makes a float copy of
// a sequence's KV.
//
// Prefill: a tile of up to kAttnQTile query tokens × the GQA group's query heads against each
// page in turn, causal (and sliding-window) mask inside the page loop. Decode: the same kernel
// with one token; each K/V page is read once for the whole query group. When one sequence
// does not give every thread work, callers split its key range into parts
// (paged_attention_partial, page-aligned) and merge them by log-sum-exp (attention_merge):
// flash-decoding.
//
// Knows pages only as pointers and strides; the page pool lives in kv/.
#pragma once
#include <cstdint>

#include "kernels/kv_tile.h"

namespace kv {

// Limits of the kernels' buffers: block_size, head_dim and group size must not exceed these.
inline constexpr int kAttnMaxBlockSize = 64;
inline constexpr int kAttnMaxHeadDim = 256;
inline constexpr int kAttnMaxGroup = 16;
inline constexpr int kAttnQTile = 8;  // query tokens per tile (rows = tokens × group)

// One layer's view of one sequence's KV pages.
struct PagedKvView {
  // The layer's tiles: page p, KV head h at k_base + p * k_page_bytes + h * kv_k_tile_bytes().
  const uint8_t* k_base = nullptr;
  const uint8_t* v_base = nullptr;
  int64_t k_page_bytes = 0;
  int64_t v_page_bytes = 0;
  const int32_t* pages = nullptr;  // the sequence's block table
  int32_t n_head_kv = 0;
  int32_t block_size = 0;
  int32_t head_dim = 0;
  KvElem elem = KvElem::kF16;
  // Staged element types: a page still filling has its tiles at f16 in a staging slot.
  const int32_t* stage_of = nullptr;  // per pool page id: staging slot or -1 (null: no staging)
  const uint8_t* k_stage = nullptr;   // slot s, head h: k_stage + s * stage_bytes + h * bs*hd*2
  const uint8_t* v_stage = nullptr;
  int64_t stage_bytes = 0;
  // > 0: a query at position p sees only keys in (p - window, p] (sliding-window layers).
  int32_t window = 0;
  // > 0 (MLA, latent cache): there is no V tile; the value of a key is the first v_from_k
  // channels of its K row (the latent c_kv of [c_kv ‖ k_pe]), read from the K tile (channel-
  // major, dequantized as keys are: int8/int4 per channel min + scale·q). Outputs and partial
  // accumulators then hold v_from_k values per query head instead of head_dim (a multiple
  // of 16, at most head_dim).
  int32_t v_from_k = 0;
  int value_dim() const { return v_from_k > 0 ? v_from_k : head_dim; }
};

// For KV head `kv_head` and its n_group query heads, n_q consecutive query tokens at
// positions [pos0, pos0 + n_q): each attends causally to key positions [0, pos] (already
// written into the pages). A block-table entry of -1 is a page that is not there (evicted,
// slid out of a window, or not selected by a sparse read): its keys are skipped.
//   q:   [n_q][q_stride] floats; head h of token t at q + t*q_stride + h*head_dim
//   out: [n_q][o_stride] floats, same head layout; heads kv_head*n_group .. +n_group written
//        (head h at out + t*o_stride + h*kv.value_dim(): head_dim, or v_from_k for MLA)
void paged_attention(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                     int64_t pos0, int n_q, float scale, float* out, int64_t o_stride);

// One part of a split key range: as paged_attention for n_q ≤ kAttnQTile tokens, but only keys
// in [key_begin, key_end) (key_begin a multiple of block_size) and without normalising. Rows
// r = t * n_group + g: acc [rows][kv.value_dim()] (Σ p·v), m [rows] (running max, -inf if the row saw
// no key), l [rows] (Σ p).
// page_lse (optional): per row r and page i of the range (page index key_begin / block_size + i),
// page_lse[r * lse_stride + i] = log Σ_{keys j of the page the row sees} exp(q·k_j · scale), or
// -inf when it sees none. With the row's total log-sum-exp (m + log l, merged over parts) this
// gives the attention mass each page received: exp(page_lse − row_lse). Eviction scores.
void paged_attention_partial(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                             int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                             float* m, float* l, float* page_lse = nullptr, int64_t lse_stride = 0);

// Several KV heads in one pass of paged_attention_partial_heads: heads [kv_head, kv_head + n),
// head i's acc at acc + i·acc_stride, m and l at + i·ml_stride, page_lse at + i·lse_stride.
// One pass holds n · n_q · n_group ≤ kAttnQTile · kAttnMaxGroup rows and n ≤ kAttnMaxHeads;
// past that the heads run one at a time (same results).
inline constexpr int kAttnMaxHeads = 8;
struct AttnHeads {
  int n = 1;
  int64_t acc_stride = 0, ml_stride = 0, lse_stride = 0;
};

// paged_attention_partial for n KV heads at once (AttnHeads), reading each page's tiles of all
// of them together: a page's head tiles are neighbours in the pool, so the pass reads one
// stretch of memory front to back instead of one head's tiles at a stride. Same results, bit
// for bit, as one call per head. The heads must share the page table (not Quest's per-head
// selections).
void paged_attention_partial_heads(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                                   int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                                   float* m, float* l, float* page_lse, int64_t lse_stride, const AttnHeads& heads);

// Whether the AVX-512 build runs a decode step's page group (≤ 4 query rows per KV head, no
// page in staging) over float pages (f32, f16, bf16) page by page across the heads instead of
// head after head: the group's K tiles, then its V tiles, read in the order they lie. Same bits
// either way. On by default; KV_ATTN_PAGE_MAJOR=0 turns it off (read once).
bool attention_page_major();
// Tests: take one way or the other. Must not race with attention calls.
void set_attention_page_major_for_testing(bool on);

// Asks the memory system for KV head kv_head's K and V tiles of the first `max_pages` pages
// holding keys [key_begin, key_end) (pages not there, and pages still filling in staging, which
// are in cache, are skipped), at kernels/prefetch.h's level, and returns at once. A caller that
// runs many short attention units (decode: one per sequence and KV head) names the next unit's
// pages before computing the current one, so its first loads do not wait on RAM.
void paged_attention_prefetch(const PagedKvView& kv, int kv_head, int64_t key_begin, int64_t key_end, int max_pages);

// Combines n_parts partial results of the same rows (laid out part after part:
// acc [n_parts][n_rows][head_dim], m and l [n_parts][n_rows]) by log-sum-exp and writes the
// normalised rows into out as paged_attention does.
void attention_merge(int n_parts, int n_group, int n_q, int head_dim, const float* acc, const float* m,
                     const float* l, int kv_head, float* out, int64_t o_stride);

// Naive reference: reads keys and values one at a time through kv_read_k / kv_read_v and
// computes each row's softmax in double. Same contract as paged_attention.
void paged_attention_ref(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                         int64_t pos0, int n_q, float scale, float* out, int64_t o_stride);

}  // namespace kv
