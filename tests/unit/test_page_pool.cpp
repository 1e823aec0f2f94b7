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
  const int64_t bytes = pool.layout().layer_page_bytes();
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
