// Where the router sends a request: pure functions over the router's view of its backends, so
// tests drive them without a network (router.h does the HTTP).
//
// Prefix affinity: a request's key hashes its namespace and the tokens of its first full KV
// pages (at most max_pages of them), so every request that starts with the same system prompt
// or chat history has the same key. Keys sit on a consistent-hash ring (virtual nodes per
// backend): a backend that goes down hands only its own share to the next backends on the
// ring, and gets the same share back when it returns.
//
// Cache-aware routing (PrefixMap, the router's default) remembers instead: a key seen for the
// first time goes to the least loaded backend, and from then on to that backend. A few heavy
// prefixes (tenants' system prompts) then split evenly, which a hash does only on average.
#pragma once
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kv {

// XXH3-64 over the namespace and tokens [0, min(n_full_pages, max_pages) * block_size); a
// prompt with no full page keys on all its tokens (nothing to share, but stable for retries).
uint64_t affinity_key(const std::string& ns, const int32_t* tokens, int64_t n_tokens, int32_t block_size, int32_t max_pages);

class HashRing {
 public:
  HashRing() = default;
  HashRing(int32_t n_backends, int32_t vnodes_per_backend = 160);
  int32_t n_backends() const { return n_backends_; }
  // Backends in the order the ring meets them from key, each once: [0] owns the key.
  std::vector<int32_t> order(uint64_t key) const;

 private:
  int32_t n_backends_ = 0;
  std::vector<std::pair<uint64_t, int32_t>> points_;  // sorted (hash, backend)
};

struct RouteChoice {
  int32_t backend = -1;  // -1: no backend is up
  bool owner = false;    // the ring's first choice for the key (an affinity hit)
  // kNew: a key the router had not seen (PrefixMap only): it went to the least loaded backend.
  enum class Why { kOwner, kOwnerDown, kOwnerBusy, kNew, kNone } why = Why::kNone;
};

// Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): the key's first
// live backend on the ring that is under capacity, capacity being
// ceil(load_factor × (requests in flight on live backends + 1) / live backends). So no backend
// carries more than load_factor × the average, and a key that overflows its owner goes to the
// same next backend every time (whose cache then holds it too). Backends listed in `exclude`
// (tried already) count as down.
RouteChoice choose_backend(const HashRing& ring, uint64_t key, const std::vector<bool>& up, const std::vector<int32_t>& load,
                           double load_factor, const std::vector<int32_t>& exclude = {});

// Where each key went, for cache-aware routing (SGLang's idea, keyed on the affinity key rather
// than a radix tree of every prompt): a remembered key goes to its backend while that backend
// is live and not busy. Busy = over the bounded-load capacity of choose_backend *and* at least
// `balance_abs` requests ahead of the least loaded live backend: a request sent elsewhere
// recomputes its whole prefix there (and evicts that backend's own prefixes to hold it), while
// one more request at its owner mostly joins a running batch. A busy owner's request goes to
// the least loaded other backend, and the key stays with its owner. A new key, or one whose
// owner is down (or excluded: tried already), goes to the least loaded live backend (ties: the
// one that owns fewest keys, then the key's ring order) and is remembered there. At most
// `capacity` keys, least recently used forgotten first. Not thread-safe: the router locks it.
class PrefixMap {
 public:
  PrefixMap(int32_t n_backends, size_t capacity = size_t(1) << 16);
  RouteChoice choose(const HashRing& ring, uint64_t key, const std::vector<bool>& up, const std::vector<int32_t>& load,
                     double load_factor, int32_t balance_abs, const std::vector<int32_t>& exclude = {});
  size_t size() const { return where_.size(); }
  int32_t keys_on(int32_t backend) const { return keys_on_[backend]; }

 private:
  void assign(uint64_t key, int32_t backend);

  size_t capacity_;
  std::vector<int32_t> keys_on_;                   // keys remembered per backend
  std::list<uint64_t> lru_;                        // most recently used first
  struct Entry {
    int32_t backend;
    std::list<uint64_t>::iterator at;
  };
  std::unordered_map<uint64_t, Entry> where_;
};

}  // namespace kv
