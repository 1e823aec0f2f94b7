#include "router/affinity.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kv {

uint64_t affinity_key(const std::string& ns, const int32_t* tokens, int64_t n_tokens, int32_t block_size, int32_t max_pages) {
  int64_t n = std::min<int64_t>(n_tokens / block_size, max_pages) * block_size;
  if (n == 0) n = n_tokens;
  // One buffer: [namespace length][namespace][tokens].
  std::string buf(sizeof(uint64_t) + ns.size() + static_cast<size_t>(n) * sizeof(int32_t), '\0');
  const uint64_t ns_len = ns.size();
  std::memcpy(buf.data(), &ns_len, sizeof ns_len);
  std::memcpy(buf.data() + sizeof ns_len, ns.data(), ns.size());
  if (n > 0) std::memcpy(buf.data() + sizeof ns_len + ns.size(), tokens, static_cast<size_t>(n) * sizeof(int32_t));
  return XXH3_64bits(buf.data(), buf.size());
}

HashRing::HashRing(int32_t n_backends, int32_t vnodes_per_backend) : n_backends_(n_backends) {
  points_.reserve(static_cast<size_t>(n_backends) * vnodes_per_backend);
  for (int32_t b = 0; b < n_backends; ++b)
    for (int32_t v = 0; v < vnodes_per_backend; ++v) {
      const uint64_t id[2] = {static_cast<uint64_t>(b), static_cast<uint64_t>(v)};
      points_.emplace_back(XXH3_64bits(id, sizeof id), b);
    }
  std::sort(points_.begin(), points_.end());
}

std::vector<int32_t> HashRing::order(uint64_t key) const {
  std::vector<int32_t> out;
  if (points_.empty()) return out;
  std::vector<bool> seen(n_backends_, false);
  size_t i = std::lower_bound(points_.begin(), points_.end(), std::make_pair(key, int32_t(-1))) - points_.begin();
  for (size_t k = 0; k < points_.size() && static_cast<int32_t>(out.size()) < n_backends_; ++k) {
    const int32_t b = points_[(i + k) % points_.size()].second;
    if (!seen[b]) {
      seen[b] = true;
      out.push_back(b);
    }
  }
  return out;
}

RouteChoice choose_backend(const HashRing& ring, uint64_t key, const std::vector<bool>& up, const std::vector<int32_t>& load,
                           double load_factor, const std::vector<int32_t>& exclude) {
  RouteChoice c;
  const std::vector<int32_t> order = ring.order(key);
  auto live = [&](int32_t b) { return up[b] && std::find(exclude.begin(), exclude.end(), b) == exclude.end(); };
  int64_t n_live = 0, total = 0;
  for (int32_t b : order)
    if (live(b)) {
      ++n_live;
      total += load[b];
    }
  if (n_live == 0) return c;
  // Some live backend is always under it: n_live × capacity > total.
  const int64_t capacity = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(load_factor * double(total + 1) / double(n_live))));
  const bool owner_live = live(order[0]);
  for (int32_t b : order)
    if (live(b) && load[b] < capacity) {
      c.backend = b;
      break;
    }
  c.owner = owner_live && c.backend == order[0];
  c.why = c.owner ? RouteChoice::Why::kOwner : owner_live ? RouteChoice::Why::kOwnerBusy : RouteChoice::Why::kOwnerDown;
  return c;
}

}  // namespace kv
