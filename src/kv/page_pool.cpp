#include "kv/page_pool.h"

#include <cassert>
#include <cstdlib>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <new>

#include <xxhash.h>

#include "common/huge_alloc.h"

#include "kernels/quant.h"

namespace kv {

const char* kv_dtype_name(KvDtype d) { return kv_elem_name(d); }

Result<KvDtype> parse_kv_dtype(const std::string& s) {
  std::string n;
  for (char c : s) n += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "auto" || n == "fp16" || n == "float16" || n == "half") n = "f16";
  else if (n == "fp32" || n == "float32") n = "f32";
  else if (n == "bfloat16") n = "bf16";
  else if (n == "fp8" || n == "fp8_e4m3fn" || n == "e4m3") n = "fp8_e4m3";
  else if (n == "e5m2") n = "fp8_e5m2";
  else if (n == "i8") n = "int8";
  else if (n == "i4") n = "int4";
  for (int i = 0; i < kKvElemCount; ++i)
    if (n == kv_elem_name(static_cast<KvElem>(i))) return static_cast<KvDtype>(i);
  std::string hint;
  if (n.rfind("q8", 0) == 0 || n.rfind("q4", 0) == 0 || n.rfind("q5", 0) == 0)
    hint = "; llama.cpp's " + s + " is a different format: kvserve's quantized pages are int8, int4, fp8";
  return Result<KvDtype>::error("unknown KV cache dtype '" + s +
                                "' (expected auto, f32, f16, bf16, fp8, fp8_e4m3, fp8_e5m2, int8 or int4" + hint + ")");
}

Result<std::vector<KvDtype>> parse_kv_dtype_layers(const std::string& spec, int32_t n_layer, KvDtype base) {
  using R = Result<std::vector<KvDtype>>;
  std::vector<KvDtype> out(n_layer, base);
  std::vector<bool> set(n_layer, false);
  size_t i = 0;
  while (i < spec.size()) {
    size_t j = spec.find(',', i);
    if (j == std::string::npos) j = spec.size();
    const std::string item = spec.substr(i, j - i);
    i = j + 1;
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    if (colon == std::string::npos) return R::error("--kv-cache-dtype-layers: '" + item + "' is not LAYERS:DTYPE");
    auto d = parse_kv_dtype(item.substr(colon + 1));
    if (!d) return R::error("--kv-cache-dtype-layers: " + d.message());
    const std::string range = item.substr(0, colon);
    const size_t dash = range.find('-');
    long lo, hi;
    try {
      size_t used = 0;
      lo = std::stol(range.substr(0, dash), &used);
      if (used != (dash == std::string::npos ? range.size() : dash)) throw std::invalid_argument("x");
      hi = lo;
      if (dash != std::string::npos) {
        const std::string b = range.substr(dash + 1);
        hi = std::stol(b, &used);
        if (used != b.size()) throw std::invalid_argument("x");
      }
    } catch (const std::exception&) {
      return R::error("--kv-cache-dtype-layers: '" + range + "' is not a layer or a range like 0-3");
    }
    if (hi < lo) return R::error("--kv-cache-dtype-layers: layers " + range + " run backwards (write " + std::to_string(hi) + "-" + std::to_string(lo) + ")");
    if (lo < 0 || hi >= n_layer)
      return R::error("--kv-cache-dtype-layers: layers " + range + " outside 0-" + std::to_string(n_layer - 1));
    for (long l = lo; l <= hi; ++l) {
      if (set[l])  // two dtypes for one layer: which one was meant is a guess
        return R::error("--kv-cache-dtype-layers: layer " + std::to_string(l) + " is named twice ('" + item + "' and an earlier item)");
      set[l] = true;
      out[l] = *d;
    }
  }
  return out;
}

bool KvLayout::mixed() const {
  for (int32_t l = 1; l < n_layer; ++l)
    if (dtype_of(l) != dtype_of(0)) return true;
  return false;
}

