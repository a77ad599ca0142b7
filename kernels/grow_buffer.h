// A 64-byte-aligned float buffer that only grows: per-thread scratch that reaches the largest
// shape its thread serves and is then reused, so that steady state allocates nothing.
#ifndef KVCACHE_KERNELS_GROW_BUFFER_H_
#define KVCACHE_KERNELS_GROW_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <utility>

#include "hwy/aligned_allocator.h"

namespace kv::kernels {

class GrowBuffer {
 public:
  // Growth is geometric, at least to min_floats: a request that creeps up by a little each call
  // (a history one cell longer per decode step) reallocates O(log n) times, not every time.
  explicit constexpr GrowBuffer(size_t min_floats = 0) : min_floats_(min_floats) {}

  // At least `floats` floats, 64-byte aligned; their contents are whatever the last user left.
  // Null when the buffer cannot grow: the old buffer and its size are kept, so the next call
  // can try again.
  [[nodiscard]] float* Reserve(size_t floats) {
    if (cap_ < floats) {
      const size_t grown = std::max({floats, 2 * cap_, min_floats_});
      auto fresh = hwy::AllocateAligned<float>(grown);
      if (!fresh) return nullptr;
      buf_ = std::move(fresh);
      cap_ = grown;
    }
    return buf_.get();
  }

 private:
  hwy::AlignedFreeUniquePtr<float[]> buf_;
  size_t cap_ = 0;
  size_t min_floats_;
};

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_GROW_BUFFER_H_
