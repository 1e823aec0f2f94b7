#include "kv/kv_eviction.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kv/cold_store.h"

namespace kv {

int64_t EvictionConfig::recent(int32_t block_size) const {
  if (recent_tokens >= 0) return recent_tokens;
  switch (policy) {
    case EvictionPolicy::kWindow:
    case EvictionPolicy::kSinks: return std::max<int64_t>(0, (budget / block_size - sink_pages(block_size) - 1) * block_size);
    case EvictionPolicy::kH2O: return budget / 2;
    case EvictionPolicy::kSnapKV: return budget / 4;
    case EvictionPolicy::kNone: return 0;
  }
  return 0;
}

Status EvictionConfig::validate(int32_t block_size) const {
  if (sink_tokens < 0 || recent_tokens < -1 || obs_window < 1 || sparse_pages < 0 || budget < 0)
    return Status::error("KV eviction: sink tokens, recent tokens, budget and sparse pages must be >= 0, the observation window >= 1");
  if (offload_cold) {
    if (!sparse() || evicts()) return Status::error("cold pages (--kv-offload-cold) need Quest sparse reads (--kv-sparse quest) and no eviction policy");
    const int64_t fixed = (sink_pages(block_size) + (quest_recent(block_size) + block_size - 1) / block_size + 1) * block_size;
    if (budget < fixed)
      return Status::error("KV budget " + std::to_string(budget) + " leaves no room for cold pages: sink pages, the recent pages and the filling page take " +
                           std::to_string(fixed) + " tokens at block size " + std::to_string(block_size) + " (--kv-budget is the RAM kept per sequence)");
  }
  if (!evicts()) return Status::ok();
  if (budget <= 0) return Status::error(std::string("KV eviction policy ") + eviction_policy_name(policy) + " needs a budget (--kv-budget, tokens kept per sequence)");
  const int64_t fixed = (sink_pages(block_size) + recent_pages(block_size) + 1) * block_size;
  if (budget < fixed)
    return Status::error("KV budget " + std::to_string(budget) + " leaves no room to evict: sink pages, recent pages and the filling page take " +
                         std::to_string(fixed) + " tokens at block size " + std::to_string(block_size) + " (raise the budget or lower sink/recent tokens)");
  return Status::ok();
}

std::string EvictionConfig::describe(int32_t block_size) const {
  std::string s = evicts() || !sparse() ? eviction_policy_name(policy) : "";  // Quest alone: "quest 4 pages"
  if (evicts()) s += " budget " + std::to_string(budget) + " sinks " + std::to_string(sinks()) + " recent " + std::to_string(recent(block_size));
  if (sparse()) s += std::string(evicts() ? ", " : "") + "quest " + std::to_string(sparse_pages) + " pages";
  if (offload_cold) s += ", cold pages to disk beyond " + std::to_string(budget) + " tokens";
  return s;
}

int64_t kept_tokens(const std::vector<int32_t>& pages, int64_t n_tokens, int32_t block_size) {
  int64_t kept = 0;
  for (size_t i = 0; i < pages.size(); ++i)
    if (pages[i] >= 0) kept += std::clamp<int64_t>(n_tokens - int64_t(i) * block_size, 0, block_size);
  return kept;
}

std::vector<int64_t> choose_evictions(const EvictionConfig& cfg, int32_t block_size, const std::vector<int32_t>& pages,
                                      int64_t n_tokens, const std::vector<float>& scores) {
  std::vector<int64_t> out;
  if (!cfg.evicts()) return out;
  // The filling page counts as full (it will be), so the kept tokens never exceed the budget
  // between evictions; when the tail page is full the next page counts already.
  const int64_t n_full = n_tokens / block_size;
  int64_t kept = block_size;
  for (int64_t i = 0; i < n_full && i < int64_t(pages.size()); ++i) kept += pages[i] >= 0 ? block_size : 0;
  if (kept <= cfg.budget) return out;
  const int64_t n_pages = std::min<int64_t>(pages.size(), (n_tokens + block_size - 1) / block_size);
  // Evictable: full pages after the sink pages and before the recent area (which ends at the
  // tail; the tail page is always recent).
  const int64_t first = cfg.sink_pages(block_size);
  // recent: the recent_pages full pages before the filling one (index n_full)
  const int64_t last = std::min<int64_t>(n_full - cfg.recent_pages(block_size), n_pages);  // exclusive
  std::vector<int64_t> cand;
  for (int64_t i = first; i < last; ++i)
    if (pages[i] >= 0) cand.push_back(i);
  if (cfg.wants_scores()) {
    auto score = [&](int64_t i) { return i < int64_t(scores.size()) ? scores[i] : 0.f; };
    std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return score(a) < score(b); });
  }
  for (int64_t i : cand) {
    if (kept <= cfg.budget) break;
    out.push_back(i);
    kept -= block_size;
  }
  std::sort(out.begin(), out.end());
  return out;
}

