// Large read-mostly buffers (packed weights, the KV pool) backed by transparent huge pages
// where the kernel allows it: 2 MiB-aligned and madvise(MADV_HUGEPAGE) before first touch, so
// streaming them costs one TLB entry per 2 MiB instead of one per 4 KiB (the hardware
// prefetchers also stop at 4 KiB page boundaries). Buffers from 64 KiB to 2 MiB (most packed
// matrices) share 32 MiB slabs that are advised the same way; smaller ones are plain. All are
// 64-byte aligned. KV_HUGEPAGES=0 turns the advice and the slabs off (for A/B measurements).
// Thread-safe.
#pragma once
#include <cstddef>
#include <vector>

namespace kv {

// Never null: throws std::bad_alloc. Free with huge_free.
void* huge_alloc(size_t bytes);
void huge_free(void* p);
// Slabs held now (tests: each is released with its last buffer).
size_t huge_slabs();
// For std::vector: huge_alloc'd storage (64-byte aligned; huge pages from 64 KiB up).
template <typename T>
struct HugeAllocator {
  using value_type = T;
  HugeAllocator() = default;
  template <typename U>
  HugeAllocator(const HugeAllocator<U>&) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(huge_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t) { huge_free(p); }
  template <typename U>
  bool operator==(const HugeAllocator<U>&) const { return true; }
};
template <typename T>
using HugeVector = std::vector<T, HugeAllocator<T>>;

// Bytes of huge pages the process holds (AnonHugePages of /proc/self/smaps_rollup); -1 if unknown.
long long huge_pages_bytes();

}  // namespace kv
