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

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
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

int default_thread_count() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace kv
