// The llama forward against the independent numpy oracle (tests/reference/llama_ref.py,
// float64, dequantized weights) on the real SmolLM2 file. Golden data from
// tests/reference/make_golden.py; format in tests/data/golden/README.md.
//
// Bars (issue #2): teacher-forced top-1 agreement ≥ 99% of positions; mean KL(oracle‖kvserve)
// under kMaxMeanKl; 32-token greedy continuations identical for ≥ 9 of 10 prompts.
//
// Why kMaxMeanKl = 1e-4 nats: kvserve quantizes every matmul input in two levels (an 8-bit
// block quantization plus an 8-bit quantization of its residual: ~15 bits, relative error
// ~2^-15 of the block range) and stores K/V in f16 (2^-11). Through 30 layers that moves logits
// by ~1e-3, and KL ≈ ½·Var_p(Δlogit) ≈ 1e-6 (measured: 1.1e-6). Single-level 8-bit activations,
// as llama.cpp uses, measure 3.9e-3 here, and real bugs (wrong RoPE, a dropped layer, an
// off-by-one causal mask) cost ≥ 0.1. The bound sits 100× above the measurement and 40× below
// the single-level regression.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/sampler.h"
#include "engine/sequence_runner.h"
#include "kernels/quant.h"
#include "model_fixture.h"

using namespace kv;
using nlohmann::json;

namespace {
constexpr double kMaxMeanKl = 1e-4;

std::string golden_root() { return std::string(KV_SOURCE_DIR) + "/tests/data/golden/"; }

json load_golden(const std::string& dir) {
  std::ifstream in(dir + "golden.json");
  if (!in) return json();
  return json::parse(in);
}

std::vector<double> log_softmax(const float* x, int n) {
  double mx = *std::max_element(x, x + n), s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(x[i]) - mx);
  double lz = mx + std::log(s);
  std::vector<double> out(n);
  for (int i = 0; i < n; ++i) out[i] = x[i] - lz;
  return out;
}

// Teacher-forced top-1 and KL over every golden prompt, then greedy continuations; the
// model's KV groups each get a pool (Gemma 3: global + sliding-window layers).
void run_golden(LlamaModel* m, const std::string& golden_dir, int min_prompts) {
  ASSERT_NE(m, nullptr);
  json g = load_golden(golden_dir);
  ASSERT_FALSE(g.is_null()) << "missing " << golden_dir << "golden.json";
  const int nv = m->config().n_vocab;
  ASSERT_EQ(g["model"]["vocab"].get<int>(), nv);

  // The oracle's full distributions at a few positions per prompt.
  std::ifstream dist_in(golden_dir + g["dist"]["file"].get<std::string>(), std::ios::binary);
  ASSERT_TRUE(dist_in) << "missing golden_dist";
  const auto& rows = g["dist"]["rows"];
  std::vector<uint16_t> dist(rows.size() * size_t(nv));
  dist_in.read(reinterpret_cast<char*>(dist.data()), static_cast<std::streamsize>(dist.size() * 2));
  ASSERT_TRUE(dist_in);

  ThreadPool tp(2);
  PagePool pool(m->kv_layout(16, KvDtype::kF16), 256);
  std::unique_ptr<PagePool> pool_g1;
  if (m->kv_groups().size() > 1) pool_g1 = std::make_unique<PagePool>(m->kv_layout(16, KvDtype::kF16, {}, 1), 256);
  int64_t n_pos = 0, n_agree = 0, n_greedy_ok = 0, n_prompts = 0;
  double kl_sum = 0;
  int n_kl = 0;
  for (const auto& p : g["prompts"]) {
    const std::string name = p["name"];
    std::vector<int32_t> toks = p["tokens"].get<std::vector<int32_t>>();
    std::vector<int32_t> top1 = p["top1"].get<std::vector<int32_t>>();
    std::vector<float> logits;
    {
      SequenceRunner seq(*m, pool, pool_g1.get(), tp, 64);
      Status st = seq.feed_all_logits(toks.data(), static_cast<int64_t>(toks.size()), &logits);
      ASSERT_TRUE(st.is_ok()) << st.message();
    }
    int agree = 0;
    for (size_t i = 0; i < toks.size(); ++i) agree += argmax(logits.data() + i * nv, nv) == top1[i];
    n_pos += static_cast<int64_t>(toks.size());
    n_agree += agree;
    for (int r : p["dist_rows"]) {
      const int pos = rows[r]["position"];
      std::vector<double> q = log_softmax(logits.data() + int64_t(pos) * nv, nv);
      const uint16_t* row = dist.data() + int64_t(r) * nv;
      double z = 0;
      for (int i = 0; i < nv; ++i) z += std::exp(double(fp16_to_fp32(row[i])));
      double kl = 0;
      for (int i = 0; i < nv; ++i) {
        double lp = double(fp16_to_fp32(row[i])) - std::log(z);
        kl += std::exp(lp) * (lp - q[i]);
      }
      kl_sum += kl;
      ++n_kl;
    }
    // Greedy continuation, 32 tokens.
    std::vector<int32_t> want = p["greedy"].get<std::vector<int32_t>>(), got;
    {
      SequenceRunner seq(*m, pool, pool_g1.get(), tp, 64);
      ASSERT_TRUE(seq.feed(toks.data(), static_cast<int64_t>(toks.size())).is_ok());
      for (size_t k = 0; k < want.size(); ++k) {
        int32_t id = argmax(seq.logits().data(), nv);
        got.push_back(id);
        if (k + 1 < want.size()) {
          ASSERT_TRUE(seq.feed(&id, 1).is_ok());
        }
      }
    }
    const bool same = got == want;
    n_greedy_ok += same;
    ++n_prompts;
    std::printf("  %-16s %4zu tokens  top-1 %5.1f%%  greedy %s\n", name.c_str(), toks.size(), 100.0 * agree / toks.size(),
                same ? "identical" : "DIFFERS");
  }
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
  if (pool_g1) {
    EXPECT_EQ(pool_g1->n_used(), 0);
    EXPECT_TRUE(pool_g1->check_integrity().is_ok());
  }
  const double agreement = double(n_agree) / n_pos, mean_kl = kl_sum / n_kl;
  std::printf("  overall: top-1 agreement %.2f%% over %lld positions, mean KL %.2e over %d rows, greedy %lld/%lld\n",
              100 * agreement, static_cast<long long>(n_pos), mean_kl, n_kl, static_cast<long long>(n_greedy_ok),
              static_cast<long long>(n_prompts));
  EXPECT_GE(n_prompts, min_prompts);
  EXPECT_GE(agreement, 0.99);
  EXPECT_LT(mean_kl, kMaxMeanKl);
  EXPECT_GE(n_greedy_ok, (9 * n_prompts + 9) / 10);  // ≥ 90% of prompts
}
}  // namespace

TEST(ModelGolden, TeacherForcedAgreementKlAndGreedy) { run_golden(kvtest::smollm2_model(), golden_root(), 10); }

// Gemma 3 against tests/reference/gemma3_ref.py (goldens: make_golden_gemma3.py), same bars.
// The 700-token prompt crosses the 512-token window: the sliding-window layers' pages slide.
TEST(ModelGolden, Gemma3TeacherForcedAgreementKlAndGreedy) {
  run_golden(kvtest::gemma3_model(), golden_root() + "gemma3/", 6);
}
