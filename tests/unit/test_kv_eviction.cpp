// Long-context KV policies (kv/kv_eviction.h): the pure page choice, Quest's selection, and
// the policies running on the real model through SequenceRunner and the Engine (pages given
// back, integrity, prefix cache, usage).
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <tuple>

#include "engine/engine.h"
#include "engine/sequence_runner.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "kv/kv_eviction.h"
#include "kv/kv_reindex.h"
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
// An engine over SmolLM2 (23,040 KV bytes per token at f16) with `pages` 16-token pages, 2 threads.
EngineConfig smol_engine(int32_t max_model_len, int64_t pages, int32_t max_seqs, int32_t batch_tokens) {
  EngineConfig c;
  c.max_num_batched_tokens = batch_tokens;
  c.max_num_seqs = max_seqs;
  c.max_model_len = max_model_len;
  c.block_size = 16;
  c.kv_cache_bytes = pages * 16 * 23040;
  c.n_threads = 2;
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
  EngineConfig c = smol_engine(512, 96, 8, 64);
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
  // page of the evicting requests, and all of it from the one that opted out: 9 full pages,
  // and 5 of the 6 prompt tokens in the 10th copied from its page (the last one is computed).
  auto again = submit(1, true, EvictionPolicy::kNone);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok());
  EXPECT_EQ(again->usage().cached_tokens, 149);
  // A scored policy computes its observation window itself: at most 150 − 32 tokens cached
  auto snap = submit(1, true, EvictionPolicy::kSnapKV);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok());
  EXPECT_EQ(snap->usage().cached_tokens, 112);
  EXPECT_GT(snap->usage().kv_tokens_evicted, 0);
  EXPECT_EQ(e.pages_in_use(), 0);
}

// A request under an evicting policy is admitted by what it holds at once (the prompt, then the
// budget), not by its whole context: 12 pages (192 tokens) run 40 + 300 tokens, with the
// server's policy and with the request's own; without a policy the same request is refused.
TEST(KvEviction, EngineAdmitsByTheBudgetNotTheWholeContext) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  EngineConfig c = smol_engine(512, 12, 4, 64);
  c.kv_policy = cfg_of(EvictionPolicy::kSinks, 64);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  Engine e(*m, **tok, c);
  ASSERT_EQ(e.pool().n_pages(), 12);
  auto request = [&](int n_prompt, int max_tokens, int policy_override, EvictionPolicy p, int32_t budget) {
    Request r;
    r.id = e.next_request_id();
    r.prompt.resize(static_cast<size_t>(n_prompt));
    for (size_t i = 0; i < r.prompt.size(); ++i) r.prompt[i] = static_cast<int32_t>(1000 + (i * 7919) % 20000);
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    if (policy_override) {
      r.params.kv_policy_set = true;
      r.params.kv_policy = cfg_of(p, budget);
    }
    r.stream = std::make_shared<RequestStream>();
    return std::make_pair(e.submit(r), r.stream);
  };
  auto [ra, a] = request(40, 300, 0, EvictionPolicy::kNone, 0);
  auto [rb, b] = request(40, 300, 1, EvictionPolicy::kSnapKV, 96);
  EXPECT_EQ(ra.http_status, 0) << ra.message;
  EXPECT_EQ(rb.http_status, 0) << rb.message;
  // Refused: no policy (340 tokens at once), a budget beyond the pool, a prompt beyond the pool.
  auto [rc, c1] = request(40, 300, 1, EvictionPolicy::kNone, 0);
  EXPECT_EQ(rc.http_status, 400);
  EXPECT_EQ(rc.param, "max_tokens");
  auto [rd, d] = request(40, 300, 1, EvictionPolicy::kSinks, 256);
  EXPECT_EQ(rd.http_status, 400);
  auto [re, e1] = request(200, 10, 0, EvictionPolicy::kNone, 0);
  EXPECT_EQ(re.http_status, 400);
  EXPECT_EQ(re.param, "messages");
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  EXPECT_EQ(a->usage().completion_tokens, 300);
  EXPECT_EQ(b->usage().completion_tokens, 300);
  EXPECT_LE(a->usage().kv_tokens_kept, 64);
  EXPECT_LE(b->usage().kv_tokens_kept, 96);
  EXPECT_GT(a->usage().kv_tokens_evicted, 200);
  EXPECT_EQ(e.pages_in_use(), 0);
}

