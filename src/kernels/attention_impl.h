// Paged attention kernels (attention.h), compiled once per ISA: included by attention_scalar.cpp,
// attention_avx2.cpp and attention_avx512.cpp, each defining KV_ISA_NS (scalar, avx2, avx512)
// and compiled with that ISA's flags. Not an ordinary header: no include guard, and nothing
// else may include it. The preprocessor picks the path that the including file's flags allow:
// AVX-512 intrinsics (__AVX512F__ && __AVX512BW__), else the same structure on AVX2 + FMA +
// F16C intrinsics (8-lane halves), else the portable loops (the baseline, SSE2).
// Everything here is in namespace kv::KV_ISA_NS (see isa_kernels.h for the ODR rules).
#ifndef KV_ISA_NS
#error "attention_impl.h is included by attention_{scalar,avx2,avx512}.cpp only"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/isa_kernels.h"
#include "kernels/prefetch.h"
#include "kernels/quant.h"

namespace kv::KV_ISA_NS {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxRows = kAttnQTile * kAttnMaxGroup;

// Pages per online-softmax update. A page is only 16 keys by default: paying the row max, the
// correction exp and the accumulator rescale once per group of pages instead of once per page
// is what long-context decode gains here (the q·k and p·v work itself is the same).
constexpr int kGroupPages = 4;
constexpr int kGroupKeys = kGroupPages * kAttnMaxBlockSize;  // score buffer width per row

// Asks for a tile's cache lines ahead of use. Inline asm, not _mm_prefetch: GCC may delete a
// loop whose only statements are prefetch builtins (no side effects, assumed finite).
// The level follows kernels/prefetch.h's attention_prefetch_level() (L1 on Intel and AMD Zen 5,
// L2 on earlier AMD).
inline void prefetch_tile(const uint8_t* p, int64_t bytes) {
  static const PrefetchLevel level = attention_prefetch_level();
  if (level == PrefetchLevel::kT1) {
    for (int64_t o = 0; o < bytes; o += 64) asm volatile("prefetcht1 %0" ::"m"(p[o]));
  } else if (level == PrefetchLevel::kT0) {
    for (int64_t o = 0; o < bytes; o += 64) asm volatile("prefetcht0 %0" ::"m"(p[o]));
  }
}

// Tiles to prefetch while a page group computes, asked for a few lines at a time between the
// group's page loops (issue()) rather than all at the group's start: on AMD Zen 4 a burst of
// 256 prefetches ahead of a 4-page group left the loads waiting (see attend).
struct TilePrefetch {
  const uint8_t* p[2 * kGroupPages];
  int64_t end[2 * kGroupPages];  // bytes of tile t
  int n = 0, t = 0;
  int64_t o = 0, left = 0;  // next byte of tile t; lines not yet asked for
  int shares = 1;           // group_rows calls still to come in this group (one per KV head)
  void add(const uint8_t* tile, int64_t bytes) {
    p[n] = tile;
    end[n++] = bytes;
    left += (bytes + 63) / 64;
  }
  int64_t step(int parts) const { return (left + parts * shares - 1) / (parts * shares); }  // lines per part
  void issue(int64_t lines) {
    for (; lines > 0 && t < n; ++t, o = 0) {
      const int64_t take = std::min(lines, (end[t] - o + 63) / 64);
      prefetch_tile(p[t] + o, take * 64);
      o += take * 64;
      lines -= take;
      left -= take;
      if (o < end[t]) return;
    }
  }
};

// The tiles of the pages a few pages ahead of each page of a group, in the K and in the V
// stream (null: none), asked for as the page's scores and values are computed.
struct StreamAhead {
  const uint8_t* k[kGroupPages] = {};
  const uint8_t* v[kGroupPages] = {};
  int64_t k_bytes = 0, v_bytes = 0;
};

// The rows of one query tile and their running softmax state.
struct Rows {
  int n = 0;
  const float* qs[kMaxRows];  // query row pre-multiplied by the softmax scale
  int64_t pos[kMaxRows];      // the row's position (causal bound)
  float* acc[kMaxRows];       // Σ p·v, head_dim floats
  float* m;                   // running max
  float* l;                   // running Σ p
  float* lse = nullptr;       // optional per-page log-sum-exp: row r, page index pg at
  int64_t lse_stride = 0;     //   lse[r * lse_stride + pg - lse_page0]
  int64_t lse_page0 = 0;
  TilePrefetch* pf = nullptr;  // optional: tiles to ask for while a group computes
};

// Which copy of a page a query reads: a page that has a staging slot is read from staging by
// the queries whose own page it is (it is still filling, or was filled by this very pass);
// queries on later pages read its quantized tiles — what they would read decoding one token
// at a time.
bool has_stage(const PagedKvView& kv, int32_t page) { return kv.stage_of && kv.stage_of[page] >= 0; }
const uint8_t* k_tile(const PagedKvView& kv, int32_t page, int head, bool staged) {
  if (staged)
    return kv.k_stage + kv.stage_of[page] * kv.stage_bytes + head * kv_stage_tile_bytes(kv.block_size, kv.head_dim);
  return kv.k_base + page * kv.k_page_bytes + head * kv_k_tile_bytes(kv.elem, kv.block_size, kv.head_dim);
}
const uint8_t* v_tile(const PagedKvView& kv, int32_t page, int head, bool staged) {
  if (kv.v_from_k > 0) return nullptr;  // values come from the K tile
  if (staged)
    return kv.v_stage + kv.stage_of[page] * kv.stage_bytes + head * kv_stage_tile_bytes(kv.block_size, kv.head_dim);
  return kv.v_base + page * kv.v_page_bytes + head * kv_v_tile_bytes(kv.elem, kv.block_size, kv.head_dim);
}

// Keys of the page [key0, key0 + n_keys) a row at `pos` may see.
inline void visible(int64_t pos, int64_t key0, int n_keys, int32_t window, int* lo, int* hi) {
  *hi = static_cast<int>(std::clamp<int64_t>(pos + 1 - key0, 0, n_keys));
  *lo = window > 0 ? static_cast<int>(std::clamp<int64_t>(pos - window + 1 - key0, 0, *hi)) : 0;
}

// One page of a group as the kernels see it.
struct PageRef {
  const uint8_t* kt;  // K tile
  const uint8_t* vt;  // V tile (MLA: the caller's f32 token-major copy of the K tile)
  int64_t key0;       // position of slot 0
  int n_keys;         // valid slots
  bool f16 = false;   // the tiles are a staging copy at f16, whatever the group's element type
};


#if defined(__AVX512F__) && defined(__AVX512BW__)

// e^x for 16 lanes: x = n·ln2 + r, |r| ≤ ln2/2, degree-6 polynomial, scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 bytes of fp8 → 16 floats (e4m3 comes out 2^-8 too small; the caller's scale has the 256).
inline __m512 fp8x16(__m128i b, bool e4m3) {
  const __m256i w = _mm256_cvtepu8_epi16(b);
  __m256i h;
  if (e4m3)
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  else
    h = _mm256_slli_epi16(w, 8);
  return _mm512_cvtph_ps(h);
}
// 8 bytes of nibbles → 16 floats: the low nibbles then the high nibbles.
inline __m512 nib8x16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i x = _mm_unpacklo_epi64(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
}
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 consecutive values (masked to `mask` lanes) of an unquantized or fp8/int8 run at element i.
template <KvElem E>
inline __m512 load16(const uint8_t* base, int64_t i, __mmask16 mask) {
  if constexpr (E == KvElem::kF32) return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(base) + i);
  if constexpr (E == KvElem::kF16)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(base) + i));
  if constexpr (E == KvElem::kBF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, reinterpret_cast<const uint16_t*>(base) + i)), 16));
  if constexpr (E == KvElem::kFp8E4M3 || E == KvElem::kFp8E5M2)
    return fp8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + i)), E == KvElem::kFp8E4M3);
  if constexpr (E == KvElem::kInt8) return u8x16(base + i);
  return _mm512_setzero_ps();
}

// K: channel d, keys [c·16, c·16 + 16) of a channel-major tile.
template <KvElem E>
inline __m512 load_k(const uint8_t* kt, int bs, int d, int c, __mmask16 mask) {
  if constexpr (E == KvElem::kInt4) return nib8x16(kt + int64_t(d) * (bs / 2) + c * 8);
  return load16<E>(kt, int64_t(d) * bs + c * 16, mask);
}
// V: token j, channels [cc·16, cc·16 + 16) of a token-major tile (G: int4 group size).
template <KvElem E>
inline __m512 load_v(const uint8_t* vt, int hd, int G, int j, int cc) {
  if constexpr (E == KvElem::kInt4) {
    const int ch = cc * 16, g = ch / G;
    const uint8_t* p = vt + int64_t(j) * (hd / 2) + g * (G / 2);
    if (G == 16) return nib8x16(p);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i x = (ch % G) == 0 ? _mm_and_si128(b, _mm_set1_epi8(0x0F))
                                    : _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
  }
  return load16<E>(vt, int64_t(j) * hd + cc * 16, 0xFFFF);
}

constexpr int64_t values_bytes(KvElem e, int64_t n) {
  return e == KvElem::kF32 ? 4 * n : (e == KvElem::kF16 || e == KvElem::kBF16) ? 2 * n : e == KvElem::kInt4 ? n / 2 : n;
}

