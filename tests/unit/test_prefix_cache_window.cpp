// PrefixCache with a sliding-window layer group (hybrid models such as Gemma 3): beside each
// cached position's global page, the window pool's page of that position, or a tombstone. A
// prefix is usable only when the window pages its next query reads are present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kv/prefix_cache.h"

using namespace kv;

namespace {
constexpr int32_t kBs = 4;
constexpr int32_t kWindow = 8;  // a query at p sees (p - 8, p]: its own page and the one before, or three pages

KvLayout tiny_layout() {
  KvLayout l;
  l.n_layer = 1;
  l.n_head_kv = 1;
  l.head_dim = 2;
  l.block_size = kBs;
  l.dtype = KvDtype::kF16;
  return l;
}

// A request as the engine drives it: one reference per block-table entry in each pool; window
// pages before the window are released (-1), as Engine::slide does.
struct Req {
  Req() = default;
  Req(std::string n, std::vector<int32_t> t) : ns(std::move(n)), tokens(std::move(t)) {}
  std::string ns;
  std::vector<int32_t> tokens;
  std::vector<int32_t> pages;   // [ceil(n / kBs)]
  std::vector<int32_t> wpages;  // [same], -1: slid out
  std::vector<PrefixHandle> pins;
  int64_t n_cached = 0;
};

struct Fixture {
  PagePool pool;
  PagePool wpool;
  uint64_t t = 0;
  PrefixCache cache;
  Fixture(int32_t n_pages, int32_t n_wpages)
      : pool(tiny_layout(), n_pages), wpool(tiny_layout(), n_wpages), cache(pool, 7, 1, [this] { return t; }, WindowGroup{&wpool, kWindow}) {}

  bool admit(Req* r) {
    const int64_t n = static_cast<int64_t>(r->tokens.size());
    PrefixMatch m = cache.match(r->ns, r->tokens.data(), n);
    EXPECT_EQ(m.window_pages.size(), m.pages.size());
    const int32_t need = BlockTable::pages_for(n, kBs) - static_cast<int32_t>(m.pages.size());
    cache.pin(m.handle);
    for (int32_t p : m.pages) pool.retain(p);
    for (int32_t p : m.window_pages)
      if (p >= 0) wpool.retain(p);
    const bool ok = (pool.can_allocate(need) || cache.ensure_free(need)) && (wpool.can_allocate(need) || cache.ensure_free_window(need));
    if (!ok) {
      cache.unpin(m.handle);
      for (int32_t p : m.pages) pool.release(p);
      for (int32_t p : m.window_pages)
        if (p >= 0) wpool.release(p);
      return false;
    }
    r->pages = m.pages;
    r->wpages = m.window_pages;
    EXPECT_TRUE(pool.allocate(need, &r->pages));
    EXPECT_TRUE(wpool.allocate(need, &r->wpages));
    r->pins.push_back(m.handle);
    r->n_cached = m.n_tokens;
    return true;
  }
  // The window slides past every page a query at position n no longer sees.
  void slide(Req* r, int64_t n) {
    const int64_t first = std::max<int64_t>(0, n - kWindow + 1) / kBs;
    for (int64_t k = 0; k < std::min<int64_t>(first, static_cast<int64_t>(r->wpages.size())); ++k)
      if (r->wpages[k] >= 0) {
        wpool.release(r->wpages[k]);
        r->wpages[k] = -1;
      }
  }
  PrefixInsert insert(Req* r) {
    return cache.insert(r->ns, r->tokens.data(), static_cast<int64_t>(r->tokens.size()), r->pages.data(), r->wpages.data());
  }
  void finish(Req* r) {
    insert(r);
    for (const PrefixHandle& h : r->pins) cache.unpin(h);
    for (int32_t p : r->pages) pool.release(p);
    for (int32_t p : r->wpages)
      if (p >= 0) wpool.release(p);
    *r = Req{};
  }
  void check(const std::vector<Req*>& running = {}) {
    ASSERT_TRUE(pool.check_integrity().is_ok());
    ASSERT_TRUE(wpool.check_integrity().is_ok());
    std::vector<int32_t> held(pool.n_pages(), 0), wheld(wpool.n_pages(), 0);
    for (const Req* r : running) {
      for (int32_t p : r->pages) ++held[p];
      for (int32_t p : r->wpages)
        if (p >= 0) ++wheld[p];
    }
    Status s = cache.check_integrity(held, wheld);
    ASSERT_TRUE(s.is_ok()) << s.message();
  }
};

std::vector<int32_t> seq(int32_t first, int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}
}  // namespace

