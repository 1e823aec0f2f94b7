#include "kv/disk_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

namespace kv {

namespace fs = std::filesystem;

namespace {
bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Up to max_bytes of the file (all of it when max_bytes < 0); nullopt when it cannot be read.
std::optional<std::string> read_file(const std::string& path, int64_t max_bytes = -1) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  size_t n = static_cast<size_t>(st.st_size);
  if (max_bytes >= 0) n = std::min<size_t>(n, static_cast<size_t>(max_bytes));
  std::string s(n, '\0');
  size_t off = 0;
  while (off < n) {
    const ssize_t r = ::read(fd, s.data() + off, n - off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    off += static_cast<size_t>(r);
  }
  ::close(fd);
  s.resize(off);
  return s;
}

// A file's time as ns since the epoch (the recency the next start reads back).
int64_t file_ns(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return 0;
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// Sets the file's modification time; 0, or the errno (ENOENT: the file is gone).
int set_file_ns(const std::string& path, int64_t ns) {
  const timespec t[2] = {{0, UTIME_OMIT}, {static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)}};
  return ::utimensat(AT_FDCWD, path.c_str(), t, 0) == 0 ? 0 : errno;
}

// Opens lock_path (creating it) and takes its flock, writing our pid into it. -1 when that fails:
// *err is open's errno, or EWOULDBLOCK when the lock is not ours (another process holds it:
// *holder is the pid it wrote, "" when none).
int take_lock(const std::string& lock_path, int* err, std::string* holder) {
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    *err = EWOULDBLOCK;  // any failure to lock: taken as held (as it always was)
    char pid[32] = {0};
    (void)!::pread(fd, pid, sizeof pid - 1, 0);
    *holder = pid;
    ::close(fd);
    return -1;
  }
  const std::string me = std::to_string(::getpid());
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, me.data(), me.size(), 0);
  return fd;
}

bool parse_hex_hash(const std::string& stem, PageHash* h) {
  if (stem.size() != 32) return false;
  for (char c : stem)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  h->hi = std::stoull(stem.substr(0, 16), nullptr, 16);
  h->lo = std::stoull(stem.substr(16), nullptr, 16);
  return true;
}
}  // namespace

Result<std::unique_ptr<DiskStore>> DiskStore::open(const std::string& dir, int64_t max_bytes, const PageIdentity& id) {
  char sub[40];
  std::snprintf(sub, sizeof sub, "%016llx-%08x", static_cast<unsigned long long>(id.fingerprint), id.format_tag);
  const std::string root = (fs::path(dir) / sub).string();
  std::error_code ec;
  fs::create_directories(fs::path(root) / "tmp", ec);
  if (ec) return Result<std::unique_ptr<DiskStore>>::error("--kv-disk-dir " + dir + ": cannot create " + root + ": " + ec.message());
  if (::access(root.c_str(), W_OK) != 0)
    return Result<std::unique_ptr<DiskStore>>::error("--kv-disk-dir " + dir + ": " + root + " is not writable");
  const std::string lock_path = root + "/lock";
  int err = 0;
  std::string pid;
  const int fd = take_lock(lock_path, &err, &pid);
  if (fd < 0 && err != EWOULDBLOCK)
    return Result<std::unique_ptr<DiskStore>>::error("--kv-disk-dir " + dir + ": cannot open " + lock_path + ": " + std::strerror(err));
  if (fd < 0)
    return Result<std::unique_ptr<DiskStore>>::error(
        "--kv-disk-dir " + dir + " is in use by another kvserve process" + (!pid.empty() ? " (pid " + pid + ")" : std::string()) +
        " for this model and KV format: give each server its own directory (servers share pages through --kv-redis)");
  std::unique_ptr<DiskStore> s(new DiskStore(root, max_bytes, fd));
  s->scan(id);
  // Other models' or formats' pages share the directory but not the budget: say so.
  int64_t other_bytes = 0;
  int n_other = 0;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_directory(ec) || e.path() == fs::path(root)) continue;
    ++n_other;
    for (const auto& f : fs::recursive_directory_iterator(e.path(), ec))
      if (f.is_regular_file(ec) && f.path().extension() == ".kvp") other_bytes += static_cast<int64_t>(f.file_size(ec));
  }
  if (n_other > 0 && other_bytes > 0)
    std::fprintf(stderr, "kv tier: %s also holds %d other models' or KV formats' page directories (%.1f MiB), outside --kv-disk-bytes "
                 "and never read by this server; delete them to free the space\n",
                 dir.c_str(), n_other, double(other_bytes) / (1 << 20));
  return s;
}

