#include "common/huge_alloc.h"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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

void* huge_alloc(size_t bytes) {
  if (bytes == 0) bytes = 64;
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

void huge_free(void* p) { std::free(p); }

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
