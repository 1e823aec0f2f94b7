// Dispatch of the paged attention kernels to the build for kernel_isa() (attention_impl.h,
// compiled per ISA), the thread-local scratch those builds share, and the reference.
#include "kernels/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/isa_kernels.h"

namespace kv {

namespace {

const AttentionKernels& kernels() {
#ifndef KV_SCALAR_ONLY
  switch (kernel_isa()) {
    case Isa::kAvx512: return avx512::kAttention;
    case Isa::kAvx2: return avx2::kAttention;
    case Isa::kScalar: break;
  }
#endif
  return scalar::kAttention;
}

}  // namespace

void paged_attention(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                     int64_t pos0, int n_q, float scale, float* out, int64_t o_stride) {
  kernels().attention(kv, kv_head, n_group, q, q_stride, pos0, n_q, scale, out, o_stride);
}

void paged_attention_partial(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                             int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                             float* m, float* l, float* page_lse, int64_t lse_stride) {
  kernels().partial(kv, kv_head, n_group, q, q_stride, pos0, n_q, key_begin, key_end, scale, acc, m, l, page_lse,
                    lse_stride);
}

void paged_attention_partial_heads(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                                   int64_t pos0, int n_q, int64_t key_begin, int64_t key_end, float scale, float* acc,
                                   float* m, float* l, float* page_lse, int64_t lse_stride, const AttnHeads& heads) {
  kernels().partial_heads(kv, kv_head, n_group, q, q_stride, pos0, n_q, key_begin, key_end, scale, acc, m, l, page_lse,
                          lse_stride, heads);
}

void paged_attention_prefetch(const PagedKvView& kv, int kv_head, int64_t key_begin, int64_t key_end, int max_pages) {
  kernels().prefetch(kv, kv_head, key_begin, key_end, max_pages);
}

void attention_merge(int n_parts, int n_group, int n_q, int head_dim, const float* acc, const float* m,
                     const float* l, int kv_head, float* out, int64_t o_stride) {
  kernels().merge(n_parts, n_group, n_q, head_dim, acc, m, l, kv_head, out, o_stride);
}

// One set per thread for whichever ISA build runs on it (~200 KiB of TLS; a copy per build
// would be paid by every thread, HTTP threads included).
AttnTileScratch attention_tile_scratch() {
  alignas(64) static thread_local float kf[kAttnMaxBlockSize * kAttnMaxHeadDim];
  alignas(64) static thread_local float kt[kAttnMaxHeadDim * kAttnMaxBlockSize];
  alignas(64) static thread_local float vf[kAttnMaxBlockSize * kAttnMaxHeadDim];
  return {kf, kt, vf};
}

namespace {
std::atomic<bool>& page_major_flag() {
  static std::atomic<bool> on = [] {
    const char* v = std::getenv("KV_ATTN_PAGE_MAJOR");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}
}  // namespace

bool attention_page_major() { return page_major_flag().load(std::memory_order_relaxed); }
void set_attention_page_major_for_testing(bool on) { page_major_flag().store(on, std::memory_order_relaxed); }

int64_t* attention_index_scratch(int64_t n) {
  thread_local std::vector<int64_t> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

void paged_attention_ref(const PagedKvView& kv, int kv_head, int n_group, const float* q, int64_t q_stride,
                         int64_t pos0, int n_q, float scale, float* out, int64_t o_stride) {
  const int hd = kv.head_dim, bs = kv.block_size, dv = kv.value_dim();
  const int64_t stage_tile = kv_stage_tile_bytes(bs, hd), k_tile_bytes = kv_k_tile_bytes(kv.elem, bs, hd),
                v_tile_bytes = kv_v_tile_bytes(kv.elem, bs, hd);
  // Reads all tokens of a page (both K and V) through the tile readers (MLA, v_from_k > 0: the
  // values are the first v_from_k channels of each key).
  std::vector<float> kp(size_t(bs) * hd), vp(size_t(bs) * hd);
  for (int t = 0; t < n_q; ++t) {
    const int64_t qpos = pos0 + t;
    const int64_t first = kv.window > 0 ? std::max<int64_t>(0, qpos - kv.window + 1) : 0;
    for (int g = 0; g < n_group; ++g) {
      const float* qr = q + int64_t(t) * q_stride + int64_t(kv_head * n_group + g) * hd;
      std::vector<double> sc(qpos + 1, -std::numeric_limits<double>::infinity());  // -inf: not seen
      std::vector<std::vector<float>> vals(qpos + 1);
      double mx = -1e300;
      for (int64_t pg = first / bs; pg * bs <= qpos; ++pg) {
        if (kv.pages[pg] < 0) continue;  // evicted: not seen
        const int32_t page = kv.pages[pg];
        const bool staged = kv.stage_of && kv.stage_of[page] >= 0 && pg == qpos / bs;  // own page: staging
        const uint8_t* kt = staged ? kv.k_stage + kv.stage_of[page] * kv.stage_bytes + kv_head * stage_tile
                                   : kv.k_base + page * kv.k_page_bytes + kv_head * k_tile_bytes;
        const uint8_t* vt = kv.v_from_k > 0 ? nullptr
                            : staged        ? kv.v_stage + kv.stage_of[page] * kv.stage_bytes + kv_head * stage_tile
                                            : kv.v_base + page * kv.v_page_bytes + kv_head * v_tile_bytes;
        const KvElem e = staged ? KvElem::kF16 : kv.elem;
        kv_read_k(kt, e, bs, hd, bs, kp.data());
        if (kv.v_from_k > 0) vp = kp;
        else kv_read_v(vt, e, bs, hd, bs, vp.data());
        for (int j = 0; j < bs; ++j) {
          const int64_t pos = pg * bs + j;
          if (pos < first || pos > qpos) continue;
          double d = 0;
          for (int i = 0; i < hd; ++i) d += double(qr[i]) * kp[size_t(j) * hd + i];
          sc[pos] = d * scale;
          mx = std::max(mx, sc[pos]);
          vals[pos].assign(vp.begin() + size_t(j) * hd, vp.begin() + size_t(j) * hd + dv);
        }
      }
      double sum = 0;
      for (int64_t j = first; j <= qpos; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
      std::vector<double> o(dv, 0.0);
      for (int64_t j = first; j <= qpos; ++j)
        if (!vals[j].empty())
          for (int i = 0; i < dv; ++i) o[i] += sc[j] / sum * vals[j][i];
      float* orow = out + int64_t(t) * o_stride + int64_t(kv_head * n_group + g) * dv;
      for (int i = 0; i < dv; ++i) orow[i] = static_cast<float>(o[i]);
    }
  }
}

}  // namespace kv
