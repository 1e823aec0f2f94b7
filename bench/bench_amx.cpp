// Where the AMX matmul's time goes (matmul_amx_avx512.cpp, rows16_group): the block loop of a
// 16-row tile over one 16-output group, taken apart. SmolLM2's gate/up shape (576 inputs = 18
// blocks of 32; 192 groups), two activation levels, Q4_1's float steps.
//   build/bench_amx [--benchmark_filter=...]
// Variants (each a complete pass over the 192 groups):
//   full        the kernel's loop before 2026-11-27: per block tile loads, two tdpbsud, two tile
//               stores, then the previous block's float steps from the stored sums
//   tiles       tile loads and tdpbsud only (the sums accumulate in the tiles; nothing stored)
//   tiles_store tiles + the two tile stores per block
//   vector      the float steps alone, from a buffer no tile writes
//   no_dep      full, but the float steps read a buffer the tile stores do not write
//   reordered   per block: tdpbsud, then the previous block's float steps, then the stores
//   pipelined   two deep: block b-1's stores and block b's products between the float steps of
//               block b-2 (three buffers)
//   interleaved block b's tile loads and products between the 4-row quarters of block b-1's
//               float steps, then block b's stores
//   interleaved_fsum  interleaved, with the level sum formed in float: the kernel's loop now
// If tile and vector work overlapped, full would be near max(tiles_store, vector); it is near
// their sum (docs/ARCHITECTURE.md, Matmul). Skipped where the CPU has no AMX-INT8.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/isa.h"

namespace {

#define KV_AMX_TARGET \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), noinline))

constexpr int kNb = 18, kNg = 192;
constexpr int32_t kLevel2 = 254;  // matmul.h
alignas(64) int8_t g_a1[16 * kNb * 32], g_a2[16 * kNb * 32];
alignas(64) uint8_t g_b[kNg][kNb][512];
alignas(64) uint16_t g_wscale[kNg][kNb][32];  // f16 d, m per output
alignas(64) float g_s[kNb * 16], g_d[kNb * 16];
alignas(64) int32_t g_fake[2][2][16][16];
alignas(64) float g_out[kNg][16][16];

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

KV_AMX_TARGET void configure() {
  TileConfig c;
  for (int t : {0, 1}) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t : {2, 3}) {
    c.rows[t] = 16;
    c.colsb[t] = 32;
  }
  c.rows[4] = 8;
  c.colsb[4] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c));
}

enum Variant { kFull, kTiles, kTilesStore, kVector, kNoDep, kReordered, kInterleaved, kPipelined, kInterleavedF };

KV_AMX_TARGET inline void dps(int g, int b) {
  _tile_loadd(4, g_b[g][b], 64);
  _tile_loadd(2, g_a1 + b * 32, kNb * 32);
  _tile_loadd(3, g_a2 + b * 32, kNb * 32);
  _tile_zero(0);
  _tile_zero(1);
  _tile_dpbsud(0, 2, 4);
  _tile_dpbsud(1, 3, 4);
}

KV_AMX_TARGET inline void stores(int32_t (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
}

// The VNNI kernel's float steps for one block of 16 rows (matmul_amx_avx512.cpp, block_step).
KV_AMX_TARGET inline void steps(int g, int b, const int32_t (*c)[16][16], __m512* acc) {
  const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(g_wscale[g][b])));
  const __m512 mw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(g_wscale[g][b] + 16)));
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    __m512i i = _mm512_mullo_epi32(_mm512_load_si512(c[0][r]), _mm512_set1_epi32(kLevel2));
    i = _mm512_add_epi32(i, _mm512_load_si512(c[1][r]));
    __m512 t = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(i));
    t = _mm512_fmadd_ps(mw, _mm512_set1_ps(g_s[b * 16 + r]), t);
    acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(g_d[b * 16 + r]), acc[r]);
  }
}

// Rows [r0, r0 + N) of steps(). FloatSum: the level sum formed in float, as the kernel does
// for 4-bit weights (the same float: c1 and c2 are exact, the FMA rounds the exact sum once).
template <int N = 4, bool FloatSum = false>
KV_AMX_TARGET inline void steps4(int g, int b, int r0, const int32_t (*c)[16][16], __m512* acc) {
  const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(g_wscale[g][b])));
  const __m512 mw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(g_wscale[g][b] + 16)));
#pragma GCC unroll 4
  for (int r = r0; r < r0 + N; ++r) {
    __m512 sum;
    if constexpr (FloatSum) {
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[0][r])), _mm512_set1_ps(float(kLevel2)),
                            _mm512_cvtepi32_ps(_mm512_load_si512(c[1][r])));
    } else {
      __m512i i = _mm512_mullo_epi32(_mm512_load_si512(c[0][r]), _mm512_set1_epi32(kLevel2));
      sum = _mm512_cvtepi32_ps(_mm512_add_epi32(i, _mm512_load_si512(c[1][r])));
    }
    __m512 t = _mm512_mul_ps(dw, sum);
    t = _mm512_fmadd_ps(mw, _mm512_set1_ps(g_s[b * 16 + r]), t);
    acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(g_d[b * 16 + r]), acc[r]);
  }
}

