// PagePool: the KV memory of one layer group, allocated once, handed out as page ids.
//
// Storage per layer: K and V each [n_pages][n_head_kv][tile] of the layer's dtype (tile formats
// in kernels/kv_tile.h), so one (page, head) is one contiguous tile for attention. Every page
// has a reference count; a page is free when its count is 0. Callers check with
// can_allocate() before allocate(); a failed check changes nothing.
//
// Staging (quantized layers: fp8 / int8 / int4): a page that is still filling keeps each such
// layer's tiles at f16 in a staging slot of that layer. When its last slot is written the
// layer's tiles are quantized into the page, and the slot is freed by release_filled() once
// the layer's attention has run: during that pass a query still reads its own page at f16 and
// every earlier page quantized, exactly as it would decoding one token at a time, so results
// do not depend on how a prompt was chunked. Each layer has n_staging slots: one partly filled
// page per running sequence plus the pages one forward's chunk fills; staging bytes are part
// of total_bytes().
//
// Threading: owned by the engine thread. Kernels running inside an engine step may read and
// write page *contents* from pool threads (each (layer, page, head) tile by one writer), but
// only the owner changes reference counts.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "common/huge_alloc.h"
#include "common/status.h"
#include "kernels/attention.h"
#include "kernels/ops.h"
#include "kv/kv_layout.h"

namespace kv {

// Quest's key summaries describe a page in parts of at most kQuestKeysPerPart slots (a page of
// 16: two parts of 8), each KV head's part in 8 bits (encode_key_summary); a page scores as its
// best part. Finer parts rank pages closer to their true highest q·k; 8-bit summaries rank as
// the f16 ones did (docs/eviction.md), so two parts in 8 bits cost the bytes one f16 summary
// per page did.
inline constexpr int32_t kQuestKeysPerPart = 8;
inline int32_t key_stat_parts(int32_t block_size) { return (block_size + kQuestKeysPerPart - 1) / kQuestKeysPerPart; }
// Slots per part (the last part may have fewer).
inline int32_t key_stat_part_slots(int32_t block_size) {
  const int32_t parts = key_stat_parts(block_size);
  return (block_size + parts - 1) / parts;
}
// Bytes of one part of a page's summaries (every KV head's), and of one (layer, page)'s:
// [part][n_head_kv][key_summary_bytes(head_dim)].
inline int64_t key_stats_part_bytes(const KvLayout& l) { return int64_t(l.n_head_kv) * key_summary_bytes(l.head_dim); }
inline int64_t key_stats_bytes_per_page(const KvLayout& l) { return key_stat_parts(l.block_size) * key_stats_part_bytes(l); }

class PagePool {
 public:
  // Pages that fit in `bytes` for this layout (at least 0).
  // Pages that fit in `bytes` for this layout (at least 0), after n_staging staging slots.
  static int64_t pages_for_bytes(const KvLayout& layout, int64_t bytes, int32_t n_staging = kDefaultStaging);
  static constexpr int32_t kDefaultStaging = 40;  // one sequence, chunks up to 38 pages

  PagePool(const KvLayout& layout, int32_t n_pages, int32_t n_staging = kDefaultStaging);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const KvLayout& layout() const { return layout_; }
  int32_t n_pages() const { return n_pages_; }
  int32_t n_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t n_used() const { return n_pages_ - n_free(); }
  int64_t page_store_bytes() const { return int64_t(n_pages_) * layout_.page_bytes(); }
  int64_t stage_store_bytes() const { return int64_t(n_staging_) * layout_.stage_layer_bytes() * layout_.n_staged_layers(); }
  int64_t total_bytes() const { return page_store_bytes() + stage_store_bytes() + key_stats_bytes(); }
  int32_t n_staging() const { return n_staging_; }
  // Staging slots in use over all layers.
  int32_t n_staging_used() const;

  bool can_allocate(int32_t n) const { return n <= n_free(); }
  // Takes n free pages (refcount 1 each) and appends their ids to out. Returns false and
  // changes nothing when fewer than n are free.
  bool allocate(int32_t n, std::vector<int32_t>* out);
  void retain(int32_t page);   // another holder shares the page
  void release(int32_t page);  // a holder lets go; the page is free when none is left
  int32_t refcount(int32_t page) const { return refcount_[page]; }
  // Copies every layer's K and V of page src into page dst (copy-on-write of a shared page),
  // staging included. False (dst untouched) when src is staged and no staging slot is free.
  bool copy_page(int32_t src, int32_t dst);
  // A page's K/V bytes of every layer, layer by layer (K then V), layout().page_bytes() in all:
  // what the lower tiers and the cold-page spill file store.
  void read_page(int32_t page, uint8_t* dst) const;
  void write_page(int32_t page, const uint8_t* src);

