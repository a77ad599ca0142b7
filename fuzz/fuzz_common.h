// Shared helpers of the fuzzers: a byte reader that decodes the input from the front (so seed files
// read like programs), a check macro that reports and aborts (libFuzzer saves the input), a
// Highway target picker, and an allocator with a memory budget.
#ifndef KVCACHE_FUZZ_FUZZ_COMMON_H_
#define KVCACHE_FUZZ_FUZZ_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/arena.h"
#include "hwy/highway.h"
#include "hwy/targets.h"

namespace kvfuzz {

// An allocator for the fuzzers' caches (Cache::SetAllocator) that refuses any one request above
// kMaxAllocation, as an edge device with a memory budget would. A forged stream can declare layers
// whose storage is terabytes (every field within its limit; fuzz_session found one, see
// tests/fuzz_regressions_test.cc); the library answers kOutOfMemory when the allocator says no,
// and the fuzzer checks that the target is then unchanged. Without a budget the request reaches
// aligned_alloc, where ASan (above 1 TiB) and libFuzzer's malloc limit (above -rss_limit_mb)
// abort instead of returning nullptr.
inline constexpr size_t kMaxAllocation = size_t{64} << 20;

inline kv::ArenaAllocator BudgetAllocator() {
  kv::ArenaAllocator a;
  a.allocate = [](size_t bytes, void*) -> void* {
    return bytes > kMaxAllocation ? nullptr : kv::SystemAllocator().allocate(bytes, nullptr);
  };
  a.release = [](void* p, void*) { kv::SystemAllocator().release(p, nullptr); };
  return a;
}

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ == end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  // Past the end every byte reads as 0, so every input is a complete program.
  uint8_t U8() { return p_ < end_ ? *p_++ : 0; }
  uint16_t U16() { return static_cast<uint16_t>(U8() | (U8() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  // Uniform-ish in [lo, hi] (hi - lo < 65536).
  int Int(int lo, int hi) {
    const uint32_t span = static_cast<uint32_t>(hi - lo) + 1;
    return lo + static_cast<int>((span <= 256 ? U8() : U16()) % span);
  }
  bool OneIn(int n) { return U8() % n == 0; }
  template <typename T, size_t N>
  T Pick(const T (&items)[N]) {
    return items[U8() % N];
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

[[noreturn]] inline void Fail(const char* file, int line, const char* what) {
  std::fprintf(stderr, "\n*** fuzz mismatch at %s:%d: %s\n", file, line, what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace kvfuzz

// Reports with a printf-style message and aborts (libFuzzer records the crashing input).
#define FUZZ_CHECK(cond, ...)                                   \
  do {                                                          \
    if (!(cond)) {                                              \
      char fuzz_msg_[512];                                      \
      std::snprintf(fuzz_msg_, sizeof(fuzz_msg_), __VA_ARGS__); \
      ::kvfuzz::Fail(__FILE__, __LINE__, fuzz_msg_);            \
    }                                                           \
  } while (0)

namespace kvfuzz {

// The Highway targets this binary can run, best first.
inline std::vector<int64_t> Targets() {
  std::vector<int64_t> out;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) out.push_back(t);
  return out;
}

// Restricts dispatch to the target picked by `byte` (every dispatched kernel call after this runs
// that target's code). Returns its name for messages.
inline const char* UseTarget(uint8_t byte) {
  static const std::vector<int64_t> targets = Targets();
  const int64_t t = targets[byte % targets.size()];
  hwy::SetSupportedTargetsForTest(t);
  return hwy::TargetName(t);
}

}  // namespace kvfuzz

#endif  // KVCACHE_FUZZ_FUZZ_COMMON_H_