// ... and such requests preempt one another and all finish: three on 8 pages (each holds up
// to 3). (A sequence preempted after its tokens outgrew the pool drops its evicted tokens, as
// past max_model_len; this schedule preempts them while they are short, so that branch of
// Engine::preempt is not reached here.)
TEST(KvEviction, BudgetAdmittedRequestsPreemptOneAnotherAndFinish) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  EngineConfig c = smol_engine(4096, 8, 4, 64);
  c.enable_prefix_caching = false;
  c.kv_policy = cfg_of(EvictionPolicy::kSinks, 48);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  Engine e(*m, **tok, c);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 3; ++i) {
    Request r;
    r.id = e.next_request_id();
    r.prompt.resize(20);
    for (size_t j = 0; j < r.prompt.size(); ++j) r.prompt[j] = static_cast<int32_t>(1000 + (j * 7919 + i * 131) % 20000);
    r.params.max_tokens = 200;
    r.params.ignore_eos = true;
    r.stream = std::make_shared<RequestStream>();
    ASSERT_EQ(e.submit(r).http_status, 0);
    streams.push_back(r.stream);
  }
  for (int i = 0; i < 20000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(streams[i]->usage().completion_tokens, 200) << i;
  EXPECT_GT(e.metrics().num_preemptions_total, 0);
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool().n_used(), 0);
}

// Quest's page score uses the expected maximum of n standard normals: known values (n = 2, 3 in
// closed form; 16 and 32 by numpy: trapezoid rule over [-12, 12], and 400k draws agree to 1e-3).
TEST(KvEviction, QuestSpreadIsTheExpectedMaximumOfNormals) {
  EXPECT_NEAR(quest_spread(1), 0.0, 1e-6);
  EXPECT_NEAR(quest_spread(2), 1.0 / std::sqrt(M_PI), 1e-6);
  EXPECT_NEAR(quest_spread(3), 1.5 / std::sqrt(M_PI), 1e-6);
  EXPECT_NEAR(quest_spread(16), 1.76598, 1e-4);
  EXPECT_NEAR(quest_spread(32), 2.06967, 1e-4);
}

