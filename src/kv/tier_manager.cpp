#include "kv/tier_manager.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <xxhash.h>

#include "common/units.h"
#include "kv/redis_store.h"

namespace kv {

namespace {
using SteadyClock = std::chrono::steady_clock;
constexpr size_t kWrittenCap = size_t(1) << 20;  // hashes remembered as written everywhere
constexpr size_t kWriteBatch = 16;               // pages per store put (Redis pipelines them)
}  // namespace

uint32_t TierManager::format_tag(const KvLayout& layout, const KvLayout* window) {
  const uint32_t t = layout.format_tag();
  if (!window) return t;
  // Both groups' formats: a blob of one hybrid layout is never read as another's.
  const uint64_t both[2] = {t, window->format_tag()};
  return static_cast<uint32_t>(XXH3_64bits(both, sizeof(both)));
}

Result<std::unique_ptr<TierManager>> TierManager::create(const TierConfig& cfg, const KvLayout& layout, bool key_stats,
                                                         uint64_t fingerprint, const KvLayout* window) {
  std::unique_ptr<TierManager> t(new TierManager(cfg, layout, key_stats, fingerprint, window));
  const PageIdentity id = t->identity(0);
  if (!cfg.disk_dir.empty()) {
    // A budget smaller than one page's blob stores nothing (every write is dropped): refused
    // before the directory is touched. A hybrid model's blob counts its window page, without
    // which a stored prefix cannot be used.
    const std::vector<int32_t> no_tokens(size_t(std::max(layout.block_size, 0)), 0);
    const int64_t header = static_cast<int64_t>(encode_blob(id, PageHash{}, PageHash{}, no_tokens.data(), 0, {}).size());
    const int64_t blob = header + t->payload_bytes(t->has_window_);
    if (cfg.disk_bytes < blob)
      return Result<std::unique_ptr<TierManager>>::error(
          "--kv-disk-bytes " + format_bytes(double(cfg.disk_bytes)) + " is smaller than one page on disk: a page of " +
          std::to_string(layout.block_size) + " tokens is " + format_bytes(double(blob)) + " (" + std::to_string(blob) + " bytes" +
          (t->has_window_ ? ", with its sliding-window layers' page" : "") +
          ") for this model and KV format, so the disk tier would store nothing; give at least that, better room for many "
          "prompts (default 8GiB)");
    auto d = DiskStore::open(cfg.disk_dir, cfg.disk_bytes, id);
    if (!d) return Result<std::unique_ptr<TierManager>>::error(d.message());
    t->disk_ = d->get();
    t->stores_.push_back(std::move(*d));
  }
  if (!cfg.redis.empty()) {
    auto r = RedisStore::create(cfg.redis, id, cfg.redis_ttl_s, cfg.redis_timeout_ms);
    if (!r) return Result<std::unique_ptr<TierManager>>::error(r.message());
    t->redis_ = r->get();
    t->stores_.push_back(std::move(*r));
  }
  t->stats_.resize(t->stores_.size());
  for (size_t i = 0; i < t->stores_.size(); ++i) {
    t->stats_[i].s.tier = t->stores_[i]->name();
    t->stats_[i].load_counts.assign(tier_load_buckets().size() + 1, 0);
  }
  t->writer_ = std::thread([p = t.get()] { p->writer_loop(); });
  t->loader_ = std::thread([p = t.get()] { p->loader_loop(); });
  return t;
}

TierManager::TierManager(const TierConfig& cfg, const KvLayout& layout, bool key_stats, uint64_t fingerprint,
                         const KvLayout* window)
    : cfg_(cfg),
      layout_(layout),
      has_window_(window != nullptr),
      window_layout_(window ? *window : KvLayout{}),
      key_stats_(key_stats),
      fingerprint_(fingerprint),
      format_tag_(format_tag(layout, window)) {}

TierManager::~TierManager() {
  flush();
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  if (loader_.joinable()) loader_.join();
}

PageIdentity TierManager::identity(uint64_t ns_tag) const { return PageIdentity{fingerprint_, format_tag_, layout_.block_size, ns_tag}; }

int64_t TierManager::payload_bytes(bool window) const {
  int64_t b = layout_.page_bytes();
  if (key_stats_) b += int64_t(layout_.n_layer) * key_stats_bytes_per_page(layout_);
  if (window) b += window_layout_.page_bytes();
  return b;
}

// ---- down ---------------------------------------------------------------------------------

void TierManager::page_cached(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                              int32_t page, int32_t) {
  if (redis_) depth_of(h, parent);  // learnt while the parent's is known (write-back writes later, tails first)
  // Without the window page: only a prefix's last window needs it (see above).
  if (cfg_.write_through) store(h, parent, ns, tokens, page);
}

int32_t TierManager::depth_of(const PageHash& h, const PageHash& parent) {
  if (auto it = depth_.find(h); it != depth_.end()) return it->second;
  int32_t d = -1;
  if (parent == PageHash{}) {
    d = 0;
  } else if (auto p = depth_.find(parent); p != depth_.end()) {
    d = p->second + 1;
  }
  if (d >= 0) remember_depth(h, d);
  return d;
}

void TierManager::remember_depth(const PageHash& h, int64_t depth) {
  if (depth > INT32_MAX || depth_.count(h)) return;  // a full map is not cleared for a page it holds
  if (depth_.size() >= kWrittenCap) depth_.clear();
  depth_.emplace(h, static_cast<int32_t>(depth));  // a known depth is never changed: it is a fact of h
}

void TierManager::page_evicted(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                               int32_t page, int32_t wpage, uint64_t last_use) {
  if (!cfg_.write_through) return store(h, parent, ns, tokens, page, wpage, last_use);
  // Written when cached: leaving RAM, its last use there is carried to the disk. Redis may have
  // lost it since: store() asks it (put_missing) and refreshes it there.
  if (disk_ && stores_.size() == 1) {
    if (disk_->may_contain(h)) refresh(h, wall_ns(last_use));
    return;
  }
  store(h, parent, ns, tokens, page, wpage, last_use);
}

// A window page leaving a position still cached (write-back): the blob with it replaces one
// written without.
void TierManager::window_page_evicted(const PageHash& h, const PageHash& parent, const std::string& ns,
                                      const int32_t* tokens, int32_t page, int32_t wpage, uint64_t last_use) {
  if (!cfg_.write_through) store(h, parent, ns, tokens, page, wpage, last_use);
}

int64_t TierManager::wall_ns(uint64_t last_use) {
  if (last_use == 0) return 0;
  const auto steady = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count());
  if (last_use > steady) return 0;  // not this clock's (an injected one): now
  return DiskStore::now_ns() - static_cast<int64_t>(steady - last_use);
}