  // Page contents: n_head_kv tiles for (layer, page).
  uint8_t* k_data(int32_t layer, int32_t page) { return k_base(layer) + int64_t(page) * layout_.k_layer_page_bytes(layer); }
  uint8_t* v_data(int32_t layer, int32_t page) { return v_base(layer) + int64_t(page) * layout_.v_layer_page_bytes(layer); }
  const uint8_t* k_data(int32_t layer, int32_t page) const { return const_cast<PagePool*>(this)->k_data(layer, page); }
  const uint8_t* v_data(int32_t layer, int32_t page) const { return const_cast<PagePool*>(this)->v_data(layer, page); }
  uint8_t* k_base(int32_t layer) { return storage_ + layer_off_[layer]; }
  uint8_t* v_base(int32_t layer) { return storage_ + layer_off_[layer] + int64_t(n_pages_) * layout_.k_layer_page_bytes(layer); }

  // Staging of a quantized layer. Makes sure `page` has a staging slot in `layer` before slot
  // `slot` is written: a fresh slot when slot == 0, else the page's already written slots
  // [0, slot) are read back from its quantized tiles (a rewrite). False when no slot is free.
  bool ensure_stage(int32_t layer, int32_t page, int32_t slot);
  // The staging slot of (layer, page), or -1.
  int32_t stage_of(int32_t layer, int32_t page) const { return stage_of_.empty() ? -1 : stage_of_[int64_t(layer) * n_pages_ + page]; }
  const int32_t* stage_table(int32_t layer) const { return stage_of_.empty() ? nullptr : stage_of_.data() + int64_t(layer) * n_pages_; }
  // Staging slot s of a staged layer: K tiles then V tiles, n_head_kv each, f16 (K-only
  // layouts, v_from_k > 0: K tiles only; stage_v is null).
  uint8_t* stage_k(int32_t layer, int32_t s) { return stage_base_[layer] + int64_t(s) * layout_.stage_layer_bytes(); }
  uint8_t* stage_v(int32_t layer, int32_t s) {
    return layout_.v_from_k > 0 ? nullptr : stage_k(layer, s) + layout_.stage_layer_bytes() / 2;
  }
  // Quantizes (layer, page)'s staged tiles into the page (the staging slot stays).
  void quantize_layer(int32_t layer, int32_t page);
  // Writes one token's K and V (n_head_kv × head_dim floats each; v unused, may be null, for
  // a K-only layout) into slot `slot` of
  // (layer, page): straight into the page, or for a staged layer into its staging tiles,
  // quantizing the page when `slot` is its last (its staging is freed by release_filled).
  // False when no staging slot is free.
  bool write_token(int32_t layer, int32_t page, int32_t slot, const float* k, const float* v);
  // write_token in three steps, so that a batch's tokens can be written by several threads:
  // begin_write for every token in order (owner thread: takes staging slots; false when none
  // is free), then write_slot for each token, from any thread (each slot by one writer), then,
  // once every write_slot returned, finish_page for each page whose last slot was written, if
  // finishes_pages (from any thread, each page by one), and mark_filled for each of them (owner
  // thread). The result is byte for byte that of write_token in the same order.
  bool begin_write(int32_t layer, int32_t page, int32_t slot) { return ensure_stage(layer, page, slot); }
  // Heads [h0, h1) only (default all), so that each head's slot can have its own writer.
  void write_slot(int32_t layer, int32_t page, int32_t slot, const float* k, const float* v, int32_t h0 = 0,
                  int32_t h1 = -1);
  // Whether a page of `layer` needs finish_page once its last slot is written (a staged layer,
  // or key summaries).
  bool finishes_pages(int32_t layer) const { return layout_.staged(layer) || !key_stats_.empty(); }
  // The page's key summary (when kept), then for a staged layer its quantized tiles.
  void finish_page(int32_t layer, int32_t page);
  // A staged layer's finished page keeps its staging until release_filled.
  void mark_filled(int32_t layer, int32_t page) {
    if (layout_.staged(layer)) filled_[layer].push_back(page);
  }
  // Frees the staging of the layer's pages that write_token filled (call after the layer's
  // attention has read them).
  void release_filled(int32_t layer);
  // Rewrites the keys of slots [0, n_slots) of (layer, page) in place: fn(keys, head) gets one
  // KV head's keys as floats, token-major [n_slots][head_dim], and changes them; they go back
  // in the page's format (a quantized page is read, changed and quantized again: one more
  // quantization round trip; a filling page's f16 staging tile is changed instead), and the
  // Quest key summaries follow. StreamingLLM's re-indexing re-rotates cached keys this way.
  template <class Fn>
  void transform_keys(int32_t layer, int32_t page, int32_t n_slots, Fn&& fn) {
    transform_keys_impl(layer, page, n_slots, [](void* f, float* k, int32_t h) { (*static_cast<Fn*>(f))(k, h); }, &fn);
  }
  // Quest key summaries: per (layer, page, part of key_stat_part_slots slots, KV head) the
  // channel-wise mean and variance of the part's keys in 8 bits (encode_key_summary, from the
  // keys as written, before any quantization), key_stats_bytes_per_page(layout) per (layer,
  // page) as [part][n_head_kv][key_summary_bytes(head_dim)]. Made when the page fills (and by
  // transform_keys, over the slots it rewrote) and kept by copy_page. A page still filling has
  // none that counts: Quest always reads a query's own page. Off until enabled; enabling
  // allocates n_layer × n_pages × key_stats_bytes_per_page bytes (counted in total_bytes).
  void enable_key_stats();
  bool has_key_stats() const { return !key_stats_.empty(); }
  uint8_t* key_stats(int32_t layer, int32_t page) {  // (a page loaded from a lower tier)
    return key_stats_.data() + (int64_t(layer) * n_pages_ + page) * key_stats_bytes_per_page(layout_);
  }
  const uint8_t* key_stats(int32_t layer, int32_t page) const {
    return key_stats_.data() + (int64_t(layer) * n_pages_ + page) * key_stats_bytes_per_page(layout_);
  }
  int64_t key_stats_bytes() const { return int64_t(key_stats_.size()); }
  // The attention kernels' view of one layer (pages, staging); the caller sets .pages.
  PagedKvView view(int32_t layer) const;