// Quest's key summaries: once a page is full they are the channel-wise mean and variance of
// the keys it holds (to f16), for a quantized (staged) and an f16 layer; a rewrite after a
// rollback leaves no trace of the rolled-back keys; copy-on-write copies them.
TEST(KvEviction, KeyStatsAreTheMeanAndVarianceOfThePage) {
  for (KvElem dt : {KvElem::kInt8, KvElem::kF16}) {
    KvLayout l;
    l.n_layer = 2;
    l.n_head_kv = 2;
    l.head_dim = 32;
    l.block_size = 16;
    l.dtype = dt;
    ASSERT_TRUE(l.validate().is_ok());
    PagePool pool(l, 4);
    pool.enable_key_stats();
    // layers × pages × parts (two of 8 slots) × heads × (scales, 8-bit means, 8-bit variances)
    ASSERT_EQ(key_stat_parts(16), 2);
    EXPECT_EQ(pool.key_stats_bytes(), int64_t(2) * 4 * 2 * 2 * (8 + 2 * 32));
    std::vector<int32_t> pages;
    ASSERT_TRUE(pool.allocate(2, &pages));
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.f, 3.f);
    std::vector<std::vector<float>> keys(16);
    auto write = [&](int slot, float scale) {
      std::vector<float> k(64), v(64, 0.f);
      for (auto& x : k) x = nd(rng) * scale + 0.1234567f;  // not f16-exact
      keys[slot] = k;
      for (int layer = 0; layer < 2; ++layer) ASSERT_TRUE(pool.write_token(layer, pages[0], slot, k.data(), v.data()));
    };
    for (int slot = 0; slot < 10; ++slot) write(slot, slot < 4 ? 1.f : 100.f);  // drafts from slot 4, rolled back
    for (int slot = 4; slot < 16; ++slot) write(slot, 1.f);
    for (int layer = 0; layer < 2; ++layer) pool.release_filled(layer);
    ASSERT_TRUE(pool.copy_page(pages[0], pages[1]));
    // Each part (slots 0-7, 8-15) and KV head: the mean and variance of its keys, in 8 bits:
    // within half a step of the largest |mean| / 127 and the largest variance / 255 (and, for
    // f16 pages, of the keys as stored: rounded to f16).
    for (int32_t page : pages)
      for (int layer = 0; layer < 2; ++layer)
        for (int part = 0; part < 2; ++part)
          for (int h = 0; h < 2; ++h) {
            const uint8_t* b = pool.key_stats(layer, page) + (part * 2 + h) * key_summary_bytes(32);
            double mean[32], var[32], amax = 0, vmax = 0;
            for (int d = 0; d < 32; ++d) {
              mean[d] = var[d] = 0;
              for (int j = 8 * part; j < 8 * part + 8; ++j) mean[d] += keys[j][h * 32 + d] / 8.0;
              for (int j = 8 * part; j < 8 * part + 8; ++j) var[d] += (keys[j][h * 32 + d] - mean[d]) * (keys[j][h * 32 + d] - mean[d]) / 8.0;
              amax = std::max(amax, std::abs(mean[d]));
              vmax = std::max(vmax, var[d]);
            }
            for (int d = 0; d < 32; ++d) {
              // (f16 pages: of the keys rounded to f16, as stored)
              EXPECT_NEAR(key_summary_mean(b, 32, d), mean[d], amax / 254 * 1.001 + std::abs(mean[d]) * 1e-3 + 1e-3) << kv_dtype_name(dt);
              EXPECT_NEAR(key_summary_var(b, 32, d), var[d], vmax / 510 * 1.001 + var[d] * 1e-3 + 1e-3) << kv_dtype_name(dt);
            }
          }
    pool.release(pages[0]);
    pool.release(pages[1]);
    EXPECT_TRUE(pool.check_integrity().is_ok());
  }
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

