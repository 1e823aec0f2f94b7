// AMX matmul kernel over the kInterleaved16 layout (see matmul.h), for batches of rows: Intel's
// tile unit (AMX-INT8) multiplies a tile of up to 16 activation rows by a 16-output group's
// block in one instruction, where VNNI needs one vpdpbusd per row and 64-byte weight vector.
//
// Per 32-element block b of a group: B (tmm4) holds the weights as unsigned bytes in the
// layout the packed records already use (row j = elements 4j..4j+3 of the 16 outputs, 4 bytes
// each; Q4/Q5 nibbles are unpacked once per group into a scratch strip), A (tmm2, tmm3) the
// activations' first and second level (rows of 32 signed bytes, stride n_in), and tdpbsud
// forms the exact integer block sums C1, C2 (tmm0, tmm1) of every row × output. The float steps
// per block then follow matmul.h exactly, in the same order as the VNNI kernel, so every output
// is bit-identical to it (and to the scalar specification) whatever the batch: integer sums are
// exact, however the hardware splits them.
//
// Q6_K (two scales per block) is not handled here: q_gemm_amx returns false and the VNNI kernel
// runs. Compiled with the AVX-512 set plus -mamx-tile -mamx-int8 (CMakeLists.txt); called only
// when cpu_has_amx() said yes, which also asked Linux for the tile state (arch_prctl).
// GCC 12 warns about the undefined-register idiom inside its own AVX-512 intrinsics.
#if !defined(__clang__)  // a GCC-only group (clang warns that it does not know it)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common/huge_alloc.h"
#include "kernels/matmul.h"

namespace kv::matmul_detail {

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers, for two groups g0, g1 at a time (four independent tdpbsud chains, so the tile
// unit pipelines them instead of waiting on each one's latency): 0/1 the block sums of g0's
// level 1/2, 6/7 the same for g1, 2/3 the activations of level 1/2, 4/5 the weights of g0/g1.
// The shape depends only on the rows of the tile (m); a thread reloads it when m changes.
thread_local int tl_tile_rows = 0;

void configure(int m) {
  if (tl_tile_rows == m) return;
  TileConfig c;
  for (int t : {0, 1, 6, 7}) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = 64;  // 16 int32 sums per row
  }
  for (int t : {2, 3}) {
    c.rows[t] = static_cast<uint8_t>(m);
    c.colsb[t] = kQK;  // one block of activations per row
  }
  for (int t : {4, 5}) {
    c.rows[t] = kQK / 4;  // 8 rows of 4 elements × 16 outputs
    c.colsb[t] = 64;
  }
  // Not _tile_loadconfig: GCC 12's version tells the compiler it reads only the first 8 bytes,
  // so the stores of the shapes may be dropped (an illegal-instruction fault at the first load).
  asm volatile("ldtilecfg %0" ::"m"(c));
  tl_tile_rows = m;
}

// The group's weights as tdpbsud's B operand, one 512-byte strip per block.
struct Strip {
  uint8_t* p = nullptr;
  int64_t cap = 0;
  ~Strip() { huge_free(p); }
  uint8_t* get(int64_t bytes) {
    if (bytes > cap) {
      huge_free(p);
      p = static_cast<uint8_t*>(huge_alloc(static_cast<size_t>(bytes)));
      cap = bytes;
    }
    return p;
  }
};
thread_local Strip tl_strip;

constexpr int64_t kStripBlock = 512;

template <QFmt F>
void unpack_group(const uint8_t* grp, int64_t nb, uint8_t* out) {
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(0x10);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = grp + b * kRec;
    uint8_t* o = out + b * kStripBlock;
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(blk + kQo + 64 * j);
      __m512i lo = _mm512_and_si512(v, m4);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      if constexpr (F == QFmt::kQ5_0) {
        uint64_t klo, khi;
        std::memcpy(&klo, blk + 32 + 16 * j, 8);
        std::memcpy(&khi, blk + 40 + 16 * j, 8);
        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(klo), lo, b16);
        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(khi), hi, b16);
      }
      _mm512_store_si512(o + 64 * j, lo);        // elements 4j..4j+3
      _mm512_store_si512(o + 64 * (4 + j), hi);  // elements 16+4j..16+4j+3
    }
  }
}

