// KV size arithmetic (src/kv/kv_size.h): every preset pinned, plus the two local GGUFs.
#include "kv/kv_size.h"

#include <gtest/gtest.h>

#include <string>

#include "gguf/gguf.h"

namespace {

constexpr int64_t kGiB = int64_t(1) << 30;

kv::KvSizeReport size_of(const std::string& preset, int64_t seq, const std::string& dtype = "f16", int64_t batch = 1) {
  auto spec = kv::kv_size_preset(preset);
  EXPECT_TRUE(spec) << spec.message();
  auto d = kv::kv_size_dtype(dtype);
  EXPECT_TRUE(d) << d.message();
  kv::KvSizeOptions o;
  o.seq_len = seq;
  o.batch = batch;
  o.dtype = *d;
  auto r = kv::compute_kv_size(*spec, o);
  EXPECT_TRUE(r) << r.message();
  return *r;
}

int64_t seq_bytes(const std::string& preset, int64_t seq, const std::string& dtype = "f16") {
  auto r = size_of(preset, seq, dtype);
  EXPECT_EQ(r.bits_per_sequence % 8, 0);
  return r.bits_per_sequence / 8;
}

int64_t token_bytes(const std::string& preset, const std::string& dtype = "f16") {
  return size_of(preset, 1, dtype).bits_per_token / 8;
}

TEST(KvSize, Llama2_70bMhaWorkedExample) {
  // 2 (K,V) × 80 layers × 64 kv heads × 128 dims × 2 bytes × 4096 tokens = 10 GiB exactly.
  // One of the seeds prints half of this (5 GiB): it drops the factor 2 for K and V.
  EXPECT_EQ(seq_bytes("llama-2-70b", 4096), 10737418240);
  EXPECT_EQ(seq_bytes("llama-2-70b", 4096), 10 * kGiB);
  EXPECT_EQ(token_bytes("llama-2-70b"), 2621440);  // 2.5 MiB per token
  auto r = size_of("llama-2-70b", 4096);
  ASSERT_EQ(r.groups.size(), 1u);
  EXPECT_EQ(r.groups[0].bits_per_token_per_layer / 8, 32768);
  EXPECT_EQ(kv::kv_size_preset("llama-2-70b")->variant(), "MHA");
}

TEST(KvSize, Llama70bGqaIsOneEighth) {
  EXPECT_EQ(seq_bytes("llama-2-70b-gqa", 4096), 10737418240 / 8);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096), 10737418240 / 8);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096), 1342177280);
  EXPECT_EQ(token_bytes("llama-3-70b"), 327680);
  auto spec = *kv::kv_size_preset("llama-3-70b");
  EXPECT_EQ(spec.variant(), "GQA");
  EXPECT_EQ(spec.group_size(), 8);
}

TEST(KvSize, Llama7bMha) {
  EXPECT_EQ(token_bytes("llama-2-7b"), 524288);
  EXPECT_EQ(token_bytes("7b-mha"), 524288);  // alias
  EXPECT_EQ(seq_bytes("llama-2-7b", 4096), 2 * kGiB);
  EXPECT_EQ(seq_bytes("llama-2-7b", 32768), 16 * kGiB);
}

TEST(KvSize, DeepSeekV2Mla) {
  EXPECT_EQ(token_bytes("deepseek-v2"), 60 * 576 * 2);
  EXPECT_EQ(token_bytes("deepseek-v2"), 69120);
  EXPECT_EQ(seq_bytes("deepseek-v2", 4096), int64_t(60) * 576 * 2 * 4096);
  auto r = size_of("deepseek-v2", 4096);
  ASSERT_EQ(r.groups.size(), 1u);
  EXPECT_EQ(r.groups[0].group.kind, kv::KvGroupKind::kLatent);
  EXPECT_EQ(r.groups[0].values_per_token_per_layer, 576);
  EXPECT_EQ(kv::kv_size_preset("deepseek-v2")->variant(), "MLA");
}