// StreamingLLM re-indexing (kv/kv_reindex.h): the plan closes the holes, moved pages are shifted
// by the distance they moved in both layer groups, shared ones are copied first, dropped ones
// (group 1) released.
TEST(KvReindex, PlanMovesKeptPagesDownAndShiftsTheirKeys) {
  KvLayout l;
  l.n_layer = 1;
  l.n_head_kv = 1;
  l.head_dim = 8;
  l.block_size = 16;
  l.dtype = KvDtype::kF16;
  PagePool pool(l, 16);
  std::vector<int32_t> t;
  ASSERT_TRUE(pool.allocate(6, &t));
  // pages 1 and 2 evicted; 70 positions: page 4 is the filling one (6 slots), page 5 is empty
  pool.release(t[1]);
  pool.release(t[2]);
  const std::vector<int32_t> orig = t;
  t[1] = t[2] = -1;
  const ReindexPlan plan = plan_reindex(t, 70, 16);
  EXPECT_EQ(plan.kept, (std::vector<int64_t>{0, 3, 4, 5}));
  EXPECT_EQ(plan.n_after, 38);
  EXPECT_EQ(plan.dropped(), 32);
  // page 3 is shared (a fork): it is copied before its keys change. Group 1 (sliding-window
  // layers) holds a page at index 2, which group 0 evicted: it is released; its page 0 slid out.
  pool.retain(orig[3]);
  EXPECT_EQ(moved_shared(plan, pool, t), 1);
  PagePool pool1(l, 8);
  BlockTable t0{t, 70}, t1;
  ASSERT_TRUE(pool1.allocate(6, &t1.pages));
  pool1.release(t1.pages[0]);
  t1.pages[0] = -1;
  const std::vector<int32_t> orig1 = t1.pages;
  PagePool* const pools[2] = {&pool, &pool1};
  BlockTable* const tables[2] = {&t0, &t1};
  std::vector<std::tuple<int, int32_t, int32_t, int64_t>> shifts;
  ASSERT_TRUE(apply_reindex(plan, pools, tables, [&](int g, int32_t page, int32_t n, int64_t d) { shifts.emplace_back(g, page, n, d); }));
  t = t0.pages;
  const int32_t copy3 = t[1];
  EXPECT_NE(copy3, orig[3]);
  EXPECT_EQ(pool.refcount(orig[3]), 1);  // the other holder keeps the original
  EXPECT_EQ(t, (std::vector<int32_t>{orig[0], copy3, orig[4], orig[5]}));
  EXPECT_EQ(t0.n_tokens, 38);
  EXPECT_EQ(t1.n_tokens, 38);
  EXPECT_EQ(t1.pages, (std::vector<int32_t>{-1, orig1[3], orig1[4], orig1[5]}));
  EXPECT_EQ(pool1.n_used(), 3);
  EXPECT_TRUE(pool1.check_integrity().is_ok());
  // page 3 (now at 1) and the filling page 4 (now at 2) of each group; page 5 holds nothing
  ASSERT_EQ(shifts.size(), 4u);
  EXPECT_EQ(shifts[0], std::make_tuple(0, copy3, 16, int64_t(32)));
  EXPECT_EQ(shifts[1], std::make_tuple(0, orig[4], 6, int64_t(32)));
  EXPECT_EQ(shifts[2], std::make_tuple(1, orig1[3], 16, int64_t(32)));
  EXPECT_EQ(shifts[3], std::make_tuple(1, orig1[4], 6, int64_t(32)));
  std::vector<float> scores = {1, 2, 3, 4, 5, 6};
  reindex_pages_of(plan, &scores);
  EXPECT_EQ(scores, (std::vector<float>{1, 4, 5, 6}));
  // tokens: positions 16..47 go, the uncomputed tail stays; 40 of a 50-token prompt... 32 dropped
  std::vector<int32_t> toks(71);
  std::iota(toks.begin(), toks.end(), 0);
  EXPECT_EQ(reindex_tokens(plan, 16, 50, &toks), 32);
  ASSERT_EQ(toks.size(), 39u);
  EXPECT_EQ(toks[15], 15);
  EXPECT_EQ(toks[16], 48);
  EXPECT_EQ(toks[38], 70);
  for (int32_t p : t)
    if (p >= 0) pool.release(p);
  pool.release(orig[3]);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
}

