// Draft proposers of speculative decoding (engine/speculative.h), on hand-made token lists whose
// answers follow from the definitions. The engine's verification is tested in test_engine.cpp.
#include <gtest/gtest.h>

#include "engine/speculative.h"
#include "sampling_stats.h"

using namespace kv;

namespace {
SpecConfig ngram(int32_t lo, int32_t hi) {
  SpecConfig c;
  c.method = SpecConfig::Method::kNgram;
  c.prompt_lookup_min = lo;
  c.prompt_lookup_max = hi;
  return c;
}
std::vector<int32_t> draft_of(const std::vector<int32_t>& t, const SpecConfig& c, int32_t k) {
  std::vector<int32_t> out;
  const int32_t n = ngram_draft(t.data(), static_cast<int64_t>(t.size()), c, k, &out);
  EXPECT_EQ(n, static_cast<int32_t>(out.size()));
  return out;
}
}  // namespace

TEST(NgramDraft, ContinuesTheMostRecentEarlierOccurrence) {
  // [1 2 3] occurs at 0 (then 4 9) and at 5 (then 7 7): the most recent wins.
  const std::vector<int32_t> t = {1, 2, 3, 4, 9, 1, 2, 3, 7, 7, 0, 1, 2, 3};
  EXPECT_EQ(draft_of(t, ngram(2, 4), 3), (std::vector<int32_t>{7, 7, 0}));
  EXPECT_EQ(draft_of(t, ngram(2, 4), 1), (std::vector<int32_t>{7}));
  EXPECT_TRUE(draft_of(t, ngram(2, 4), 0).empty());
}

TEST(NgramDraft, PrefersTheLongestPatternAndRespectsTheMinimum) {
  // Suffix [8 5 6]: [5 6] alone last occurred followed by 1, but [8 5 6] occurred followed by 2.
  const std::vector<int32_t> t = {8, 5, 6, 2, 2, 5, 6, 1, 8, 5, 6};
  EXPECT_EQ(draft_of(t, ngram(2, 3), 2), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(draft_of(t, ngram(2, 2), 2), (std::vector<int32_t>{1, 8}));
  // Only the last token repeats: below prompt_lookup_min = 2, no draft.
  EXPECT_TRUE(draft_of({4, 1, 5, 1}, ngram(2, 4), 3).empty());
  EXPECT_EQ(draft_of({4, 1, 5, 1}, ngram(1, 4), 3), (std::vector<int32_t>{5, 1}));  // up to the end
}

TEST(SuffixDraft, FollowsTheMostFrequentContinuationUntilItsProbabilityDrops) {
  // [5 6] is followed by 7, 7, 8: 7 has probability 2/3; after [5 6 7] always 5.
  const std::vector<int32_t> t = {5, 6, 7, 5, 6, 7, 5, 6, 8, 5, 6};
  SuffixDraft d = suffix_draft_self(t.data(), static_cast<int64_t>(t.size()), 16, 8, 0.5f, 4.f);
  EXPECT_EQ(d.match_len, 2);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{7, 5, 6}));
  EXPECT_NEAR(d.score, 3 * 2.0 / 3, 1e-9);
  // alpha bounds the length by the match: 1 × 2 tokens.
  EXPECT_EQ(suffix_draft_self(t.data(), static_cast<int64_t>(t.size()), 16, 8, 0.5f, 1.f).tokens, (std::vector<int32_t>{7, 5}));
  // A threshold above 2/3 stops at once.
  EXPECT_TRUE(suffix_draft_self(t.data(), static_cast<int64_t>(t.size()), 16, 8, 0.7f, 4.f).tokens.empty());
  // max_match 1: the pattern is [6] alone, which is followed by 7, 7, 8 as well.
  EXPECT_EQ(suffix_draft_self(t.data(), static_cast<int64_t>(t.size()), 1, 8, 0.5f, 4.f).match_len, 1);
}

