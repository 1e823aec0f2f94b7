#include "kv/cold_store.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace kv {

namespace {

// An unlinked file in dir: O_TMPFILE where the filesystem has it, else mkstemp + unlink.
int open_spill_file(const std::string& dir, std::string* err) {
  int fd = -1;
#ifdef O_TMPFILE
  fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
#endif
  std::string path = dir + "/kvserve-cold-XXXXXX";
  fd = ::mkstemp(path.data());
  if (fd < 0) {
    *err = "cannot create a spill file in " + dir + ": " + std::strerror(errno);
    return -1;
  }
  ::unlink(path.c_str());
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
}

bool pwrite_all(int fd, const uint8_t* p, int64_t n, int64_t off) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, static_cast<size_t>(n), off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= w, off += w;
  }
  return true;
}

bool pread_all(int fd, uint8_t* p, int64_t n, int64_t off) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, static_cast<size_t>(n), off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r, n -= r, off += r;
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<ColdStore>> ColdStore::create(const std::string& dir, PagePool& pool) {
  if (!pool.has_key_stats()) return Status::error("cold pages need the pool's key summaries (Quest sparse reads)");
  std::string err;
  const int fd = open_spill_file(dir.empty() ? "/tmp" : dir, &err);
  if (fd < 0) return Status::error(err);
  return std::unique_ptr<ColdStore>(new ColdStore(pool, fd));
}

ColdStore::ColdStore(PagePool& pool, int fd) : pool_(pool), fd_(fd) {
  const KvLayout& L = pool.layout();
  n_layer_ = L.n_layer;
  stats_per_layer_ = key_stats_bytes_per_page(L);
  slot_bytes_ = L.page_bytes();
  buf_.resize(static_cast<size_t>(slot_bytes_));
  max_ready_ = static_cast<size_t>(std::clamp<int64_t>((int64_t(64) << 20) / std::max<int64_t>(1, slot_bytes_), 4, 256));
  loader_ = std::thread([this] { loader_loop(); });
}

ColdStore::~ColdStore() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  loader_.join();
  ::close(fd_);
}

int32_t ColdStore::put(int32_t page) {
  pool_.read_page(page, buf_.data());
  int32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = n_slots_++;
    refs_.push_back(0);
    checksum_.push_back(0);
    gen_.push_back(0);
    stats_.resize(stats_.size() + size_t(n_layer_ * stats_per_layer_));
  }
  if (!pwrite_all(fd_, buf_.data(), slot_bytes_, int64_t(slot) * slot_bytes_)) {
    free_slots_.push_back(slot);
    errors_.fetch_add(1, std::memory_order_relaxed);
    return -1;
  }
  refs_[slot] = 1;
  ++gen_[slot];
  checksum_[slot] = XXH3_64bits(buf_.data(), static_cast<size_t>(slot_bytes_));
  for (int32_t l = 0; l < n_layer_; ++l)
    std::memcpy(stats_.data() + (int64_t(slot) * n_layer_ + l) * stats_per_layer_, pool_.key_stats(l, page), stats_per_layer_);
  ++slots_used_;
  slots_used_pub_.store(slots_used_, std::memory_order_relaxed);
  file_bytes_.store(int64_t(n_slots_) * slot_bytes_, std::memory_order_relaxed);
  pages_out_.fetch_add(1, std::memory_order_relaxed);
  bytes_out_.fetch_add(slot_bytes_, std::memory_order_relaxed);
  return slot;
}

void ColdStore::copy_in(const uint8_t* src, int32_t slot, int32_t page) {
  pool_.write_page(page, src);
  for (int32_t l = 0; l < n_layer_; ++l) std::memcpy(pool_.key_stats(l, page), key_stats(slot, l), stats_per_layer_);
}

bool ColdStore::read_slot(int32_t slot, uint8_t* dst) { return pread_all(fd_, dst, slot_bytes_, int64_t(slot) * slot_bytes_); }

