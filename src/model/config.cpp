#include "model/config.h"

#include <cmath>

#include "kv/kv_size.h"

#include "gguf/gguf.h"

namespace kv {

Result<ModelConfig> ModelConfig::from_gguf(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.get_string("general.architecture", "");
  if (!arch) return arch.status();
  c.arch = *arch;
  if (c.arch.empty()) return Result<ModelConfig>::error("general.architecture is missing");
  auto name = f.get_string("general.name", c.arch);
  c.name = name ? *name : c.arch;
  const std::string p = c.arch + ".";
  Status err;
  auto geti = [&](const std::string& k, int64_t d, int32_t* out) {
    auto v = f.get_int(p + k, d);
    if (!v) { if (err) err = v.status(); return; }
    if (*v < 0 || *v > (1 << 30)) { if (err) err = Status::error("metadata " + p + k + " out of range: " + std::to_string(*v)); return; }
    *out = static_cast<int32_t>(*v);
  };
  auto getf = [&](const std::string& k, double d, float* out) {
    auto v = f.get_float(p + k, d);
    if (!v) { if (err) err = v.status(); return; }
    *out = static_cast<float>(*v);
  };
  geti("block_count", 0, &c.n_layer);
  geti("embedding_length", 0, &c.n_embd);
  geti("feed_forward_length", 0, &c.n_ff);
  geti("attention.head_count", 0, &c.n_head);
  geti("attention.head_count_kv", c.n_head, &c.n_head_kv);
  geti("context_length", 2048, &c.n_ctx_train);
  getf("rope.freq_base", 10000.0, &c.rope_base);
  getf("attention.layer_norm_rms_epsilon", 1e-5, &c.rms_eps);
  float scale = 1.f;
  getf("rope.scaling.factor", 1.0, &scale);
  if (!err) return err;
  // A NaN or negative epsilon (or RoPE base) loads but turns every logit into NaN; say so at load.
  if (!std::isfinite(c.rms_eps) || c.rms_eps <= 0 || c.rms_eps > 1)
    return Result<ModelConfig>::error("metadata " + p + "attention.layer_norm_rms_epsilon is " + std::to_string(c.rms_eps) + ", not in (0, 1]");
  if (!std::isfinite(c.rope_base) || c.rope_base <= 0)
    return Result<ModelConfig>::error("metadata " + p + "rope.freq_base is " + std::to_string(c.rope_base) + ", not a positive number");
  if (!std::isfinite(scale)) return Result<ModelConfig>::error("metadata " + p + "rope.scaling.factor is not a finite number");
  c.rope_scale = scale > 0 ? 1.f / scale : 1.f;
  if (c.n_layer <= 0 || c.n_embd <= 0 || c.n_ff <= 0 || c.n_head <= 0 || c.n_head_kv <= 0)
    return Result<ModelConfig>::error("model metadata incomplete: block_count, embedding_length, feed_forward_length and head_count must be positive");
  if (c.n_head % c.n_head_kv != 0)
    return Result<ModelConfig>::error("head_count " + std::to_string(c.n_head) + " is not a multiple of head_count_kv " + std::to_string(c.n_head_kv));
  int32_t hd_default = c.n_embd / c.n_head;
  geti("attention.key_length", hd_default, &c.head_dim);
  geti("rope.dimension_count", c.head_dim, &c.n_rot);
  if (!err) return err;
  if (c.head_dim <= 0 || c.head_dim > 1024 || c.n_rot <= 0 || c.n_rot > c.head_dim || c.n_rot % 2)
    return Result<ModelConfig>::error("bad head_dim " + std::to_string(c.head_dim) + " / rope dimension " + std::to_string(c.n_rot));
  if (const GgufValue* toks = f.find("tokenizer.ggml.tokens")) c.n_vocab = static_cast<int32_t>(toks->arr.size());
  int32_t nv = c.n_vocab;
  geti("vocab_size", nv, &c.n_vocab);
  if (!err) return err;
  if (c.arch == "gemma3") {
    c.gemma3 = true;
    getf("rope.freq_base_swa", 10000.0, &c.rope_base_swa);
    getf("final_logit_softcapping", 0.0, &c.final_softcap);
    if (!err) return err;
    if (!std::isfinite(c.rope_base_swa) || c.rope_base_swa <= 0 || !std::isfinite(c.final_softcap) || c.final_softcap < 0)
      return Result<ModelConfig>::error("gemma3: rope.freq_base_swa or final_logit_softcapping is not a usable number");
    std::vector<bool> local;
    auto win = sliding_window_layers(f, c.n_layer, &local, nullptr);
    if (!win) return win.status();
    if (win.value() < 0 || win.value() > (int64_t(1) << 30))
      return Result<ModelConfig>::error("bad sliding window " + std::to_string(win.value()));
    c.n_swa = static_cast<int32_t>(win.value());
    if (c.n_swa > 0) c.layer_swa = local;
  }
  // llama-family GGUFs were permuted by the converter for adjacent-pair RoPE.
  c.rope_style = (c.arch == "llama" || c.arch == "mistral" || c.arch == "granite") ? RopeStyle::kNorm : RopeStyle::kNeox;
  if (c.arch == "deepseek2") {
    c.mla = true;
    c.rope_style = RopeStyle::kNorm;  // GGML_ROPE_TYPE_NORM: adjacent pairs
    int32_t rope_dim = 0, k_mla = 0, v_mla = 0, key_len = 0, val_len = 0;
    geti("attention.kv_lora_rank", 0, &c.kv_lora_rank);
    geti("attention.q_lora_rank", 0, &c.q_lora_rank);
    geti("rope.dimension_count", 0, &rope_dim);
    geti("attention.key_length_mla", 0, &k_mla);
    geti("attention.value_length_mla", 0, &v_mla);
    geti("attention.key_length", 0, &key_len);
    geti("attention.value_length", 0, &val_len);
    geti("leading_dense_block_count", 0, &c.n_layer_dense_lead);
    if (!err) return err;
    if (f.find(p + "rope.scaling.yarn_log_multiplier"))
      return Result<ModelConfig>::error("deepseek2: YaRN RoPE scaling is not supported");
    if (auto st = f.get_string(p + "rope.scaling.type", "none"); st && *st != "none")
      return Result<ModelConfig>::error("deepseek2: RoPE scaling '" + *st + "' is not supported");
    if (c.n_layer_dense_lead < c.n_layer)
      return Result<ModelConfig>::error("deepseek2: MoE layers are not supported (leading_dense_block_count " +
                                        std::to_string(c.n_layer_dense_lead) + " < block_count " +
                                        std::to_string(c.n_layer) + "); only all-dense models run");
    if (k_mla > 0 && v_mla > 0) {  // split attn_k_b / attn_v_b (current converters)
      c.qk_nope = k_mla - rope_dim;
      c.v_head_dim = v_mla;
    } else {  // legacy: attn_kv_b, key_length = dn + dr, value_length = dv
      c.mla_legacy = true;
      c.qk_nope = key_len - rope_dim;
      c.v_head_dim = val_len;
    }
    c.qk_rope = rope_dim;
    if (c.kv_lora_rank <= 0 || rope_dim <= 0 || rope_dim % 2 || c.qk_nope <= 0 || c.v_head_dim <= 0 || c.q_lora_rank < 0)
      return Result<ModelConfig>::error("deepseek2: bad MLA dimensions (kv_lora_rank " + std::to_string(c.kv_lora_rank) +
                                        ", rope " + std::to_string(rope_dim) + ", qk_nope " + std::to_string(c.qk_nope) +
                                        ", v_head " + std::to_string(c.v_head_dim) + ")");
    // The cache's view: one latent "KV head" of width C + dr, rotated in its last dr channels
    // (the model rotates q_pe / k_pe itself; n_rot is dr).
    c.n_head_kv = 1;
    c.head_dim = c.kv_lora_rank + rope_dim;
    c.n_rot = rope_dim;
  }
  return c;
}

std::string max_model_len_warning(int64_t max_model_len, int32_t n_ctx_train, bool meant, const std::string& name,
                                  const std::string& meant_name) {
  if (meant || n_ctx_train <= 0 || max_model_len <= n_ctx_train) return "";
  return name + " " + std::to_string(max_model_len) + " is past the model's training context (" + std::to_string(n_ctx_train) +
         " tokens, the GGUF's context_length): positions beyond it were never trained, expect worse text past " +
         std::to_string(n_ctx_train) + " (" + meant_name + " says it is meant and drops this warning)";
}

}  // namespace kv
