// Long-context KV policies (kv/kv_eviction.h): the pure page choice, Quest's selection, and
// the policies running on the real model through SequenceRunner and the Engine (pages given
// back, integrity, prefix cache, usage).
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "engine/engine.h"
#include "engine/sequence_runner.h"
#include "kernels/quant.h"
#include "kv/kv_eviction.h"
#include "gguf/gguf.h"
#include "model_fixture.h"
#include "tokenizer/tokenizer.h"

using namespace kv;

namespace {
EvictionConfig cfg_of(EvictionPolicy p, int64_t budget, int32_t sinks = 4, int32_t recent = -1) {
  EvictionConfig c;
  c.policy = p;
  c.budget = budget;
  c.sink_tokens = sinks;
  c.recent_tokens = recent;
  return c;
}
std::vector<int32_t> table_of(int n_pages) {
  std::vector<int32_t> t(n_pages);
  std::iota(t.begin(), t.end(), 100);
  return t;
}
}  // namespace

TEST(KvEviction, ValidateNeedsRoomBeyondSinksAndRecent) {
  EXPECT_FALSE(cfg_of(EvictionPolicy::kSinks, 0).validate(16).is_ok());  // no budget
  EXPECT_FALSE(cfg_of(EvictionPolicy::kSinks, 16).validate(16).is_ok());  // sink page + filling page > 16
  EXPECT_TRUE(cfg_of(EvictionPolicy::kSinks, 32).validate(16).is_ok());
  EXPECT_FALSE(cfg_of(EvictionPolicy::kH2O, 64, 4, 64).validate(16).is_ok());  // recent fills the budget
  EXPECT_TRUE(cfg_of(EvictionPolicy::kNone, 0).validate(16).is_ok());
  EXPECT_FALSE(parse_eviction_policy("lru").is_ok());
  EXPECT_EQ(*parse_eviction_policy("snapkv"), EvictionPolicy::kSnapKV);
}

TEST(KvEviction, SinksKeepStartAndRecentEvictOldestFirst) {
  const int bs = 16;
  EvictionConfig c = cfg_of(EvictionPolicy::kSinks, 128);  // 8 pages: 1 sink + 6 recent + filling
  auto t = table_of(10);
  // 160 tokens: pages 0..9 full; counting the next page, 11 pages kept → evict 3 (pages 1, 2, 3)
  auto out = choose_evictions(c, bs, t, 160, {});
  EXPECT_EQ(out, (std::vector<int64_t>{1, 2, 3}));
  for (int64_t i : out) t[i] = -1;
  EXPECT_TRUE(choose_evictions(c, bs, t, 160, {}).empty());  // at budget now
  EXPECT_LE(kept_tokens(t, 160, bs) + bs, c.budget);
  // window: no sinks, page 0 goes first
  EvictionConfig w = cfg_of(EvictionPolicy::kWindow, 128);
  EXPECT_EQ(choose_evictions(w, bs, table_of(10), 160, {}).front(), 0);
}

TEST(KvEviction, ScoredPoliciesEvictTheLowestScoresOutsideSinksAndRecent) {
  const int bs = 16;
  EvictionConfig c = cfg_of(EvictionPolicy::kH2O, 128, 4, 32);  // sink page, 2 recent pages
  auto t = table_of(12);  // 192 tokens, tail filling page 12 counts too: 13 pages, budget 8 → evict 5
  std::vector<float> sc = {9, 1, 5, 0.5f, 7, 2, 8, 3, 4, 6, 0, 0};  // pages 10, 11: recent (score 0 kept)
  t[4] = -1;  // already evicted: not a candidate, not counted
  auto out = choose_evictions(c, bs, t, 192, sc);
  // candidates 1..9 except 4; lowest: 3 (0.5), 1 (1), 5 (2), 7 (3) → 4 pages suffice (one is gone)
  EXPECT_EQ(out, (std::vector<int64_t>{1, 3, 5, 7}));
  // ties go to the older page
  std::vector<float> flat(12, 1.f);
  EXPECT_EQ(choose_evictions(c, bs, table_of(12), 192, flat).front(), 1);
}