bool ColdStore::get(int32_t slot, int32_t page) {
  const auto t0 = std::chrono::steady_clock::now();
  Ready ready;
  bool prefetched = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = ready_.find(slot);
    if (it != ready_.end()) {
      if (it->second.gen == gen_[slot]) {
        ready = std::move(it->second);
        prefetched = true;
      }
      ready_.erase(it);
    }
  }
  const uint8_t* src = prefetched ? ready.bytes.data() : buf_.data();
  bool ok = prefetched || read_slot(slot, buf_.data());
  if (ok && XXH3_64bits(src, static_cast<size_t>(slot_bytes_)) != checksum_[slot]) ok = false;
  if (ok) {
    copy_in(src, slot, page);
    pages_in_.fetch_add(1, std::memory_order_relaxed);
    if (prefetched) prefetch_hits_.fetch_add(1, std::memory_order_relaxed);
    else bytes_in_.fetch_add(slot_bytes_, std::memory_order_relaxed);
  } else {
    errors_.fetch_add(1, std::memory_order_relaxed);
  }
  fetch_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
                      std::memory_order_relaxed);
  return ok;
}

void ColdStore::prefetch(int32_t slot) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (ready_.count(slot) || want_.size() >= max_ready_) return;
    for (const auto& w : want_)
      if (w.first == slot) return;
    while (!ready_.empty() && ready_.size() + want_.size() >= max_ready_) {  // the oldest untaken buffer goes
      auto oldest = ready_.begin();
      for (auto it = ready_.begin(); it != ready_.end(); ++it)
        if (it->second.tick < oldest->second.tick) oldest = it;
      ready_.erase(oldest);
    }
    want_.emplace_back(slot, gen_[slot]);
  }
  cv_.notify_one();
}

void ColdStore::loader_loop() {
  std::vector<uint8_t> bytes;
  for (;;) {
    std::pair<int32_t, uint32_t> w;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !want_.empty(); });
      if (stop_) return;
      w = want_.front();
      want_.pop_front();
    }
    // The slot's bytes are fixed while its generation lasts; a read that races with a reuse
    // of the slot is caught by the generation (and the checksum) when it is taken.
    bytes.resize(static_cast<size_t>(slot_bytes_));
    if (!pread_all(fd_, bytes.data(), slot_bytes_, int64_t(w.first) * slot_bytes_)) continue;
    prefetches_.fetch_add(1, std::memory_order_relaxed);
    bytes_in_.fetch_add(slot_bytes_, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lk(mu_);
    ready_[w.first] = Ready{w.second, ++tick_, std::move(bytes)};
    bytes = {};
  }
}