bool TierManager::may_contain(const PageHash& h) const {
  for (const auto& s : stores_)
    if (s->may_contain(h)) return true;
  return false;
}

void TierManager::forget_lost() {
  if (!has_lost_.load(std::memory_order_acquire)) return;
  std::vector<PageHash> lost;
  {
    std::lock_guard<std::mutex> l(mu_);
    lost.swap(lost_);
    has_lost_.store(false, std::memory_order_relaxed);
  }
  for (const PageHash& h : lost) {
    written_.erase(h);
    written_window_.erase(h);
  }
}

void TierManager::store(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                        int32_t page, int32_t wpage, uint64_t last_use, bool ram_keeps) {
  if (!pool_ || stores_.empty()) return;
  forget_lost();
  const int64_t used = wall_ns(last_use);
  const bool win = wpage >= 0 && wpool_ && has_window_;
  // Already below (with its window page, if this write has one): the disk's index says so
  // exactly (a blob with the window page is the larger), and the disk's copy is then refreshed
  // instead. Redis (the last store) may have lost what this process wrote or loaded: such a page
  // goes down as if_missing (the writer asks Redis first).
  const bool disk_has = disk_ && (win ? disk_->blob_bytes(h) >= payload_bytes(true) : disk_->may_contain(h));
  if (disk_has) refresh(h, used);
  const bool redis = !(disk_ && stores_.size() == 1);
  if (!redis && disk_has) return;
  const int32_t redis_store = static_cast<int32_t>(stores_.size()) - 1;
  const bool if_missing = redis && (win ? written_window_ : written_).count(h) > 0;
  const int32_t depth = redis_ ? depth_of(h, parent) : -1;
  if (if_missing && ram_keeps && (!disk_ || disk_has)) {
    // Nothing to write below RAM unless Redis lost it, and RAM still has the bytes: a probe, no
    // copy (a finished request's path may be hundreds of pages).
    Write w;
    w.hash = h;
    w.ns_tag = namespace_tag(ns);
    w.probe = true;
    w.depth = depth;
    w.only_store = redis_store;
    queue_write(std::move(w));
    return;
  }
  Write w = page_write(h, parent, ns, tokens, page, win ? wpage : -1);
  w.used_ns = used;
  w.depth = depth;
  if (redis) {
    if (disk_has) w.only_store = redis_store;
    w.if_missing = if_missing;
    if (written_.size() >= kWrittenCap) {
      written_.clear();
      written_window_.clear();
    }
    written_.insert(h);
    if (win) written_window_.insert(h);
  }
  queue_write(std::move(w));
}

