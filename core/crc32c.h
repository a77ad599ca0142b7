// CRC32C (Castagnoli), the checksum of the persistence format (core/persistence.h).
//
// Why CRC32C and not xxHash (XXH3): the library depends on Highway alone, and a checksum needs
// no extra runtime dependency for ~60 lines; CRC32C detects every burst error up to 32 bits and
// every odd number of bit flips, which is what a truncated or damaged file looks like, and it is a
// standard (iSCSI, ext4, LevelDB, Snappy framing) that other tools can verify. It is not a MAC: it
// catches accidents, not an attacker, so loading validates every field on its own as well.
// Speed: the SSE4.2 instruction where present, else slicing-by-8 (8 table lookups per 8 bytes).
#ifndef KVCACHE_CORE_CRC32C_H_
#define KVCACHE_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace kv {

// Extends a running CRC32C (start with 0) by n bytes. Crc32c(0, "123456789", 9) == 0xE3069283.
// Uses the SSE4.2 crc32 instruction when the CPU has it (checked once), else the portable code.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);
// The portable slicing-by-8 version (tests compare the two).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);

}  // namespace kv

#endif  // KVCACHE_CORE_CRC32C_H_