void ColdStore::release(int32_t slot) {
  if (--refs_[slot] > 0) return;
  free_slots_.push_back(slot);
  --slots_used_;
  slots_used_pub_.store(slots_used_, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lk(mu_);
  ready_.erase(slot);
  for (auto it = want_.begin(); it != want_.end();) it = it->first == slot ? want_.erase(it) : std::next(it);
}

int64_t ColdStore::total_refs() const {
  int64_t n = 0;
  for (int32_t r : refs_) n += r;
  return n;
}

ColdStats ColdStore::stats() const {
  ColdStats s;
  s.pages_out = pages_out_.load(std::memory_order_relaxed);
  s.pages_in = pages_in_.load(std::memory_order_relaxed);
  s.prefetch_hits = prefetch_hits_.load(std::memory_order_relaxed);
  s.prefetches = prefetches_.load(std::memory_order_relaxed);
  s.bytes_out = bytes_out_.load(std::memory_order_relaxed);
  s.bytes_in = bytes_in_.load(std::memory_order_relaxed);
  s.errors = errors_.load(std::memory_order_relaxed);
  s.no_room = no_room_.load(std::memory_order_relaxed);
  s.room_swaps = room_swaps_.load(std::memory_order_relaxed);
  s.slots_used = slots_used_pub_.load(std::memory_order_relaxed);
  s.file_bytes = file_bytes_.load(std::memory_order_relaxed);
  s.fetch_seconds = double(fetch_ns_.load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

// ---- ColdTable ----------------------------------------------------------------------------

int32_t ColdTable::fetch(int64_t i) {
  std::vector<int32_t>& pages = *pages_;
  if (pages[i] != kColdPage) return pages[i];
  PagePool& pool = store_->pool();
  if (mark_ != 0 && resident_ < 0) {
    resident_ = 0;
    for (int32_t p : pages) resident_ += p >= 0;
  }
  // at its cap, with no free page to spare, the sequence makes its own room; else a free page, one
  // from the prefix cache, or its own
  const bool own = mark_ != 0 && resident_ >= cap_ && pool.n_free() <= store_->keep_free() && room_for();
  if (!own && pool.n_free() < 1 && !(reclaim_ && reclaim_(1)) && !room_for()) {
    store_->add_no_room();
    return -1;
  }
  std::vector<int32_t> got;
  pool.allocate(1, &got);
  if (!store_->get(slot_[i], got[0])) {  // unreadable: the page is gone, as if evicted
    pool.release(got[0]);
    store_->release(slot_[i]);
    slot_[i] = -1;
    pages[i] = -1;
    --n_cold_;
    return -1;
  }
  pages[i] = got[0];
  --n_cold_;
  if (resident_ >= 0) ++resident_;
  return got[0];
}

void ColdTable::begin_layer(const EvictionConfig& cfg, int64_t pos) {
  const int32_t bs = store_->pool().layout().block_size;
  ++mark_;
  resident_ = -1;
  movable_from_ = cfg.sink_pages(bs);
  // as quest_select: the query's recent area (and the filling page) is always read
  movable_to_ = std::max<int64_t>(0, pos + 1 - cfg.quest_recent(bs)) / bs;
}

bool ColdTable::room_for() {
  if (mark_ == 0) return false;
  std::vector<int32_t>& pages = *pages_;
  PagePool& pool = store_->pool();
  // The least recently read page the layer does not read, held by this sequence alone (a
  // shared page frees nothing); a clean one (its slot still holds its bytes) before one that
  // must be written.
  int64_t best = -1;
  auto key = [&](int64_t i) {
    return std::pair<bool, int64_t>(i >= int64_t(slot_.size()) || slot_[i] < 0, i < int64_t(last_read_.size()) ? last_read_[i] : -1);
  };
  const int64_t to = std::min<int64_t>(movable_to_, pages.size());
  for (int64_t i = movable_from_; i < to; ++i) {
    if (pages[i] < 0 || pool.refcount(pages[i]) != 1 || (i < int64_t(need_.size()) && need_[i] == mark_)) continue;
    if (best < 0 || key(i) < key(best)) best = i;
  }
  if (best < 0) return false;
  if (int64_t(slot_.size()) <= best) slot_.resize(best + 1, -1);
  if (slot_[best] < 0 && (slot_[best] = store_->put(pages[best])) < 0) return false;  // the disk failed
  pool.release(pages[best]);
  pages[best] = kColdPage;
  ++n_cold_;
  if (resident_ >= 0) --resident_;
  store_->add_room_swap();
  return true;
}

bool ColdTable::fetch_all() {
  if (n_cold_ == 0) return true;
  mark_ = 0;  // the run reads every page: none may go down for room
  resident_ = -1;
  bool ok = true;
  for (int64_t i = 0; i < int64_t(pages_->size()); ++i)
    if ((*pages_)[i] == kColdPage) ok = fetch(i) >= 0 && ok;
  return ok;
}

int64_t ColdTable::offload(const EvictionConfig& cfg, int64_t n_tokens) {
  std::vector<int32_t>& pages = *pages_;
  const int32_t bs = store_->pool().layout().block_size;
  const int64_t n_full = std::min<int64_t>(n_tokens / bs, pages.size());
  int64_t resident = bs;  // the filling page counts as full
  for (int64_t i = 0; i < n_full; ++i) resident += pages[i] >= 0 ? bs : 0;
  if (resident <= cfg.budget) return 0;
  // Movable: full pages after the sinks and before the next query's recent area.
  const int64_t first = cfg.sink_pages(bs);
  const int64_t last = std::min<int64_t>(n_full, std::max<int64_t>(0, n_tokens - cfg.quest_recent(bs)) / bs);
  std::vector<int64_t> cand;
  for (int64_t i = first; i < last; ++i)
    if (pages[i] >= 0) cand.push_back(i);
  auto last_read = [&](int64_t i) { return i < int64_t(last_read_.size()) ? last_read_[i] : -1; };
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return last_read(a) < last_read(b); });
  if (int64_t(slot_.size()) < n_full) slot_.resize(n_full, -1);
  int64_t moved = 0;
  for (int64_t i : cand) {
    if (resident <= cfg.budget) break;
    if (slot_[i] < 0) {
      slot_[i] = store_->put(pages[i]);
      if (slot_[i] < 0) break;  // the disk failed: keep the rest in RAM
    }
    store_->pool().release(pages[i]);
    pages[i] = kColdPage;
    ++n_cold_;
    ++moved;
    resident -= bs;
  }
  return moved;
}

void ColdTable::release_all() {
  if (!store_) return;
  for (int32_t& s : slot_)
    if (s >= 0) {
      store_->release(s);
      s = -1;
    }
  slot_.clear();
  last_read_.clear();
  n_cold_ = 0;
}

bool ColdTable::truncate(int64_t n_tokens) {
  if (!store_) return true;
  mark_ = 0;  // no layer runs: the last one's marks say nothing (nothing goes down for room)
  resident_ = -1;
  const int32_t bs = store_->pool().layout().block_size;
  const int64_t n_pages = (n_tokens + bs - 1) / bs;
  if (n_tokens % bs != 0 && n_tokens / bs < int64_t(slot_.size())) {  // the partly kept page
    const int64_t i = n_tokens / bs;
    if (i < int64_t(pages_->size()) && (*pages_)[i] == kColdPage && fetch(i) < 0) return false;
    if (slot_[i] >= 0) {
      store_->release(slot_[i]);
      slot_[i] = -1;
    }
  }
  for (int64_t i = n_pages; i < int64_t(slot_.size()); ++i)
    if (slot_[i] >= 0) {
      if (i < int64_t(pages_->size()) && (*pages_)[i] == kColdPage) --n_cold_;
      store_->release(slot_[i]);
    }
  if (int64_t(slot_.size()) > n_pages) slot_.resize(n_pages);
  if (int64_t(last_read_.size()) > n_pages) last_read_.resize(n_pages);
  return true;
}

Status ColdTable::check(int64_t* refs) const {
  if (!store_) return Status::ok();
  int64_t cold = 0;
  for (size_t i = 0; i < pages_->size(); ++i)
    if ((*pages_)[i] == kColdPage) {
      ++cold;
      if (i >= slot_.size() || slot_[i] < 0) return Status::error("cold page " + std::to_string(i) + " has no slot");
    }
  if (cold != n_cold_) return Status::error("cold table counts " + std::to_string(n_cold_) + " cold pages, holds " + std::to_string(cold));
  for (int32_t s : slot_) *refs += s >= 0;
  return Status::ok();
}

void ColdTable::copy_from(const ColdTable& parent) {
  release_all();
  slot_ = parent.slot_;
  last_read_ = parent.last_read_;
  step_ = parent.step_;
  n_cold_ = parent.n_cold_;
  for (int32_t s : slot_)
    if (s >= 0) store_->retain(s);
}

}  // namespace kv
