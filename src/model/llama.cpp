#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf/gguf.h"
#include "kernels/attention.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

#include <xxhash.h>

namespace kv {

namespace {

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

}  // namespace

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(const GgufFile& f, Isa isa, LoadProgress* progress) {
  auto cfg = ModelConfig::from_gguf(f);
  if (!cfg) return cfg.status();
  if (cfg->arch != "llama" && cfg->arch != "gemma3")
    return Result<std::unique_ptr<LlamaModel>>::error("architecture '" + cfg->arch + "' is not supported (llama, gemma3)");
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->cfg_ = *cfg;
  const ModelConfig& c = m->cfg_;
  if (c.head_dim > kAttnMaxHeadDim || c.head_dim % 16 != 0)
    return Result<std::unique_ptr<LlamaModel>>::error("head_dim " + std::to_string(c.head_dim) + " is not supported by the attention kernel (a multiple of 16, at most " + std::to_string(kAttnMaxHeadDim) + ")");
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
  if (!layer_dtypes.empty())
    for (int32_t il : grp.layers) l.layer_dtypes.push_back(layer_dtypes[il]);
  l.n_layer = static_cast<int32_t>(grp.layers.size());
  l.n_head_kv = cfg_.n_head_kv;
  l.head_dim = cfg_.head_dim;
  l.block_size = block_size;
  l.dtype = dtype;
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
      for (int32_t h = 0; h < c.n_head_kv; ++h) {
        const int32_t split = static_cast<int32_t>(splits_.size());
        splits_.push_back({s, h, 0, bs.n_tokens, n_parts, acc, ml});
        for (int32_t p = 0; p < n_parts; ++p)
          units_.push_back({s, h, 0, bs.n_tokens, p * split_keys, std::min<int64_t>(ctx, (p + 1) * split_keys), split, p});
        acc += n_parts * rows * c.head_dim;
        ml += n_parts * rows;
      }
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

Status LlamaModel::forward(const Batch& batch, PagePool& pool, ThreadPool& tp, float* logits) {
  if (groups_.size() != 1) return Status::error("this model has " + std::to_string(groups_.size()) + " KV layer groups: pass one pool per group");
  PagePool* pools[1] = {&pool};
  return forward(batch, pools, tp, logits);
}

Status LlamaModel::forward(const Batch& batch, PagePool* const* pools, ThreadPool& tp, float* logits) {
  const ModelConfig& c = cfg_;
  const int n_groups = static_cast<int>(groups_.size());
  for (int g = 0; g < n_groups; ++g) {
    const KvLayout& l = pools[g]->layout();
    if (l.n_layer != static_cast<int32_t>(groups_[g].layers.size()) || l.n_head_kv != c.n_head_kv || l.head_dim != c.head_dim ||
        l.block_size != pools[0]->layout().block_size)
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
  const std::vector<AttnUnit>& units = units_;
  const int64_t bs = kl.block_size;

  for (int il = 0; il < c.n_layer; ++il) {
    const Layer& L = layers_[il];
    const int grp = layer_group_[il], li = layer_slot_[il];
    PagePool& pool = *pools[grp];
    const int32_t window = groups_[grp].window;
    const float rope_base = (!c.layer_swa.empty() && c.layer_swa[il]) ? c.rope_base_swa : c.rope_base;
    // h = rmsnorm(x) ; qkv = h · Wqkvᵀ     [n_tok][n_qkv]
    for (int64_t t = 0; t < n_tok; ++t) rms_norm(x_.data() + t * E, L.attn_norm.data(), h_.data() + t * E, E, c.rms_eps);
    matmul(L.wqkv, h_.data(), n_tok, qkv_.data(), tp);
    // RoPE on q and k, then write k and v into the pages (staged layers: into the page's f16
    // staging tiles, quantized when the page's last slot is written).
    for (const BatchSeq& s : batch.seqs) {
      for (int32_t i = 0; i < s.n_tokens; ++i) {
        const int64_t t = s.offset + i, pos = s.pos0 + i;
        float* row = qkv_.data() + t * n_qkv;
        if (c.gemma3) {  // QK-norm: RMSNorm over each head
          for (int h = 0; h < c.n_head; ++h) rms_norm(row + h * HD, L.q_norm.data(), row + h * HD, HD, c.rms_eps);
          for (int h = 0; h < c.n_head_kv; ++h) rms_norm(row + n_q + h * HD, L.k_norm.data(), row + n_q + h * HD, HD, c.rms_eps);
        }
        rope(row, c.n_head, c.head_dim, c.n_rot, pos, rope_base, c.rope_scale, c.rope_style);
        rope(row + n_q, c.n_head_kv, c.head_dim, c.n_rot, pos, rope_base, c.rope_scale, c.rope_style);
        const int32_t page = Batch::group_pages(s, grp)[pos / bs];
        const int slot = static_cast<int>(pos % bs);
        if (!pool.write_token(li, page, slot, row + n_q, row + n_q + n_kv)) {
          pool.release_filled(li);
          return Status::error("KV staging slots exhausted (more partly filled pages than the pool was sized for)");
        }
      }
    }
    // attn: [n_tok][n_q]
    PagedKvView view = pool.view(li);
    view.window = window;
    const int n_group = c.n_group();
    tp.run([&](int ith, int nth) {
      int64_t b, e;
      ThreadPool::split(static_cast<int64_t>(units.size()), ith, nth, 1, &b, &e);
      for (int64_t u = b; u < e; ++u) {
        const AttnUnit& w = units[u];
        const BatchSeq& s = batch.seqs[w.seq];
        PagedKvView v = view;
        v.pages = Batch::group_pages(s, grp);
        const int64_t t = s.offset + w.t0;
        if (w.split < 0) {
          paged_attention(v, w.head, n_group, qkv_.data() + t * n_qkv, n_qkv, s.pos0 + w.t0, w.n, scale,
                          attn_.data() + t * n_q, n_q);
        } else {
          const AttnSplit& sp = splits_[w.split];
          const int64_t rows = int64_t(w.n) * n_group;
          paged_attention_partial(v, w.head, n_group, qkv_.data() + t * n_qkv, n_qkv, s.pos0 + w.t0, w.n, w.key_begin,
                                  w.key_end, scale, part_acc_.data() + sp.acc_off + w.part * rows * HD,
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
        attention_merge(sp.n_parts, n_group, sp.n, c.head_dim, part_acc_.data() + sp.acc_off, part_m_.data() + sp.ml_off,
                        part_l_.data() + sp.ml_off, sp.head, attn_.data() + t * n_q, n_q);
      }
    });
    pool.release_filled(li);
    // x += attn · Woᵀ   (Gemma 3: normed first)
    matmul(L.wo, attn_.data(), n_tok, tmp_.data(), tp);
    if (c.gemma3)
      for (int64_t t = 0; t < n_tok; ++t) rms_norm(tmp_.data() + t * E, L.post_attn_norm.data(), tmp_.data() + t * E, E, c.rms_eps);
    add_inplace(x_.data(), tmp_.data(), n_tok * E);
    // x += down(silu(gate(h)) * up(h)),  h = rmsnorm(x)
    for (int64_t t = 0; t < n_tok; ++t) rms_norm(x_.data() + t * E, L.ffn_norm.data(), h_.data() + t * E, E, c.rms_eps);
    matmul(L.wgu, h_.data(), n_tok, gu_.data(), tp);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* g = gu_.data() + t * 2 * c.n_ff;
      if (c.gemma3) gelu_mul(g, g + c.n_ff, h_.data() + t * c.n_ff, c.n_ff);
      else silu_mul(g, g + c.n_ff, h_.data() + t * c.n_ff, c.n_ff);
    }
    matmul(L.wdown, h_.data(), n_tok, tmp_.data(), tp);
    if (c.gemma3)
      for (int64_t t = 0; t < n_tok; ++t) rms_norm(tmp_.data() + t * E, L.post_ffw_norm.data(), tmp_.data() + t * E, E, c.rms_eps);
    add_inplace(x_.data(), tmp_.data(), n_tok * E);
  }

  // Logits for the last token of each run that asked.
  int64_t r = 0;
  for (const BatchSeq& s : batch.seqs) {
    if (!s.want_logits) continue;
    const int64_t t = s.offset + s.n_tokens - 1;
    rms_norm(x_.data() + t * E, output_norm_.data(), last_.data() + r * E, E, c.rms_eps);
    ++r;
  }
  if (r > 0) matmul(output_, last_.data(), r, logits, tp);
  if (c.final_softcap > 0)
    for (int64_t i = 0; i < r * int64_t(c.n_vocab); ++i) logits[i] = c.final_softcap * std::tanh(logits[i] / c.final_softcap);
  return Status::ok();
}

}  // namespace kv
