// StreamingLLM's re-indexing: a sequence that evicts pages can run past the positions its model
// may use (max_model_len). When its next position would be the first one past them, the holes
// eviction left in its block table are closed: the kept page at logical index j moves to j' =
// the number of kept pages before it, its slots' positions drop by (j - j')·block_size, and its
// keys, cached after RoPE, are re-rotated by that many positions (rotations compose:
// R(p - Δ) = R(-Δ)·R(p); LlamaModel::shift_keys). Queries then get positions within the cache,
// as StreamingLLM assigns them, and the sequence goes on at position n_tokens - dropped.
//
// Pages before the first hole do not move (a published prefix stays valid). A moved page that
// another holder shares (n > 1 forks) is copied first: copy-on-write, as for any write.
// The sliding-window group of a hybrid model moves by group 0's plan; its pages at indices
// group 0 evicted are freed. Quantized pages are requantized after the rotation (one more
// round trip); Quest's key bounds follow (PagePool::transform_keys).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "kv/page_pool.h"

namespace kv {

struct ReindexPlan {
  std::vector<int64_t> kept;  // old logical pages that stay, ascending: kept[i] moves to i
  int64_t n_before = 0;       // positions of the table before
  int64_t n_after = 0;        // and after
  bool empty() const { return n_after == n_before; }
  int64_t dropped() const { return n_before - n_after; }
};

// The plan for group 0's table of n_tokens positions (-1 entries: evicted pages). Nothing to do
// (empty()) when the table has no hole before its last position.
ReindexPlan plan_reindex(const std::vector<int32_t>& pages, int64_t n_tokens, int32_t block_size);

// shift(page, n_slots, delta): re-rotate the keys of slots [0, n_slots) of a page by -delta.
using KeyShift = std::function<void(int32_t page, int32_t n_slots, int64_t delta)>;

// Step 1 for each group: the shared pages the plan moves (their keys will change) are replaced
// by private copies (copy-on-write). False when a copy found no free page or staging slot; the
// table then holds some identical private copies and is otherwise unchanged: try again later.
bool unshare_moved(const ReindexPlan& plan, PagePool& pool, std::vector<int32_t>* pages);
// Step 2, once step 1 succeeded for every group: moved pages' keys are shifted, the table is
// closed up, and pages at indices the plan drops are released.
void move_pages(const ReindexPlan& plan, PagePool& pool, std::vector<int32_t>* pages, const KeyShift& shift);

// Per-page values (eviction scores) follow their pages; entries past the array stay absent.
void reindex_pages_of(const ReindexPlan& plan, std::vector<float>* per_page);

// A sequence's tokens follow: the kept pages' tokens, then those past the table (not computed
// yet). Returns how many of the first n_prompt tokens were dropped.
int64_t reindex_tokens(const ReindexPlan& plan, int32_t block_size, int64_t n_prompt, std::vector<int32_t>* tokens);

}  // namespace kv
