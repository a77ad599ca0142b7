// The growing and rotating caches (the seeds' imagegen Cache), [B, H, T, D] layout.
// Exact behaviour: SEMANTICS.md section 11.
//
// Shapes: Update takes key {Dk, n, H, B} and value {Dv, n, H, B} (TensorView order, ne[0] fastest;
// f32, f16 or bf16, any strides) and returns keys_out {Dk, L, H, B} and values_out {Dv, L, H, B} in
// the storage dtype: one strided view each, tokens in temporal order, no padding rows. Dk, Dv, H
// and B are fixed by the first Update (until Reset or RestoreState); quantized storage needs Dk and
// Dv multiples of 32. Views stay valid until the next Update, Trim, Reset or RestoreState.
//
// Memory (layouts/kv_layout.h SequenceBlockLayout: block[b][h][t][d], capacity T per (b, h)):
// - NewKVCache grows T in steps of 256 tokens, geometrically: the new capacity is the next
//   multiple of 256 at or above max(needed, 1.5 x old). The [B, H, T, D] layout puts T inside
//   every head's stride, so growing means a new block and a copy of every held row. 1.5x growth
//   bounds the copies at 3 per token amortized (c + c / 1.5 + c / 1.5^2 + ... <= 3c rows, c <= T)
//   and leaves at most a third of the block unused. Reserving ahead needs the final length, which
//   the cache does not know; plain 256-token steps (the seed) copy O(T^2 / 512) rows in all.
// - NewRotatingKVCache keeps a sliding window inside a block of max_size + slack tokens (slack
//   defaults to max(256, max_size / 2), rounded to 256): the held tokens are always one contiguous
//   run [start, start + len) laid out [sinks | recent], so every returned view is one strided view
//   in temporal order. Evicting the oldest non-sink token moves the `keep` sink rows one row
//   forward (keep rows per token; sinks are few); a new token is written at the run's end; when the
//   run reaches the end of the block it is moved back to the front once (at most max_size - 1 rows
//   every `slack` tokens). Bytes moved per decoded token after wrap-around, amortized, per (b, h)
//   and K or V: row_stride * (keep + (max_size - 1) / slack), plus the row written. Stats() counts
//   them. Measured (perf/bench_sequence_cache.cc; f16, H 8, D 128, keep 4): 24.6 KB moved per
//   decoded token at max_size 4096 and 32768, 6 rows per (b, h, K|V), against 16.8 MB and 134 MB
//   for copying the window into temporal order per token. The block grows 1.5x (256-token steps)
//   up to max_size + slack while filling; only a prefill that needs more grows it further; decode
//   never allocates. Known cost: the compaction is one call's work (max_size - 1 rows per (b, h)),
//   a latency spike once every `slack` tokens.
#ifndef KVCACHE_CORE_SEQUENCE_CACHE_H_
#define KVCACHE_CORE_SEQUENCE_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"
#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

namespace kv {

// Everything needed to restore a cache bit-exactly: its kind, counters, shapes and the held rows.
// keys: [B][H][len][key_row_bytes] packed (no row padding), tokens in temporal order, storage
// dtype; values likewise with value_row_bytes. A state with offset == 0 is an empty cache (shapes
// 0).
struct SequenceCacheState {
  DType dtype = DType::kF32;
  int32_t max_size = 0;  // 0: the growing cache
  int32_t keep = 0;
  int32_t offset = 0;     // tokens ever appended
  int32_t len = 0;        // tokens held: the first min(keep, offset) tokens, then the newest ones
  int32_t key_dim = 0;    // Dk
  int32_t value_dim = 0;  // Dv
  int32_t heads = 0;      // H
  int32_t batch = 0;      // B
  std::vector<uint8_t> keys;
  std::vector<uint8_t> values;
};

// Counters since construction (Reset does not clear them): what Update cost in memory traffic.
struct SequenceCacheStats {
  uint64_t bytes_written = 0;  // new rows converted into storage (K and V)
  uint64_t bytes_moved = 0;    // held rows copied: sink shifts, compaction, growth (K and V)
  uint64_t allocations = 0;    // blocks allocated (growth)
  int64_t capacity = 0;        // tokens per (b, h) in the current block
};

class SequenceCache {
 public:
  virtual ~SequenceCache() = default;
  // Appends key/value ({D, n, H, B}; n == key.ne[1]); returns the full history views in temporal
  // order, in the storage dtype.
  virtual Status Update(const TensorView& key, const TensorView& value, int n, TensorView* keys_out,
                        TensorView* values_out) = 0;
  virtual int Offset() const = 0;  // tokens ever appended (the next token's position)
  virtual int Len() const = 0;     // tokens held now
  virtual void Reset() = 0;

  // Drops the newest n tokens (speculative-decoding rollback): Offset() and Len() fall by n.
  // Allowed while every dropped token is still held; otherwise kInvalidArgument and no change.
  // n == 0 is a no-op; n < 0 is kInvalidArgument.
  virtual Status Trim(int n) {
    (void)n;
    return Status::Error(Code::kNotSupported, "Trim not supported by this cache");
  }
  // Copies the held tokens and counters into *state (allocates its vectors).
  virtual Status SaveState(SequenceCacheState* state) const {
    (void)state;
    return Status::Error(Code::kNotSupported, "SaveState not supported by this cache");
  }
  // Replaces the contents with a saved state. The state's dtype, max_size and keep must match this
  // cache's; an inconsistent state is kInvalidArgument (kCorrupt for wrong byte counts) and changes
  // nothing.
  virtual Status RestoreState(const SequenceCacheState& state) {
    (void)state;
    return Status::Error(Code::kNotSupported, "RestoreState not supported by this cache");
  }
  virtual SequenceCacheStats Stats() const { return {}; }
};

std::unique_ptr<SequenceCache> NewKVCache(DType dtype = DType::kF32);  // grows in steps of 256
std::unique_ptr<SequenceCache> NewRotatingKVCache(int max_size, int keep = 0,
                                                  DType dtype = DType::kF32);
// As above with an explicit slack (tokens of free room after the window; rounded up to 256 with the
// block). More slack: fewer compactions (bytes moved), more memory. An invalid configuration
// (max_size < 1, keep < 0, keep >= max_size: nothing could ever be evicted, slack < 1, an invalid
// dtype) still returns a cache, whose Update, Trim and RestoreState return kInvalidArgument saying
// why; the same holds for the three-argument form and for NewKVCache with an invalid dtype.
std::unique_ptr<SequenceCache> NewRotatingKVCache(int max_size, int keep, DType dtype, int slack);

}  // namespace kv

#endif  // KVCACHE_CORE_SEQUENCE_CACHE_H_
