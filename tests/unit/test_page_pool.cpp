#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "kv/page_pool.h"

using namespace kv;

namespace {
KvLayout small_layout() {
  KvLayout l;
  l.n_layer = 2;
  l.n_head_kv = 3;
  l.head_dim = 8;
  l.block_size = 4;
  l.dtype = KvDtype::kF16;
  return l;
}
}  // namespace

TEST(PagePool, BytesPerTokenFormula) {
  KvLayout l;
  l.n_layer = 30;
  l.n_head_kv = 3;
  l.head_dim = 64;
  l.dtype = KvDtype::kF16;
  EXPECT_EQ(l.bytes_per_token(), 23040);  // SmolLM2-135M: 2 × 30 × 3 × 64 × 2
  l.block_size = 16;
  EXPECT_EQ(l.page_bytes(), 23040 * 16);
  EXPECT_EQ(PagePool::pages_for_bytes(l, 23040 * 16 * 10 + 5), 10);
}

TEST(PagePool, AllocateReleaseAndFailureChangesNothing) {
  PagePool pool(small_layout(), 5);
  std::vector<int32_t> got;
  ASSERT_TRUE(pool.allocate(3, &got));
  EXPECT_EQ(pool.n_used(), 3);
  std::vector<int32_t> more;
  EXPECT_FALSE(pool.allocate(3, &more));  // only 2 free
  EXPECT_TRUE(more.empty());
  EXPECT_EQ(pool.n_free(), 2);
  pool.retain(got[0]);
  pool.release(got[0]);
  EXPECT_EQ(pool.refcount(got[0]), 1);
  for (int32_t p : got) pool.release(p);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
}

TEST(PagePool, PagesAreDisjointTiles) {
  PagePool pool(small_layout(), 4);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.allocate(4, &pages));
  const int64_t bytes = pool.layout().k_layer_page_bytes(0);
  for (int layer = 0; layer < 2; ++layer)
    for (int32_t p : pages) {
      std::memset(pool.k_data(layer, p), 0x10 + layer * 4 + p, bytes);
      std::memset(pool.v_data(layer, p), 0x80 + layer * 4 + p, bytes);
    }
  for (int layer = 0; layer < 2; ++layer)
    for (int32_t p : pages) {
      EXPECT_EQ(pool.k_data(layer, p)[0], 0x10 + layer * 4 + p);
      EXPECT_EQ(pool.k_data(layer, p)[bytes - 1], 0x10 + layer * 4 + p);
      EXPECT_EQ(pool.v_data(layer, p)[bytes - 1], 0x80 + layer * 4 + p);
    }
  for (int32_t p : pages) pool.release(p);
}

TEST(PagePool, IntegrityHoldsUnderRandomOperations) {
  PagePool pool(small_layout(), 64);
  std::mt19937 rng(7);
  std::vector<BlockTable> seqs(8);
  for (int step = 0; step < 5000; ++step) {
    BlockTable& t = seqs[rng() % seqs.size()];
    int op = rng() % 3;
    if (op == 0) {
      int n = 1 + rng() % 6;
      if (pool.can_allocate(n)) {
        ASSERT_TRUE(pool.allocate(n, &t.pages));
      }
    } else if (op == 1) {
      t.release_all(pool);
    } else if (!t.pages.empty()) {
      // share a page with another table (fork) — refcounts must follow
      BlockTable& u = seqs[rng() % seqs.size()];
      if (&u != &t) {
        pool.retain(t.pages[0]);
        u.pages.push_back(t.pages[0]);
      }
    }
    ASSERT_TRUE(pool.check_integrity().is_ok()) << pool.check_integrity().message();
  }
  for (auto& t : seqs) t.release_all(pool);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
}

namespace {
KvLayout staged_layout() {
  KvLayout l;
  l.n_layer = 3;
  l.n_head_kv = 2;
  l.head_dim = 32;
  l.block_size = 16;
  l.dtype = KvDtype::kInt8;
  l.layer_dtypes = {KvDtype::kF16, KvDtype::kInt8, KvDtype::kInt4};
  return l;
}
void token(int seed, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
}
}  // namespace