// A prefix used again in RAM since the disk got it is recent again there. Through the queue, in
// order with the writes (the disk evicts leaves first, so a parent refreshed before its children
// are written is still safe).
void TierManager::refresh(const PageHash& h, int64_t used_ns) {
  if (!disk_) return;
  Write w;
  w.hash = h;
  w.touch = true;
  w.used_ns = used_ns;
  w.only_store = 0;
  queue_write(std::move(w));
}

void TierManager::refresh_held(const PageHash& h, uint64_t last_use) {
  if (disk_ && disk_->may_contain(h)) refresh(h, wall_ns(last_use));
}

bool TierManager::store_tail(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                             int32_t page) {
  const int32_t shared = static_cast<int32_t>(stores_.size()) - 1;  // L3 (Redis) is the last store
  if (!pool_ || shared < 0 || stores_[shared].get() == disk_) return false;
  Write w = page_write(h, parent, ns, tokens, page);
  w.only_store = shared;
  w.depth = depth_of(h, parent);
  return queue_write(std::move(w));
}

TierManager::Write TierManager::page_write(const PageHash& h, const PageHash& parent, const std::string& ns,
                                           const int32_t* tokens, int32_t page, int32_t wpage) const {
  Write w;
  w.hash = h;
  w.parent = parent;
  w.ns_tag = namespace_tag(ns);
  w.tokens.assign(tokens, tokens + layout_.block_size);
  const bool win = wpage >= 0 && wpool_ && has_window_;
  w.flags = (key_stats_ ? kBlobFlagKeyStats : 0) | (win ? kBlobFlagWindow : 0);
  w.payload.resize(static_cast<size_t>(payload_bytes(win)));
  char* dst = w.payload.data();
  pool_->read_page(page, reinterpret_cast<uint8_t*>(dst));
  dst += layout_.page_bytes();
  if (key_stats_) {
    const size_t bb = size_t(key_stats_bytes_per_page(layout_));
    for (int32_t l = 0; l < layout_.n_layer; ++l, dst += bb) std::memcpy(dst, pool_->key_stats(l, page), bb);
  }
  if (win) wpool_->read_page(wpage, reinterpret_cast<uint8_t*>(dst));
  return w;
}

bool TierManager::queue_write(Write w) {
  const int64_t bytes = static_cast<int64_t>(w.payload.size() + w.blob.size());
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!w.touch && pending_bytes_ + bytes > cfg_.max_pending_bytes) {  // a refresh costs nothing: never dropped
      for (size_t i = 0; i < stores_.size(); ++i)
        if (w.only_store < 0 || w.only_store == static_cast<int32_t>(i)) ++stats_[i].s.write_drops;
      // written_ is the engine thread's: only its own writes (store()) were added there; a
      // promotion (only_store >= 0) is queued by the loader thread, which must not touch it.
      if (w.only_store < 0) written_.erase(w.hash);
      if (!w.touch) ++lost_writes_;
      return false;
    }
    pending_bytes_ += bytes;
    w.seq = ++queued_seq_;
    writes_.push_back(std::move(w));
  }
  cv_.notify_all();
  return true;
}

