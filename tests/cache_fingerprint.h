// A cache's observable state as bytes, for tests that assert "nothing changed": the persistence
// stream of every sequence (contents, positions, sequence sets) followed by MemoryBytes() (so a
// failed call that allocated, or freed, is seen too). Shared by the persistence and OOM tests.
#ifndef KVCACHE_TESTS_CACHE_FINGERPRINT_H_
#define KVCACHE_TESTS_CACHE_FINGERPRINT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/persistence.h"
#include "gtest/gtest.h"

namespace kv::testing {

// with_memory false: the stream only (two caches of other capacities can hold the same tokens).
inline std::vector<uint8_t> Fingerprint(const Cache& c, bool with_memory = true) {
  std::vector<uint8_t> s;
  EXPECT_TRUE(SaveCache(c, &s).ok());
  if (!with_memory) return s;
  const size_t mem = c.MemoryBytes();
  const uint8_t* m = reinterpret_cast<const uint8_t*>(&mem);
  s.insert(s.end(), m, m + sizeof(mem));
  return s;
}

}  // namespace kv::testing

#endif  // KVCACHE_TESTS_CACHE_FINGERPRINT_H_
