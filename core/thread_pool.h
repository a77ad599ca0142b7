// A small persistent thread pool for Attend, and the parallel-for type a runtime can supply
// instead.
//
// Highway 1.0.3 ships no pool. This one keeps num_threads - 1 workers for its lifetime; the calling
// thread works too. Run hands out task indices through one atomic counter (tasks are few and
// coarse: KV heads x history chunks), so no queue and no allocation per call. Idle workers spin
// briefly (decode calls come back to back, and a futex wake costs tens of microseconds), then sleep
// on a condition variable.
#ifndef KVCACHE_CORE_THREAD_POOL_H_
#define KVCACHE_CORE_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace kv {

// A parallel-for supplied by the caller: run must call task(ctx, i) exactly once for every i in
// [0, n), from any of its threads, and return only when every call has returned. num_threads says
// how many may run at once (Attend sizes its work split by it). run == nullptr: everything runs on
// the calling thread.
struct ParallelFor {
  void (*run)(void* user, int64_t n, void (*task)(void* ctx, int64_t i), void* ctx) = nullptr;
  void* user = nullptr;
  int num_threads = 1;
};

class ThreadPool {
 public:
  // num_threads counts the caller: 1 starts no thread. Values below 1 mean 1.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int NumThreads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(ctx, i) for i in [0, n) on the caller and the workers; returns when all are done.
  // Calls from several threads are serialized.
  void Run(int64_t n, void (*task)(void* ctx, int64_t i), void* ctx);

  // This pool as a ParallelFor (valid while the pool lives).
  ParallelFor AsParallelFor();

 private:
  void WorkerLoop();
  void Drain();

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one Run at a time
  std::mutex mu_;
  std::condition_variable wake_cv_;
  std::condition_variable done_cv_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_{0};
  // The current job; written before generation_ is bumped (release), read after (acquire).
  int64_t n_ = 0;
  void (*task_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace kv

#endif  // KVCACHE_CORE_THREAD_POOL_H_