// Scores of one page for rows [r0, r0 + NR) into s[r][off, off + n_chunks·16): q·k, 16 keys
// per vector, one FMA per channel and row (two accumulator sets for ILP). Int keys: the
// per-channel scales are folded into the query and the zero points add one constant per row;
// fp8 keys: the tile scale is folded into the query, the channel midpoints likewise add one
// constant per row.
template <KvElem E, int NR>
inline void page_scores(const uint8_t* kt, int bs, int hd, int n_keys, const Rows& rows, int r0,
                        float (*s)[kGroupKeys], int off) {
  constexpr bool kInt = E == KvElem::kInt8 || E == KvElem::kInt4;
  constexpr bool kFp8 = E == KvElem::kFp8E4M3 || E == KvElem::kFp8E5M2;
  const int64_t n = int64_t(bs) * hd;
  const int n_chunks = (n_keys + 15) / 16;
  alignas(64) float qe[(kInt || kFp8) ? NR : 1][kAttnMaxHeadDim];  // q·scale·(per-channel / tile scale)
  float cadd[NR] = {};  // Σ q·scale·zero (int keys' min, fp8 keys' channel midpoint)
  if constexpr (kInt || kFp8) {
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(kt + values_bytes(E, n));
    alignas(64) float ks[kAttnMaxHeadDim], kz[kAttnMaxHeadDim];
    if constexpr (kFp8) {  // one tile scale (e4m3: ×256, see fp8x16), then f16 zero points
      float ts;
      std::memcpy(&ts, meta, 4);
      const __m512 tv = _mm512_set1_ps(E == KvElem::kFp8E4M3 ? ts * 256.f : ts);
      for (int d = 0; d < hd; d += 16) {
        _mm512_store_ps(ks + d, tv);
        _mm512_store_ps(kz + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 2 + d))));
      }
    } else {
      for (int d = 0; d < hd; d += 16) {  // meta pairs {scale, min} per channel: deinterleave 16 pairs
        const __m512i pr = _mm512_loadu_si512(meta + 2 * d);
        _mm512_store_ps(ks + d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pr)));
        _mm512_store_ps(kz + d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pr, 16))));
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float* q = rows.qs[r0 + r];
      __m512 c = _mm512_setzero_ps();
      for (int d = 0; d < hd; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        _mm512_store_ps(qe[r] + d, _mm512_mul_ps(qv, _mm512_load_ps(ks + d)));
        c = _mm512_fmadd_ps(qv, _mm512_load_ps(kz + d), c);
      }
      cadd[r] = _mm512_reduce_add_ps(c);
    }
  }
  auto qrow = [&](int r) -> const float* {
    if constexpr (kInt || kFp8) return qe[r];
    return rows.qs[r0 + r];
  };
  auto chunk = [&](int c, auto full) {
    // full: all 16 slots of the chunk exist (bs a multiple of 16, the usual case), so the
    // loads need no mask and fold into the conversions
    const __mmask16 mask = full ? 0xFFFF : static_cast<__mmask16>((1u << std::min(16, bs - c * 16)) - 1);
    __m512 a0[NR] = {}, a1[NR] = {};
    for (int d = 0; d + 2 <= hd; d += 2) {
      const __m512 k0 = load_k<E>(kt, bs, d, c, mask);
      const __m512 k1 = load_k<E>(kt, bs, d + 1, c, mask);
      for (int r = 0; r < NR; ++r) {
        a0[r] = _mm512_fmadd_ps(_mm512_set1_ps(qrow(r)[d]), k0, a0[r]);
        a1[r] = _mm512_fmadd_ps(_mm512_set1_ps(qrow(r)[d + 1]), k1, a1[r]);
      }
    }
    for (int r = 0; r < NR; ++r)
      _mm512_store_ps(s[r] + off + c * 16, _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_set1_ps(cadd[r])));
  };
  for (int c = 0; c < n_chunks; ++c) {
    if (bs - c * 16 >= 16) chunk(c, std::true_type{});
    else chunk(c, std::false_type{});
  }
}

// One group of n_pg pages against NR rows [r0, r0 + NR), in phases: the scores of each page
// (group_page_scores), one online-softmax update per row for the whole group (group_softmax),
// then Σ p·v over a range of pages (group_values) between group_values_begin and group_values_end.
// The phases take the pages one at a time so that several KV heads' groups can interleave page
// by page (group_heads): a page's head tiles are neighbours in the pool, so the K tiles of the
// group's pages are read front to back, then its V tiles. K tiles of type E; V tiles of type EV
// (E, or f32 for MLA: the K tile's first dv channels made token-major by the caller),
// token-major with row stride hd; dv value channels (hd, or C).
template <int NR>
struct GroupRows {
  int lo[kGroupPages][NR], hi[kGroupPages][NR];
  int j_end[kGroupPages];  // one past the last key any row sees in page i (0: none)
  int cpp = 1;             // 16-key chunks per page in the score buffer
  bool full = false;       // every row sees every slot of every page
  alignas(64) float s[NR][kGroupKeys];  // scores, then p; page i at s[r][i·cpp·16, ...)
  float corr[NR];                       // e^(m_old − m_new) of the group's update
};

// group_heads' Σ p·v of one head's group between its pages, two sums per channel for ILP:
// a0 = corr·acc + the even keys', a1 = the odd keys'; acc = a0 + a1 at the group's end (the
// order of group_rows' register-held sums: the same bits). Kept here, not in the rows'
// accumulators, between pages: those may share cache lines with another thread's.
template <int NR>
struct GroupSums {
  alignas(64) float a0[NR][kAttnMaxHeadDim];
  alignas(64) float a1[NR][kAttnMaxHeadDim];
};

// Visibility of the group's pages for each row; false when no row sees any key.
template <int NR>
__attribute__((always_inline)) inline bool group_begin(GroupRows<NR>& G, const PageRef* pg, int n_pg, int bs, int32_t window, const Rows& rows, int r0) {
  bool any = false;
  G.cpp = (bs + 15) / 16;
  G.full = bs % 16 == 0;
  for (int i = 0; i < n_pg; ++i) {
    G.j_end[i] = 0;
    for (int r = 0; r < NR; ++r) {
      visible(rows.pos[r0 + r], pg[i].key0, pg[i].n_keys, window, &G.lo[i][r], &G.hi[i][r]);
      if (G.hi[i][r] > G.lo[i][r]) G.j_end[i] = std::max(G.j_end[i], G.hi[i][r]);
      G.full &= G.lo[i][r] == 0 && G.hi[i][r] == bs;
    }
    any |= G.j_end[i] > 0;
  }
  return any;
}

template <KvElem E, int NR>
__attribute__((always_inline)) inline void group_page_scores(GroupRows<NR>& G, const PageRef& p, int i, int bs, int hd, const Rows& rows, int r0) {
  if (G.j_end[i] == 0) return;
  if (kv_elem_staged(E) && p.f16) page_scores<KvElem::kF16, NR>(p.kt, bs, hd, p.n_keys, rows, r0, G.s, i * G.cpp * 16);
  else page_scores<E, NR>(p.kt, bs, hd, p.n_keys, rows, r0, G.s, i * G.cpp * 16);
}

// One online-softmax update per row for the group; s becomes p (0 where the row sees no key).
template <int NR>
__attribute__((always_inline)) inline void group_softmax(GroupRows<NR>& G, const PageRef* pg, int n_pg, int bs, Rows& rows, int r0) {
  const int cpp = G.cpp;
  if (G.full && !rows.lse) {
    // Every row sees every key of the group (decode, away from a part's last page): the rows'
    // steps interleaved, so one row's reductions and exponentials overlap the others' (each
    // row's operations and their order are those of the loop below: the same bits).
    const int nk = n_pg * cpp;
    __m512 mxv[NR];
    for (int r = 0; r < NR; ++r) mxv[r] = _mm512_set1_ps(kNegInf);
    for (int k = 0; k < nk; ++k)
      for (int r = 0; r < NR; ++r) mxv[r] = _mm512_max_ps(mxv[r], _mm512_load_ps(G.s[r] + k * 16));
    float mx[NR];
    bool none = false;
    for (int r = 0; r < NR; ++r) none |= (mx[r] = _mm512_reduce_max_ps(mxv[r])) == kNegInf;
    if (!none) {
      __m512 mv[NR], sum[NR];
      for (int r = 0; r < NR; ++r) {
        const float m_old = rows.m[r0 + r], m_new = std::max(m_old, mx[r]);
        G.corr[r] = m_new == m_old ? 1.f : std::exp(m_old - m_new);
        rows.m[r0 + r] = m_new;
        mv[r] = _mm512_set1_ps(m_new);
        sum[r] = _mm512_setzero_ps();
      }
      for (int k = 0; k < nk; ++k)
        for (int r = 0; r < NR; ++r) {
          const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(G.s[r] + k * 16), mv[r]));
          _mm512_store_ps(G.s[r] + k * 16, p);
          sum[r] = _mm512_add_ps(sum[r], p);
        }
      for (int r = 0; r < NR; ++r) rows.l[r0 + r] = rows.l[r0 + r] * G.corr[r] + _mm512_reduce_add_ps(sum[r]);
      return;
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int row = r0 + r;
    float* s = G.s[r];
    __mmask16 vm[kGroupKeys / 16];
    __m512 mxv = _mm512_set1_ps(kNegInf);
    for (int i = 0; i < n_pg; ++i)
      for (int c = 0; c < cpp; ++c) {
        const int j0 = c * 16, k = i * cpp + c;
        if (G.full) {
          vm[k] = 0xFFFF;
        } else {
          const int a = std::clamp(G.lo[i][r] - j0, 0, 16), b = std::clamp(G.hi[i][r] - j0, 0, 16);
          vm[k] = static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
        }
        if (vm[k]) mxv = _mm512_mask_max_ps(mxv, vm[k], mxv, _mm512_load_ps(s + k * 16));
      }
    const float mx = _mm512_reduce_max_ps(mxv);
    if (mx == kNegInf) {  // the row sees none of the group's keys
      G.corr[r] = 1.f;
      for (int k = 0; k < n_pg * cpp; ++k) _mm512_store_ps(s + k * 16, _mm512_setzero_ps());
      continue;
    }
    const float m_old = rows.m[row], m_new = std::max(m_old, mx);
    G.corr[r] = m_new == m_old ? 1.f : std::exp(m_old - m_new);  // deep in a context the max rarely moves
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < n_pg * cpp; ++k) {
      const __m512 p = vm[k] ? _mm512_maskz_mov_ps(vm[k], exp16(_mm512_sub_ps(_mm512_load_ps(s + k * 16), mv)))
                             : _mm512_setzero_ps();
      _mm512_store_ps(s + k * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
    rows.l[row] = rows.l[row] * G.corr[r] + _mm512_reduce_add_ps(sum);
    rows.m[row] = m_new;
    if (rows.lse) {  // eviction scores: each page's share, as a log-sum-exp at this row's max
      for (int i = 0; i < n_pg; ++i) {
        __m512 ps = _mm512_setzero_ps();
        for (int c = 0; c < cpp; ++c) ps = _mm512_add_ps(ps, _mm512_load_ps(s + (i * cpp + c) * 16));
        const float t = _mm512_reduce_add_ps(ps);
        if (t > 0.f) rows.lse[row * rows.lse_stride + pg[i].key0 / bs - rows.lse_page0] = m_new + std::log(t);
      }
    }
  }
}

