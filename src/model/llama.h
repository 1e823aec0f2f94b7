// The Llama-family forward (MHA / GQA / MQA by n_head_kv; RoPE; RMSNorm; SwiGLU; tied or
// separate output) over paged KV storage, and Gemma 3 (QK-norm, post-norms, GELU-tanh gated
// MLP, √d-scaled embeddings, sliding-window layers interleaved with global ones), and
// DeepSeek-V2 MLA (arch "deepseek2", dense layers): one KV group whose pages hold only the
// latent row [c_kv ‖ k_pe] per token and layer (KvLayout::v_from_k = kv_lora_rank, n_head_kv 1),
// attention in the absorbed form (W_UK folded into the query, W_UV applied to the latent
// output) so no per-head K or V is ever materialised.
//
// KV layer groups: layers that share a page pool and block table. Llama: one group. Gemma 3:
// group 0 = the global (full-attention) layers, group 1 = the sliding-window layers, whose
// pages outside the window can be freed (a block table entry of -1 is such a freed page).
//
// Weights are packed once at load from the mmap'd GGUF (which must outlive the model). One
// forward() processes a Batch: every run's K/V is written into its pages, attention reads
// K/V straight from pages, and logits come out for the runs that asked. Called from one
// thread (the engine thread); parallelism is inside, on the ThreadPool passed in.
#pragma once
#include <memory>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "kernels/matmul.h"
#include "kv/page_pool.h"
#include "model/batch.h"
#include "model/config.h"

namespace kv {

class GgufFile;

struct LoadProgress {
  virtual ~LoadProgress() = default;
  virtual void on_tensor(int done, int total) = 0;
};

class LlamaModel {
 public:
  static Result<std::unique_ptr<LlamaModel>> load(const GgufFile& f, Isa isa, LoadProgress* progress = nullptr);

  const ModelConfig& config() const { return cfg_; }
  struct KvGroup {
    const char* name;             // "global", "local"
    std::vector<int32_t> layers;  // model layer indices, ascending
    int32_t window = 0;           // > 0: sliding window (positions a query sees)
  };
  const std::vector<KvGroup>& kv_groups() const { return groups_; }
  // The layout of group g. layer_dtypes: per model layer overrides (empty: every layer `dtype`).
  KvLayout kv_layout(int32_t block_size, KvDtype dtype, std::vector<KvDtype> layer_dtypes = {}, int g = 0) const;
  // Bytes of weights one decode token reads (every matrix once + one embedding row).
  int64_t weight_bytes_per_token() const { return weight_bytes_; }
  // Identifies the weights (tensor directory + a sample of every tensor's bytes): part of the
  // prefix cache's chain hash, so pages are never shared across different models.
  uint64_t fingerprint() const { return fingerprint_; }

  // StreamingLLM's re-indexing (kv/kv_reindex.h): keys are cached after RoPE, and rotations
  // compose, so the keys in slots [0, n_slots) of `page` become those of positions `delta`
  // earlier by one more rotation, by -delta, in every layer of group g with that layer's RoPE
  // base. Not for MLA (refused before any eviction).
  void shift_keys(PagePool& pool, int g, int32_t page, int32_t n_slots, int64_t delta) const;

  // Runs the batch. logits: [batch.n_logit_rows()][n_vocab], rows in batch.seqs order.
  // The pool's layout must equal kv_layout(...) for some block size and dtype.
  Status forward(const Batch& batch, PagePool& pool, ThreadPool& tp, float* logits);
  // Models with several KV groups: pools[g] holds group g (BatchSeq::pages / pages_g1).
  Status forward(const Batch& batch, PagePool* const* pools, ThreadPool& tp, float* logits);

  // Where the last forward's time went (wall seconds on the calling thread): attention = RoPE,
  // the KV page writes and paged attention (MLA: its whole attention block); logits = the
  // output norm and projection; the rest of the forward is matmuls, norms and activations.
  struct ForwardTimes {
    double total = 0, attention = 0, logits = 0;
  };
  const ForwardTimes& last_forward_times() const { return times_; }
  // Whether forwards of fewer than 8 rows walk every layer in one job (the default; the
  // environment's KV_WALK=0 turns it off, for comparison). Same results either way.
  void set_walk(bool on) { walk_on_ = on; }

 private:
  ForwardTimes times_;
  bool walk_on_ = walk_default();
  static bool walk_default();
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;  // [n_embd]
    std::vector<float> q_norm, k_norm;       // [head_dim] (Gemma 3)
    std::vector<float> post_attn_norm, post_ffw_norm;  // [n_embd] (Gemma 3)
    PackedMatrix wqkv;                       // [n_embd] -> [(n_head + 2 n_head_kv) head_dim]
    PackedMatrix wo;                         // [n_head head_dim] -> [n_embd]
    PackedMatrix wgu;                        // [n_embd] -> [2 n_ff] (gate rows, then up rows)
    PackedMatrix wdown;                      // [n_ff] -> [n_embd]
    // MLA (deepseek2): wqkv = [attn_q (or attn_q_a) ; attn_kv_a_mqa], wo = attn_output.
    PackedMatrix wq_b;                       // [q_lora] -> [n_head (dn + dr)] (q_lora_rank > 0)
    std::vector<float> q_a_norm;             // [q_lora]
    std::vector<float> kv_a_norm;            // [C]
    std::vector<float> w_uk;                 // [n_head][C][dn]: q_lat[h] = w_uk[h] · q_nope[h]
    std::vector<float> w_uv;                 // [n_head][dv][C]: o[h] = w_uv[h] · o_lat[h]
  };
  LlamaModel() = default;
  void ensure_scratch(int64_t n_tokens, int64_t n_logits);
  Status load_mla_layer(const GgufFile& f, int il, Isa isa, Layer* L);
  // MLA attention block of layer il: from h_ (normed input) to tmp_ (the attn_output result).
  Status mla_attention(const Batch& batch, int il, PagePool& pool, ThreadPool& tp);