TEST(KvSize, Gemma3_27bHybrid) {
  // 62 layers: 10 global ((il + 1) % 6 == 0) + 52 local keeping min(seq, 1024) tokens.
  const int64_t per_token_layer = 2 * 16 * 128 * 2;  // 8,192 bytes
  auto r = size_of("gemma-3-27b", 32768);
  ASSERT_EQ(r.groups.size(), 2u);
  int64_t local = 0, global = 0;
  for (const auto& g : r.groups) {
    if (g.group.kind == kv::KvGroupKind::kLocal) {
      local = g.group.n_layers;
      EXPECT_EQ(g.group.window, 1024);
      EXPECT_EQ(g.tokens_kept, 1024);
    } else {
      global = g.group.n_layers;
      EXPECT_EQ(g.tokens_kept, 32768);
    }
  }
  EXPECT_EQ(local, 52);
  EXPECT_EQ(global, 10);
  EXPECT_EQ(r.bits_per_sequence / 8, per_token_layer * (10 * 32768 + 52 * 1024));
  EXPECT_EQ(r.bits_per_sequence / 8, 3120562176);
  EXPECT_EQ(r.bits_per_token / 8, per_token_layer * 62);
  // Below the window every layer keeps every token.
  EXPECT_EQ(seq_bytes("gemma-3-27b", 512), per_token_layer * 62 * 512);
  auto spec = *kv::kv_size_preset("gemma-3-27b");
  EXPECT_EQ(spec.variant(), "hybrid");
  EXPECT_EQ(spec.group_size(), 2);
}

TEST(KvSize, LocalModelPresets) {
  EXPECT_EQ(token_bytes("smollm2-135m"), 23040);
  EXPECT_EQ(seq_bytes("smollm2-135m", 4096), int64_t(23040) * 4096);
  // Gemma 3 270M: 18 layers = 3 global + 15 local (window 512), 1 kv head of 256.
  const int64_t ptl = 2 * 1 * 256 * 2;
  EXPECT_EQ(token_bytes("gemma-3-270m"), ptl * 18);
  EXPECT_EQ(seq_bytes("gemma-3-270m", 4096), ptl * (3 * 4096 + 15 * 512));
  EXPECT_EQ(kv::kv_size_preset("gemma-3-270m")->variant(), "hybrid");
  EXPECT_EQ(kv::kv_size_preset("gemma-3-270m")->group_size(), 4);
}

TEST(KvSize, DtypesAndBatch) {
  const int64_t f16 = seq_bytes("llama-3-70b", 4096, "f16");
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "f32"), 2 * f16);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "bf16"), f16);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "fp8_e4m3"), f16 / 2);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "fp8_e5m2"), f16 / 2);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "int8"), f16 / 2);
  EXPECT_EQ(seq_bytes("llama-3-70b", 4096, "int4"), seq_bytes("llama-3-70b", 4096, "int8") / 2);
  EXPECT_EQ(seq_bytes("deepseek-v2", 4096, "int4"), seq_bytes("deepseek-v2", 4096, "int8") / 2);
  auto r = size_of("gemma-3-27b", 32768, "f16", 8);
  EXPECT_EQ(r.bits_per_batch, 8 * r.bits_per_sequence);
  for (const auto& g : r.groups) EXPECT_EQ(g.bits_per_batch, 8 * g.bits_per_sequence);
}

TEST(KvSize, HalfByteStaysExact) {
  kv::KvSizeSpec s;
  s.name = "odd";
  s.n_head = 1;
  kv::KvLayerGroupSpec g;  // K dim 1, V dim 2 (K and V head dims may differ): 3 values per token
  g.n_layers = 1;
  g.n_head_kv = 1;
  g.k_dim = 1;
  g.v_dim = 2;
  s.groups = {g};
  kv::KvSizeOptions o;
  o.seq_len = 1;
  o.dtype = *kv::kv_size_dtype("int4");
  auto r = kv::compute_kv_size(s, o);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->bits_per_token, 12);  // 1.5 bytes
  EXPECT_EQ(kv::format_kv_bits(12), "1.5 bytes");
}

TEST(KvSize, ScalesAreOptInForQuantizedDtypes) {
  auto spec = *kv::kv_size_preset("llama-3-70b");
  kv::KvSizeOptions o;
  o.seq_len = 1;
  o.dtype = *kv::kv_size_dtype("int8");
  o.scale_group = 32;  // one f16 scale per 32 elements: 128 dims -> 4 scales per row
  auto r = *kv::compute_kv_size(spec, o);
  const int64_t elems = int64_t(80) * 8 * 256;
  EXPECT_EQ(r.bits_per_token, elems * 8 + int64_t(80) * 8 * 2 * 4 * 16);
  EXPECT_EQ(r.scale_bits_per_sequence, int64_t(80) * 8 * 2 * 4 * 16);
  o.dtype = *kv::kv_size_dtype("f16");  // not quantized: no scales
  EXPECT_EQ(kv::compute_kv_size(spec, o)->bits_per_token, elems * 16);
}