// a0 = corr·acc, a1 = 0.
template <int NR>
__attribute__((always_inline)) inline void group_values_begin(const GroupRows<NR>& G, GroupSums<NR>& S, const Rows& rows, int r0, int dv) {
  for (int r = 0; r < NR; ++r) {
    const float* acc = rows.acc[r0 + r];
    const __m512 c = _mm512_set1_ps(G.corr[r]);
    for (int cc = 0; cc < dv / 16; ++cc) {
      _mm512_store_ps(S.a0[r] + cc * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + cc * 16), c));
      _mm512_store_ps(S.a1[r] + cc * 16, _mm512_setzero_ps());
    }
  }
}

// acc = a0 + a1.
template <int NR>
__attribute__((always_inline)) inline void group_values_end(const GroupSums<NR>& S, Rows& rows, int r0, int dv) {
  for (int r = 0; r < NR; ++r) {
    float* acc = rows.acc[r0 + r];
    for (int cc = 0; cc < dv / 16; ++cc)
      _mm512_storeu_ps(acc + cc * 16, _mm512_add_ps(_mm512_load_ps(S.a0[r] + cc * 16), _mm512_load_ps(S.a1[r] + cc * 16)));
  }
}

// Pages [i0, i1)'s Σ p·v into the group's sums, 16 channels at a time across those pages; float
// pages (f32, f16, bf16), whose value weights are p itself. Any split of the group into ranges
// gives the same bits.
template <KvElem EV, int NR>
__attribute__((always_inline)) inline void group_values(const GroupRows<NR>& G, GroupSums<NR>& S, const PageRef* pg,
                                                        int i0, int i1, int hd, int dv) {
  static_assert(EV == KvElem::kF32 || EV == KvElem::kF16 || EV == KvElem::kBF16, "float pages only");
  // C chunks of 16 channels at once (2: twice the independent sums of one chunk); each sum
  // takes its keys in the same order either way.
  auto pv = [&](auto nc, int cc0) __attribute__((always_inline)) {
    constexpr int C = decltype(nc)::value;
    __m512 a0[C][NR], a1[C][NR];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < NR; ++r) {
        a0[c][r] = _mm512_load_ps(S.a0[r] + (cc0 + c) * 16);
        a1[c][r] = _mm512_load_ps(S.a1[r] + (cc0 + c) * 16);
      }
    for (int i = i0; i < i1; ++i) {
      const int je = G.j_end[i], off = i * G.cpp * 16;
      const uint8_t* vt = pg[i].vt;
      int j = 0;
      for (; j + 2 <= je; j += 2)
        for (int c = 0; c < C; ++c) {
          const __m512 v0 = load_v<EV>(vt, hd, hd, j, cc0 + c);
          const __m512 v1 = load_v<EV>(vt, hd, hd, j + 1, cc0 + c);
          for (int r = 0; r < NR; ++r) {
            a0[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(G.s[r][off + j]), v0, a0[c][r]);
            a1[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(G.s[r][off + j + 1]), v1, a1[c][r]);
          }
        }
      if (j < je)
        for (int c = 0; c < C; ++c) {
          const __m512 v0 = load_v<EV>(vt, hd, hd, j, cc0 + c);
          for (int r = 0; r < NR; ++r) a0[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(G.s[r][off + j]), v0, a0[c][r]);
        }
    }
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < NR; ++r) {
        _mm512_store_ps(S.a0[r] + (cc0 + c) * 16, a0[c][r]);
        _mm512_store_ps(S.a1[r] + (cc0 + c) * 16, a1[c][r]);
      }
  };
  const int n_cc = dv / 16;
  int cc = 0;
  for (; cc + 2 <= n_cc; cc += 2) pv(std::integral_constant<int, 2>{}, cc);
  if (cc < n_cc) pv(std::integral_constant<int, 1>{}, cc);
}

// One KV head's group (the way for quantized pages and prefill tiles): the scores of every
// page, the softmax update, then Σ p·v 16 channels at a time with the sums in registers across
// the group's pages, loaded from and stored to the rows' accumulators once per group. Rows::pf's
// tiles are asked for in even parts before each page's scores and each value chunk.
template <KvElem E, KvElem EV, int NR>
void group_rows(const PageRef* pg, int n_pg, int bs, int hd, int dv, int32_t window, Rows& rows, int r0) {
  constexpr bool kIntV = EV == KvElem::kInt8 || EV == KvElem::kInt4;
  constexpr bool kFp8V = EV == KvElem::kFp8E4M3 || EV == KvElem::kFp8E5M2;
  const int64_t n = int64_t(bs) * hd;
  GroupRows<NR> Gr;
  if (!group_begin(Gr, pg, n_pg, bs, window, rows, r0)) return;
  const int cpp = Gr.cpp;
  const int* j_end = Gr.j_end;
  auto& s = Gr.s;
  const float* corr = Gr.corr;

  // 1. scores, page i at s[r][i·cpp·16, ...)
  const int64_t pf_step = rows.pf ? rows.pf->step(n_pg + dv / 16) : 0;
  for (int i = 0; i < n_pg; ++i) {
    if (pf_step) rows.pf->issue(pf_step);
    group_page_scores<E>(Gr, pg[i], i, bs, hd, rows, r0);
  }

  // 2. one online-softmax update per row for the group
  group_softmax(Gr, pg, n_pg, bs, rows, r0);

  // 3. value weights. fp8: p·(tile scale). int: v = min + scale·q per (token, channel group),
  // so Σ p·v = Σ (p·scale)·q + Σ p·min: pw[g][r][j] = p·scale, zr[i][r][g] = Σ_j p·min of page i
  // (added page by page: the two terms nearly cancel, so summing each over the group first
  // would cost precision).
  const int G = kIntV ? kv_v_group(EV, hd) : hd;
  constexpr int kMaxG = kIntV ? kAttnMaxHeadDim / 16 : 1;
  alignas(64) float pw[kMaxG][kIntV ? NR : 1][kIntV ? kGroupKeys : 1];
  float zr[kIntV ? kGroupPages : 1][NR][kMaxG];
  for (int i = 0; i < n_pg; ++i) {
    if (j_end[i] == 0) continue;
    const int off = i * cpp * 16, n_chunks = (j_end[i] + 15) / 16;
    const uint8_t* vt = pg[i].vt;
    if (kv_elem_staged(EV) && pg[i].f16) {  // f16 staging: the weights are p itself
      if constexpr (kIntV)
        for (int r = 0; r < NR; ++r) {
          for (int g = 0; g < hd / G; ++g) {
            zr[i][r][g] = 0.f;
            for (int c = 0; c < n_chunks; ++c) _mm512_store_ps(pw[g][r] + off + c * 16, _mm512_load_ps(s[r] + off + c * 16));
          }
        }
      continue;
    }
    if constexpr (kFp8V) {
      float ts;
      std::memcpy(&ts, vt + n, 4);
      const __m512 tv = _mm512_set1_ps(EV == KvElem::kFp8E4M3 ? ts * 256.f : ts);
      for (int r = 0; r < NR; ++r)
        for (int c = 0; c < n_chunks; ++c)
          _mm512_store_ps(s[r] + off + c * 16, _mm512_mul_ps(_mm512_load_ps(s[r] + off + c * 16), tv));
    }
    if constexpr (kIntV) {
      const int ng = hd / G;
      const uint16_t* meta = reinterpret_cast<const uint16_t*>(vt + values_bytes(EV, n));
      alignas(64) float vs[kAttnMaxBlockSize], vz[kAttnMaxBlockSize];
      for (int g = 0; g < ng; ++g) {
        if (ng == 1) {
          for (int c = 0; c < n_chunks; ++c) {
            const __m512i pr = _mm512_loadu_si512(meta + 2 * c * 16);
            _mm512_store_ps(vs + c * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pr)));
            _mm512_store_ps(vz + c * 16, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pr, 16))));
          }
        } else {
          for (int j = 0; j < n_chunks * 16; ++j) {
            vs[j] = j < bs ? _cvtsh_ss(meta[2 * (j * ng + g)]) : 0.f;
            vz[j] = j < bs ? _cvtsh_ss(meta[2 * (j * ng + g) + 1]) : 0.f;
          }
        }
        for (int r = 0; r < NR; ++r) {
          __m512 z = _mm512_setzero_ps();
          for (int c = 0; c < n_chunks; ++c) {
            const __m512 p = _mm512_load_ps(s[r] + off + c * 16);
            _mm512_store_ps(pw[g][r] + off + c * 16, _mm512_mul_ps(p, _mm512_load_ps(vs + c * 16)));
            z = _mm512_fmadd_ps(p, _mm512_load_ps(vz + c * 16), z);
          }
          zr[i][r][g] = _mm512_reduce_add_ps(z);
        }
      }
    }
  }

  // 4. acc = corr·acc + Σ_pages Σ_j p·v, 16 channels at a time (two chunks at once when they
  // share their value weights: each weight broadcast once for both, where one chunk at a time
  // is bound by the core's loads), loaded and stored once per group. Each chunk's sums take
  // their keys in the same order either way.
  auto chunks = [&](auto nc, int cc0) __attribute__((always_inline)) {
    constexpr int C = decltype(nc)::value;
    const int g = kIntV ? cc0 * 16 / G : 0;
    auto w = [&](int r, int j) -> float {
      if constexpr (kIntV) return pw[g][r][j];
      return s[r][j];
    };
    __m512 a0[C][NR], a1[C][NR];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < NR; ++r) {
        a0[c][r] = _mm512_mul_ps(_mm512_loadu_ps(rows.acc[r0 + r] + (cc0 + c) * 16), _mm512_set1_ps(corr[r]));
        a1[c][r] = _mm512_setzero_ps();
      }
    auto page_pv = [&](const uint8_t* vt, int off, int je, auto ev) {
      constexpr KvElem T = decltype(ev)::value;
      int j = 0;
      for (; j + 2 <= je; j += 2) {
        __m512 w0[NR], w1[NR];
        for (int r = 0; r < NR; ++r) {
          w0[r] = _mm512_set1_ps(w(r, off + j));
          w1[r] = _mm512_set1_ps(w(r, off + j + 1));
        }
        for (int c = 0; c < C; ++c) {
          const __m512 v0 = load_v<T>(vt, hd, G, j, cc0 + c);
          const __m512 v1 = load_v<T>(vt, hd, G, j + 1, cc0 + c);
          for (int r = 0; r < NR; ++r) {
            a0[c][r] = _mm512_fmadd_ps(w0[r], v0, a0[c][r]);
            a1[c][r] = _mm512_fmadd_ps(w1[r], v1, a1[c][r]);
          }
        }
      }
      if (j < je)
        for (int c = 0; c < C; ++c) {
          const __m512 v0 = load_v<T>(vt, hd, G, j, cc0 + c);
          for (int r = 0; r < NR; ++r) a0[c][r] = _mm512_fmadd_ps(_mm512_set1_ps(w(r, off + j)), v0, a0[c][r]);
        }
    };
    for (int i = 0; i < n_pg; ++i) {
      const int off = i * cpp * 16, je = j_end[i];
      if (kv_elem_staged(EV) && pg[i].f16) page_pv(pg[i].vt, off, je, std::integral_constant<KvElem, KvElem::kF16>{});
      else page_pv(pg[i].vt, off, je, std::integral_constant<KvElem, EV>{});
      if constexpr (kIntV)
        if (je > 0)
          for (int c = 0; c < C; ++c)
            for (int r = 0; r < NR; ++r) a1[c][r] = _mm512_add_ps(a1[c][r], _mm512_set1_ps(zr[i][r][g]));
    }
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < NR; ++r) _mm512_storeu_ps(rows.acc[r0 + r] + (cc0 + c) * 16, _mm512_add_ps(a0[c][r], a1[c][r]));
  };
  const int n_cc = dv / 16;
  for (int cc = 0; cc < n_cc;) {
    if (cc + 2 <= n_cc && (!kIntV || cc * 16 / G == (cc + 1) * 16 / G)) {
      if (pf_step) rows.pf->issue(2 * pf_step);
      chunks(std::integral_constant<int, 2>{}, cc);
      cc += 2;
    } else {
      if (pf_step) rows.pf->issue(pf_step);
      chunks(std::integral_constant<int, 1>{}, cc);
      ++cc;
    }
  }
}

