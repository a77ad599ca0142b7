// Saving and loading caches: a whole causal-family or encoder cache, one sequence of it, a wrapper
// of such caches, or a growing / rotating SequenceCache, to a byte stream or a file. The anchors
// are llama.cpp's session / sequence-state files and MLX's prompt-cache files; unlike both, every
// load is validated in full before anything changes, and a checksum covers every byte.
//
// Stream format, version 1 (every integer and every K/V value little-endian, no implicit padding):
//   offset 0   char[8] magic "KVCACHE\0"
//          8   u32 version (1)
//         12   u32 kind: 1 causal family (CausalCache), 2 growing/rotating (SequenceCache),
//              3 wrapper (WrapperCache), 4 encoder (EncoderCache)
//         16   u64 total bytes of the stream, checksum included
//         24   body (below)
//   total - 4  u32 CRC32C (core/crc32c.h) of bytes [0, total - 4)
// Causal body:
//   u8 storage dtype, u8 permuted_v (informative: rows are stored canonically), u8[2] zero
//   i32 window, memory, chunk (effective values after Init; INT32_MAX = unlimited), padding
//   i32 max_sequences, capacity, max_batch, cells (the cache's shape)
//   i32 saved sequence (-1: the whole cache)
//   i32 layers; per layer: u8 allocated, u8[3] zero, i32 k_head_dim, v_head_dim, kv_heads
//   u32 n saved cells; per cell: i32 cell index, i32 position (cell indices strictly increasing)
//   whole cache only: per saved cell, u64[ceil(max_sequences / 64)] sequence bits
//   per allocated layer: K rows [cell][kv_head][k_head_dim], then V rows
//   [cell][kv_head][v_head_dim], in the storage dtype, packed (a row is RowBytes(dtype, head_dim);
//   quantized rows are their blocks back to back). Only held cells are written: a mostly empty
//   cache saves small.
// Encoder body:
//   u8 Init dtype, u8 per_sequence, u8 permuted_v, u8 zero
//   i32 max_sequences, i32 saved sequence (-1: the whole cache), i32 slot count (whole cache: 1
//   shared, max_sequences per sequence; one sequence: 1)
//   per slot: u8 cached, u8[3] zero, i32 position of the cached data, i32 position recorded by the
//   last multimodal StartForward, i32 layers; per layer: u8 present, u8 K dtype, u8 V dtype, u8
//   zero, and when present i64 K ne[4], i64 V ne[4] (the views Get returns: V already permuted
//   when permuted_v), then the contiguous K bytes and V bytes in their own float dtype.
// Sequence-cache body: SequenceCacheState (core/sequence_cache.h) field by field:
//   u8 dtype, u8[3] zero, i32 max_size, keep, offset, len, key_dim, value_dim, heads, batch,
//   u64 key bytes, u64 value bytes, the key bytes, the value bytes.
//
// Loading: the stream is checked in this order, and nothing in the target changes before all of it
// passes: size and magic (kCorrupt), version (kCorrupt for 0, kNotSupported for a newer one: its
// layout may differ past the version field), total size and checksum (kCorrupt), kind
// (kInvalidArgument: another cache kind's stream; checked after the checksum, so that damage to the
// kind field reads as damage), then every field with a bounds-checked reader (kCorrupt for a
// malformed stream: out-of-range cells, duplicate cells, bad sequence bits, byte counts that
// disagree with the shapes), then compatibility with the target (kInvalidArgument: different dtype,
// window/memory/chunk, shape or per-layer K/V shapes), then room (kCacheFull: not enough free cells
// for a sequence; kOutOfMemory: storage for layers the target has not allocated yet, taken in one
// allocation). The reader never reads outside the given span, whatever the stream says.
//
// Whole cache (seq == -1 on both sides): the target must be Init'ed with the same dtype,
// window/memory/chunk, padding, max_sequences, capacity and max_batch (so the same cell count);
// permuted_v may differ. Afterwards the target holds exactly the saved cells, at the same cell
// indices, with the same positions and sequence sets, and the same K/V rows in every saved layer
// (layers the target had allocated but the stream has not are zeroed): decoding continues with
// bit-identical results to the cache that was saved.
// One sequence (SaveCache with seq >= 0): the stream holds that sequence's cells (positions and
// rows; sharing with other sequences is not recorded). LoadCache(bytes, cache, dst) with dst >= 0
// puts it into sequence dst (dst == -1: the id it was saved from): dst first loses every cell it
// held (as CopyPrefix's destination does), then the saved cells take the lowest free cells in
// index order (counting those dst just released), keeping their relative order. Other sequences
// are untouched. Not enough free cells: kCacheFull and nothing changed. The target needs the same
// dtype and window/memory/chunk; its cell count and sequence count may differ. Rows of a layer
// that the stream lacks but the target has are zeroed for the placed cells.
// After any successful load the target has no current forward pass: call StartForward before
// Put/Get (as after Init).
//
// Encoder caches (stream kind 4): the target must be Init'ed with the same dtype (recorded though
// K/V keep their input dtype), the same EncoderOptions::per_sequence and the same permuted_v
// (kInvalidArgument otherwise). Whole cache (seq == -1 on both sides): also the same
// max_sequences; afterwards every slot holds the saved cached flag, positions and per-layer K/V
// (dtype, shape, bytes; a reserve pass's sized-but-uncached views included), and attention over
// it is bit-identical to the saved cache. One sequence (SaveCache with seq >= 0): per sequence,
// that sequence's block; shared, the one block every sequence reads (any valid seq saves it).
// LoadCache with dst (-1: the saved id) replaces sequence dst's block, or, shared, the shared
// block (dst only checked to be in range); other sequences are untouched and max_sequences may
// differ. Layers the target holds but the stream lacks become empty (their storage is kept).
// Storage grows only: a load allocates (one arena per layer, before anything changes) only where
// the target's blocks are too small, so reloading a stream the cache held earlier (a wrapper's
// rollback) never allocates. After a load no forward pass is current: call StartForward.
//
// Wrapper caches (the WrapperCache overloads below; stream kind 3): a u32 child count, then per
// child a u64 byte count and that child's own stream. Every child must support persistence (a
// hand-written child without it: kNotSupported before anything changes); seq applies to every
// child. A load validates the outer stream, asks every child whether it would accept its stream
// (Cache::CheckDeserialize: everything but the allocation), so that a malformed, incompatible or
// too-large child stream changes no child, not even its forward pass, backs every child up in
// memory, and then loads the children in order; if child i still fails (out of memory), children
// 0..i-1 are restored from their backups (contents as before; their current forward pass is
// dropped, and storage they allocated stays allocated, zeroed or unused). Through a plain Cache& a
// wrapper is kNotSupported; call these overloads with the WrapperCache type.
//
// Files: SaveCacheFile writes `path` + ".tmp", fsyncs it, renames it over `path` and fsyncs the
// directory, so a crash mid-save leaves either the previous file or the new one, never a torn one.
// A stale ".tmp" from a crash is overwritten by the next save.
//
// Threading: saving reads the cache (like Get); no other call may run on that cache meanwhile.
#ifndef KVCACHE_CORE_PERSISTENCE_H_
#define KVCACHE_CORE_PERSISTENCE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "core/cache.h"
#include "core/sequence_cache.h"
#include "core/status.h"

