// Internal (not installed): the byte-stream primitives of the persistence format shared by every
// cache kind that saves itself (core/persistence.cc for the causal family, wrapper and sequence
// caches; core/encoder_cache.cc for the encoder). The format itself is in core/persistence.h.
#ifndef KVCACHE_CORE_STREAM_IMPL_H_
#define KVCACHE_CORE_STREAM_IMPL_H_

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/crc32c.h"
#include "core/persistence.h"
#include "core/status.h"
#include "layouts/quant.h"

namespace kv::internal {

inline constexpr char kStreamMagic[8] = {'K', 'V', 'C', 'A', 'C', 'H', 'E', '\0'};
inline constexpr uint32_t kKindCausal = 1;
inline constexpr uint32_t kKindSequence = 2;
inline constexpr uint32_t kKindWrapper = 3;
inline constexpr uint32_t kKindEncoder = 4;
inline constexpr size_t kHeaderBytes = 24;  // magic, version, kind, total
inline constexpr size_t kTrailerBytes = 4;  // CRC32C

// ---- writing ------------------------------------------------------------------------------------

inline void PutBytes(std::vector<uint8_t>* out, const void* p, size_t n) {
  if (n == 0) return;
  const size_t at = out->size();
  out->resize(at + n);
  std::memcpy(out->data() + at, p, n);
}
// K/V data in the stream are little-endian like its integers: an f32 as 4 bytes, an f16 or bf16 as
// 2, a q8_0 / q4_0 block as its f16 scale's 2 bytes and then its code bytes. The cache holds them
// in the machine's order. This converts `n` bytes of whole elements (blocks) of `dtype` between the
// two, in place, either way: nothing on a little-endian machine, each value's bytes reversed on a
// big-endian one (s390x), so that a stream saved there loads anywhere and the other way round.
inline void SwapToOrFromStreamOrder(void* data, size_t n, DType dtype) {
  if constexpr (std::endian::native == std::endian::little) return;
  uint8_t* bytes = static_cast<uint8_t*>(data);
  const size_t unit = BlockBytes(dtype);  // an element, or a quantized block
  const size_t value = IsQuantized(dtype) ? kQuantScaleBytes : unit;
  for (size_t at = 0; at + unit <= n; at += unit) std::reverse(bytes + at, bytes + at + value);
}
// PutBytes of K/V data: n bytes of whole elements (blocks) of `dtype`, in the stream's order.
inline void PutElements(std::vector<uint8_t>* out, const void* p, size_t n, DType dtype) {
  const size_t at = out->size();
  PutBytes(out, p, n);
  SwapToOrFromStreamOrder(out->data() + at, n, dtype);
}
// The other way: n bytes of K/V data from the stream into the cache's storage, in its order.
inline void CopyElementsIn(void* dst, const uint8_t* stream, size_t n, DType dtype) {
  if (n == 0) return;
  std::memcpy(dst, stream, n);
  SwapToOrFromStreamOrder(dst, n, dtype);
}
inline void PutU8(std::vector<uint8_t>* out, uint8_t v) { out->push_back(v); }
inline void PutU32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void PutI32(std::vector<uint8_t>* out, int32_t v) { PutU32(out, static_cast<uint32_t>(v)); }
inline void PutU64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Replaces *out with a header of `kind`; EndStream patches the total and appends the checksum.
inline void BeginStream(std::vector<uint8_t>* out, uint32_t kind) {
  out->clear();
  PutBytes(out, kStreamMagic, sizeof(kStreamMagic));
  PutU32(out, kPersistenceVersion);
  PutU32(out, kind);
  PutU64(out, 0);  // total, patched by EndStream
}

inline void EndStream(std::vector<uint8_t>* out) {
  const uint64_t total = out->size() + kTrailerBytes;
  for (int i = 0; i < 8; ++i) (*out)[16 + i] = static_cast<uint8_t>(total >> (8 * i));
  PutU32(out, Crc32c(0, out->data(), out->size()));
}

// ---- reading ------------------------------------------------------------------------------------

// Never reads outside [data, data + size): every read checks the remaining length first.
class Reader {
 public:
  Reader() = default;
  Reader(const uint8_t* data, size_t size) : p_(data), left_(size) {}
  size_t left() const { return left_; }
  bool Bytes(size_t n, const uint8_t** out) {
    if (n > left_) return false;
    *out = p_;
    p_ += n;
    left_ -= n;
    return true;
  }
  bool U8(uint8_t* v) {
    const uint8_t* b;
    if (!Bytes(1, &b)) return false;
    *v = b[0];
    return true;
  }
  bool U32(uint32_t* v) {
    const uint8_t* b;
    if (!Bytes(4, &b)) return false;
    *v = static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
         static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
    return true;
  }
  bool I32(int32_t* v) {
    uint32_t u;
    if (!U32(&u)) return false;
    *v = static_cast<int32_t>(u);
    return true;
  }
  bool U64(uint64_t* v) {
    uint32_t lo, hi;
    if (!U32(&lo) || !U32(&hi)) return false;
    *v = static_cast<uint64_t>(hi) << 32 | lo;
    return true;
  }
  bool I64(int64_t* v) {
    uint64_t u;
    if (!U64(&u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }

 private:
  const uint8_t* p_ = nullptr;
  size_t left_ = 0;
};

inline uint32_t LoadU32(const uint8_t* b) {
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
         static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
}
inline int32_t LoadI32(const uint8_t* b) { return static_cast<int32_t>(LoadU32(b)); }

inline Status Truncated(const char* what) {
  return Status::Error(Code::kCorrupt, "cache stream: truncated or malformed at %s", what);
}

// Checks magic, version, kind, total size and checksum; *body spans the bytes between header and
// checksum.
inline Status OpenStream(std::span<const uint8_t> bytes, uint32_t want_kind, Reader* body) {
  if (bytes.size() < kHeaderBytes + kTrailerBytes) {
    return Status::Error(Code::kCorrupt, "cache stream: %zu bytes is shorter than a header",
                         bytes.size());
  }
  if (std::memcmp(bytes.data(), kStreamMagic, sizeof(kStreamMagic)) != 0)
    return Status::Error(Code::kCorrupt, "cache stream: bad magic (not a kvcache file)");
  Reader r(bytes.data() + 8, kHeaderBytes - 8);
  uint32_t version = 0, kind = 0;
  uint64_t total = 0;
  (void)r.U32(&version);
  (void)r.U32(&kind);
  (void)r.U64(&total);
  if (version == 0) return Status::Error(Code::kCorrupt, "cache stream: version 0");
  if (version > kPersistenceVersion) {
    return Status::Error(Code::kNotSupported, "cache stream: version %u is newer than %u", version,
                         kPersistenceVersion);
  }
  if (total != bytes.size()) {
    return Status::Error(Code::kCorrupt, "cache stream: header says %llu bytes, have %zu",
                         static_cast<unsigned long long>(total), bytes.size());
  }
  const size_t body_end = bytes.size() - kTrailerBytes;
  const uint32_t stored = LoadU32(bytes.data() + body_end);
  const uint32_t actual = Crc32c(0, bytes.data(), body_end);
  if (stored != actual) {
    return Status::Error(Code::kCorrupt, "cache stream: checksum %08x, computed %08x", stored,
                         actual);
  }
  if (kind != want_kind) {
    return Status::Error(Code::kInvalidArgument, "cache stream holds kind %u, target is kind %u",
                         kind, want_kind);
  }
  *body = Reader(bytes.data() + kHeaderBytes, body_end - kHeaderBytes);
  return Status::Ok();
}

// a * b (+ c) without wrapping; false on overflow.
inline bool MulAdd(size_t a, size_t b, size_t c, size_t* out) {
  size_t m;
  if (__builtin_mul_overflow(a, b, &m)) return false;
  return !__builtin_add_overflow(m, c, out);
}

}  // namespace kv::internal

#endif  // KVCACHE_CORE_STREAM_IMPL_H_
