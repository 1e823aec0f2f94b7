// Fast ops against their float64 references, on every ISA build this CPU can run (scalar
// always; AVX2 and AVX-512 when present), over sizes that hit every tail case.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/quant.h"
#include "isa_param.h"

namespace kv {
namespace {

std::vector<int64_t> sizes() {
  std::vector<int64_t> s;
  for (int64_t n = 1; n <= 70; ++n) s.push_back(n);  // every 16-lane tail, 1..4 full vectors
  for (int64_t n : {576, 640, 1023, 1536, 2048, 4097, 8191}) s.push_back(n);
  return s;
}

std::vector<float> randn(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));  // [n]
  for (auto& x : v) x = nd(rng);
  return v;
}

// Runs each test once per ISA build (isa_param.h).
class OpsTest : public kvtest::IsaTest {};

TEST_P(OpsTest, RmsNorm) {
  for (int64_t n : sizes()) {
    auto x = randn(n, static_cast<uint32_t>(n), 3.0f);
    const auto w = randn(n, static_cast<uint32_t>(n) + 7, 1.0f);
    for (const float* wp : {w.data(), static_cast<const float*>(nullptr)}) {
      std::vector<float> want(x.size()), got(x.size());  // [n]
      rms_norm_ref(x.data(), wp, want.data(), n, 1e-6f);
      rms_norm(x.data(), wp, got.data(), n, 1e-6f);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_NEAR(got[i], want[i], 2e-6 * std::fabs(want[i]) + 1e-30) << "n=" << n << " i=" << i;
      // In place (y aliases x) gives the same answer.
      std::vector<float> inplace = x;
      rms_norm(inplace.data(), wp, inplace.data(), n, 1e-6f);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(inplace[i], got[i]);
    }
  }
  // eps dominates an all-zero row: output zero, not NaN.
  std::vector<float> z(37, 0.0f), y(37, 1.0f);
  rms_norm(z.data(), nullptr, y.data(), 37, 1e-5f);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST_P(OpsTest, SiluMul) {
  for (int64_t n : sizes()) {
    auto g = randn(n, static_cast<uint32_t>(n) * 3, 4.0f);
    const auto u = randn(n, static_cast<uint32_t>(n) * 3 + 1, 1.0f);
    // Saturation regions, where exp over/underflows.
    const float extremes[] = {-200.0f, -90.0f, -88.0f, -30.0f, 0.0f, -0.0f, 1e-30f, 30.0f, 90.0f, 200.0f};
    for (int64_t i = 0; i < n && i < 10; ++i) g[static_cast<size_t>(i * 7 % n)] = extremes[i];
    std::vector<float> want(g.size()), got(g.size());  // [n]
    silu_mul_ref(g.data(), u.data(), want.data(), n);
    silu_mul(g.data(), u.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i)
      // Below 1e-30 an activation is zero for every purpose (exp saturates at g < -88).
      ASSERT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-30)
          << "n=" << n << " g=" << g[i] << " u=" << u[i];
    std::vector<float> inplace = g;  // y aliases gate
    silu_mul(inplace.data(), u.data(), inplace.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(inplace[i], got[i]);
  }
}

TEST_P(OpsTest, GeluMul) {
  constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
  for (int64_t n : sizes()) {
    auto g = randn(n, static_cast<uint32_t>(n) * 5, 3.0f);
    const auto u = randn(n, static_cast<uint32_t>(n) * 5 + 1, 1.0f);
    const float extremes[] = {-200.0f, -12.0f, -5.0f, 0.0f, 1e-30f, 5.0f, 12.0f, 200.0f};
    for (int64_t i = 0; i < n && i < 8; ++i) g[static_cast<size_t>(i * 5 % n)] = extremes[i];
    std::vector<float> want(g.size()), got(g.size());  // [n]
    gelu_mul_ref(g.data(), u.data(), want.data(), n);
    gelu_mul(g.data(), u.data(), got.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      // sigmoid(2z) for z < 0 has relative sensitivity |2z| to a relative error in z, and z is
      // formed in float: the bound grows with |z| (only where the output is already tiny).
      const double z = kSqrt2OverPi * g[i] * (1 + 0.044715 * g[i] * g[i]);
      const double tol = 1e-6 * (1 + 2 * std::fabs(z)) * std::fabs(want[i]) + 1e-30;
      ASSERT_NEAR(got[i], want[i], tol) << "n=" << n << " g=" << g[i] << " u=" << u[i];
    }
  }
}

TEST_P(OpsTest, Softmax) {
  for (int64_t n : sizes()) {
    for (float scale : {0.1f, 10.0f, 1000.0f}) {
      auto x = randn(n, static_cast<uint32_t>(n) * 11, scale);
      if (n > 3) x[2] = -std::numeric_limits<float>::infinity();  // a masked position
      std::vector<float> want = x, got = x;  // [n]
      const float lse_want = softmax_ref(want.data(), n);
      const float lse_got = softmax(got.data(), n);
      ASSERT_NEAR(lse_got, lse_want, 1e-6 * std::max(1.0f, std::fabs(lse_want)))
          << "n=" << n << " scale=" << scale;
      float max = -std::numeric_limits<float>::infinity();
      for (float v : x) max = std::max(max, v);
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        // x - max is formed in float: an absolute error of half an ulp of |x - max| becomes
        // that relative error in exp, so the bound grows with the distance from the max.
        const double dist = std::isinf(x[i]) ? 0.0 : std::fabs(double(x[i]) - max);
        const double tol = want[i] * (1e-6 + 1.2e-7 * dist);
        ASSERT_NEAR(got[i], want[i], tol + 1e-37) << "n=" << n << " i=" << i;
        sum += got[i];
      }
      ASSERT_NEAR(sum, 1.0, 1e-5);
      if (n > 3) {
        ASSERT_EQ(got[2], 0.0f);
      }
    }
  }
}

