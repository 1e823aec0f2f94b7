// Hot and cold pages of live sequences (--kv-offload-cold): a long sequence keeps only its hot
// pages in RAM; the others live in a spill file on the L2 disk, their Quest key summaries stay
// in RAM, and a page the summaries pick is read back before the attention that needs it.
//
// The buffer-pool idea of the design notes, with Quest (kv_eviction.h) as the access oracle:
//   - Budget: after every run the sequence's resident pages of group 0 (the global layers)
//     fall to --kv-budget tokens. The pages that go down are the least recently read ones
//     (every Quest selection of every layer and KV head stamps the pages it reads), never a sink
//     page, a page of the recent area or the filling page.
//   - Cold entry: the block table holds kColdPage; ColdTable maps the logical page to its slot
//     in the ColdStore. The kernels skip negative entries, so a cold page is never read in place.
//   - Reads: Quest ranks cold pages by their RAM summaries like resident ones; before a layer's
//     attention the model asks the ColdTable to make every page the selection picked resident
//     (ColdTable::fetch: a free pool page, filled from the slot and checked). The attention then
//     reads exactly the pages it would read with everything in RAM: the logits are identical
//     (as long as every fetch finds a free pool page: kvserve:kv_cold_no_room_total stays 0).
//   - Prefetch: the pages ranked just below the selection (the runners-up) are read into RAM
//     buffers by the store's loader thread, one step ahead, so that when the query drifts onto
//     them the fetch is a memcpy instead of a read.
//   - Clean pages: a page's bytes never change once it is full, so a page read back keeps its
//     slot and going down again costs no write.
//   - Runs that do not read sparsely (a prompt chunk longer than the Quest tile) read every page:
//     ColdTable::fetch_all first (the engine keeps such chunks within the budget: a prompt's
//     tokens beyond it are computed in Quest-sized runs).
//
// The spill file is created unlinked (O_TMPFILE, or mkstemp + unlink), so nothing outlives the
// process. Its pages go through the OS page cache: RAM the kernel may reclaim, not RAM the
// process holds.
//
// Threading: everything but stats() and the loader is engine-thread only.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kv/kv_eviction.h"
#include "kv/page_pool.h"

namespace kv {

inline constexpr int32_t kColdPage = -2;  // block-table entry: the page lives in the cold store

struct ColdStats {
  int64_t pages_out = 0;       // pages written to the spill file
  int64_t pages_in = 0;        // pages read back (fetches)
  int64_t prefetch_hits = 0;   // fetches served from a prefetched buffer
  int64_t prefetches = 0;      // runners-up read ahead
  int64_t bytes_out = 0, bytes_in = 0;
  int64_t errors = 0;          // I/O failures and checksum mismatches (the page is then dropped)
  int64_t no_room = 0;         // fetches that found no free pool page (the page was skipped once)
  int64_t room_swaps = 0;      // pages the layer did not read sent down mid-step to make room for a fetch
  int64_t slots_used = 0;      // pages held in the spill file now
  int64_t file_bytes = 0;      // the spill file's size
  double fetch_seconds = 0;    // time spent in fetches (reads and copies)
};

class ColdStore {
 public:
  // dir: where the spill file is made. The pool is group 0's (pages and key summaries).
  static Result<std::unique_ptr<ColdStore>> create(const std::string& dir, PagePool& pool);
  ~ColdStore();
  ColdStore(const ColdStore&) = delete;
  ColdStore& operator=(const ColdStore&) = delete;

  PagePool& pool() { return pool_; }
  // Writes pool page `page` (every layer's K/V) to a new slot with one reference and keeps its
  // key summaries in RAM. -1 when the write failed (counted).
  int32_t put(int32_t page);
  // Fills pool page `page` from the slot (K/V and key summaries). False when the read failed or
  // the bytes do not match the checksum written with them (counted).
  bool get(int32_t slot, int32_t page);
  // Reads the slot ahead into RAM (the loader thread), for a get() soon.
  void prefetch(int32_t slot);
  const uint8_t* key_stats(int32_t slot, int32_t layer) const {
    return stats_.data() + (int64_t(slot) * n_layer_ + layer) * stats_per_layer_;
  }
  void retain(int32_t slot) { ++refs_[slot]; }
  void release(int32_t slot);
  int64_t slots_used() const { return slots_used_; }
  int64_t total_refs() const;  // references held on all slots (integrity checks)
  int64_t slot_bytes() const { return slot_bytes_; }
  ColdStats stats() const;
  void add_no_room() { no_room_.fetch_add(1, std::memory_order_relaxed); }
  void add_room_swap() { room_swaps_.fetch_add(1, std::memory_order_relaxed); }
  // Free pool pages the owner keeps for the running sequences' reads this step (the engine's
  // reserve): a sequence at its cap takes a free page only while more than this many are free.
  void set_keep_free(int64_t n) { keep_free_ = n; }
  int64_t keep_free() const { return keep_free_; }

 private:
  ColdStore(PagePool& pool, int fd);
  void loader_loop();
  bool read_slot(int32_t slot, uint8_t* dst);  // pread of the whole slot
  void copy_in(const uint8_t* src, int32_t slot, int32_t page);

  PagePool& pool_;
  int fd_;
  int32_t n_layer_;
  int64_t stats_per_layer_;  // bytes per (slot, layer): key_stats_bytes_per_page
  int64_t slot_bytes_;
  std::vector<int32_t> refs_;        // per slot (0: free)
  std::vector<uint64_t> checksum_;   // per slot: XXH3-64 of its bytes
  std::vector<uint32_t> gen_;        // per slot: bumped at each put (stale prefetches are dropped)
  std::vector<uint8_t> stats_;      // per slot, per layer: the page's key summaries
  std::vector<int32_t> free_slots_;
  int32_t n_slots_ = 0;              // high-water mark
  int64_t slots_used_ = 0;
  std::vector<uint8_t> buf_;         // engine thread's I/O buffer
  int64_t keep_free_ = 0;