  // free + in use = total; free list has no duplicates and only refcount-0 pages; every
  // refcount-0 page is on the free list; staging slots belong to pages in use, one slot to
  // one page, and free + used slots = n_staging per layer. Returns what is wrong, if anything.
  Status check_integrity() const;

 private:
  void release_stages(int32_t page);
  void transform_keys_impl(int32_t layer, int32_t page, int32_t n_slots, void (*call)(void*, float*, int32_t), void* fn);

  KvLayout layout_;
  int32_t n_pages_;
  int32_t n_staging_;
  uint8_t* storage_ = nullptr;            // per layer: K [n_pages][page tiles], V [n_pages][page tiles]
  std::vector<int64_t> layer_off_;        // [n_layer] byte offset of the layer's K store
  std::vector<int32_t> refcount_;         // [n_pages]
  std::vector<int32_t> free_list_;        // LIFO: recently freed pages are warm in cache
  // Staging (empty when no layer is staged).
  uint8_t* stage_storage_ = nullptr;
  std::vector<uint8_t*> stage_base_;           // [n_layer], null for unstaged layers
  std::vector<int32_t> stage_of_;              // [n_layer][n_pages]: slot or -1
  std::vector<int32_t> stage_page_;            // [n_layer][n_staging]: page holding the slot or -1
  std::vector<std::vector<int32_t>> stage_free_;  // [n_layer]: free slots
  std::vector<std::vector<int32_t>> filled_;      // [n_layer]: quantized pages still holding staging
  HugeVector<uint8_t> key_stats_;                // [n_layer][n_pages][part][n_head_kv][summary], or empty (huge pages: Quest reads a layer's all)
  // keys [n_head_kv][n][head_dim] → the page's summaries; summarize_keys reads a full page's keys
  // (from its staging tile while it has one).
  void store_key_stats(int32_t layer, int32_t page, const float* keys, int32_t n);
  void summarize_keys(int32_t layer, int32_t page);
};

// The pages of one sequence in one layer group. Position p lives in page pages[p / block_size],
// slot p % block_size. n_tokens counts positions whose K/V have been written.
struct BlockTable {
  std::vector<int32_t> pages;
  int64_t n_tokens = 0;

  // Pages needed to hold n positions.
  static int32_t pages_for(int64_t n, int32_t block_size) { return static_cast<int32_t>((n + block_size - 1) / block_size); }
  // Returns every page to the pool and empties the table (-1 entries: pages already freed,
  // e.g. slid out of a sliding window).
  void release_all(PagePool& pool) {
    for (int32_t p : pages)
      if (p >= 0) pool.release(p);
    pages.clear();
    n_tokens = 0;
  }
};

}  // namespace kv