TEST(PrefixCacheWindow, FirstWindowPageArithmetic) {
  PagePool pool(tiny_layout(), 4), wpool(tiny_layout(), 4);
  PrefixCache c(pool, 1, 1, nullptr, WindowGroup{&wpool, kWindow});
  // next query at 4P sees keys (4P - 8, 4P]: from position 4P - 7, in page (4P - 7) / 4
  EXPECT_EQ(c.window_first_page(0), 0);
  EXPECT_EQ(c.window_first_page(1), 0);
  EXPECT_EQ(c.window_first_page(2), 0);  // query 8 sees 1..8
  EXPECT_EQ(c.window_first_page(3), 1);  // query 12 sees 5..12
  EXPECT_EQ(c.window_first_page(6), 4);  // query 24 sees 17..24
}

TEST(PrefixCacheWindow, AMatchNeedsItsLastWindowAndTombstonesRefill) {
  Fixture f(32, 32);
  // a: 6 full pages + a tail; by the end its window slid past pages 0..3 (held: 4, 5, tail)
  Req a{"", seq(100, 6 * kBs + 1)};
  ASSERT_TRUE(f.admit(&a));
  f.slide(&a, 6 * kBs + 1);
  EXPECT_EQ(a.wpages[3], -1);
  EXPECT_GE(a.wpages[4], 0);
  const std::vector<int32_t> a_w = a.wpages;
  f.finish(&a);
  EXPECT_EQ(f.cache.n_cached_pages(), 6);
  EXPECT_EQ(f.cache.n_cached_window_pages(), 2);  // only what a still held
  EXPECT_EQ(f.wpool.n_used(), 2);
  f.check();

  // The whole history again plus a new turn: its window (pages 4, 5) is there.
  Req b{"", seq(100, 6 * kBs + 3)};
  ASSERT_TRUE(f.admit(&b));
  EXPECT_EQ(b.n_cached, 6 * kBs);
  EXPECT_EQ(std::vector<int32_t>(b.wpages.begin(), b.wpages.begin() + 6), (std::vector<int32_t>{-1, -1, -1, -1, a_w[4], a_w[5]}));
  f.check({&b});
  f.finish(&b);

  // Diverging after page 3: its window (pages 2, 3) is gone, and so is every shorter one's.
  std::vector<int32_t> ct = seq(100, 4 * kBs);
  ct.push_back(5);
  ct.push_back(6);
  Req c{"", ct};
  EXPECT_EQ(f.cache.match_length("", ct.data(), static_cast<int64_t>(ct.size())), 0);
  ASSERT_TRUE(f.admit(&c));
  EXPECT_EQ(c.n_cached, 0);
  // c computed everything and still holds every window page: its insert refills 0..3
  f.finish(&c);
  EXPECT_EQ(f.cache.n_cached_window_pages(), 6);
  EXPECT_EQ(f.cache.match_length("", ct.data(), static_cast<int64_t>(ct.size())), 4 * kBs);
  // a prefix ending at page 5 still reads a's pages 4, 5
  Req d{"", seq(100, 6 * kBs + 2)};
  ASSERT_TRUE(f.admit(&d));
  EXPECT_EQ(d.n_cached, 6 * kBs);
  EXPECT_EQ(d.wpages[5], a_w[5]);
  f.check({&d});
  f.finish(&d);
  f.check();
}

