// KV eviction and sparse reads for long contexts: which pages of a sequence stay.
//
// Unit: the page. A sequence's cache (its global layer group; sliding-window groups are
// bounded already) splits into a start area of sink pages, an evictable middle and a recent
// area; only whole pages of the middle go, every layer and KV head at once, so what is evicted
// is memory given back to the pool (DESIGN.md: per-token or per-head holes free nothing unless
// compacted). An evicted page leaves -1 in the block table; the attention kernels skip it.
// Kept keys keep their original positions (keys are cached after RoPE; nothing is re-rotated).
//
// Policies (each ranks the evictable pages; the lowest go first):
//   window  recent tokens only (no sinks): oldest first
//   sinks   StreamingLLM: sink tokens + recent: oldest first
//   h2o     heavy hitters: attention mass each page has received, summed over every query
//           since the sequence began, over layers, KV heads and the query heads of each group
//   snapkv  the mass from the queries since the previous eviction (at the end of a prompt:
//           the last obs_window prompt queries: SnapKV's observation window), reset after
//           each eviction
// Budgets count tokens in kept pages (the filling tail page counts its written slots).
// Evictions happen only when a page has just filled or a prompt has ended, so decoding a
// token at a time and teacher-forcing page-aligned chunks evict the same pages.
//
// Quest (sparse reads, no eviction): per (layer, page, KV head) the channel-wise mean and
// variance of the page's keys (kept by PagePool); a decode query reads its sink and recent
// pages (by default its own page and the 3 before it) plus the sparse_pages pages with the
// highest score q·mean + quest_spread(block_size)·sqrt(Σ_d q_d²·var_d), an estimate of the
// page's highest q·k (Quest's paper ranks by the upper bound Σ_d max(q_d·min_d, q_d·max_d);
// docs/eviction.md has both measured). Cold pages (kColdPage entries, cold_store.h) are
// candidates like resident ones, ranked by the summaries kept in RAM.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "kv/page_pool.h"

namespace kv {

enum class EvictionPolicy : uint8_t { kNone, kWindow, kSinks, kH2O, kSnapKV };

const char* eviction_policy_name(EvictionPolicy p);
Result<EvictionPolicy> parse_eviction_policy(const std::string& s);

struct EvictionConfig {
  EvictionPolicy policy = EvictionPolicy::kNone;
  int64_t budget = 0;         // tokens kept per sequence (global layer group)
  int32_t sink_tokens = 4;    // kept from the start (window: none)
  int32_t recent_tokens = -1; // kept at the end; -1: the policy's default (recent())
  int32_t obs_window = 32;    // SnapKV: prompt queries that vote at the end of a prompt
  // Quest sparse reads (independent of eviction): 0 = off, else pages read per decode query
  // beyond the sink and recent pages.
  int32_t sparse_pages = 0;
  // Hot and cold pages (kv/cold_store.h, needs Quest and no eviction policy): pages beyond the
  // budget go to the L2 spill file instead of leaving; Quest reads them back when it picks them.
  bool offload_cold = false;