DiskStore::~DiskStore() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

bool DiskStore::root_intact_locked() const {
  // access(), not stat(), on tmp/: a stat marks the directory's times as seen, and the kernel
  // (multigrain timestamps) then gives the next file made in it a fine-grained time, which
  // changes which of two pages written in one batch looks older to the next start's scan.
  struct stat held, now;
  return ::access((root_ + "/tmp/.").c_str(), F_OK) == 0 && lock_fd_ >= 0 && ::fstat(lock_fd_, &held) == 0 &&
         ::stat((root_ + "/lock").c_str(), &now) == 0 && held.st_dev == now.st_dev && held.st_ino == now.st_ino;
}

bool DiskStore::recover_locked() {
  if (off_) return false;
  if (root_intact_locked()) return true;
  const bool dir_gone = ::access((root_ + "/tmp/.").c_str(), F_OK) != 0;
  std::error_code ec;
  fs::create_directories(fs::path(root_) / "tmp", ec);
  if (ec) {
    ++errors_;
    tell_failure_locked("recreating the removed directory", ec.value(), "pages are not stored until it can be");
    return false;
  }
  struct stat held, now;
  const std::string lock_path = root_ + "/lock";
  if (!(::fstat(lock_fd_, &held) == 0 && ::stat(lock_path.c_str(), &now) == 0 && held.st_dev == now.st_dev && held.st_ino == now.st_ino)) {
    int err = 0;
    std::string pid;
    const int fd = take_lock(lock_path, &err, &pid);
    if (fd < 0 && err != EWOULDBLOCK) {
      ++errors_;
      tell_failure_locked("recreating the lock file", err, "pages are not stored until it can be");
      return false;
    }
    if (fd < 0) {  // another server took the directory meanwhile: it is theirs now
      ++errors_;
      std::fprintf(stderr, "kv tier: %s was removed while this server used it, and another kvserve process%s has locked it since: "
                   "this server's disk tier is off (pages are neither stored nor read there; give each server its own --kv-disk-dir)\n",
                   root_.c_str(), pid.empty() ? "" : (" (pid " + pid + ")").c_str());
      off_ = true;
      index_.clear();  // never read, refreshed or deleted here again: the files are the other's
      children_.clear();
      leaves_.clear();
      lost_.clear();
      bytes_ = 0;
      ::close(lock_fd_);
      lock_fd_ = -1;
      return false;
    }
    ::close(lock_fd_);  // the old lock's file is gone: no other process can take it
    lock_fd_ = fd;
  }
  // The index still lists what was removed: drop those entries (their files are gone).
  const size_t before = index_.size();
  std::vector<PageHash> gone;
  for (const auto& [h, e] : index_)
    if (::access(path_of(h).c_str(), F_OK) != 0 && errno == ENOENT) gone.push_back(h);
  for (const PageHash& h : gone) erase_locked(h);
  ++errors_;
  std::fprintf(stderr, "kv tier: %s was removed while in use (%zu of its %zu pages gone with it): recreated %s and took the lock "
               "again; pages are stored there again\n",
               dir_gone ? root_.c_str() : (root_ + "/lock").c_str(), gone.size(), before, dir_gone ? "it" : "the lock file");
  return true;
}

void DiskStore::tell_failure_locked(const char* what, int err, const char* then) {
  if (!told_.insert(std::string(what) + ":" + std::to_string(err)).second) return;
  std::fprintf(stderr, "kv tier: disk: %s in %s failed: %s (%s; counted in kvserve:kv_tier_errors_total{tier=\"disk\"}, told once per kind)\n",
               what, root_.c_str(), std::strerror(err), then);
}

std::string DiskStore::path_of(const PageHash& h) const {
  const std::string hex = h.hex();
  return root_ + "/" + hex.substr(0, 2) + "/" + hex + ".kvp";
}

