#include "model/llama.h"

#include "kv/cold_store.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <cstdlib>

#include "gguf/gguf.h"
#include "kernels/attention.h"
#include "kv/cold_store.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

#include <xxhash.h>

namespace kv {

namespace {

// Rows from which the elementwise ops between matmuls (norms, residual adds, silu/gelu) are
// split between the threads: alone on the engine thread they left the others waiting (~6% of
// a 16-row step's time on Zen 3); below it a dispatch costs more than the rows.
constexpr int64_t kParallelRows = 8;

// fn(t) for every row t in [0, n): on the pool's threads for kParallelRows rows or more, else
// inline. fn touches row t only, so the result is the same either way.
template <class Fn>
void for_rows(ThreadPool& tp, int64_t n, const Fn& fn) {
  if (n < kParallelRows || tp.size() == 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  tp.run([&](int ith, int nth) {
    int64_t b, e;
    ThreadPool::split(n, ith, nth, 1, &b, &e);
    for (int64_t t = b; t < e; ++t) fn(t);
  });
}

// Finds a 2-D weight [n_out][n_in] (GGUF ne = {n_in, n_out}) and checks its shape.
Result<RawMatrix> get_matrix(const GgufFile& f, const std::string& name, int64_t n_in, int64_t n_out) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) return Result<RawMatrix>::error("tensor '" + name + "' is missing");
  if (t->ne.size() != 2 || t->ne[0] != n_in || t->ne[1] != n_out)
    return Result<RawMatrix>::error("tensor '" + name + "' has shape [" + std::to_string(t->ne[0]) +
                                    (t->ne.size() > 1 ? ", " + std::to_string(t->ne[1]) : "") + "], expected [" +
                                    std::to_string(n_in) + ", " + std::to_string(n_out) + "]");
  return RawMatrix{t->type, t->data, n_in, n_out};
}

Result<std::vector<float>> get_vector(const GgufFile& f, const std::string& name, int64_t n) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) return Result<std::vector<float>>::error("tensor '" + name + "' is missing");
  if (t->n_elements != n) return Result<std::vector<float>>::error("tensor '" + name + "' has " + std::to_string(t->n_elements) + " elements, expected " + std::to_string(n));
  std::vector<float> v(n);
  if (!dequantize_row_ref(t->type, t->data, v.data(), n))
    return Result<std::vector<float>>::error("tensor '" + name + "' has unsupported type " + type_name(t->type));
  return v;
}

// A weight of any rank dequantized to f32, its GGUF dims checked (ne[0] contiguous).
Result<std::vector<float>> get_tensor_f32(const GgufFile& f, const std::string& name, const std::vector<int64_t>& ne) {
  const GgufTensor* t = f.find_tensor(name);
  if (!t) return Result<std::vector<float>>::error("tensor '" + name + "' is missing");
  std::vector<int64_t> got = t->ne;
  while (got.size() > ne.size() && got.back() == 1) got.pop_back();
  if (got != ne) {
    auto str = [](const std::vector<int64_t>& v) {
      std::string r = "[";
      for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
      return r + "]";
    };
    return Result<std::vector<float>>::error("tensor '" + name + "' has shape " + str(t->ne) + ", expected " + str(ne));
  }
  std::vector<float> v(t->n_elements);
  if (!dequantize_row_ref(t->type, t->data, v.data(), t->n_elements))
    return Result<std::vector<float>>::error("tensor '" + name + "' has unsupported type " + type_name(t->type));
  return v;
}

}  // namespace

