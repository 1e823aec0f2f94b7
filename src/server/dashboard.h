// The KV dashboard's SSE payload (GET /dashboard/events, drawn by web/dashboard.html): one JSON
// object per engine snapshot (engine/kv_snapshot.h), as one viewer may see it.
//
// Tenants. With --api-key, every request's prefix-cache namespace starts with
// "key:<XXH3-64(key)>/" (http_server.cpp). A viewer sees the namespaces of the key it connected
// with: their names (the part after that prefix), the text of their tree nodes and requests.
// Everything else (other keys' pages, nodes, requests) is shown anonymously: counts, states,
// sizes and times, never a namespace or a token. Without --api-key, everything is visible
// (a cache_salt alone is no boundary: prefix_cache.h).
//
// Payload (times in seconds since the engine started; see web/dashboard.html for the drawing):
//   {seq, t, build_ms, block_size,
//    pools: [{name, n_pages, runs (encode_runs of the page states), counts {free, running, shared, cached}}],
//    requests: [{id, choice, choices (the request's n), mine, ns?, state, prompt, computed, generated, max_tokens, pages, cached,
//                arrival, first_token, finished, reason, preemptions, truncated,
//                events: [[kind, t0, t1, n], ...]}],
//    tree: {nodes_total, namespaces: [{name?, mine, pages, nodes}],
//           nodes: [{id, parent, ns, text?, pages, depth, hits, age, pinned}]},
//    rates: [{t, gen_tok_s, prompt_tok_s, kv_used, kv_cached, hit_rate, preemptions, ttft, itl, running, waiting}],
//    tiers: [{tier, pages}]}
// rates holds the points newer than the caller's last (the whole window on a client's first event).
#pragma once
#include <string>

#include "engine/kv_snapshot.h"
#include "tokenizer/tokenizer.h"

namespace kv {

struct DashboardViewer {
  std::string ns_prefix;  // the viewer's namespaces start with this; empty: no auth, all visible
  bool sees(const std::string& ns) const { return ns.compare(0, ns_prefix.size(), ns_prefix) == 0; }
};

// The namespace prefix of an API key's requests: "key:<XXH3-64 of the key, 16 hex digits>/".
constexpr const char* kTenantPrefixTag = "key:";  // a server without keys refuses salts that start with it
std::string tenant_prefix(const std::string& api_key);

// One event's JSON (one line). rates_after: only rate points with t > rates_after.
std::string dashboard_json(const KvSnapshot& s, const DashboardViewer& viewer, const Tokenizer& tok, double rates_after);

}  // namespace kv