TEST(KvSize, FormattingUsesBinaryPrefixes) {
  EXPECT_EQ(kv::group_thousands(10737418240), "10,737,418,240");
  EXPECT_EQ(kv::format_kv_bits(int64_t(10737418240) * 8), "10,737,418,240 bytes (10.00 GiB)");
  EXPECT_EQ(kv::format_kv_bits(int64_t(23040) * 8), "23,040 bytes (22.50 KiB)");
  EXPECT_EQ(kv::format_kv_bits(512 * 8), "512 bytes");
}

TEST(KvSize, Errors) {
  EXPECT_FALSE(kv::kv_size_preset("llama-9000b"));
  EXPECT_FALSE(kv::kv_size_dtype("q3_k"));
  EXPECT_FALSE(kv::kv_size_dtype("q4"));  // the engine refuses it too (parse_kv_dtype): one set of names
  EXPECT_EQ(kv::kv_size_dtype("FP8")->name, "fp8_e4m3");
  auto spec = *kv::kv_size_preset("llama-2-7b");
  kv::KvSizeOptions o;
  o.seq_len = 0;
  EXPECT_FALSE(kv::compute_kv_size(spec, o));
  o.seq_len = int64_t(1) << 40;
  o.batch = int64_t(1) << 30;
  auto r = kv::compute_kv_size(spec, o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("overflow"), std::string::npos);
}

std::string model_path(const char* name) { return std::string(KV_SOURCE_DIR) + "/models/" + name; }

TEST(KvSize, SmolLM2Gguf) {
  auto f = kv::GgufFile::open(model_path("SmolLM2-135M-Instruct.Q4_1.gguf"));
  if (!f) GTEST_SKIP() << "model missing: " << f.message();
  auto spec = kv::kv_size_spec_from_gguf(**f);
  ASSERT_TRUE(spec) << spec.message();
  EXPECT_EQ(spec->variant(), "GQA");
  EXPECT_EQ(spec->group_size(), 3);
  EXPECT_EQ(spec->n_layers(), 30);
  kv::KvSizeOptions o;
  o.seq_len = 4096;
  auto r = *kv::compute_kv_size(*spec, o);
  EXPECT_EQ(r.bits_per_token / 8, 23040);
  auto preset = *kv::compute_kv_size(*kv::kv_size_preset("smollm2-135m"), o);
  EXPECT_EQ(r.bits_per_sequence, preset.bits_per_sequence);
}

TEST(KvSize, Gemma3_270mGguf) {
  auto f = kv::GgufFile::open(model_path("gemma-3-270m-Q4_K_M.gguf"));
  if (!f) GTEST_SKIP() << "model missing: " << f.message();
  auto spec = kv::kv_size_spec_from_gguf(**f);
  ASSERT_TRUE(spec) << spec.message();
  EXPECT_EQ(spec->variant(), "hybrid");
  EXPECT_EQ(spec->n_layers(), 18);
  ASSERT_EQ(spec->groups.size(), 2u);
  EXPECT_EQ(spec->groups[0].kind, kv::KvGroupKind::kGlobal);
  EXPECT_EQ(spec->groups[0].n_layers, 3);
  EXPECT_EQ(spec->groups[1].kind, kv::KvGroupKind::kLocal);
  EXPECT_EQ(spec->groups[1].n_layers, 15);
  EXPECT_EQ(spec->groups[1].window, 512);
  EXPECT_EQ(spec->groups[1].n_head_kv, 1);
  EXPECT_EQ(spec->groups[1].k_dim, 256);
  kv::KvSizeOptions o;
  o.seq_len = 32768;
  auto r = *kv::compute_kv_size(*spec, o);
  EXPECT_EQ(r.bits_per_sequence / 8, int64_t(1024) * (3 * 32768 + 15 * 512));
  auto preset = *kv::compute_kv_size(*kv::kv_size_preset("gemma-3-270m"), o);
  EXPECT_EQ(r.bits_per_sequence, preset.bits_per_sequence);
}

}  // namespace
