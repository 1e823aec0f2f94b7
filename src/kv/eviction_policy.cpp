// Policy names (no pool, no kernels): what request parsing needs from kv_eviction.h, apart from
// the eviction mechanics, so the request parser links (and fuzzes) without the KV pool.
#include "kv/kv_eviction.h"

namespace kv {

const char* eviction_policy_name(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::kNone: return "none";
    case EvictionPolicy::kWindow: return "window";
    case EvictionPolicy::kSinks: return "sinks";
    case EvictionPolicy::kH2O: return "h2o";
    case EvictionPolicy::kSnapKV: return "snapkv";
  }
  return "?";
}

Result<EvictionPolicy> parse_eviction_policy(const std::string& s) {
  for (EvictionPolicy p : {EvictionPolicy::kNone, EvictionPolicy::kWindow, EvictionPolicy::kSinks, EvictionPolicy::kH2O,
                           EvictionPolicy::kSnapKV})
    if (s == eviction_policy_name(p)) return p;
  return Status::error("unknown KV eviction policy '" + s + "' (expected none, window, sinks, h2o or snapkv)");
}

}  // namespace kv