Status LlamaModel::load_mla_layer(const GgufFile& f, int il, Isa isa, Layer* L) {
  const ModelConfig& c = cfg_;
  const std::string p = "blk." + std::to_string(il) + ".";
  const int64_t H = c.n_head, C = c.kv_lora_rank, dn = c.qk_nope, dr = c.qk_rope, dv = c.v_head_dim;
  const int64_t n_qh = H * (dn + dr);
  auto an = get_vector(f, p + "attn_norm.weight", c.n_embd);
  auto fn = get_vector(f, p + "ffn_norm.weight", c.n_embd);
  auto wkv = get_matrix(f, p + "attn_kv_a_mqa.weight", c.n_embd, C + dr);
  auto kvn = get_vector(f, p + "attn_kv_a_norm.weight", C);
  auto wo = get_matrix(f, p + "attn_output.weight", H * dv, c.n_embd);
  auto wg = get_matrix(f, p + "ffn_gate.weight", c.n_embd, c.n_ff);
  auto wu = get_matrix(f, p + "ffn_up.weight", c.n_embd, c.n_ff);
  auto wd = get_matrix(f, p + "ffn_down.weight", c.n_ff, c.n_embd);
  for (const Status* st : {&an.status(), &fn.status(), &wkv.status(), &kvn.status(), &wo.status(), &wg.status(),
                           &wu.status(), &wd.status()})
    if (!*st) return *st;
  L->attn_norm = std::move(*an);
  L->ffn_norm = std::move(*fn);
  L->kv_a_norm = std::move(*kvn);
  RawMatrix wq_first;  // the query's first matrix: attn_q, or attn_q_a (query LoRA)
  if (c.q_lora_rank > 0) {
    auto qa = get_matrix(f, p + "attn_q_a.weight", c.n_embd, c.q_lora_rank);
    auto qan = get_vector(f, p + "attn_q_a_norm.weight", c.q_lora_rank);
    auto qb = get_matrix(f, p + "attn_q_b.weight", c.q_lora_rank, n_qh);
    for (const Status* st : {&qa.status(), &qan.status(), &qb.status()})
      if (!*st) return *st;
    wq_first = *qa;
    L->q_a_norm = std::move(*qan);
    auto qbp = PackedMatrix::pack(*qb, isa);
    if (!qbp) return Status::error(p + "attn_q_b: " + qbp.message());
    L->wq_b = std::move(*qbp);
  } else {
    auto wq = get_matrix(f, p + "attn_q.weight", c.n_embd, n_qh);
    if (!wq) return wq.status();
    wq_first = *wq;
  }
  if (!c.mla_legacy) {
    auto kb = get_tensor_f32(f, p + "attn_k_b.weight", {dn, C, H});  // [H][C][dn]
    auto vb = get_tensor_f32(f, p + "attn_v_b.weight", {C, dv, H});  // [H][dv][C]
    if (!kb) return kb.status();
    if (!vb) return vb.status();
    L->w_uk = std::move(*kb);
    L->w_uv = std::move(*vb);
  } else {  // attn_kv_b [H (dn + dv)][C]: per head rows W_UK (dn) then W_UV (dv)
    auto kvb = get_tensor_f32(f, p + "attn_kv_b.weight", {C, H * (dn + dv)});
    if (!kvb) return kvb.status();
    L->w_uk.resize(H * C * dn);
    L->w_uv.resize(H * dv * C);
    for (int64_t h = 0; h < H; ++h) {
      const float* b = kvb->data() + h * (dn + dv) * C;
      for (int64_t i = 0; i < dn; ++i)
        for (int64_t k = 0; k < C; ++k) L->w_uk[(h * C + k) * dn + i] = b[i * C + k];
      std::copy(b + dn * C, b + (dn + dv) * C, L->w_uv.begin() + h * dv * C);
    }
  }
  auto qkv = PackedMatrix::pack({wq_first, *wkv}, isa);
  auto o = PackedMatrix::pack(*wo, isa);
  auto gu = PackedMatrix::pack({*wg, *wu}, isa);
  auto d = PackedMatrix::pack(*wd, isa);
  for (const Status* st : {&qkv.status(), &o.status(), &gu.status(), &d.status()})
    if (!*st) return Status::error(p + ": " + st->message());
  L->wqkv = std::move(*qkv);
  L->wo = std::move(*o);
  L->wgu = std::move(*gu);
  L->wdown = std::move(*d);
  weight_bytes_ += L->wqkv.bytes() + L->wq_b.bytes() + L->wo.bytes() + L->wgu.bytes() + L->wdown.bytes() +
                   4 * int64_t(L->w_uk.size() + L->w_uv.size()) + 2 * 4 * c.n_embd;
  return Status::ok();
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(const GgufFile& f, Isa isa, LoadProgress* progress) {
  auto cfg = ModelConfig::from_gguf(f);
  if (!cfg) return cfg.status();
  if (cfg->arch != "llama" && cfg->arch != "gemma3" && cfg->arch != "deepseek2")
    return Result<std::unique_ptr<LlamaModel>>::error("architecture '" + cfg->arch + "' is not supported (llama, gemma3, deepseek2)");
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->cfg_ = *cfg;
  const ModelConfig& c = m->cfg_;
  if (c.head_dim > kAttnMaxHeadDim || c.head_dim % 16 != 0)
    return Result<std::unique_ptr<LlamaModel>>::error(
        (c.mla ? "MLA cache row kv_lora_rank + rope = " : "head_dim ") + std::to_string(c.head_dim) +
        " is not supported by the attention kernel (a multiple of 16, at most " + std::to_string(kAttnMaxHeadDim) + ")");
  if (c.mla && (c.kv_lora_rank % 16 != 0 || c.qk_rope % 16 != 0))
    return Result<std::unique_ptr<LlamaModel>>::error("MLA: kv_lora_rank " + std::to_string(c.kv_lora_rank) + " and rope dim " +
                                                      std::to_string(c.qk_rope) + " must be multiples of 16");
  if (c.n_group() > kAttnMaxGroup)
    return Result<std::unique_ptr<LlamaModel>>::error("query group size " + std::to_string(c.n_group()) + " exceeds the attention kernel's limit");
  // KV layer groups: global layers, then (hybrid models) the sliding-window layers.
  {
    KvGroup global{"global", {}, 0}, local{"local", {}, c.n_swa};
    m->layer_group_.resize(c.n_layer);
    m->layer_slot_.resize(c.n_layer);
    for (int32_t il = 0; il < c.n_layer; ++il) {
      const bool swa = !c.layer_swa.empty() && c.layer_swa[il];
      KvGroup& g = swa ? local : global;
      m->layer_group_[il] = swa ? 1 : 0;
      m->layer_slot_[il] = static_cast<int32_t>(g.layers.size());
      g.layers.push_back(il);
    }
    if (global.layers.empty()) {  // every layer slides: one group, windowed
      m->groups_.push_back(std::move(local));
      std::fill(m->layer_group_.begin(), m->layer_group_.end(), 0);
    } else {
      m->groups_.push_back(std::move(global));
      if (!local.layers.empty()) m->groups_.push_back(std::move(local));
    }
  }
  const int64_t n_q = int64_t(c.n_head) * c.head_dim, n_kv = int64_t(c.n_head_kv) * c.head_dim;

  const GgufTensor* emb = f.find_tensor("token_embd.weight");
  if (!emb || emb->ne.size() != 2 || emb->ne[0] != c.n_embd)
    return Result<std::unique_ptr<LlamaModel>>::error("tensor 'token_embd.weight' is missing or not [n_embd, n_vocab]");
  // More rows than tokens is a padded vocabulary; fewer would let a token id read past the matrix.
  if (const GgufValue* toks = f.find("tokenizer.ggml.tokens"); toks && emb->ne[1] < static_cast<int64_t>(toks->arr.size()))
    return Result<std::unique_ptr<LlamaModel>>::error("token_embd.weight has " + std::to_string(emb->ne[1]) +
                                                      " rows but the vocabulary has " + std::to_string(toks->arr.size()) + " tokens");
  if (c.n_vocab != emb->ne[1]) m->cfg_.n_vocab = static_cast<int32_t>(emb->ne[1]);
  TypeTraits tt;
  if (!type_traits(static_cast<uint32_t>(emb->type), &tt) || !tt.supported)
    return Result<std::unique_ptr<LlamaModel>>::error("token_embd.weight has unsupported type");
  m->tok_embd_ = RawMatrix{emb->type, emb->data, c.n_embd, emb->ne[1]};

  const int total = c.n_layer + 1;
  auto fail = [](const Status& s) { return Result<std::unique_ptr<LlamaModel>>(s); };
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    Layer L;
    if (c.mla) {
      Status st = m->load_mla_layer(f, il, isa, &L);
      if (!st) return fail(st);
      m->layers_.push_back(std::move(L));
      if (progress) progress->on_tensor(il + 1, total);
      continue;
    }
    auto an = get_vector(f, p + "attn_norm.weight", c.n_embd);
    auto fn = get_vector(f, p + "ffn_norm.weight", c.n_embd);
    auto wq = get_matrix(f, p + "attn_q.weight", c.n_embd, n_q);
    auto wk = get_matrix(f, p + "attn_k.weight", c.n_embd, n_kv);
    auto wv = get_matrix(f, p + "attn_v.weight", c.n_embd, n_kv);
    auto wo = get_matrix(f, p + "attn_output.weight", n_q, c.n_embd);
    auto wg = get_matrix(f, p + "ffn_gate.weight", c.n_embd, c.n_ff);
    auto wu = get_matrix(f, p + "ffn_up.weight", c.n_embd, c.n_ff);
    auto wd = get_matrix(f, p + "ffn_down.weight", c.n_ff, c.n_embd);
    for (const Status* s : {&an.status(), &fn.status(), &wq.status(), &wk.status(), &wv.status(), &wo.status(),
                            &wg.status(), &wu.status(), &wd.status()})
      if (!*s) return fail(*s);
    L.attn_norm = std::move(*an);
    L.ffn_norm = std::move(*fn);
    if (c.gemma3) {
      auto qn = get_vector(f, p + "attn_q_norm.weight", c.head_dim);
      auto kn = get_vector(f, p + "attn_k_norm.weight", c.head_dim);
      auto pa = get_vector(f, p + "post_attention_norm.weight", c.n_embd);
      auto pf = get_vector(f, p + "post_ffw_norm.weight", c.n_embd);
      for (const Status* s : {&qn.status(), &kn.status(), &pa.status(), &pf.status()})
        if (!*s) return fail(*s);
      L.q_norm = std::move(*qn);
      L.k_norm = std::move(*kn);
      L.post_attn_norm = std::move(*pa);
      L.post_ffw_norm = std::move(*pf);
    }
    // Q, K, V share their input: one packed matrix (parts may differ in type; pack says when
    // it cannot do that).
    auto qkv = PackedMatrix::pack({*wq, *wk, *wv}, isa);
    auto o = PackedMatrix::pack(*wo, isa);
    auto gu = PackedMatrix::pack({*wg, *wu}, isa);
    auto d = PackedMatrix::pack(*wd, isa);
    for (const Status* s : {&qkv.status(), &o.status(), &gu.status(), &d.status()})
      if (!*s) return fail(Status::error(p + ": " + s->message()));
    L.wqkv = std::move(*qkv);
    L.wo = std::move(*o);
    L.wgu = std::move(*gu);
    L.wdown = std::move(*d);
    m->weight_bytes_ += L.wqkv.bytes() + L.wo.bytes() + L.wgu.bytes() + L.wdown.bytes() + 2 * 4 * c.n_embd;
    m->layers_.push_back(std::move(L));
    if (progress) progress->on_tensor(il + 1, total);
  }
  auto on = get_vector(f, "output_norm.weight", c.n_embd);
  if (!on) return fail(on.status());
  m->output_norm_ = std::move(*on);
  RawMatrix out_raw = m->tok_embd_;  // tied embeddings unless the file has its own output
  if (f.find_tensor("output.weight")) {
    auto ow = get_matrix(f, "output.weight", c.n_embd, m->cfg_.n_vocab);
    if (!ow) return fail(ow.status());
    out_raw = *ow;
  }
  auto out = PackedMatrix::pack(out_raw, isa);
  if (!out) return fail(Status::error("output: " + out.message()));
  m->output_ = std::move(*out);
  m->weight_bytes_ += m->output_.bytes() + row_bytes(m->tok_embd_.type, c.n_embd) + 4 * c.n_embd;
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  for (const GgufTensor& t : f.tensors()) {
    XXH3_64bits_update(hs, t.name.data(), t.name.size());
    XXH3_64bits_update(hs, &t.type, sizeof t.type);
    XXH3_64bits_update(hs, t.ne.data(), t.ne.size() * sizeof(int64_t));
    XXH3_64bits_update(hs, t.data, std::min<uint64_t>(t.n_bytes, 4096));
  }
  m->fingerprint_ = XXH3_64bits_digest(hs);
  XXH3_freeState(hs);
  if (progress) progress->on_tensor(total, total);
  return Result<std::unique_ptr<LlamaModel>>(std::move(m));
}

