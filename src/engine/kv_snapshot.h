// What the KV dashboard (/dashboard, web/dashboard.html) shows of the engine: the page pools
// by page state, the prefix cache's trees (bounded), the requests with their timelines, and a
// rolling window of rates. Plain data; the server turns it into JSON per viewer.
//
// Who builds it. The engine thread, at the end of a step (DashboardRecorder::end_step, then
// Engine::publish_dashboard when one is due):
//   - RequestTimelines and RateWindow are updated on every step (a hash lookup per run, and one
//     metrics copy per interval), so a dashboard that connects sees history;
//   - the snapshot proper (pools, trees, requests) is built only while SnapshotFeed has
//     subscribers, at most once per interval (250 ms) and per step (nothing changes inside a
//     step): O(pages + block-table entries + tree nodes), measured in KvSnapshot::build_s
//     (5,825 pages, 64 requests, ~1,000 tree nodes: 0.3-0.5 ms median, bench/dashboard_overhead.py).
//     Readers never take the engine's lock: they get the last published snapshot from the feed
//     (a shared_ptr swapped under the feed's mutex).
//
// Page states, per pool (one char per page, PageState):
//   '.' free            refcount 0
//   'r' running         held by one sequence's block table (the prefix cache may hold it too)
//   's' shared          held by two or more block tables (a shared prefix, n > 1 forks)
//   'c' cached          held by the prefix cache alone (reclaimable)
//   't' lower tier      reserved: pages of live sequences moved below RAM (not built yet)
//   '?'                 referenced by none of the above (never, between steps)
// "Shared" counts block tables, not the refcount: a running sequence's published pages have
// refcount 2 (its table and the cache), and showing them all as shared would hide what is.
//
// Threading: RequestTimelines, RateWindow and pool_view() belong to the engine thread;
// SnapshotFeed is thread-safe.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/metrics.h"
#include "kv/page_pool.h"
#include "kv/prefix_cache.h"

namespace kv {

enum PageState : char {
  kPageFree = '.',
  kPageRunning = 'r',
  kPageShared = 's',
  kPageCached = 'c',
  kPageTier = 't',
  kPageUnknown = '?',
};

struct PoolView {
  std::string name;    // "global", or "window" (the sliding-window layers of a hybrid model)
  std::string states;  // [n_pages] one PageState per page
  int32_t n_free = 0, n_running = 0, n_shared = 0, n_cached = 0;
};

// States of every page of pool. tables: the block tables of every sequence (entries -1: freed).
// cache: the prefix cache (null: none); window: pool is its sliding-window group's.
PoolView pool_view(const std::string& name, const PagePool& pool, const std::vector<const std::vector<int32_t>*>& tables,
                   const PrefixCache* cache, bool window);
// Run-length form of a states string: each state char, followed by its count when the run is
// longer than one ("c12.300r3s"). What the dashboard's SSE payload carries.
std::string encode_runs(const std::string& states);

// One thing that happened to a request, in seconds since the engine started. Instant events
// have t0 == t1.
struct TimelineEvent {
  enum Kind : uint8_t { kPrefill, kDecode, kPreempted, kFinished } kind = kPrefill;
  double t0 = 0, t1 = 0;
  int32_t n = 0;  // kPrefill: prompt tokens of the chunk; kDecode: decode steps over the span (a
                  // speculative step may draw several tokens)
};
const char* timeline_kind_name(TimelineEvent::Kind k);

struct Timeline {
  uint64_t id = 0;
  std::string ns;
  double arrival = 0;      // queued from here until the first run
  double first_token = -1;
  double finished = -1;
  std::string finish_reason;
  int32_t n_preemptions = 0;
  int32_t n_prompt = 0, n_generated = 0, cached_tokens = 0;  // set when it finishes (generated: all choices)
  int32_t max_tokens = 0, n_choices = 1;                      // ... max_tokens: all choices'
  bool truncated = false;  // older events were dropped (at most kMaxEvents are kept)
  std::vector<TimelineEvent> events;
};

// Per-request timelines, bounded: running requests' events (at most kMaxEvents each; a run of
// decode steps is one event), and the last kMaxFinished finished requests. Engine thread only.
class RequestTimelines {
 public:
  static constexpr size_t kMaxEvents = 48;
  static constexpr size_t kMaxFinished = 16;

  explicit RequestTimelines(std::chrono::steady_clock::time_point epoch) : epoch_(epoch) {}
  double since_epoch(std::chrono::steady_clock::time_point t) const { return std::chrono::duration<double>(t - epoch_).count(); }

  // A step starting at t0 runs n tokens of request id (prefill: prompt tokens; else a decode
  // step); logits: it draws a token. end_step(t1) closes the step's runs.
  void ran(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival, double t0, int32_t n, bool prefill,
           bool logits);
  void end_step(double t1);
  void preempted(uint64_t id, double t);
  // The request's last choice ended: moves it to the finished list.
  void finished(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival, double t, const char* reason,
                int32_t n_prompt, int32_t n_generated, int32_t cached_tokens, int32_t max_tokens, int32_t n_choices);

  const Timeline* find(uint64_t id) const;  // a request that ran and has not finished, or null
  const std::deque<Timeline>& recent_finished() const { return finished_; }
  size_t n_active() const { return active_.size(); }

 private:
  Timeline& entry(uint64_t id, const std::string& ns, std::chrono::steady_clock::time_point arrival);
  void add(Timeline& t, const TimelineEvent& ev);

