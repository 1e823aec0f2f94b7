#include "common/huge_alloc.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>
#include <new>

namespace kv {

namespace {
constexpr size_t kHuge = size_t(2) << 20;

bool advise_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KV_HUGEPAGES");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}
}  // namespace

namespace {
// Buffers of kSlabMin up to 2 MiB share slabs of kSlab bytes, 2 MiB-aligned and advised like
// the large ones: a model's packed matrices are mostly 0.2-1.5 MiB each (SmolLM2: 120 of
// them, 82 MiB), too small for a huge page of their own, and on 4 KiB pages batch-1 decode
// ran 12-19% slower (Zen 4 VM, 2026-11-28). A slab is a bump allocator; it goes back to the
// system when its last buffer is freed (a model's weights come and go together).
constexpr size_t kSlab = size_t(32) << 20, kSlabMin = size_t(64) << 10;
struct Slab {
  uint8_t* base;
  size_t used, live;
};
std::mutex slab_mu;
std::vector<Slab> slabs;  // the last one takes new buffers

void* slab_alloc(size_t bytes) {
  const size_t need = (bytes + 63) / 64 * 64;
  std::lock_guard<std::mutex> lock(slab_mu);
  if (slabs.empty() || slabs.back().used + need > kSlab) {
    auto* base = static_cast<uint8_t*>(std::aligned_alloc(kHuge, kSlab));
    if (!base) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(base, kSlab, MADV_HUGEPAGE);
#endif
    slabs.push_back({base, 0, 0});
  }
  Slab& s = slabs.back();
  void* p = s.base + s.used;
  s.used += need;
  ++s.live;
  return p;
}

// True if p was a slab's (and is now released).
bool slab_free(void* p) {
  std::lock_guard<std::mutex> lock(slab_mu);
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < slabs.size(); ++i) {
    Slab& s = slabs[i];
    if (b < s.base || b >= s.base + kSlab) continue;
    if (--s.live == 0) {
      std::free(s.base);
      slabs.erase(slabs.begin() + static_cast<std::ptrdiff_t>(i));
    }
    return true;
  }
  return false;
}
}  // namespace

void* huge_alloc(size_t bytes) {
  if (bytes == 0) bytes = 64;
  if (bytes >= kSlabMin && bytes < kHuge && advise_enabled()) return slab_alloc(bytes);
  const bool huge = bytes >= kHuge && advise_enabled();
  const size_t align = huge ? kHuge : 64;
  const size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (huge) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure leaves 4 KiB pages
#endif
  return p;
}

void huge_free(void* p) {
  if (p && !slab_free(p)) std::free(p);
}

size_t huge_slabs() {
  std::lock_guard<std::mutex> lock(slab_mu);
  return slabs.size();
}

long long huge_pages_bytes() {
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (!f) return -1;
  char line[256];
  long long kb = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "AnonHugePages: %lld kB", &kb) == 1) break;
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

}  // namespace kv