Status KvLayout::validate() const {
  if (!layer_dtypes.empty() && static_cast<int32_t>(layer_dtypes.size()) != n_layer)
    return Status::error("per-layer KV dtypes name " + std::to_string(layer_dtypes.size()) + " layers, the model has " +
                         std::to_string(n_layer));
  if (v_from_k < 0 || v_from_k > head_dim || v_from_k % 16 != 0)
    return Status::error("K-only (MLA) layout: value channels " + std::to_string(v_from_k) +
                         " must be a multiple of 16 and at most head_dim " + std::to_string(head_dim));
  for (int32_t l = 0; l < n_layer; ++l)
    if (const char* e = kv_tile_shape_error(dtype_of(l), block_size, head_dim))
      return Status::error(std::string(kv_dtype_name(dtype_of(l))) + " KV: " + e + " (block size " +
                           std::to_string(block_size) + ", head_dim " + std::to_string(head_dim) + ")");
  return Status::ok();
}

int64_t KvLayout::page_bytes() const {
  int64_t b = 0;
  for (int32_t l = 0; l < n_layer; ++l) b += k_layer_page_bytes(l) + v_layer_page_bytes(l);
  return b;
}

void PagePool::read_page(int32_t page, uint8_t* dst) const {
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    const int64_t kb = layout_.k_layer_page_bytes(l), vb = layout_.v_layer_page_bytes(l);
    std::memcpy(dst, k_data(l, page), kb);
    if (vb > 0) std::memcpy(dst + kb, v_data(l, page), vb);
    dst += kb + vb;
  }
}

void PagePool::write_page(int32_t page, const uint8_t* src) {
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    const int64_t kb = layout_.k_layer_page_bytes(l), vb = layout_.v_layer_page_bytes(l);
    std::memcpy(k_data(l, page), src, kb);
    if (vb > 0) std::memcpy(v_data(l, page), src + kb, vb);
    src += kb + vb;
  }
}

uint32_t KvLayout::format_tag() const {
  std::vector<uint32_t> w = {kKvPageFormatVersion, static_cast<uint32_t>(n_layer), static_cast<uint32_t>(n_head_kv),
                             static_cast<uint32_t>(head_dim), static_cast<uint32_t>(block_size), static_cast<uint32_t>(v_from_k)};
  for (int32_t l = 0; l < n_layer; ++l) w.push_back(static_cast<uint32_t>(dtype_of(l)));
  uint8_t buf[4];
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (uint32_t x : w) {  // little-endian words, the same on every host
    for (int b = 0; b < 4; ++b) buf[b] = static_cast<uint8_t>(x >> (8 * b));
    XXH3_64bits_update(st, buf, 4);
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return static_cast<uint32_t>(h);
}

int32_t KvLayout::n_staged_layers() const {
  int32_t n = 0;
  for (int32_t l = 0; l < n_layer; ++l) n += staged(l) ? 1 : 0;
  return n;
}

std::string KvLayout::describe() const {
  if (!mixed()) return kv_dtype_name(dtype_of(0));
  // the most common dtype, then the others as layer ranges
  int count[kKvElemCount] = {};
  for (int32_t l = 0; l < n_layer; ++l) ++count[static_cast<int>(dtype_of(l))];
  int main = 0;
  for (int i = 1; i < kKvElemCount; ++i)
    if (count[i] > count[main]) main = i;
  std::string s = kv_dtype_name(static_cast<KvDtype>(main));
  std::string rest;
  for (int32_t l = 0; l < n_layer;) {
    const KvDtype d = dtype_of(l);
    int32_t e = l;
    while (e + 1 < n_layer && dtype_of(e + 1) == d) ++e;
    if (static_cast<int>(d) != main) {
      if (!rest.empty()) rest += ",";
      rest += std::to_string(l);
      if (e > l) {
        rest += '-';
        rest += std::to_string(e);
      }
      rest += ":";
      rest += kv_dtype_name(d);
    }
    l = e + 1;
  }
  return s + " (" + rest + ")";
}

int64_t PagePool::pages_for_bytes(const KvLayout& layout, int64_t bytes, int32_t n_staging) {
  const int64_t pb = layout.page_bytes();
  bytes -= int64_t(n_staging) * layout.stage_layer_bytes() * layout.n_staged_layers();
  return pb > 0 && bytes > 0 ? bytes / pb : 0;
}

namespace {
uint8_t* alloc_zeroed(size_t bytes) {
  if (bytes == 0) return nullptr;
  bytes = (bytes + 63) / 64 * 64;
  auto* p = static_cast<uint8_t*>(huge_alloc(bytes));  // huge pages: long contexts stream the pool
  // Zero once so an unwritten slot can never hold NaN garbage that a masked lane reads.
  std::memset(p, 0, bytes);
  return p;
}
}  // namespace

PagePool::PagePool(const KvLayout& layout, int32_t n_pages, int32_t n_staging)
    : layout_(layout), n_pages_(n_pages), n_staging_(layout.n_staged_layers() > 0 ? n_staging : 0) {
  layer_off_.resize(layout_.n_layer);
  int64_t off = 0;
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    layer_off_[l] = off;
    off += int64_t(n_pages_) * (layout_.k_layer_page_bytes(l) + layout_.v_layer_page_bytes(l));
  }
  storage_ = alloc_zeroed(static_cast<size_t>(off));
  refcount_.assign(n_pages_, 0);
  free_list_.reserve(n_pages_);
  for (int32_t p = n_pages_ - 1; p >= 0; --p) free_list_.push_back(p);
  if (n_staging_ > 0) {
    stage_storage_ = alloc_zeroed(static_cast<size_t>(stage_store_bytes()));
    stage_base_.assign(layout_.n_layer, nullptr);
    stage_of_.assign(int64_t(layout_.n_layer) * n_pages_, -1);
    stage_page_.assign(int64_t(layout_.n_layer) * n_staging_, -1);
    stage_free_.resize(layout_.n_layer);
    filled_.resize(layout_.n_layer);
    int64_t so = 0;
    for (int32_t l = 0; l < layout_.n_layer; ++l) {
      if (!layout_.staged(l)) continue;
      stage_base_[l] = stage_storage_ + so;
      so += int64_t(n_staging_) * layout_.stage_layer_bytes();
      for (int32_t s = n_staging_ - 1; s >= 0; --s) stage_free_[l].push_back(s);
    }
  }
}

