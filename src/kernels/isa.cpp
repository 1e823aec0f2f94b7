#include "kernels/isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kv {

namespace {

Isa best_isa() {
  return cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
}

// One warning per process, whichever thread asks first (model loads and the CLI all call
// detect_isa()).
std::atomic<bool> g_warned{false};
void warn_once(const char* what, const char* value, Isa used) {
  if (g_warned.exchange(true)) return;
  std::fprintf(stderr, "kvserve: warning: KV_ISA=%s %s; using %s\n", value, what, isa_name(used));
}

// -1 until first use; then an Isa. Relaxed: every thread computes the same answer.
std::atomic<int> g_kernel_isa{-1};

}  // namespace

bool cpu_has_f16c() {
#if defined(__x86_64__) || defined(__i386__)
  // CPUID leaf 1, ECX bit 29: clang's __builtin_cpu_supports does not know "f16c".
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
#else
  return false;
#endif
}

bool cpu_has_amx() {
#if defined(KV_SCALAR_ONLY) || !defined(__x86_64__) || !defined(__linux__)
  return false;
#else
  static const bool has = [] {
    if (!cpu_has(Isa::kAvx512)) return false;
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
    // The tile data state is off by default for a process; ask for it (Linux 5.16+).
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#endif
}

bool cpu_has(Isa isa) {
#if defined(KV_SCALAR_ONLY) || !(defined(__x86_64__) || defined(__i386__))
  return isa == Isa::kScalar;
#else
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case Isa::kAvx512:
      // Everything the *_avx512.cpp files are compiled for (CMakeLists.txt), so the compiler
      // may use any of it there.
      return cpu_has(Isa::kAvx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#endif
}

Isa detect_isa() {
  const Isa best = best_isa();
  const char* e = std::getenv("KV_ISA");
  if (!e || !*e) return best;
  Isa want;
  if (std::strcmp(e, "scalar") == 0) want = Isa::kScalar;
  else if (std::strcmp(e, "avx2") == 0) want = Isa::kAvx2;
  else if (std::strcmp(e, "avx512") == 0) want = Isa::kAvx512;
  else {
    warn_once("is not one of scalar, avx2, avx512", e, best);
    return best;
  }
  if (!cpu_has(want)) {
    warn_once("asks for more than this CPU has", e, best);
    return best;
  }
  return want;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

Isa kernel_isa() {
  int v = g_kernel_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(detect_isa());
    g_kernel_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

Isa set_kernel_isa_for_testing(Isa isa) {
  while (!cpu_has(isa)) isa = static_cast<Isa>(static_cast<int>(isa) - 1);
  g_kernel_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return isa;
}

}  // namespace kv
