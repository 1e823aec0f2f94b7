// DiskStore: L2, pages as files in a local directory, surviving restarts.
//
// Layout: DIR/<fingerprint:016x>-<format tag:08x>/<first 2 hex digits>/<hash hex>.kvp, one blob
// (page_store.h) per file, so another model or KV format never shares a file name. A write goes
// to DIR/.../tmp/ and is renamed into place: a crash mid-write leaves only a temp file, which the
// next start deletes. At start the directory is scanned and every file's header checked (a
// corrupt or foreign one is deleted); the index (hash -> size, recency) lives in RAM, recency
// starting from the files' modification times. Over the byte budget, pages are deleted leaves
// first, and among leaves those a lookup cannot reach from the disk alone (an ancestor is
// missing) before the others: a page another stored page continues (its blob names the parent's chain hash, blob
// version 2) is never deleted before it, so a prefix loses its tail, never its head (which would
// leave the rest unreachable: a lookup stops at the first gap), however its pages came: in one
// batch, over several turns, children before parents (write-back evicts RAM's leaves first), or
// after a restart. Among leaves, the least recently used goes first. Pages whose parent is
// unknown (version 1 blobs) are leaves; a batch is refreshed last page first, so that such a
// prefix's head is still its most recent page. The budget is enforced at the end of each put
// (a batch may pass it for a moment).
//
// The directory removed while the store is open (rm -rf DIR): each put first checks that tmp/
// and the lock file it holds are still there, and a read, write or refresh failing with ENOENT
// checks it too (a page whose file alone is gone leaves the index). Either way the store recreates tmp/ and the lock file, takes the lock again, drops the
// index entries whose files are gone, says so on stderr, and goes on storing. Should another
// process have locked the recreated directory meanwhile, the store turns itself off (every put a
// drop, every get a miss) rather than share it. Other write and read failures are told on
// stderr once per kind (errno), as the Redis store tells its errors.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/page_store.h"

namespace kv {

struct PageHashKey {
  size_t operator()(const PageHash& h) const { return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)); }
};

class DiskStore : public PageStore {
 public:
  // Opens (creating) dir for pages of `id` (ns_tag unused). Fails when the directory cannot be
  // created or written.
  // Fails when the directory cannot be created or written, or when another store (another
  // kvserve process) has it open: its subdirectory is locked (flock) while this store lives;
  // two servers on one directory deleted each other's pages and believed their own index. Says
  // on stderr when the directory also holds other models' or formats' pages (not counted in
  // max_bytes, never read here).
  static Result<std::unique_ptr<DiskStore>> open(const std::string& dir, int64_t max_bytes, const PageIdentity& id);
  ~DiskStore() override;

  const char* name() const override { return "disk"; }
  std::vector<bool> put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs) override;
  // put(), each page last used at used_ns[i] (wall-clock ns; empty, or 0 for a page: now). A
  // page's recency here is when it was last used, not when it was written: a clean stop writes
  // a RAM cache's old pages before its newest ones, and write-back writes a page when RAM drops
  // it, long after its use.
  std::vector<bool> put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs,
                        std::span<const int64_t> used_ns);
  std::vector<std::optional<std::string>> get(uint64_t ns_tag, std::span<const PageHash> hashes) override;
  bool may_contain(const PageHash& h) const override;
  void remove(uint64_t ns_tag, const PageHash& h) override;
  void fill_stats(TierStats* s) const override;
  // Marks the pages it holds of hashes as used at used_ns[i] (wall-clock ns; empty, or 0: now),
  // in order, unless it knows a later use (and sets their files' times, which the next start
  // reads): the tier manager's refresh of a page RAM let go again.
  void touch(std::span<const PageHash> hashes, std::span<const int64_t> used_ns = {});
  static int64_t now_ns();  // wall clock

  const std::string& root() const { return root_; }
  std::string path_of(const PageHash& h) const;  // where the page's file is (or would be)
  int64_t blob_bytes(const PageHash& h) const;   // the stored blob's size, -1 when absent
  int64_t n_pages() const;
  int64_t bytes() const;
  int64_t dropped_at_open() const { return dropped_at_open_; }

 private:
  DiskStore(std::string root, int64_t max_bytes, int lock_fd) : root_(std::move(root)), max_bytes_(max_bytes), lock_fd_(lock_fd) {}
  void scan(const PageIdentity& id);
  // Under mu_: index bookkeeping.
  struct Entry;
  void add_locked(const PageHash& h, int64_t bytes, const PageHash& parent, int64_t used_ns);
  void link_locked(const PageHash& h, const PageHash& parent);
  void file_leaf(const PageHash& h, const Entry& e);
  void unfile_leaf(const Entry& e);
  void set_reach(const PageHash& h, bool reach);
  // Recency used_ns unless the page's is later (ties: this call is the more recent).
  void touch_locked(const PageHash& h, int64_t used_ns);
  void erase_locked(const PageHash& h);  // index and file
  // The directory's health (rm -rf while serving; see the header). Under mu_: whether tmp/ is
  // there and root/lock is still the file lock_fd_ holds.
  bool root_intact_locked() const;
  // Under mu_: recreates tmp/ and the lock (flock'd again), drops the index entries whose files
  // are gone, tells stderr once. False when the store cannot write there (yet) or is off.
  bool recover_locked();
  // Under mu_: one stderr line per kind (what failed and its errno), then quiet.
  void tell_failure_locked(const char* what, int err, const char* then);
  // Deletes leaves (those in lost_ first), least recently used first, while the store holds more than max_bytes (and
  // more than keep pages). Returns the bytes freed.
  int64_t trim_locked(int64_t max_bytes, size_t keep = 1);

  // Recency: the last use (wall-clock ns), then the order this store learnt of it.
  using Tick = std::pair<int64_t, uint64_t>;
  struct Entry {
    int64_t bytes;
    Tick tick;        // recency (larger: more recent); the key in leaves_ or lost_ when a leaf
    PageHash parent;  // PageHash{}: a first page, or not known
    bool reach;       // every ancestor is stored
  };
  std::string root_;
  int64_t max_bytes_;
  int lock_fd_ = -1;  // flock'd root/lock, held for the store's life
  mutable std::mutex mu_;
  std::unordered_map<PageHash, Entry, PageHashKey> index_;
  // The stored pages naming each hash as their parent (whether that page is stored or not:
  // write-back writes children first). Only hashes with at least one.
  std::unordered_map<PageHash, std::vector<PageHash>, PageHashKey> children_;
  // Stored pages no stored page continues, by tick (oldest first): reachable from a first page
  // through stored pages, or not (lost_: an ancestor is missing; deleted first over budget).
  std::map<Tick, PageHash> leaves_, lost_;
  uint64_t seq_ = 0;
  int64_t bytes_ = 0;
  int64_t errors_ = 0;
  int64_t dropped_at_open_ = 0;  // corrupt / foreign / temp files deleted by scan()
  uint64_t tmp_counter_ = 0;
  // Another process locked the directory after it was removed under this store: it is off.
  bool off_ = false;
  std::set<std::string> told_;  // failure kinds already told on stderr
};

}  // namespace kv