TEST_P(OpsTest, SoftmaxEdgeCases) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float one[1] = {-3.0f};
  EXPECT_EQ(softmax(one, 1), -3.0f);
  EXPECT_EQ(one[0], 1.0f);
  std::vector<float> masked(19, ninf);
  EXPECT_EQ(softmax(masked.data(), 19), ninf);
  for (float v : masked) EXPECT_EQ(v, 0.0f);
  std::vector<float> flat(33, 2.0f);
  EXPECT_NEAR(softmax(flat.data(), 33), 2.0f + std::log(33.0f), 1e-6);
  for (float v : flat) EXPECT_NEAR(v, 1.0f / 33, 1e-7);
}

struct RopeCase {
  int n_head, head_dim, n_rot;
  float base, scale;
};

TEST_P(OpsTest, RopeMatchesReference) {
  const RopeCase cases[] = {
      {9, 64, 64, 10000.0f, 1.0f},      // SmolLM2 Q
      {3, 64, 64, 10000.0f, 1.0f},      // SmolLM2 K
      {4, 256, 256, 1000000.0f, 1.0f},  // gemma-3 global layers
      {4, 256, 256, 10000.0f, 0.125f},  // freq_scale (linear position scaling)
      {5, 128, 64, 10000.0f, 1.0f},     // partial rotary: n_rot < head_dim
      {2, 80, 32, 500000.0f, 1.0f},
      {1, 2, 2, 10000.0f, 1.0f},
  };
  for (RopeStyle style : {RopeStyle::kNorm, RopeStyle::kNeox}) {
    for (const auto& c : cases) {
      for (int64_t pos : {0, 1, 2, 7, 100, 4095, 8000, 32767, 131071}) {
        const int64_t n = static_cast<int64_t>(c.n_head) * c.head_dim;
        const auto x = randn(n, static_cast<uint32_t>(pos + n), 1.0f);
        std::vector<float> want = x, got = x;  // [n_head, head_dim]
        rope_ref(want.data(), c.n_head, c.head_dim, c.n_rot, pos, c.base, c.scale, style);
        rope(got.data(), c.n_head, c.head_dim, c.n_rot, pos, c.base, c.scale, style);
        SCOPED_TRACE("style=" + std::to_string(int(style)) + " pos=" + std::to_string(pos) +
                     " head_dim=" + std::to_string(c.head_dim) + " n_rot=" + std::to_string(c.n_rot));
        for (int64_t i = 0; i < n; ++i) {
          const int d = static_cast<int>(i % c.head_dim);
          if (d >= c.n_rot || pos == 0) {
            ASSERT_EQ(got[i], x[i]) << "d=" << d;  // untouched tail; identity at pos 0
          } else {
            // Each output mixes two unit-scale inputs with float cos/sin (rounded from float64
            // angles): a few float ulps of the pair's magnitude.
            ASSERT_NEAR(got[i], want[i], 5e-7 * (std::fabs(x[i]) + 1.0)) << "d=" << d;
          }
        }
      }
    }
  }
}