PagePool::~PagePool() {
  huge_free(storage_);
  huge_free(stage_storage_);
}

int32_t PagePool::n_staging_used() const {
  int32_t n = 0;
  for (int32_t l = 0; l < layout_.n_layer; ++l)
    if (layout_.staged(l)) n += n_staging_ - static_cast<int32_t>(stage_free_[l].size());
  return n;
}

bool PagePool::allocate(int32_t n, std::vector<int32_t>* out) {
  if (!can_allocate(n)) return false;
  for (int32_t k = 0; k < n; ++k) {
    int32_t p = free_list_.back();
    free_list_.pop_back();
    assert(refcount_[p] == 0);
    refcount_[p] = 1;
    out->push_back(p);
  }
  return true;
}

void PagePool::retain(int32_t page) {
  assert(page >= 0 && page < n_pages_ && refcount_[page] > 0);
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  assert(page >= 0 && page < n_pages_ && refcount_[page] > 0);
  if (--refcount_[page] == 0) {
    release_stages(page);
    free_list_.push_back(page);
  }
}

void PagePool::release_stages(int32_t page) {
  if (stage_of_.empty()) return;
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    int32_t& s = stage_of_[int64_t(l) * n_pages_ + page];
    if (s < 0) continue;
    stage_page_[int64_t(l) * n_staging_ + s] = -1;
    stage_free_[l].push_back(s);
    s = -1;
  }
}

bool PagePool::ensure_stage(int32_t layer, int32_t page, int32_t slot) {
  if (!layout_.staged(layer)) return true;
  int32_t& s = stage_of_[int64_t(layer) * n_pages_ + page];
  if (s >= 0) return true;
  if (stage_free_[layer].empty()) return false;
  s = stage_free_[layer].back();
  stage_free_[layer].pop_back();
  stage_page_[int64_t(layer) * n_staging_ + s] = page;
  if (slot > 0) {  // a rewrite inside a quantized page: bring its written slots back to f16
    const int bs = layout_.block_size, hd = layout_.head_dim;
    const KvElem e = layout_.dtype_of(layer);
    const int64_t kt = kv_k_tile_bytes(e, bs, hd), vt = kv_v_tile_bytes(e, bs, hd), st = kv_stage_tile_bytes(bs, hd);
    std::vector<float> tmp(size_t(bs) * hd);
    for (int32_t h = 0; h < layout_.n_head_kv; ++h) {
      kv_read_k(k_data(layer, page) + h * kt, e, bs, hd, slot, tmp.data());
      for (int j = 0; j < slot; ++j) kv_write_k(stage_k(layer, s) + h * st, KvElem::kF16, bs, hd, j, tmp.data() + size_t(j) * hd);
      if (layout_.v_from_k > 0) continue;
      kv_read_v(v_data(layer, page) + h * vt, e, bs, hd, slot, tmp.data());
      for (int j = 0; j < slot; ++j) kv_write_v(stage_v(layer, s) + h * st, KvElem::kF16, bs, hd, j, tmp.data() + size_t(j) * hd);
    }
  }
  return true;
}