TEST(PrefixCacheWindow, WindowEvictionKeepsLastWindowsAndSkipsHeldPages) {
  Fixture f(32, 12);
  Req a{"", seq(0, 4 * kBs + 1)};  // 4 full pages: 4 window pages cached
  ASSERT_TRUE(f.admit(&a));
  f.finish(&a);
  f.t = 10;
  Req b{"", seq(1000, 4 * kBs + 1)};
  ASSERT_TRUE(f.admit(&b));
  f.finish(&b);
  EXPECT_EQ(f.cache.n_cached_window_pages(), 8);
  EXPECT_EQ(f.wpool.n_free(), 4);
  EXPECT_EQ(f.cache.n_evictable_window_pages(), 8);
  f.t = 20;
  // c reuses a's prefix (window pages 2, 3): those become held and cannot be freed by eviction
  std::vector<int32_t> ct = seq(0, 4 * kBs);
  ct.push_back(77);
  Req c{"", ct};
  ASSERT_TRUE(f.admit(&c));
  EXPECT_EQ(c.n_cached, 4 * kBs);
  EXPECT_EQ(f.cache.n_evictable_window_pages(), 6);
  f.check({&c});
  // 7 free wanted, 3 are: first the pages no match ending at a node end reads (pages 0, 1 of
  // both edges: a match ending at page 4 reads pages 2, 3), b's first (least recently used).
  ASSERT_EQ(f.wpool.n_free(), 3);
  EXPECT_TRUE(f.cache.ensure_free_window(7));
  EXPECT_EQ(f.cache.n_cached_window_pages(), 4);
  std::vector<int32_t> bt = seq(1000, 4 * kBs + 1);
  EXPECT_EQ(f.cache.match_length("", bt.data(), static_cast<int64_t>(bt.size())), 4 * kBs);  // b's last window stays
  f.check({&c});
  // More than can be freed: b's last window goes too; c's held pages stay.
  EXPECT_FALSE(f.cache.ensure_free_window(12));
  EXPECT_EQ(f.cache.n_cached_window_pages(), 2);
  EXPECT_EQ(f.cache.n_evictable_window_pages(), 0);
  EXPECT_EQ(f.cache.match_length("", bt.data(), static_cast<int64_t>(bt.size())), 0);
  EXPECT_EQ(f.cache.n_cached_pages(), 8);  // the global pages stay: a later insert can refill the window
  f.check({&c});
  // c's prefix still matches: its window pages are there.
  EXPECT_EQ(f.cache.match_length("", ct.data(), static_cast<int64_t>(ct.size())), 4 * kBs);
  f.finish(&c);
  // Global eviction takes the window pages of the positions it drops.
  f.cache.evict(f.pool.n_pages());
  EXPECT_EQ(f.cache.n_cached_window_pages(), 0);
  EXPECT_EQ(f.wpool.n_used(), 0);
  EXPECT_EQ(f.pool.n_used(), 0);
  f.check();
}

