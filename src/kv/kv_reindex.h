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

// shift(group, page, n_slots, delta): re-rotate the keys of slots [0, n_slots) of a page of
// layer group `group` by -delta positions.
using KeyShift = std::function<void(int group, int32_t page, int32_t n_slots, int64_t delta)>;

// Shared pages the plan moves in a table (their keys will change, so each needs a copy first).
int32_t moved_shared(const ReindexPlan& plan, const PagePool& pool, const std::vector<int32_t>& pages);

// Applies the plan to a sequence's tables: group 0 (pools[0], tables[0]) and, for a hybrid
// model, group 1 (pools[1], tables[1]; null when there is none). First, in every group, shared
// pages that move are replaced by private copies (copy-on-write); then moved pages' keys are
// shifted, the tables closed up, pages at indices the plan drops released, and n_tokens set.
// False when a copy found no free page or staging slot (callers count them first with
// moved_shared): the tables then hold some identical private copies and are otherwise
// unchanged, and the caller may try again later.
bool apply_reindex(const ReindexPlan& plan, PagePool* const pools[2], BlockTable* const tables[2], const KeyShift& shift);

// Per-page values (eviction scores) follow their pages; entries past the array stay absent.
void reindex_pages_of(const ReindexPlan& plan, std::vector<float>* per_page);

// A sequence's tokens follow: the kept pages' tokens, then those past the table (not computed
// yet). Returns how many of the first n_prompt tokens were dropped.
int64_t reindex_tokens(const ReindexPlan& plan, int32_t block_size, int64_t n_prompt, std::vector<int32_t>* tokens);

}  // namespace kv
