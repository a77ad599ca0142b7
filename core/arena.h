// Arena: the one place a cache gets K/V memory. Regions are 64-byte aligned and carved into blocks
// by a bump pointer; blocks are zero-filled (masked cells must never inject NaN into attention).
//
// A cache reserves one region up front when it knows its shapes (CausalCache::ReserveLayers), or
// lets each layer's first Put add a region of exactly what that layer needs. A caller-supplied
// buffer replaces owned regions entirely: then running out is kOutOfMemory, never a malloc.
// The allocator is injectable so tests can make any allocation fail.
#ifndef KVCACHE_CORE_ARENA_H_
#define KVCACHE_CORE_ARENA_H_

#include <cstddef>
#include <vector>

#include "core/status.h"

namespace kv {

struct ArenaAllocator {
  // Returns `bytes` of 64-byte aligned memory, or nullptr.
  void* (*allocate)(size_t bytes, void* ctx) = nullptr;
  void (*release)(void* p, void* ctx) = nullptr;
  void* ctx = nullptr;
};

// The default: std::aligned_alloc / std::free.
ArenaAllocator SystemAllocator();

// One zero-filled, 64-byte aligned allocation that remembers the allocator it came from, so it is
// always released to the right one. Move-only. Used for the metadata a cache sizes at Init (the
// cell table, per-batch scratch, the mask), so that injected failures reach those too.
class OwnedBlock {
 public:
  OwnedBlock() = default;
  ~OwnedBlock() { Reset(); }
  OwnedBlock(OwnedBlock&& other) noexcept { *this = static_cast<OwnedBlock&&>(other); }
  OwnedBlock& operator=(OwnedBlock&& other) noexcept;
  OwnedBlock(const OwnedBlock&) = delete;
  OwnedBlock& operator=(const OwnedBlock&) = delete;

  // Replaces *out only on success; kOutOfMemory otherwise.
  static Status Allocate(const ArenaAllocator& allocator, size_t bytes, OwnedBlock* out);
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void Reset();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  ArenaAllocator allocator_;
};

// Lays typed arrays out in one block, each 64-byte aligned. Run it once with a null base to learn
// the size, allocate, then run the same sequence of Take calls again with the block's base.
class BlockCarver {
 public:
  explicit BlockCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* Take(size_t count) {
    offset_ = (offset_ + 63) / 64 * 64;
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * sizeof(T);
    return p;
  }
  size_t size() const { return (offset_ + 63) / 64 * 64; }

 private:
  char* base_;
  size_t offset_ = 0;
};

class Arena {
 public:
  Arena() : Arena(SystemAllocator()) {}
  explicit Arena(ArenaAllocator allocator) : allocator_(allocator) {}
  ~Arena() { Release(); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void SetAllocator(ArenaAllocator allocator) { allocator_ = allocator; }
  const ArenaAllocator& allocator() const { return allocator_; }

  // Adds an owned region of at least `bytes` that later Allocate calls carve first.
  Status Reserve(size_t bytes);
  // Uses a caller-owned buffer (64-byte aligned, outliving the arena's use) instead of owned
  // regions. Only before anything is allocated.
  Status UseBuffer(void* buffer, size_t bytes);
  // A zero-filled, 64-byte aligned block. Adds an owned region when no region has room (never with
  // a caller buffer). On failure nothing changes.
  Status Allocate(size_t bytes, void** out);
  // Frees every owned region; forgets the caller buffer.
  void Release();

  size_t BytesUsed() const { return used_; }          // handed out by Allocate
  size_t BytesReserved() const { return reserved_; }  // held in regions (owned or caller's)

 private:
  struct Region {
    char* base;
    size_t size;
    size_t top;  // next free byte
    bool owned;
  };
  ArenaAllocator allocator_;
  std::vector<Region> regions_;
  size_t used_ = 0;
  size_t reserved_ = 0;
};

}  // namespace kv

#endif  // KVCACHE_CORE_ARENA_H_