void DiskStore::scan(const PageIdentity& id) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(root_) / "tmp", ec)) {  // interrupted writes
    fs::remove(e.path(), ec);
    ++dropped_at_open_;
  }
  struct Found {
    PageHash h;
    int64_t bytes;
    int64_t mtime;
    PageHash parent;
  };
  std::vector<Found> found;
  // A header is at most this long (100 bytes of fields + 4 per token).
  const int64_t header_max = 128 + 4 * int64_t(id.block_size);
  for (const auto& d : fs::directory_iterator(root_, ec)) {
    if (!d.is_directory() || d.path().filename() == "tmp") continue;
    for (const auto& f : fs::directory_iterator(d.path(), ec)) {
      PageHash h;
      const std::string path = f.path().string();
      bool keep = f.is_regular_file() && f.path().extension() == ".kvp" && parse_hex_hash(f.path().stem().string(), &h);
      BlobHeader hdr;
      if (keep) {
        auto head = read_file(path, header_max);
        keep = head && decode_header(*head, &hdr) == BlobCheck::kOk && hdr.hash == h && hdr.id.fingerprint == id.fingerprint &&
               hdr.id.format_tag == id.format_tag && hdr.id.block_size == id.block_size &&
               int64_t(hdr.header_bytes + hdr.payload_bytes) == int64_t(f.file_size(ec));
      }
      if (!keep) {  // corrupt, truncated, foreign or not ours: its page is recomputed when needed
        fs::remove(f.path(), ec);
        ++dropped_at_open_;
        continue;
      }
      found.push_back({h, static_cast<int64_t>(f.file_size(ec)), file_ns(path), hdr.parent});
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime < b.mtime; });
  if (dropped_at_open_ > 0)  // the counter alone would not say why the cache came back smaller
    std::fprintf(stderr, "kv tier: disk %s: removed %lld files at start that were corrupt, truncated, interrupted writes or of "
                 "another page format (their pages are recomputed when needed; counted in kvserve:kv_tier_corrupt_total)\n",
                 root_.c_str(), static_cast<long long>(dropped_at_open_));
  std::lock_guard<std::mutex> l(mu_);
  for (const Found& f : found) add_locked(f.h, f.bytes, f.parent, f.mtime);
  trim_locked(max_bytes_, 0);
}

// Leaf bookkeeping: a page no stored page continues is in leaves_ (reachable from a first page
// through stored pages) or lost_ (not: an ancestor is missing).
void DiskStore::file_leaf(const PageHash& h, const Entry& e) {
  if (children_.count(h) == 0) (e.reach ? leaves_ : lost_).emplace(e.tick, h);
}

void DiskStore::unfile_leaf(const Entry& e) {
  leaves_.erase(e.tick);
  lost_.erase(e.tick);
}

// h and its stored descendants become reachable (or not).
void DiskStore::set_reach(const PageHash& h, bool reach) {
  std::vector<PageHash> todo = {h};
  while (!todo.empty()) {
    const PageHash x = todo.back();
    todo.pop_back();
    Entry& e = index_.at(x);
    if (e.reach == reach) continue;
    unfile_leaf(e);
    e.reach = reach;
    file_leaf(x, e);
    if (auto kids = children_.find(x); kids != children_.end()) todo.insert(todo.end(), kids->second.begin(), kids->second.end());
  }
}

// h (in index_) names parent (PageHash{}: a first page).
void DiskStore::link_locked(const PageHash& h, const PageHash& parent) {
  bool reach = true;
  if (!(parent == PageHash{})) {
    index_.at(h).parent = parent;
    std::vector<PageHash>& sib = children_[parent];
    sib.push_back(h);
    auto p = index_.find(parent);
    if (p != index_.end() && sib.size() == 1) unfile_leaf(p->second);  // no longer a leaf
    reach = p != index_.end() && p->second.reach;  // write-back writes children first: not yet
  }
  set_reach(h, reach);
}

void DiskStore::add_locked(const PageHash& h, int64_t bytes, const PageHash& parent, int64_t used_ns) {
  Entry& e = index_[h] = Entry{bytes, Tick{used_ns, ++seq_}, PageHash{}, false};
  bytes_ += bytes;
  file_leaf(h, e);
  link_locked(h, parent);
}

int64_t DiskStore::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void DiskStore::touch_locked(const PageHash& h, int64_t used_ns) {
  auto it = index_.find(h);
  if (it == index_.end() || used_ns < it->second.tick.first) return;
  unfile_leaf(it->second);
  it->second.tick = Tick{used_ns, ++seq_};
  file_leaf(h, it->second);
}

void DiskStore::erase_locked(const PageHash& hash) {
  const PageHash h = hash;  // a copy: callers may pass a reference into leaves_, which the erase below frees
  auto it = index_.find(h);
  if (it == index_.end()) return;
  bytes_ -= it->second.bytes;
  unfile_leaf(it->second);
  // Its stored children (they keep naming it) cannot be reached now: the first to go over budget.
  if (auto kids = children_.find(h); kids != children_.end())
    for (const PageHash& c : kids->second) set_reach(c, false);
  const PageHash parent = it->second.parent;
  index_.erase(it);
  if (!(parent == PageHash{})) {
    auto c = children_.find(parent);
    if (c != children_.end()) {
      std::erase(c->second, h);
      if (c->second.empty()) {
        children_.erase(c);
        if (auto p = index_.find(parent); p != index_.end()) file_leaf(parent, p->second);  // a leaf again
      }
    }
  }
  ::unlink(path_of(h).c_str());
}

