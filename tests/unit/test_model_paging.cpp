// Paging and chunking do not change results: the same tokens through block sizes 1, 16, 32
// and prefill chunks of 1, 7, 64 and 512 give the same logits within float tolerance, and
// every page returns to the pool.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/sequence_runner.h"
#include "model_fixture.h"

using namespace kv;

namespace {
std::vector<float> run(LlamaModel& m, ThreadPool& tp, int block_size, int chunk, KvDtype dtype,
                       const std::vector<int32_t>& toks) {
  PagePool pool(m.kv_layout(block_size, dtype), 4096 / block_size + 8);
  std::vector<float> out;
  {
    SequenceRunner seq(m, pool, tp, chunk);
    Status st = seq.feed(toks.data(), static_cast<int64_t>(toks.size()));
    EXPECT_TRUE(st.is_ok()) << st.message();
    out = seq.logits();
  }
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::abs(a[i] - b[i])));
  return d;
}
}  // namespace

TEST(ModelPaging, BlockSizesAndChunksAgree) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_NE(m, nullptr);
  ThreadPool tp(2);
  std::vector<int32_t> toks(300);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<int32_t>(200 + (i * 7919) % 40000);
  const auto base = run(*m, tp, 16, 512, KvDtype::kF32, toks);
  ASSERT_EQ(base.size(), static_cast<size_t>(m->config().n_vocab));
  for (int bs : {1, 16, 32})
    for (int chunk : {1, 7, 64, 512}) {
      if (bs == 16 && chunk == 512) continue;
      // Logits are O(10); chunking changes only float summation order inside attention.
      EXPECT_LT(max_abs_diff(run(*m, tp, bs, chunk, KvDtype::kF32, toks), base), 2e-3) << "bs=" << bs << " chunk=" << chunk;
    }
}

TEST(ModelPaging, KvCacheFullIsAnErrorNotACrash) {
  LlamaModel* m = kvtest::smollm2_model();
  ASSERT_NE(m, nullptr);
  ThreadPool tp(1);
  PagePool pool(m->kv_layout(16, KvDtype::kF16), 2);  // 32 positions
  SequenceRunner seq(*m, pool, tp, 64);
  std::vector<int32_t> toks(40, 300);
  Status st = seq.feed(toks.data(), 40);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("KV cache full"), std::string::npos);
  EXPECT_EQ(pool.n_used(), 0);
}
