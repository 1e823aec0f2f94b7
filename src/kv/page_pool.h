// PagePool: the KV memory of one layer group, allocated once, handed out as page ids.
//
// Storage per layer: K and V each [n_pages][n_head_kv][block_size][head_dim] of the layout's
// dtype, so one (page, head) is one contiguous tile for attention. Every page has a reference
// count; a page is free when its count is 0. Callers check with can_allocate() before
// allocate(); a failed check changes nothing.
//
// Threading: owned by the engine thread. Kernels running inside an engine step may read and
// write page *contents* from pool threads (each (layer, page, head) tile by one writer), but
// only the owner changes reference counts.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kv/kv_layout.h"

namespace kv {

class PagePool {
 public:
  // Pages that fit in `bytes` for this layout (at least 0).
  static int64_t pages_for_bytes(const KvLayout& layout, int64_t bytes);

  PagePool(const KvLayout& layout, int32_t n_pages);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const KvLayout& layout() const { return layout_; }
  int32_t n_pages() const { return n_pages_; }
  int32_t n_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t n_used() const { return n_pages_ - n_free(); }
  int64_t total_bytes() const { return int64_t(n_pages_) * layout_.page_bytes(); }

  bool can_allocate(int32_t n) const { return n <= n_free(); }
  // Takes n free pages (refcount 1 each) and appends their ids to out. Returns false and
  // changes nothing when fewer than n are free.
  bool allocate(int32_t n, std::vector<int32_t>* out);
  void retain(int32_t page);   // another holder shares the page
  void release(int32_t page);  // a holder lets go; the page is free when none is left
  int32_t refcount(int32_t page) const { return refcount_[page]; }
  // Copies every layer's K and V of page src into page dst (copy-on-write of a shared page).
  void copy_page(int32_t src, int32_t dst);

  // Page contents: [n_head_kv][block_size][head_dim] of dtype for (layer, page).
  uint8_t* k_data(int32_t layer, int32_t page) { return base(layer, 0) + int64_t(page) * layout_.layer_page_bytes(); }
  uint8_t* v_data(int32_t layer, int32_t page) { return base(layer, 1) + int64_t(page) * layout_.layer_page_bytes(); }
  const uint8_t* k_data(int32_t layer, int32_t page) const { return const_cast<PagePool*>(this)->k_data(layer, page); }
  const uint8_t* v_data(int32_t layer, int32_t page) const { return const_cast<PagePool*>(this)->v_data(layer, page); }

  // free + in use = total; free list has no duplicates and only refcount-0 pages; every
  // refcount-0 page is on the free list. Returns what is wrong, if anything.
  Status check_integrity() const;

 private:
  uint8_t* base(int32_t layer, int kv) { return storage_ + (int64_t(layer) * 2 + kv) * int64_t(n_pages_) * layout_.layer_page_bytes(); }

  KvLayout layout_;
  int32_t n_pages_;
  uint8_t* storage_ = nullptr;            // [n_layer][2][n_pages][n_head_kv][block_size][head_dim]
  std::vector<int32_t> refcount_;         // [n_pages]
  std::vector<int32_t> free_list_;        // LIFO: recently freed pages are warm in cache
};

// The pages of one sequence in one layer group. Position p lives in page pages[p / block_size],
// slot p % block_size. n_tokens counts positions whose K/V have been written.
struct BlockTable {
  std::vector<int32_t> pages;
  int64_t n_tokens = 0;

  // Pages needed to hold n positions.
  static int32_t pages_for(int64_t n, int32_t block_size) { return static_cast<int32_t>((n + block_size - 1) / block_size); }
  // Returns every page to the pool and empties the table.
  void release_all(PagePool& pool) {
    for (int32_t p : pages) pool.release(p);
    pages.clear();
    n_tokens = 0;
  }
};

}  // namespace kv