void TierManager::writer_loop() {
  for (;;) {
    std::vector<Write> batch;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !writes_.empty(); });
      if (writes_.empty()) return;  // stop_ and nothing left
      while (!writes_.empty() && batch.size() < kWriteBatch) {
        batch.push_back(std::move(writes_.front()));
        writes_.pop_front();
      }
      writes_in_flight_ += static_cast<int64_t>(batch.size());
    }
    int64_t batch_bytes = 0;
    std::vector<PageHash> hashes;
    std::vector<std::string> blobs;
    std::vector<uint64_t> tags;
    std::vector<int32_t> only;
    std::vector<int64_t> used;
    std::vector<char> missing;  // if_missing
    std::vector<PageHash> touches;  // pages the disk holds, to refresh there
    std::vector<int64_t> touch_used;
    std::vector<PageHash> probes;   // pages RAM keeps, to ask Redis about
    std::vector<uint64_t> probe_tags;
    std::vector<int32_t> depths, probe_depths;  // page indices in their prefixes (Redis TTLs)
    for (Write& w : batch) {
      batch_bytes += static_cast<int64_t>(w.payload.size() + w.blob.size());
      if (w.touch) {
        touches.push_back(w.hash);
        touch_used.push_back(w.used_ns);
        continue;
      }
      if (w.probe) {
        probes.push_back(w.hash);
        probe_tags.push_back(w.ns_tag);
        probe_depths.push_back(w.depth);
        continue;
      }
      if (w.blob.empty())
        w.blob = encode_blob(identity(w.ns_tag), w.hash, w.parent, w.tokens.data(), w.flags,
                             std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w.payload.data()), w.payload.size()));
      hashes.push_back(w.hash);
      tags.push_back(w.ns_tag);
      blobs.push_back(std::move(w.blob));
      only.push_back(w.only_store);
      used.push_back(w.used_ns);
      missing.push_back(w.if_missing);
      depths.push_back(w.depth);
    }
    // Refreshes before the batch's writes: a put trims the store to its budget at its end, and a
    // page refreshed after that trim could already have gone as old (a clean stop refreshes
    // and writes a whole RAM cache in one stream).
    if (disk_ && !touches.empty()) disk_->touch(touches, touch_used);
    for (size_t i = 0; i < stores_.size(); ++i) {
      const bool is_disk = stores_[i].get() == disk_;
      for (const bool if_missing : {false, true}) {  // Redis: plain writes, then put_missing
        if (is_disk && if_missing) continue;
        std::vector<PageHash> hs;
        std::vector<uint64_t> ts;
        std::vector<std::string> bs;
        std::vector<int64_t> us;
        std::vector<int32_t> ds;
        for (size_t k = 0; k < hashes.size(); ++k)
          if ((only[k] < 0 || only[k] == static_cast<int32_t>(i)) && (is_disk || bool(missing[k]) == if_missing)) {
            hs.push_back(hashes[k]);
            ts.push_back(tags[k]);
            bs.push_back(blobs[k]);
            us.push_back(used[k]);
            ds.push_back(depths[k]);
          }
        if (hs.empty()) continue;
        const bool is_redis = stores_[i].get() == redis_;
        std::vector<PageStore::PutResult> res;
        if (if_missing) {
          res = is_redis ? redis_->put_missing(hs, ts, bs, ds) : stores_[i]->put_missing(hs, ts, bs);
        } else {
          // The disk orders its pages by their last use, not by when they reach it; Redis grades
          // their TTLs by depth.
          const std::vector<bool> ok = is_disk ? disk_->put(hs, ts, bs, us) : is_redis ? redis_->put(hs, ts, bs, ds) : stores_[i]->put(hs, ts, bs);
          for (bool o : ok) res.push_back(o ? PageStore::PutResult::kStored : PageStore::PutResult::kFailed);
        }
        std::lock_guard<std::mutex> l(mu_);
        TierStats& st = stats_[i].s;
        for (size_t k = 0; k < hs.size(); ++k) {  // only what the store took counts as written
          if (res[k] == PageStore::PutResult::kStored) {
            ++st.pages_written;
            st.bytes_out += static_cast<int64_t>(bs[k].size());
          } else if (res[k] == PageStore::PutResult::kHeld) {
            ++st.pages_refreshed;
          } else {
            ++st.write_drops;
            if (i + 1 == stores_.size()) ++lost_writes_;  // the shared store (Redis is the last)
          }
        }
      }
    }
    if (!probes.empty()) {  // Redis is the last store
      const std::vector<std::string> none(probes.size());
      const auto res = redis_ ? redis_->put_missing(probes, probe_tags, none, probe_depths)
                              : stores_.back()->put_missing(probes, probe_tags, none);
      std::lock_guard<std::mutex> l(mu_);
      for (size_t k = 0; k < probes.size(); ++k) {
        if (res[k] == PageStore::PutResult::kHeld) ++stats_.back().s.pages_refreshed;
        if (res[k] == PageStore::PutResult::kMissing) lost_.push_back(probes[k]);
      }
      if (!lost_.empty()) has_lost_.store(true, std::memory_order_release);
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      pending_bytes_ -= batch_bytes;
      writes_in_flight_ -= static_cast<int64_t>(batch.size());
      done_seq_ = batch.back().seq;  // FIFO: everything queued up to it is done
    }
    done_cv_.notify_all();
  }
}