TEST_P(OpsTest, RopeCacheFollowsArguments) {
  // Same position with different n_head (Q then K), then a new base, then a new position;
  // positions that share a slot of the per-position cache (1,024 apart), and a third
  // (n_rot, base) that pushes out one of the two tables kept: each must equal a fresh
  // reference, i.e. the cached angles never go stale.
  const struct { int n_head, n_rot; int64_t pos; float base; } seq[] = {
      {9, 64, 42, 10000.0f},        {3, 64, 42, 10000.0f},       {3, 64, 42, 500000.0f},
      {3, 32, 42, 500000.0f},       {3, 32, 43, 500000.0f},      {9, 64, 42, 10000.0f},
      {9, 64, 42 + 1024, 10000.0f}, {3, 64, 42, 10000.0f},       {3, 64, 42 + 2048, 10000.0f},
      {3, 64, 42, 1000000.0f},      {3, 64, 42, 500000.0f},      {3, 64, 42, 10000.0f},
      {3, 64, 42 + 1024, 1000000.0f}, {3, 64, 42, 1000000.0f},   {9, 64, 43, 10000.0f}};
  for (const auto& s : seq) {
    const auto x = randn(s.n_head * 64, 99, 1.0f);
    std::vector<float> want = x, got = x;  // [n_head, 64]
    rope_ref(want.data(), s.n_head, 64, s.n_rot, s.pos, s.base, 1.0f, RopeStyle::kNeox);
    rope(got.data(), s.n_head, 64, s.n_rot, s.pos, s.base, 1.0f, RopeStyle::kNeox);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-6) << i;
  }
}

TEST(OpsRef, RopeConventions) {
  // head_dim 4, n_rot 4, base 100: pair 0 turns by pos, pair 1 by pos·100^(-1/2) = pos/10.
  const double a0 = 3.0, a1 = 0.3;
  float x[4] = {1, 0, 0, 0};
  rope_ref(x, 1, 4, 4, 3, 100.0f, 1.0f, RopeStyle::kNorm);  // pairs (0,1), (2,3)
  EXPECT_NEAR(x[0], std::cos(a0), 1e-7);
  EXPECT_NEAR(x[1], std::sin(a0), 1e-7);
  float y[4] = {0, 0, 1, 0};
  rope_ref(y, 1, 4, 4, 3, 100.0f, 1.0f, RopeStyle::kNorm);
  EXPECT_NEAR(y[2], std::cos(a1), 1e-7);
  EXPECT_NEAR(y[3], std::sin(a1), 1e-7);
  float z[4] = {0, 1, 0, 0};
  rope_ref(z, 1, 4, 4, 3, 100.0f, 1.0f, RopeStyle::kNeox);  // pairs (0,2), (1,3)
  EXPECT_NEAR(z[1], std::cos(a1), 1e-7);
  EXPECT_NEAR(z[3], std::sin(a1), 1e-7);
  EXPECT_EQ(z[0], 0.0f);
  EXPECT_EQ(z[2], 0.0f);
}

TEST_P(OpsTest, AddInplace) {
  for (int64_t n : sizes()) {
    auto y = randn(n, 1, 1.0f);
    const auto x = randn(n, 2, 1.0f);
    const auto y0 = y;
    add_inplace(y.data(), x.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], y0[i] + x[i]);
  }
}

