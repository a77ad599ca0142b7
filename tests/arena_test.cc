// The default arena allocator: alignment and zero fill of the regions it hands out.
#include "core/arena.h"

#include <cstddef>
#include <cstdint>

#include "gtest/gtest.h"

namespace kv {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

bool AllZero(const void* p, size_t bytes) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

// A region of 2 MiB or more starts on a 2 MiB boundary (Linux), so that the huge pages it asks
// for can back all of it: decode reads the whole history every step, and with 4 KiB pages a long
// history misses the TLB on nearly every row. The first block of a fresh region is its base.
TEST(Arena, LargeRegionsStartOnAHugePageBoundary) {
  for (size_t bytes : {kHugePage, 3 * kHugePage + 4096, 17 * kHugePage}) {
    Arena arena;
    ASSERT_TRUE(arena.Reserve(bytes).ok());
    void* p = nullptr;
    ASSERT_TRUE(arena.Allocate(bytes, &p).ok());
#if defined(__linux__)
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePage, 0u) << bytes;
#endif
    EXPECT_TRUE(AllZero(p, bytes)) << bytes;
    static_cast<unsigned char*>(p)[bytes - 1] = 1;  // writable to the last byte
    EXPECT_EQ(arena.BytesUsed(), bytes);
  }
}

TEST(Arena, SmallRegionsAre64ByteAlignedAndZeroed) {
  for (size_t bytes : {size_t{1}, size_t{64}, size_t{4096}, kHugePage - 64}) {
    Arena arena;
    void* p = nullptr;
    ASSERT_TRUE(arena.Allocate(bytes, &p).ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes;
    EXPECT_TRUE(AllZero(p, bytes)) << bytes;
  }
}

}  // namespace
}  // namespace kv