// Random admissions, slides, eager inserts, finishes and evictions of both kinds: the tree stays
// whole, every reference in both pools is accounted for, and a hit returns pages (global and
// window) whose content is exactly what the request would have computed.
TEST(PrefixCacheWindow, IntegrityUnderRandomOperations) {
  Fixture f(64, 40);
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> stems;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> s(1 + rng() % (4 * kBs));
    for (auto& x : s) x = static_cast<int32_t>(rng() % 4);
    stems.push_back(s);
  }
  std::map<int32_t, std::string> content, wcontent;
  auto content_of = [&](const std::string& ns, const std::vector<int32_t>& tokens, int64_t page) {
    std::string s = ns + '|';
    for (int64_t i = 0; i < (page + 1) * kBs; ++i) s += std::to_string(tokens[i]) + ',';
    return s;
  };
  std::vector<Req> running;
  running.reserve(64);
  int64_t n_hits = 0, n_rejected = 0;
  auto check_all = [&] {
    std::vector<Req*> rs;
    for (Req& r : running) rs.push_back(&r);
    f.check(rs);
  };
  for (int step = 0; step < 5000; ++step) {
    f.t += 1 + rng() % 3;
    const int op = static_cast<int>(rng() % 12);
    if (op < 4 || running.empty()) {
      Req r;
      r.ns = rng() % 3 == 0 ? "x" : "";
      r.tokens = stems[rng() % stems.size()];
      const int32_t extra = static_cast<int32_t>(rng() % (5 * kBs));
      for (int32_t i = 0; i < extra; ++i) r.tokens.push_back(static_cast<int32_t>(rng() % 3));
      if (rng() % 3 == 0 && !running.empty()) {  // a follow-up turn
        const Req& prev = running[rng() % running.size()];
        r.ns = prev.ns;
        std::vector<int32_t> t = prev.tokens;
        t.insert(t.end(), r.tokens.begin(), r.tokens.end());
        r.tokens = t;
      }
      if (r.tokens.size() > 14 * kBs) r.tokens.resize(14 * kBs);
      const int64_t n = static_cast<int64_t>(r.tokens.size());
      const int64_t peek = f.cache.match_length(r.ns, r.tokens.data(), n);
      if (!f.admit(&r)) {
        ++n_rejected;
      } else {
        ASSERT_EQ(r.n_cached, peek);
        const int64_t P = r.n_cached / kBs;
        for (int64_t k = 0; k < P; ++k) {
          ASSERT_EQ(content[r.pages[k]], content_of(r.ns, r.tokens, k)) << "step " << step;
          if (k >= f.cache.window_first_page(P)) {
            ASSERT_GE(r.wpages[k], 0) << "step " << step << ": a window page of the match is missing";
            ASSERT_EQ(wcontent[r.wpages[k]], content_of(r.ns, r.tokens, k)) << "step " << step;
          } else {
            ASSERT_EQ(r.wpages[k], -1);
          }
        }
        for (int64_t k = P; k < static_cast<int64_t>(r.pages.size()); ++k) {
          content[r.pages[k]] = wcontent[r.wpages[k]] = k < n / kBs ? content_of(r.ns, r.tokens, k) : "tail";
        }
        n_hits += P > 0;
        if (rng() % 2) f.slide(&r, n);
        running.push_back(std::move(r));
      }
    } else if (op < 7) {
      const size_t i = rng() % running.size();
      f.finish(&running[i]);
      running.erase(running.begin() + static_cast<int64_t>(i));
    } else if (op < 8) {
      Req& r = running[rng() % running.size()];
      PrefixInsert ins = f.insert(&r);
      f.cache.pin(ins.handle);
      r.pins.push_back(ins.handle);
    } else if (op < 10) {
      const int32_t target = std::min(f.pool.n_pages(), f.pool.n_free() + static_cast<int32_t>(rng() % 6));
      f.cache.ensure_free(target);
    } else {
      const int32_t evictable = f.cache.n_evictable_window_pages();
      const int32_t free_before = f.wpool.n_free();
      const int32_t target = std::min(f.wpool.n_pages(), free_before + static_cast<int32_t>(rng() % 6));
      ASSERT_EQ(f.cache.ensure_free_window(target), free_before + evictable >= target);
    }
    check_all();
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(n_hits, 200);
  EXPECT_GT(n_rejected, 10);
  EXPECT_GT(f.cache.stats().evicted_window_pages, 100);
  while (!running.empty()) {
    f.finish(&running.back());
    running.pop_back();
  }
  check_all();
  EXPECT_EQ(f.wpool.n_used(), f.cache.n_cached_window_pages());
  f.cache.evict(f.pool.n_pages());
  EXPECT_EQ(f.pool.n_used(), 0);
  EXPECT_EQ(f.wpool.n_used(), 0);
  check_all();
  std::printf("window random ops: %lld hits, %lld rejected, %lld window pages evicted\n", (long long)n_hits, (long long)n_rejected,
              (long long)f.cache.stats().evicted_window_pages);
}
