// The definitions behind tests/malloc_hooks.h.
#include "malloc_hooks.h"

#include <malloc.h>

#include <cstdlib>
#include <new>

namespace kv::heap_hooks {

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};

namespace {
// Initial-exec TLS of the executable: reading it allocates nothing (malloc may not recurse).
thread_local int64_t t_fail_in = -1;  // large allocations to let through before one fails
thread_local bool t_failed = false;
}  // namespace

void FailLargeAllocationOnThisThread(int64_t n) {
  t_fail_in = n;
  t_failed = false;
}

bool LargeAllocationFailedOnThisThread() { return t_failed; }

bool MallocHooked() {
  if (!kMallocHooked) return false;
  // Both entry points: valgrind leaves the executable's malloc in place but replaces the C++
  // runtime's operator new, which then no longer reaches it.
  static const bool hooked = [] {
    FailLargeAllocationOnThisThread(0);
    void* volatile p = std::malloc(kLargeAllocationBytes);  // volatile: the call is not elided
    const bool malloc_refused = LargeAllocationFailedOnThisThread();
    std::free(p);  // null where the hook refused it
    FailLargeAllocationOnThisThread(0);
    void* volatile q = ::operator new(kLargeAllocationBytes, std::nothrow);
    const bool new_refused = LargeAllocationFailedOnThisThread();
    ::operator delete(q);
    FailLargeAllocationOnThisThread(-1);
    return malloc_refused && new_refused;
  }();
  return hooked;
}

// True: the allocation of `bytes` is counted and must fail.
[[maybe_unused]] static bool Hook(size_t bytes) {
  if (g_counting.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  if (bytes < kLargeAllocationBytes || t_fail_in < 0) return false;
  if (t_fail_in-- > 0) return false;
  t_failed = true;  // t_fail_in is now -1: later allocations succeed
  return true;
}

}  // namespace kv::heap_hooks

#if KV_MALLOC_HOOKED
extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void __libc_free(void*);
void* __libc_memalign(size_t, size_t);

void* malloc(size_t n) { return kv::heap_hooks::Hook(n) ? nullptr : __libc_malloc(n); }
void* calloc(size_t n, size_t s) {
  // n * s may overflow: __libc_calloc rejects that itself; the hook only needs a size class.
  return kv::heap_hooks::Hook(s != 0 && n > SIZE_MAX / s ? SIZE_MAX : n * s) ? nullptr
                                                                             : __libc_calloc(n, s);
}
void* realloc(void* p, size_t n) {
  return kv::heap_hooks::Hook(n) ? nullptr : __libc_realloc(p, n);
}
void free(void* p) { __libc_free(p); }
void* memalign(size_t a, size_t n) {
  return kv::heap_hooks::Hook(n) ? nullptr : __libc_memalign(a, n);
}
void* aligned_alloc(size_t a, size_t n) {
  return kv::heap_hooks::Hook(n) ? nullptr : __libc_memalign(a, n);
}
int posix_memalign(void** out, size_t a, size_t n) {
  void* p = kv::heap_hooks::Hook(n) ? nullptr : __libc_memalign(a, n);
  if (p == nullptr) return 12;  // ENOMEM
  *out = p;
  return 0;
}
}
#endif
