// RedisStore: L3, pages in Redis (one or more standalone servers, or a Redis Cluster), shared
// by every kvserve instance that points at it. hiredis (Debian) speaks the protocol; Debian has
// no cluster client for C, so the slot routing (CRC16 key slots, CLUSTER SLOTS, MOVED / ASK
// redirections) is here.
//
// Keys: "kvs:<fingerprint:016x>:<format tag:08x>:<namespace tag:016x>:<chain hash hex>", so
// pages of another model, KV format or tenant never share a key (the namespace tag is an XXH3
// of the namespace: an API key never reaches Redis in clear). Values: blobs (page_store.h),
// checked on every load. SET ... PX ttl when a TTL is set, graded by the page's depth (ttl_ms).
// Batches are pipelined per node.
// Redis evicts on its own, restarts empty, or is down when a write comes: what this process
// wrote is no proof it is there, so pages written before go through put_missing (EXISTS, then
// SET what is missing, refresh what is held).
//
// Addresses: redis://HOST[:PORT] (or HOST:PORT; parse_address). At first use the store asks the
// first reachable address for CLUSTER SLOTS; if it is a cluster, keys go to their slot's master
// and MOVED/ASK are followed; otherwise keys are spread over the addresses by their hash.
//
// Failure: connect and command timeouts (timeout_ms). A node that fails is skipped (a miss, a
// dropped write, an error counted) until its backoff ends (0.5 s doubling to 8 s), then
// reconnected: Redis slow or down never fails a request, it only loses hits.
//
// Threading: every method is thread-safe; each calling thread has its own connections.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <utility>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "kv/page_store.h"

namespace kv {

uint16_t redis_key_slot(std::string_view key);  // CRC16-XMODEM mod 16384, {hash tags} honoured

class RedisStore : public PageStore {
 public:
  struct Endpoint {  // a node
    std::string host;
    int port = 0;
    bool operator<(const Endpoint& o) const { return host != o.host ? host < o.host : port < o.port; }
  };
  // One address as --kv-redis takes it: redis://HOST[:PORT][/] or HOST:PORT, HOST a host name or an
  // IPv4 address; else the reason (it names the address and the forms wanted). create() parses
  // with it; `kvserve serve` checks its flag with it before the weights load.
  static Result<Endpoint> parse_address(const std::string& address);
  // Parses the addresses; connects lazily. id.ns_tag is unused (each key carries its own).
  static Result<std::unique_ptr<RedisStore>> create(const std::vector<std::string>& addrs, const PageIdentity& id, int32_t ttl_s,
                                                    int32_t timeout_ms);
  ~RedisStore() override;

  const char* name() const override { return "redis"; }
  std::vector<bool> put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs) override;
  // EXISTS for every page, SET (EX ttl) for the ones missing, and for the ones held TOUCH (no
  // TTL) or EXPIRE ttl: two pipelined round trips, and no page sent that Redis has. A probe (an
  // empty blob) missing is kMissing.
  std::vector<PutResult> put_missing(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags,
                                     std::span<const std::string> blobs) override;
  // EXISTS first, then GET only the leading run of pages that exist (a prefix is usable up to its
  // first gap: the pages past it are never fetched). With a TTL, the pages found get it afresh.
  std::vector<std::optional<std::string>> get(uint64_t ns_tag, std::span<const PageHash> hashes) override;

  // The same with each page's depth in its prefix (its page index; -1: unknown), which grades its
  // TTL (ttl_ms): the tier manager knows it, the PageStore interface does not carry it.
  std::vector<bool> put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs,
                        std::span<const int32_t> depths);
  std::vector<PutResult> put_missing(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags,
                                     std::span<const std::string> blobs, std::span<const int32_t> depths);
  // hashes are pages first_depth, first_depth + 1, ... of their prefix (-1: unknown).
  std::vector<std::optional<std::string>> get(uint64_t ns_tag, std::span<const PageHash> hashes, int64_t first_depth);
  // A page's TTL in ms (0: none) when ttl_s > 0: graded by depth, from 1.5·ttl_s at a prefix's
  // first page down to ttl_s at page kTtlDepthCap and beyond (or unknown), ttl_s/1024 per page,
  // so that a Redis with maxmemory-policy volatile-ttl evicts a prefix's tail before its head (a
  // lookup stops at the first missing page; docs/tiers.md, "Redis under maxmemory"). A step of
  // ttl_s/1024 is more than a prefill takes per page, so a prefix written over seconds still
  // expires tail first.
  int64_t ttl_ms(int32_t depth) const;
  static constexpr int32_t kTtlDepthCap = 512;
  bool may_contain(const PageHash&) const override { return true; }
  void remove(uint64_t ns_tag, const PageHash& h) override;
  void fill_stats(TierStats* s) const override;

  // The key a page of namespace tag ns_tag is stored under.
  std::string key(uint64_t ns_tag, const PageHash& h) const;

 private:
  RedisStore(std::vector<Endpoint> seeds, const PageIdentity& id, int32_t ttl_s, int32_t timeout_ms);
  struct Conn;
  struct ThreadConns;
  ThreadConns& conns();
  Conn* conn(ThreadConns& tc, const Endpoint& e);  // connected, or null (down / backing off)
  void answers(Conn& c);
  void fail(ThreadConns& tc, const Endpoint& e);   // drop the connection, start a backoff
  void reply_error(const std::string& err);         // an error reply (OOM, NOAUTH, ...): counted; each kind told once
  void discover(ThreadConns& tc);                  // cluster or not; slot map
  Endpoint node_for(const std::string& key) const;
  // Runs one command per key (argv built by make), pipelined per node, following MOVED/ASK
  // once. replies[i]: the i-th reply's string (GET), "" for OK, the number for an integer reply
  // (EXISTS, TOUCH, DEL), nullopt for nil or failure.
  std::vector<std::optional<std::string>> run(const std::vector<std::string>& keys,
                                              const std::vector<std::vector<std::string>>& argvs, bool want_value);

  std::vector<Endpoint> seeds_;
  PageIdentity id_;
  int32_t ttl_s_;
  int32_t timeout_ms_;

  mutable std::mutex mu_;
  bool discovered_ = false;
  bool cluster_ = false;
  std::vector<std::pair<std::pair<int, int>, Endpoint>> slots_;  // [first, last] slot -> master
  std::map<std::thread::id, std::unique_ptr<ThreadConns>> threads_;
  int64_t errors_ = 0;
  std::map<Endpoint, bool> told_down_;  // an outage told (each thread's connection sees it: told once)
  int64_t redirects_ = 0;
  std::set<std::string> errors_told_;  // first words of the error replies already logged
};

}  // namespace kv
