// Runs one sequence's tokens through the model over its own pages: allocates pages on demand
// from the pool and feeds the tokens in chunks. The single-sequence path used by
// `kvserve generate`, `kvserve bench` and the tests; the batching engine builds on the same
// Batch/BlockTable contract.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "kv/page_pool.h"
#include "model/llama.h"

namespace kv {

class SequenceRunner {
 public:
  SequenceRunner(LlamaModel& model, PagePool& pool, ThreadPool& tp, int32_t chunk = 512)
      : model_(model), pool_(pool), tp_(tp), chunk_(chunk) {}
  ~SequenceRunner() { reset(); }

  // Appends tokens to the sequence (chunked); logits of the last one land in logits()
  // when want_logits. Fails without changing the KV if the pool lacks pages.
  Status feed(const int32_t* tokens, int64_t n, bool want_logits = true);
  // Logits for every fed position (teacher forcing): runs chunks with one logit row per token.
  Status feed_all_logits(const int32_t* tokens, int64_t n, std::vector<float>* out /*[n][n_vocab]*/);
  const std::vector<float>& logits() const { return logits_; }
  int64_t n_tokens() const { return table_.n_tokens; }
  const BlockTable& table() const { return table_; }
  void reset() { table_.release_all(pool_); }

 private:
  Status reserve(int64_t n_new);
  LlamaModel& model_;
  PagePool& pool_;
  ThreadPool& tp_;
  int32_t chunk() const;  // chunk_, capped by the pool's staging slots for quantized layers
  int32_t chunk_;
  BlockTable table_;
  Batch batch_;
  std::vector<float> logits_;  // [n_vocab]
};

}  // namespace kv
