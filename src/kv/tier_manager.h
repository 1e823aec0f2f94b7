// TierManager: moves full KV pages between the RAM pool (L1) and the stores below it (L2 disk,
// L3 Redis; page_store.h), on its own threads, so an engine step never waits for I/O.
//
// Down (writes). The prefix cache tells the manager about pages it adopts and drops
// (PageListener). Write-back (the default) writes a page when the cache evicts it; write-through
// as soon as the cache adopts it. Either way the engine thread only copies the page's bytes out
// of the pool (a memcpy) and queues them; a writer thread encodes the blob (header, checksums)
// and puts it in every store. A page the disk already holds is not written again, only refreshed
// there (through the queue; a batch's refreshes land before its writes and their trim). Redis is
// not ours to index: a page this process wrote or loaded before goes down again as "if missing"
// (Redis may have evicted it, restarted empty, or been down): the writer asks Redis, stores it
// where it is gone and refreshes it where it is held, so reuse in RAM keeps it recent there too.
// While RAM keeps such a page (a finished request's path) nothing is copied: a probe asks Redis,
// refreshes a held page, and a lost one is forgotten as written, so RAM letting it go stores it.
// When the queue holds more than max_pending_bytes, new writes are dropped (counted), never
// waited for.
//
// Up (loads). fetch() queues a lookup of consecutive pages by chain hash (the part of a prompt
// the RAM cache lacks); a loader thread asks L2, then L3 for what L2 lacks, checks every blob
// (page_store.h: identity, tokens, checksums; a bad one is dropped from its store, counted as
// corrupt, and ends the hit) and hands back the longest valid prefix. Pages found in L3 are
// written to L2 too. poll() returns finished lookups; install() copies a blob into a pool page.
//
// Hybrid models (a sliding-window layer group in a pool of its own): a page's blob may also
// carry the window group's page of the same position (page_store.h, flag bit 2); the engine
// uses a loaded prefix only as far as its last window's pages carry them. Write-back: with the
// window page when the cache holds one at eviction. Write-through: without, as pages fill; the
// engine writes the last window of what a sequence published again, with them, when it ends
// (Engine::store_finished_path). A write with the window page replaces a stored blob without it,
// never the other way round.
//
// Threading: store()/fetch()/poll()/install() and the listener calls are engine-thread only;
// stats() from any thread.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "kv/disk_store.h"
#include "kv/page_pool.h"
#include "kv/page_store.h"
#include "kv/prefix_cache.h"
#include "kv/redis_store.h"

namespace kv {

struct TierConfig {
  std::string disk_dir;                       // L2; empty: none
  int64_t disk_bytes = int64_t(8) << 30;
  std::vector<std::string> redis;             // L3: redis://host:port addresses; empty: none
  int32_t redis_ttl_s = 0;                    // 0: keys never expire
  int32_t redis_timeout_ms = 1000;            // connect and per-command
  bool write_through = false;                 // false: write-back (on eviction from RAM)
  int32_t min_pages = 2;                      // look below RAM only for at least this many pages
  int64_t max_pending_bytes = int64_t(256) << 20;
  bool enabled() const { return !disk_dir.empty() || !redis.empty(); }
};

// Load latency buckets (seconds) for kvserve:kv_tier_load_seconds.
inline const std::vector<double>& tier_load_buckets() {
  static const std::vector<double> b = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
  return b;
}

struct TierSnapshot {
  TierStats s;
  std::vector<uint64_t> load_counts;  // per tier_load_buckets() bucket, last = +Inf
  double load_sum = 0;
  uint64_t load_count = 0;
  // Corrupt pages found since the log last said so (at most once a minute per tier).
  int64_t corrupt_untold = 0;
  std::chrono::steady_clock::time_point corrupt_told{};
};

class TierManager : public PageListener {
 public:
  // Opens the stores (the disk directory is scanned; Redis is connected lazily, so a Redis that
  // is down at start is an error count, not a failure). key_stats: the pool keeps Quest key
  // summaries, so pages carry them. window: the window group's layout (hybrid models), or null;
  // its format joins the blobs' format tag (format_tag()).
  static Result<std::unique_ptr<TierManager>> create(const TierConfig& cfg, const KvLayout& layout, bool key_stats,
                                                     uint64_t fingerprint, const KvLayout* window = nullptr);
  // The format tag of pages of `layout` (and of `window`'s group beside them): what the prefix
  // cache's chain hash and every blob carry.
  static uint32_t format_tag(const KvLayout& layout, const KvLayout* window);
  ~TierManager() override;  // finishes the queued writes (so a clean stop persists them)