int64_t DiskStore::trim_locked(int64_t max_bytes, size_t keep) {
  int64_t freed = 0;
  // Leaves no lookup can reach from the disk first (an ancestor is missing), then reachable
  // leaves, least recently used first. Every finite forest has a leaf: both maps are empty only
  // when index_ is.
  while (bytes_ > max_bytes && index_.size() > keep && !(lost_.empty() && leaves_.empty())) {
    const PageHash h = lost_.empty() ? leaves_.begin()->second : lost_.begin()->second;
    freed += index_.at(h).bytes;
    erase_locked(h);
  }
  return freed;
}

void DiskStore::touch(std::span<const PageHash> hashes, std::span<const int64_t> used_ns) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto it = index_.find(hashes[i]);
    if (it == index_.end()) continue;
    const int64_t t = i < used_ns.size() && used_ns[i] > 0 ? used_ns[i] : now;
    const Tick before = it->second.tick;
    touch_locked(hashes[i], t);
    // The file's time is the order the next start reads. Its file gone behind our back: the
    // index forgets it (the next eviction from RAM writes it again), and if the whole directory
    // went (rm -rf), the store recovers as a put or a get would.
    if (it->second.tick != before && set_file_ns(path_of(hashes[i]), t) == ENOENT) {
      ++errors_;
      erase_locked(hashes[i]);
      if (!root_intact_locked()) recover_locked();
    }
  }
}

std::vector<bool> DiskStore::put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs) {
  return put(hashes, ns_tags, blobs, {});
}