TEST(PagePool, DtypeParsingAndPerLayerOverrides) {
  EXPECT_EQ(*parse_kv_dtype("auto"), KvDtype::kF16);
  EXPECT_EQ(*parse_kv_dtype("fp8"), KvDtype::kFp8E4M3);
  for (const char* n : {"f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"})
    EXPECT_STREQ(kv_dtype_name(*parse_kv_dtype(n)), n);
  EXPECT_FALSE(parse_kv_dtype("int3").is_ok());
  // Other spellings, any case; llama.cpp's block formats are not ours and say so.
  EXPECT_EQ(*parse_kv_dtype("FP16"), KvDtype::kF16);
  EXPECT_EQ(*parse_kv_dtype("bfloat16"), KvDtype::kBF16);
  EXPECT_EQ(*parse_kv_dtype("e5m2"), KvDtype::kFp8E5M2);
  EXPECT_EQ(*parse_kv_dtype("i4"), KvDtype::kInt4);
  for (const char* n : {"q4", "q8", "q8_0", "q4_0"}) {
    auto r = parse_kv_dtype(n);
    ASSERT_FALSE(r.is_ok()) << n;
    EXPECT_NE(r.message().find("llama.cpp's"), std::string::npos) << r.message();
  }
  auto l = parse_kv_dtype_layers("0-1:f16,28-29:f16", 30, KvDtype::kInt4);
  ASSERT_TRUE(l.is_ok());
  for (int i = 0; i < 30; ++i) EXPECT_EQ((*l)[i], (i < 2 || i >= 28) ? KvDtype::kF16 : KvDtype::kInt4) << i;
  for (const char* bad : {"0-1", "0-1:q9", "a-b:f16", "5-2:f16", "0-30:f16", "-1:f16", "3x:f16", "0:int4,0:int8", "0-3:f16,2:int8"})
    EXPECT_FALSE(parse_kv_dtype_layers(bad, 30, KvDtype::kInt4).is_ok()) << bad;
  // each says what is wrong: a reversed range is not "outside" the model, a layer named twice
  EXPECT_NE(parse_kv_dtype_layers("5-2:int8", 30, KvDtype::kF16).message().find("run backwards"), std::string::npos);
  EXPECT_NE(parse_kv_dtype_layers("0:int4,0:int8", 30, KvDtype::kF16).message().find("layer 0 is named twice"), std::string::npos);
  KvLayout lay;
  lay.n_layer = 30;
  lay.n_head_kv = 3;
  lay.head_dim = 64;
  lay.dtype = KvDtype::kInt4;
  lay.layer_dtypes = *l;
  EXPECT_EQ(lay.describe(), "int4 (0-1:f16,28-29:f16)");
  EXPECT_TRUE(lay.validate().is_ok());
  lay.block_size = 8;
  EXPECT_FALSE(lay.validate().is_ok());  // quantized pages need a multiple of 16 slots
}

TEST(PagePool, QuantizedBytesPerToken) {
  KvLayout l;
  l.n_layer = 30;
  l.n_head_kv = 3;
  l.head_dim = 64;
  l.block_size = 16;
  l.dtype = KvDtype::kInt8;
  // per head and page: K 1024 + 64·4, V 1024 + 16·4 → 2368 B per 16 tokens
  EXPECT_DOUBLE_EQ(l.bytes_per_token(), 30 * 3 * 2368 / 16.0);
  l.dtype = KvDtype::kInt4;
  // K 512 + 256, V 512 + 16·2·4 → 1408
  EXPECT_DOUBLE_EQ(l.bytes_per_token(), 30 * 3 * 1408 / 16.0);
  for (KvDtype fp8 : {KvDtype::kFp8E4M3, KvDtype::kFp8E5M2}) {
    l.dtype = fp8;
    // K 1024 + 4 (scale) + 64·2 (f16 zero per channel) = 1156, V 1024 + 4 = 1028 → 2184
    EXPECT_DOUBLE_EQ(l.bytes_per_token(), 30 * 3 * 2184 / 16.0);  // 12,285
  }
}