  const TierConfig& config() const { return cfg_; }
  // The pool pages are copied from and into (the engine's global pool).
  void set_pool(const PagePool* pool) { pool_ = pool; }
  // The window group's pool (hybrid models), whose pages go with their positions.
  void set_window_pool(const PagePool* pool) { wpool_ = pool; }
  // Called (from the loader thread) when a lookup finishes: the engine wakes up.
  void set_notify(std::function<void()> f) { notify_ = std::move(f); }

  // PageListener (engine thread): write-through / write-back.
  void page_cached(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens, int32_t page,
                   int32_t wpage = -1) override;
  void page_evicted(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens, int32_t page,
                    int32_t wpage = -1, uint64_t last_use = 0) override;
  void window_page_evicted(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                           int32_t page, int32_t wpage, uint64_t last_use = 0) override;
  // Queues a write of one pool page (e.g. a preempted sequence's pages, swap mode), with the
  // window pool's page wpage of the same position when >= 0. parent: the chain hash of the page
  // before it (PageHash{} for the first). A page the disk holds already is not written again,
  // but its recency there is refreshed, in queue order with the writes. last_use: when the page
  // was last used, on the prefix cache's steady clock (0: now); the disk orders its pages by it.
  // ram_keeps: RAM goes on holding the page (a finished request's path, not an eviction), so a
  // page this process already wrote to Redis is not copied: Redis is only asked (a probe) and
  // refreshes it; one it lost is forgotten as written, and the write when RAM lets it go stores it.
  void store(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens, int32_t page,
             int32_t wpage = -1, uint64_t last_use = 0, bool ram_keeps = false);
  // Queues a refresh of h's recency on disk to last_use (as store()) if the disk holds it.
  void refresh_held(const PageHash& h, uint64_t last_use);
  // A prompt's partly filled last page for another instance (prefill/decode disaggregation): read
  // once, so it goes to the shared store (Redis) alone, never to a local disk. False when it was
  // not queued (no shared store, or the queue is full).
  bool store_tail(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens, int32_t page);
  // Whether some store may hold h (disk: its index; Redis: always).
  bool may_contain(const PageHash& h) const;

  // A lookup of pages [first_page, first_page + hashes.size()) of a prompt: their hashes, and
  // the prompt's tokens from position 0 through the last of those pages. Returns a ticket (> 0).
  // last_is_tail: the last page is a store_tail() page: found, it is removed from its store
  // (read once) and not copied into the disk tier.
  uint64_t fetch(const std::string& ns, std::vector<PageHash> hashes, std::vector<int32_t> tokens, int64_t first_page,
                 bool last_is_tail = false);
  struct Loaded {
    uint64_t ticket = 0;
    std::string ns;
    std::vector<int32_t> tokens;     // as given to fetch()
    int64_t first_page = 0;
    int64_t n_asked = 0;             // pages looked up
    std::vector<std::string> blobs;  // checked blobs of pages first_page, first_page + 1, ... (the longest found run)
    double seconds = 0;
  };
  std::vector<Loaded> poll();
  // Copies a checked blob into `page` of pool (K/V of every layer, key summaries), and its window
  // group's page into wpage of wpool when wpage >= 0. False when the pool keeps key summaries
  // and the blob has none, or a window page is asked for and the blob has none.
  bool install(const std::string& blob, PagePool& pool, int32_t page, PagePool* wpool = nullptr, int32_t wpage = -1);
  // Whether a checked blob carries its position's window-group page.
  static bool has_window(const std::string& blob);
  // Waits until every write queued so far is done (tests, shutdown).
  void flush();
  // Ordered writes: write_mark() names every write queued so far (dropped ones excepted);
  // wait_written(mark) returns once all of them are done (put in every store, or failed there),
  // true, or false after timeout_s. Unlike flush(), later writes do not hold it up: a prefill
  // instance answers once its own pages are down. Any thread.
  uint64_t write_mark() const;
  bool wait_written(uint64_t mark, double timeout_s);
  // Writes that did not reach the shared store (Redis; else the last store): dropped from a full
  // queue, or failed there. Unchanged across a prefill's writes: its pages are all down.
  uint64_t lost_writes() const;