TEST_P(OpsTest, MaxValue) {
  for (int64_t n : sizes()) {
    auto x = randn(n, static_cast<uint32_t>(n) + 3, 4.0f);
    ASSERT_EQ(max_value(x.data(), n), max_value_ref(x.data(), n)) << n;
    x[static_cast<size_t>(n - 1)] = 1e9f;  // the max in the tail lane
    ASSERT_EQ(max_value(x.data(), n), 1e9f) << n;
  }
  EXPECT_EQ(max_value(nullptr, 0), -std::numeric_limits<float>::infinity());
  std::vector<float> x = {-std::numeric_limits<float>::infinity(), std::nanf(""), -3.f};
  EXPECT_EQ(max_value(x.data(), 3), -3.f);  // NaN ignored
}

TEST_P(OpsTest, ExpScaledBlockSums) {
  // Rows of a vocabulary's size and every tail, at the temperatures sampling uses.
  std::vector<int64_t> ns = sizes();
  for (int64_t n : {49152, 262144, 50001}) ns.push_back(n);
  for (int64_t n : ns)
    for (float scale : {1.0f, 1.f / 0.7f, 4.0f}) {
      auto x = randn(n, static_cast<uint32_t>(n) + 11, 3.0f);
      if (n > 5) x[3] = -std::numeric_limits<float>::infinity();  // a banned token
      const float mx = max_value_ref(x.data(), n);
      auto want = x, got = x;
      const int64_t nb = (n + kExpBlock - 1) / kExpBlock;
      std::vector<double> bw(nb), bg(nb);
      const double tw = exp_scaled_ref(want.data(), n, mx, scale, bw.data());
      const double tg = exp_scaled(got.data(), n, mx, scale, bg.data());
      // Float evaluation of the argument (x - mx)·scale costs ~|arg| ulps before exp does.
      for (int64_t i = 0; i < n; ++i) {
        if (want[i] == 0) {
          ASSERT_EQ(got[i], 0.f);
          continue;
        }
        const double arg = std::fabs((static_cast<double>(x[i]) - mx) * scale);
        ASSERT_NEAR(got[i], want[i], 2.5e-7 * (1 + arg) * want[i] + 1e-37) << "n=" << n << " i=" << i;
      }
      if (n > 5) {
        ASSERT_EQ(got[3], 0.f);
      }
      double sum = 0;
      for (int64_t b = 0; b < nb; ++b) {
        ASSERT_NEAR(bg[b], bw[b], 1e-5 * bw[b]) << "n=" << n << " block " << b;
        sum += bg[b];
      }
      ASSERT_EQ(tg, sum);  // the total is the block sums added in order
      ASSERT_NEAR(tg, tw, 1e-5 * tw);
      ASSERT_GE(tg, 1.0);  // the max maps to exactly 1
    }
}

TEST_P(OpsTest, CollectGe) {
  std::vector<int64_t> ns = sizes();
  ns.push_back(49152);
  std::vector<int32_t> got_idx, want_idx;
  for (int64_t n : ns)
    for (float t : {-1.f, 0.5f, 2.5f, 100.f}) {
      const auto x = randn(n, static_cast<uint32_t>(n) + 5, 1.5f);
      got_idx.assign(static_cast<size_t>(n) + 16, -1);
      want_idx.assign(static_cast<size_t>(n) + 16, -1);
      double got_mass = 0, want_mass = 0;
      const int64_t got = collect_ge(x.data(), n, t, got_idx.data(), &got_mass);
      const int64_t want = collect_ge_ref(x.data(), n, t, want_idx.data(), &want_mass);
      ASSERT_EQ(got, want) << "n=" << n << " t=" << t;
      for (int64_t i = 0; i < want; ++i) ASSERT_EQ(got_idx[i], want_idx[i]) << "n=" << n << " t=" << t;
      ASSERT_NEAR(got_mass, want_mass, 1e-6 * std::fabs(want_mass) + 1e-6);
    }
}