TEST(KvEviction, QuestKeepsSinkRecentAndTheHighestBounds) {
  EvictionConfig c;
  c.sparse_pages = 2;
  c.sink_tokens = 4;
  c.recent_tokens = 16;
  auto t = table_of(10);
  std::vector<float> bound = {0, 5, 1, 9, 2, 8, 0, 3, 0, 0};
  std::vector<int32_t> out, scratch;
  quest_select(c, 16, t.data(), 159, bound.data(), &out, &scratch);  // pos 159: page 9 is its own
  ASSERT_EQ(out.size(), 10u);
  for (int i = 0; i < 10; ++i) {
    const bool want = i == 0 || i == 9 || i == 3 || i == 5;  // sink page, recent (the last 16 tokens: page 9), top 2
    EXPECT_EQ(out[i] >= 0, want) << "page " << i;
  }
}

// The model under each policy: a budget ≥ the context changes nothing; a small budget keeps
// kept tokens within it at every page boundary, hands pages back and passes integrity.
TEST(KvEviction, SequenceRunnerHoldsTheBudgetAndGivesPagesBack) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  KvLayout l = m->kv_layout(16, KvDtype::kF16);
  PagePool pool(l, 64);
  ThreadPool tp(2);
  std::vector<int32_t> toks(300);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>(1000 + (i * 7919) % 20000);
  SequenceRunner base(*m, pool, tp);
  std::vector<float> ref;
  ASSERT_TRUE(base.feed(toks.data(), 200).is_ok());
  ASSERT_TRUE(base.feed_all_logits(toks.data() + 200, 100, &ref).is_ok());
  base.reset();
  for (EvictionPolicy p : {EvictionPolicy::kWindow, EvictionPolicy::kSinks, EvictionPolicy::kH2O, EvictionPolicy::kSnapKV}) {
    for (int64_t budget : {int64_t(512), int64_t(96)}) {
      SequenceRunner seq(*m, pool, tp);
      ASSERT_TRUE(seq.set_eviction(cfg_of(p, budget)).is_ok());
      std::vector<float> out;
      ASSERT_TRUE(seq.feed(toks.data(), 200).is_ok());
      EXPECT_LE(seq.kept_tokens(), budget);
      for (int i = 0; i < 100; ++i) {
        std::vector<float> one;
        ASSERT_TRUE(seq.feed_all_logits(toks.data() + 200 + i, 1, &one).is_ok());
        out.insert(out.end(), one.begin(), one.end());
        EXPECT_LE(seq.kept_tokens(), budget) << eviction_policy_name(p);
        EXPECT_LE(pool.n_used(), budget / 16) << eviction_policy_name(p);
      }
      float diff = 0;
      for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::abs(out[i] - ref[i]));
      if (budget >= 300) {
        EXPECT_EQ(seq.evicted_tokens(), 0);
        EXPECT_EQ(diff, 0.f) << eviction_policy_name(p);  // nothing evicted: bit-identical
      } else {
        EXPECT_GT(seq.evicted_tokens(), 150) << eviction_policy_name(p);
        EXPECT_GT(diff, 1e-2f) << eviction_policy_name(p);  // the model saw less
      }
      seq.reset();
      EXPECT_EQ(pool.n_used(), 0);
      EXPECT_TRUE(pool.check_integrity().is_ok());
    }
  }
}

// Quest reading every page equals full attention; reading few pages stays close (sparse reads
// never change what is stored).
TEST(KvEviction, QuestReadingAllPagesEqualsFullAttention) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  KvLayout l = m->kv_layout(16, KvDtype::kF16);
  PagePool pool(l, 64);
  ThreadPool tp(2);
  std::vector<int32_t> toks(400);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>(1000 + (i * 7919) % 20000);
  auto run = [&](int sparse_pages) {
    SequenceRunner seq(*m, pool, tp);
    EvictionConfig c;
    c.sparse_pages = sparse_pages;
    EXPECT_TRUE(seq.set_eviction(c).is_ok());
    std::vector<float> out;
    EXPECT_TRUE(seq.feed(toks.data(), 360).is_ok());
    EXPECT_TRUE(seq.feed_all_logits(toks.data() + 360, 40, &out).is_ok());
    seq.reset();
    return out;
  };
  const std::vector<float> full = run(0), all = run(64), few = run(4);
  float d_all = 0, d_few = 0;
  for (size_t i = 0; i < full.size(); ++i) {
    d_all = std::max(d_all, std::abs(all[i] - full[i]));
    d_few = std::max(d_few, std::abs(few[i] - full[i]));
  }
  EXPECT_EQ(d_all, 0.f);
  EXPECT_GT(d_few, 0.f);
  EXPECT_EQ(pool.n_used(), 0);
}

