#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "engine/sampler.h"

using namespace kv;

TEST(Sampler, GreedyPicksArgmaxFirstOnTies) {
  std::vector<float> l = {0.1f, 3.f, 3.f, -1.f};
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
}

TEST(Sampler, SeedReproducesAndDiffers) {
  SamplingParams p;
  p.temperature = 1.f;
  p.seed = 42;
  std::vector<float> base(100);
  for (int i = 0; i < 100; ++i) base[i] = std::sin(i * 0.37f) * 2;
  auto draw = [&](uint64_t seed) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int k = 0; k < 50; ++k) {
      auto l = base;
      out.push_back(s.sample(l.data(), 100, {}));
    }
    return out;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(Sampler, TopKTopPMinPRestrictSupport) {
  std::vector<float> base = {5.f, 4.f, 3.f, 0.f, -2.f};
  auto support = [&](SamplingParams p) {
    std::map<int, int> seen;
    Sampler s(p);
    for (int k = 0; k < 4000; ++k) {
      auto l = base;
      seen[s.sample(l.data(), 5, {})]++;
    }
    return seen;
  };
  SamplingParams p;
  p.temperature = 1.f;
  p.top_k = 2;
  auto s1 = support(p);
  EXPECT_EQ(s1.size(), 2u);
  EXPECT_TRUE(s1.count(0) && s1.count(1));
  // p(0) ≈ 0.66, p(1) ≈ 0.24: top_p 0.8 keeps exactly {0, 1}
  p.top_k = 0;
  p.top_p = 0.8f;
  EXPECT_EQ(support(p).size(), 2u);
  // min_p 0.3 keeps tokens with p ≥ 0.3 × 0.66: only {0, 1}
  p.top_p = 1.f;
  p.min_p = 0.3f;
  EXPECT_EQ(support(p).size(), 2u);
  // Frequencies follow the softmax: token 0 about 0.665 of draws with no filter.
  p.min_p = 0.f;
  auto all = support(p);
  EXPECT_NEAR(all[0] / 4000.0, 0.6652, 0.03);
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 2.f;
  std::vector<float> l = {4.f, 3.f, -1.f};
  Sampler s(p);
  EXPECT_EQ(s.sample(l.data(), 3, {0}), 1);  // 4/2 = 2 < 3
  EXPECT_FLOAT_EQ(l[0], 2.f);
  std::vector<float> l2 = {-1.f, -1.5f};
  Sampler s2(p);
  EXPECT_EQ(s2.sample(l2.data(), 2, {0}), 1);  // -1*2 = -2 < -1.5
}