namespace kv {

inline constexpr uint32_t kPersistenceVersion = 1;

// Replaces *out with the stream of `cache` (seq == -1: every sequence; else that one sequence).
// kNotSupported for cache kinds without persistence, kInvalidArgument before Init or for a bad seq.
Status SaveCache(const Cache& cache, std::vector<uint8_t>* out, int seq = -1);
// Loads a stream written by SaveCache into `cache` (see the rules above). seq: -1 for a whole-cache
// stream; for a one-sequence stream the destination sequence (-1: the saved one).
Status LoadCache(std::span<const uint8_t> bytes, Cache* cache, int seq = -1);

Status SaveCacheFile(const Cache& cache, const char* path, int seq = -1);
Status LoadCacheFile(const char* path, Cache* cache, int seq = -1);

// Wrapper caches: every child, in order (see above).
Status SaveCache(const WrapperCache& cache, std::vector<uint8_t>* out, int seq = -1);
Status LoadCache(std::span<const uint8_t> bytes, WrapperCache* cache, int seq = -1);
Status SaveCacheFile(const WrapperCache& cache, const char* path, int seq = -1);
Status LoadCacheFile(const char* path, WrapperCache* cache, int seq = -1);

// The growing and rotating caches: the stream wraps SaveState / RestoreState. The target must have
// the same dtype, max_size and keep (kInvalidArgument otherwise).
Status SaveSequenceCache(const SequenceCache& cache, std::vector<uint8_t>* out);
Status LoadSequenceCache(std::span<const uint8_t> bytes, SequenceCache* cache);
Status SaveSequenceCacheFile(const SequenceCache& cache, const char* path);
Status LoadSequenceCacheFile(const char* path, SequenceCache* cache);

}  // namespace kv

#endif  // KVCACHE_CORE_PERSISTENCE_H_
