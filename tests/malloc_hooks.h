// Heap hooks for the tests that must see (or refuse) every allocation in the process.
//
// tests/malloc_hooks.cc defines malloc, calloc, realloc, free, aligned_alloc, posix_memalign and
// memalign, forwarding to glibc's __libc_* entry points. Linked into a test executable, these
// definitions bind every malloc call in the process (the library, the C++ runtime's operator new,
// Highway's aligned allocator, other threads), so a counter sees every heap allocation, not only
// those made through operator new, and a test can make a chosen one fail. Sanitizer builds bring
// their own malloc: there the file defines nothing, kMallocHooked is false and the tests skip.
#ifndef KVCACHE_TESTS_MALLOC_HOOKS_H_
#define KVCACHE_TESTS_MALLOC_HOOKS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

// g++ says a sanitizer is on with __SANITIZE_*__, clang (14) only through __has_feature.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KV_SANITIZER_OWNS_MALLOC 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || \
    defined(KV_SANITIZER_OWNS_MALLOC)
#define KV_MALLOC_HOOKED 0
#else
#define KV_MALLOC_HOOKED 1
#endif

namespace kv::heap_hooks {

inline constexpr bool kMallocHooked = KV_MALLOC_HOOKED != 0;

// Whether the hooks see the process's allocations: not in a sanitizer build (kMallocHooked), and
// not under a tool that replaces the allocator at run time, such as valgrind. Probed once, by
// asking the hook to refuse one large malloc and one large operator new. Tests that count or fail
// allocations skip when it is false: without the hooks they would count nothing and pass without
// looking.
bool MallocHooked();

// Skips the calling GoogleTest test where MallocHooked() is false. The empty if-branch keeps a
// following `else` of the caller from binding to this macro's `if`.
#define KV_SKIP_UNLESS_MALLOC_HOOKED()    \
  if (::kv::heap_hooks::MallocHooked()) { \
  } else                                  \
    GTEST_SKIP() << "malloc is not the test's own (sanitizer, valgrind)"

// While g_counting is true, every allocation (any thread) adds one to g_allocations.
extern std::atomic<bool> g_counting;
extern std::atomic<int64_t> g_allocations;

// Allocations of at least this many bytes are "large": the per-call scratch buffers a kernel grows
// are (Attend's start at 256 KiB), the small ones the C++ and C runtimes make for themselves
// (thread state, TLS destructor records) are not, so failing large ones only reaches the code under
// test.
inline constexpr size_t kLargeAllocationBytes = size_t{64} << 10;

// On the calling thread only: the large allocation `n` places ahead fails (returns null; 0: the
// next one), and every large allocation after it succeeds again. n < 0: none fails.
void FailLargeAllocationOnThisThread(int64_t n);

// Whether the failure asked for on this thread has happened since that request.
bool LargeAllocationFailedOnThisThread();

}  // namespace kv::heap_hooks

#endif  // KVCACHE_TESTS_MALLOC_HOOKS_H_
