// A persistent pool of worker threads for parallelism inside one engine step.
//
// run(fn) calls fn(ith, nth) once on each of nth threads (the caller is thread 0) and returns
// when all are done. Workers spin briefly between jobs, then sleep on a futex, so a decode
// step costs one wake-up rather than a thread creation. Owned and called by one thread (the
// engine thread); not reentrant: fn must not call run().
#pragma once
#include <atomic>
#include <cstdint>
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

  // Work split with stealing at the tail. Before run(), deal(n, chunk) gives each thread the
  // range split() would; inside run(), next(ith) hands out its own range front to back in
  // chunks of `chunk` units, and once that is done, chunks taken from the back of the other
  // threads' ranges. Each thread still streams one contiguous range, and a thread that falls
  // behind (a busy host, a slower memory channel) is helped instead of waited for.
  // Returns false when no work is left anywhere.
  // Every steal, and the owner's next chunk after one, moves a range's cache line between
  // cores, so this is for work of milliseconds (prefill matmuls); decode-sized work splits
  // statically (split).
  void deal(int64_t n, int64_t chunk);
  bool next(int ith, int64_t* begin, int64_t* end);

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
  // One thread's remaining range [front, back), packed in one word so that the owner (taking
  // the front) and a thief (taking the back) agree with one compare-exchange.
  struct alignas(64) Range {
    std::atomic<uint64_t> fb{0};
  };
  std::vector<Range> ranges_;
  int64_t chunk_ = 1;
};

// Number of physical-ish cores to use by default.
int default_thread_count();

}  // namespace kv
