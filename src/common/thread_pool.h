// A persistent pool of worker threads for parallelism inside one engine step.
//
// run(fn) calls fn(ith, nth) once on each of nth threads (the caller is thread 0) and returns
// when all are done. Workers spin briefly between jobs, then sleep on a futex, so a decode
// step costs one wake-up rather than a thread creation. Owned and called by one thread (the
// engine thread); not reentrant: fn must not call run().
#pragma once
#include <atomic>
#include <functional>
#include <thread>
#include <vector>

namespace kv {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  void run(const std::function<void(int ith, int nth)>& fn);
  // Inside run(): every thread waits until all nth threads have arrived. Phases inside one
  // job (quantize the activations, then multiply) sync here instead of paying a new run().
  void barrier();

  // Splits [0, n) into nth nearly equal contiguous chunks, each a multiple of `align`
  // except the last; returns thread ith's half-open range.
  static void split(int64_t n, int ith, int nth, int64_t align, int64_t* begin, int64_t* end);

 private:
  void worker(int ith);

  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<uint32_t> barrier_phase_{0};
};

// Number of physical-ish cores to use by default.
int default_thread_count();

}  // namespace kv