// The group for nh KV heads at once, NR rows each (pg[h]: head h's tiles of the same pages):
// page by page, every head's scores, then page by page every head's Σ p·v, so the group's K
// tiles and then its V tiles are read in the order they lie. Before each head's tile of a page,
// that head's tile `ahead` pages on in the same stream is asked for. Each head's rows get the
// bits of group_rows.
template <KvElem E, int NR>
void group_heads(const PageRef (*pg)[kGroupPages], int nh, int n_pg, int bs, int hd, int32_t window, Rows* rows,
                 const StreamAhead& ahead) {
  GroupRows<NR> G[kAttnMaxHeads];
  GroupSums<NR> S[kAttnMaxHeads];
  bool any[kAttnMaxHeads], some = false;
  for (int h = 0; h < nh; ++h) some |= any[h] = group_begin(G[h], pg[h], n_pg, bs, window, rows[h], 0);
  if (!some) return;
  const int64_t kt_bytes = ahead.k_bytes / nh, vt_bytes = ahead.v_bytes / nh;  // one head's tile
  for (int i = 0; i < n_pg; ++i)
    for (int h = 0; h < nh; ++h) {
      if (ahead.k[i]) prefetch_tile(ahead.k[i] + h * kt_bytes, kt_bytes);
      if (any[h]) group_page_scores<E>(G[h], pg[h][i], i, bs, hd, rows[h], 0);
    }
  for (int h = 0; h < nh; ++h)
    if (any[h]) {
      group_softmax(G[h], pg[h], n_pg, bs, rows[h], 0);
      group_values_begin(G[h], S[h], rows[h], 0, hd);
    }
  for (int i = 0; i < n_pg; ++i)
    for (int h = 0; h < nh; ++h) {
      if (ahead.v[i]) prefetch_tile(ahead.v[i] + h * vt_bytes, vt_bytes);
      if (any[h]) group_values<E>(G[h], S[h], pg[h], i, i + 1, hd, hd);
    }
  for (int h = 0; h < nh; ++h)
    if (any[h]) group_values_end(S[h], rows[h], 0, hd);
}

// Whether attend runs a decode group's heads page by page (group_heads): for float pages,
// which wait on memory. Quantized pages are bound by their conversions and keep one head at a
// time with the sums in registers across the group's pages (group_rows): there the page-major
// order measured ×0.955 end to end at 8k (int8, Zen 5 VM, 2026-12-01), where f16 gained.
bool page_major_heads(KvElem e) {
  return (e == KvElem::kF16 || e == KvElem::kBF16 || e == KvElem::kF32) && attention_page_major();
}

// group_heads for a float page type and a row count (1 to 4).
void heads_dispatch(KvElem e, const PageRef (*pg)[kGroupPages], int nh, int n_pg, int bs, int hd, int32_t window,
                    Rows* rows, int n_rows, const StreamAhead& ahead) {
  auto by_rows = [&](auto et) {
    constexpr KvElem E = decltype(et)::value;
    switch (n_rows) {
      case 1: return group_heads<E, 1>(pg, nh, n_pg, bs, hd, window, rows, ahead);
      case 2: return group_heads<E, 2>(pg, nh, n_pg, bs, hd, window, rows, ahead);
      case 3: return group_heads<E, 3>(pg, nh, n_pg, bs, hd, window, rows, ahead);
      default: return group_heads<E, 4>(pg, nh, n_pg, bs, hd, window, rows, ahead);
    }
  };
  switch (e) {
    case KvElem::kF32: return by_rows(std::integral_constant<KvElem, KvElem::kF32>{});
    case KvElem::kBF16: return by_rows(std::integral_constant<KvElem, KvElem::kBF16>{});
    default: return by_rows(std::integral_constant<KvElem, KvElem::kF16>{});
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The AVX-512 path's structure on 8-lane vectors: a 16-key chunk (or 16 value channels) is two
// halves, lanes [0, 8) and [8, 16); a 16-bit key mask becomes a lane mask per half.

// e^x for 8 lanes: the polynomial of exp16.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));  // 2^n stays a normal float below
  x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}
// Lanes whose bit of `bits` (lane i: bit i) is set: all ones, the others zero.
inline __m256 lane_mask(uint32_t bits) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), lanes), lanes));
}
// The low 16 bits of 8 u32 lanes as halves → 8 floats.
inline __m256 half_lo16(__m256i x) {
  const __m256i p = _mm256_packus_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_setzero_si256());
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08)));
}

struct V16 {
  __m256 lo, hi;  // lanes [0, 8), [8, 16)
};

// 8 bytes of fp8 → 8 floats (e4m3 comes out 2^-8 too small; the caller's scale has the 256).
inline __m256 fp8x8(__m128i b, bool e4m3) {
  const __m128i w = _mm_cvtepu8_epi16(b);
  __m128i h;
  if (e4m3)
    h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
  else
    h = _mm_slli_epi16(w, 8);
  return _mm256_cvtph_ps(h);
}
inline __m256 u8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
// 8 bytes of nibbles → 16 values: the low nibbles then the high nibbles.
inline V16 nib8x16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return {u8x8(_mm_and_si128(b, m)), u8x8(_mm_and_si128(_mm_srli_epi16(b, 4), m))};
}

