#include "engine/sequence_runner.h"

#include "kernels/attention.h"
#include "kv/kv_reindex.h"

#include <algorithm>
#include <cstring>

namespace kv {

Status SequenceRunner::reserve(int64_t n_new) {
  const int32_t bs = pool_.layout().block_size;
  const int32_t need = BlockTable::pages_for(table_.n_tokens + n_new, bs) - static_cast<int32_t>(table_.pages.size());
  if (need > 0 && !pool_.allocate(need, &table_.pages))
    return Status::error("KV cache full: need " + std::to_string(need) + " more pages, " + std::to_string(pool_.n_free()) +
                         " free (raise --kv-cache-memory or shorten the prompt)");
  // The sliding-window group (pool_g1_) allocates chunk by chunk in forward(), so at most
  // window + chunk positions are held there.
  return Status::ok();
}

void SequenceRunner::slide(int64_t pos0) {
  if (!pool_g1_ || window_g1_ <= 0) return;
  const int64_t first_needed = std::max<int64_t>(0, pos0 - window_g1_ + 1) / pool_g1_->layout().block_size;
  for (int64_t i = 0; i < std::min<int64_t>(first_needed, table_g1_.pages.size()); ++i)
    if (table_g1_.pages[i] >= 0) {
      pool_g1_->release(table_g1_.pages[i]);
      table_g1_.pages[i] = -1;
    }
}

Status SequenceRunner::forward(float* logits) {
  if (pool_g1_) {
    // group 1 pages for the batch's positions (slid-out ones freed first)
    int64_t pos0 = batch_.seqs.front().pos0, end = pos0;
    for (const BatchSeq& s : batch_.seqs) end = std::max(end, s.pos0 + s.n_tokens);
    slide(pos0);
    const int32_t bs = pool_g1_->layout().block_size;
    const int32_t need = BlockTable::pages_for(end, bs) - static_cast<int32_t>(table_g1_.pages.size());
    if (need > 0 && !pool_g1_->allocate(need, &table_g1_.pages))
      return Status::error("KV cache full (sliding-window layers): need " + std::to_string(need) + " more pages, " +
                           std::to_string(pool_g1_->n_free()) + " free");
    for (BatchSeq& s : batch_.seqs) s.pages_g1 = table_g1_.pages.data();
    PagePool* pools[2] = {&pool_, pool_g1_};
    return model_.forward(batch_, pools, tp_, logits);
  }
  return model_.forward(batch_, pool_, tp_, logits);
}

bool SequenceRunner::truncate(int64_t n) {
  n = std::clamp<int64_t>(n, 0, table_.n_tokens);
  if (pool_g1_ && window_g1_ > 0 && n > 0) {
    // the window ending at n must still be allocated in the sliding-window group
    const int64_t bs = pool_g1_->layout().block_size;
    for (int64_t i = std::max<int64_t>(0, n - window_g1_) / bs; i < (n - 1) / bs + 1 && i < int64_t(table_g1_.pages.size()); ++i)
      if (table_g1_.pages[i] < 0) {
        reset();
        return false;
      }
  }
  if (!cold_.truncate(n)) {  // the partly kept page was cold and could not come back
    reset();
    return false;
  }
  const size_t keep = static_cast<size_t>(BlockTable::pages_for(n, pool_.layout().block_size));
  for (size_t i = keep; i < table_.pages.size(); ++i)
    if (table_.pages[i] >= 0) pool_.release(table_.pages[i]);
  table_.pages.resize(std::min(keep, table_.pages.size()));
  table_.n_tokens = n;
  if (pool_g1_) {  // sliding-window group: pages freed by the window cannot be brought back
    for (size_t i = keep; i < table_g1_.pages.size(); ++i)
      if (table_g1_.pages[i] >= 0) pool_g1_->release(table_g1_.pages[i]);
    table_g1_.pages.resize(std::min(keep, table_g1_.pages.size()));
    table_g1_.n_tokens = n;
  }
  return true;
}

Status SequenceRunner::set_eviction(const EvictionConfig& cfg, ColdStore* cold) {
  if (Status st = cfg.validate(pool_.layout().block_size); !st) return st;
  if (cfg.active() && model_.config().mla) return Status::error("KV eviction and sparse reads are not supported for MLA models");
  if (cfg.offload_cold && (!cold || &cold->pool() != &pool_)) return Status::error("cold pages need a cold store on the sequence's pool");
  evict_ = cfg;
  if (cfg.sparse()) pool_.enable_key_stats();
  cold_.release_all();
  cold_ = ColdTable{};
  if (cfg.offload_cold) cold_.attach(cold, &table_.pages);
  return Status::ok();
}

void SequenceRunner::advance(int64_t len) {
  table_.n_tokens += len;
  if (!cold_.attached()) return;
  cold_.next_step();
  cold_.offload(evict_, table_.n_tokens);
}

int64_t SequenceRunner::run_len(int64_t want) const {
  int64_t len = std::min<int64_t>(chunk(), want);
  if (cold_.attached() && table_.n_tokens + len > evict_.budget)
    len = std::min<int64_t>(len, std::max<int64_t>(kAttnQTile, evict_.budget - table_.n_tokens));
  return std::max<int64_t>(1, len);
}

// feed_end: the sequence length when the current feed() completes (SnapKV's observation
// window is its last obs_window queries).
void SequenceRunner::annotate_batch(int64_t feed_end) {
  if (!evict_.active()) return;
  const int32_t bs = pool_.layout().block_size;
  for (BatchSeq& s : batch_.seqs) {
    if (evict_.sparse()) s.quest = &evict_;
    if (cold_.attached()) s.cold = &cold_;
    if (!evict_.wants_scores()) continue;
    const int64_t n_pages = (s.pos0 + s.n_tokens + bs - 1) / bs;
    if (static_cast<int64_t>(scores_.size()) < n_pages) scores_.resize(n_pages, 0.f);
  }
  if (!evict_.wants_scores()) return;
  for (BatchSeq& s : batch_.seqs) {
    s.page_scores = scores_.data();
    s.score_from = score_from(evict_, feed_end, s.pos0, s.n_tokens);
  }
}

void SequenceRunner::maybe_evict(bool prompt_end) {
  const std::vector<int64_t> out = evict_if_due(evict_, pool_, table_.pages, table_.n_tokens, prompt_end, scores_);
  evicted_tokens_ += int64_t(out.size()) * pool_.layout().block_size;
}

Status SequenceRunner::fit_positions(int64_t len) {
  if (max_pos_ <= 0 || table_.n_tokens + len <= max_pos_) return Status::ok();
  auto too_long = [&](const std::string& why) {
    return Status::error("the sequence would pass the model's " + std::to_string(max_pos_) + " positions (max_model_len): " + why);
  };
  if (!evict_.evicts()) return too_long("going on past them needs an evicting KV policy (--kv-eviction)");
  const int32_t bs = pool_.layout().block_size;
  maybe_evict(/*prompt_end=*/true);  // the checks a feed may have skipped (a no-op when they ran)
  const ReindexPlan plan = plan_reindex(table_.pages, table_.n_tokens, bs);
  if (plan.n_after + len > max_pos_)
    return too_long("re-indexing frees only " + std::to_string(plan.dropped()) + " (the KV budget must leave room below them)");
  PagePool* const pools[2] = {&pool_, pool_g1_};
  BlockTable* const tables[2] = {&table_, &table_g1_};
  // A runner's pages are its own (refcount 1): nothing to copy, so this cannot fail.
  if (!apply_reindex(plan, pools, tables, [&](int g, int32_t page, int32_t n, int64_t d) { model_.shift_keys(*pools[g], g, page, n, d); }))
    return Status::error("re-indexing: no page for a copy");
  reindex_pages_of(plan, &scores_);
  reindexed_ += plan.dropped();
  return Status::ok();
}

int32_t SequenceRunner::chunk() const {
  // A quantized layer holds one staging slot per page a forward fills, until its attention ran.
  int32_t c = chunk_;
  const PagePool* pools[2] = {&pool_, pool_g1_};
  for (const PagePool* p : pools)
    if (p && p->layout().n_staged_layers() > 0)
      c = std::max<int32_t>(1, std::min<int32_t>(c, (p->n_staging() - 2) * p->layout().block_size));
  if (pool_g1_) {  // the sliding-window pool holds one window plus one chunk
    const int64_t bs = pool_g1_->layout().block_size;
    c = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(c, (pool_g1_->n_pages() - 2) * bs - window_g1_)));
  }
  return c;
}

