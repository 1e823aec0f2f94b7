// Runs one sequence's tokens through the model over its own pages: allocates pages on demand
// from the pool and feeds the tokens in chunks. The single-sequence path used by
// `kvserve generate`, `kvserve bench` and the tests; the batching engine builds on the same
// Batch/BlockTable contract.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "kv/cold_store.h"
#include "kv/kv_eviction.h"
#include "kv/page_pool.h"
#include "model/llama.h"

namespace kv {

class SequenceRunner {
 public:
  SequenceRunner(LlamaModel& model, PagePool& pool, ThreadPool& tp, int32_t chunk = 512)
      : model_(model), pool_(pool), tp_(tp), chunk_(chunk) {}
  // Hybrid models (two KV layer groups): pool_g1 holds group 1, the sliding-window layers,
  // whose pages are freed as soon as they leave the window.
  SequenceRunner(LlamaModel& model, PagePool& pool, PagePool* pool_g1, ThreadPool& tp, int32_t chunk = 512)
      : model_(model), pool_(pool), pool_g1_(pool_g1), tp_(tp), chunk_(chunk) {
    if (pool_g1_ && model.kv_groups().size() > 1) window_g1_ = model.kv_groups()[1].window;
  }
  ~SequenceRunner() { reset(); }

  // Appends tokens to the sequence (chunked); logits of the last one land in logits()
  // when want_logits. Fails without changing the KV if the pool lacks pages.
  Status feed(const int32_t* tokens, int64_t n, bool want_logits = true);
  // Logits for every fed position (teacher forcing): runs chunks with one logit row per token.
  Status feed_all_logits(const int32_t* tokens, int64_t n, std::vector<float>* out /*[n][n_vocab]*/);
  const std::vector<float>& logits() const { return logits_; }
  // Later feeds use chunks of c tokens (a long prefix in one chunk, then short ones).
  void set_chunk(int32_t c) { chunk_ = c; }
  int64_t n_tokens() const { return table_.n_tokens; }
  const BlockTable& table() const { return table_; }
  void reset() {
    scores_.clear();
    reindexed_ = 0;
    evicted_tokens_ = 0;
    cold_.release_all();
    table_.release_all(pool_);
    if (pool_g1_) table_g1_.release_all(*pool_g1_);
  }
  const BlockTable& table_g1() const { return table_g1_; }
  // Rolls the sequence back to its first n positions (n clamped to [0, n_tokens()]): pages
  // wholly past n go back to the pool, and the next feed overwrites positions n onward. A
  // kept page already quantized is rewritten through PagePool's staging (its first n % block
  // slots read back to f16, so they may differ by one quantization round trip). The pages
  // must be this sequence's alone (refcount 1), as they are for a SequenceRunner.
  // Hybrid models: false (and the sequence reset to empty) when the sliding-window pages the
  // position n needs were already freed; the caller must feed the tokens again. The same when
  // a cold page (cold_store.h) the position n needs cannot be read back.
  bool truncate(int64_t n);

  // Long-context policy (kv/kv_eviction.h) for this sequence, set before the first feed. The
  // runner scores pages as the policy asks and evicts when a page has just filled or a feed of
  // several tokens (a prompt) ends. Quest sparse reads enable the pool's key summaries.
  // cfg.offload_cold: pages beyond the budget go to `cold` (made on the pool, whose key summaries
  // must be on: call set_eviction first with offload_cold off, or enable them), and a prompt's
  // tokens beyond the budget are fed in Quest-sized runs so the budget holds throughout.
  Status set_eviction(const EvictionConfig& cfg, ColdStore* cold = nullptr);
  const EvictionConfig& eviction() const { return evict_; }
  // The positions the model may use (max_model_len; 0: no limit). With an evicting policy a
  // sequence goes on past them: when its next position would be n, the holes eviction left are
  // closed and the kept keys re-rotated (StreamingLLM's re-indexing, kv/kv_reindex.h). Without
  // one, a feed past them fails.
  void set_max_positions(int64_t n) { max_pos_ = n; }
  // Positions given back by re-indexing over the sequence's life.
  int64_t reindexed_tokens() const { return reindexed_; }
  int64_t evicted_tokens() const { return evicted_tokens_; }
  int64_t kept_tokens() const { return kv::kept_tokens(table_.pages, table_.n_tokens, pool_.layout().block_size); }
  // Resident tokens of group 0 (= kept_tokens: cold pages are not resident) and cold pages.
  int64_t cold_pages() const { return cold_.n_cold(); }

 private:
  Status reserve(int64_t n_new);
  // After a forward of len tokens: positions advance; cold pages go down to the budget.
  void advance(int64_t len);
  // Tokens a run may take from position table_.n_tokens: chunk, or a Quest tile once a
  // cold-page sequence is past its budget.
  int64_t run_len(int64_t want) const;
  // Frees group 1's pages that no query from position pos0 on can see.
  void slide(int64_t pos0);
  Status forward(float* logits);
  // Sets the batch's score / sparse fields for runs of this sequence; then evicts if due.
  void annotate_batch(int64_t feed_end);
  void maybe_evict(bool prompt_end);
  // Closes the table's holes before a run of len tokens would pass max_pos_ (see set_max_positions).
  Status fit_positions(int64_t len);
  EvictionConfig evict_;
  int64_t max_pos_ = 0;
  int64_t reindexed_ = 0;
  std::vector<float> scores_;  // per logical page (group 0)
  ColdTable cold_;
  int64_t evicted_tokens_ = 0;
  LlamaModel& model_;
  PagePool& pool_;
  PagePool* pool_g1_ = nullptr;
  int32_t window_g1_ = 0;
  BlockTable table_g1_;
  ThreadPool& tp_;
  int32_t chunk() const;  // chunk_, capped by the pool's staging slots for quantized layers
  int32_t chunk_;
  BlockTable table_;
  Batch batch_;
  std::vector<float> logits_;  // [n_vocab]
};

}  // namespace kv
