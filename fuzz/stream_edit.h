// Editing a saved stream (core/persistence.h) the way a damaged or hostile file would be, for the
// fuzzers and the tests. The stream's fields are little-endian on every machine, so an edit writes
// them byte by byte (a memcpy of a native integer wrote them backwards on s390x, where a test then
// checked another field than it meant to). ResealStream makes the header's total and the CRC32C
// trailer agree with the edited bytes, so that only the loader's field checks stand between the
// edit and the cache.
#ifndef KVCACHE_FUZZ_STREAM_EDIT_H_
#define KVCACHE_FUZZ_STREAM_EDIT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/crc32c.h"

namespace kvfuzz {

// Writes the low `bytes` bytes of value at offset `at`, least significant first.
// Precondition: at + bytes <= stream->size().
inline void StoreLittleEndian(std::vector<uint8_t>* stream, size_t at, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) (*stream)[at + i] = static_cast<uint8_t>(value >> (8 * i));
}

// Precondition: stream->size() >= 28 (the header and the trailer).
inline void ResealStream(std::vector<uint8_t>* stream) {
  StoreLittleEndian(stream, 16, stream->size(), 8);
  StoreLittleEndian(stream, stream->size() - 4, kv::Crc32c(0, stream->data(), stream->size() - 4),
                    4);
}

}  // namespace kvfuzz

#endif  // KVCACHE_FUZZ_STREAM_EDIT_H_