// 8 consecutive values of an unquantized or fp8/int8 run at element i.
template <KvElem E>
inline __m256 load8(const uint8_t* base, int64_t i) {
  if constexpr (E == KvElem::kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(base) + i);
  if constexpr (E == KvElem::kF16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(base) + i)));
  if constexpr (E == KvElem::kBF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(base) + i))), 16));
  if constexpr (E == KvElem::kFp8E4M3 || E == KvElem::kFp8E5M2)
    return fp8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + i)), E == KvElem::kFp8E4M3);
  if constexpr (E == KvElem::kInt8) return u8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + i)));
  return _mm256_setzero_ps();
}
// One value of an unquantized run (a partial chunk's lanes, read one by one).
template <KvElem E>
inline float load1(const uint8_t* base, int64_t i) {
  if constexpr (E == KvElem::kF32) return reinterpret_cast<const float*>(base)[i];
  if constexpr (E == KvElem::kF16) return fp16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]);
  if constexpr (E == KvElem::kBF16) {
    const uint32_t b = uint32_t(reinterpret_cast<const uint16_t*>(base)[i]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  return 0.f;  // quantized tiles have whole chunks (kv_tile_shape_error)
}

// K: channel d, keys [c·16, c·16 + 16) of a channel-major tile; `n` < 16 keys exist in the
// last chunk of a page whose block size is not a multiple of 16 (unquantized only): those are
// read one by one and the rest is zero, so no load passes the tile's end.
template <KvElem E>
inline V16 load_k(const uint8_t* kt, int bs, int d, int c) {
  if constexpr (E == KvElem::kInt4) return nib8x16(kt + int64_t(d) * (bs / 2) + c * 8);
  const int64_t i = int64_t(d) * bs + c * 16;
  return {load8<E>(kt, i), load8<E>(kt, i + 8)};
}
template <KvElem E>
inline V16 load_k_part(const uint8_t* kt, int bs, int d, int c, int n) {
  alignas(32) float t[16] = {};
  const int64_t i = int64_t(d) * bs + c * 16;
  for (int j = 0; j < n; ++j) t[j] = load1<E>(kt, i + j);
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}
// V: token j, channels [cc·16, cc·16 + 16) of a token-major tile (G: int4 group size).
template <KvElem E>
inline V16 load_v(const uint8_t* vt, int hd, int G, int j, int cc) {
  if constexpr (E == KvElem::kInt4) {
    const int ch = cc * 16, g = ch / G;
    const uint8_t* p = vt + int64_t(j) * (hd / 2) + g * (G / 2);
    if (G == 16) return nib8x16(p);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i x = (ch % G) == 0 ? _mm_and_si128(b, _mm_set1_epi8(0x0F))
                                    : _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    return {u8x8(x), u8x8(_mm_srli_si128(x, 8))};
  }
  const int64_t i = int64_t(j) * hd + cc * 16;
  return {load8<E>(vt, i), load8<E>(vt, i + 8)};
}

constexpr int64_t values_bytes(KvElem e, int64_t n) {
  return e == KvElem::kF32 ? 4 * n : (e == KvElem::kF16 || e == KvElem::kBF16) ? 2 * n : e == KvElem::kInt4 ? n / 2 : n;
}

// Scores of one page for rows [r0, r0 + NR) into s[r][off, off + n_chunks·16): q·k, 16 keys
// per chunk in two halves, one FMA per channel, row and half (each score sums its channels in
// order). Int and fp8 keys: scales folded into the query, zero points one constant per row,
// as in the AVX-512 path.
template <KvElem E, int NR>
inline void page_scores(const uint8_t* kt, int bs, int hd, int n_keys, const Rows& rows, int r0,
                        float (*s)[kGroupKeys], int off) {
  constexpr bool kInt = E == KvElem::kInt8 || E == KvElem::kInt4;
  constexpr bool kFp8 = E == KvElem::kFp8E4M3 || E == KvElem::kFp8E5M2;
  const int64_t n = int64_t(bs) * hd;
  const int n_chunks = (n_keys + 15) / 16;
  alignas(32) float qe[(kInt || kFp8) ? NR : 1][kAttnMaxHeadDim];
  float cadd[NR] = {};
  if constexpr (kInt || kFp8) {
    const uint16_t* meta = reinterpret_cast<const uint16_t*>(kt + values_bytes(E, n));
    alignas(32) float ks[kAttnMaxHeadDim], kz[kAttnMaxHeadDim];
    if constexpr (kFp8) {
      float ts;
      std::memcpy(&ts, meta, 4);
      const __m256 tv = _mm256_set1_ps(E == KvElem::kFp8E4M3 ? ts * 256.f : ts);
      for (int d = 0; d < hd; d += 8) {
        _mm256_store_ps(ks + d, tv);
        _mm256_store_ps(kz + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 2 + d))));
      }
    } else {
      for (int d = 0; d < hd; d += 8) {  // {scale, min} per channel
        const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 2 * d));
        _mm256_store_ps(ks + d, half_lo16(pr));
        _mm256_store_ps(kz + d, half_lo16(_mm256_srli_epi32(pr, 16)));
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float* q = rows.qs[r0 + r];
      __m256 c = _mm256_setzero_ps();
      for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        _mm256_store_ps(qe[r] + d, _mm256_mul_ps(qv, _mm256_load_ps(ks + d)));
        c = _mm256_fmadd_ps(qv, _mm256_load_ps(kz + d), c);
      }
      cadd[r] = hsum8(c);
    }
  }
  auto qrow = [&](int r) -> const float* {
    if constexpr (kInt || kFp8) return qe[r];
    return rows.qs[r0 + r];
  };
  auto chunk = [&](int c, auto full) {
    __m256 alo[NR], ahi[NR];
    for (int r = 0; r < NR; ++r) alo[r] = ahi[r] = _mm256_setzero_ps();
    for (int d = 0; d < hd; ++d) {
      V16 k;
      if constexpr (decltype(full)::value) k = load_k<E>(kt, bs, d, c);
      else k = load_k_part<E>(kt, bs, d, c, bs - c * 16);
      for (int r = 0; r < NR; ++r) {
        const __m256 qd = _mm256_broadcast_ss(qrow(r) + d);
        alo[r] = _mm256_fmadd_ps(qd, k.lo, alo[r]);
        ahi[r] = _mm256_fmadd_ps(qd, k.hi, ahi[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 ca = _mm256_set1_ps(cadd[r]);
      _mm256_store_ps(s[r] + off + c * 16, _mm256_add_ps(alo[r], ca));
      _mm256_store_ps(s[r] + off + c * 16 + 8, _mm256_add_ps(ahi[r], ca));
    }
  };
  for (int c = 0; c < n_chunks; ++c) {
    if (bs - c * 16 >= 16) chunk(c, std::true_type{});
    else chunk(c, std::false_type{});
  }
}

// A group of n_pg pages against NR rows: the AVX-512 path's group_rows (scores, one
// online-softmax update per row for the group, value weights, Σ p·v with the accumulators in
// registers across the group's pages), on halves.
template <KvElem E, KvElem EV, int NR>
void group_rows(const PageRef* pg, int n_pg, int bs, int hd, int dv, int32_t window, Rows& rows, int r0) {
  constexpr bool kIntV = EV == KvElem::kInt8 || EV == KvElem::kInt4;
  constexpr bool kFp8V = EV == KvElem::kFp8E4M3 || EV == KvElem::kFp8E5M2;
  const int64_t n = int64_t(bs) * hd;
  const int cpp = (bs + 15) / 16;
  int lo[kGroupPages][NR], hi[kGroupPages][NR];
  int j_end[kGroupPages];
  bool any = false, full = bs % 16 == 0;
  for (int i = 0; i < n_pg; ++i) {
    j_end[i] = 0;
    for (int r = 0; r < NR; ++r) {
      visible(rows.pos[r0 + r], pg[i].key0, pg[i].n_keys, window, &lo[i][r], &hi[i][r]);
      if (hi[i][r] > lo[i][r]) j_end[i] = std::max(j_end[i], hi[i][r]);
      full &= lo[i][r] == 0 && hi[i][r] == bs;
    }
    any |= j_end[i] > 0;
  }
  if (!any) return;

  // 1. scores, page i at s[r][i·cpp·16, ...)
  alignas(32) float s[NR][kGroupKeys];
  const int64_t pf_step = rows.pf ? rows.pf->step(n_pg + dv / 16) : 0;  // as the AVX-512 path
  for (int i = 0; i < n_pg; ++i) {
    if (pf_step) rows.pf->issue(pf_step);
    if (j_end[i] > 0) {
      if (kv_elem_staged(E) && pg[i].f16) page_scores<KvElem::kF16, NR>(pg[i].kt, bs, hd, pg[i].n_keys, rows, r0, s, i * cpp * 16);
      else page_scores<E, NR>(pg[i].kt, bs, hd, pg[i].n_keys, rows, r0, s, i * cpp * 16);
    }
  }

  // 2. one online-softmax update per row for the group; s becomes p (0 where the row sees no key)
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  float corr[NR];
  for (int r = 0; r < NR; ++r) {
    const int row = r0 + r;
    uint32_t vm[kGroupKeys / 16];
    __m256 mxv = neg_inf;
    for (int i = 0; i < n_pg; ++i)
      for (int c = 0; c < cpp; ++c) {
        const int j0 = c * 16, k = i * cpp + c;
        if (full) {
          vm[k] = 0xFFFF;
          mxv = _mm256_max_ps(mxv, _mm256_max_ps(_mm256_load_ps(s[r] + k * 16), _mm256_load_ps(s[r] + k * 16 + 8)));
          continue;
        }
        const int a = std::clamp(lo[i][r] - j0, 0, 16), b = std::clamp(hi[i][r] - j0, 0, 16);
        vm[k] = ((1u << b) - 1) & ~((1u << a) - 1);
        if (vm[k]) {
          mxv = _mm256_max_ps(mxv, _mm256_blendv_ps(neg_inf, _mm256_load_ps(s[r] + k * 16), lane_mask(vm[k])));
          mxv = _mm256_max_ps(mxv, _mm256_blendv_ps(neg_inf, _mm256_load_ps(s[r] + k * 16 + 8), lane_mask(vm[k] >> 8)));
        }
      }
    const float mx = hmax8(mxv);
    if (mx == kNegInf) {  // the row sees none of the group's keys
      corr[r] = 1.f;
      for (int k = 0; k < n_pg * cpp * 16; k += 8) _mm256_store_ps(s[r] + k, _mm256_setzero_ps());
      continue;
    }
    const float m_old = rows.m[row], m_new = std::max(m_old, mx);
    corr[r] = m_new == m_old ? 1.f : std::exp(m_old - m_new);
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int k = 0; k < n_pg * cpp; ++k)
      for (int h = 0; h < 2; ++h) {
        float* sp = s[r] + k * 16 + h * 8;
        const uint32_t bits = vm[k] >> (8 * h) & 0xFF;
        __m256 p = _mm256_setzero_ps();
        if (bits == 0xFF) p = exp8(_mm256_sub_ps(_mm256_load_ps(sp), mv));
        else if (bits) p = _mm256_and_ps(lane_mask(bits), exp8(_mm256_sub_ps(_mm256_load_ps(sp), mv)));
        _mm256_store_ps(sp, p);
        sum = _mm256_add_ps(sum, p);
      }
    rows.l[row] = rows.l[row] * corr[r] + hsum8(sum);
    rows.m[row] = m_new;
    if (rows.lse) {
      for (int i = 0; i < n_pg; ++i) {
        __m256 ps = _mm256_setzero_ps();
        for (int k = i * cpp * 16; k < (i + 1) * cpp * 16; k += 8) ps = _mm256_add_ps(ps, _mm256_load_ps(s[r] + k));
        const float t = hsum8(ps);
        if (t > 0.f) rows.lse[row * rows.lse_stride + pg[i].key0 / bs - rows.lse_page0] = m_new + std::log(t);
      }
    }
  }

  // 3. value weights (see the AVX-512 path): fp8 p·(tile scale); int pw = p·scale and
  // zr = Σ_j p·min per page.
  const int G = kIntV ? kv_v_group(EV, hd) : hd;
  constexpr int kMaxG = kIntV ? kAttnMaxHeadDim / 16 : 1;
  alignas(32) float pw[kMaxG][kIntV ? NR : 1][kIntV ? kGroupKeys : 1];
  float zr[kIntV ? kGroupPages : 1][NR][kMaxG];
  for (int i = 0; i < n_pg; ++i) {
    if (j_end[i] == 0) continue;
    const int off = i * cpp * 16, n_vec = (j_end[i] + 15) / 16 * 2;  // 8-lane vectors of weights
    const uint8_t* vt = pg[i].vt;
    if (kv_elem_staged(EV) && pg[i].f16) {
      if constexpr (kIntV)
        for (int r = 0; r < NR; ++r)
          for (int g = 0; g < hd / G; ++g) {
            zr[i][r][g] = 0.f;
            for (int v = 0; v < n_vec; ++v) _mm256_store_ps(pw[g][r] + off + v * 8, _mm256_load_ps(s[r] + off + v * 8));
          }
      continue;
    }
    if constexpr (kFp8V) {
      float ts;
      std::memcpy(&ts, vt + n, 4);
      const __m256 tv = _mm256_set1_ps(EV == KvElem::kFp8E4M3 ? ts * 256.f : ts);
      for (int r = 0; r < NR; ++r)
        for (int v = 0; v < n_vec; ++v)
          _mm256_store_ps(s[r] + off + v * 8, _mm256_mul_ps(_mm256_load_ps(s[r] + off + v * 8), tv));
    }
    if constexpr (kIntV) {
      const int ng = hd / G;
      const uint16_t* meta = reinterpret_cast<const uint16_t*>(vt + values_bytes(EV, n));
      alignas(32) float vs[kAttnMaxBlockSize], vz[kAttnMaxBlockSize];
      for (int g = 0; g < ng; ++g) {
        if (ng == 1) {
          for (int v = 0; v < n_vec; ++v) {
            const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 2 * v * 8));
            _mm256_store_ps(vs + v * 8, half_lo16(pr));
            _mm256_store_ps(vz + v * 8, half_lo16(_mm256_srli_epi32(pr, 16)));
          }
        } else {
          for (int j = 0; j < n_vec * 8; ++j) {
            vs[j] = j < bs ? _cvtsh_ss(meta[2 * (j * ng + g)]) : 0.f;
            vz[j] = j < bs ? _cvtsh_ss(meta[2 * (j * ng + g) + 1]) : 0.f;
          }
        }
        for (int r = 0; r < NR; ++r) {
          __m256 z = _mm256_setzero_ps();
          for (int v = 0; v < n_vec; ++v) {
            const __m256 p = _mm256_load_ps(s[r] + off + v * 8);
            _mm256_store_ps(pw[g][r] + off + v * 8, _mm256_mul_ps(p, _mm256_load_ps(vs + v * 8)));
            z = _mm256_fmadd_ps(p, _mm256_load_ps(vz + v * 8), z);
          }
          zr[i][r][g] = hsum8(z);
        }
      }
    }
  }

  // 4. acc = corr·acc + Σ_pages Σ_j p·v, 16 channels (two halves) at a time
  for (int cc = 0; cc < dv / 16; ++cc) {
    if (pf_step) rows.pf->issue(pf_step);
    const int g = kIntV ? cc * 16 / G : 0;
    auto w = [&](int r, int j) -> const float* {
      if constexpr (kIntV) return pw[g][r] + j;
      return s[r] + j;
    };
    __m256 alo[NR], ahi[NR];
    for (int r = 0; r < NR; ++r) {
      const __m256 c = _mm256_set1_ps(corr[r]);
      alo[r] = _mm256_mul_ps(_mm256_loadu_ps(rows.acc[r0 + r] + cc * 16), c);
      ahi[r] = _mm256_mul_ps(_mm256_loadu_ps(rows.acc[r0 + r] + cc * 16 + 8), c);
    }
    auto page_pv = [&](const uint8_t* vt, int off, int je, auto ev) {
      constexpr KvElem T = decltype(ev)::value;
      for (int j = 0; j < je; ++j) {
        const V16 v = load_v<T>(vt, hd, G, j, cc);
        for (int r = 0; r < NR; ++r) {
          const __m256 wv = _mm256_broadcast_ss(w(r, off + j));
          alo[r] = _mm256_fmadd_ps(wv, v.lo, alo[r]);
          ahi[r] = _mm256_fmadd_ps(wv, v.hi, ahi[r]);
        }
      }
    };
    for (int i = 0; i < n_pg; ++i) {
      const int off = i * cpp * 16, je = j_end[i];
      if (kv_elem_staged(EV) && pg[i].f16) page_pv(pg[i].vt, off, je, std::integral_constant<KvElem, KvElem::kF16>{});
      else page_pv(pg[i].vt, off, je, std::integral_constant<KvElem, EV>{});
      if constexpr (kIntV)
        if (je > 0)
          for (int r = 0; r < NR; ++r) {
            const __m256 z = _mm256_set1_ps(zr[i][r][g]);
            alo[r] = _mm256_add_ps(alo[r], z);
            ahi[r] = _mm256_add_ps(ahi[r], z);
          }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(rows.acc[r0 + r] + cc * 16, alo[r]);
      _mm256_storeu_ps(rows.acc[r0 + r] + cc * 16 + 8, ahi[r]);
    }
  }
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))

