// The router's pure routing policy (router/affinity.h): affinity keys, the consistent-hash
// ring, and the choice between the prefix's owner and the least loaded backend.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <random>
#include <vector>

#include "router/affinity.h"
#include "router/router.h"

namespace kv {
namespace {

std::vector<int32_t> tokens(int32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 49152);
  return t;
}

TEST(RouterAffinity, KeyCoversTheFirstFullPagesOnly) {
  std::vector<int32_t> a = tokens(300, 1), b = a;
  b[200] = 7;  // differs after the first 8 pages of 16
  EXPECT_EQ(affinity_key("", a.data(), 300, 16, 8), affinity_key("", b.data(), 300, 16, 8));
  b[127] = a[127] + 1;  // differs inside them
  EXPECT_NE(affinity_key("", a.data(), 300, 16, 8), affinity_key("", b.data(), 300, 16, 8));
  // A partial last page is not part of the key: 40 tokens key on 2 full pages.
  std::vector<int32_t> c = a;
  c[35] = a[35] + 1;
  EXPECT_EQ(affinity_key("", a.data(), 40, 16, 8), affinity_key("", c.data(), 40, 16, 8));
  c[31] = a[31] + 1;
  EXPECT_NE(affinity_key("", a.data(), 40, 16, 8), affinity_key("", c.data(), 40, 16, 8));
  // No full page: all tokens.
  EXPECT_NE(affinity_key("", a.data(), 10, 16, 8), affinity_key("", a.data(), 11, 16, 8));
  // Namespaces never share a key.
  EXPECT_NE(affinity_key("t1", a.data(), 300, 16, 8), affinity_key("t2", a.data(), 300, 16, 8));
  EXPECT_NE(affinity_key("ab", a.data(), 300, 16, 8), affinity_key("a", a.data(), 300, 16, 8));
}

TEST(RouterAffinity, RingSpreadsKeysEvenlyAndOrdersEveryBackendOnce) {
  HashRing ring(4);
  std::map<int32_t, int> owned;
  std::mt19937_64 rng(3);
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> o = ring.order(rng());
    ASSERT_EQ(o.size(), 4u);
    EXPECT_EQ(std::set<int32_t>(o.begin(), o.end()).size(), 4u);
    ++owned[o[0]];
  }
  // 160 virtual nodes each: every share within 25% of a quarter (a fixed seed; measured ±8%).
  for (int b = 0; b < 4; ++b) EXPECT_NEAR(owned[b], n / 4, n / 16) << b;
}

TEST(RouterAffinity, ADownBackendHandsOnlyItsOwnKeysOnAndGetsThemBack) {
  HashRing ring(3);
  const std::vector<int32_t> load(3, 0);
  std::mt19937_64 rng(5);
  int moved = 0, owned_by_1 = 0;
  for (int i = 0; i < 5000; ++i) {
    const uint64_t k = rng();
    const RouteChoice all = choose_backend(ring, k, {true, true, true}, load, 1.25);
    const RouteChoice without1 = choose_backend(ring, k, {true, false, true}, load, 1.25);
    EXPECT_TRUE(all.owner);
    EXPECT_EQ(all.why, RouteChoice::Why::kOwner);
    if (all.backend == 1) {
      ++owned_by_1;
      EXPECT_NE(without1.backend, 1);
      EXPECT_EQ(without1.backend, ring.order(k)[1]);  // the next on the ring
      EXPECT_EQ(without1.why, RouteChoice::Why::kOwnerDown);
      EXPECT_FALSE(without1.owner);
    } else {
      moved += without1.backend != all.backend;
    }
  }
  EXPECT_GT(owned_by_1, 1000);
  EXPECT_EQ(moved, 0);  // nobody else's keys move
}

TEST(RouterAffinity, TheOwnerLosesRequestsOnlyAboveItsBoundedLoad) {
  HashRing ring(2);
  const uint64_t k = 12345;
  const int32_t owner = ring.order(k)[0], other = 1 - owner;
  auto pick = [&](int32_t lo, int32_t lt) {
    std::vector<int32_t> load(2);
    load[owner] = lo;
    load[other] = lt;
    return choose_backend(ring, k, {true, true}, load, 1.25);
  };
  // capacity = ceil(1.25 × (in flight + 1) / 2)
  EXPECT_EQ(pick(0, 0).backend, owner);  // capacity 1
  EXPECT_EQ(pick(1, 0).backend, owner);  // capacity 2
  const RouteChoice c = pick(2, 0);      // capacity 2: the owner is full
  EXPECT_EQ(c.backend, other);
  EXPECT_EQ(c.why, RouteChoice::Why::kOwnerBusy);
  EXPECT_FALSE(c.owner);
  EXPECT_EQ(pick(4, 4).backend, owner);  // capacity 6
  EXPECT_EQ(pick(5, 3).backend, owner);
  EXPECT_EQ(pick(6, 2).backend, other);
  EXPECT_EQ(pick(6, 2).why, RouteChoice::Why::kOwnerBusy);
  // Whatever the loads, no live backend goes past 1.25 × the average + 1 (random loads, 4 backends).
  HashRing r4(4);
  std::mt19937_64 rng(9);
  for (int i = 0; i < 2000; ++i) {
    std::vector<int32_t> load(4);
    int64_t total = 0;
    for (auto& x : load) total += (x = static_cast<int32_t>(rng() % 12));
    const RouteChoice rc = choose_backend(r4, rng(), {true, true, true, true}, load, 1.25);
    ASSERT_GE(rc.backend, 0);
    EXPECT_LT(load[rc.backend], std::ceil(1.25 * double(total + 1) / 4.0));
  }
  // Nobody up, or everybody tried: -1.
  EXPECT_EQ(choose_backend(ring, k, {false, false}, {0, 0}, 1.25).backend, -1);
  EXPECT_EQ(choose_backend(ring, k, {true, true}, {0, 0}, 1.25, {0, 1}).backend, -1);
  EXPECT_EQ(choose_backend(ring, k, {true, true}, {0, 0}, 1.25, {owner}).backend, other);
}