KvLayout LlamaModel::kv_layout(int32_t block_size, KvDtype dtype, std::vector<KvDtype> layer_dtypes, int g) const {
  KvLayout l;
  const KvGroup& grp = groups_[g];
  // layer_dtypes is indexed by model layer; a short list leaves the rest at `dtype`.
  if (!layer_dtypes.empty())
    for (int32_t il : grp.layers) l.layer_dtypes.push_back(il < static_cast<int32_t>(layer_dtypes.size()) ? layer_dtypes[il] : dtype);
  l.n_layer = static_cast<int32_t>(grp.layers.size());
  l.n_head_kv = cfg_.n_head_kv;
  l.head_dim = cfg_.head_dim;
  l.block_size = block_size;
  l.dtype = dtype;
  if (cfg_.mla) l.v_from_k = cfg_.kv_lora_rank;  // pages hold only the latent row [c_kv ‖ k_pe]
  return l;
}

void LlamaModel::ensure_scratch(int64_t n_tokens, int64_t n_logits) {
  const ModelConfig& c = cfg_;
  if (n_tokens > cap_tokens_) {
    cap_tokens_ = n_tokens;
    const int64_t n_qkv = int64_t(c.n_head + 2 * c.n_head_kv) * c.head_dim;
    x_.resize(n_tokens * c.n_embd);
    h_.resize(n_tokens * std::max<int64_t>(std::max(c.n_embd, c.n_ff), int64_t(c.n_head) * c.head_dim));
    qkv_.resize(n_tokens * n_qkv);
    attn_.resize(n_tokens * int64_t(c.n_head) * c.head_dim);
    if (c.mla) {
      const int64_t n_qh = int64_t(c.n_head) * (c.qk_nope + c.qk_rope);
      const int64_t first = (c.q_lora_rank > 0 ? c.q_lora_rank : n_qh) + c.kv_lora_rank + c.qk_rope;
      if (first > n_qkv) qkv_.resize(n_tokens * first);
      mla_q_.resize(n_tokens * int64_t(c.n_head) * c.head_dim);
      mla_qb_.resize(c.q_lora_rank > 0 ? n_tokens * n_qh : 0);
      mla_qa_.resize(n_tokens * int64_t(c.q_lora_rank));
      mla_o_.resize(n_tokens * int64_t(c.n_head) * c.v_head_dim);
    }
    gu_.resize(n_tokens * 2 * int64_t(c.n_ff));
    tmp_.resize(n_tokens * c.n_embd);
  }
  if (n_logits > cap_logits_) {
    cap_logits_ = n_logits;
    last_.resize(n_logits * c.n_embd);
  }
}

void LlamaModel::plan_attention(const Batch& batch, int32_t block_size) {
  const ModelConfig& c = cfg_;
  const int64_t split_keys = std::max<int64_t>(block_size, kSplitKeys / block_size * block_size);  // page-aligned parts
  units_.clear();
  splits_.clear();
  constexpr int kUnitTokens = 32;
  int64_t acc = 0, ml = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(batch.seqs.size()); ++s) {
    const BatchSeq& bs = batch.seqs[s];
    const int64_t ctx = bs.pos0 + bs.n_tokens;
    if (bs.n_tokens <= kAttnQTile && ctx > split_keys) {
      const int32_t n_parts = static_cast<int32_t>((ctx + split_keys - 1) / split_keys);
      const int64_t rows = int64_t(bs.n_tokens) * c.n_group();
      const int32_t split0 = static_cast<int32_t>(splits_.size());
      for (int32_t h = 0; h < c.n_head_kv; ++h) {
        splits_.push_back({s, h, 0, bs.n_tokens, n_parts, acc, ml});
        acc += n_parts * rows * c.attn_value_dim();
        ml += n_parts * rows;
      }
      // Part-major: a thread takes every KV head of a key range in turn, in one pass where it
      // can (forward, paged_attention_partial_heads). A page's head tiles are neighbours in
      // the pool, so that reads memory front to back instead of one head's tiles at a stride
      // of n_head_kv tiles across the whole context (docs/ARCHITECTURE.md, Attention).
      for (int32_t p = 0; p < n_parts; ++p)
        for (int32_t h = 0; h < c.n_head_kv; ++h)
          units_.push_back({s, h, 0, bs.n_tokens, p * split_keys, std::min<int64_t>(ctx, (p + 1) * split_keys), split0 + h, p});
      continue;
    }
    for (int32_t t0 = 0; t0 < bs.n_tokens; t0 += kUnitTokens)
      for (int32_t h = 0; h < c.n_head_kv; ++h)
        units_.push_back({s, h, t0, std::min(kUnitTokens, bs.n_tokens - t0), 0, 0, -1, 0});
  }
  if (static_cast<int64_t>(part_acc_.size()) < acc) part_acc_.resize(acc);
  if (static_cast<int64_t>(part_m_.size()) < ml) {
    part_m_.resize(ml);
    part_l_.resize(ml);
  }
}

template <class PagesOf>
void LlamaModel::balance_units(int n_threads, int32_t block_size, const Batch& batch, PagesOf pages) {
  const int64_t n_units = static_cast<int64_t>(units_.size());
  unit_cost_.assign(n_units + 1, 0);  // prefix sums
  for (int64_t u = 0; u < n_units; ++u) {
    const AttnUnit& w = units_[u];
    const BatchSeq& s = batch.seqs[w.seq];
    const int64_t k0 = w.split >= 0 ? w.key_begin : 0, k1 = w.split >= 0 ? w.key_end : s.pos0 + w.t0 + w.n;
    const int32_t* pg = pages(w);
    int64_t live = 0;
    for (int64_t i = k0 / block_size; i < (k1 + block_size - 1) / block_size; ++i) live += pg[i] >= 0 || pg[i] == kColdPage;
    unit_cost_[u + 1] = unit_cost_[u] + int64_t(w.n) * (live + 1);
  }
  unit_bounds_.assign(n_threads + 1, n_units);
  unit_bounds_[0] = 0;
  const int64_t total = unit_cost_[n_units];
  int64_t u = 0;
  for (int t = 1; t < n_threads; ++t) {  // the first unit whose work starts at or past t/n of the total
    while (u < n_units && unit_cost_[u] * n_threads < total * t) ++u;
    unit_bounds_[t] = u;
  }
}

bool LlamaModel::prepare_scores(const Batch& batch, int n_threads, int32_t block_size) {
  // One stretch of the accumulators per distinct page_scores array (runs may share one).
  score_slots_.clear();
  seq_score_off_.assign(batch.seqs.size(), -1);
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const BatchSeq& s = batch.seqs[i];
    if (!s.page_scores || s.score_from >= s.n_tokens) continue;
    const int64_t n_pages = (s.pos0 + s.n_tokens + block_size - 1) / block_size;
    auto it = std::find_if(score_slots_.begin(), score_slots_.end(), [&](const ScoreSlot& x) { return x.dst == s.page_scores; });
    if (it == score_slots_.end()) it = score_slots_.insert(it, {s.page_scores, 0, 0});
    it->n_pages = std::max(it->n_pages, n_pages);
    seq_score_off_[i] = it - score_slots_.begin();  // slot index for now, offset below
  }
  if (score_slots_.empty()) return false;
  int64_t width = 0;
  for (ScoreSlot& x : score_slots_) {
    x.off = width;
    width += x.n_pages;
  }
  for (int64_t& off : seq_score_off_)
    if (off >= 0) off = score_slots_[off].off;
  score_acc_.resize(n_threads);
  for (auto& a : score_acc_) a.assign(width, 0.f);
  // split parts keep their page log-sum-exps until the merge
  const int64_t ppp = kSplitKeys / block_size;
  int64_t ml = 0;
  for (const AttnSplit& sp : splits_) ml = std::max<int64_t>(ml, sp.ml_off + int64_t(sp.n_parts) * sp.n * cfg_.n_group());
  if (static_cast<int64_t>(part_lse_.size()) < ml * ppp) part_lse_.resize(ml * ppp);
  return true;
}

void LlamaModel::finish_scores() {
  for (const ScoreSlot& x : score_slots_)
    for (const auto& a : score_acc_)
      for (int64_t i = 0; i < x.n_pages; ++i) x.dst[i] += a[x.off + i];
}