Status SequenceRunner::feed(const int32_t* tokens, int64_t n, bool want_logits) {
  if (n <= 0) return Status::ok();
  // A prompt is fed whole (then compressed): only its start may re-index, not its middle.
  if (Status st = fit_positions(n); !st) return st;
  // Cold pages: pages are taken run by run, so the resident ones stay within the budget.
  if (!cold_.attached())
    if (Status st = reserve(n); !st) return st;
  logits_.resize(model_.config().n_vocab);
  for (int64_t i = 0, len; i < n; i += len) {
    len = run_len(n - i);
    if (cold_.attached())
      if (Status st = reserve(len); !st) return st;
    const bool last = i + len == n;
    batch_.clear();
    batch_.add(table_.pages.data(), table_.n_tokens, tokens + i, static_cast<int32_t>(len), last && want_logits);
    annotate_batch(table_.n_tokens - i + n);
    if (Status st = forward(logits_.data()); !st) return st;
    advance(len);
  }
  maybe_evict(/*prompt_end=*/n > 1);
  return Status::ok();
}

Status SequenceRunner::feed_all_logits(const int32_t* tokens, int64_t n, std::vector<float>* out) {
  const int64_t nv = model_.config().n_vocab;
  out->assign(n * nv, 0.f);
  // Pages run by run when cold pages keep RAM at the budget or re-indexing may move the table.
  const bool per_run = cold_.attached() || max_pos_ > 0;
  if (!per_run)
    if (Status st = reserve(n); !st) return st;
  const int32_t chunk_ = chunk();
  // One run per token so every position gets logits; runs of the same chunk share a forward.
  const int32_t bs = pool_.layout().block_size;
  for (int64_t i = 0, len; i < n; i += len) {
    len = std::min<int64_t>(chunk_, n - i);
    // with eviction, chunks end at page boundaries: what decoding a token at a time evicts
    if (evict_.evicts()) len = std::min<int64_t>(len, bs - table_.n_tokens % bs);
    if (max_pos_ > 0) {
      if (table_.n_tokens >= max_pos_)
        if (Status st = fit_positions(1); !st) return st;
      len = std::min<int64_t>(len, max_pos_ - table_.n_tokens);
    }
    if (per_run)
      if (Status st = reserve(len); !st) return st;
    batch_.clear();
    for (int32_t k = 0; k < len; ++k) batch_.add(table_.pages.data(), table_.n_tokens + k, tokens + i + k, 1, true);
    annotate_batch(table_.n_tokens + 1);  // decoding: every query since the last eviction votes
    if (Status st = forward(out->data() + i * nv); !st) return st;
    advance(len);
    maybe_evict(false);
  }
  return Status::ok();
}

}  // namespace kv
