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

namespace {

// Requests a backend may carry: ceil(load_factor × (in flight on live backends + 1) / live ones).
// Some live backend is always under it: n_live × capacity > total.
int64_t bounded_capacity(const std::vector<int32_t>& load, const std::vector<bool>& live, double load_factor, int64_t* n_live) {
  int64_t total = 0;
  *n_live = 0;
  for (size_t b = 0; b < live.size(); ++b)
    if (live[b]) {
      ++*n_live;
      total += load[b];
    }
  if (*n_live == 0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(load_factor * double(total + 1) / double(*n_live))));
}

std::vector<bool> live_backends(const std::vector<bool>& up, const std::vector<int32_t>& exclude) {
  std::vector<bool> live = up;
  for (int32_t b : exclude)
    if (b >= 0 && b < static_cast<int32_t>(live.size())) live[b] = false;
  return live;
}

}  // namespace

RouteChoice choose_backend(const HashRing& ring, uint64_t key, const std::vector<bool>& up, const std::vector<int32_t>& load,
                           double load_factor, const std::vector<int32_t>& exclude) {
  RouteChoice c;
  const std::vector<int32_t> order = ring.order(key);
  const std::vector<bool> live = live_backends(up, exclude);
  int64_t n_live = 0;
  const int64_t capacity = bounded_capacity(load, live, load_factor, &n_live);
  if (n_live == 0) return c;
  const bool owner_live = live[order[0]];
  for (int32_t b : order)
    if (live[b] && load[b] < capacity) {
      c.backend = b;
      break;
    }
  c.owner = owner_live && c.backend == order[0];
  c.why = c.owner ? RouteChoice::Why::kOwner : owner_live ? RouteChoice::Why::kOwnerBusy : RouteChoice::Why::kOwnerDown;
  return c;
}

PrefixMap::PrefixMap(int32_t n_backends, size_t capacity) : capacity_(std::max<size_t>(1, capacity)), keys_on_(n_backends, 0) {}

void PrefixMap::assign(uint64_t key, int32_t backend) {
  auto it = where_.find(key);
  if (it != where_.end()) {
    --keys_on_[it->second.backend];
    it->second.backend = backend;
    lru_.splice(lru_.begin(), lru_, it->second.at);
  } else {
    if (where_.size() >= capacity_) {  // forget the least recently used key
      auto old = where_.find(lru_.back());
      --keys_on_[old->second.backend];
      where_.erase(old);
      lru_.pop_back();
    }
    lru_.push_front(key);
    where_.emplace(key, Entry{backend, lru_.begin()});
  }
  ++keys_on_[backend];
}

RouteChoice PrefixMap::choose(const HashRing& ring, uint64_t key, const std::vector<bool>& up, const std::vector<int32_t>& load,
                              double load_factor, int32_t balance_abs, const std::vector<int32_t>& exclude) {
  RouteChoice c;
  const std::vector<bool> live = live_backends(up, exclude);
  int64_t n_live = 0;
  const int64_t capacity = bounded_capacity(load, live, load_factor, &n_live);
  if (n_live == 0) return c;
  int32_t min_load = 0;
  bool first = true;
  for (size_t b = 0; b < live.size(); ++b)
    if (live[b]) {
      min_load = first ? load[b] : std::min(min_load, load[b]);
      first = false;
    }
  auto known = where_.find(key);
  const int32_t owner = known == where_.end() ? -1 : known->second.backend;
  if (owner >= 0 && live[owner] && (load[owner] < capacity || load[owner] - min_load < balance_abs)) {
    lru_.splice(lru_.begin(), lru_, known->second.at);
    c.backend = owner;
    c.owner = true;
    c.why = RouteChoice::Why::kOwner;
    return c;
  }
  // The least loaded live backend other than the owner; ties: fewest keys, then ring order.
  const std::vector<int32_t> order = ring.order(key);
  for (int32_t b : order) {
    if (!live[b] || b == owner) continue;
    if (c.backend < 0 || load[b] < load[c.backend] || (load[b] == load[c.backend] && keys_on_[b] < keys_on_[c.backend])) c.backend = b;
  }
  if (owner >= 0 && live[owner]) {  // busy: this request goes elsewhere, the key stays
    lru_.splice(lru_.begin(), lru_, known->second.at);
    c.why = RouteChoice::Why::kOwnerBusy;
    if (c.backend < 0) c.backend = owner;  // the only live backend (cannot be over capacity then)
    return c;
  }
  c.why = owner >= 0 ? RouteChoice::Why::kOwnerDown : RouteChoice::Why::kNew;
  assign(key, c.backend);
  return c;
}

}  // namespace kv
