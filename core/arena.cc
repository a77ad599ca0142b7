#include "core/arena.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "layouts/kv_layout.h"

namespace kv {
namespace {

// Regions of 2 MiB and more are 2 MiB-aligned and asked to be backed by transparent huge pages
// (where the kernel's THP mode is "madvise", as on Debian 12, nothing else gets them). Decode walks
// the whole history every step: with 4 KiB pages a history of 16 layers x 16K tokens (512 MiB of
// f16) misses the TLB on nearly every row, and under a hypervisor each miss is a two-level walk.
constexpr size_t kHugePage = size_t{2} << 20;

void* SystemAllocate(size_t bytes, void*) {
  bytes = RoundUp(bytes == 0 ? 1 : bytes, kBlockAlign);
#if defined(__linux__)
  if (bytes >= kHugePage) {
    void* p = nullptr;
    if (posix_memalign(&p, kHugePage, bytes) != 0) return nullptr;
#if defined(MADV_HUGEPAGE)
    (void)madvise(p, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: failure is fine
#endif
    return p;
  }
#endif
  return std::aligned_alloc(kBlockAlign, bytes);
}
void SystemRelease(void* p, void*) { std::free(p); }

}  // namespace

ArenaAllocator SystemAllocator() {
  return ArenaAllocator{&SystemAllocate, &SystemRelease, nullptr};
}

OwnedBlock& OwnedBlock::operator=(OwnedBlock&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    bytes_ = other.bytes_;
    allocator_ = other.allocator_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

Status OwnedBlock::Allocate(const ArenaAllocator& allocator, size_t bytes, OwnedBlock* out) {
  bytes = RoundUp(bytes == 0 ? 1 : bytes, kBlockAlign);
  void* p = allocator.allocate(bytes, allocator.ctx);
  if (p == nullptr) return Status::Error(Code::kOutOfMemory, "cannot allocate %zu bytes", bytes);
  std::memset(p, 0, bytes);
  out->Reset();
  out->data_ = p;
  out->bytes_ = bytes;
  out->allocator_ = allocator;
  return Status::Ok();
}

void OwnedBlock::Reset() {
  if (data_ != nullptr) allocator_.release(data_, allocator_.ctx);
  data_ = nullptr;
  bytes_ = 0;
}

Status Arena::Reserve(size_t bytes) {
  if (!regions_.empty() && !regions_.front().owned) {
    return Status::Error(Code::kInvalidArgument, "arena uses a caller buffer; cannot reserve more");
  }
  bytes = RoundUp(bytes, kBlockAlign);
  if (bytes == 0) return Status::Ok();
  regions_.reserve(regions_.size() + 1);  // may allocate; do it before taking the region
  void* p = allocator_.allocate(bytes, allocator_.ctx);
  if (p == nullptr)
    return Status::Error(Code::kOutOfMemory, "arena: cannot allocate %zu bytes", bytes);
  regions_.push_back(Region{static_cast<char*>(p), bytes, 0, true});
  reserved_ += bytes;
  return Status::Ok();
}

Status Arena::UseBuffer(void* buffer, size_t bytes) {
  if (used_ != 0 || !regions_.empty()) {
    return Status::Error(Code::kInvalidArgument,
                         "arena: caller buffer must be set before any allocation");
  }
  if (buffer == nullptr || reinterpret_cast<uintptr_t>(buffer) % kBlockAlign != 0) {
    return Status::Error(Code::kInvalidArgument,
                         "arena: caller buffer must be non-null and 64-byte aligned");
  }
  regions_.push_back(Region{static_cast<char*>(buffer), bytes, 0, false});
  reserved_ = bytes;
  return Status::Ok();
}

Status Arena::Allocate(size_t bytes, void** out) {
  bytes = RoundUp(bytes == 0 ? 1 : bytes, kBlockAlign);
  for (Region& r : regions_) {
    if (r.size - r.top >= bytes) {
      char* p = r.base + r.top;
      // Zero on hand-out: regions may be reused after Release of a caller buffer, and reserved
      // regions are not zeroed at Reserve so reserving stays cheap for unused layers.
      std::memset(p, 0, bytes);
      r.top += bytes;
      used_ += bytes;
      *out = p;
      return Status::Ok();
    }
  }
  if (!regions_.empty() && !regions_.front().owned) {
    return Status::Error(Code::kOutOfMemory, "arena: caller buffer has %zu bytes free, %zu needed",
                         regions_.front().size - regions_.front().top, bytes);
  }
  KV_RETURN_IF_ERROR(Reserve(bytes));
  Region& r = regions_.back();
  std::memset(r.base, 0, bytes);
  r.top = bytes;
  used_ += bytes;
  *out = r.base;
  return Status::Ok();
}

void Arena::Release() {
  for (Region& r : regions_) {
    if (r.owned) allocator_.release(r.base, allocator_.ctx);
  }
  regions_.clear();
  used_ = 0;
  reserved_ = 0;
}

}  // namespace kv
