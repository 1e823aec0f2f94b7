// DiskStore: L2, pages as files in a local directory, surviving restarts.
//
// Layout: DIR/<fingerprint:016x>-<format tag:08x>/<first 2 hex digits>/<hash hex>.kvp, one blob
// (page_store.h) per file, so another model or KV format never shares a file name. A write goes
// to DIR/.../tmp/ and is renamed into place: a crash mid-write leaves only a temp file, which the
// next start deletes. At start the directory is scanned and every file's header checked (a
// corrupt or foreign one is deleted); the index (hash -> size, recency) lives in RAM, recency
// starting from the files' modification times. LRU by bytes: a put past the byte budget
// deletes the least recently used files first. A batch (a prefix's pages in chain order) is
// written and refreshed last page first, so a prefix loses its tail, never its head (which would
// leave the rest unreachable: a lookup stops at the first gap). Across batches plain LRU holds:
// a prefix extended later (a new turn) can still lose its head before its newer pages.
#pragma once
#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>

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
  std::vector<std::optional<std::string>> get(uint64_t ns_tag, std::span<const PageHash> hashes) override;
  bool may_contain(const PageHash& h) const override;
  void remove(uint64_t ns_tag, const PageHash& h) override;
  void fill_stats(TierStats* s) const override;

  const std::string& root() const { return root_; }
  std::string path_of(const PageHash& h) const;  // where the page's file is (or would be)
  int64_t blob_bytes(const PageHash& h) const;   // the stored blob's size, -1 when absent
  int64_t n_pages() const;
  int64_t bytes() const;
  int64_t dropped_at_open() const { return dropped_at_open_; }

 private:
  DiskStore(std::string root, int64_t max_bytes, int lock_fd) : root_(std::move(root)), max_bytes_(max_bytes), lock_fd_(lock_fd) {}
  void scan(const PageIdentity& id);
  void erase_locked(const PageHash& h);  // index and file

  struct Entry {
    int64_t bytes;
    std::list<PageHash>::iterator lru;  // position in lru_ (front: oldest)
  };
  std::string root_;
  int64_t max_bytes_;
  int lock_fd_ = -1;  // flock'd root/lock, held for the store's life
  mutable std::mutex mu_;
  std::unordered_map<PageHash, Entry, PageHashKey> index_;
  std::list<PageHash> lru_;
  int64_t bytes_ = 0;
  int64_t errors_ = 0;
  int64_t dropped_at_open_ = 0;  // corrupt / foreign / temp files deleted by scan()
  uint64_t tmp_counter_ = 0;
};

}  // namespace kv