// Re-rotating keys in place, for every page format: rotating by +d then by -d gives the keys
// back (to the format's precision), in a full quantized page and in a filling page's staging.
TEST(KvReindex, TransformKeysRoundTripsEveryFormat) {
  for (KvDtype dt : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kFp8E4M3, KvDtype::kInt8, KvDtype::kInt4}) {
    KvLayout l;
    l.n_layer = 1;
    l.n_head_kv = 2;
    l.head_dim = 64;
    l.block_size = 16;
    l.dtype = dt;
    PagePool pool(l, 4, 4);
    pool.enable_key_stats();
    std::vector<int32_t> pages;
    ASSERT_TRUE(pool.allocate(2, &pages));
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    std::vector<float> k(2 * 64), v(2 * 64);
    for (int slot = 0; slot < 16 + 5; ++slot) {  // page 0 full (quantized), page 1 filling
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      ASSERT_TRUE(pool.write_token(0, pages[slot / 16], slot % 16, k.data(), v.data()));
    }
    pool.release_filled(0);
    auto read = [&](int32_t page, int n) {
      std::vector<float> out(size_t(2) * n * 64);
      const PagedKvView view = pool.view(0);
      for (int h = 0; h < 2; ++h) {
        const int32_t s = pool.stage_of(0, page);
        const uint8_t* tile = s >= 0 ? pool.stage_k(0, s) + h * kv_stage_tile_bytes(16, 64)
                                     : pool.k_data(0, page) + h * kv_k_tile_bytes(view.elem, 16, 64);
        kv_read_k(tile, s >= 0 ? KvElem::kF16 : view.elem, 16, 64, n, out.data() + size_t(h) * n * 64);
      }
      return out;
    };
    for (int pi = 0; pi < 2; ++pi) {
      const int n = pi == 0 ? 16 : 5;
      const std::vector<float> before = read(pages[pi], n);
      auto rotate = [&](int64_t d) {
        pool.transform_keys(0, pages[pi], n, [&](float* keys, int32_t) {
          for (int j = 0; j < n; ++j) rope(keys + j * 64, 1, 64, 64, d, 10000.f, 1.f, RopeStyle::kNorm);
        });
      };
      rotate(100);
      const std::vector<float> moved = read(pages[pi], n);
      rotate(-100);
      const std::vector<float> after = read(pages[pi], n);
      double err = 0, change = 0;
      for (size_t i = 0; i < before.size(); ++i) {
        err = std::max(err, double(std::abs(after[i] - before[i])));
        change = std::max(change, double(std::abs(moved[i] - before[i])));
      }
      const double tol = dt == KvDtype::kF32 ? 1e-5 : dt == KvDtype::kF16 ? 5e-3 : dt == KvDtype::kBF16 ? 4e-2 : dt == KvDtype::kInt4 ? 1.5 : 0.5;
      EXPECT_LT(err, tol) << kv_dtype_name(dt) << " page " << pi;
      EXPECT_GT(change, 0.5) << kv_dtype_name(dt) << " page " << pi;  // the rotation did act
      // Quest's summaries follow the keys: the mean and variance of each part's slots rotated
      // (slots 0-7 and 8-15; the filling page's 5 slots are all part 0's, which part 1 repeats),
      // in 8 bits: within a step of the largest |mean| / 127 and the largest variance / 255.
      // They are of the keys before rounding to bf16 or quantizing (a staging tile is f16).
      if (!(dt == KvDtype::kBF16 || (dt != KvDtype::kF32 && dt != KvDtype::kF16 && pi == 0)))
        for (int part = 0; part < 2; ++part)
          for (int h = 0; h < 2; ++h) {
            const uint8_t* b = pool.key_stats(0, pages[pi]) + (part * 2 + h) * key_summary_bytes(64);
            const int j0 = n > 8 ? 8 * part : 0, j1 = n > 8 ? j0 + 8 : n;
            double mean[64], var[64], amax = 0, vmax = 0;
            for (int d = 0; d < 64; ++d) {
              mean[d] = var[d] = 0;
              for (int j = j0; j < j1; ++j) mean[d] += after[(size_t(h) * n + j) * 64 + d] / (j1 - j0);
              for (int j = j0; j < j1; ++j) var[d] += std::pow(after[(size_t(h) * n + j) * 64 + d] - mean[d], 2) / (j1 - j0);
              amax = std::max(amax, std::abs(mean[d]));
              vmax = std::max(vmax, var[d]);
            }
            for (int d = 0; d < 64; ++d) {
              ASSERT_NEAR(key_summary_mean(b, 64, d), mean[d], 1e-2 + amax / 127) << kv_dtype_name(dt);
              ASSERT_NEAR(key_summary_var(b, 64, d), var[d], 1e-2 * (1 + var[d]) + vmax / 255) << kv_dtype_name(dt);
            }
          }
    }
    for (int32_t p : pages) pool.release(p);
    EXPECT_TRUE(pool.check_integrity().is_ok());
  }
}