TEST(RouterCacheAware, NewPrefixesSplitEvenlyAndStayWhereTheyWent) {
  // Eight tenants on two backends, seen one at a time with nothing in flight: 4 and 4, where a
  // hash may split them 2 / 6. Later requests go where each tenant went first.
  HashRing ring(2);
  PrefixMap map(2);
  const std::vector<bool> up{true, true};
  std::map<uint64_t, int32_t> first;
  for (uint64_t t = 1; t <= 8; ++t) {
    const RouteChoice c = map.choose(ring, t * 0x9E3779B97F4A7C15ull, up, {0, 0}, 1.25, 0);
    EXPECT_EQ(c.why, RouteChoice::Why::kNew);
    EXPECT_FALSE(c.owner);
    first[t] = c.backend;
  }
  EXPECT_EQ(map.keys_on(0), 4);
  EXPECT_EQ(map.keys_on(1), 4);
  EXPECT_EQ(map.size(), 8u);
  std::mt19937 rng(4);
  for (int i = 0; i < 200; ++i) {
    const uint64_t t = 1 + rng() % 8;
    const RouteChoice c = map.choose(ring, t * 0x9E3779B97F4A7C15ull, up, {1, 1}, 1.25, 0);
    EXPECT_EQ(c.backend, first[t]);
    EXPECT_TRUE(c.owner);
    EXPECT_EQ(c.why, RouteChoice::Why::kOwner);
  }
  // A new key goes to the least loaded backend, whatever the key counts.
  EXPECT_EQ(map.choose(ring, 999, up, {3, 1}, 1.25, 0).backend, 1);
  EXPECT_EQ(map.choose(ring, 1000, up, {1, 3}, 1.25, 0).backend, 0);
}

TEST(RouterCacheAware, ABusyOwnerLendsOneRequestADownOwnerLosesTheKey) {
  HashRing ring(2);
  PrefixMap map(2);
  const uint64_t k = 77;
  const int32_t owner = map.choose(ring, k, {true, true}, {0, 0}, 1.25, 0).backend;
  const int32_t other = 1 - owner;
  std::vector<int32_t> busy(2);
  busy[owner] = 6;
  busy[other] = 2;  // capacity ceil(1.25 × 9 / 2) = 6: the owner is full
  RouteChoice c = map.choose(ring, k, {true, true}, busy, 1.25, 0);
  EXPECT_EQ(c.backend, other);
  EXPECT_EQ(c.why, RouteChoice::Why::kOwnerBusy);
  // The key stayed with its owner.
  c = map.choose(ring, k, {true, true}, {0, 0}, 1.25, 0);
  EXPECT_EQ(c.backend, owner);
  EXPECT_EQ(c.why, RouteChoice::Why::kOwner);
  // Down (or tried already): the key moves, and stays moved when the owner is back.
  std::vector<bool> up(2, true);
  up[owner] = false;
  c = map.choose(ring, k, up, {0, 0}, 1.25, 0);
  EXPECT_EQ(c.backend, other);
  EXPECT_EQ(c.why, RouteChoice::Why::kOwnerDown);
  EXPECT_EQ(map.keys_on(owner), 0);
  EXPECT_EQ(map.keys_on(other), 1);
  c = map.choose(ring, k, {true, true}, {0, 0}, 1.25, 0);
  EXPECT_EQ(c.backend, other);
  EXPECT_TRUE(c.owner);
  c = map.choose(ring, k, {true, true}, {0, 0}, 1.25, 0, {other});
  EXPECT_EQ(c.backend, owner);
  EXPECT_EQ(c.why, RouteChoice::Why::kOwnerDown);
  // Nobody up, or everybody tried: -1, and nothing is remembered for a new key.
  EXPECT_EQ(map.choose(ring, 5, {false, false}, {0, 0}, 1.25, 0).backend, -1);
  EXPECT_EQ(map.choose(ring, 5, {true, true}, {0, 0}, 1.25, 0, {0, 1}).backend, -1);
  EXPECT_EQ(map.size(), 1u);
  // One live backend takes everything, whatever its load.
  EXPECT_EQ(map.choose(ring, k, {true, false}, {50, 0}, 1.25, 0).backend, 0);
}