  bool evicts() const { return policy != EvictionPolicy::kNone; }
  bool wants_scores() const { return policy == EvictionPolicy::kH2O || policy == EvictionPolicy::kSnapKV; }
  bool sparse() const { return sparse_pages > 0; }
  bool active() const { return evicts() || sparse(); }
  // Tokens of the start area: sink_tokens (window: 0).
  int32_t sinks() const { return policy == EvictionPolicy::kWindow ? 0 : sink_tokens; }
  // Tokens of the recent area (whole pages before the filling one): recent_tokens, or by
  // default what the budget leaves after the sink pages and the filling page (window, sinks),
  // half of the budget (h2o, as the H2O paper splits it), a quarter (snapkv).
  int64_t recent(int32_t block_size) const;
  // Whole pages of the start area / recent area at this block size.
  int64_t sink_pages(int32_t block_size) const { return (sinks() + block_size - 1) / block_size; }
  int64_t recent_pages(int32_t block_size) const { return (recent(block_size) + block_size - 1) / block_size; }
  // Quest: tokens always read at the end: recent_tokens, by default the query's own page and
  // the 3 before it.
  int64_t quest_recent(int32_t block_size) const {
    return std::max<int64_t>(recent_tokens >= 0 ? recent_tokens : 4 * block_size, block_size);
  }
  // Quest: pages a decode query reads at most (sink, recent, sparse_pages).
  int64_t quest_pages_read(int32_t block_size) const {
    return sink_pages(block_size) + (quest_recent(block_size) + block_size - 1) / block_size + sparse_pages;
  }
  // Cold pages (offload_cold): the pages one layer's selections read at once when each of
  // n_head_kv KV heads picks its own sparse_pages, and the most pages a sequence past its budget
  // holds during a step (its budget, or that layer's reads when they are more: cold_extra_pages).
  // (The recent area's tokens end at the query, so unaligned they span one page more.)
  int64_t quest_layer_pages(int32_t block_size, int32_t n_head_kv) const {
    return sink_pages(block_size) + (quest_recent(block_size) - 1) / block_size + 2 + int64_t(n_head_kv) * sparse_pages;
  }
  int64_t cold_cap_pages(int32_t block_size, int32_t n_head_kv) const {
    return std::max<int64_t>(budget / block_size, quest_layer_pages(block_size, n_head_kv));
  }
  int64_t cold_extra_pages(int32_t block_size, int32_t n_head_kv) const {
    return cold_cap_pages(block_size, n_head_kv) - budget / block_size;
  }
  // The budget must leave room for one evictable page beyond sinks and recent, and everything
  // must be non-negative.
  Status validate(int32_t block_size) const;
  // e.g. "h2o budget 2048 sinks 4 recent 1024" (recent as whole pages of block_size)
  std::string describe(int32_t block_size = 16) const;
};

// Tokens held by the live pages of a block table of n_tokens positions (-1 entries: gone).
int64_t kept_tokens(const std::vector<int32_t>& pages, int64_t n_tokens, int32_t block_size);

// The pure policy: logical page indices to evict (ascending) so that the kept tokens of the
// table fall to the budget or below, taking only evictable pages (not sink, not recent, not
// the tail). scores: per logical page (h2o, snapkv), else ignored; ties go to the older page.
std::vector<int64_t> choose_evictions(const EvictionConfig& cfg, int32_t block_size, const std::vector<int32_t>& pages,
                                      int64_t n_tokens, const std::vector<float>& scores);

// Quest's page score: the expected maximum of n independent standard normal draws (1.766 for
// n = 16), so that q·mu + quest_spread(block_size) · sd(q·k) estimates the highest q·k in a
// full page whose scores spread like a normal (kernels/ops.h key_score_pages). Integrates
// numerically; the last n's value is kept per thread.
double quest_spread(int32_t n);

// Quest: logical pages a decode query at position pos reads when the sparse config is on:
// sink pages, recent pages (the page of pos included) and the k evictable pages with the
// highest score; score[i] per logical page (ignored for -1 pages). Writes the mask as a copy
// of pages with unselected entries set to -1 into out (resized to pos / block_size + 1).
// runners_up (optional): the next n_runners_up candidates by score after the selected ones
// (what a cold-page prefetch reads ahead).
void quest_select(const EvictionConfig& cfg, int32_t block_size, const int32_t* pages, int64_t pos, const float* score,
                  std::vector<int32_t>* out, std::vector<int32_t>* scratch, int32_t n_runners_up = 0,
                  std::vector<int32_t>* runners_up = nullptr);

// What the owner of a sequence (Engine, SequenceRunner) calls around a forward.
// The first token of a run [pos0, pos0 + n) whose queries add to the page scores: SnapKV's
// observation window is the last obs_window of the n_known tokens (a prompt's end; in decode,
// every query), the other scored policies take every token.
int32_t score_from(const EvictionConfig& cfg, int64_t n_known, int64_t pos0, int32_t n);
// After a run, with n_tokens positions written: evicts what the policy says when due (a page
// has just filled, or a run of several tokens, a prompt, has ended): releases the pages,
// writes -1 into the table, resets SnapKV's scores. Returns the logical pages evicted.
std::vector<int64_t> evict_if_due(const EvictionConfig& cfg, PagePool& pool, std::vector<int32_t>& pages, int64_t n_tokens,
                                  bool prompt_end, std::vector<float>& scores);

}  // namespace kv