// Past max_model_len under preemption: a preempted sequence that went past the limit drops its
// evicted tokens and is recomputed from what it kept; every request finishes in full, every
// page comes back, forks (n = 2) included.
TEST(KvReindex, EngineGoesPastMaxModelLenThroughPreemption) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  EngineConfig c = smol_engine(128, 24, 8, 64);  // 24 pages: 8 sequences of up to 5 pages preempt
  c.enable_prefix_caching = false;
  c.kv_policy = cfg_of(EvictionPolicy::kSinks, 64);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  Engine e(*m, **tok, c);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.id = e.next_request_id();
    r.prompt.resize(40 + 7 * i);
    for (size_t j = 0; j < r.prompt.size(); ++j) r.prompt[j] = static_cast<int32_t>(1000 + (j * 7919 + i * 31) % 20000);
    r.params.max_tokens = 200;
    r.params.n = i % 3 == 0 ? 2 : 1;
    r.params.ignore_eos = true;
    r.params.sampling.temperature = 0.7f;
    r.params.sampling.seed = 11 + i;
    r.params.sampling.presence_penalty = 0.3f;
    r.stream = std::make_shared<RequestStream>();
    ASSERT_EQ(e.submit(r).http_status, 0);
    streams.push_back(r.stream);
  }
  for (int i = 0; i < 200000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  for (int i = 0; i < 6; ++i) {
    const Usage u = streams[i]->usage();
    EXPECT_EQ(u.completion_tokens, (i % 3 == 0 ? 2 : 1) * 200) << i;
    EXPECT_GT(u.kv_tokens_reindexed, 0) << i;
  }
  EXPECT_GT(e.metrics().num_preemptions_total, 0);
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool().n_used(), 0);
}

// Gemma 3 past max_model_len: the sliding-window layers' pages move with the global layers' plan
// (each group re-rotated with its own RoPE base), forks copy what they share, and both pools
// account for every page.
TEST(KvReindex, Gemma3BothLayerGroupsGoPastMaxModelLen) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_TRUE(m);
  auto f = GgufFile::open(kvtest::gemma3_path());
  ASSERT_TRUE(f);
  auto tok = Tokenizer::from_gguf(**f);
  ASSERT_TRUE(tok);
  EngineConfig c;
  c.max_num_batched_tokens = 128;
  c.max_num_seqs = 4;
  c.max_model_len = 700;
  c.block_size = 16;
  c.kv_cache_bytes = 96ll << 20;
  c.n_threads = 2;
  c.kv_policy = cfg_of(EvictionPolicy::kSinks, 600);  // recent 560 tokens: more than the 512-token window
  Engine e(*m, **tok, c);
  ASSERT_NE(e.pool_g1(), nullptr);
  Request r;
  r.id = e.next_request_id();
  r.prompt.resize(300);
  for (size_t i = 0; i < r.prompt.size(); ++i) r.prompt[i] = static_cast<int32_t>(1000 + (i * 7919) % 200000);
  r.params.max_tokens = 700;
  r.params.n = 2;
  r.params.ignore_eos = true;
  r.params.sampling.temperature = 0.8f;
  r.params.sampling.seed = 5;
  r.stream = std::make_shared<RequestStream>();
  ASSERT_EQ(e.submit(r).http_status, 0);
  for (int i = 0; i < 100000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  const Usage u = r.stream->usage();
  EXPECT_EQ(u.completion_tokens, 1400);
  EXPECT_GT(u.kv_tokens_reindexed, 0);
  EXPECT_LE(u.kv_tokens_kept, 2 * 600);
  EXPECT_EQ(e.pages_in_use(), 0);
  EXPECT_EQ(e.pool_g1()->n_used(), e.window_pages_cached());
}