bool LlamaModel::prepare_quest(const Batch& batch) {
  quest_on_.assign(batch.seqs.size(), 0);
  bool any = false;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const BatchSeq& s = batch.seqs[i];
    if (s.quest && s.quest->sparse() && s.n_tokens <= kAttnQTile) quest_on_[i] = any = true;
    else if (s.cold) s.cold->fetch_all();  // a run that reads every page (what cannot come back is skipped)
  }
  if (any && quest_tables_.size() < batch.seqs.size() * cfg_.n_head_kv) {
    quest_tables_.resize(batch.seqs.size() * cfg_.n_head_kv);
    quest_runners_.resize(quest_tables_.size());
  }
  return any;
}

// Quest: for each (sequence, KV head) that reads sparsely, an estimate of the highest q·k over
// each page's keys from the page's channel mean and variance (key_score_pages), maxed over the
// group's query heads and the run's tokens, then quest_select; units read the resulting table.
void LlamaModel::quest_select_layer(const Batch& batch, const PagePool& pool, int li, ThreadPool& tp) {
  const ModelConfig& c = cfg_;
  const int64_t HD = c.head_dim, n_qkv = int64_t(c.n_head + 2 * c.n_head_kv) * HD;
  const int32_t bs = pool.layout().block_size;
  const int n_group = c.n_group(), hkv = c.n_head_kv;
  // Work: scores in chunks of kChunk pages per sequence (all KV heads of a page at once: their
  // summaries are contiguous), spread over the threads, then one selection per (sequence, head).
  constexpr int64_t kChunk = 64;
  struct Chunk { int32_t si; int64_t i0, i1; };
  thread_local std::vector<Chunk> chunks;  // the engine thread's
  chunks.clear();
  if (quest_scores_.size() < quest_tables_.size()) quest_scores_.resize(quest_tables_.size());
  for (int32_t si = 0; si < static_cast<int32_t>(batch.seqs.size()); ++si) {
    if (!quest_on_[si]) continue;
    const BatchSeq& s = batch.seqs[si];
    const int64_t n_pg = (s.pos0 + s.n_tokens - 1) / bs + 1;
    for (int32_t h = 0; h < hkv; ++h) quest_scores_[size_t(si) * hkv + h].assign(n_pg, 0.f);
    for (int64_t i0 = 0; i0 < n_pg; i0 += kChunk) chunks.push_back({si, i0, std::min(n_pg, i0 + kChunk)});
  }
  const std::vector<Chunk>& work = chunks;
  const int64_t n_pairs = int64_t(batch.seqs.size()) * hkv;
  // A page's summaries are key_stat_parts parts of key_stat_part_slots keys (PagePool::key_stats).
  constexpr int kMaxParts = kAttnMaxBlockSize / kQuestKeysPerPart;
  const int parts = key_stat_parts(bs);
  const int64_t part_bytes = key_stats_part_bytes(pool.layout());
  const float spread = static_cast<float>(quest_spread(key_stat_part_slots(bs)));
  tp.run([&](int ith, int nth) {
    int64_t b, e;
    ThreadPool::split(static_cast<int64_t>(work.size()), ith, nth, 1, &b, &e);
    for (int64_t wi = b; wi < e; ++wi) {
      const Chunk& ck = work[wi];
      const BatchSeq& s = batch.seqs[ck.si];
      const int32_t* pages = s.pages;
      const int n_rows = s.n_tokens * n_group;
      // the run's query rows, KV head by KV head (each head's group of query heads)
      thread_local std::vector<const float*> q;
      thread_local std::vector<float> out;  // [page][head]
      q.resize(size_t(hkv) * n_rows);
      out.resize(size_t(kChunk) * parts * hkv);
      for (int h = 0; h < hkv; ++h)
        for (int r = 0; r < n_rows; ++r)
          q[h * n_rows + r] = qkv_.data() + (s.offset + r / n_group) * n_qkv + int64_t(h * n_group + r % n_group) * HD;
      // The chunk's pages that have keys, each part an entry of its own, then one kernel call;
      // a page scores as its best part.
      const uint8_t* kb[kChunk * kMaxParts];
      int64_t at[kChunk], n = 0;
      for (int64_t i = ck.i0; i < ck.i1; ++i) {
        if (pages[i] < 0 && !(pages[i] == kColdPage && s.cold)) continue;
        const uint8_t* st = pages[i] >= 0 ? pool.key_stats(li, pages[i]) : s.cold->key_stats(i, li);
        for (int p = 0; p < parts; ++p) kb[n * parts + p] = st + p * part_bytes;
        at[n++] = i;
      }
      key_score_pages(q.data(), n_rows, hkv, kb, n * parts, static_cast<int>(HD), spread, out.data());
      for (int h = 0; h < hkv; ++h) {
        float* score = quest_scores_[size_t(ck.si) * hkv + h].data();
        for (int64_t j = 0; j < n; ++j) {
          float best = out[j * parts * hkv + h];
          for (int p = 1; p < parts; ++p) best = std::max(best, out[(j * parts + p) * hkv + h]);
          score[at[j]] = best;
        }
      }
    }
    tp.barrier();
    thread_local std::vector<int32_t> scratch;
    ThreadPool::split(n_pairs, ith, nth, 1, &b, &e);
    for (int64_t wi = b; wi < e; ++wi) {
      const int32_t si = static_cast<int32_t>(wi / hkv);
      if (!quest_on_[si]) continue;
      const BatchSeq& s = batch.seqs[si];
      // with cold pages, the runners-up (a quarter of the selection) are read ahead
      quest_select(*s.quest, bs, s.pages, s.pos0 + s.n_tokens - 1, quest_scores_[wi].data(), &quest_tables_[wi], &scratch,
                   s.cold ? std::max(1, s.quest->sparse_pages / 4) : 0, &quest_runners_[wi]);
    }
  });
  resolve_cold(batch);
}

// Engine thread, after a layer's selections: every cold page a selection picked is made
// resident (the table entry and the sequence's block table get its pool page), the pages read
// are stamped, and the runners-up still cold are prefetched for the next step.
void LlamaModel::resolve_cold(const Batch& batch) {
  const int hkv = cfg_.n_head_kv;
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const BatchSeq& s = batch.seqs[si];
    if (!quest_on_[si] || !s.cold) continue;
    // what any head of this layer reads stays; a fetch short of room sends down another page
    s.cold->begin_layer(*s.quest, s.pos0 + s.n_tokens - 1);
    for (int h = 0; h < hkv; ++h)
      for (int64_t i = 0; i < int64_t(quest_tables_[si * hkv + h].size()); ++i)
        if (quest_tables_[si * hkv + h][i] != -1) s.cold->need(i);
    for (int h = 0; h < hkv; ++h) {
      std::vector<int32_t>& t = quest_tables_[si * hkv + h];
      for (int64_t i = 0; i < int64_t(t.size()); ++i) {
        if (t[i] == kColdPage) t[i] = s.cold->fetch(i);  // -1 when it could not come back: skipped
        if (t[i] >= 0) s.cold->touch(i);
      }
      for (int32_t i : quest_runners_[si * hkv + h]) s.cold->prefetch(i);
    }
  }
}

void LlamaModel::shift_keys(PagePool& pool, int g, int32_t page, int32_t n_slots, int64_t delta) const {
  const ModelConfig& c = cfg_;
  assert(!c.mla);
  const std::vector<int32_t>& layers = groups_[g].layers;
  for (size_t li = 0; li < layers.size(); ++li) {
    const int32_t il = layers[li];
    const float base = (!c.layer_swa.empty() && c.layer_swa[il]) ? c.rope_base_swa : c.rope_base;
    pool.transform_keys(static_cast<int32_t>(li), page, n_slots, [&](float* k, int32_t) {
      for (int32_t j = 0; j < n_slots; ++j) rope(k + int64_t(j) * c.head_dim, 1, c.head_dim, c.n_rot, -delta, base, c.rope_scale, c.rope_style);
    });
  }
}

bool LlamaModel::walk_default() {
  const char* e = std::getenv("KV_WALK");
  return !(e && std::strcmp(e, "0") == 0);
}

Status LlamaModel::forward(const Batch& batch, PagePool& pool, ThreadPool& tp, float* logits) {
  if (groups_.size() != 1) return Status::error("this model has " + std::to_string(groups_.size()) + " KV layer groups: pass one pool per group");
  PagePool* pools[1] = {&pool};
  return forward(batch, pools, tp, logits);
}