void PagePool::quantize_layer(int32_t layer, int32_t page) {
  const int32_t s = stage_of_[int64_t(layer) * n_pages_ + page];
  assert(s >= 0);
  const int bs = layout_.block_size, hd = layout_.head_dim;
  const KvElem e = layout_.dtype_of(layer);
  const int64_t kt = kv_k_tile_bytes(e, bs, hd), vt = kv_v_tile_bytes(e, bs, hd), st = kv_stage_tile_bytes(bs, hd);
  for (int32_t h = 0; h < layout_.n_head_kv; ++h) {
    kv_quantize_k(reinterpret_cast<const uint16_t*>(stage_k(layer, s) + h * st), e, bs, hd, k_data(layer, page) + h * kt);
    if (layout_.v_from_k == 0) kv_quantize_v(reinterpret_cast<const uint16_t*>(stage_v(layer, s) + h * st), e, bs, hd, v_data(layer, page) + h * vt);
  }
}

void PagePool::release_filled(int32_t layer) {
  if (filled_.empty()) return;
  for (int32_t page : filled_[layer]) {
    int32_t& s = stage_of_[int64_t(layer) * n_pages_ + page];
    if (s < 0) continue;
    stage_page_[int64_t(layer) * n_staging_ + s] = -1;
    stage_free_[layer].push_back(s);
    s = -1;
  }
  filled_[layer].clear();
}

void PagePool::enable_key_stats() {
  if (key_stats_.empty()) key_stats_.assign(int64_t(layout_.n_layer) * n_pages_ * key_stats_bytes_per_page(layout_), 0);
}

void PagePool::store_key_stats(int32_t layer, int32_t page, const float* keys, int32_t n) {
  assert(n > 0);
  const int hd = layout_.head_dim, parts = key_stat_parts(layout_.block_size);
  const int32_t per = key_stat_part_slots(layout_.block_size);
  uint8_t* b = key_stats(layer, page);
  thread_local std::vector<float> mv, vv;  // one part and head: mean, variance
  mv.resize(hd);
  vv.resize(hd);
  for (int p = 0; p < parts; ++p) {
    // Slots [j0, j1) of the part; a part with none written (transform_keys on a page still
    // filling) repeats the last part that has some.
    const int32_t j0 = std::min(p * per, (n - 1) / per * per), j1 = std::min(n, j0 + per);
    for (int32_t h = 0; h < layout_.n_head_kv; ++h, b += key_summary_bytes(hd)) {
      const float* kh = keys + int64_t(h) * n * hd;
      for (int d = 0; d < hd; ++d) {
        double sum = 0, sq = 0;
        for (int32_t j = j0; j < j1; ++j) sum += kh[int64_t(j) * hd + d];
        const double mean = sum / (j1 - j0);
        for (int32_t j = j0; j < j1; ++j) sq += (kh[int64_t(j) * hd + d] - mean) * (kh[int64_t(j) * hd + d] - mean);
        mv[d] = static_cast<float>(mean);
        vv[d] = static_cast<float>(sq / (j1 - j0));
      }
      encode_key_summary(mv.data(), vv.data(), hd, b);
    }
  }
}

void PagePool::summarize_keys(int32_t layer, int32_t page) {
  const int bs = layout_.block_size, hd = layout_.head_dim, nh = layout_.n_head_kv;
  const int32_t s = stage_of(layer, page);
  const KvElem te = s >= 0 ? KvElem::kF16 : layout_.dtype_of(layer);
  const int64_t tile_bytes = s >= 0 ? kv_stage_tile_bytes(bs, hd) : kv_k_tile_bytes(te, bs, hd);
  const uint8_t* base = s >= 0 ? stage_k(layer, s) : k_data(layer, page);
  thread_local std::vector<float> keys;  // [head][slot][hd]
  keys.resize(size_t(nh) * bs * hd);
  for (int32_t h = 0; h < nh; ++h) kv_read_k(base + h * tile_bytes, te, bs, hd, bs, keys.data() + size_t(h) * bs * hd);
  store_key_stats(layer, page, keys.data(), bs);
}