TEST(RouterCacheAware, TheOwnerKeepsItsPrefixUntilItIsFarAhead) {
  // balance_abs 4: over capacity is not enough, the owner must also be 4 requests ahead of the
  // least loaded backend before one of its requests goes elsewhere.
  HashRing ring(2);
  PrefixMap map(2);
  const uint64_t k = 5;
  const int32_t owner = map.choose(ring, k, {true, true}, {0, 0}, 1.25, 4).backend;
  auto pick = [&](int32_t lo, int32_t lt) {
    std::vector<int32_t> load(2);
    load[owner] = lo;
    load[1 - owner] = lt;
    return map.choose(ring, k, {true, true}, load, 1.25, 4);
  };
  // capacity = ceil(1.25 × (in flight + 1) / 2)
  EXPECT_EQ(pick(5, 2).backend, owner);  // capacity 5: over it, but only 3 ahead
  EXPECT_EQ(pick(5, 2).why, RouteChoice::Why::kOwner);
  EXPECT_EQ(pick(6, 2).backend, 1 - owner);  // capacity 6: over it and 4 ahead
  EXPECT_EQ(pick(6, 2).why, RouteChoice::Why::kOwnerBusy);
  EXPECT_EQ(pick(9, 6).backend, owner);  // capacity 10: under it
  EXPECT_EQ(pick(20, 2).backend, 1 - owner);
  // Without the threshold (0): bounded loads alone, as the ring's.
  EXPECT_EQ(map.choose(ring, k, {true, true}, owner == 0 ? std::vector<int32_t>{5, 2} : std::vector<int32_t>{2, 5}, 1.25, 0).why,
            RouteChoice::Why::kOwnerBusy);
  EXPECT_EQ(pick(20, 10).why, RouteChoice::Why::kOwnerBusy);
}

TEST(RouterCacheAware, ForgetsTheLeastRecentlyUsedKeyWhenFull) {
  HashRing ring(3);
  PrefixMap map(3, 4);
  const std::vector<bool> up{true, true, true};
  const std::vector<int32_t> idle{0, 0, 0};
  std::map<uint64_t, int32_t> at;
  for (uint64_t k = 1; k <= 4; ++k) at[k] = map.choose(ring, k, up, idle, 1.25, 0).backend;
  EXPECT_EQ(map.choose(ring, 1, up, idle, 1.25, 0).why, RouteChoice::Why::kOwner);  // 1 is now the most recent
  EXPECT_EQ(map.choose(ring, 5, up, idle, 1.25, 0).why, RouteChoice::Why::kNew);    // forgets 2
  EXPECT_EQ(map.size(), 4u);
  EXPECT_EQ(map.keys_on(0) + map.keys_on(1) + map.keys_on(2), 4);
  EXPECT_EQ(map.choose(ring, 2, up, idle, 1.25, 0).why, RouteChoice::Why::kNew);    // forgets 3
  for (uint64_t k : {1, 4}) {
    const RouteChoice c = map.choose(ring, k, up, idle, 1.25, 0);
    EXPECT_EQ(c.why, RouteChoice::Why::kOwner) << k;
    EXPECT_EQ(c.backend, at[k]) << k;
  }
  EXPECT_EQ(map.choose(ring, 3, up, idle, 1.25, 0).why, RouteChoice::Why::kNew);
  // Random traffic keeps the counts equal to what is remembered.
  PrefixMap m(3, 50);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 5000; ++i) {
    std::vector<bool> u{rng() % 8 != 0, rng() % 8 != 0, true};
    std::vector<int32_t> load{int32_t(rng() % 5), int32_t(rng() % 5), int32_t(rng() % 5)};
    const RouteChoice c = m.choose(ring, rng() % 120, u, load, 1.25, 0);
    ASSERT_GE(c.backend, 0);
    ASSERT_TRUE(u[c.backend]);
    ASSERT_LE(m.size(), 50u);
    ASSERT_EQ(size_t(m.keys_on(0) + m.keys_on(1) + m.keys_on(2)), m.size());
  }
}

TEST(RouterAffinity, BackendUrls) {
  auto a = parse_backend_url("http://127.0.0.1:8081");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->first, "127.0.0.1");
  EXPECT_EQ(a->second, 8081);
  auto b = parse_backend_url("localhost:9000/");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->first, "localhost");
  auto c = parse_backend_url("http://[::1]:80");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->first, "::1");
  EXPECT_FALSE(parse_backend_url("https://x:1"));
  EXPECT_FALSE(parse_backend_url("http://x"));
  EXPECT_FALSE(parse_backend_url("http://x:0"));
  EXPECT_FALSE(parse_backend_url("http://x:99999"));
  EXPECT_FALSE(parse_backend_url("http://x:8a"));
  auto path = parse_backend_url("http://127.0.0.1:8081/v1");  // said "bad port"
  ASSERT_FALSE(path);
  EXPECT_NE(path.status().message().find("a path is not allowed"), std::string::npos);
}

}  // namespace
}  // namespace kv
