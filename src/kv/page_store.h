// Page stores below RAM (the KV tiers): L2 a local directory (disk_store.h), L3 Redis
// (redis_store.h). A store keeps self-describing blobs keyed by a page's chain hash; the tier
// manager (tier_manager.h) moves pages between them and the pool on its own threads.
//
// Blob format (little-endian; every load checks all of it, and any mismatch is a miss):
//   8   magic "KVSPAGE\0"
//   u32 kBlobVersion              u32 PrefixCache::kChainHashVersion
//   u64 model fingerprint         u32 KvLayout::format_tag()     u32 block_size
//   u64 namespace tag (XXH3-64 of the namespace: the raw string, which may hold an API key,
//       never leaves the process)
//   u64 hash.lo  u64 hash.hi      (the page's chain hash: its key in every store)
//   u32 flags (bit 3: Quest key summaries follow the K/V bytes; bit 2: the sliding-window
//       layer group's K/V of the same position follows, hybrid models)
//   u64 parent.lo  u64 parent.hi  (version 2: the chain hash of the page before it, all zero for
//       a namespace's first page; the disk store evicts pages no stored page continues first)
//   i32 tokens[block_size]        (the page's tokens)
//   u64 payload bytes             u64 XXH3-64 of the payload
//   u64 XXH3-64 of every header byte before this one
//   payload: per layer, K bytes then V bytes of the page (the pool's tile format), then with
//   flag bit 3 the pool's key summaries of the page, per layer, then with flag bit 2 the
//   window group's page (its pool's format; the global page's format tag covers both groups).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/prefix_cache.h"

namespace kv {

// 2: the parent's chain hash after the flags. Version 1 blobs (without it) are still read: their
// parent is unknown.
inline constexpr uint32_t kBlobVersion = 2;
// Bit 3: Quest's key summaries follow (PagePool::key_stats: 8-bit mean and variance per part of
// kQuestKeysPerPart slots). Earlier bits, no longer written: bit 0 (min/max bounds per page,
// before 2026-11-27), bit 1 (f16 mean and variance per page, until 2026-11-28). Such a blob is
// a miss for a pool that keeps summaries (and, by its size, for one that does not), never read
// as summaries.
inline constexpr uint32_t kBlobFlagKeyStats = 8;
// Bit 2: the window group's page of the same position follows (hybrid models, e.g. Gemma 3).
inline constexpr uint32_t kBlobFlagWindow = 4;

// What a blob must say to be the page a lookup asked for.
struct PageIdentity {
  uint64_t fingerprint = 0;
  uint32_t format_tag = 0;
  int32_t block_size = 0;
  uint64_t ns_tag = 0;
};

uint64_t namespace_tag(std::string_view ns);

// Header + payload. payload is the page's bytes in the pool's format; parent is the chain hash
// of the page before this one (PageHash{} for a namespace's first page).
std::string encode_blob(const PageIdentity& id, const PageHash& hash, const PageHash& parent, const int32_t* tokens,
                        uint32_t flags, std::span<const uint8_t> payload);

enum class BlobCheck { kOk, kCorrupt, kForeign };
const char* blob_check_name(BlobCheck c);

// Header fields of a blob (after decode_header).
struct BlobHeader {
  PageIdentity id;
  PageHash hash;
  PageHash parent;          // PageHash{}: a namespace's first page, or unknown (a version 1 blob)
  uint32_t flags = 0;
  std::vector<int32_t> tokens;
  uint64_t payload_bytes = 0;
  uint64_t payload_xxh3 = 0;
  size_t header_bytes = 0;
};
// Parses and checks the header alone (magic, versions, header checksum). kForeign: well formed
// but another blob or chain-hash version.
BlobCheck decode_header(std::string_view blob, BlobHeader* out);
// Full check of a blob fetched for (id, hash, tokens): header, identity, tokens, payload size
// and checksum. kForeign: a valid page of another model / format / namespace / position.
BlobCheck check_blob(std::string_view blob, const PageIdentity& id, const PageHash& hash, const int32_t* tokens,
                     BlobHeader* header = nullptr);

// Counters of one store, read by /metrics (names under kvserve:kv_tier_*{tier="..."}).
struct TierStats {
  std::string tier;               // "disk", "redis"
  int64_t hits = 0;               // pages found and valid on load
  int64_t misses = 0;             // pages looked up and not found (or invalid)
  int64_t bytes_in = 0;           // bytes loaded from the store
  int64_t bytes_out = 0;          // bytes written to it
  int64_t pages_written = 0;
  int64_t pages_refreshed = 0;    // pages found held on a write again (put_missing): not sent
  int64_t write_drops = 0;        // writes given up (queue full, store down, no room)
  int64_t errors = 0;             // I/O or connection failures
  int64_t corrupt = 0;            // blobs that failed their checks (dropped, recomputed)
  int64_t pages_stored = -1;      // pages held now (-1: unknown, e.g. a shared Redis)
  int64_t bytes_stored = -1;
};

// A store of blobs by chain hash. Methods may block (disk, network): only the tier manager's
// threads call them. Implementations are thread-safe.
class PageStore {
 public:
  virtual ~PageStore() = default;
  virtual const char* name() const = 0;
  // Stores blobs[i] under hashes[i] (replacing); ns_tags[i] is the page's namespace tag (the
  // hash already depends on it; a store may also name its keys by it). False when nothing could
  // be written. Returns, per page, whether it was stored (a failed page is counted as a drop,
  // never as written). hashes come in chain order: a prefix's first page first.
  virtual std::vector<bool> put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs) = 0;
  // As put(), for pages the caller believes the store holds already (it wrote them, or loaded
  // them from it): a page the store still holds is only refreshed there (its recency, its
  // expiry), not sent again; a page it lost (evicted, restarted empty, down when the write came)
  // is stored. Per page: kStored, kHeld (refreshed) or kFailed. An empty blob is a probe: held,
  // it is refreshed; lost, it is kMissing (nothing stored). The default stores every page.
  enum class PutResult : uint8_t { kFailed, kStored, kHeld, kMissing };
  virtual std::vector<PutResult> put_missing(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags,
                                             std::span<const std::string> blobs) {
    const std::vector<bool> ok = put(hashes, ns_tags, blobs);
    std::vector<PutResult> out(ok.size());
    for (size_t i = 0; i < ok.size(); ++i) out[i] = ok[i] ? PutResult::kStored : PutResult::kFailed;
    return out;
  }
  // The blobs of hashes, in order: nullopt where absent or unreachable. Implementations may
  // stop early and leave the rest nullopt after the first absent one (a prefix is only
  // usable up to its first gap).
  virtual std::vector<std::optional<std::string>> get(uint64_t ns_tag, std::span<const PageHash> hashes) = 0;
  // Whether the store may hold the page (a cheap local answer; a remote store says true).
  virtual bool may_contain(const PageHash& h) const = 0;
  // Drops a stored page (found corrupt).
  virtual void remove(uint64_t ns_tag, const PageHash& h) = 0;
  // Fills pages_stored / bytes_stored / errors and what only the store knows.
  virtual void fill_stats(TierStats* s) const = 0;
};

}  // namespace kv