// Each layer group re-rotates with its own layers' RoPE base (Gemma 3: 1,000,000 for the
// global layers, 10,000 for the sliding-window ones). Layer 0's keys depend on the token and its
// position only, so the oracle is the model itself: the same tokens fed 32 positions later, then
// shifted by -32, must give the keys they get at positions 0..: within f32 rounding, and far from
// what a rotation with the other group's base gives.
TEST(KvReindex, Gemma3EachGroupRotatesWithItsLayersBase) {
  LlamaModel* m = kvtest::gemma3_model();
  ASSERT_TRUE(m);
  ASSERT_EQ(m->kv_groups().size(), 2u);
  const auto& g1 = m->kv_groups()[1];
  ASSERT_FALSE(g1.layers.empty());
  ASSERT_EQ(g1.layers[0], 0);  // layer 0 is a sliding-window layer: slot 0 of group 1
  ThreadPool tp(2);
  const int32_t bs = 16, delta = 32;
  std::vector<int32_t> toks(16), padded(delta);
  for (int i = 0; i < 16; ++i) toks[i] = 1000 + i * 7919 % 200000;
  for (int i = 0; i < delta; ++i) padded[i] = 3000 + i * 104729 % 200000;
  padded.insert(padded.end(), toks.begin(), toks.end());
  // layer 0's keys of `toks` (the sequence's last page), after shifting that page of group 1 by -shift
  auto keys = [&](const std::vector<int32_t>& t, int64_t shift, std::vector<float>* out) {
    PagePool p0(m->kv_layout(bs, KvDtype::kF32, {}, 0), 8), p1(m->kv_layout(bs, KvDtype::kF32, {}, 1), 8);
    SequenceRunner seq(*m, p0, &p1, tp);
    ASSERT_TRUE(seq.feed(t.data(), static_cast<int64_t>(t.size()), false).is_ok());
    const int32_t page = seq.table_g1().pages[(t.size() - 16) / bs];
    if (shift) m->shift_keys(p1, 1, page, bs, shift);
    const KvLayout& l = p1.layout();
    out->resize(size_t(bs) * l.n_head_kv * l.head_dim);
    for (int h = 0; h < l.n_head_kv; ++h)
      kv_read_k(p1.k_data(0, page) + h * kv_k_tile_bytes(KvElem::kF32, bs, l.head_dim), KvElem::kF32, bs, l.head_dim, bs,
                out->data() + size_t(h) * bs * l.head_dim);
  };
  std::vector<float> want, got, wrong, unshifted;
  keys(toks, 0, &want);
  keys(padded, delta, &got);
  keys(padded, 0, &unshifted);
  double err = 0, moved = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, double(std::abs(got[i] - want[i])));
    moved = std::max(moved, double(std::abs(unshifted[i] - want[i])));
    scale = std::max(scale, double(std::abs(want[i])));
  }
  EXPECT_LT(err, 1e-4 * scale);
  EXPECT_GT(moved, 0.05 * scale);  // the positions do matter to these keys
  // the global group's base on these keys: what a mix-up of the groups' bases would give
  {
    PagePool p0(m->kv_layout(bs, KvDtype::kF32, {}, 0), 8), p1(m->kv_layout(bs, KvDtype::kF32, {}, 1), 8);
    SequenceRunner seq(*m, p0, &p1, tp);
    ASSERT_TRUE(seq.feed(padded.data(), static_cast<int64_t>(padded.size()), false).is_ok());
    const int32_t page = seq.table_g1().pages[delta / bs];
    const KvLayout& l = p1.layout();
    const int64_t tile = kv_k_tile_bytes(KvElem::kF32, bs, l.head_dim);
    std::vector<float> k(size_t(bs) * l.head_dim), tok_major(k.size());
    double werr = 0;
    for (int h = 0; h < l.n_head_kv; ++h) {
      kv_read_k(p1.k_data(0, page) + h * tile, KvElem::kF32, bs, l.head_dim, bs, k.data());
      for (int j = 0; j < bs; ++j)
        rope(k.data() + size_t(j) * l.head_dim, 1, l.head_dim, m->config().n_rot, -delta, m->config().rope_base, m->config().rope_scale,
             m->config().rope_style);
      for (size_t i = 0; i < k.size(); ++i) werr = std::max(werr, double(std::abs(k[i] - want[size_t(h) * k.size() + i])));
    }
    EXPECT_GT(werr, 100 * err);
  }
}

// A limit that is not a page boundary, and a prompt whose last chunk is one token (run as a
// decode, so no prompt-end check): the sequence reaches the limit with nothing evicted yet.
// Re-indexing checks the policy first instead of stalling there (review finding, 2026-11-27).
TEST(KvReindex, EngineChecksThePolicyWhenTheLimitComesBeforeAnyCheck) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  EngineConfig c = smol_engine(130, 64, 4, 64);
  c.kv_policy = cfg_of(EvictionPolicy::kSinks, 64);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  Engine e(*m, **tok, c);
  Request r;
  r.id = e.next_request_id();
  r.prompt.resize(129);  // chunks of 64, 64 and 1
  for (size_t j = 0; j < r.prompt.size(); ++j) r.prompt[j] = static_cast<int32_t>(1000 + (j * 7919) % 20000);
  r.params.max_tokens = 50;
  r.params.ignore_eos = true;
  r.stream = std::make_shared<RequestStream>();
  ASSERT_EQ(e.submit(r).http_status, 0);
  int steps = 0;
  for (; steps < 2000 && e.step(); ++steps) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
  EXPECT_LT(steps, 2000);
  const Usage u = r.stream->usage();
  EXPECT_EQ(u.completion_tokens, 50);
  EXPECT_GT(u.kv_tokens_reindexed, 0);
  EXPECT_EQ(e.metrics().num_preemptions_total, 0);
  EXPECT_EQ(e.pages_in_use(), 0);
}