Status LlamaModel::forward(const Batch& batch, PagePool* const* pools, ThreadPool& tp, float* logits) {
  using Clock = std::chrono::steady_clock;
  const auto t_begin = Clock::now();
  times_ = ForwardTimes{};
  auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const ModelConfig& c = cfg_;
  const int n_groups = static_cast<int>(groups_.size());
  for (int g = 0; g < n_groups; ++g) {
    const KvLayout& l = pools[g]->layout();
    if (l.n_layer != static_cast<int32_t>(groups_[g].layers.size()) || l.n_head_kv != c.n_head_kv || l.head_dim != c.head_dim ||
        l.block_size != pools[0]->layout().block_size || l.v_from_k != (c.mla ? c.kv_lora_rank : 0))
      return Status::error("page pool layout does not match the model's KV group " + std::string(groups_[g].name));
  }
  const KvLayout& kl = pools[0]->layout();
  const int64_t n_tok = static_cast<int64_t>(batch.tokens.size());
  if (n_tok == 0) return Status::ok();
  for (int32_t t : batch.tokens)
    if (t < 0 || t >= c.n_vocab) return Status::error("token id " + std::to_string(t) + " out of range");
  ensure_scratch(n_tok, batch.n_logit_rows());

  const int64_t E = c.n_embd, HD = c.head_dim;
  const int64_t n_q = int64_t(c.n_head) * HD, n_kv = int64_t(c.n_head_kv) * HD;
  const int64_t n_qkv = n_q + 2 * n_kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(HD));
  const float emb_scale = c.gemma3 ? std::sqrt(static_cast<float>(E)) : 1.f;

  // x: [n_tok][E] ← embedding rows
  const int64_t emb_row = row_bytes(tok_embd_.type, E);
  for (int64_t t = 0; t < n_tok; ++t)
    dequantize_row_ref(tok_embd_.type, static_cast<const uint8_t*>(tok_embd_.data) + batch.tokens[t] * emb_row,
                       x_.data() + t * E, E);
  if (emb_scale != 1.f)
    for (int64_t i = 0; i < n_tok * E; ++i) x_[i] *= emb_scale;

  plan_attention(batch, kl.block_size);
  const bool scoring = !c.mla && prepare_scores(batch, tp.size(), kl.block_size);
  const bool questing = !c.mla && prepare_quest(batch);
  if (questing && !pools[0]->has_key_stats()) return Status::error("Quest sparse reads need the pool's key summaries (PagePool::enable_key_stats)");
  const std::vector<AttnUnit>& units = units_;
  const int64_t bs = kl.block_size;
  tok_pos_.resize(n_tok);
  tok_seq_.resize(n_tok);
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const BatchSeq& s = batch.seqs[si];
    for (int32_t i = 0; i < s.n_tokens; ++i) {
      tok_pos_[s.offset + i] = s.pos0 + i;
      tok_seq_[s.offset + i] = static_cast<int32_t>(si);
    }
  }

  // A forward of fewer rows than kParallelRows (decode: a row per sequence, for a few
  // sequences or one with a speculative draft) walks every layer inside one ThreadPool::run:
  // each thread keeps its own copy of the residual stream and does the norms, residual adds
  // and activations of every row itself, each matmul splits its outputs between the threads
  // (matmul_share) and a barrier follows it, so only the matmul outputs cross between cores.
  // A run per matmul and attention instead (~150 a token for SmolLM2) paid a wake-up, the job's
  // cache lines and the engine thread's inputs each time. Quest layers (their page choice
  // runs its own jobs) and MLA run a job per step. Both ways give the same bits.
  const int nthr = tp.size();
  // Token t's page in KV group grp, and its slot there.
  auto page_of = [&](int64_t t, int grp) { return Batch::group_pages(batch.seqs[tok_seq_[t]], grp)[tok_pos_[t] / bs]; };
  auto slot_of = [&](int64_t t) { return static_cast<int32_t>(tok_pos_[t] % bs); };
  // The pages this forward's writes fill, finished in the attention job (layer by layer; the
  // walk lists every layer's first, layer il's at [fill_off_[il], fill_off_[il + 1])).
  fill_pages_.clear();
  const bool walk = walk_on_ && nthr > 1 && n_tok < kParallelRows && !c.mla && !questing;
  // Whether a run reads a page another run of this forward writes (several runs of one
  // sequence in a batch: SequenceRunner::feed_all_logits). Then the walk's threads cannot each
  // write the keys they read (`own` in the attention below).
  auto runs_share_a_written_page = [&] {
    auto last_page = [&](const BatchSeq& s) { return (s.pos0 + s.n_tokens - 1) / bs; };
    for (int g = 0; g < n_groups; ++g)
      for (size_t a = 0; a < batch.seqs.size(); ++a) {
        const int32_t* ta = Batch::group_pages(batch.seqs[a], g);
        for (int64_t pi = batch.seqs[a].pos0 / bs; pi <= last_page(batch.seqs[a]); ++pi) {
          if (ta[pi] < 0) continue;
          for (size_t r = 0; r < batch.seqs.size(); ++r) {
            if (r == a) continue;
            const int32_t *tr = Batch::group_pages(batch.seqs[r], g), *end = tr + last_page(batch.seqs[r]) + 1;
            if (std::find(tr, end, ta[pi]) != end) return true;
          }
        }
      }
    return false;
  };
  const bool walk_own = walk && !runs_share_a_written_page();
  // The code of a layer, run by the engine thread (ith < 0: each step a job, x = x_, h = h_,
  // o = tmp_) or by thread ith of the walk (its own x, h and o).
  auto rows = [&](int ith, const auto& fn) {
    if (ith < 0) return for_rows(tp, n_tok, fn);
    for (int64_t t = 0; t < n_tok; ++t) fn(t);
  };
  auto mm = [&](int ith, const PackedMatrix& w, const float* in, float* out) {
    if (ith < 0) return matmul(w, in, n_tok, out, tp);
    matmul_share(w, in, n_tok, out, ith, nthr);
    tp.barrier();
  };
  // The rest of a layer once its attention output (after Wo) is in tmp_: x += tmp_ (Gemma 3:
  // normed into o first); then x += down(silu(gate(h)) * up(h)), h = rmsnorm(x) (Gemma 3:
  // gelu, and the down output normed into o before it is added).
  auto add_tmp = [&](const std::vector<float>& post_norm, float* x, float* o, int64_t t) {
    const float* a = tmp_.data() + t * E;
    if (c.gemma3) {
      rms_norm(a, post_norm.data(), o + t * E, E, c.rms_eps);
      a = o + t * E;
    }
    add_inplace(x + t * E, a, E);
  };
  auto ffn = [&](const Layer& L, int ith, float* x, float* h, float* o) {
    rows(ith, [&](int64_t t) {
      add_tmp(L.post_attn_norm, x, o, t);
      rms_norm(x + t * E, L.ffn_norm.data(), h + t * E, E, c.rms_eps);
    });
    mm(ith, L.wgu, h, gu_.data());
    rows(ith, [&](int64_t t) {
      const float* g = gu_.data() + t * 2 * c.n_ff;
      if (c.gemma3) gelu_mul(g, g + c.n_ff, h + t * c.n_ff, c.n_ff);
      else silu_mul(g, g + c.n_ff, h + t * c.n_ff, c.n_ff);
    });
    mm(ith, L.wdown, h, tmp_.data());
    rows(ith, [&](int64_t t) { add_tmp(L.post_ffw_norm, x, o, t); });
  };

  auto layer = [&](int il, int ith, float* x, float* h, float* o) -> Status {
    const bool walking = ith >= 0;
    const Layer& L = layers_[il];
    const int grp = layer_group_[il], li = layer_slot_[il];
    PagePool& pool = *pools[grp];
    if (c.mla) {  // never walking
      for_rows(tp, n_tok, [&](int64_t t) { rms_norm(x_.data() + t * E, L.attn_norm.data(), h_.data() + t * E, E, c.rms_eps); });
      const auto t_attn = Clock::now();
      Status st = mla_attention(batch, il, pool, tp);
      if (!st) return st;
      times_.attention += since(t_attn);
      ffn(L, -1, x_.data(), h_.data(), tmp_.data());
      return Status::ok();
    }
    const int32_t window = groups_[grp].window;
    const float rope_base = (!c.layer_swa.empty() && c.layer_swa[il]) ? c.rope_base_swa : c.rope_base;
    // h = rmsnorm(x) ; qkv = h · Wqkvᵀ     [n_tok][n_qkv]
    rows(ith, [&](int64_t t) { rms_norm(x + t * E, L.attn_norm.data(), h + t * E, E, c.rms_eps); });
    mm(ith, L.wqkv, h, qkv_.data());
    const auto t_attn = Clock::now();
    // QK-norm (Gemma 3: RMSNorm over each head) and RoPE on n contiguous heads of token t.
    auto rope_heads = [&](float* x, const std::vector<float>& norm, int n, int64_t t) {
      if (c.gemma3)
        for (int h = 0; h < n; ++h) rms_norm(x + h * HD, norm.data(), x + h * HD, HD, c.rms_eps);
      rope(x, n, c.head_dim, c.n_rot, tok_pos_[t], rope_base, c.rope_scale, c.rope_style);
    };
    // RoPE on q and k of token t, then its k and v into the pages (staged layers: into the
    // page's f16 staging tiles).
    auto rope_write = [&](int64_t t) {
      float* row = qkv_.data() + t * n_qkv;
      rope_heads(row, L.q_norm, c.n_head, t);
      rope_heads(row + n_q, L.k_norm, c.n_head_kv, t);
      pool.write_slot(li, page_of(t, grp), slot_of(t), row + n_q, row + n_q + n_kv);
    };
    // In the walk (when no page fills in this layer, `own` below) each thread ropes the
    // queries of the units it runs into its own buffer (walk_q_), and the unit whose key range
    // holds a (token, KV head)'s key ropes that key and writes its slot: a unit reads only new
    // slots its own thread wrote, so the attention needs no barrier after the writes.
    auto own_q = [&](int ith, int64_t t, int kh) {
      const int64_t off = int64_t(kh) * c.n_group() * HD;
      float* dst = walk_q_[ith].data() + t * n_q + off;
      std::memcpy(dst, qkv_.data() + t * n_qkv + off, size_t(c.n_group() * HD) * sizeof(float));
      rope_heads(dst, L.q_norm, c.n_group(), t);
    };
    auto own_kv = [&](int64_t t, int kh) {
      float* row = qkv_.data() + t * n_qkv;
      rope_heads(row + n_q + int64_t(kh) * HD, L.k_norm, 1, t);
      pool.write_slot(li, page_of(t, grp), slot_of(t), row + n_q, row + n_q + n_kv, kh, kh + 1);
    };
    const bool score_layer = scoring && grp == 0, quest_layer = questing && grp == 0;
    // With more than one thread the tokens are written by the attention job's threads, each its
    // share, then the pages they filled (fill) are finished, each by one thread, before a
    // barrier. Staging slots are taken here first, in order (PagePool::begin_write; a walk took
    // every layer's before it began). Quest layers write here, in order: their page choice needs
    // every roped query before the job.
    const bool write_in_job = nthr > 1 && !quest_layer;
    const int64_t fill0 = walking ? fill_off_[il] : static_cast<int64_t>(fill_pages_.size());
    for (int64_t t = 0; t < n_tok && !walking; ++t) {
      const int32_t page = page_of(t, grp);
      if (!pool.begin_write(li, page, slot_of(t))) {
        pool.release_filled(li);
        return Status::error("KV staging slots exhausted (more partly filled pages than the pool was sized for)");
      }
      const bool fills = slot_of(t) == bs - 1 && pool.finishes_pages(li);  // its last slot
      if (write_in_job) {
        if (fills) fill_pages_.push_back(page);
      } else {
        rope_write(t);
        if (fills) pool.finish_page(li, page);
      }
      if (fills) pool.mark_filled(li, page);
    }
    const int32_t* fill = fill_pages_.data() + fill0;
    const int64_t n_fill = (walking ? fill_off_[il + 1] : static_cast<int64_t>(fill_pages_.size())) - fill0;
    // attn: [n_tok][n_q]
    PagedKvView view = pool.view(li);
    view.window = window;
    const int n_group = c.n_group();
    if (quest_layer) quest_select_layer(batch, pool, li, tp);
    const int64_t ppp = kSplitKeys / bs;  // pages per split part
    // Adds the attention mass of row r's pages (their log-sum-exp, lse[r·stride + i] for page
    // page0 + i) at the row's total log-sum-exp to this thread's accumulator of the sequence.
    auto add_mass = [&](int ith, int32_t seq, const float* lse, int64_t stride, int64_t page0, int64_t n_pg, int r,
                        float row_lse) {
      float* acc = score_acc_[ith].data() + seq_score_off_[seq] + page0;
      for (int64_t i = 0; i < n_pg; ++i) {
        const float e = lse[r * stride + i];
        if (e != -std::numeric_limits<float>::infinity()) acc[i] += std::exp(e - row_lse);
      }
    };
    auto scored = [&](const BatchSeq& s, const AttnUnit& w) {
      return score_layer && seq_score_off_[w.seq] >= 0 && w.t0 + w.n > s.score_from;
    };
    // Units go to the threads by their work, not their count: a long context that eviction or
    // Quest thinned out reads few of its split parts' pages, and which parts depends on the
    // table (kept pages cluster at the start and the end).
    auto unit_pages = [&](const AttnUnit& w) {  // the table a unit reads
      if (quest_layer && quest_on_[w.seq]) return static_cast<const int32_t*>(quest_tables_[size_t(w.seq) * c.n_head_kv + w.head].data());
      return Batch::group_pages(batch.seqs[w.seq], grp);
    };
    if (!walking) balance_units(nthr, bs, batch, unit_pages);
    const int64_t* bounds = walking ? walk_bounds_.data() + int64_t(grp) * (nthr + 1) : unit_bounds_.data();
    // Decode runs many short units (a sequence's KV head over a few pages), each of which would
    // start by waiting on RAM for its first tiles: the next unit's first pages are asked for
    // before this one computes (paged_attention_prefetch).
    auto prefetch_unit = [&](const AttnUnit& w) {
      PagedKvView v = view;
      v.pages = unit_pages(w);
      const BatchSeq& s = batch.seqs[w.seq];
      const int64_t pos = s.pos0 + w.t0;
      const int64_t kb = w.split >= 0 ? w.key_begin : window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t ke = w.split >= 0 ? w.key_end : pos + w.n;
      constexpr int kPages = 4;  // the kernels' own look-ahead (attention_impl.h, kPrefetchAhead)
      paged_attention_prefetch(v, w.head, kb, ke, kPages);
    };
    // Walking with no page filled in this layer: each unit's queries roped into its thread's
    // walk_q_, its new keys written by it (own_unit), no barrier before the attention. A page
    // that fills (a staged layer's, or one with key summaries) is finished before any query
    // reads it, and later tokens of the run read its quantized tiles: then the writes go first,
    // as outside the walk.
    const bool own = walking && walk_own && n_fill == 0;
    auto attend = [&](int ith, int nth) {
      int64_t b, e;
      const float* qb = own ? walk_q_[ith].data() : qkv_.data();
      const int64_t q_stride = own ? n_q : n_qkv;
      auto own_unit = [&](const AttnUnit& w) {
        const BatchSeq& s = batch.seqs[w.seq];
        uint8_t* done = walk_roped_[ith].data();
        for (int64_t t = s.offset + w.t0; t < s.offset + w.t0 + w.n; ++t) {
          if (!done[t * c.n_head_kv + w.head]) {
            done[t * c.n_head_kv + w.head] = 1;
            own_q(ith, t, w.head);
          }
          // a split unit writes the run's keys in its key range, the only new keys it reads
          if (w.split < 0 || (tok_pos_[t] >= w.key_begin && tok_pos_[t] < w.key_end)) own_kv(t, w.head);
        }
      };
      if (own) {
        std::fill(walk_roped_[ith].begin(), walk_roped_[ith].end(), uint8_t{0});
      } else if (write_in_job) {
        ThreadPool::split(n_tok, ith, nth, 1, &b, &e);
        for (int64_t t = b; t < e; ++t) rope_write(t);
        tp.barrier();
        if (n_fill > 0) {
          ThreadPool::split(n_fill, ith, nth, 1, &b, &e);
          for (int64_t i = b; i < e; ++i) pool.finish_page(li, fill[i]);
          tp.barrier();
        }
      }
      b = bounds[ith], e = bounds[ith + 1];
      for (int64_t u = b; u < e; ++u) {
        const AttnUnit& w = units[u];
        const BatchSeq& s = batch.seqs[w.seq];
        if (u + 1 < e) prefetch_unit(units[u + 1]);
        if (own) own_unit(w);
        PagedKvView v = view;
        v.pages = unit_pages(w);
        const int64_t t = s.offset + w.t0;
        if (w.split < 0 && !scored(s, w)) {
          paged_attention(v, w.head, n_group, qb + t * q_stride, q_stride, s.pos0 + w.t0, w.n, scale,
                          attn_.data() + t * n_q, n_q);
        } else if (w.split < 0) {  // as paged_attention, tile by tile, keeping each page's share
          thread_local std::vector<float> acc, m, l, lse;
          const int64_t rows_max = int64_t(kAttnQTile) * n_group, n_pg = (s.pos0 + w.t0 + w.n + bs - 1) / bs;
          acc.resize(rows_max * HD);
          m.resize(rows_max);
          l.resize(rows_max);
          lse.resize(rows_max * n_pg);
          for (int32_t t0 = 0; t0 < w.n; t0 += kAttnQTile) {
            const int nt = std::min<int>(kAttnQTile, w.n - t0);
            const int64_t pos = s.pos0 + w.t0 + t0, tt = t + t0;
            paged_attention_partial(v, w.head, n_group, qb + tt * q_stride, q_stride, pos, nt, 0, pos + nt, scale,
                                    acc.data(), m.data(), l.data(), lse.data(), n_pg);
            attention_merge(1, n_group, nt, HD, acc.data(), m.data(), l.data(), w.head, attn_.data() + tt * n_q, n_q);
            for (int r = 0; r < nt * n_group; ++r)
              if (w.t0 + t0 + r / n_group >= s.score_from && l[r] > 0)
                add_mass(ith, w.seq, lse.data(), n_pg, 0, (pos + nt + bs - 1) / bs, r, m[r] + std::log(l[r]));
          }
        } else {
          const AttnSplit& sp = splits_[w.split];
          const int64_t rows = int64_t(w.n) * n_group;
          // This thread's next units that are the following KV heads of the same key range
          // (plan_attention orders them so) run in one pass, unless Quest gave each head its
          // own pages: paged_attention_partial_heads.
          AttnHeads heads;
          if (!(quest_layer && quest_on_[w.seq]))
            while (u + heads.n < e && heads.n < kAttnMaxHeads && (heads.n + 1) * rows <= int64_t(kAttnQTile) * kAttnMaxGroup &&
                   units[u + heads.n].seq == w.seq && units[u + heads.n].part == w.part &&
                   units[u + heads.n].split == w.split + heads.n && units[u + heads.n].head == w.head + heads.n)
              ++heads.n;
          if (own)
            for (int k = 1; k < heads.n; ++k) own_unit(units[u + k]);
          if (heads.n > 1) {
            heads.acc_stride = splits_[w.split + 1].acc_off - sp.acc_off;
            heads.ml_stride = splits_[w.split + 1].ml_off - sp.ml_off;
            heads.lse_stride = heads.ml_stride * ppp;
          }
          paged_attention_partial_heads(
              v, w.head, n_group, qb + t * q_stride, q_stride, s.pos0 + w.t0, w.n, w.key_begin, w.key_end, scale,
              part_acc_.data() + sp.acc_off + w.part * rows * HD, part_m_.data() + sp.ml_off + w.part * rows,
              part_l_.data() + sp.ml_off + w.part * rows,
              scored(s, w) ? part_lse_.data() + (sp.ml_off + w.part * rows) * ppp : nullptr, ppp, heads);
          u += heads.n - 1;
        }
      }
      if (splits_.empty()) return;
      tp.barrier();
      ThreadPool::split(static_cast<int64_t>(splits_.size()), ith, nth, 1, &b, &e);
      for (int64_t i = b; i < e; ++i) {
        const AttnSplit& sp = splits_[i];
        const BatchSeq& s = batch.seqs[sp.seq];
        const int64_t t = s.offset + sp.t0;
        attention_merge(sp.n_parts, n_group, sp.n, c.head_dim, part_acc_.data() + sp.acc_off, part_m_.data() + sp.ml_off,
                        part_l_.data() + sp.ml_off, sp.head, attn_.data() + t * n_q, n_q);
        if (!scored(s, AttnUnit{sp.seq, sp.head, sp.t0, sp.n, 0, 0, 0, 0})) continue;
        const int rows = sp.n * n_group;
        const float* pm = part_m_.data() + sp.ml_off;
        const float* pl = part_l_.data() + sp.ml_off;
        const int64_t ctx = s.pos0 + sp.t0 + sp.n;
        for (int r = 0; r < rows; ++r) {
          if (sp.t0 + r / n_group < s.score_from) continue;
          float mx = -std::numeric_limits<float>::infinity();
          for (int p = 0; p < sp.n_parts; ++p) mx = std::max(mx, pm[p * rows + r]);
          double lsum = 0;
          for (int p = 0; p < sp.n_parts; ++p)
            if (pm[p * rows + r] != -std::numeric_limits<float>::infinity()) lsum += std::exp(double(pm[p * rows + r] - mx)) * pl[p * rows + r];
          if (lsum <= 0) continue;
          const float row_lse = mx + static_cast<float>(std::log(lsum));
          for (int p = 0; p < sp.n_parts; ++p) {
            const int64_t page0 = p * ppp, n_pg = std::min<int64_t>(ppp, (ctx + bs - 1) / bs - page0);
            add_mass(ith, sp.seq, part_lse_.data() + (sp.ml_off + int64_t(p) * rows) * ppp, ppp, page0, n_pg, r, row_lse);
          }
        }
      }
    };
    if (walking) {
      attend(ith, nthr);
      tp.barrier();
      if (ith == 0) times_.attention += since(t_attn);
    } else {
      tp.run(attend);
      pool.release_filled(li);
      times_.attention += since(t_attn);
    }
    // tmp = attn · Woᵀ
    mm(ith, L.wo, attn_.data(), tmp_.data());
    ffn(L, ith, x, h, o);
    return Status::ok();
  };

  if (!walk) {
    for (int il = 0; il < c.n_layer; ++il) {
      Status st = layer(il, -1, x_.data(), h_.data(), tmp_.data());
      if (!st) return st;
    }
  } else {
    // Every layer's staging slots first, in order, and the pages each layer's writes fill.
    fill_off_.assign(1, 0);
    for (int il = 0; il < c.n_layer; ++il) {
      const int grp = layer_group_[il], li = layer_slot_[il];
      PagePool& pool = *pools[grp];
      for (int64_t t = 0; t < n_tok; ++t) {
        const int32_t page = page_of(t, grp), slot = slot_of(t);
        if (!pool.begin_write(li, page, slot)) {
          for (int j = 0; j <= il; ++j) pools[layer_group_[j]]->release_filled(layer_slot_[j]);
          return Status::error("KV staging slots exhausted (more partly filled pages than the pool was sized for)");
        }
        if (slot == bs - 1 && pool.finishes_pages(li)) {
          fill_pages_.push_back(page);
          pool.mark_filled(li, page);
        }
      }
      fill_off_.push_back(static_cast<int64_t>(fill_pages_.size()));
    }
    // Each KV group's attention units shared out by their work (as balance_units per layer).
    walk_bounds_.resize(size_t(n_groups) * (nthr + 1));
    for (int g = 0; g < n_groups; ++g) {
      balance_units(nthr, bs, batch, [&](const AttnUnit& w) { return Batch::group_pages(batch.seqs[w.seq], g); });
      std::copy(unit_bounds_.begin(), unit_bounds_.begin() + nthr + 1, walk_bounds_.begin() + int64_t(g) * (nthr + 1));
    }
    walk_x_.resize(nthr);
    walk_h_.resize(nthr);
    walk_o_.resize(nthr);
    walk_q_.resize(nthr);
    walk_roped_.resize(nthr);
    for (int i = 0; i < nthr; ++i) {
      walk_q_[i].resize(size_t(n_tok * n_q));
      walk_roped_[i].resize(size_t(n_tok * c.n_head_kv));
      walk_x_[i].resize(size_t(n_tok * E));
      walk_h_[i].resize(size_t(n_tok * std::max<int64_t>(E, c.n_ff)));
      walk_o_[i].resize(size_t(n_tok * E));
    }
    tp.run([&](int ith, int) {
      float* x = walk_x_[ith].data();
      std::memcpy(x, x_.data(), size_t(n_tok * E) * sizeof(float));
      for (int il = 0; il < c.n_layer; ++il) layer(il, ith, x, walk_h_[ith].data(), walk_o_[ith].data());
      if (ith == 0) std::memcpy(x_.data(), x, size_t(n_tok * E) * sizeof(float));
    });
    for (int il = 0; il < c.n_layer; ++il) pools[layer_group_[il]]->release_filled(layer_slot_[il]);
  }

  if (scoring) finish_scores();
  // Logits for the last n_logits tokens of each run that asked.
  const auto t_logits = Clock::now();
  int64_t r = 0;
  for (const BatchSeq& s : batch.seqs) {
    if (!s.want_logits) continue;
    for (int64_t t = s.offset + s.n_tokens - s.n_logits; t < s.offset + s.n_tokens; ++t) {
      rms_norm(x_.data() + t * E, output_norm_.data(), last_.data() + r * E, E, c.rms_eps);
      ++r;
    }
  }
  if (r > 0) matmul(output_, last_.data(), r, logits, tp);
  if (c.final_softcap > 0)
    for (int64_t i = 0; i < r * int64_t(c.n_vocab); ++i) logits[i] = c.final_softcap * std::tanh(logits[i] / c.final_softcap);
  times_.logits = since(t_logits);
  times_.total = since(t_begin);
  return Status::ok();
}