TEST_P(OpsTest, FirstGt) {
  for (int64_t n : sizes()) {
    const auto x = randn(n, static_cast<uint32_t>(n) + 9, 1.0f);
    for (float t : {-10.f, 0.f, 1.5f, 2.5f, 10.f})
      for (int64_t from : {int64_t(0), int64_t(1), n / 2, n - 1, n})
        ASSERT_EQ(first_gt(x.data(), from, n, t), first_gt_ref(x.data(), from, n, t)) << n << " " << t << " " << from;
  }
}

// Quest's 8-bit key summary: each mean within half a step of max|mean| / 127 and each variance
// within half a step of max var / 255; zeros stay zeros (a page of one key has no variance).
TEST(OpsRef, KeySummaryEncoding) {
  for (int hd : {8, 64, 256}) {
    const auto mean = randn(hd, hd + 1, 3.0f), sd = randn(hd, hd + 2, 1.0f);
    std::vector<float> var(hd), zero(hd, 0.f);
    for (int d = 0; d < hd; ++d) var[d] = sd[d] * sd[d];
    float amax = 0, vmax = 0;
    for (int d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(mean[d])), vmax = std::max(vmax, var[d]);
    std::vector<uint8_t> s(key_summary_bytes(hd));
    encode_key_summary(mean.data(), var.data(), hd, s.data());
    for (int d = 0; d < hd; ++d) {
      ASSERT_NEAR(key_summary_mean(s.data(), hd, d), mean[d], amax / 254 * 1.0001f) << hd << " " << d;
      ASSERT_NEAR(key_summary_var(s.data(), hd, d), var[d], vmax / 510 * 1.0001f) << hd << " " << d;
    }
    encode_key_summary(zero.data(), zero.data(), hd, s.data());
    for (int d = 0; d < hd; ++d) {
      ASSERT_EQ(key_summary_mean(s.data(), hd, d), 0.f);
      ASSERT_EQ(key_summary_var(s.data(), hd, d), 0.f);
    }
  }
}