template <QFmt F>
inline void block_scales(const uint8_t* blk, __m512* dw, __m512* mw) {
  if constexpr (F == QFmt::kQ4_K) {
    *dw = _mm512_load_ps(blk);
    *mw = _mm512_load_ps(blk + 64);
  } else {
    *dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk)));
    if constexpr (F == QFmt::kQ4_1)
      *mw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    else if constexpr (F == QFmt::kQ4_0)
      *mw = _mm512_mul_ps(*dw, _mm512_set1_ps(-8.0f));
    else
      *mw = *dw;
  }
}

// 4-bit weights with two levels: the level sum kLevel2·c1 + c2 is formed in float (two
// conversions and one FMA instead of vpmulld, vpaddd and a conversion), the same float as the
// integer path's: c1 and c2 are exact in float (|c| ≤ 32 · 127 · 15), and the FMA rounds the
// exact sum once, as the conversion of the integer sum does (here it is even exact:
// 254 · 60,960 + 60,960 < 2^24). Not for Q5_0 or Q8_0, whose offset term would be a second
// rounding.
template <QFmt F, bool T>
constexpr bool kFloatLevelSum = T && (F == QFmt::kQ4_0 || F == QFmt::kQ4_1 || F == QFmt::kQ4_K);

// The VNNI kernel's float steps for one block of one row (matmul_avx512.cpp, tile(), same order).
template <QFmt F, bool T>
inline __m512 block_step(const int32_t* c1, const int32_t* c2, const QAct& a, int64_t row, int64_t b, __m512 dw,
                         __m512 mw, __m512 acc) {
  __m512 sum;
  if constexpr (kFloatLevelSum<F, T>) {
    sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c1)), _mm512_set1_ps(static_cast<float>(kLevel2)),
                          _mm512_cvtepi32_ps(_mm512_load_si512(c2)));
  } else {
    __m512i i = _mm512_load_si512(c1);
    if constexpr (T) i = _mm512_add_epi32(_mm512_mullo_epi32(i, _mm512_set1_epi32(kLevel2)), _mm512_load_si512(c2));
    if constexpr (F == QFmt::kQ8_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(a.s128[row * a.nb + b]));
    if constexpr (F == QFmt::kQ5_0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(a.s128[row * a.nb + b] / 8));
    sum = _mm512_cvtepi32_ps(i);
  }
  __m512 t = _mm512_mul_ps(dw, sum);
  if constexpr (F == QFmt::kQ4_0 || F == QFmt::kQ4_1 || F == QFmt::kQ4_K)
    t = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[row * a.nb + b]), t);
  return _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[row * a.nb + b]), acc);
}