  std::chrono::steady_clock::time_point epoch_;
  std::unordered_map<uint64_t, Timeline> active_;
  std::deque<Timeline> finished_;  // oldest first
  struct Pending {
    uint64_t id;
    bool logits;
  };
  std::vector<Pending> step_runs_;  // this step's runs, closed by end_step
};

// One point of the dashboard's charts: rates over the interval since the previous point.
struct RatePoint {
  double t = 0;               // seconds since the engine started
  double gen_tok_s = 0;       // generated tokens per second
  double prompt_tok_s = 0;    // prompt tokens computed per second
  double kv_used = 0;         // fraction of the global pool held by requests
  double kv_cached = 0;       // fraction held by the prefix cache (possibly also by requests)
  double hit_rate = -1;       // prompt tokens found cached / looked up, over the interval (-1: no lookup)
  int64_t preemptions = 0;    // over the interval
  double ttft_s = -1;         // mean time to first token of the interval's first tokens (-1: none)
  double itl_s = -1;          // mean inter-token latency over the interval (-1: none)
  int64_t running = 0, waiting = 0;
};

// The charts' rolling window (kMaxPoints points), from successive metrics snapshots.
class RateWindow {
 public:
  static constexpr size_t kMaxPoints = 240;  // one minute at 4 Hz
  void add(double t, const MetricsSnapshot& m);
  const std::deque<RatePoint>& points() const { return points_; }

 private:
  std::deque<RatePoint> points_;
  bool have_prev_ = false;
  double prev_t_ = 0;
  MetricsSnapshot prev_;
};

struct RequestView {
  uint64_t id = 0;
  int32_t index = 0;  // choice
  int32_t n_choices = 1;  // the request's n (a finished row is the whole request: its counts sum the choices)
  std::string ns;
  enum State : uint8_t { kWaiting, kLoading, kRunning, kFinished } state = kWaiting;
  int32_t n_prompt = 0, n_generated = 0, max_tokens = 0;
  int64_t n_computed = 0;
  int32_t n_pages = 0;        // pages its global block table holds
  int32_t cached_tokens = -1; // prompt tokens from the prefix cache (-1: not admitted yet)
  double arrival = 0;         // seconds since the engine started
  Timeline timeline;          // events only on choice 0 (the request's)
};
const char* request_state_name(RequestView::State s);

struct KvSnapshot {
  uint64_t seq = 0;     // 1, 2, ... per published snapshot
  double t = 0;         // seconds since the engine started
  double build_s = 0;   // engine-thread time spent building it
  int32_t block_size = 0;
  std::vector<PoolView> pools;          // global first
  std::vector<RequestView> requests;    // running (admission order), waiting, recently finished
  PrefixTreeView tree;                  // empty without prefix caching
  double tree_clock_per_s = 1e9;        // tree clock units per second (ages)
  std::vector<RatePoint> rates;         // the rolling window, oldest first
  std::vector<std::pair<std::string, int64_t>> tier_pages;  // pages stored per lower tier
};

// Snapshots from the engine thread to HTTP threads. Thread-safe.
class SnapshotFeed {
 public:
  static constexpr double kDefaultInterval = 0.25;  // seconds between snapshots (4 Hz)

  void subscribe() { subscribers_.fetch_add(1); }
  void unsubscribe() { subscribers_.fetch_sub(1); }
  int32_t subscribers() const { return subscribers_.load(); }
  // Waits up to timeout for a snapshot with seq > after; returns the latest (null before the
  // first, or one with seq <= after on timeout).
  std::shared_ptr<const KvSnapshot> wait_newer(uint64_t after, std::chrono::milliseconds timeout) const;

  // Engine thread: whether a snapshot is due at t (seconds since the engine started), and
  // publishing one (its seq is set here).
  bool due(double t) const { return subscribers_.load() > 0 && t - last_t_ >= interval_; }
  void publish(std::shared_ptr<KvSnapshot> s);
  void set_interval(double seconds) { interval_ = seconds; }  // tests: 0 = every step

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::shared_ptr<const KvSnapshot> latest_;
  uint64_t seq_ = 0;
  std::atomic<int32_t> subscribers_{0};
  double last_t_ = -1e9;  // engine thread only
  double interval_ = kDefaultInterval;
};

// What the engine keeps for the dashboard: timelines, rates and the feed. Engine thread, but
// for feed() (thread-safe).
class DashboardRecorder {
 public:
  static constexpr int32_t kTreeNodes = 64;       // tree nodes per snapshot (most recent first)
  static constexpr int32_t kSnippetTokens = 12;   // tokens of each edge shown as text

  DashboardRecorder() : epoch_(std::chrono::steady_clock::now()), timelines_(epoch_) {}
  double since_epoch(std::chrono::steady_clock::time_point t) const { return timelines_.since_epoch(t); }
  RequestTimelines& timelines() { return timelines_; }
  SnapshotFeed& feed() { return feed_; }

  // End of a step: closes its runs, adds a rate point when one is due (metrics read then).
  // True when a snapshot is due (someone watches and the interval has passed).
  bool end_step(const Metrics& metrics);

  // One sequence as the engine has it: its view (state, sizes) and block tables.
  struct Live {
    RequestView view;
    const std::vector<int32_t>* table;     // global pool
    const std::vector<int32_t>* table_g1;  // sliding-window pool (hybrid models)
  };
  // Builds and publishes a snapshot: these sequences (running, then waiting), the pools' states,
  // the tree, the recent finished requests and the rates. started: when the engine began
  // collecting (build_s counts from there).
  void publish(std::vector<Live> live, const PagePool& pool, const PagePool* pool_g1, const PrefixCache* cache,
               std::vector<std::pair<std::string, int64_t>> tier_pages, std::chrono::steady_clock::time_point started);

 private:
  std::chrono::steady_clock::time_point epoch_;
  RequestTimelines timelines_;
  RateWindow rates_;
  double last_rate_t_ = -1e9;
  SnapshotFeed feed_;
};

}  // namespace kv
