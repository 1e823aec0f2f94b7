#include "kv/kv_reindex.h"

#include <algorithm>
#include <cassert>

namespace kv {

ReindexPlan plan_reindex(const std::vector<int32_t>& pages, int64_t n_tokens, int32_t block_size) {
  ReindexPlan p;
  p.n_before = p.n_after = n_tokens;
  const int64_t used = (n_tokens + block_size - 1) / block_size;
  for (int64_t j = 0; j < int64_t(pages.size()); ++j) {
    if (pages[j] >= 0 || j >= used) p.kept.push_back(j);  // pages past the positions hold nothing yet
    else p.n_after -= block_size;                         // an evicted page is always a whole one
  }
  return p;
}

namespace {
int32_t slots_of(const ReindexPlan& plan, int64_t j, int32_t bs) {
  return static_cast<int32_t>(std::clamp<int64_t>(plan.n_before - j * bs, 0, bs));
}

// Page kept[i] of the table must be copied before its keys change: it moves, holds keys, and
// another holder shares it.
bool needs_copy(const ReindexPlan& plan, size_t i, const PagePool& pool, const std::vector<int32_t>& t) {
  const int64_t j = plan.kept[i];
  return j != int64_t(i) && j < int64_t(t.size()) && t[j] >= 0 && slots_of(plan, j, pool.layout().block_size) > 0 &&
         pool.refcount(t[j]) > 1;
}

bool unshare_moved(const ReindexPlan& plan, PagePool& pool, std::vector<int32_t>& t) {
  for (size_t i = 0; i < plan.kept.size(); ++i) {
    if (!needs_copy(plan, i, pool, t)) continue;
    const int64_t j = plan.kept[i];
    std::vector<int32_t> fresh;
    if (!pool.allocate(1, &fresh)) return false;
    if (!pool.copy_page(t[j], fresh[0])) {
      pool.release(fresh[0]);
      return false;
    }
    pool.release(t[j]);
    t[j] = fresh[0];
  }
  return true;
}

void move_pages(const ReindexPlan& plan, int group, PagePool& pool, std::vector<int32_t>& t, const KeyShift& shift) {
  const int32_t bs = pool.layout().block_size;
  std::vector<int32_t> out;
  out.reserve(plan.kept.size());
  std::vector<bool> keep(t.size(), false);
  for (size_t i = 0; i < plan.kept.size(); ++i) {
    const int64_t j = plan.kept[i];
    if (j >= int64_t(t.size())) break;  // a group with fewer pages than group 0
    keep[j] = true;
    out.push_back(t[j]);
    const int32_t n = slots_of(plan, j, bs);
    if (t[j] >= 0 && j != int64_t(i) && n > 0) {
      assert(pool.refcount(t[j]) == 1);
      shift(group, t[j], n, (j - int64_t(i)) * bs);
    }
  }
  for (size_t j = 0; j < t.size(); ++j)
    if (!keep[j] && t[j] >= 0) pool.release(t[j]);
  t = std::move(out);
}
}  // namespace

int32_t moved_shared(const ReindexPlan& plan, const PagePool& pool, const std::vector<int32_t>& pages) {
  int32_t n = 0;
  for (size_t i = 0; i < plan.kept.size(); ++i) n += needs_copy(plan, i, pool, pages);
  return n;
}

bool apply_reindex(const ReindexPlan& plan, PagePool* const pools[2], BlockTable* const tables[2], const KeyShift& shift) {
  if (plan.empty()) return true;
  for (int g = 0; g < 2; ++g)
    if (pools[g] && !unshare_moved(plan, *pools[g], tables[g]->pages)) return false;
  for (int g = 0; g < 2; ++g) {
    if (!pools[g]) continue;
    move_pages(plan, g, *pools[g], tables[g]->pages, shift);
    tables[g]->n_tokens = plan.n_after;
  }
  return true;
}

void reindex_pages_of(const ReindexPlan& plan, std::vector<float>* per_page) {
  if (plan.empty()) return;
  std::vector<float> out;
  for (int64_t j : plan.kept) {
    if (j >= int64_t(per_page->size())) break;
    out.push_back((*per_page)[j]);
  }
  *per_page = std::move(out);
}

int64_t reindex_tokens(const ReindexPlan& plan, int32_t block_size, int64_t n_prompt, std::vector<int32_t>* tokens) {
  if (plan.empty()) return 0;
  std::vector<int32_t> out;
  out.reserve(tokens->size() - plan.dropped());
  int64_t prompt_dropped = n_prompt;
  for (int64_t j : plan.kept) {
    const int64_t a = j * block_size, b = std::min<int64_t>(a + block_size, plan.n_before);
    if (a >= b) break;
    out.insert(out.end(), tokens->begin() + a, tokens->begin() + b);
    prompt_dropped -= std::clamp<int64_t>(n_prompt - a, 0, b - a);
  }
  out.insert(out.end(), tokens->begin() + plan.n_before, tokens->end());
  prompt_dropped -= std::max<int64_t>(0, n_prompt - plan.n_before);
  *tokens = std::move(out);
  return prompt_dropped;
}

}  // namespace kv