  // Prefetch: requests to the loader; finished buffers by slot (with the slot's generation).
  // Buffers never taken (a runner-up Quest did not pick after all) are dropped oldest first
  // when max_ready_ (at most 64 MiB of buffers) is reached.
  struct Ready { uint32_t gen; uint64_t tick; std::vector<uint8_t> bytes; };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int32_t, uint32_t>> want_;
  std::unordered_map<int32_t, Ready> ready_;
  size_t max_ready_ = 0;
  uint64_t tick_ = 0;
  bool stop_ = false;
  std::thread loader_;

  std::atomic<int64_t> pages_out_{0}, pages_in_{0}, prefetch_hits_{0}, prefetches_{0}, bytes_out_{0}, bytes_in_{0}, errors_{0},
      no_room_{0}, room_swaps_{0}, fetch_ns_{0};
  std::atomic<int64_t> slots_used_pub_{0}, file_bytes_{0};
};

// One sequence's cold pages: its group-0 block table's cold entries and their slots, and when
// each page was last read. Engine-thread only.
class ColdTable {
 public:
  // pages: the owner's group-0 block table (kept in step with it: entries may turn cold or
  // resident, never move). reclaim(n): frees n pool pages if it can (e.g. from the prefix
  // cache); may be empty.
  void attach(ColdStore* store, std::vector<int32_t>* pages, std::function<bool(int32_t)> reclaim = {}) {
    store_ = store;
    pages_ = pages;
    reclaim_ = std::move(reclaim);
  }
  // The most pages the sequence is sure to get during a step (EvictionConfig::cold_cap_pages): at
  // it, a fetch takes a free page only while the pool has more free than the engine keeps for the
  // running sequences' reads (ColdStore::keep_free), else it sends one of its own pages down
  // first, so one sequence does not take the others' room. (Always at the cap, SmolLM2 at 8
  // pages per head on a 256-token budget decoded at half speed: each layer read pages the last
  // had just sent down.)
  void set_cap(int64_t pages) { cap_ = pages; }
  bool attached() const { return store_ != nullptr; }
  int64_t n_cold() const { return n_cold_; }
  const uint8_t* key_stats(int64_t logical, int32_t layer) const { return store_->key_stats(slot_[logical], layer); }

  // Makes logical page i resident: its pool page, or -1 (no free page, or the read failed: then
  // the page is dropped for good and the entry becomes -1, as if evicted). With no free pool
  // page, even after reclaim: after begin_layer, one of the sequence's own resident pages that
  // the layer does not read goes down to make room (room_for); otherwise the page is skipped.
  int32_t fetch(int64_t i);
  // Before a layer's fetches: the query at position pos, and need(i) for every page any of the
  // layer's selections reads. Until the next begin_layer, a fetch may send down a resident page
  // not needed, outside the sinks and the query's recent area, to make room.
  void begin_layer(const EvictionConfig& cfg, int64_t pos);
  void need(int64_t i) {
    if (i >= int64_t(need_.size())) need_.resize(i + 1, 0);
    need_[i] = mark_;
  }
  // Every cold page resident (a run that reads the whole table). False if some could not be.
  bool fetch_all();
  void prefetch(int64_t i) {
    if (i < int64_t(slot_.size()) && slot_[i] >= 0 && (*pages_)[i] == kColdPage) store_->prefetch(slot_[i]);
  }
  // A Quest selection read page i in this step.
  void touch(int64_t i) {
    if (i >= int64_t(last_read_.size())) last_read_.resize(i + 1, -1);
    last_read_[i] = step_;
  }
  void next_step() { ++step_; }
  // After a run with n_tokens positions written: the least recently read resident pages go
  // down until the resident tokens fit cfg.budget (the filling page counts as full). Sink pages,
  // the recent area of the next Quest query and the tail are never moved. Returns the pages moved.
  int64_t offload(const EvictionConfig& cfg, int64_t n_tokens);
  // Gives every slot back (the table's pool pages are the owner's to release).
  void release_all();
  // The owner rolls its table back to n_tokens positions (before it drops the pages past
  // them): slots past the kept pages go back, and a partly kept page, which will be written
  // again, is made resident and loses its slot (its bytes change). False when that page could
  // not come back: the owner must start over.
  bool truncate(int64_t n_tokens);
  // A fork: the child's table is a copy of the parent's; it shares the parent's slots.
  void copy_from(const ColdTable& parent);
  // Every cold entry has a slot and n_cold() counts them; slot references held (added to *refs).
  Status check(int64_t* refs) const;

 private:
  ColdStore* store_ = nullptr;
  std::vector<int32_t>* pages_ = nullptr;
  std::function<bool(int32_t)> reclaim_;
  std::vector<int32_t> slot_;        // per logical page: its slot, or -1
  std::vector<int64_t> last_read_;   // per logical page: the step a selection last read it (-1 never)
  bool room_for();                   // sends one page down for a fetch; false when none may go
  std::vector<uint64_t> need_;       // per logical page: the mark of the last layer that reads it
  uint64_t mark_ = 0;                // the current layer's mark (0: no layer begun: nothing may go)
  int64_t movable_from_ = 0, movable_to_ = 0;  // pages that may go down for room: [from, to)
  int64_t cap_ = INT64_MAX;
  int64_t resident_ = -1;            // resident pages during the current layer (-1: not counted yet)
  int64_t step_ = 0;
  int64_t n_cold_ = 0;
};

}  // namespace kv
