// The read-bandwidth baseline the benchmarks compare the kernels with: how fast the machine streams
// memory into registers when nothing else is done with it.
//
// What is measured: a plain sum of 64-bit words (four independent accumulators, so the adds never
// hold the loads back) over a buffer, split into equal contiguous parts that a kv::ThreadPool hands
// out to its threads. A 1-thread pool gives one core's read bandwidth; an N-thread pool what N
// cores read together. Over a buffer far larger than the last-level cache (256 MiB) that is DRAM
// bandwidth. A figure is bytes actually summed / wall seconds of one pass, the pool's dispatch
// included (as it is in the kernel timings compared with it). Filling the buffer is not timed.
#ifndef KVCACHE_PERF_READ_BANDWIDTH_H_
#define KVCACHE_PERF_READ_BANDWIDTH_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/thread_pool.h"

namespace kvbench {

// Memory as the caches get theirs: from the library's default allocator (regions of 2 MiB and more
// are 2 MiB-aligned and madvised for huge pages), so that a kernel reading a history laid out by
// hand and the baseline it is compared with see the same kind of pages as a real cache.
struct ArenaLikeFree {
  void operator()(void* p) const { kv::SystemAllocator().release(p, nullptr); }
};
template <class T>
using ArenaLikePtr = std::unique_ptr<T[], ArenaLikeFree>;
template <class T>
ArenaLikePtr<T> AllocateArenaLike(size_t count) {
  return ArenaLikePtr<T>(
      static_cast<T*>(kv::SystemAllocator().allocate(count * sizeof(T), nullptr)));
}

namespace read_bandwidth_internal {
struct Parts {
  const uint64_t* data;
  int64_t words_per_part;  // a multiple of 4
  uint64_t* partial;       // one sum per part
};
inline void SumPart(void* ctx, int64_t i) {
  const Parts* parts = static_cast<const Parts*>(ctx);
  const uint64_t* p = parts->data + i * parts->words_per_part;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t w = 0; w < parts->words_per_part; w += 4) {
    s0 += p[w];
    s1 += p[w + 1];
    s2 += p[w + 2];
    s3 += p[w + 3];
  }
  parts->partial[i] = s0 + s1 + s2 + s3;
}
}  // namespace read_bandwidth_internal

// One timed pass: sums the first `words` words of `data` as `parts` tasks on `pool`, each task a
// contiguous run of words / parts words rounded down to a multiple of 8 (the remainder, fewer than
// 8 * parts words, is not read). Returns the bytes summed per second. Precondition: parts >= 1 and
// words >= 8 * parts.
inline double ReadPassBytesPerSecond(kv::ThreadPool* pool, const uint64_t* data, size_t words,
                                     int64_t parts) {
  std::vector<uint64_t> partial(static_cast<size_t>(parts));
  read_bandwidth_internal::Parts ctx{data, static_cast<int64_t>(words) / parts / 8 * 8,
                                     partial.data()};
  const auto t0 = std::chrono::steady_clock::now();
  pool->Run(parts, &read_bandwidth_internal::SumPart, &ctx);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The sums leave through a volatile store, so the reads cannot be dropped.
  volatile uint64_t sink = 0;
  for (uint64_t s : partial) sink = sink + s;
  return static_cast<double>(ctx.words_per_part) * static_cast<double>(parts) * 8.0 / sec;
}

// Best of `reps` passes over a `bytes` buffer (allocated and filled once, untimed), split into
// min(256, 8 x the pool's threads) parts. kvperf's baseline: 256 MiB, 5 passes.
inline double MeasureReadBandwidth(kv::ThreadPool* pool, size_t bytes = size_t{256} << 20,
                                   int reps = 5) {
  const size_t words = bytes / 8;
  auto buf = AllocateArenaLike<uint64_t>(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  const int64_t parts = std::min<int64_t>(256, int64_t{pool->NumThreads()} * 8);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep)
    best = std::max(best, ReadPassBytesPerSecond(pool, buf.get(), words, parts));
  return best;
}

}  // namespace kvbench

#endif  // KVCACHE_PERF_READ_BANDWIDTH_H_
