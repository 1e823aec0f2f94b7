#include "engine/kv_snapshot.h"

#include <algorithm>

namespace kv {

const char* timeline_kind_name(TimelineEvent::Kind k) {
  switch (k) {
    case TimelineEvent::kPrefill: return "prefill";
    case TimelineEvent::kDecode: return "decode";
    case TimelineEvent::kPreempted: return "preempted";
    default: return "finished";
  }
}

const char* request_state_name(RequestView::State s) {
  switch (s) {
    case RequestView::kWaiting: return "waiting";
    case RequestView::kLoading: return "loading";
    case RequestView::kRunning: return "running";
    default: return "finished";
  }
}

// ---- pools ------------------------------------------------------------------------------

PoolView pool_view(const std::string& name, const PagePool& pool, const std::vector<const std::vector<int32_t>*>& tables,
                   const PrefixCache* cache, bool window) {
  PoolView v;
  v.name = name;
  std::vector<uint8_t> holders(pool.n_pages(), 0);  // [n_pages] block tables holding the page (saturating)
  for (const auto* t : tables)
    for (int32_t p : *t)
      if (p >= 0 && holders[p] < 255) ++holders[p];
  v.states.resize(pool.n_pages());
  for (int32_t p = 0; p < pool.n_pages(); ++p) {
    char c = kPageUnknown;
    if (pool.refcount(p) == 0) {
      c = kPageFree;
      ++v.n_free;
    } else if (holders[p] >= 2) {
      c = kPageShared;
      ++v.n_shared;
    } else if (holders[p] == 1) {
      c = kPageRunning;
      ++v.n_running;
    } else if (cache && (window ? cache->is_cached_window(p) : cache->is_cached(p))) {
      c = kPageCached;
      ++v.n_cached;
    }
    v.states[p] = c;
  }
  return v;
}

std::string encode_runs(const std::string& states) {
  std::string out;
  for (size_t i = 0; i < states.size();) {
    size_t j = i + 1;
    while (j < states.size() && states[j] == states[i]) ++j;
    out += states[i];
    if (j - i > 1) out += std::to_string(j - i);
    i = j;
  }
  return out;
}

// ---- RequestTimelines ---------------------------------------------------------------------

Timeline& RequestTimelines::entry(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival) {
  auto [it, fresh] = active_.try_emplace(id);
  if (fresh) {
    it->second.id = id;
    it->second.ns = ns;
    it->second.arrival = since_epoch(arrival);
  }
  return it->second;
}

void RequestTimelines::add(Timeline& t, const TimelineEvent& ev) {
  if (t.events.size() >= kMaxEvents) {
    t.events.erase(t.events.begin());
    t.truncated = true;
  }
  t.events.push_back(ev);
}

void RequestTimelines::ran(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival, double t0, int32_t n,
                           bool prefill, bool logits) {
  Timeline& t = entry(id, ns, arrival);
  step_runs_.push_back({id, logits});
  if (!prefill) {
    // A run of decode steps is one event (n counts steps); n > 1 choices add to the same one.
    if (!t.events.empty() && t.events.back().kind == TimelineEvent::kDecode) {
      t.events.back().n += 1;
      return;
    }
    add(t, {TimelineEvent::kDecode, t0, t0, 1});
    return;
  }
  if (!t.events.empty() && t.events.back().kind == TimelineEvent::kPrefill && t.events.back().t0 == t0) {
    t.events.back().n += n;  // another choice's chunk in the same step
    return;
  }
  add(t, {TimelineEvent::kPrefill, t0, t0, n});
}

void RequestTimelines::end_step(double t1) {
  for (const Pending& p : step_runs_) {
    auto it = active_.find(p.id);
    if (it == active_.end()) continue;  // finished in this step (finished() closed its runs)
    Timeline& t = it->second;
    if (!t.events.empty()) t.events.back().t1 = std::max(t.events.back().t1, t1);
    if (p.logits && t.first_token < 0) t.first_token = t1;
  }
  step_runs_.clear();
}

void RequestTimelines::preempted(uint64_t id, double t) {
  auto it = active_.find(id);
  if (it == active_.end()) return;
  add(it->second, {TimelineEvent::kPreempted, t, t, 0});
  ++it->second.n_preemptions;
}

void RequestTimelines::finished(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival, double t,
                                const char* reason, int32_t n_prompt, int32_t n_generated, int32_t cached_tokens, int32_t max_tokens,
                                int32_t n_choices) {
  Timeline tl;
  if (auto it = active_.find(id); it != active_.end()) {
    tl = std::move(it->second);
    active_.erase(it);
  } else {  // never ran (cancelled while waiting)
    tl.id = id;
    tl.ns = ns;
    tl.arrival = since_epoch(arrival);
  }
  // Finished inside a step (postprocess): that step's run ends now, and may have drawn the first token.
  if (!tl.events.empty()) tl.events.back().t1 = std::max(tl.events.back().t1, t);
  for (const Pending& p : step_runs_)
    if (p.id == id && p.logits && tl.first_token < 0) tl.first_token = t;
  if (tl.events.size() >= kMaxEvents) {
    tl.events.erase(tl.events.begin());
    tl.truncated = true;
  }
  tl.events.push_back({TimelineEvent::kFinished, t, t, 0});
  tl.finished = t;
  tl.finish_reason = reason;
  tl.n_prompt = n_prompt;
  tl.n_generated = n_generated;
  tl.max_tokens = max_tokens;
  tl.n_choices = n_choices;
  tl.cached_tokens = cached_tokens;
  finished_.push_back(std::move(tl));
  if (finished_.size() > kMaxFinished) finished_.pop_front();
}

const Timeline* RequestTimelines::find(uint64_t id) const {
  auto it = active_.find(id);
  return it == active_.end() ? nullptr : &it->second;
}

// ---- RateWindow ---------------------------------------------------------------------------

void RateWindow::add(double t, const MetricsSnapshot& m) {
  RatePoint p;
  p.t = t;
  const double total = static_cast<double>(std::max<int64_t>(m.kv_pages_total, 1));
  p.kv_used = static_cast<double>(m.kv_pages_used) / total;
  p.kv_cached = static_cast<double>(m.prefix_cache_cached_pages) / total;
  p.running = m.num_requests_running;
  p.waiting = m.num_requests_waiting;
  if (have_prev_ && t > prev_t_) {
    const double dt = t - prev_t_;
    p.gen_tok_s = static_cast<double>(m.generation_tokens_total - prev_.generation_tokens_total) / dt;
    p.prompt_tok_s = static_cast<double>(m.prompt_tokens_total - prev_.prompt_tokens_total) / dt;
    const int64_t q = m.prefix_cache_queries_total - prev_.prefix_cache_queries_total;
    if (q > 0) p.hit_rate = static_cast<double>(m.prefix_cache_hits_total - prev_.prefix_cache_hits_total) / static_cast<double>(q);
    p.preemptions = m.num_preemptions_total - prev_.num_preemptions_total;
    auto mean = [](const Histogram& now, const Histogram& before) {
      const uint64_t n = now.count() - before.count();
      return n > 0 ? (now.sum() - before.sum()) / static_cast<double>(n) : -1.0;
    };
    p.ttft_s = mean(m.ttft, prev_.ttft);
    p.itl_s = mean(m.itl, prev_.itl);
  }
  have_prev_ = true;
  prev_t_ = t;
  prev_ = m;
  points_.push_back(p);
  if (points_.size() > kMaxPoints) points_.pop_front();
}

// ---- SnapshotFeed -------------------------------------------------------------------------

std::shared_ptr<const KvSnapshot> SnapshotFeed::wait_newer(uint64_t after, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait_for(l, timeout, [&] { return latest_ && latest_->seq > after; });
  return latest_;
}

void SnapshotFeed::publish(std::shared_ptr<KvSnapshot> s) {
  last_t_ = s->t;
  {
    std::lock_guard<std::mutex> l(mu_);
    s->seq = ++seq_;
    latest_ = std::move(s);
  }
  cv_.notify_all();
}

// ---- DashboardRecorder --------------------------------------------------------------------

bool DashboardRecorder::end_step(const Metrics& metrics) {
  const double t = since_epoch(std::chrono::steady_clock::now());
  timelines_.end_step(t);
  if (t - last_rate_t_ >= SnapshotFeed::kDefaultInterval) {
    rates_.add(t, metrics.snapshot());
    last_rate_t_ = t;
  }
  return feed_.due(t);
}

void DashboardRecorder::publish(std::vector<Live> live, const PagePool& pool, const PagePool* pool_g1, const PrefixCache* cache,
                                std::vector<std::pair<std::string, int64_t>> tier_pages, std::chrono::steady_clock::time_point started) {
  auto snap = std::make_shared<KvSnapshot>();
  snap->t = since_epoch(started);
  snap->block_size = pool.layout().block_size;
  std::vector<const std::vector<int32_t>*> tables, tables_g1;
  for (Live& l : live) {
    tables.push_back(l.table);
    if (l.table_g1) tables_g1.push_back(l.table_g1);
    RequestView& v = l.view;
    v.n_pages = static_cast<int32_t>(std::count_if(l.table->begin(), l.table->end(), [](int32_t p) { return p >= 0; }));
    if (v.index == 0)
      if (const Timeline* t = timelines_.find(v.id)) v.timeline = *t;
    if (v.timeline.id == 0) {  // not run yet: the queued part only
      v.timeline.id = v.id;
      v.timeline.ns = v.ns;
      v.timeline.arrival = v.arrival;
    }
    snap->requests.push_back(std::move(v));
  }
  for (const Timeline& f : timelines_.recent_finished()) {
    RequestView& v = snap->requests.emplace_back();  // built in place (a local moved in warned -Wmaybe-uninitialized)
    v.id = f.id;
    v.ns = f.ns;
    v.state = RequestView::kFinished;
    v.n_prompt = f.n_prompt;
    v.n_generated = f.n_generated;
    v.max_tokens = f.max_tokens;
    v.n_choices = f.n_choices;
    v.cached_tokens = f.cached_tokens;
    v.arrival = f.arrival;
    v.timeline = f;
  }
  snap->pools.push_back(pool_view("global", pool, tables, cache, false));
  if (pool_g1) snap->pools.push_back(pool_view("window", *pool_g1, tables_g1, cache, true));
  if (cache) snap->tree = cache->view(kTreeNodes, kSnippetTokens);
  snap->rates.assign(rates_.points().begin(), rates_.points().end());
  snap->tier_pages = std::move(tier_pages);
  snap->build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  feed_.publish(std::move(snap));
}

}  // namespace kv
