// The KV dashboard's engine side without a model: page states, their run-length form, request
// timelines (bounds, decode spans, preemptions, finish) and rates from metrics deltas.
#include <gtest/gtest.h>

#include "engine/kv_snapshot.h"

using namespace kv;

namespace {
KvLayout tiny_layout() {
  KvLayout l;
  l.n_layer = 1;
  l.n_head_kv = 1;
  l.head_dim = 2;
  l.block_size = 4;
  l.dtype = KvDtype::kF16;
  return l;
}
}  // namespace

TEST(KvSnapshot, PageStatesCountHoldersNotReferences) {
  PagePool pool(tiny_layout(), 10);
  uint64_t t = 0;
  PrefixCache cache(pool, 1, 1, [&] { return ++t; });
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.allocate(3, &a));  // pages 0..2 (some ids) for sequence a
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  cache.insert("", tokens.data(), 8, a.data());  // a's two full pages are also cached: still a's alone
  b = {a[0], a[1]};  // b shares a's prefix (its own references)
  pool.retain(a[0]);
  pool.retain(a[1]);
  std::vector<int32_t> lone;
  ASSERT_TRUE(pool.allocate(1, &lone));
  const std::vector<int32_t> other = {50, 51, 52, 53};
  cache.insert("x", other.data(), 4, lone.data());
  pool.release(lone[0]);  // the cache alone holds it now

  PoolView v = pool_view("global", pool, {&a, &b}, &cache, false);
  EXPECT_EQ(v.states[a[0]], kPageShared);
  EXPECT_EQ(v.states[a[1]], kPageShared);
  EXPECT_EQ(v.states[a[2]], kPageRunning);
  EXPECT_EQ(v.states[lone[0]], kPageCached);
  EXPECT_EQ(v.n_shared, 2);
  EXPECT_EQ(v.n_running, 1);
  EXPECT_EQ(v.n_cached, 1);
  EXPECT_EQ(v.n_free, 6);
  EXPECT_EQ(v.states.size(), 10u);
  EXPECT_EQ(std::count(v.states.begin(), v.states.end(), kPageUnknown), 0);

  // The same pages after both sequences let go: cached (the prefix) or free (the tail).
  for (int32_t p : b) pool.release(p);
  for (int32_t p : a) pool.release(p);
  PoolView after = pool_view("global", pool, {}, &cache, false);
  EXPECT_EQ(after.n_cached, 3);
  EXPECT_EQ(after.n_free, 7);
  EXPECT_EQ(after.n_running + after.n_shared, 0);
}

TEST(KvSnapshot, RunLengthForm) {
  EXPECT_EQ(encode_runs(""), "");
  EXPECT_EQ(encode_runs("."), ".");
  EXPECT_EQ(encode_runs("cccc....rs"), "c4.4rs");
  EXPECT_EQ(encode_runs(std::string(1000, '.') + "r"), ".1000r");
}