// MLA, absorbed: per token, q (per head [q_nope (dn) ‖ q_pe (dr)]) and the latent row
// kv = [c (C) ‖ k_pe (dr)]; c is RMS-normed, q_pe and k_pe rotated (adjacent pairs), the row
// written into the page (its only KV). Each head's query becomes [W_UKᵀ q_nope (C) ‖ q_pe]: all
// heads are one query group over the single latent "KV head" of width C + dr, scale
// 1/√(dn + dr); the kernel's output per head is Σ p·c (C values, the values being the K tile's
// first C channels), then o[h] = W_UV[h] · that, and attn_output.
Status LlamaModel::mla_attention(const Batch& batch, int il, PagePool& pool, ThreadPool& tp) {
  const ModelConfig& c = cfg_;
  const Layer& L = layers_[il];
  const int li = layer_slot_[il];
  const int64_t n_tok = static_cast<int64_t>(batch.tokens.size());
  const int64_t H = c.n_head, C = c.kv_lora_rank, dn = c.qk_nope, dr = c.qk_rope, dv = c.v_head_dim;
  const int64_t n_qh = H * (dn + dr), HD = c.head_dim;  // HD = C + dr
  const int64_t first = (c.q_lora_rank > 0 ? c.q_lora_rank : n_qh) + C + dr;
  const int64_t bs = pool.layout().block_size;
  // [q or q_a | kv] = h · [Wq ; Wkv_a]ᵀ
  matmul(L.wqkv, h_.data(), n_tok, qkv_.data(), tp);
  const float* qsrc = qkv_.data();
  int64_t q_stride = first;
  if (c.q_lora_rank > 0) {
    const int64_t R = c.q_lora_rank;
    for (int64_t t = 0; t < n_tok; ++t) rms_norm(qkv_.data() + t * first, L.q_a_norm.data(), mla_qa_.data() + t * R, R, c.rms_eps);
    matmul(L.wq_b, mla_qa_.data(), n_tok, mla_qb_.data(), tp);
    qsrc = mla_qb_.data();
    q_stride = n_qh;
  }
  const int64_t kv_off = first - (C + dr);
  // Latent rows: norm + rope, then into the pages (one writer: staging slots are taken here).
  for (int64_t t = 0; t < n_tok; ++t) {
    float* kv = qkv_.data() + t * first + kv_off;
    rms_norm(kv, L.kv_a_norm.data(), kv, C, c.rms_eps);
    rope(kv + C, 1, static_cast<int>(dr), static_cast<int>(dr), tok_pos_[t], c.rope_base, c.rope_scale, c.rope_style);
  }
  for (const BatchSeq& s : batch.seqs)
    for (int32_t i = 0; i < s.n_tokens; ++i) {
      const int64_t t = s.offset + i, pos = s.pos0 + i;
      const int32_t page = Batch::group_pages(s, 0)[pos / bs];
      if (!pool.write_token(li, page, static_cast<int>(pos % bs), qkv_.data() + t * first + kv_off, nullptr)) {
        pool.release_filled(li);
        return Status::error("KV staging slots exhausted (more partly filled pages than the pool was sized for)");
      }
    }
  // Absorbed queries: mla_q_[t][h] = [W_UK[h]ᵀ q_nope (C) ‖ rope(q_pe) (dr)]
  tp.run([&](int ith, int nth) {
    int64_t b, e;
    ThreadPool::split(n_tok, ith, nth, 1, &b, &e);
    for (int64_t t = b; t < e; ++t) {
      float* q = const_cast<float*>(qsrc) + t * q_stride;
      rope(q + dn, static_cast<int>(H), static_cast<int>(dn + dr), static_cast<int>(dr), tok_pos_[t], c.rope_base,
           c.rope_scale, c.rope_style);
      for (int64_t h = 0; h < H; ++h) {
        const float* qn = q + h * (dn + dr);
        float* out = mla_q_.data() + t * H * HD + h * HD;
        const float* w = L.w_uk.data() + h * C * dn;
        for (int64_t k = 0; k < C; ++k) {
          float a = 0.f;
          for (int64_t i = 0; i < dn; ++i) a += w[k * dn + i] * qn[i];
          out[k] = a;
        }
        std::memcpy(out + C, qn + dn, dr * sizeof(float));
      }
    }
  });
  // Latent attention: one KV head, all H query heads in its group; out [n_tok][H][C].
  PagedKvView view = pool.view(li);
  const float scale = 1.f / std::sqrt(static_cast<float>(dn + dr));
  const int n_group = static_cast<int>(H);
  const int64_t q_ld = H * HD, o_ld = H * C;
  tp.run([&](int ith, int nth) {
    int64_t b, e;
    ThreadPool::split(static_cast<int64_t>(units_.size()), ith, nth, 1, &b, &e);
    for (int64_t u = b; u < e; ++u) {
      const AttnUnit& w = units_[u];
      const BatchSeq& s = batch.seqs[w.seq];
      PagedKvView v = view;
      v.pages = Batch::group_pages(s, 0);
      const int64_t t = s.offset + w.t0;
      if (w.split < 0) {
        paged_attention(v, w.head, n_group, mla_q_.data() + t * q_ld, q_ld, s.pos0 + w.t0, w.n, scale,
                        attn_.data() + t * o_ld, o_ld);
      } else {
        const AttnSplit& sp = splits_[w.split];
        const int64_t rows = int64_t(w.n) * n_group;
        paged_attention_partial(v, w.head, n_group, mla_q_.data() + t * q_ld, q_ld, s.pos0 + w.t0, w.n, w.key_begin,
                                w.key_end, scale, part_acc_.data() + sp.acc_off + w.part * rows * C,
                                part_m_.data() + sp.ml_off + w.part * rows, part_l_.data() + sp.ml_off + w.part * rows);
      }
    }
    if (splits_.empty()) return;
    tp.barrier();
    ThreadPool::split(static_cast<int64_t>(splits_.size()), ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; ++i) {
      const AttnSplit& sp = splits_[i];
      const BatchSeq& s = batch.seqs[sp.seq];
      const int64_t t = s.offset + sp.t0;
      attention_merge(sp.n_parts, n_group, sp.n, static_cast<int>(C), part_acc_.data() + sp.acc_off,
                      part_m_.data() + sp.ml_off, part_l_.data() + sp.ml_off, sp.head, attn_.data() + t * o_ld, o_ld);
    }
  });
  pool.release_filled(li);
  // o[t][h] = W_UV[h] · o_lat[t][h]   (dv each), then attn_output
  tp.run([&](int ith, int nth) {
    int64_t b, e;
    ThreadPool::split(n_tok, ith, nth, 1, &b, &e);
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* lat = attn_.data() + t * o_ld + h * C;
        const float* w = L.w_uv.data() + h * dv * C;
        float* o = mla_o_.data() + (t * H + h) * dv;
        for (int64_t k = 0; k < dv; ++k) {
          float a = 0.f;
          for (int64_t j = 0; j < C; ++j) a += w[k * C + j] * lat[j];
          o[k] = a;
        }
      }
  });
  matmul(L.wo, mla_o_.data(), n_tok, tmp_.data(), tp);
  return Status::ok();
}

}  // namespace kv