// Rows [r0, r0 + m) × groups [g, g + G) (G = 1 or 2), all blocks. strip: the groups' unpacked
// weights, G strips of nb blocks.
template <QFmt F, bool T, int G>
void rows_groups(const QWeights& w, const QAct& a, int64_t r0, int m, int64_t g, const uint8_t* strip, float* y) {
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  const int64_t gstride = w.nb * kRec;
  const uint8_t* base = w.data + (g - w.g_base) * gstride;
  alignas(64) int32_t c[G][2][16][16];
  alignas(64) float acc[G][16][16];
  for (int k = 0; k < G; ++k)
    for (int r = 0; r < m; ++r) _mm512_store_ps(acc[k][r], _mm512_setzero_ps());
  const int8_t* q1 = a.q + r0 * a.n_in;
  const int8_t* q2 = T ? a.q2 + r0 * a.n_in : nullptr;
  for (int64_t b = 0; b < w.nb; ++b) {
    if constexpr (F == QFmt::kQ8_0) {
      _tile_loadd(4, base + b * kRec + kQo, 64);
      if constexpr (G == 2) _tile_loadd(5, base + gstride + b * kRec + kQo, 64);
    } else {
      _tile_loadd(4, strip + b * kStripBlock, 64);
      if constexpr (G == 2) _tile_loadd(5, strip + (w.nb + b) * kStripBlock, 64);
    }
    _tile_loadd(2, q1 + b * kQK, a.n_in);
    if constexpr (T) _tile_loadd(3, q2 + b * kQK, a.n_in);
    _tile_zero(0);
    if constexpr (G == 2) _tile_zero(6);
    if constexpr (T) {
      _tile_zero(1);
      if constexpr (G == 2) _tile_zero(7);
    }
    _tile_dpbsud(0, 2, 4);
    if constexpr (G == 2) _tile_dpbsud(6, 2, 5);
    if constexpr (T) {
      _tile_dpbsud(1, 3, 4);
      if constexpr (G == 2) _tile_dpbsud(7, 3, 5);
    }
    _tile_stored(0, c[0][0], 64);
    if constexpr (G == 2) _tile_stored(6, c[G - 1][0], 64);
    if constexpr (T) {
      _tile_stored(1, c[0][1], 64);
      if constexpr (G == 2) _tile_stored(7, c[G - 1][1], 64);
    }
    for (int k = 0; k < G; ++k) {
      __m512 dw, mw;
      block_scales<F>(base + k * gstride + b * kRec, &dw, &mw);
      for (int r = 0; r < m; ++r)
        _mm512_store_ps(acc[k][r], block_step<F, T>(c[k][0][r], c[k][1][r], a, r0 + r, b, dw, mw, _mm512_load_ps(acc[k][r])));
    }
  }
  for (int k = 0; k < G; ++k) {
    const int64_t o = (g + k) * kGroup, rem = w.n_out - o;
    for (int r = 0; r < m; ++r) {
      float* yp = y + (r0 + r) * w.n_out + o;
      if (rem >= kGroup)
        _mm512_storeu_ps(yp, _mm512_load_ps(acc[k][r]));
      else if (rem > 0)
        _mm512_mask_storeu_ps(yp, static_cast<__mmask16>((1u << rem) - 1), _mm512_load_ps(acc[k][r]));
    }
  }
}

// 16 rows [r0, r0 + 16) × one group g. The tile unit's work and the vector units' do not
// overlap by themselves, even without a dependency between them (bench/bench_amx.cpp), so the
// loop interleaves them by hand: block b's tile loads and products are issued between the
// 4-row quarters of block b−1's float steps (from the buffer its sums were stored to), then
// block b's sums are stored to the other buffer. The 16 rows' accumulators stay in registers.
// (Measured slower: all float steps after the stores; a two-deep pipeline with three buffers;
// two groups at once, four tdpbsud per block.)
template <QFmt F, bool T>
void rows16_group(const QWeights& w, const QAct& a, int64_t r0, int64_t g, const uint8_t* strip, float* y) {
  constexpr int64_t kRec = record_bytes(F), kQo = quant_offset(F);
  const uint8_t* base = w.data + (g - w.g_base) * w.nb * kRec;
  alignas(64) int32_t c[2][2][16][16];  // [buffer][level][row][output]
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* q1 = a.q + r0 * a.n_in;
  const int8_t* q2 = T ? a.q2 + r0 * a.n_in : nullptr;
  auto load_weights = [&](int64_t b) {
    if constexpr (F == QFmt::kQ8_0) _tile_loadd(4, base + b * kRec + kQo, 64);
    else _tile_loadd(4, strip + b * kStripBlock, 64);
  };
  auto load_acts = [&](int64_t b) {
    _tile_loadd(2, q1 + b * kQK, a.n_in);
    if constexpr (T) _tile_loadd(3, q2 + b * kQK, a.n_in);
  };
  auto product1 = [&] {
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
  };
  auto product2 = [&] {
    if constexpr (T) {
      _tile_zero(1);
      _tile_dpbsud(1, 3, 4);
    }
  };
  auto store = [&](int64_t b) {
    _tile_stored(0, c[b % 2][0], 64);
    if constexpr (T) _tile_stored(1, c[b % 2][1], 64);
  };
  // Rows [q, q + 4) of block b's float steps, from buffer b % 2.
  auto quarter = [&](int64_t b, int q, __m512 dw, __m512 mw) {
#pragma GCC unroll 4
    for (int r = q; r < q + 4; ++r) acc[r] = block_step<F, T>(c[b % 2][0][r], c[b % 2][1][r], a, r0 + r, b, dw, mw, acc[r]);
  };
  load_weights(0);
  load_acts(0);
  product1();
  product2();
  store(0);
  __m512 dw, mw;
  for (int64_t b = 1; b < w.nb; ++b) {
    block_scales<F>(base + (b - 1) * kRec, &dw, &mw);
    load_weights(b);
    quarter(b - 1, 0, dw, mw);
    load_acts(b);
    quarter(b - 1, 4, dw, mw);
    product1();
    quarter(b - 1, 8, dw, mw);
    product2();
    quarter(b - 1, 12, dw, mw);
    store(b);
  }
  block_scales<F>(base + (w.nb - 1) * kRec, &dw, &mw);
  for (int q = 0; q < 16; q += 4) quarter(w.nb - 1, q, dw, mw);
  const int64_t o = g * kGroup, rem = w.n_out - o;
  for (int r = 0; r < 16; ++r) {
    float* yp = y + (r0 + r) * w.n_out + o;
    if (rem >= kGroup)
      _mm512_storeu_ps(yp, acc[r]);
    else if (rem > 0)
      _mm512_mask_storeu_ps(yp, static_cast<__mmask16>((1u << rem) - 1), acc[r]);
  }
}