// A sequence preempted exactly at the limit (its next position would be max_model_len) cannot be
// recomputed whole: its evicted tokens go and the kept ones are recomputed at re-indexed
// positions (Engine::preempt). Here an older request takes the last page at the very step a
// forked n = 2 request reaches the limit, so the newest sibling is preempted there. Greedy: both
// siblings' text equals the text of the same request with room to spare, re-indexed in place
// (rotated keys against recomputed ones: equal up to f16 rounding, which moves no argmax here).
TEST(KvReindex, PreemptionAtTheLimitRecomputesWhatWasKept) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_TRUE(m);
  auto tok = Tokenizer::from_gguf(*kvtest::smollm2_file());
  ASSERT_TRUE(tok);
  auto run = [&](int pages, std::vector<std::vector<int32_t>>* texts, MetricsSnapshot* ms) {
    EngineConfig c = smol_engine(128, pages, 8, 256);
    c.enable_prefix_caching = false;
    Engine e(*m, **tok, c);
    std::vector<std::shared_ptr<RequestStream>> st;
    for (int i = 0; i < 2; ++i) {
      Request r;
      r.id = e.next_request_id();
      // the older request (24 + 24 tokens) needs a new page at the very step the forked one
      // (104 + 24) reaches 128, and the 9-page pool has none left
      r.prompt.resize(i == 0 ? 24 : 104);
      for (size_t j = 0; j < r.prompt.size(); ++j) r.prompt[j] = static_cast<int32_t>(1000 + (j * 7919 + i * 31) % 20000);
      r.params.max_tokens = i == 0 ? 104 : 100;
      r.params.ignore_eos = true;
      if (i == 1) {
        r.params.n = 2;
        r.params.kv_policy_set = true;
        r.params.kv_policy = cfg_of(EvictionPolicy::kSinks, 64);
      }
      r.stream = std::make_shared<RequestStream>();
      EXPECT_EQ(e.submit(r).http_status, 0);
      st.push_back(r.stream);
    }
    for (int i = 0; i < 200000 && e.step(); ++i) ASSERT_TRUE(e.check_integrity().is_ok()) << e.check_integrity().message();
    EXPECT_EQ(e.pages_in_use(), 0);
    EXPECT_EQ(e.pool().n_used(), 0);
    std::vector<StreamEvent> evs;
    texts->assign(3, {});
    for (int i = 0; i < 2; ++i) {
      st[i]->pop(&evs, std::chrono::milliseconds(0));
      for (const auto& ev : evs) {
        std::vector<int32_t>& t = (*texts)[i == 0 ? 0 : 1 + ev.index];
        t.insert(t.end(), ev.tokens.begin(), ev.tokens.end());
      }
      evs.clear();
    }
    EXPECT_EQ(st[0]->usage().completion_tokens, 104);
    EXPECT_EQ(st[1]->usage().completion_tokens, 200);
    *ms = e.metrics();
  };
  std::vector<std::vector<int32_t>> tight, roomy;
  MetricsSnapshot a, b;
  run(9, &tight, &a);
  run(64, &roomy, &b);
  EXPECT_EQ(a.kv_reindex_preemptions_total, 1);  // the case under test happened
  EXPECT_EQ(b.num_preemptions_total, 0);
  EXPECT_EQ(a.kv_reindexed_tokens_total, b.kv_reindexed_tokens_total);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(tight[k].size(), k == 0 ? 104u : 100u) << k;
    EXPECT_EQ(tight[k], roomy[k]) << k;
  }
}
