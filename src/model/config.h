// Hyperparameters of a model, read from GGUF metadata ({arch}.* keys).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/ops.h"

namespace kv {

class GgufFile;

struct ModelConfig {
  std::string arch;       // general.architecture
  std::string name;       // general.name
  int32_t n_layer = 0;
  int32_t n_embd = 0;
  int32_t n_ff = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;   // key_length, or n_embd / n_head
  int32_t n_rot = 0;      // rope.dimension_count, or head_dim
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;
  float rope_base = 10000.f;
  float rope_scale = 1.f;  // frequency scale (1 / linear scaling factor)
  float rms_eps = 1e-5f;
  RopeStyle rope_style = RopeStyle::kNorm;

  // Gemma 3 (arch "gemma3"): QK-norm, post-attention / post-FFN norms, GELU-tanh gated MLP,
  // embeddings scaled by √n_embd, sliding-window layers with their own RoPE base.
  bool gemma3 = false;
  int32_t n_swa = 0;                 // sliding window (0: none)
  std::vector<bool> layer_swa;       // per layer: true = sliding window (local)
  float rope_base_swa = 10000.f;     // RoPE base of sliding-window layers
  float final_softcap = 0.f;         // logits = c·tanh(logits / c) when > 0
  // DeepSeek-V2 MLA (arch "deepseek2", dense layers only). The KV cache holds one latent row per
  // token and layer: [c_kv (kv_lora_rank) ‖ k_pe (qk_rope)], so for the cache n_head_kv = 1 and
  // head_dim = kv_lora_rank + qk_rope; n_rot = qk_rope. Query heads are qk_nope + qk_rope
  // wide; attention runs absorbed (W_UK into the query, W_UV after the latent output).
  bool mla = false;
  int32_t q_lora_rank = 0;           // 0: attn_q; > 0: attn_q_a → attn_q_a_norm → attn_q_b
  int32_t kv_lora_rank = 0;          // C
  int32_t qk_nope = 0;               // dn
  int32_t qk_rope = 0;               // dr (= n_rot)
  int32_t v_head_dim = 0;            // dv
  bool mla_legacy = false;           // one attn_kv_b per layer (old GGUFs) instead of attn_k_b / attn_v_b
  int32_t n_layer_dense_lead = 0;    // leading_dense_block_count
  // Per query head: the attention kernel's output width (C for MLA: the latent; head_dim
  // otherwise). MLA's softmax scale is 1/√(dn + dr), not 1/√head_dim.
  int32_t attn_value_dim() const { return mla ? kv_lora_rank : head_dim; }
  bool hybrid() const {              // both local and global layers
    int n = 0;
    for (bool b : layer_swa) n += b;
    return n > 0 && n < n_layer;
  }

  // Reads and validates the config: every size positive, n_head a multiple of n_head_kv,
  // head_dim × n_head consistent with the tensors (checked by the loader).
  static Result<ModelConfig> from_gguf(const GgufFile& f);
  int32_t n_group() const { return n_head / n_head_kv; }  // query heads per KV head
  const char* attention_kind() const { return n_head_kv == n_head ? "MHA" : n_head_kv == 1 ? "MQA" : "GQA"; }
};

// A max_model_len past the training context (n_ctx_train, the GGUF's context_length) runs the
// model on positions it was never trained on: the warning to print once (llama.cpp warns; vLLM
// refuses unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, but the passkey and eviction benchmarks run
// SmolLM2 a little past its 8,192 on purpose), or "" within it or when `meant` (serve's
// --past-trained-context, Python's past_trained_context=True). `name` and `meant_name` spell the
// option and the flag as the caller takes them. An evicting KV policy goes on past max_model_len
// without any of this: it re-indexes positions below it (docs/eviction.md).
std::string max_model_len_warning(int64_t max_model_len, int32_t n_ctx_train, bool meant, const std::string& name,
                                  const std::string& meant_name);

}  // namespace kv