// A filling page lives in staging; the last slot quantizes it and frees the slot; copy-on-write
// of a partly filled page copies its staging; releasing frees everything.
TEST(PagePool, StagingFollowsTheFillingPage) {
  PagePool pool(staged_layout(), 8, 2);
  EXPECT_EQ(pool.n_staging(), 2);
  EXPECT_EQ(pool.stage_store_bytes(), 2 * pool.layout().stage_layer_bytes() * 2);  // 2 staged layers
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.allocate(3, &pages));
  std::vector<float> k(64), v(64);
  for (int slot = 0; slot < 5; ++slot) {
    token(slot, k, v);
    for (int l = 0; l < 3; ++l) ASSERT_TRUE(pool.write_token(l, pages[0], slot, k.data(), v.data()));
  }
  EXPECT_EQ(pool.stage_of(0, pages[0]), -1);  // f16 layer: written in place
  EXPECT_GE(pool.stage_of(1, pages[0]), 0);
  EXPECT_GE(pool.stage_of(2, pages[0]), 0);
  EXPECT_EQ(pool.n_staging_used(), 2);
  ASSERT_TRUE(pool.check_integrity().is_ok());
  // copy-on-write of the partly filled page
  ASSERT_TRUE(pool.copy_page(pages[0], pages[1]));
  EXPECT_EQ(pool.n_staging_used(), 4);
  EXPECT_NE(pool.stage_of(1, pages[1]), pool.stage_of(1, pages[0]));
  // staging exhausted: a third partly filled page cannot be staged; nothing changes
  EXPECT_FALSE(pool.write_token(1, pages[2], 0, k.data(), v.data()));
  EXPECT_FALSE(pool.copy_page(pages[0], pages[2]));
  ASSERT_TRUE(pool.check_integrity().is_ok());
  // fill page 1 to the end: quantized, staging back
  for (int slot = 5; slot < 16; ++slot) {
    token(slot, k, v);
    for (int l = 0; l < 3; ++l) ASSERT_TRUE(pool.write_token(l, pages[1], slot, k.data(), v.data()));
  }
  EXPECT_GE(pool.stage_of(1, pages[1]), 0);  // filled: staging kept until the layer's attention ran
  pool.release_filled(1);
  pool.release_filled(2);
  EXPECT_EQ(pool.stage_of(1, pages[1]), -1);
  EXPECT_EQ(pool.n_staging_used(), 2);
  // its quantized contents decode close to what was written (slot 3 of layer 1, head 1)
  std::vector<float> rk(16 * 32);
  kv_read_k(pool.k_data(1, pages[1]) + kv_k_tile_bytes(KvElem::kInt8, 16, 32), KvElem::kInt8, 16, 32, 16, rk.data());
  token(3, k, v);
  for (int d = 0; d < 32; ++d) EXPECT_NEAR(rk[3 * 32 + d], k[32 + d], 0.05f) << d;
  // rewriting a slot inside the quantized page brings it back to staging with its old slots
  token(99, k, v);
  ASSERT_TRUE(pool.write_token(1, pages[1], 7, k.data(), v.data()));
  EXPECT_GE(pool.stage_of(1, pages[1]), 0);
  for (int32_t p : pages) pool.release(p);
  EXPECT_EQ(pool.n_used(), 0);
  EXPECT_EQ(pool.n_staging_used(), 0);
  EXPECT_TRUE(pool.check_integrity().is_ok());
}

TEST(PagePool, PagesForBytesLeavesRoomForStaging) {
  KvLayout l = staged_layout();
  const int64_t page = l.page_bytes(), stage = 2 * l.stage_layer_bytes();
  EXPECT_EQ(PagePool::pages_for_bytes(l, 10 * page + 4 * stage, 4), 10);
  EXPECT_EQ(PagePool::pages_for_bytes(l, 10 * page + 4 * stage - 1, 4), 9);
  PagePool pool(l, 10, 4);
  EXPECT_EQ(pool.total_bytes(), 10 * page + 4 * stage);
}