template <Variant V>
KV_AMX_TARGET void pass() {
  for (int g = 0; g < kNg; ++g) {
    alignas(64) int32_t c[2][2][16][16] = {};
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    if constexpr (V == kVector) {
      for (int b = 0; b < kNb; ++b) steps(g, b, g_fake[b % 2], acc);
    } else if constexpr (V == kTiles) {
      _tile_zero(0);
      _tile_zero(1);
      for (int b = 0; b < kNb; ++b) {
        _tile_loadd(4, g_b[g][b], 64);
        _tile_loadd(2, g_a1 + b * 32, kNb * 32);
        _tile_loadd(3, g_a2 + b * 32, kNb * 32);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 3, 4);
      }
      stores(c[0]);
    } else if constexpr (V == kInterleaved || V == kInterleavedF) {
      constexpr bool kF = V == kInterleavedF;
      dps(g, 0);
      stores(c[0]);
      for (int b = 1; b < kNb; ++b) {
        const int32_t(*p)[16][16] = c[(b - 1) % 2];
        _tile_loadd(4, g_b[g][b], 64);
        steps4<4, kF>(g, b - 1, 0, p, acc);
        _tile_loadd(2, g_a1 + b * 32, kNb * 32);
        _tile_loadd(3, g_a2 + b * 32, kNb * 32);
        steps4<4, kF>(g, b - 1, 4, p, acc);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbsud(0, 2, 4);
        steps4<4, kF>(g, b - 1, 8, p, acc);
        _tile_dpbsud(1, 3, 4);
        steps4<4, kF>(g, b - 1, 12, p, acc);
        stores(c[b % 2]);
      }
      steps(g, kNb - 1, c[(kNb - 1) % 2], acc);
    } else if constexpr (V == kPipelined) {
      // iteration b: block b-1's sums leave the tiles, block b's products start, and block
      // b-2's float steps (stored one iteration ago) fill the gaps; three buffers.
      alignas(64) int32_t cb[3][2][16][16];
      dps(g, 0);
      for (int b = 1; b <= kNb + 1; ++b) {
        const int32_t(*p)[16][16] = cb[(b + 1) % 3];  // block b-2
        const bool fin = b >= 2;
        if (b - 1 < kNb) _tile_stored(0, cb[(b - 1) % 3][0], 64);
        if (fin) steps4<2>(g, b - 2, 0, p, acc);
        if (b - 1 < kNb) _tile_stored(1, cb[(b - 1) % 3][1], 64);
        if (fin) steps4<2>(g, b - 2, 2, p, acc);
        if (b < kNb) _tile_loadd(4, g_b[g][b], 64);
        if (fin) steps4<2>(g, b - 2, 4, p, acc);
        if (b < kNb) _tile_loadd(2, g_a1 + b * 32, kNb * 32);
        if (fin) steps4<2>(g, b - 2, 6, p, acc);
        if (b < kNb) _tile_loadd(3, g_a2 + b * 32, kNb * 32);
        if (fin) steps4<2>(g, b - 2, 8, p, acc);
        if (b < kNb) {
          _tile_zero(0);
          _tile_dpbsud(0, 2, 4);
        }
        if (fin) steps4<4>(g, b - 2, 10, p, acc);
        if (b < kNb) {
          _tile_zero(1);
          _tile_dpbsud(1, 3, 4);
        }
        if (fin) steps4<2>(g, b - 2, 14, p, acc);
      }
      c[0][0][0][0] = cb[0][0][0][0];
    } else if constexpr (V == kReordered) {
      dps(g, 0);
      stores(c[0]);
      for (int b = 1; b < kNb; ++b) {
        dps(g, b);
        steps(g, b - 1, c[(b - 1) % 2], acc);
        stores(c[b % 2]);
      }
      steps(g, kNb - 1, c[(kNb - 1) % 2], acc);
    } else {
      for (int b = 0; b < kNb; ++b) {
        dps(g, b);
        stores(c[b % 2]);
        if constexpr (V == kFull)
          if (b > 0) steps(g, b - 1, c[(b - 1) % 2], acc);
        if constexpr (V == kNoDep)
          if (b > 0) steps(g, b - 1, g_fake[(b - 1) % 2], acc);
      }
      if constexpr (V == kFull) steps(g, kNb - 1, c[(kNb - 1) % 2], acc);
      if constexpr (V == kNoDep) steps(g, kNb - 1, g_fake[(kNb - 1) % 2], acc);
    }
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(g_out[g][r], acc[r]);
    g_out[g][0][0] += static_cast<float>(c[0][0][0][0] + c[1][1][15][15]);
  }
}

template <Variant V>
void BM_AmxBlockLoop(benchmark::State& st) {
  if (!kv::cpu_has_amx()) {  // also asks Linux for the tile state
    st.SkipWithError("no AMX-INT8 on this CPU");
    return;
  }
  std::memset(g_b, 3, sizeof g_b);
  std::memset(g_a1, 1, sizeof g_a1);
  std::memset(g_a2, 2, sizeof g_a2);
  for (float& x : g_s) x = 0.5f;
  for (float& x : g_d) x = 0.25f;
  configure();
  for (auto _ : st) {
    pass<V>();
    benchmark::DoNotOptimize(g_out);
  }
  st.counters["ns_per_block"] = benchmark::Counter(static_cast<double>(kNg * kNb) * st.iterations(),
                                                   benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_AmxBlockLoop<kFull>)->Name("BM_AmxBlockLoop/full")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kTiles>)->Name("BM_AmxBlockLoop/tiles")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kTilesStore>)->Name("BM_AmxBlockLoop/tiles_store")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kVector>)->Name("BM_AmxBlockLoop/vector")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kNoDep>)->Name("BM_AmxBlockLoop/no_dep")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kInterleaved>)->Name("BM_AmxBlockLoop/interleaved")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kInterleavedF>)->Name("BM_AmxBlockLoop/interleaved_fsum")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kPipelined>)->Name("BM_AmxBlockLoop/pipelined")->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(BM_AmxBlockLoop<kReordered>)->Name("BM_AmxBlockLoop/reordered")->Repetitions(5)->ReportAggregatesOnly(true);

}  // namespace

BENCHMARK_MAIN();