constexpr bool kGroupRowsPrefetch = true;  // group_rows asks for Rows::pf's tiles as it goes

template <KvElem E, KvElem EV>
void group_all_rows(const PageRef* pg, int n_pg, int bs, int hd, int dv, int32_t window, Rows& rows, int r_begin,
                    int r_end) {
  int r = r_begin;
  for (; r + 4 <= r_end; r += 4) group_rows<E, EV, 4>(pg, n_pg, bs, hd, dv, window, rows, r);
  switch (r_end - r) {
    case 3: group_rows<E, EV, 3>(pg, n_pg, bs, hd, dv, window, rows, r); break;
    case 2: group_rows<E, EV, 2>(pg, n_pg, bs, hd, dv, window, rows, r); break;
    case 1: group_rows<E, EV, 1>(pg, n_pg, bs, hd, dv, window, rows, r); break;
    default: break;
  }
}

// MLA (values = the K tile's first v_from_k channels): each page's keys are dequantized once,
// token-major, into an f32 tile (row stride hd) that serves as the V tile for every row group;
// one page per softmax update, since the f32 tile is per page.
template <KvElem E>
void group_all_rows_vk(const PageRef* pg, int n_pg, int bs, int hd, int dv, int32_t window, Rows& rows, int r_begin,
                       int r_end) {
  alignas(64) float vf[kAttnMaxBlockSize * kAttnMaxHeadDim];  // [n_keys][hd]
  for (int i = 0; i < n_pg; ++i) {
    const PageRef one{pg[i].kt, reinterpret_cast<const uint8_t*>(vf), pg[i].key0, pg[i].n_keys};
    if (kv_elem_staged(E) && pg[i].f16) {
      kv_read_k(pg[i].kt, KvElem::kF16, bs, hd, pg[i].n_keys, vf);
      group_all_rows<KvElem::kF16, KvElem::kF32>(&one, 1, bs, hd, dv, window, rows, r_begin, r_end);
    } else {
      kv_read_k(pg[i].kt, E, bs, hd, pg[i].n_keys, vf);
      group_all_rows<E, KvElem::kF32>(&one, 1, bs, hd, dv, window, rows, r_begin, r_end);
    }
  }
}

void page_dispatch(KvElem e, const PageRef* pg, int n_pg, int bs, int hd, int v_from_k, int32_t window, Rows& rows,
                   int r_begin, int r_end) {
  if (v_from_k > 0) {
    const int dv = v_from_k;
    switch (e) {
      case KvElem::kF32: return group_all_rows_vk<KvElem::kF32>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kF16: return group_all_rows_vk<KvElem::kF16>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kBF16: return group_all_rows_vk<KvElem::kBF16>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kFp8E4M3: return group_all_rows_vk<KvElem::kFp8E4M3>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kFp8E5M2: return group_all_rows_vk<KvElem::kFp8E5M2>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kInt8: return group_all_rows_vk<KvElem::kInt8>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
      case KvElem::kInt4: return group_all_rows_vk<KvElem::kInt4>(pg, n_pg, bs, hd, dv, window, rows, r_begin, r_end);
    }
    return;
  }
  switch (e) {
    case KvElem::kF32: return group_all_rows<KvElem::kF32, KvElem::kF32>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kF16: return group_all_rows<KvElem::kF16, KvElem::kF16>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kBF16: return group_all_rows<KvElem::kBF16, KvElem::kBF16>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kFp8E4M3: return group_all_rows<KvElem::kFp8E4M3, KvElem::kFp8E4M3>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kFp8E5M2: return group_all_rows<KvElem::kFp8E5M2, KvElem::kFp8E5M2>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kInt8: return group_all_rows<KvElem::kInt8, KvElem::kInt8>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
    case KvElem::kInt4: return group_all_rows<KvElem::kInt4, KvElem::kInt4>(pg, n_pg, bs, hd, hd, window, rows, r_begin, r_end);
  }
}

