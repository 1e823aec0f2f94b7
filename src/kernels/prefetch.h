// Which cache level the streaming kernels (matmul weights, paged attention tiles) prefetch
// into. Measured per vendor with one core streaming from RAM: on Intel Xeon prefetcht0 is best
// (matmul 11 → 25 GB/s over none; prefetcht1 15% slower in attention); on AMD Zen 4 prefetcht0
// holds a core at ~13 GB/s of weights where prefetcht1 reaches ~20 and none ~17. So AMD gets
// kT1, everyone else kT0. KV_PREFETCH_HINT=t0|t1|none overrides (for A/B runs). Read once.
#pragma once

namespace kv {

enum class PrefetchLevel { kNone = 0, kT0 = 1, kT1 = 2 };
PrefetchLevel prefetch_level();

}  // namespace kv