TEST(SuffixTrie, CountsAddAndRemoveAndProposeByFrequency) {
  SuffixTrie trie(8);
  const std::vector<int32_t> a = {5, 6, 7, 1}, b = {5, 6, 8, 2};
  trie.add(a.data(), 4, +1);
  trie.add(a.data(), 4, +1);
  trie.add(b.data(), 4, +1);
  const std::vector<int32_t> ctx = {9, 9, 5, 6};
  SuffixDraft d = trie.propose(ctx.data(), 4, 4, 0.1f, 4.f);
  EXPECT_EQ(d.match_len, 2);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{7, 1}));
  EXPECT_NEAR(d.score, 2 * 2.0 / 3, 1e-9);
  trie.add(a.data(), 4, -1);  // 7 and 8 tie at one each: the lower id first
  d = trie.propose(ctx.data(), 4, 4, 0.1f, 4.f);
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{7, 1}));
  EXPECT_NEAR(d.score, 1.0, 1e-9);
  trie.add(a.data(), 4, -1);
  EXPECT_EQ(trie.propose(ctx.data(), 4, 4, 0.1f, 4.f).tokens, (std::vector<int32_t>{8, 2}));
  trie.add(b.data(), 4, -1);
  EXPECT_TRUE(trie.propose(ctx.data(), 4, 4, 0.1f, 4.f).tokens.empty());
  EXPECT_EQ(trie.n_live_nodes(), 0);
}

TEST(SuffixTrie, PatternIsAtMostHalfTheDepthSoTheContinuationFits) {
  SuffixTrie trie(4);  // patterns of ≤ 2 tokens, continuations of ≤ 2 more
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6};
  trie.add(a.data(), 6, +1);
  const std::vector<int32_t> ctx = {1, 2, 3};
  SuffixDraft d = trie.propose(ctx.data(), 3, 8, 0.f, 8.f);
  EXPECT_EQ(d.match_len, 2);  // [2 3], not [1 2 3]
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{4, 5}));
}

TEST(SuffixCache, KeepsANamespacesRecentOutputsOnly) {
  SpecConfig c;
  c.suffix_max_depth = 8;
  c.suffix_cache_tokens = 8;
  SuffixCache cache(c);
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {5, 6, 7, 8}, d = {9, 9, 9, 9};
  cache.add_output("t1", a.data(), 4);
  cache.add_output("t1", b.data(), 4);
  ASSERT_NE(cache.trie("t1"), nullptr);
  EXPECT_EQ(cache.trie("t2"), nullptr);  // another namespace sees nothing
  const std::vector<int32_t> ctx = {1, 2};
  EXPECT_EQ(cache.trie("t1")->propose(ctx.data(), 2, 2, 0.f, 4.f).tokens, (std::vector<int32_t>{3, 4}));
  cache.add_output("t1", d.data(), 4);  // over 8 tokens: [1 2 3 4] goes
  EXPECT_TRUE(cache.trie("t1")->propose(ctx.data(), 2, 2, 0.f, 4.f).tokens.empty());
  const std::vector<int32_t> ctx2 = {5, 6};
  EXPECT_EQ(cache.trie("t1")->propose(ctx2.data(), 2, 2, 0.f, 4.f).tokens, (std::vector<int32_t>{7, 8}));
}

TEST(SpecConfig, ValidatesRanges) {
  SpecConfig c = ngram(2, 4);
  EXPECT_TRUE(c.validate().is_ok());
  EXPECT_EQ(c.describe(), "ngram k=5 n=2..4");
  c.prompt_lookup_min = 5;
  EXPECT_FALSE(c.validate().is_ok());
  c = ngram(2, 4);
  c.num_speculative_tokens = 33;
  EXPECT_FALSE(c.validate().is_ok());
  EXPECT_EQ(SpecConfig{}.describe(), "none");
}

