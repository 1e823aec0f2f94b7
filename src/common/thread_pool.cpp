#include "common/thread_pool.h"

#include <immintrin.h>

#include <algorithm>

namespace kv {

namespace {
constexpr int kSpinIters = 1 << 16;
inline void cpu_relax() { _mm_pause(); }
// Spin while the wait is short (the common case: threads finish within one kernel), then
// yield so an oversubscribed machine (parallel test runs, a busy host) still makes progress.
struct Backoff {
  int n = 0;
  void pause() {
    if (++n < 2048) cpu_relax();
    else std::this_thread::yield();
  }
};
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)), ranges_(static_cast<size_t>(std::max(1, n_threads))) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  fn(0, n_threads_);
  // Wait for the workers; they finish within one kernel's time, so spinning is right.
  Backoff b;
  while (pending_.load(std::memory_order_acquire) != 0) b.pause();
  job_ = nullptr;
}

void ThreadPool::worker(int ith) {
  uint32_t seen = 0;  // the constructor's generation: a job posted before this thread starts still runs
  for (;;) {
    uint32_t g;
    int spins = 0;
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (++spins < kSpinIters) {
        if (spins > 2048) std::this_thread::yield(); else cpu_relax();
      } else {
        generation_.wait(seen, std::memory_order_acquire);
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    (*job_)(ith, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::barrier() {
  if (n_threads_ == 1) return;
  uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == n_threads_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.fetch_add(1, std::memory_order_acq_rel);
  } else {
    Backoff b;
    while (barrier_phase_.load(std::memory_order_acquire) == phase) b.pause();
  }
}

void ThreadPool::split(int64_t n, int ith, int nth, int64_t align, int64_t* begin, int64_t* end) {
  int64_t n_units = (n + align - 1) / align;
  int64_t per = n_units / nth, extra = n_units % nth;
  int64_t b = ith * per + std::min<int64_t>(ith, extra);
  int64_t e = b + per + (ith < extra ? 1 : 0);
  *begin = std::min(n, b * align);
  *end = std::min(n, e * align);
}

namespace {
constexpr uint64_t pack_fb(int64_t f, int64_t b) {
  return (static_cast<uint64_t>(f) << 32) | static_cast<uint64_t>(b);
}
}  // namespace

void ThreadPool::deal(int64_t n, int64_t chunk) {
  // Units are counted in 32 bits (matmul groups, rows, heads: far below 2^31).
  chunk_ = std::max<int64_t>(1, chunk);
  for (int i = 0; i < n_threads_; ++i) {
    int64_t b, e;
    split(n, i, n_threads_, 1, &b, &e);
    ranges_[static_cast<size_t>(i)].fb.store(pack_fb(b, e), std::memory_order_relaxed);
  }
}

bool ThreadPool::next(int ith, int64_t* begin, int64_t* end) {
  const int64_t chunk = chunk_;
  // Own range first, from its front.
  std::atomic<uint64_t>& own = ranges_[static_cast<size_t>(ith)].fb;
  uint64_t v = own.load(std::memory_order_acquire);
  for (;;) {
    const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xffffffffu);
    if (f >= b) break;
    const int64_t e = std::min(b, f + chunk);
    if (own.compare_exchange_weak(v, pack_fb(e, b), std::memory_order_acq_rel)) {
      *begin = f;
      *end = e;
      return true;
    }
  }
  // Then the back of the others' ranges, starting with the next thread.
  for (int k = 1; k < n_threads_; ++k) {
    std::atomic<uint64_t>& r = ranges_[static_cast<size_t>((ith + k) % n_threads_)].fb;
    v = r.load(std::memory_order_acquire);
    for (;;) {
      const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xffffffffu);
      if (f >= b) break;
      const int64_t s = std::max(f, b - chunk);
      if (r.compare_exchange_weak(v, pack_fb(f, s), std::memory_order_acq_rel)) {
        *begin = s;
        *end = b;
        return true;
      }
    }
  }
  return false;
}

int default_thread_count() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace kv
