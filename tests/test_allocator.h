// An ArenaAllocator for tests (Cache::SetAllocator) that counts its calls and fails on demand, so a
// test can make any allocation of a cache fail and check that nothing changed. Memory comes from
// SystemAllocator(). Shared by the OOM, causal-cache and encoder-cache tests.
#ifndef KVCACHE_TESTS_TEST_ALLOCATOR_H_
#define KVCACHE_TESTS_TEST_ALLOCATOR_H_

#include <cstddef>

#include "core/arena.h"

namespace kv::testing {

struct TestAllocator {
  // A call fails (returns nullptr) while `fail` is set, and when its number (0-based, over every
  // call so far) is >= fail_from; fail_from -1: no call fails by number.
  bool fail = false;
  int fail_from = -1;
  int calls = 0;        // Allocate calls, failed ones included
  int allocations = 0;  // successful ones
  int failures = 0;
  int releases = 0;

  static void* Allocate(size_t bytes, void* ctx) {
    auto* self = static_cast<TestAllocator*>(ctx);
    const int call = self->calls++;
    if (self->fail || (self->fail_from >= 0 && call >= self->fail_from)) {
      ++self->failures;
      return nullptr;
    }
    ++self->allocations;
    return SystemAllocator().allocate(bytes, nullptr);
  }
  static void Release(void* p, void* ctx) {
    ++static_cast<TestAllocator*>(ctx)->releases;
    SystemAllocator().release(p, nullptr);
  }
  ArenaAllocator Get() { return ArenaAllocator{&Allocate, &Release, this}; }
};

}  // namespace kv::testing

#endif  // KVCACHE_TESTS_TEST_ALLOCATOR_H_
