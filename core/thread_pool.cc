#include "core/thread_pool.h"

#include <algorithm>

namespace kv {
namespace {

// One polling step's delay. aarch64's `yield` hint costs about nothing on most cores, which would
// shrink the polling window below to a microsecond or two; `isb` (a pipeline flush, tens of
// cycles) is the usual spin delay there (Rust's spin_loop hint uses it). Not measured on Arm
// hardware: the project's Arm build has run under emulation only (README).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("isb" ::: "memory");
#endif
}

// Polling before a worker sleeps: 2000 pauses are ~10 us (Zen, Ice Lake: ~10-40 cycles each) to
// ~100 us (Skylake-SP: ~140 cycles), enough to catch the next layer's call during decode without
// burning a shared core for long.
constexpr int kSpinIterations = 2000;

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  const int workers = std::max(1, num_threads) - 1;
  workers_.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Drain() {
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_) return;
    task_(ctx_, i);
  }
}

void ThreadPool::Run(int64_t n, void (*task)(void* ctx, int64_t i), void* ctx) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) task(ctx, i);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  n_ = n;
  task_ = task;
  ctx_ = ctx;
  next_.store(0, std::memory_order_relaxed);
  busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_cv_.notify_all();
  Drain();
  for (int spin = 0; spin < kSpinIterations; ++spin) {
    if (busy_.load(std::memory_order_acquire) == 0) return;
    CpuRelax();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return busy_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < kSpinIterations; ++spin) {
      CpuRelax();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load(std::memory_order_relaxed)) return;
    Drain();
    if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

ParallelFor ThreadPool::AsParallelFor() {
  ParallelFor pf;
  pf.run = [](void* user, int64_t n, void (*task)(void*, int64_t), void* ctx) {
    static_cast<ThreadPool*>(user)->Run(n, task, ctx);
  };
  pf.user = this;
  pf.num_threads = NumThreads();
  return pf;
}

}  // namespace kv