TEST(KvSnapshot, TimelinesMergeDecodeStepsAndStayBounded) {
  const auto epoch = std::chrono::steady_clock::now();
  RequestTimelines tl(epoch);
  const auto arrival = epoch + std::chrono::milliseconds(100);
  tl.ran(7, "ns", arrival, 0.5, 64, true, false);  // first prompt chunk
  tl.end_step(0.6);
  tl.ran(7, "ns", arrival, 0.6, 20, true, true);   // last chunk: the first token
  tl.end_step(0.7);
  for (int i = 0; i < 5; ++i) {
    tl.ran(7, "ns", arrival, 0.7 + 0.1 * i, 1, false, true);
    tl.end_step(0.8 + 0.1 * i);
  }
  tl.preempted(7, 1.25);
  tl.ran(7, "ns", arrival, 1.5, 89, true, true);  // recomputed
  tl.end_step(1.6);
  const Timeline* t = tl.find(7);
  ASSERT_TRUE(t);
  EXPECT_NEAR(t->arrival, 0.1, 1e-6);
  EXPECT_NEAR(t->first_token, 0.7, 1e-9);
  ASSERT_EQ(t->events.size(), 5u);
  EXPECT_EQ(t->events[0].kind, TimelineEvent::kPrefill);
  EXPECT_EQ(t->events[0].n, 64);
  EXPECT_NEAR(t->events[0].t1, 0.6, 1e-9);
  EXPECT_EQ(t->events[2].kind, TimelineEvent::kDecode);  // five steps, one event
  EXPECT_EQ(t->events[2].n, 5);
  EXPECT_NEAR(t->events[2].t0, 0.7, 1e-9);
  EXPECT_NEAR(t->events[2].t1, 1.2, 1e-9);
  EXPECT_EQ(t->events[3].kind, TimelineEvent::kPreempted);
  EXPECT_EQ(t->n_preemptions, 1);

  // Finishing inside a step closes its run and moves it to the finished list.
  tl.ran(7, "ns", arrival, 1.6, 1, false, true);
  tl.finished(7, "ns", arrival, 1.65, "stop", 89, 7, 32, 3 * 16, 3);
  tl.end_step(1.7);
  EXPECT_EQ(tl.find(7), nullptr);
  ASSERT_EQ(tl.recent_finished().size(), 1u);
  const Timeline& f = tl.recent_finished().back();
  EXPECT_EQ(f.events.back().kind, TimelineEvent::kFinished);
  EXPECT_NEAR(f.events[f.events.size() - 2].t1, 1.65, 1e-9);
  EXPECT_EQ(f.finish_reason, "stop");
  EXPECT_EQ(f.cached_tokens, 32);
  EXPECT_EQ(f.max_tokens, 48);  // the request's, over its 3 choices (the dashboard showed 0)
  EXPECT_EQ(f.n_choices, 3);

  // A request cancelled while waiting still shows up; only the last kMaxFinished are kept.
  for (uint64_t id = 100; id < 100 + RequestTimelines::kMaxFinished + 3; ++id) tl.finished(id, "", arrival, 2.0, "abort", 5, 0, 0, 16, 1);
  EXPECT_EQ(tl.recent_finished().size(), RequestTimelines::kMaxFinished);
  EXPECT_EQ(tl.recent_finished().back().events.size(), 1u);
  EXPECT_EQ(tl.n_active(), 0u);

  // Alternating prefill chunks and preemptions never keep more than kMaxEvents events.
  for (int i = 0; i < 200; ++i) {
    tl.ran(9, "", arrival, 3.0 + i, 16, true, false);
    tl.end_step(3.5 + i);
    tl.preempted(9, 3.6 + i);
  }
  EXPECT_EQ(tl.find(9)->events.size(), RequestTimelines::kMaxEvents);
  EXPECT_TRUE(tl.find(9)->truncated);
}

TEST(KvSnapshot, RatesAreDeltasOverTheInterval) {
  RateWindow w;
  MetricsSnapshot m;
  m.kv_pages_total = 100;
  m.ttft = Histogram({1.0}, {0, 0}, 0, 0);
  m.itl = Histogram({1.0}, {0, 0}, 0, 0);
  w.add(1.0, m);
  EXPECT_EQ(w.points().back().hit_rate, -1);  // nothing to compare with yet
  m.generation_tokens_total = 50;
  m.prompt_tokens_total = 200;
  m.kv_pages_used = 25;
  m.prefix_cache_cached_pages = 10;
  m.prefix_cache_queries_total = 100;
  m.prefix_cache_hits_total = 40;
  m.num_preemptions_total = 3;
  m.ttft = Histogram({1.0}, {2, 0}, 0.5, 2);
  w.add(1.5, m);
  const RatePoint& p = w.points().back();
  EXPECT_DOUBLE_EQ(p.gen_tok_s, 100);
  EXPECT_DOUBLE_EQ(p.prompt_tok_s, 400);
  EXPECT_DOUBLE_EQ(p.kv_used, 0.25);
  EXPECT_DOUBLE_EQ(p.kv_cached, 0.1);
  EXPECT_DOUBLE_EQ(p.hit_rate, 0.4);
  EXPECT_EQ(p.preemptions, 3);
  EXPECT_DOUBLE_EQ(p.ttft_s, 0.25);
  EXPECT_EQ(p.itl_s, -1);  // no token gap in the interval
  for (int i = 0; i < 500; ++i) w.add(2.0 + i, m);
  EXPECT_EQ(w.points().size(), RateWindow::kMaxPoints);
}

TEST(KvSnapshot, FeedPublishesOnlyWhileWatchedAndAtMostPerInterval) {
  SnapshotFeed feed;
  EXPECT_FALSE(feed.due(10.0));  // nobody watches
  feed.subscribe();
  EXPECT_TRUE(feed.due(10.0));
  auto s = std::make_shared<KvSnapshot>();
  s->t = 10.0;
  feed.publish(s);
  EXPECT_FALSE(feed.due(10.1));
  EXPECT_TRUE(feed.due(10.0 + SnapshotFeed::kDefaultInterval));
  auto got = feed.wait_newer(0, std::chrono::milliseconds(0));
  ASSERT_TRUE(got);
  EXPECT_EQ(got->seq, 1u);
  EXPECT_EQ(feed.wait_newer(1, std::chrono::milliseconds(1))->seq, 1u);  // timed out: the same one
  feed.unsubscribe();
  EXPECT_FALSE(feed.due(100.0));
}