  ModelConfig cfg_;
  std::vector<KvGroup> groups_;
  std::vector<int32_t> layer_group_, layer_slot_;  // per model layer: its group, its index there
  RawMatrix tok_embd_{};                     // [n_vocab][n_embd], read one row per token
  std::vector<float> output_norm_;           // [n_embd]
  PackedMatrix output_;                      // [n_embd] -> [n_vocab]
  std::vector<Layer> layers_;
  int64_t weight_bytes_ = 0;
  uint64_t fingerprint_ = 0;

  // Scratch, grown to the largest batch seen; never allocated per token.
  int64_t cap_tokens_ = 0, cap_logits_ = 0;
  std::vector<float> x_;     // [n_tokens][n_embd] residual stream
  std::vector<float> h_;     // [n_tokens][max(n_embd, n_ff)] normed input / activation
  std::vector<float> qkv_;   // [n_tokens][(n_head + 2 n_head_kv) head_dim]
  std::vector<float> attn_;  // [n_tokens][n_head head_dim]
  std::vector<float> gu_;    // [n_tokens][2 n_ff]
  std::vector<float> last_;  // [n_logits][n_embd]
  std::vector<float> tmp_;   // [n_tokens][n_embd]
  // MLA scratch: absorbed queries [n_tokens][n_head (C + dr)], q after attn_q_b
  // [n_tokens][n_head (dn + dr)], normed q_a [n_tokens][q_lora], per-head values
  // [n_tokens][n_head dv].
  std::vector<float> mla_q_, mla_qb_, mla_qa_, mla_o_;
  std::vector<int64_t> tok_pos_;   // [n_tokens] position of each batch token
  std::vector<int32_t> tok_seq_;   // [n_tokens] its batch sequence
  // The walk (forward of a few rows, all layers in one job): per thread its residual stream,
  // normed input / activation and normed output, the roped queries of its attention units
  // and which (token, KV head)s it roped in the current layer; each KV group's unit_bounds_.
  std::vector<std::vector<float>> walk_x_, walk_h_, walk_o_, walk_q_;
  std::vector<std::vector<uint8_t>> walk_roped_;
  std::vector<int64_t> walk_bounds_;
  // The pages this forward fills (finished in the attention job); in a walk layer il's are
  // fill_pages_[fill_off_[il], fill_off_[il + 1]).
  std::vector<int32_t> fill_pages_;
  std::vector<int64_t> fill_off_;
  // Attention work units: (sequence, kv head, tile of query tokens, key range), spread over
  // threads. A run of at most kAttnQTile tokens with a long context is split into parts of
  // kSplitKeys keys (flash-decoding); the parts' partial results are merged by log-sum-exp.
  // The split depends only on the run itself, never on the rest of the batch, so a
  // sequence's result is the same alone or batched.
  static constexpr int64_t kSplitKeys = 512;
  struct AttnUnit { int32_t seq, head, t0, n; int64_t key_begin, key_end; int32_t split, part; };
  struct AttnSplit { int32_t seq, head, t0, n, n_parts; int64_t acc_off, ml_off; };
  void plan_attention(const Batch& batch, int32_t block_size);
  // Splits units_ into n_threads contiguous ranges of about equal work (query rows × pages
  // each unit will read: evicted pages and Quest's unselected ones cost nothing), into
  // unit_bounds_[0..n_threads]. pages(unit) is the table the unit reads.
  template <class PagesOf>
  void balance_units(int n_threads, int32_t block_size, const Batch& batch, PagesOf pages);
  std::vector<AttnUnit> units_;
  std::vector<int64_t> unit_bounds_, unit_cost_;
  std::vector<AttnSplit> splits_;
  std::vector<float> part_acc_, part_m_, part_l_;
  // Eviction scores and Quest selections of the current forward (kv/kv_eviction.h, BatchSeq).
  // Each thread adds page masses into its own row of score_acc_ (one stretch per distinct
  // page_scores array); the rows are summed into the arrays when the forward ends.
  struct ScoreSlot { float* dst; int64_t n_pages; int64_t off; };
  std::vector<ScoreSlot> score_slots_;
  std::vector<int64_t> seq_score_off_;              // per batch seq: offset of its stretch, or -1
  std::vector<std::vector<float>> score_acc_;       // [thread][Σ n_pages]
  std::vector<float> part_lse_;                     // split parts: [ml_off + row][pages per part]
  std::vector<std::vector<int32_t>> quest_tables_;  // [seq × n_head_kv + head]: pages to read
  std::vector<std::vector<float>> quest_scores_;    // [seq × n_head_kv + head]: each page's score
  std::vector<uint8_t> quest_on_;                   // per batch seq
  std::vector<std::vector<int32_t>> quest_runners_; // [seq × n_head_kv + head]: cold-page prefetch candidates
  bool prepare_scores(const Batch& batch, int n_threads, int32_t block_size);
  void finish_scores();
  bool prepare_quest(const Batch& batch);
  void resolve_cold(const Batch& batch);  // after a layer's selection: cold picks made resident
  void quest_select_layer(const Batch& batch, const PagePool& pool, int li, ThreadPool& tp);
};

}  // namespace kv
