#include "server/dashboard.h"

#include <xxhash.h>

#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "server/api_error.h"

namespace kv {

using json = nlohmann::ordered_json;

namespace {
// Milliseconds are all a chart needs; shorter numbers make a smaller payload.
double ms3(double s) { return std::round(s * 1000.0) / 1000.0; }
json maybe(double v) { return v < 0 ? json(nullptr) : json(ms3(v)); }
json maybe4(double v) { return v < 0 ? json(nullptr) : json(std::round(v * 1e4) / 1e4); }
}  // namespace

std::string tenant_prefix(const std::string& api_key) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%016llx/", kTenantPrefixTag, static_cast<unsigned long long>(XXH3_64bits(api_key.data(), api_key.size())));
  return buf;
}

std::string dashboard_json(const KvSnapshot& s, const DashboardViewer& viewer, const Tokenizer& tok, double rates_after) {
  json j;
  j["seq"] = s.seq;
  j["t"] = ms3(s.t);
  j["build_ms"] = std::round(s.build_s * 1e6) / 1e3;
  j["block_size"] = s.block_size;

  json pools = json::array();
  for (const PoolView& p : s.pools)
    pools.push_back({{"name", p.name},
                     {"n_pages", p.states.size()},
                     {"runs", encode_runs(p.states)},
                     {"counts", {{"free", p.n_free}, {"running", p.n_running}, {"shared", p.n_shared}, {"cached", p.n_cached}}}});
  j["pools"] = std::move(pools);

  const size_t n_prefix = viewer.ns_prefix.size();
  json reqs = json::array();
  for (const RequestView& r : s.requests) {
    const Timeline& tl = r.timeline;
    const bool mine = viewer.sees(r.ns);
    json o = {{"id", r.id}, {"choice", r.index}, {"choices", r.n_choices}, {"mine", mine}};
    if (mine) o["ns"] = r.ns.substr(n_prefix);
    o["state"] = request_state_name(r.state);
    o["prompt"] = r.n_prompt;
    o["computed"] = r.n_computed;
    o["generated"] = r.n_generated;
    o["max_tokens"] = r.max_tokens;
    o["pages"] = r.n_pages;
    o["cached"] = r.cached_tokens;
    o["arrival"] = ms3(r.arrival);
    o["first_token"] = maybe(tl.first_token);
    o["finished"] = maybe(tl.finished);
    o["reason"] = tl.finish_reason;
    o["preemptions"] = tl.n_preemptions;
    o["truncated"] = tl.truncated;
    json evs = json::array();
    for (const TimelineEvent& e : tl.events) evs.push_back({timeline_kind_name(e.kind), ms3(e.t0), ms3(e.t1), e.n});
    o["events"] = std::move(evs);
    reqs.push_back(std::move(o));
  }
  j["requests"] = std::move(reqs);

  // Other tenants' namespaces collapse into one anonymous entry.
  const PrefixTreeView& tv = s.tree;
  json nss = json::array();
  std::vector<int32_t> ns_index(tv.namespaces.size(), -1);
  int32_t anon = -1;
  for (size_t k = 0; k < tv.namespaces.size(); ++k) {
    if (viewer.sees(tv.namespaces[k])) {
      ns_index[k] = static_cast<int32_t>(nss.size());
      nss.push_back({{"name", tv.namespaces[k].substr(n_prefix)}, {"mine", true}, {"pages", tv.ns_pages[k]}, {"nodes", tv.ns_nodes[k]}});
      continue;
    }
    if (anon < 0) {
      anon = static_cast<int32_t>(nss.size());
      nss.push_back({{"name", nullptr}, {"mine", false}, {"pages", 0}, {"nodes", 0}});
    }
    ns_index[k] = anon;
    nss[anon]["pages"] = nss[anon]["pages"].get<int64_t>() + tv.ns_pages[k];
    nss[anon]["nodes"] = nss[anon]["nodes"].get<int64_t>() + tv.ns_nodes[k];
  }
  json nodes = json::array();
  for (const PrefixTreeView::Node& n : tv.nodes) {
    json o = {{"id", n.id}, {"parent", n.parent}, {"ns", ns_index[n.ns]}};
    if (viewer.sees(tv.namespaces[n.ns])) o["text"] = tok.decode(n.head, true);
    o["pages"] = n.n_pages;
    o["depth"] = n.depth_tokens;
    o["hits"] = n.hits;
    o["age"] = ms3(static_cast<double>(tv.now - n.last_access) / s.tree_clock_per_s);
    o["pinned"] = n.pinned;
    nodes.push_back(std::move(o));
  }
  j["tree"] = {{"nodes_total", tv.n_nodes}, {"namespaces", std::move(nss)}, {"nodes", std::move(nodes)}};

  json rates = json::array();
  for (const RatePoint& p : s.rates) {
    if (p.t <= rates_after) continue;
    rates.push_back({{"t", ms3(p.t)},
                     {"gen_tok_s", std::round(p.gen_tok_s * 10) / 10},
                     {"prompt_tok_s", std::round(p.prompt_tok_s * 10) / 10},
                     {"kv_used", maybe4(p.kv_used)},
                     {"kv_cached", maybe4(p.kv_cached)},
                     {"hit_rate", maybe4(p.hit_rate)},
                     {"preemptions", p.preemptions},
                     {"ttft", maybe(p.ttft_s)},
                     {"itl", maybe(p.itl_s)},
                     {"running", p.running},
                     {"waiting", p.waiting}});
  }
  j["rates"] = std::move(rates);
  json tiers = json::array();
  for (const auto& [name, pages] : s.tier_pages) tiers.push_back({{"tier", name}, {"pages", pages}});
  j["tiers"] = std::move(tiers);
  // A snippet may end inside a UTF-8 sequence (an edge starts and stops at page boundaries).
  return dump_json(j);
}

}  // namespace kv