void TierManager::flush() {
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return writes_.empty() && writes_in_flight_ == 0; });
}

uint64_t TierManager::write_mark() const {
  std::lock_guard<std::mutex> l(mu_);
  return queued_seq_;
}

uint64_t TierManager::lost_writes() const {
  std::lock_guard<std::mutex> l(mu_);
  return lost_writes_;
}

bool TierManager::wait_written(uint64_t mark, double timeout_s) {
  std::unique_lock<std::mutex> l(mu_);
  return done_cv_.wait_for(l, std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)), [&] { return done_seq_ >= mark; });
}

// ---- up -----------------------------------------------------------------------------------

uint64_t TierManager::fetch(const std::string& ns, std::vector<PageHash> hashes, std::vector<int32_t> tokens, int64_t first_page,
                            bool last_is_tail) {
  if (redis_)
    for (size_t i = 0; i < hashes.size(); ++i) remember_depth(hashes[i], first_page + int64_t(i));
  uint64_t t;
  {
    std::lock_guard<std::mutex> l(mu_);
    t = next_ticket_++;
    fetches_.push_back(Fetch{t, ns, std::move(hashes), std::move(tokens), first_page, last_is_tail});
  }
  cv_.notify_all();
  return t;
}

std::vector<TierManager::Loaded> TierManager::poll() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<Loaded> out;
  out.swap(loaded_);
  return out;
}

