// The dashboard's payload as one viewer may see it (server/dashboard.h): another key's
// namespaces, snippets and request namespaces never appear, only their counts.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model_fixture.h"
#include "server/dashboard.h"

using namespace kv;

namespace {
// Two tenants' namespaces, a request and a tree node each.
KvSnapshot two_tenants(const Tokenizer& tok, const std::string& a, const std::string& b) {
  KvSnapshot s;
  s.seq = 3;
  s.t = 2.0;
  s.block_size = 16;
  s.pools.push_back({"global", "..rrsc", 2, 2, 1, 1});
  s.tree.namespaces = {a + "salt-a", b + "salt-b"};
  s.tree.ns_pages = {2, 3};
  s.tree.ns_nodes = {1, 1};
  s.tree.n_nodes = 2;
  s.tree.now = 5'000'000'000;
  for (int k = 0; k < 2; ++k) {
    PrefixTreeView::Node n;
    n.id = k + 1;
    n.ns = k;
    n.n_pages = 2 + k;
    n.hits = 4;
    n.last_access = 4'000'000'000;
    n.head = tok.encode(k == 0 ? "Alpha secret" : "Bravo secret", false, false);
    s.tree.nodes.push_back(n);
    RequestView r;
    r.id = 10 + k;
    r.ns = s.tree.namespaces[k];
    r.state = RequestView::kRunning;
    r.timeline.events.push_back({TimelineEvent::kPrefill, 1.0, 1.5, 32});
    s.requests.push_back(r);
  }
  s.rates = {{1.0}, {1.25}, {1.5}};
  return s;
}
}  // namespace

TEST(DashboardJson, AViewerSeesItsOwnNamespacesByNameAndOthersAnonymously) {
  const Tokenizer* tok = kvtest::smollm2_tokenizer();
  ASSERT_TRUE(tok);
  const std::string a = tenant_prefix("sk-a"), b = tenant_prefix("sk-b");
  EXPECT_EQ(a.size(), 21u);  // "key:" + 16 hex digits + "/"
  EXPECT_NE(a, b);
  const KvSnapshot s = two_tenants(*tok, a, b);
  const std::string text = dashboard_json(s, DashboardViewer{a}, *tok, 1.25);
  EXPECT_EQ(text.find("Bravo"), std::string::npos);
  EXPECT_EQ(text.find("salt-b"), std::string::npos);
  EXPECT_EQ(text.find("key:"), std::string::npos);  // not even one's own hash
  const auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["pools"][0]["runs"], ".2r2sc");
  ASSERT_EQ(j["tree"]["namespaces"].size(), 2u);
  EXPECT_EQ(j["tree"]["namespaces"][0]["name"], "salt-a");
  EXPECT_TRUE(j["tree"]["namespaces"][1]["name"].is_null());
  EXPECT_EQ(j["tree"]["namespaces"][1]["pages"], 3);
  EXPECT_EQ(j["tree"]["nodes"][0]["text"], "Alpha secret");
  EXPECT_DOUBLE_EQ(j["tree"]["nodes"][0]["age"].get<double>(), 1.0);
  EXPECT_FALSE(j["tree"]["nodes"][1].contains("text"));
  EXPECT_EQ(j["tree"]["nodes"][1]["pages"], 3);
  EXPECT_EQ(j["requests"][0]["ns"], "salt-a");
  EXPECT_TRUE(j["requests"][0]["mine"]);
  EXPECT_FALSE(j["requests"][1].contains("ns"));
  EXPECT_FALSE(j["requests"][1]["mine"]);
  EXPECT_EQ(j["requests"][1]["events"][0][0], "prefill");
  ASSERT_EQ(j["rates"].size(), 1u);  // only the points after the viewer's last
  EXPECT_DOUBLE_EQ(j["rates"][0]["t"].get<double>(), 1.5);

  // Several foreign namespaces fold into one anonymous entry; without auth everything shows.
  KvSnapshot three = s;
  three.tree.namespaces.push_back(tenant_prefix("sk-c") + "x");
  three.tree.ns_pages.push_back(4);
  three.tree.ns_nodes.push_back(1);
  const auto j3 = nlohmann::json::parse(dashboard_json(three, DashboardViewer{a}, *tok, 0));
  ASSERT_EQ(j3["tree"]["namespaces"].size(), 2u);
  EXPECT_EQ(j3["tree"]["namespaces"][1]["pages"], 7);
  const auto open = nlohmann::json::parse(dashboard_json(s, DashboardViewer{}, *tok, 0));
  EXPECT_EQ(open["tree"]["nodes"][1]["text"], "Bravo secret");
  EXPECT_EQ(open["requests"][1]["ns"], b + "salt-b");
  EXPECT_EQ(open["rates"].size(), 3u);
}
