// The work of one forward pass: runs of consecutive tokens from one or more sequences.
// Built by the engine (or a CLI loop), read by Model::forward. The pages a run writes must be
// allocated in the sequence's block table before forward is called.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/kv_eviction.h"

namespace kv {
class ColdTable;
}

namespace kv {

// KV layer groups a model may have (global full-attention layers; sliding-window layers).
inline constexpr int kMaxKvGroups = 2;

struct BatchSeq {
  const int32_t* pages = nullptr;  // the sequence's block table (covers pos0 + n_tokens), group 0
  const int32_t* pages_g1 = nullptr;  // group 1's block table (hybrid models), else null
  int64_t pos0 = 0;                // position of the run's first token (= tokens already in KV)
  int32_t n_tokens = 0;            // run length; the run's tokens are tokens[offset, offset+n)
  int32_t offset = 0;
  bool want_logits = false;        // logits for the run's last n_logits tokens
  // Eviction scores (kv/kv_eviction.h): when set, the attention mass each page of group 0
  // receives from the run's tokens at index ≥ score_from is added to page_scores[logical
  // page] (summed over group-0 layers, KV heads and query heads). Runs may share one array.
  float* page_scores = nullptr;
  int32_t score_from = 0;
  // Quest sparse reads (kv/kv_eviction.h, sparse_pages > 0): a run of ≤ kAttnQTile tokens reads
  // only the pages quest_select picks, per group-0 layer and KV head. Needs the pool's key summaries.
  const EvictionConfig* quest = nullptr;
  // Cold pages (kv/cold_store.h): group 0's table may hold kColdPage entries; the model fetches
  // the ones a Quest selection picks (every one, for a run that does not read sparsely) and
  // stamps the pages each selection reads. Null: the table has no cold entries.
  ColdTable* cold = nullptr;
  int32_t n_logits = 1;            // with want_logits: rows for the run's last n_logits tokens
                                   // (speculative verification), in position order
};

struct Batch {
  std::vector<int32_t> tokens;   // [n_tokens_total]
  std::vector<BatchSeq> seqs;

  // Appends one sequence's run; returns its index.
  int add(const int32_t* pages, int64_t pos0, const int32_t* toks, int32_t n, bool want_logits,
          const int32_t* pages_g1 = nullptr) {
    BatchSeq s{pages, pages_g1, pos0, n, static_cast<int32_t>(tokens.size()), want_logits};
    tokens.insert(tokens.end(), toks, toks + n);
    seqs.push_back(s);
    return static_cast<int>(seqs.size()) - 1;
  }
  int32_t n_logit_rows() const {
    int32_t n = 0;
    for (const auto& s : seqs) n += s.want_logits ? s.n_logits : 0;
    return n;
  }
  void clear() { tokens.clear(); seqs.clear(); }
  static const int32_t* group_pages(const BatchSeq& s, int g) { return g == 0 ? s.pages : s.pages_g1; }
};

}  // namespace kv