// The engine with a default policy and per-request overrides: integrity after every step,
// pages back to zero, usage counts, forks (n = 2) sharing an evicted table, and the prefix
// cache never holding pages computed after an eviction.
TEST(KvEviction, EngineEvictsAndAccountsForEveryPage) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  EngineConfig c;
  c.max_num_batched_tokens = 64;
  c.max_num_seqs = 8;
  c.max_model_len = 512;
  c.block_size = 16;
  c.kv_cache_bytes = int64_t(96) * 16 * 23040;
  c.n_threads = 2;
  c.kv_policy = cfg_of(EvictionPolicy::kH2O, 64);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  Engine e(*m, **tok, c);
  std::vector<int32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1000 + (i * 7919) % 20000);
  auto submit = [&](int n, bool override_policy, EvictionPolicy p) {
    Request r;
    r.id = e.next_request_id();
    r.prompt = prompt;
    r.params.max_tokens = 60;
    r.params.n = n;
    r.params.ignore_eos = true;
    if (override_policy) {
      r.params.kv_policy_set = true;
      r.params.kv_policy = cfg_of(p, 96);
    }
    r.stream = std::make_shared<RequestStream>();
    EXPECT_EQ(e.submit(r).http_status, 0);
    return r.stream;
  };
  auto a = submit(1, false, EvictionPolicy::kNone);
  auto b = submit(2, true, EvictionPolicy::kSnapKV);
  auto d = submit(1, true, EvictionPolicy::kNone);  // this request opts out
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool().n_used(), e.pages_cached());
  const Usage ua = a->usage(), ub = b->usage(), ud = d->usage();
  EXPECT_GT(ua.kv_tokens_evicted, 100);
  EXPECT_LE(ua.kv_tokens_kept, 64);
  EXPECT_GT(ub.kv_tokens_evicted, 2 * 100);  // both choices
  EXPECT_LE(ub.kv_tokens_kept, 2 * 96);
  EXPECT_EQ(ud.kv_tokens_evicted, 0);
  EXPECT_EQ(ud.kv_policy, "none");
  EXPECT_GT(e.metrics().kv_evicted_tokens_total, 0);
  EXPECT_EQ(e.metrics().kv_kept_tokens.count(), 3u);
  // The prompt again, without a policy: the cache holds its pages up to the first evicted
  // page of the evicting requests, and all of it from the one that opted out.
  auto again = submit(1, true, EvictionPolicy::kNone);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok());
  EXPECT_EQ(again->usage().cached_tokens, 144);
  // A scored policy computes its observation window itself: at most 150 − 32 tokens cached
  auto snap = submit(1, true, EvictionPolicy::kSnapKV);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok());
  EXPECT_EQ(snap->usage().cached_tokens, 112);
  EXPECT_GT(snap->usage().kv_tokens_evicted, 0);
  EXPECT_EQ(e.pages_in_use(), 0);
}

// Quest's key bounds: after any writes, every key of the page lies inside [min, max] of its
// (layer, page, head) per channel, rounding to f16 included; a new page starts afresh;
// copy-on-write copies them.
TEST(KvEviction, KeyBoundsContainEveryKeyWritten) {
  KvLayout l;
  l.n_layer = 2;
  l.n_head_kv = 2;
  l.head_dim = 32;
  l.block_size = 16;
  l.dtype = KvElem::kInt8;
  ASSERT_TRUE(l.validate().is_ok());
  PagePool pool(l, 4);
  pool.enable_key_bounds();
  EXPECT_EQ(pool.key_bounds_bytes(), int64_t(2) * 4 * 2 * 2 * 32 * 2);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.allocate(2, &pages));
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<std::vector<float>> keys;
  for (int slot = 0; slot < 16; ++slot) {
    std::vector<float> k(64), v(64, 0.f);
    for (auto& x : k) x = nd(rng) * (slot == 7 ? 1000.f : 1.f) + 0.1234567f;  // not f16-exact
    keys.push_back(k);
    for (int layer = 0; layer < 2; ++layer) ASSERT_TRUE(pool.write_token(layer, pages[0], slot, k.data(), v.data()));
  }
  for (int layer = 0; layer < 2; ++layer) pool.release_filled(layer);
  ASSERT_TRUE(pool.copy_page(pages[0], pages[1]));
  for (int32_t page : pages)
    for (int layer = 0; layer < 2; ++layer)
      for (int h = 0; h < 2; ++h) {
        const uint16_t* b = pool.key_bounds(layer, page) + h * 64;
        for (int d = 0; d < 32; ++d) {
          float lo = 1e30f, hi = -1e30f;
          for (const auto& k : keys) {
            lo = std::min(lo, k[h * 32 + d]);
            hi = std::max(hi, k[h * 32 + d]);
          }
          EXPECT_LE(fp16_to_fp32(b[d]), lo);
          EXPECT_GE(fp16_to_fp32(b[32 + d]), hi);
          EXPECT_NEAR(fp16_to_fp32(b[d]), lo, std::abs(lo) * 1e-3 + 1e-4);  // tight: one f16 step
          EXPECT_NEAR(fp16_to_fp32(b[32 + d]), hi, std::abs(hi) * 1e-3 + 1e-4);
        }
      }
  pool.release(pages[0]);
  pool.release(pages[1]);
}