  std::vector<TierSnapshot> stats() const;
  const DiskStore* disk() const { return disk_; }

 private:
  TierManager(const TierConfig& cfg, const KvLayout& layout, bool key_stats, uint64_t fingerprint, const KvLayout* window);
  struct Write {
    PageHash hash;
    PageHash parent;         // the chain hash of the page before (PageHash{}: the first)
    bool touch = false;      // refresh the disk's recency of a page it holds; nothing to write
    int64_t used_ns = 0;     // the page's last use, wall-clock ns (0: when written)
    uint64_t ns_tag = 0;
    std::vector<int32_t> tokens;
    std::string payload;     // page bytes (encoded into a blob by the writer)
    std::string blob;        // or a ready blob (promotion of an L3 hit into L2)
    uint32_t flags = 0;      // the blob's flags (page_store.h)
    int32_t only_store = -1; // >= 0: write to that store alone
    bool if_missing = false; // a page this process wrote or loaded before: Redis stores it only
                             // if it lost it, else refreshes it (PageStore::put_missing)
    bool probe = false;      // Redis alone, no bytes: refresh it if held, else report it lost
    uint64_t seq = 0;        // queue order (write_mark)
    int32_t depth = -1;      // the page's index in its prefix (-1: unknown): grades its Redis TTL
  };
  struct Fetch {
    uint64_t ticket;
    std::string ns;
    std::vector<PageHash> hashes;
    std::vector<int32_t> tokens;
    int64_t first_page;
    bool last_is_tail = false;
  };
  void writer_loop();
  void loader_loop();
  Write page_write(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens, int32_t page,
                   int32_t wpage = -1) const;
  bool queue_write(Write w);  // false: dropped (the queue is full)
  void refresh(const PageHash& h, int64_t used_ns);  // queues a touch of the disk's copy
  // A last use on the prefix cache's steady clock as wall-clock ns (0: none given).
  static int64_t wall_ns(uint64_t last_use);
  PageIdentity identity(uint64_t ns_tag) const;
  int64_t payload_bytes(bool window = false) const;

  TierConfig cfg_;
  KvLayout layout_;
  bool has_window_ = false;
  KvLayout window_layout_;  // when has_window_
  bool key_stats_;
  uint64_t fingerprint_;
  uint32_t format_tag_;
  const PagePool* pool_ = nullptr;
  const PagePool* wpool_ = nullptr;
  std::function<void()> notify_;
  std::vector<std::unique_ptr<PageStore>> stores_;  // L2 first, then L3
  DiskStore* disk_ = nullptr;                       // stores_[0] when there is a disk tier
  RedisStore* redis_ = nullptr;                     // stores_.back() when there is a Redis tier
  // Engine thread: each chain hash's page index in its prefix, learnt from lookups (fetch: the
  // first page's index) and from pages whose parent's is known (bounded). A chain hash covers
  // every token before it, so its depth is a fact, whatever store holds the page.
  std::unordered_map<PageHash, int32_t, PageHashKey> depth_;
  int32_t depth_of(const PageHash& h, const PageHash& parent);  // known, or from the parent's (-1: unknown)
  void remember_depth(const PageHash& h, int64_t depth);
  // Pages this process wrote to (or loaded from) Redis (bounded): written again only as
  // put_missing, since Redis may have lost them since.
  std::unordered_set<PageHash, PageHashKey> written_;
  void forget_lost();                  // engine thread: drops lost_ from written_
  std::vector<PageHash> lost_;         // probes Redis answered missing (writer in, under mu_)
  std::atomic<bool> has_lost_{false};
  std::unordered_set<PageHash, PageHashKey> written_window_;  // of those, with their window page

  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Write> writes_;
  int64_t pending_bytes_ = 0;
  int64_t writes_in_flight_ = 0;
  uint64_t queued_seq_ = 0;  // writes accepted into writes_ so far
  uint64_t done_seq_ = 0;    // writes finished so far (in queue order)
  uint64_t lost_writes_ = 0; // lost_writes()
  std::deque<Fetch> fetches_;
  std::vector<Loaded> loaded_;
  uint64_t next_ticket_ = 1;
  bool stop_ = false;
  std::vector<TierSnapshot> stats_;  // [stores_.size()], under mu_
  std::thread writer_, loader_;
};

}  // namespace kv