double quest_spread(int32_t n) {
  thread_local int32_t last_n = -1;  // one integral per thread and block size, not per layer and step
  thread_local double last = 0;
  if (n == last_n) return last;
  // E[max] = ∫ x · n φ(x) Φ(x)^(n−1) dx, by the midpoint rule over [−10, 10]
  constexpr int kSteps = 4000;
  constexpr double kLo = -10, kHi = 10, kDx = (kHi - kLo) / kSteps;
  double e = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double x = kLo + (i + 0.5) * kDx;
    const double phi = std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI), cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    e += x * n * phi * std::pow(cdf, n - 1) * kDx;
  }
  last_n = n;
  return last = e;
}

void quest_select(const EvictionConfig& cfg, int32_t block_size, const int32_t* pages, int64_t pos, const float* score,
                  std::vector<int32_t>* out, std::vector<int32_t>* scratch, int32_t n_runners_up,
                  std::vector<int32_t>* runners_up) {
  if (runners_up) runners_up->clear();
  const int64_t n = pos / block_size + 1;
  out->assign(pages, pages + n);
  const int64_t first = cfg.sink_pages(block_size);
  // recent (quest_recent): what a token attends to most is the text just before it, and a
  // query early in its page would otherwise see almost none of it unless its score picked it.
  const int64_t recent_from = std::max<int64_t>(0, pos + 1 - cfg.quest_recent(block_size)) / block_size;
  scratch->clear();
  for (int64_t i = first; i < recent_from && i < n; ++i)
    if (pages[i] >= 0 || pages[i] == kColdPage) scratch->push_back(static_cast<int32_t>(i));
  const int64_t k = cfg.sparse_pages;
  if (int64_t(scratch->size()) <= k) return;
  // the k highest scores stay (ties: the later page), the rest are not read
  auto higher = [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a > b); };
  std::nth_element(scratch->begin(), scratch->begin() + k, scratch->end(), higher);
  for (size_t j = k; j < scratch->size(); ++j) (*out)[(*scratch)[j]] = -1;
  if (runners_up && n_runners_up > 0) {
    const int64_t m = std::min<int64_t>(n_runners_up, int64_t(scratch->size()) - k);
    std::nth_element(scratch->begin() + k, scratch->begin() + k + m - 1, scratch->end(), higher);
    runners_up->assign(scratch->begin() + k, scratch->begin() + k + m);
  }
}

int32_t score_from(const EvictionConfig& cfg, int64_t n_known, int64_t pos0, int32_t n) {
  if (cfg.policy != EvictionPolicy::kSnapKV) return 0;
  return static_cast<int32_t>(std::clamp<int64_t>(n_known - cfg.obs_window - pos0, 0, n));
}

std::vector<int64_t> evict_if_due(const EvictionConfig& cfg, PagePool& pool, std::vector<int32_t>& pages, int64_t n_tokens,
                                  bool prompt_end, std::vector<float>& scores) {
  const int32_t bs = pool.layout().block_size;
  if (!cfg.evicts() || (!prompt_end && n_tokens % bs != 0)) return {};
  std::vector<int64_t> out = choose_evictions(cfg, bs, pages, n_tokens, scores);
  for (int64_t i : out) {
    pool.release(pages[i]);
    pages[i] = -1;
  }
  if (!out.empty() && cfg.policy == EvictionPolicy::kSnapKV) std::fill(scores.begin(), scores.end(), 0.f);
  return out;
}

}  // namespace kv

