#include "kv/page_pool.h"

#include <cassert>
#include <cstdlib>
#include <cstring>
#include <new>

namespace kv {

const char* kv_dtype_name(KvDtype d) { return d == KvDtype::kF32 ? "f32" : "f16"; }

Result<KvDtype> parse_kv_dtype(const std::string& s) {
  if (s == "auto" || s == "f16") return KvDtype::kF16;
  if (s == "f32") return KvDtype::kF32;
  return Result<KvDtype>::error("unknown KV cache dtype '" + s + "' (expected auto, f16 or f32)");
}

int64_t PagePool::pages_for_bytes(const KvLayout& layout, int64_t bytes) {
  int64_t pb = layout.page_bytes();
  return pb > 0 && bytes > 0 ? bytes / pb : 0;
}

PagePool::PagePool(const KvLayout& layout, int32_t n_pages) : layout_(layout), n_pages_(n_pages) {
  size_t bytes = static_cast<size_t>(total_bytes());
  if (bytes > 0) {
    bytes = (bytes + 63) / 64 * 64;
    storage_ = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
    if (!storage_) throw std::bad_alloc();
    // Zero once so an unwritten slot can never hold NaN garbage that a masked lane reads.
    std::memset(storage_, 0, bytes);
  }
  refcount_.assign(n_pages_, 0);
  free_list_.reserve(n_pages_);
  for (int32_t p = n_pages_ - 1; p >= 0; --p) free_list_.push_back(p);
}

PagePool::~PagePool() { std::free(storage_); }

bool PagePool::allocate(int32_t n, std::vector<int32_t>* out) {
  if (!can_allocate(n)) return false;
  for (int32_t k = 0; k < n; ++k) {
    int32_t p = free_list_.back();
    free_list_.pop_back();
    assert(refcount_[p] == 0);
    refcount_[p] = 1;
    out->push_back(p);
  }
  return true;
}

void PagePool::retain(int32_t page) {
  assert(page >= 0 && page < n_pages_ && refcount_[page] > 0);
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  assert(page >= 0 && page < n_pages_ && refcount_[page] > 0);
  if (--refcount_[page] == 0) free_list_.push_back(page);
}

void PagePool::copy_page(int32_t src, int32_t dst) {
  const int64_t n = layout_.layer_page_bytes();
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    std::memcpy(k_data(l, dst), k_data(l, src), n);
    std::memcpy(v_data(l, dst), v_data(l, src), n);
  }
}

Status PagePool::check_integrity() const {
  std::vector<uint8_t> on_free(n_pages_, 0);
  for (int32_t p : free_list_) {
    if (p < 0 || p >= n_pages_) return Status::error("free list holds invalid page id " + std::to_string(p));
    if (on_free[p]) return Status::error("page " + std::to_string(p) + " is on the free list twice");
    on_free[p] = 1;
    if (refcount_[p] != 0) return Status::error("free page " + std::to_string(p) + " has refcount " + std::to_string(refcount_[p]));
  }
  for (int32_t p = 0; p < n_pages_; ++p) {
    if (refcount_[p] < 0) return Status::error("page " + std::to_string(p) + " has negative refcount");
    if (refcount_[p] == 0 && !on_free[p]) return Status::error("page " + std::to_string(p) + " is unreferenced but not free (leak)");
  }
  return Status::ok();
}

}  // namespace kv
