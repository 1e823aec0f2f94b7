// Which cache level the streaming kernels (matmul weights, paged attention tiles) prefetch
// into. Measured per vendor with one core streaming from RAM: on Intel Xeon prefetcht0 is best
// (matmul 11 → 25 GB/s over none; prefetcht1 15% slower in attention); on AMD Zen 4 prefetcht0
// holds a core at ~13 GB/s of weights where prefetcht1 reaches ~20 and none ~17. So AMD gets
// kT1, everyone else kT0. KV_PREFETCH_HINT=t0|t1|none overrides (for A/B runs). Read once.
#pragma once

namespace kv {

enum class PrefetchLevel { kNone = 0, kT0 = 1, kT1 = 2 };
PrefetchLevel prefetch_level();
// The level the paged attention kernels' tile look-ahead uses: prefetch_level(), except on AMD
// Zen 5 (family 0x1A), where L1 measured faster for attention and not for the matmuls. On the
// Zen 5 VM (2026-12-01, `bench/ab_pairs.py`, KV_PREFETCH_HINT=t0 against t1 for everything):
// 8k-context decode f16 ×1.072 (9 of 10 pairs), int8 ×1.030 (7 of 8); batch 1, 16 sequences
// and 512-token prefill unchanged (×0.989, ×0.996, ×0.997). KV_PREFETCH_HINT overrides both.
PrefetchLevel attention_prefetch_level();

// How a one-row matmul (decode at batch 1) streams its weights. AVX-512 GEMV either takes 4
// groups of 16 outputs at once (4 streams, one per group's records, each prefetched 2 KiB
// ahead at prefetch_level()) or one group at a time (one sequential stream, no software
// prefetch). On AMD Zen 4 (EPYC VM, 2026-11-27) one core streamed packed weights at 18 GB/s
// the first way and 27-29 GB/s the second (a plain read loop: 27); software prefetch on top
// of one stream cost 30%. So AMD gets one stream; Intel keeps 4 streams + prefetcht0, which
// its hosts measured best (not re-measured this way). KV_GEMV=one|four overrides. Read once.
bool gemv_one_stream();
// Tests: take one way or the other (both give the same bits). Must not race with matmuls.
void set_gemv_one_stream_for_testing(bool one);

}  // namespace kv
