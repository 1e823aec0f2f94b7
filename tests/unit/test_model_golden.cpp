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

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// ctest's golden_isa_<isa> entries run these tests with KV_ISA forcing one ISA build
// (CMakeLists.txt); on a CPU without it, detect_isa() falls back (with a warning), and the run
// would only repeat the default one: skip instead.
bool forced_isa_missing() {
  const char* e = std::getenv("KV_ISA");
  return e && *e && std::strcmp(e, isa_name(detect_isa())) != 0;
}

// n greedy tokens after the prompt (one SequenceRunner, f16 KV).
std::vector<int32_t> greedy(LlamaModel& m, PagePool& pool, PagePool* pool_g1, ThreadPool& tp,
                            const std::vector<int32_t>& prompt, size_t n) {
  const int nv = m.config().n_vocab;
  std::vector<int32_t> got;
  SequenceRunner seq(m, pool, pool_g1, tp, 64);
  EXPECT_TRUE(seq.feed(prompt.data(), static_cast<int64_t>(prompt.size())).is_ok());
  for (size_t k = 0; k < n; ++k) {
    int32_t id = argmax(seq.logits().data(), nv);
    got.push_back(id);
    if (k + 1 < n) {
      EXPECT_TRUE(seq.feed(&id, 1).is_ok());
    }
  }
  return got;
}