TEST(SpecStats, DraftsAsLongAsTheAcceptanceRatePays) {
  SpecStats st;  // prior 1/2: 0.5, 0.25, 0.125 > 0.1 → 3 tokens
  EXPECT_EQ(st.worth(8, 0.1f), 3);
  for (int i = 0; i < 40; ++i) st.observe(5, 5);  // everything accepted: long drafts
  EXPECT_EQ(st.worth(8, 0.1f), 8);
  EXPECT_EQ(st.worth(5, 0.1f), 5);
  for (int i = 0; i < 60; ++i) st.observe(3, 0);  // everything rejected: none, then a probe
  EXPECT_LT(st.rate(), 0.05);
  int32_t probes = 0;
  for (int i = 0; i < 4 * SpecStats::kProbeEvery; ++i) probes += st.worth(5, 0.1f);
  EXPECT_EQ(probes, 4);
  EXPECT_EQ(st.worth(5, 0.f), 5);  // draft_cost 0: always the full length
}

// The verification rule (draw, accept while the draw equals the draft) against the exact
// target distributions, over 100k seeds: the first token emitted follows p0 whatever the draft,
// the draft's first token is accepted with probability p0(d1), and the token after an accepted
// d1 follows p1 computed with d1 in the history (a frequency penalty makes that matter).
// Thresholds as in test_sampler.cpp: chi-square at alpha = 1e-6; the acceptance rate within
// 5 standard deviations of p0(d1).
TEST(VerifyDraft, AcceptedTokensFollowTheTargetDistribution) {
  constexpr int32_t nv = 12;
  constexpr int64_t kDraws = 100000;
  std::vector<float> rows(3 * nv);
  for (int32_t j = 0; j < 3; ++j)
    for (int32_t v = 0; v < nv; ++v) rows[j * nv + v] = std::sin(0.7f * v + 1.3f * j) * 2.f;
  for (kv::SamplingParams p : {kv::SamplingParams{}, kv::SamplingParams{}}) {
    p.temperature = 0.9f;
    static int variant = 0;
    if (variant++ % 2) p.top_p = 0.9f, p.frequency_penalty = 0.8f;
    const std::vector<float> row0(rows.begin(), rows.begin() + nv), row1(rows.begin() + nv, rows.begin() + 2 * nv);
    const std::vector<int32_t> history = {1, 2, 3};
    const std::vector<double> p0 = kvtest::reference_probs(row0, p, history, 3);
    const int32_t d1 = static_cast<int32_t>(std::max_element(p0.begin(), p0.end()) - p0.begin());
    std::vector<int32_t> with_d1 = history;
    with_d1.push_back(d1);
    const std::vector<double> p1 = kvtest::reference_probs(row1, p, with_d1, 3);
    const std::vector<int32_t> draft = {d1, 5};
    std::vector<int64_t> first(nv, 0), second(nv, 0);
    int64_t accepted = 0;
    std::vector<float> buf(nv);
    std::vector<int32_t> out, hist = history;
    kv::SamplerScratch ws;
    for (int64_t i = 0; i < kDraws; ++i) {
      p.seed = 1000 + static_cast<uint64_t>(i);
      kv::Sampler sampler(p);
      out.clear();
      kv::verify_draft(sampler, rows.data(), 3, nv, &draft, hist, 3, &ws, buf.data(), &out, kv::DrawRules{}, nullptr);
      ASSERT_EQ(hist, history);  // restored
      ASSERT_GE(out.size(), 1u);
      ++first[out[0]];
      if (out[0] == d1) {
        ++accepted;
        ASSERT_GE(out.size(), 2u);
        ++second[out[1]];
      } else {
        ASSERT_EQ(out.size(), 1u);  // a rejected draft ends the step
      }
    }
    const kvtest::ChiSquare c0 = kvtest::chi_square(first, p0, kDraws);
    EXPECT_TRUE(c0.pass()) << "first token: chi2 " << c0.stat << " df " << c0.df;
    const double sd = std::sqrt(p0[d1] * (1 - p0[d1]) / kDraws);
    EXPECT_NEAR(double(accepted) / kDraws, p0[d1], 5 * sd);
    const kvtest::ChiSquare c1 = kvtest::chi_square(second, p1, accepted);
    EXPECT_TRUE(c1.pass()) << "after an accepted d1: chi2 " << c1.stat << " df " << c1.df;
  }
}