// Last page first: of pages used at the same time, a prefix's first page ends up the most recent
// (and its file the newest, for the next start's scan). The budget is enforced once the whole
// batch is in, leaves first (see the header): trimming after each page could delete a page
// whose child was still to come.
std::vector<bool> DiskStore::put(std::span<const PageHash> hashes, std::span<const uint64_t>, std::span<const std::string> blobs,
                                 std::span<const int64_t> used_ns) {
  std::vector<bool> stored(hashes.size(), false);
  const int64_t now = now_ns();
  {
    std::lock_guard<std::mutex> l(mu_);  // the directory removed since the last put: recreate it first
    if (!off_ && !root_intact_locked()) recover_locked();
    if (off_) return stored;
  }
  for (size_t i = hashes.size(); i-- > 0;) {
    const PageHash& h = hashes[i];
    const std::string& b = blobs[i];
    // Written last page first, each a nanosecond after the one before: of pages used at once, a
    // prefix's first page is the most recent, in the index and in the files' times alike (a
    // filesystem's own times can tie within a batch, and the next start's order with them).
    const int64_t used = (i < used_ns.size() && used_ns[i] > 0 ? used_ns[i] : now) + int64_t(hashes.size() - 1 - i);
    BlobHeader hdr;  // the parent's hash, for the links (a blob that does not parse has none)
    if (decode_header(b, &hdr) != BlobCheck::kOk) hdr.parent = PageHash{};
    uint64_t n;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = index_.find(h);
      // Same hash, same page: refresh its recency only, unless this blob carries more (a
      // hybrid model's window page, which a blob of the position may lack): then replace it.
      if (it != index_.end() && int64_t(b.size()) <= it->second.bytes) {
        const Tick before = it->second.tick;
        touch_locked(h, used);
        if (it->second.tick == before || set_file_ns(path_of(h), used) != ENOENT) {
          stored[i] = true;
          continue;
        }
        ++errors_;
        erase_locked(h);  // its file was deleted behind our back: written again below
      }
      if (int64_t(b.size()) > max_bytes_ || off_) continue;
      n = tmp_counter_++;
    }
    // Write outside the lock: temp file, then rename into place (atomic on one filesystem).
    const std::string final_path = path_of(h);
    const std::string tmp = root_ + "/tmp/" + h.hex() + "." + std::to_string(n) + ".tmp";
    std::error_code ec;
    fs::create_directories(fs::path(final_path).parent_path(), ec);
    auto write_file = [&] {  // 0, or the errno of the step that failed
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) return errno != 0 ? errno : EIO;
      int err = write_all(fd, b.data(), b.size()) ? 0 : (errno != 0 ? errno : EIO);
      if (::close(fd) != 0 && err == 0) err = errno != 0 ? errno : EIO;
      if (err == 0) set_file_ns(tmp, used);  // the recency the next start reads
      if (err == 0 && ::rename(tmp.c_str(), final_path.c_str()) != 0) err = errno != 0 ? errno : EIO;
      if (err != 0) ::unlink(tmp.c_str());
      return err;
    };
    int err = write_file();
    if (err == ENOSPC) {
      // The filesystem filled before the byte budget did (other files share it): make room from
      // the least recently used pages, as the budget would, and try once more. Without this a
      // full disk dropped every later write.
      {
        std::lock_guard<std::mutex> l(mu_);
        // said once: the budget is not what limits the store (nothing said it; a user test)
        if (told_.insert("enospc").second)
          std::fprintf(stderr, "kv tier: disk: %s is full at %.1f MiB of pages, below --kv-disk-bytes (%.1f MiB): the least recently "
                       "used pages make room; set --kv-disk-bytes to the space the filesystem has for them\n",
                       root_.c_str(), double(bytes_) / (1 << 20), double(max_bytes_) / (1 << 20));
        trim_locked(bytes_ - 2 * int64_t(b.size()));
      }
      err = write_file();
    }
    if (err == ENOENT) {
      // The directory (or part of it) was removed since the check above: recreate it, once more.
      bool again;
      {
        std::lock_guard<std::mutex> l(mu_);
        again = recover_locked();
      }
      if (again) {
        fs::create_directories(fs::path(final_path).parent_path(), ec);
        err = write_file();
      }
    }
    const bool ok = err == 0;
    std::lock_guard<std::mutex> l(mu_);
    if (!ok) {
      ++errors_;
      if (!off_) tell_failure_locked("writing a page", err, "such pages are not stored");
      continue;
    }
    auto it = index_.find(h);
    if (it == index_.end()) {
      add_locked(h, static_cast<int64_t>(b.size()), hdr.parent, used);
    } else {  // replaced (the same parent: the hash covers the whole chain; a version 1 blob did not say)
      bytes_ += static_cast<int64_t>(b.size()) - it->second.bytes;
      it->second.bytes = static_cast<int64_t>(b.size());
      if (it->second.parent == PageHash{} && !(hdr.parent == PageHash{})) link_locked(h, hdr.parent);
      touch_locked(h, used);
    }
    stored[i] = true;
  }
  std::lock_guard<std::mutex> l(mu_);
  trim_locked(max_bytes_);
  return stored;
}

std::vector<std::optional<std::string>> DiskStore::get(uint64_t, std::span<const PageHash> hashes) {
  std::vector<std::optional<std::string>> out(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = index_.find(hashes[i]);
      if (it == index_.end()) break;  // a prefix ends at its first gap
    }
    out[i] = read_file(path_of(hashes[i]));
    if (!out[i]) {  // deleted behind our back, or unreadable
      const int err = errno;
      std::lock_guard<std::mutex> l(mu_);
      ++errors_;
      erase_locked(hashes[i]);
      if (err != ENOENT) tell_failure_locked("reading a page", err, "such pages miss and are recomputed");
      else if (!root_intact_locked()) recover_locked();  // the whole directory removed (rm -rf)?
      break;
    }
  }
  // Used now, last page first, as put() does: the prefix's head is the most recent.
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = hashes.size(); i-- > 0;)
    if (out[i]) touch_locked(hashes[i], now);
  return out;
}

bool DiskStore::may_contain(const PageHash& h) const {
  std::lock_guard<std::mutex> l(mu_);
  return index_.count(h) > 0;
}

int64_t DiskStore::blob_bytes(const PageHash& h) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = index_.find(h);
  return it == index_.end() ? -1 : it->second.bytes;
}

void DiskStore::remove(uint64_t, const PageHash& h) {
  std::lock_guard<std::mutex> l(mu_);
  erase_locked(h);
}

int64_t DiskStore::n_pages() const {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(index_.size());
}

int64_t DiskStore::bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_;
}

void DiskStore::fill_stats(TierStats* s) const {
  std::lock_guard<std::mutex> l(mu_);
  s->pages_stored = static_cast<int64_t>(index_.size());
  s->bytes_stored = bytes_;
  s->errors += errors_;
  s->corrupt += dropped_at_open_;  // found corrupt, truncated or foreign by the start-up scan
}

}  // namespace kv