// Quest's page score: the fast path equals the double reference to float rounding; a page of
// one key (variance 0) scores that key's q·k; the spread term scales with the keys' spread.
TEST_P(OpsTest, KeyScore) {
  constexpr int kPages = 13;  // page 1 holds a single key (variance 0); the fast path takes 8 pages at a time
  constexpr float kSpread = 1.766f;
  for (int hd : {8, 16, 40, 48, 64, 256, 320}) {  // vector widths, their tails, past the fast paths' 256
    for (int n_rows : {1, 2, 3, 4, 5, 7, 16}) {   // the fast path's row groups of 4 and their rests
      for (int n_heads : {1, 3})
      for (bool grid : {false, true}) {
        // grid: every q_d a whole multiple of its row's absmax/127, so that the kernel's int8
        // q is exact and only the variance term's quantization is left to the bound.
        auto qs = randn(int64_t(n_heads) * n_rows * hd, hd + n_rows + 1000 * n_heads, 1.0f);
        if (grid)
          for (int64_t r = 0; r < int64_t(n_heads) * n_rows; ++r) {
            float amax = 0;
            for (int d = 0; d < hd; ++d) amax = std::max(amax, std::fabs(qs[r * hd + d]));
            for (int d = 0; d < hd; ++d) qs[r * hd + d] = std::nearbyint(qs[r * hd + d] * 127.f / amax) * (amax / 127.f);
          }
        const int64_t sb = key_summary_bytes(hd);
        std::vector<uint8_t> stats(size_t(kPages) * n_heads * sb), wide(stats.size());
        std::vector<const uint8_t*> pages(kPages), wide_pages(kPages);
        for (int p = 0; p < kPages; ++p) {
          const int pp = (p * 3) % kPages;  // pages out of memory order
          for (int h = 0; h < n_heads; ++h) {
            const int salt = 100 * p + 10 * h;
            const auto a = randn(hd, hd * 7 + n_rows + salt, 2.0f), b = randn(hd, hd * 11 + n_rows + salt, 1.0f);
            std::vector<float> var(hd), var4(hd);
            for (int d = 0; d < hd; ++d) var[d] = p == 1 ? 0.f : b[d] * b[d], var4[d] = 4 * var[d];  // twice the sd
            encode_key_summary(a.data(), var.data(), hd, stats.data() + (size_t(pp) * n_heads + h) * sb);
            encode_key_summary(a.data(), var4.data(), hd, wide.data() + (size_t(pp) * n_heads + h) * sb);
          }
          pages[p] = stats.data() + size_t(pp) * n_heads * sb;
          wide_pages[p] = wide.data() + size_t(pp) * n_heads * sb;
        }
        std::vector<const float*> q_all(size_t(n_heads) * n_rows);
        for (size_t r = 0; r < q_all.size(); ++r) q_all[r] = qs.data() + int64_t(r) * hd;
        std::vector<float> got(size_t(kPages) * n_heads), want(got.size()), got_wide(got.size());
        key_score_pages(q_all.data(), n_rows, n_heads, pages.data(), kPages, hd, kSpread, got.data());
        key_score_pages_ref(q_all.data(), n_rows, n_heads, pages.data(), kPages, hd, kSpread, want.data());
        // The AVX-512 kernel quantizes the query rows (q to int8, q² to two 8-bit levels):
        // within half a step of each per channel. The bound, per entry, is the worst row's
        // |Σ_d mu_d·dq_d| + spread·|sqrt(s + ds) - sqrt(s)|; float paths are far inside it.
        for (int64_t i = 0; i < kPages; ++i)
          for (int h = 0; h < n_heads; ++h) {
            const uint8_t* sm = pages[i] + h * sb;
            double tol = 0;
            for (int r = 0; r < n_rows; ++r) {
              const float* qr = q_all[size_t(h) * n_rows + r];
              double amax = 0, q2max = 0, mu_abs = 0, var_sum = 0, s2 = 0;
              for (int d = 0; d < hd; ++d) {
                amax = std::max(amax, std::fabs(double(qr[d])));
                q2max = std::max(q2max, double(qr[d]) * qr[d]);
                mu_abs += std::fabs(key_summary_mean(sm, hd, d));
                var_sum += key_summary_var(sm, hd, d);
                s2 += double(qr[d]) * qr[d] * key_summary_var(sm, hd, d);
              }
              const double ds = q2max / (127.0 * 256.0) * var_sum;
              const double dsq = s2 > ds ? ds / std::sqrt(s2 - ds) : std::sqrt(2 * ds);
              tol = std::max(tol, mu_abs * amax / (grid ? 1e6 : 254.0) + kSpread * dsq);
            }
            const size_t k = size_t(i) * n_heads + h;
            ASSERT_NEAR(got[k], want[k], 1e-5 * (1 + std::fabs(want[k])) + tol) << hd << " " << n_rows << " " << grid << " " << k;
          }
        for (int h = 0; h < n_heads; ++h) {
          const float* const* q = q_all.data() + int64_t(h) * n_rows;
          double best = -1e30;  // page 1: one key, its mean
          for (int r = 0; r < n_rows; ++r) {
            double dot = 0;
            for (int d = 0; d < hd; ++d) dot += q[r][d] * double(key_summary_mean(pages[1] + h * sb, hd, d));
            best = std::max(best, dot);
          }
          ASSERT_NEAR(want[n_heads + h], best, 1e-5 * (1 + std::fabs(best)));
        }
        if (n_rows == 1) {  // one row: twice the standard deviation, twice the spread term
          key_score_pages_ref(q_all.data(), n_rows, n_heads, wide_pages.data(), kPages, hd, kSpread, got_wide.data());
          for (int h = 0; h < n_heads; ++h) {
            double mean = 0;
            for (int d = 0; d < hd; ++d) mean += q_all[h][d] * double(key_summary_mean(pages[0] + h * sb, hd, d));
            ASSERT_GT(want[h], mean);
            ASSERT_NEAR(got_wide[h] - mean, 2 * (want[h] - mean), 1e-2 * (1 + std::fabs(want[h] - mean)));
          }
        }
      }
    }
  }
}

KV_INSTANTIATE_FOR_EVERY_ISA(OpsTest);

}  // namespace
}  // namespace kv