#else  // portable path: dequantize one page tile to floats, then plain loops

constexpr bool kGroupRowsPrefetch = false;

// f16 → f32 for n values (K tiles are [hd][bs], V tiles [bs][hd]: both convert in place order).
inline void f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

// s[j] = q · k_j for j in [lo, hi); kt is the page's keys channel-major [hd][bs].
inline void scores(const float* q, const float* kt, int bs, int hd, int lo, int hi, float* s) {
  for (int j = lo; j < hi; ++j) s[j] = 0.f;
  for (int i = 0; i < hd; ++i) {
    const float qi = q[i];
    const float* kc = kt + size_t(i) * bs;
    for (int j = lo; j < hi; ++j) s[j] += qi * kc[j];
  }
}

// s[j] = e^(s[j] - m) for j in [lo, hi) (s has room for kAttnMaxBlockSize values).
inline void exp_minus(float* s, int lo, int hi, float m) {
  for (int j = lo; j < hi; ++j) s[j] = std::exp(s[j] - m);
}

// Loops shaped for the compiler's vectorizer (SSE2: the baseline build): keys channel-major so
// the scores of a page are one vector FMA per channel, values token-major so the accumulator
// update is one per key. Each score still sums its channels in
// order, as a scalar dot product would.
void page_dispatch(KvElem e, const PageRef* pg, int n_pg, int bs, int hd, int v_from_k, int32_t window, Rows& rows,
                   int r_begin, int r_end) {
  const AttnTileScratch tiles = attention_tile_scratch();  // per thread, shared by the ISA builds
  float* kf = tiles.kf;                                     // [bs][hd] as read
  float* kt = tiles.kt;                                     // [hd][bs]
  float* vf = tiles.vf;                                     // [bs][hd]
  alignas(64) float s[kAttnMaxBlockSize];
  const int dv = v_from_k > 0 ? v_from_k : hd;
  for (int ip = 0; ip < n_pg; ++ip) {
    const int n_keys = pg[ip].n_keys;
    const KvElem pe = pg[ip].f16 ? KvElem::kF16 : e;
    const float* vrow = kf;  // values: the first v_from_k channels of each key row
    if (pe == KvElem::kF16 && v_from_k <= 0) {  // the default: tiles convert as they lie
      f16_to_f32(reinterpret_cast<const uint16_t*>(pg[ip].kt), kt, int64_t(hd) * bs);
      f16_to_f32(reinterpret_cast<const uint16_t*>(pg[ip].vt), vf, int64_t(n_keys) * hd);
      vrow = vf;
    } else {
      kv_read_k(pg[ip].kt, pe, bs, hd, n_keys, kf);
      for (int j = 0; j < n_keys; ++j)
        for (int i = 0; i < hd; ++i) kt[size_t(i) * bs + j] = kf[size_t(j) * hd + i];
      if (v_from_k <= 0) {
        kv_read_v(pg[ip].vt, pe, bs, hd, n_keys, vf);
        vrow = vf;
      }
    }
    for (int r = r_begin; r < r_end; ++r) {
      int lo, hi;
      visible(rows.pos[r], pg[ip].key0, n_keys, window, &lo, &hi);
      if (hi <= lo) continue;
      const float* q = rows.qs[r];
      scores(q, kt, bs, hd, lo, hi, s);
      float mx = kNegInf;
      for (int j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
      const float m_new = std::max(rows.m[r], mx), corr = std::exp(rows.m[r] - m_new);
      float* acc = rows.acc[r];
      for (int i = 0; i < dv; ++i) acc[i] *= corr;
      exp_minus(s, lo, hi, m_new);
      float sum = 0;
      for (int j = lo; j < hi; ++j) {
        const float p = s[j];
        sum += p;
        const float* v = vrow + size_t(j) * hd;
        for (int i = 0; i < dv; ++i) acc[i] += p * v[i];
      }
      rows.l[r] = rows.l[r] * corr + sum;
      rows.m[r] = m_new;
      if (rows.lse && sum > 0.f) rows.lse[r * rows.lse_stride + pg[ip].key0 / bs - rows.lse_page0] = m_new + std::log(sum);
    }
  }
}

#endif


// Runs the rows of one query tile over keys [key_begin, key_end), leaving acc/m/l unnormalised,
// for KV heads [kv_head, kv_head + hs.n) in one pass: page group by page group, each head's
// rows in turn. A page's head tiles are neighbours in the pool, so the pass (and the prefetch
// of the pages ahead, one run per page for all the heads) reads memory front to back; one head
// at a time reads tiles at a stride of n_head_kv tiles, which the hardware prefetchers do not
// follow (AMD Zen 4: 12 GB/s per core against 31 for the same bytes in order).
void attend(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride, int64_t pos0, int n_q,
            int64_t key_begin, int64_t key_end, float scale, float* acc, float* m, float* l, float* page_lse,
            int64_t lse_stride, const AttnHeads& hs) {
  const int hd = kv.head_dim, bs = kv.block_size, dv = kv.value_dim();
  const int nh = hs.n, n_rows = n_q * n_group;
  alignas(64) float qs[kMaxRows][kAttnMaxHeadDim];  // nh · n_rows ≤ kMaxRows (the caller checks)
  Rows rows[kAttnMaxHeads];
  for (int h = 0; h < nh; ++h) {
    Rows& R = rows[h];
    R.n = n_rows;
    R.m = m + h * hs.ml_stride;
    R.l = l + h * hs.ml_stride;
    for (int t = 0; t < n_q; ++t)
      for (int g = 0; g < n_group; ++g) {
        const int r = t * n_group + g, qi = h * n_rows + r;
        const float* src = q + int64_t(t) * q_stride + int64_t((kv_head + h) * n_group + g) * hd;
        for (int i = 0; i < hd; ++i) qs[qi][i] = src[i] * scale;
        R.qs[r] = qs[qi];
        R.pos[r] = pos0 + t;
        R.acc[r] = acc + h * hs.acc_stride + int64_t(r) * dv;
        std::fill(R.acc[r], R.acc[r] + dv, 0.f);
        R.m[r] = kNegInf;
        R.l[r] = 0.f;
      }
  }
  int64_t lo = key_begin;
  const int64_t hi = std::min(key_end, pos0 + n_q);  // one past the last key any row sees
  if (kv.window > 0) lo = std::max(lo, (pos0 - kv.window + 1) / bs * bs);
  // Pages are scattered tiles of a few KiB: ask for the tiles kPrefetchAhead pages ahead so
  // the memory system streams them while this page is computed.
  // (Measured at 8k context on an Intel Xeon: 2 to 4 pages ahead are equal, 8 is no better;
  // prefetcht1 is 15% and prefetchnta 3x slower there; every cache line must be asked for, not
  // every other one.) The tiles for page j + kPrefetchAhead are asked for while page j's group
  // computes, spread over its loops (TilePrefetch); on AMD Zen 4, 8 or 12 pages ahead were slower.
  // The AVX2 build (AVX2-only hosts) asks 2 pages ahead: AMD Zen 3 VM, 2026-11-28, 8k f16
  // decode attention (bench_ops, 7 rounds) medians 18.8 ms per token at 2 pages, 24.5 at 4;
  // `kvserve bench -d 8192` medians 62% of the read loop at 2, 54% at 4 (docs/ARCHITECTURE.md).
#if defined(__AVX512F__) && defined(__AVX512BW__)
  constexpr int kPrefetchAhead = 4;
#else
  constexpr int kPrefetchAhead = 2;
#endif
  const int64_t k_bytes = kv_k_tile_bytes(kv.elem, bs, hd);
  const int64_t v_bytes = kv.v_from_k ? 0 : kv_v_tile_bytes(kv.elem, bs, hd);
  auto kq = [&](int32_t page, int h) { return kv.k_base + page * kv.k_page_bytes + (kv_head + h) * k_bytes; };
  auto vq = [&](int32_t page, int h) -> const uint8_t* {
    return v_bytes ? kv.v_base + page * kv.v_page_bytes + (kv_head + h) * v_bytes : nullptr;
  };
  const int64_t pg_end = (hi + bs - 1) / bs;
  const int64_t pg0 = std::max<int64_t>(lo, 0) / bs;
  if (page_lse) {
    for (int h = 0; h < nh; ++h) {
      Rows& R = rows[h];
      R.lse = page_lse + h * hs.lse_stride;
      R.lse_stride = lse_stride;
      R.lse_page0 = key_begin / bs;
      for (int r = 0; r < R.n; ++r)
        for (int64_t pg = key_begin / bs; pg < (key_end + bs - 1) / bs; ++pg) R.lse[r * lse_stride + pg - key_begin / bs] = kNegInf;
    }
  }
  // Sparse tables (evicted pages, Quest's selection): the live pages go kGroupPages at a time
  // and the live pages ahead are prefetched; dense tables keep groups aligned to absolute page
  // indices (see below).
  int64_t* live = nullptr;  // [n_live] the live pages' indices
  int64_t n_live = 0;
  bool sparse = false;
  for (int64_t pg = pg0; pg < pg_end && !sparse; ++pg) sparse = kv.pages[pg] < 0;
  if (sparse) {
    live = attention_index_scratch(pg_end - pg0);
    for (int64_t pg = pg0; pg < pg_end; ++pg)
      if (kv.pages[pg] >= 0) live[n_live++] = pg;
  }
  const int64_t n_iter = sparse ? n_live : pg_end - pg0;
  auto page_at = [&](int64_t j) { return sparse ? live[j] : pg0 + j; };
  auto prefetch_page = [&](TilePrefetch* pf, int64_t j) {  // the j-th page's tiles, when in RAM
    if (j >= n_iter) return;
    const int32_t page = kv.pages[page_at(j)];
    if (page < 0 || has_stage(kv, page)) return;
    pf->add(kq(page, 0), nh * k_bytes);  // every head's tile of the page: one run
    if (v_bytes) pf->add(vq(page, 0), nh * v_bytes);
  };
  static_assert(kPrefetchAhead <= kGroupPages, "TilePrefetch holds one group's tiles");
  {
    TilePrefetch first;  // the first pages: nothing to spread them over
    for (int64_t a = 0; a < kPrefetchAhead; ++a) prefetch_page(&first, a);
    first.issue(first.left);
  }
  // Pages go kGroupPages at a time to one softmax update, in groups aligned to absolute page
  // indices: a row's sequence of updates then depends only on its position and the part, never
  // on how the prompt was chunked or which pages still have staging (chunked prefill stays
  // bit-identical to one pass). Within a group, rows are cut where their view of a staged page
  // changes: rows before it leave it out, rows on it read its staging copy at f16, rows past
  // it read its quantized tiles.
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const bool page_major = kv.v_from_k == 0 && n_rows <= 4 && page_major_heads(kv.elem);  // decode, float pages
#else
  constexpr bool page_major = false;
#endif
  for (int64_t j0 = 0; j0 < n_iter;) {
    const int64_t j1 = sparse ? std::min<int64_t>(j0 + kGroupPages, n_iter)
                              : std::min((page_at(j0) / kGroupPages + 1) * kGroupPages, pg_end) - pg0;
    int32_t pages[kGroupPages];
    int64_t key0s[kGroupPages];
    bool staged[kGroupPages], any_staged = false;
    int n = 0;
    TilePrefetch pf;
    for (int64_t j = j0; j < j1; ++j) {
      if (!page_major) prefetch_page(&pf, j + kPrefetchAhead);
      const int64_t pg = page_at(j);
      pages[n] = kv.pages[pg];
      key0s[n] = pg * bs;
      staged[n] = has_stage(kv, pages[n]);
      any_staged |= staged[n];
      ++n;
    }
    j0 = j1;
    if constexpr (!kGroupRowsPrefetch) pf.issue(pf.left);  // the portable loops ask for none
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (page_major && !any_staged) {
      PageRef grp[kAttnMaxHeads][kGroupPages];
      for (int h = 0; h < nh; ++h)
        for (int i = 0; i < n; ++i)
          grp[h][i] = {kq(pages[i], h), vq(pages[i], h), key0s[i], static_cast<int>(std::min<int64_t>(bs, hi - key0s[i]))};
      // The tiles kStreamAhead pages on, asked for tile by tile just before the same head's
      // tile of the page kStreamAhead pages back is computed: in each stream (K, then V) about
      // two pages ahead of use. (Zen 5 VM, 2026-12-01, `bench_ops BM_PagedAttentionDecodeModel`
      // 8k f16, one thread: 1, 2 and 3 pages alike; a page's heads asked for at once before its
      // first head, instead of head by head, 20–30% slower, and slower still 4 or 8 pages ahead.)
      constexpr int kStreamAhead = 2;
      StreamAhead ahead;
      ahead.k_bytes = nh * k_bytes;
      ahead.v_bytes = nh * v_bytes;
      for (int i = 0; i < n; ++i) {
        const int64_t j = j1 - n + i + kStreamAhead;
        if (j >= n_iter) continue;
        const int32_t page = kv.pages[page_at(j)];
        if (page < 0 || has_stage(kv, page)) continue;
        ahead.k[i] = kq(page, 0);
        ahead.v[i] = vq(page, 0);
      }
      heads_dispatch(kv.elem, grp, nh, n, bs, hd, kv.window, rows, n_rows, ahead);
      continue;
    }
#endif
    for (int h = 0; h < nh; ++h) {
      Rows& R = rows[h];
      R.pf = &pf;
      pf.shares = nh - h;  // the heads still to run share what is left to ask for
      PageRef grp[kGroupPages];
      for (int i = 0; i < n; ++i)
        grp[i] = {kq(pages[i], h), vq(pages[i], h), key0s[i], static_cast<int>(std::min<int64_t>(bs, hi - key0s[i]))};
      if (!any_staged) {
        page_dispatch(kv.elem, grp, n, bs, hd, kv.v_from_k, kv.window, R, 0, R.n);
        R.pf = nullptr;
        continue;
      }
      auto view_of = [&](int r, int i) {  // 0: before the page, 1: on it, 2: past it
        const int64_t pos = R.pos[r], key0 = grp[i].key0;
        return pos < key0 ? 0 : pos < key0 + bs ? 1 : 2;
      };
      for (int ra = 0, rb; ra < R.n; ra = rb) {
        rb = ra + 1;
        for (bool same = true; rb < R.n && same; rb += same) {
          for (int i = 0; i < n && same; ++i) same = !staged[i] || view_of(rb, i) == view_of(ra, i);
        }
        PageRef sub[kGroupPages];
        int n_sub = 0;
        for (int i = 0; i < n; ++i) {
          if (!staged[i]) {
            sub[n_sub++] = grp[i];
            continue;
          }
          switch (view_of(ra, i)) {
            case 0: break;
            case 1:
              sub[n_sub++] = {k_tile(kv, pages[i], kv_head + h, true), v_tile(kv, pages[i], kv_head + h, true),
                              grp[i].key0, grp[i].n_keys, true};
              break;
            default: sub[n_sub++] = grp[i]; break;
          }
        }
        if (n_sub > 0) page_dispatch(kv.elem, sub, n_sub, bs, hd, kv.v_from_k, kv.window, R, ra, rb);
      }
      R.pf = nullptr;
    }
    pf.issue(pf.left);  // what group_rows did not ask for (rows that saw no key)
  }
}

}  // namespace