// Gemma 3 (two KV groups): the policy bounds the global layers' pages; the sliding-window
// layers keep their own window; forks, Quest and integrity as for SmolLM2.
TEST(KvEviction, Gemma3GlobalLayersEvictSlidingWindowLayersKeepWorking) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_TRUE(m);
  auto f = GgufFile::open(kvtest::gemma3_path());
  ASSERT_TRUE(f);
  auto tok = Tokenizer::from_gguf(**f);
  ASSERT_TRUE(tok);
  EngineConfig c;
  c.max_num_batched_tokens = 128;
  c.max_num_seqs = 8;
  c.max_model_len = 1024;
  c.block_size = 16;
  c.kv_cache_bytes = 96ll << 20;
  c.n_threads = 2;
  c.kv_policy = cfg_of(EvictionPolicy::kSnapKV, 256);
  c.kv_policy.sparse_pages = 4;
  Engine e(*m, **tok, c);
  ASSERT_NE(e.pool_g1(), nullptr);
  std::vector<int32_t> prompt(700);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1000 + (i * 7919) % 200000);
  Request r;
  r.id = e.next_request_id();
  r.prompt = prompt;
  r.params.max_tokens = 40;
  r.params.n = 2;
  r.params.ignore_eos = true;
  r.stream = std::make_shared<RequestStream>();
  ASSERT_EQ(e.submit(r).http_status, 0);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  const Usage u = r.stream->usage();
  EXPECT_EQ(u.completion_tokens, 80);
  EXPECT_GT(u.kv_tokens_evicted, 2 * (700 - 256));
  EXPECT_LE(u.kv_tokens_kept, 2 * 256);
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool_g1()->n_used(), e.window_pages_cached());
}

// Pages computed after a sequence's first eviction never reach the prefix cache: the prompt's
// full pages (computed before the eviction at the prompt's end) are cached, the decode pages
// are not; without a policy the decode pages are cached too.
TEST(KvEviction, PagesComputedAfterAnEvictionAreNeverCached) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  std::vector<int32_t> prompt(150);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(2000 + (i * 104729) % 20000);
  for (bool evict : {false, true}) {
    EngineConfig c;
    c.max_num_batched_tokens = 64;
    c.max_model_len = 512;
    c.kv_cache_bytes = int64_t(96) * 16 * 23040;
    if (evict) c.kv_policy = cfg_of(EvictionPolicy::kSinks, 64);
    Engine e(*m, **tok, c);
    Request r;
    r.id = e.next_request_id();
    r.prompt = prompt;
    r.params.max_tokens = 60;
    r.params.ignore_eos = true;
    r.stream = std::make_shared<RequestStream>();
    ASSERT_EQ(e.submit(r).http_status, 0);
    for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok());
    EXPECT_EQ(e.pages_in_use(), 0);
    // 150 prompt + 59 computed decode positions = 209: 13 full pages, 9 of them the prompt's
    EXPECT_EQ(e.pages_cached(), evict ? 9 : 13) << (evict ? "sinks" : "none");
    EXPECT_EQ(e.pool().n_used(), e.pages_cached());
  }
}