void TierManager::loader_loop() {
  for (;;) {
    Fetch f;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !fetches_.empty(); });
      if (stop_) return;
      f = std::move(fetches_.front());
      fetches_.pop_front();
    }
    const auto t0 = SteadyClock::now();
    const PageIdentity id = identity(namespace_tag(f.ns));
    const int32_t bs = layout_.block_size;
    Loaded out;
    out.ticket = f.ticket;
    out.ns = f.ns;
    out.first_page = f.first_page;
    out.n_asked = static_cast<int64_t>(f.hashes.size());
    size_t have = 0;  // pages found so far, in order
    for (size_t i = 0; i < stores_.size() && have < f.hashes.size(); ++i) {
      const auto ts = SteadyClock::now();
      std::span<const PageHash> want(f.hashes.data() + have, f.hashes.size() - have);
      std::vector<std::optional<std::string>> got =
          stores_[i].get() == redis_ ? redis_->get(id.ns_tag, want, f.first_page + int64_t(have)) : stores_[i]->get(id.ns_tag, want);
      int64_t hits = 0, bytes = 0, corrupt = 0;
      const size_t before = have;
      for (size_t k = 0; k < got.size() && got[k]; ++k) {
        const size_t pos = have;
        const BlobCheck c = check_blob(*got[k], id, f.hashes[pos], f.tokens.data() + (f.first_page + int64_t(pos)) * bs);
        if (c != BlobCheck::kOk) {
          stores_[i]->remove(id.ns_tag, f.hashes[pos]);
          ++corrupt;
          break;
        }
        const bool tail = f.last_is_tail && pos + 1 == f.hashes.size();
        if (tail) stores_[i]->remove(id.ns_tag, f.hashes[pos]);  // read once
        // A page found below L2 is written to L2 as well (promotion).
        if (i > 0 && disk_ && !tail) {
          Write w;
          w.hash = f.hashes[pos];
          w.ns_tag = id.ns_tag;
          w.blob = *got[k];
          w.only_store = 0;
          queue_write(std::move(w));
        }
        bytes += static_cast<int64_t>(got[k]->size());
        out.blobs.push_back(std::move(*got[k]));
        ++hits;
        ++have;
      }
      const double sec = std::chrono::duration<double>(SteadyClock::now() - ts).count();
      std::lock_guard<std::mutex> l(mu_);
      TierSnapshot& st = stats_[i];
      st.s.hits += hits;
      st.s.bytes_in += bytes;
      st.s.corrupt += corrupt;
      st.corrupt_untold += corrupt;
      if (st.corrupt_untold > 0 && (st.corrupt_told == SteadyClock::time_point{} || SteadyClock::now() - st.corrupt_told > std::chrono::minutes(1))) {
        // the counter alone would not say that a tier is handing back damaged pages
        std::fprintf(stderr, "kv tier: %s: %lld stored pages failed their checks (corrupt, truncated or not the page asked for) "
                     "since this was last told: removed, their tokens recomputed (kvserve:kv_tier_corrupt_total)\n",
                     stores_[i]->name(), static_cast<long long>(st.corrupt_untold));
        st.corrupt_untold = 0;
        st.corrupt_told = SteadyClock::now();
      }
      if (have < f.hashes.size()) ++st.s.misses;  // the lookup ended (or moved on) here
      if (have > before) {
        const auto& b = tier_load_buckets();
        const size_t k = std::lower_bound(b.begin(), b.end(), sec) - b.begin();
        ++st.load_counts[k];
        st.load_sum += sec;
        ++st.load_count;
      }
    }
    out.seconds = std::chrono::duration<double>(SteadyClock::now() - t0).count();
    out.tokens = std::move(f.tokens);
    {
      std::lock_guard<std::mutex> l(mu_);
      loaded_.push_back(std::move(out));
    }
    if (notify_) notify_();
  }
}

bool TierManager::has_window(const std::string& blob) {
  BlobHeader h;
  return decode_header(blob, &h) == BlobCheck::kOk && (h.flags & kBlobFlagWindow) != 0;
}

bool TierManager::install(const std::string& blob, PagePool& pool, int32_t page, PagePool* wpool, int32_t wpage) {
  BlobHeader h;
  if (decode_header(blob, &h) != BlobCheck::kOk) return false;
  const bool has_stats = (h.flags & kBlobFlagKeyStats) != 0;
  const bool has_win = (h.flags & kBlobFlagWindow) != 0;
  if (pool.has_key_stats() && !has_stats) return false;
  if (wpage >= 0 && (!wpool || !has_win)) return false;
  const KvLayout& L = pool.layout();
  const char* src = blob.data() + h.header_bytes;
  const int64_t kv_bytes = L.page_bytes();
  const int64_t bb = key_stats_bytes_per_page(L);
  const int64_t w_bytes = has_win ? (wpool ? wpool->layout().page_bytes() : window_layout_.page_bytes()) : 0;
  if (int64_t(h.payload_bytes) != kv_bytes + (has_stats ? int64_t(L.n_layer) * bb : 0) + w_bytes) return false;
  written_.insert(h.hash);  // it came from below: no need to write it back
  if (has_win) written_window_.insert(h.hash);
  pool.write_page(page, reinterpret_cast<const uint8_t*>(src));
  src += kv_bytes;
  if (has_stats) {
    if (pool.has_key_stats())
      for (int32_t l = 0; l < L.n_layer; ++l) std::memcpy(pool.key_stats(l, page), src + l * bb, bb);
    src += int64_t(L.n_layer) * bb;
  }
  if (wpage >= 0) wpool->write_page(wpage, reinterpret_cast<const uint8_t*>(src));
  return true;
}

std::vector<TierSnapshot> TierManager::stats() const {
  std::vector<TierSnapshot> out;
  {
    std::lock_guard<std::mutex> l(mu_);
    out = stats_;
  }
  for (size_t i = 0; i < stores_.size(); ++i) stores_[i]->fill_stats(&out[i].s);
  return out;
}

}  // namespace kv
