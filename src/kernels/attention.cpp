#include "kernels/attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/quant.h"

namespace kv {

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlock = 64;     // largest block_size the tile buffers hold (checked at start-up)
constexpr int kQTile = 8;       // query tokens per tile
constexpr int kMaxGroup = 16;   // query heads per KV head handled in one tile

// Converts n elements of a KV tile to float.
inline void load_tile(const uint8_t* src, KvElem elem, int64_t n, float* dst) {
  if (elem == KvElem::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void write_kv_token(uint8_t* page, KvElem elem, int n_head_kv, int block_size, int head_dim, int slot,
                    const float* src) {
  for (int h = 0; h < n_head_kv; ++h) {
    int64_t off = (int64_t(h) * block_size + slot) * head_dim;
    const float* s = src + int64_t(h) * head_dim;
    if (elem == KvElem::kF32) {
      std::memcpy(reinterpret_cast<float*>(page) + off, s, head_dim * sizeof(float));
    } else {
      uint16_t* d = reinterpret_cast<uint16_t*>(page) + off;
      for (int i = 0; i < head_dim; ++i) d[i] = fp32_to_fp16(s[i]);
    }
  }
}

void paged_attention(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                     int64_t pos0, int n_q, float scale, float* out, int64_t o_stride) {
  const int hd = kv.head_dim, bs = kv.block_size;
  const int64_t elem_bytes = kv.elem == KvElem::kF32 ? 4 : 2;
  const int64_t head_off = int64_t(kv_head) * bs * hd * elem_bytes;
  alignas(64) float kt[kMaxBlock * kMaxHeadDim];
  alignas(64) float vt[kMaxBlock * kMaxHeadDim];
  alignas(64) float acc[kQTile * kMaxGroup][kMaxHeadDim];
  float m[kQTile * kMaxGroup], l[kQTile * kMaxGroup];
  float s[kMaxBlock];

  for (int t0 = 0; t0 < n_q; t0 += kQTile) {
    const int nt = std::min(kQTile, n_q - t0);
    const int rows = nt * n_group;
    for (int r = 0; r < rows; ++r) {
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
      std::fill(acc[r], acc[r] + hd, 0.f);
    }
    const int64_t last_pos = pos0 + t0 + nt - 1;  // highest position any row of the tile sees
    const int64_t n_pages = last_pos / bs + 1;
    for (int64_t pg = 0; pg < n_pages; ++pg) {
      const int64_t key0 = pg * bs;
      const int n_keys = static_cast<int>(std::min<int64_t>(bs, last_pos + 1 - key0));
      const int64_t page_off = int64_t(kv.pages[pg]) * kv.page_bytes + head_off;
      load_tile(kv.k_base + page_off, kv.elem, int64_t(n_keys) * hd, kt);
      load_tile(kv.v_base + page_off, kv.elem, int64_t(n_keys) * hd, vt);
      for (int t = 0; t < nt; ++t) {
        const int64_t qpos = pos0 + t0 + t;
        const int nk = static_cast<int>(std::min<int64_t>(n_keys, qpos + 1 - key0));  // causal mask
        if (nk <= 0) continue;
        for (int g = 0; g < n_group; ++g) {
          const int r = t * n_group + g;
          const float* qr = q + int64_t(t0 + t) * q_stride + int64_t(kv_head * n_group + g) * hd;
          float mx = m[r];
          for (int j = 0; j < nk; ++j) {
            s[j] = dot(qr, kt + int64_t(j) * hd, hd) * scale;
            mx = std::max(mx, s[j]);
          }
          const float corr = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first page
          float* a = acc[r];
          if (corr != 1.f)
            for (int i = 0; i < hd; ++i) a[i] *= corr;
          float lsum = 0.f;
          for (int j = 0; j < nk; ++j) {
            const float p = std::exp(s[j] - mx);
            lsum += p;
            const float* vr = vt + int64_t(j) * hd;
#pragma omp simd
            for (int i = 0; i < hd; ++i) a[i] += p * vr[i];
          }
          l[r] = l[r] * corr + lsum;
          m[r] = mx;
        }
      }
    }
    for (int t = 0; t < nt; ++t)
      for (int g = 0; g < n_group; ++g) {
        const int r = t * n_group + g;
        float* o = out + int64_t(t0 + t) * o_stride + int64_t(kv_head * n_group + g) * hd;
        const float inv = 1.f / l[r];
        for (int i = 0; i < hd; ++i) o[i] = acc[r][i] * inv;
      }
  }
}

void paged_attention_ref(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                         int64_t pos0, int n_q, float scale, float* out, int64_t o_stride) {
  const int hd = kv.head_dim, bs = kv.block_size;
  const int64_t elem_bytes = kv.elem == KvElem::kF32 ? 4 : 2;
  auto load = [&](const uint8_t* base, int64_t pos, float* dst) {
    const uint8_t* p = base + int64_t(kv.pages[pos / bs]) * kv.page_bytes +
                       ((int64_t(kv_head) * bs + pos % bs) * hd) * elem_bytes;
    load_tile(p, kv.elem, hd, dst);
  };
  std::vector<float> kr(hd), vr(hd);
  for (int t = 0; t < n_q; ++t) {
    const int64_t qpos = pos0 + t;
    for (int g = 0; g < n_group; ++g) {
      const float* qr = q + int64_t(t) * q_stride + int64_t(kv_head * n_group + g) * hd;
      std::vector<double> sc(qpos + 1);
      double mx = -1e300;
      for (int64_t j = 0; j <= qpos; ++j) {
        load(kv.k_base, j, kr.data());
        double d = 0;
        for (int i = 0; i < hd; ++i) d += double(qr[i]) * kr[i];
        sc[j] = d * scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (auto& x : sc) sum += (x = std::exp(x - mx));
      std::vector<double> o(hd, 0.0);
      for (int64_t j = 0; j <= qpos; ++j) {
        load(kv.v_base, j, vr.data());
        for (int i = 0; i < hd; ++i) o[i] += sc[j] / sum * vr[i];
      }
      float* orow = out + int64_t(t) * o_stride + int64_t(kv_head * n_group + g) * hd;
      for (int i = 0; i < hd; ++i) orow[i] = static_cast<float>(o[i]);
    }
  }
}

}  // namespace kv