bool PagePool::write_token(int32_t layer, int32_t page, int32_t slot, const float* k, const float* v) {
  if (!begin_write(layer, page, slot)) return false;
  write_slot(layer, page, slot, k, v);
  if (slot == layout_.block_size - 1 && finishes_pages(layer)) {
    finish_page(layer, page);
    mark_filled(layer, page);
  }
  return true;
}

void PagePool::write_slot(int32_t layer, int32_t page, int32_t slot, const float* k, const float* v, int32_t h0,
                          int32_t h1) {
  const int bs = layout_.block_size, hd = layout_.head_dim;
  if (h1 < 0) h1 = layout_.n_head_kv;
  if (layout_.staged(layer)) {
    const int32_t s = stage_of(layer, page);
    assert(s >= 0);  // begin_write
    const int64_t st = kv_stage_tile_bytes(bs, hd);
    for (int32_t h = h0; h < h1; ++h) {
      kv_write_k(stage_k(layer, s) + h * st, KvElem::kF16, bs, hd, slot, k + int64_t(h) * hd);
      if (layout_.v_from_k == 0) kv_write_v(stage_v(layer, s) + h * st, KvElem::kF16, bs, hd, slot, v + int64_t(h) * hd);
    }
    return;
  }
  const KvElem e = layout_.dtype_of(layer);
  const int64_t kt = kv_k_tile_bytes(e, bs, hd), vt = kv_v_tile_bytes(e, bs, hd);
  for (int32_t h = h0; h < h1; ++h) {
    kv_write_k(k_data(layer, page) + h * kt, e, bs, hd, slot, k + int64_t(h) * hd);
    if (layout_.v_from_k == 0) kv_write_v(v_data(layer, page) + h * vt, e, bs, hd, slot, v + int64_t(h) * hd);
  }
}

void PagePool::finish_page(int32_t layer, int32_t page) {
  if (!key_stats_.empty()) summarize_keys(layer, page);  // from the keys as written
  if (layout_.staged(layer)) quantize_layer(layer, page);
}

void PagePool::transform_keys_impl(int32_t layer, int32_t page, int32_t n_slots, void (*call)(void*, float*, int32_t),
                                   void* fn) {
  const int bs = layout_.block_size, hd = layout_.head_dim, nh = layout_.n_head_kv;
  assert(page >= 0 && page < n_pages_ && n_slots >= 0 && n_slots <= bs);
  if (n_slots == 0) return;
  const KvElem e = layout_.dtype_of(layer);
  const int32_t s = stage_of(layer, page);
  // Where the keys live: the staging tile (f16) of a filling page of a staged layer, else the page.
  const bool in_stage = s >= 0;
  const KvElem te = in_stage ? KvElem::kF16 : e;
  const int64_t tile_bytes = in_stage ? kv_stage_tile_bytes(bs, hd) : kv_k_tile_bytes(e, bs, hd);
  uint8_t* base = in_stage ? stage_k(layer, s) : k_data(layer, page);
  // A quantized page is requantized whole: read every slot (n_slots must be the whole page).
  const bool requant = !in_stage && kv_elem_staged(e);
  const int n = requant ? bs : n_slots;
  std::vector<float> keys(size_t(nh) * n * hd);  // [head][slot][hd]
  std::vector<uint16_t> stage;
  for (int32_t h = 0; h < nh; ++h) {
    float* kh = keys.data() + size_t(h) * n * hd;
    kv_read_k(base + h * tile_bytes, te, bs, hd, n, kh);
    call(fn, kh, h);
    if (requant) {
      stage.assign(size_t(bs) * hd, 0);
      for (int j = 0; j < bs; ++j) kv_write_k(reinterpret_cast<uint8_t*>(stage.data()), KvElem::kF16, bs, hd, j, kh + size_t(j) * hd);
      kv_quantize_k(stage.data(), e, bs, hd, base + h * tile_bytes);
    } else {
      for (int j = 0; j < n; ++j) kv_write_k(base + h * tile_bytes, te, bs, hd, j, kh + size_t(j) * hd);
    }
  }
  if (!key_stats_.empty()) store_key_stats(layer, page, keys.data(), n);
}