// Teacher-forced top-1 and KL over every golden prompt, then greedy continuations; the
// model's KV groups each get a pool (Gemma 3: global + sliding-window layers).
void run_golden(LlamaModel* m, const std::string& golden_dir, int min_prompts) {
  if (forced_isa_missing()) GTEST_SKIP() << "KV_ISA=" << std::getenv("KV_ISA") << ": not on this CPU";
  ASSERT_NE(m, nullptr);
  std::printf("  kernels: %s\n", isa_name(kernel_isa()));
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
    const std::vector<int32_t> want = p["greedy"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = greedy(*m, pool, pool_g1.get(), tp, toks, want.size());
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

// One binary for every x86-64 CPU (issue 17): ctest's golden_isa_<isa> entries run this test and
// the MLA golden with KV_ISA forcing each ISA build (CMakeLists.txt), so every build's tokens are
// compared with the oracle's, hence with each other's. Short, for the scalar build (10-20x slower):
// two prompts, 16 greedy tokens each, chosen because their greedy paths keep the top two logits
// ≥ 0.03 apart on every build measured. (prose_short, for one, meets a near tie at its 8th token:
// 1.3e-4 apart on the scalar build, 1.0e-3 on AVX2; any change of float summation order may flip it.)
TEST(ModelGolden, ShortGreedyAsTheOracleOnTheForcedIsa) {
  if (forced_isa_missing()) GTEST_SKIP() << "KV_ISA=" << std::getenv("KV_ISA") << ": not on this CPU";
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_NE(m, nullptr);
  json g = load_golden(golden_root());
  ASSERT_FALSE(g.is_null());
  std::printf("  kernels: %s\n", isa_name(kernel_isa()));
  constexpr size_t kTokens = 16;
  ThreadPool tp(2);
  PagePool pool(m->kv_layout(16, KvDtype::kF16), 32);
  int n = 0;
  for (const auto& p : g["prompts"]) {
    const std::string name = p["name"];
    if (name != "numbers_primes" && name != "chat_single") continue;
    std::vector<int32_t> want = p["greedy"].get<std::vector<int32_t>>();
    want.resize(kTokens);
    EXPECT_EQ(greedy(*m, pool, nullptr, tp, p["tokens"].get<std::vector<int32_t>>(), kTokens), want) << name;
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_EQ(pool.n_used(), 0);
}

// ---- MLA (deepseek2) against tests/reference/mla_ref.py (goldens: make_golden_mla.py), same
// bars. The model is not committed: it is generated (deterministically) by
// tests/reference/make_mla_model.py and checked against the golden's digests first. The
// prompts are token ids (the generated GGUF's gpt2 tokenizer is never needed here).
namespace {

std::string run_capture(const std::string& cmd) {
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// Generates the MLA test model into a temp file, checks it is the golden's model, runs the golden.
// layout "legacy" (one attn_kv_b, old GGUFs) holds the same W_UK / W_UV as "split", rearranged:
// same golden, no digest check (the digests are of the split file).
void run_mla_golden(const std::string& subdir, int q_lora_rank, const std::string& layout = "split") {
  if (forced_isa_missing()) GTEST_SKIP() << "KV_ISA=" << std::getenv("KV_ISA") << ": not on this CPU";
  const std::string dir = golden_root() + "mla/" + subdir;
  json g = load_golden(dir);
  ASSERT_FALSE(g.is_null()) << "missing " << dir << "golden.json";
  ASSERT_EQ(g["model"]["q_lora_rank"].get<int>(), q_lora_rank);
  const std::string src = KV_SOURCE_DIR;
  const std::string path = ::testing::TempDir() + "kvserve_mla_" + layout + "_q" + std::to_string(q_lora_rank) + "_" +
                           std::to_string(::getpid()) + ".gguf";
  const std::string gen = "python3 " + src + "/tests/reference/make_mla_model.py '" + path + "' --q-lora-rank " +
                          std::to_string(q_lora_rank) + " --layout " + layout + " 2>/dev/null";
  ASSERT_EQ(std::system(gen.c_str()), 0) << "failed: " << gen << " (python3 with numpy and gguf is required)";
  struct Rm {
    std::string p;
    ~Rm() { std::remove(p.c_str()); }
  } rm{path};
  // The file's sha256 depends on the gguf writer's version; the weights digest does not.
  const std::string sha = layout == "split" ? run_capture("sha256sum '" + path + "' | cut -d' ' -f1") : "";
  if (layout == "split" && sha != g["model"]["sha256"].get<std::string>()) {
    const std::string wsha = run_capture("cd '" + src + "/tests/reference' && python3 -c \"import make_mla_model as m; "
                                         "print(m.weights_digest_of_file('" + path + "'))\"");
    ASSERT_EQ(wsha, g["model"]["weights_sha256"].get<std::string>()) << "generated MLA model differs from the golden's";
    std::printf("  (file sha256 differs from the golden's — another gguf writer — but the weights digest matches)\n");
  }
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.message();
  auto m = LlamaModel::load(**f, detect_isa());
  ASSERT_TRUE(m) << m.message();
  const ModelConfig& c = (*m)->config();
  EXPECT_TRUE(c.mla);
  EXPECT_EQ(c.n_head_kv, 1);
  EXPECT_EQ(c.head_dim, 80);
  EXPECT_EQ(c.q_lora_rank, q_lora_rank);
  EXPECT_EQ(c.mla_legacy, layout == "legacy");
  const KvLayout l = (*m)->kv_layout(16, KvDtype::kF16);
  EXPECT_EQ(l.v_from_k, 64);
  EXPECT_EQ(l.v_layer_page_bytes(0), 0);
  EXPECT_DOUBLE_EQ(l.bytes_per_token(), 4.0 * (64 + 16) * 2);  // latent + rope key, f16, 4 layers
  run_golden(m->get(), dir, 6);
}

}  // namespace

TEST(ModelGolden, MlaTeacherForcedAgreementKlAndGreedy) { run_mla_golden("", 0); }
TEST(ModelGolden, MlaQueryLoraTeacherForcedAgreementKlAndGreedy) { run_mla_golden("q_lora/", 96); }
TEST(ModelGolden, MlaLegacyKvBLayoutTeacherForcedAgreementKlAndGreedy) { run_mla_golden("", 0, "legacy"); }

// Quantized latent pages (staged: f16 while a page fills, quantized when full): chunking a
// prompt differently gives bit-identical logits, and int8 stays close to f16.
TEST(ModelGolden, MlaQuantizedLatentPagesAreChunkInvariant) {
  const std::string path = ::testing::TempDir() + "kvserve_mla_chunks_" + std::to_string(::getpid()) + ".gguf";
  ASSERT_EQ(std::system(("python3 " + std::string(KV_SOURCE_DIR) + "/tests/reference/make_mla_model.py '" + path +
                         "' 2>/dev/null").c_str()), 0);
  struct Rm {
    std::string p;
    ~Rm() { std::remove(p.c_str()); }
  } rm{path};
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.message();
  auto m = LlamaModel::load(**f, detect_isa());
  ASSERT_TRUE(m) << m.message();
  std::vector<int32_t> toks(200);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>((i * 7919 + 13) % 511);
  ThreadPool tp(2);
  const int nv = (*m)->config().n_vocab;
  auto run = [&](KvDtype dt, int chunk) {
    PagePool pool((*m)->kv_layout(16, dt), 64);
    SequenceRunner seq(**m, pool, tp, chunk);
    EXPECT_TRUE(seq.feed(toks.data(), static_cast<int64_t>(toks.size())).is_ok());
    std::vector<float> out = seq.logits();
    int32_t id = argmax(out.data(), nv);
    EXPECT_TRUE(seq.feed(&id, 1).is_ok());  // one decode step on top
    out.insert(out.end(), seq.logits().begin(), seq.logits().end());
    return out;
  };
  const std::vector<float> base = run(KvDtype::kF16, 512);
  for (KvDtype dt : {KvDtype::kInt8, KvDtype::kInt4, KvDtype::kFp8E4M3}) {
    const std::vector<float> a = run(dt, 512), b = run(dt, 13);
    EXPECT_EQ(a, b) << kv_dtype_name(dt) << ": chunking changed the logits";
    if (dt == KvDtype::kInt8) {
      double worst = 0, scale = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        worst = std::max(worst, double(std::abs(a[i] - base[i])));
        scale = std::max(scale, double(std::abs(base[i])));
      }
      EXPECT_LT(worst / scale, 0.05) << "int8 latent pages far from f16";
    }
  }
}