void paged_attention_partial(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                             int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                             float* m, float* l, float* page_lse, int64_t lse_stride) {
  attend(kv, kv_head, n_group, q, q_stride, pos0, n_q, key_begin, key_end, scale, acc, m, l, page_lse, lse_stride,
         AttnHeads{});
}

void paged_attention_partial_heads(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                                   int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                                   float* m, float* l, float* page_lse, int64_t lse_stride, const AttnHeads& heads) {
  if (heads.n <= kAttnMaxHeads && heads.n * n_q * n_group <= kMaxRows) {
    attend(kv, kv_head, n_group, q, q_stride, pos0, n_q, key_begin, key_end, scale, acc, m, l, page_lse, lse_stride,
           heads);
    return;
  }
  for (int h = 0; h < heads.n; ++h)  // more rows than one pass holds: a head at a time
    attend(kv, kv_head + h, n_group, q, q_stride, pos0, n_q, key_begin, key_end, scale, acc + h * heads.acc_stride,
           m + h * heads.ml_stride, l + h * heads.ml_stride, page_lse ? page_lse + h * heads.lse_stride : nullptr,
           lse_stride, AttnHeads{});
}

void attention_merge(int n_parts, int n_group, int n_q, int head_dim, const float* acc, const float* m,
                     const float* l, int kv_head, float* out, int64_t o_stride) {
  const int n_rows = n_q * n_group;
  for (int r = 0; r < n_rows; ++r) {
    float mx = kNegInf;
    for (int p = 0; p < n_parts; ++p) mx = std::max(mx, m[p * n_rows + r]);
    float* o = out + int64_t(r / n_group) * o_stride + int64_t(kv_head * n_group + r % n_group) * head_dim;
    std::fill(o, o + head_dim, 0.f);
    float lsum = 0.f;
    for (int p = 0; p < n_parts; ++p) {
      const float mp = m[p * n_rows + r];
      if (mp == kNegInf) continue;
      const float w = std::exp(mp - mx);
      lsum += w * l[p * n_rows + r];
      const float* a = acc + (int64_t(p) * n_rows + r) * head_dim;
      for (int i = 0; i < head_dim; ++i) o[i] += w * a[i];
    }
    const float inv = lsum > 0 ? 1.f / lsum : 0.f;
    for (int i = 0; i < head_dim; ++i) o[i] *= inv;
  }
}

void paged_attention(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                     int64_t pos0, int n_q, float scale, float* out, int64_t o_stride) {
  const int dv = kv.value_dim();
  alignas(64) float acc[kMaxRows * kAttnMaxHeadDim];
  float m[kMaxRows], l[kMaxRows];
  for (int t0 = 0; t0 < n_q; t0 += kAttnQTile) {
    const int nt = std::min(kAttnQTile, n_q - t0);
    attend(kv, kv_head, n_group, q + int64_t(t0) * q_stride, q_stride, pos0 + t0, nt, 0, pos0 + t0 + nt, scale, acc, m,
           l, nullptr, 0, AttnHeads{});
    attention_merge(1, n_group, nt, dv, acc, m, l, kv_head, out + int64_t(t0) * o_stride, o_stride);
  }
}

void paged_attention_prefetch(const PagedKvView& kv, int kv_head, int64_t key_begin, int64_t key_end, int max_pages) {
  const int bs = kv.block_size;
  const int64_t k_bytes = kv_k_tile_bytes(kv.elem, bs, kv.head_dim), v_bytes = kv_v_tile_bytes(kv.elem, bs, kv.head_dim);
  int n = 0;
  for (int64_t pg = key_begin / bs; pg < (key_end + bs - 1) / bs && n < max_pages; ++pg) {
    const int32_t page = kv.pages[pg];
    if (page < 0 || has_stage(kv, page)) continue;  // as attend: a staged page is being written, in cache
    ++n;
    prefetch_tile(k_tile(kv, page, kv_head, false), k_bytes);
    if (const uint8_t* v = v_tile(kv, page, kv_head, false)) prefetch_tile(v, v_bytes);
  }
}

const AttentionKernels kAttention = {paged_attention, paged_attention_partial, paged_attention_partial_heads, attention_merge,
                                     paged_attention_prefetch};

}  // namespace kv::KV_ISA_NS