template <QFmt F, bool T>
void run(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  constexpr int64_t kRec = record_bytes(F);
  uint8_t* strip = F == QFmt::kQ8_0 ? nullptr : tl_strip.get(2 * w.nb * kStripBlock);
  const int64_t full = n_rows / 16 * 16;
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 2 <= g1;
    if constexpr (F != QFmt::kQ8_0)
      for (int k = 0; k < (two ? 2 : 1); ++k)
        unpack_group<F>(w.data + (g + k - w.g_base) * w.nb * kRec, w.nb, strip + k * w.nb * kStripBlock);
    if (full > 0) {
      configure(16);
      for (int k = 0; k < (two ? 2 : 1); ++k)
        for (int64_t r0 = 0; r0 < full; r0 += 16)  // (Q8_0 reads its records directly: no strip)
          rows16_group<F, T>(w, a, r0, g + k, F == QFmt::kQ8_0 ? nullptr : strip + k * w.nb * kStripBlock, y);
    }
    if (full < n_rows) {  // the last rows, fewer than 16
      configure(static_cast<int>(n_rows - full));
      if (two)
        rows_groups<F, T, 2>(w, a, full, static_cast<int>(n_rows - full), g, strip, y);
      else
        rows_groups<F, T, 1>(w, a, full, static_cast<int>(n_rows - full), g, strip, y);
    }
  }
}

template <QFmt F>
void run_any(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  if (a.two)
    run<F, true>(w, a, n_rows, g0, g1, y);
  else
    run<F, false>(w, a, n_rows, g0, g1, y);
}

}  // namespace

bool q_gemm_amx(const QWeights& w, const QAct& a, int64_t n_rows, int64_t g0, int64_t g1, float* y) {
  // Other code in the process (another library's AMX kernels) may have loaded its own tile
  // shapes since this thread's last call: load ours again at the first tile of every call.
  tl_tile_rows = 0;
  switch (w.fmt) {
    case QFmt::kQ4_0: run_any<QFmt::kQ4_0>(w, a, n_rows, g0, g1, y); return true;
    case QFmt::kQ4_1: run_any<QFmt::kQ4_1>(w, a, n_rows, g0, g1, y); return true;
    case QFmt::kQ8_0: run_any<QFmt::kQ8_0>(w, a, n_rows, g0, g1, y); return true;
    case QFmt::kQ5_0: run_any<QFmt::kQ5_0>(w, a, n_rows, g0, g1, y); return true;
    case QFmt::kQ4_K: run_any<QFmt::kQ4_K>(w, a, n_rows, g0, g1, y); return true;
    case QFmt::kQ6_K: return false;
  }
  return false;
}

}  // namespace kv::matmul_detail