PagedKvView PagePool::view(int32_t layer) const {
  PagePool& self = const_cast<PagePool&>(*this);
  PagedKvView v;
  v.k_base = self.k_base(layer);
  v.v_base = self.v_base(layer);
  v.k_page_bytes = layout_.k_layer_page_bytes(layer);
  v.v_page_bytes = layout_.v_layer_page_bytes(layer);
  v.n_head_kv = layout_.n_head_kv;
  v.block_size = layout_.block_size;
  v.head_dim = layout_.head_dim;
  v.elem = layout_.dtype_of(layer);
  v.v_from_k = layout_.v_from_k;
  if (v.v_from_k > 0) {
    v.v_base = nullptr;
    v.v_page_bytes = 0;
  }
  if (layout_.staged(layer)) {
    v.stage_of = stage_table(layer);
    v.k_stage = self.stage_k(layer, 0);
    v.v_stage = self.stage_v(layer, 0);
    v.stage_bytes = layout_.stage_layer_bytes();
  }
  return v;
}

bool PagePool::copy_page(int32_t src, int32_t dst) {
  if (!stage_of_.empty()) {  // enough staging for every staged layer of src?
    for (int32_t l = 0; l < layout_.n_layer; ++l)
      if (stage_of(l, src) >= 0 && stage_of(l, dst) < 0 && stage_free_[l].empty()) return false;
  }
  if (!key_stats_.empty())
    for (int32_t l = 0; l < layout_.n_layer; ++l)
      std::memcpy(const_cast<uint8_t*>(key_stats(l, dst)), key_stats(l, src), size_t(key_stats_bytes_per_page(layout_)));
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    std::memcpy(k_data(l, dst), k_data(l, src), layout_.k_layer_page_bytes(l));
    std::memcpy(v_data(l, dst), v_data(l, src), layout_.v_layer_page_bytes(l));
    const int32_t ss = stage_of(l, src);
    if (ss < 0) continue;
    ensure_stage(l, dst, 0);
    std::memcpy(stage_k(l, stage_of(l, dst)), stage_k(l, ss), layout_.stage_layer_bytes());
  }
  return true;
}

Status PagePool::check_integrity() const {
  std::vector<uint8_t> on_free(n_pages_, 0);
  for (int32_t p : free_list_) {
    if (p < 0 || p >= n_pages_) return Status::error("free list holds invalid page id " + std::to_string(p));
    if (on_free[p]) return Status::error("page " + std::to_string(p) + " is on the free list twice");
    on_free[p] = 1;
    if (refcount_[p] != 0) return Status::error("free page " + std::to_string(p) + " has refcount " + std::to_string(refcount_[p]));
  }
  for (int32_t p = 0; p < n_pages_; ++p) {
    if (refcount_[p] < 0) return Status::error("page " + std::to_string(p) + " has negative refcount");
    if (refcount_[p] == 0 && !on_free[p]) return Status::error("page " + std::to_string(p) + " is unreferenced but not free (leak)");
  }
  if (stage_of_.empty()) return Status::ok();
  for (int32_t l = 0; l < layout_.n_layer; ++l) {
    if (!layout_.staged(l)) continue;
    const std::string where = "layer " + std::to_string(l) + " staging: ";
    std::vector<uint8_t> free_slot(n_staging_, 0);
    for (int32_t s : stage_free_[l]) {
      if (s < 0 || s >= n_staging_ || free_slot[s]) return Status::error(where + "bad or duplicate free slot " + std::to_string(s));
      free_slot[s] = 1;
      if (stage_page_[int64_t(l) * n_staging_ + s] != -1) return Status::error(where + "free slot " + std::to_string(s) + " names a page");
    }
    int32_t used = 0;
    for (int32_t p = 0; p < n_pages_; ++p) {
      const int32_t s = stage_of(l, p);
      if (s < 0) continue;
      ++used;
      if (s >= n_staging_ || free_slot[s]) return Status::error(where + "page " + std::to_string(p) + " holds a free or invalid slot");
      if (stage_page_[int64_t(l) * n_staging_ + s] != p) return Status::error(where + "slot " + std::to_string(s) + " does not name page " + std::to_string(p));
      if (refcount_[p] == 0) return Status::error(where + "free page " + std::to_string(p) + " holds a slot (leak)");
    }
    if (used + static_cast<int32_t>(stage_free_[l].size()) != n_staging_)
      return Status::error(where + std::to_string(used) + " used + " + std::to_string(stage_free_[l].size()) + " free != " +
                           std::to_string(n_staging_));
  }
  return Status::ok();
}

}  // namespace kv
