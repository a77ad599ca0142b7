// The Cache interface (Ollama's kvcache.Cache) and its variants. Exact behaviour: SEMANTICS.md.
//
// Threading: a cache is used by one thread at a time: no call that changes it (everything except
// the readers below; Get counts as a change, it reads the layer SetLayer writes) may overlap with
// any other call on it. Between two changes, readers may run concurrently from any number of
// threads: Attend over Histories taken earlier, SaveCache, CanResume, MemoryBytes, NumCells,
// CheckConsistency. Views returned by Get stay valid until the next StartForward, Remove,
// CopyPrefix, Close or load (LoadCache) on that cache. Separate caches never interfere. A ShiftFn
// or ArenaAllocator runs on the thread that made the call (shared across caches on different
// threads, it must be thread-safe). Tested under ThreadSanitizer: tests/concurrency_test.cc.
#ifndef KVCACHE_CORE_CACHE_H_
#define KVCACHE_CORE_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/arena.h"
#include "core/status.h"
#include "core/types.h"

namespace kv {

class Cache {
 public:
  virtual ~Cache() = default;
  virtual Status SetConfig(const CacheConfig& config) = 0;  // before Init only
  virtual Status Init(DType dtype, int max_sequences, int capacity, int max_batch) = 0;
  virtual Status StartForward(const Batch& batch, bool reserve) = 0;
  virtual void SetLayer(int layer) = 0;
  // key: [k_head_dim, kv_heads, batch], value: [v_head_dim, kv_heads, batch]; f32, f16 or bf16.
  // Causal family: every Put of a layer takes the shapes and input dtypes of its first Put.
  virtual Status Put(const TensorView& key, const TensorView& value) = 0;
  // Views valid until the next StartForward, Remove, CopyPrefix or Close.
  virtual History Get() = 0;
  virtual Status CopyPrefix(int src_seq, int dst_seq, int32_t len) = 0;
  virtual bool CanResume(int seq, int32_t pos) const = 0;
  virtual Status Remove(int seq, int32_t begin, int32_t end) = 0;
  virtual void Close() = 0;

  // Beyond the seeds (defaults keep hand-written children of a wrapper valid).
  // The error SetConfig / Init would return for these arguments, found without changing anything
  // (Ok: they would be accepted; Init may still run out of memory). A wrapper asks every child
  // before it changes any, so that its own error leaves every child as it was.
  virtual Status CheckConfig(const CacheConfig& config) const {
    (void)config;
    return Status::Ok();
  }
  virtual Status CheckInit(DType dtype, int max_sequences, int capacity, int max_batch) const {
    (void)dtype;
    (void)max_sequences;
    (void)capacity;
    (void)max_batch;
    return Status::Ok();
  }
  // The error StartForward would return for this batch, found without changing anything a
  // caller can observe (Ok: it would be accepted, unless it runs out of memory). A wrapper asks
  // every child before it starts any, so that a batch one child refuses changes no child. It may
  // use the cache's scratch: for threading it counts as a change, like StartForward.
  virtual Status CheckStartForward(const Batch& batch, bool reserve) {
    (void)batch;
    (void)reserve;
    return Status::Ok();
  }
  // Bytes this cache holds now (allocated, not merely reserved by sizing rules): its K/V storage
  // and, for the causal family, its cell table, mask and per-pass scratch (~25 bytes per cell
  // after Init, before any K/V).
  virtual size_t MemoryBytes() const { return 0; }
  // False when CopyPrefix would return kNotSupported whatever its arguments (a single-sequence
  // encoder cache). Lets a wrapper refuse CopyPrefix before any child changes.
  virtual bool SupportsCopyPrefix() const { return true; }

  // Persistence (core/persistence.h has the format and the free functions that callers use).
  // Appends this cache's contents (seq == -1: every sequence; else that sequence only) to *out.
  virtual Status Serialize(std::vector<uint8_t>* out, int seq) const {
    (void)out;
    (void)seq;
    return Status::Error(Code::kNotSupported, "this cache kind cannot be saved");
  }
  // Replaces the contents (seq == -1: the whole cache; else sequence seq, or the saved sequence's
  // own id when the stream holds one sequence and seq == -1) with a stream written by Serialize.
  // Validates everything first: on error the cache is unchanged.
  virtual Status Deserialize(std::span<const uint8_t> bytes, int seq) {
    (void)bytes;
    (void)seq;
    return Status::Error(Code::kNotSupported, "this cache kind cannot be loaded");
  }
  // The error Deserialize would return, found without changing anything (Ok: it would succeed
  // unless it runs out of memory). A wrapper asks every child before it loads any.
  virtual Status CheckDeserialize(std::span<const uint8_t> bytes, int seq) {
    (void)bytes;
    (void)seq;
    return Status::Ok();
  }
  // Where K/V storage comes from (tests inject failures through it). Only while the cache holds
  // no storage (before Init, or after Close); else kInvalidArgument.
  virtual Status SetAllocator(const ArenaAllocator& allocator) {
    (void)allocator;
    return Status::Error(Code::kNotSupported, "this cache kind has no injectable allocator");
  }
};

// The causal family: causal, sliding window, sliding window with memory, chunked attention.
class CausalCache : public Cache {
 public:
  // Batch indices exempt from the causal rule until the next StartForward; rebuilds the mask now.
  virtual void SetCausal(std::span<const int32_t> except) = 0;

  // Beyond the seeds:
  // Allocates storage for layers [0, layers) up front in one arena allocation, so that no Put
  // allocates. Shapes must then match every Put. Call after Init.
  virtual Status ReserveLayers(int layers, int k_head_dim, int v_head_dim, int kv_heads) = 0;
  virtual int32_t NumCells() const = 0;  // cells after Init's sizing rules (SEMANTICS.md section 1)
  // Checks the cell table's invariants by brute force (tests, fuzzers); kCorrupt names a violation.
  virtual Status CheckConsistency() const = 0;
};

std::unique_ptr<CausalCache> NewCausalCache(ShiftFn shift = nullptr);
std::unique_ptr<CausalCache> NewSWACache(int32_t window, ShiftFn shift = nullptr);
std::unique_ptr<CausalCache> NewSWAMemCache(int32_t window, int32_t memory,
                                            ShiftFn shift = nullptr);
std::unique_ptr<CausalCache> NewChunkedAttentionCache(int32_t chunk, ShiftFn shift = nullptr);

class EncoderCache : public Cache {
 public:
  // Get's views carry null data while this is false (their shapes are those last Put).
  virtual bool EncoderCached() const = 0;
};
std::unique_ptr<EncoderCache> NewEncoderCache();

// Beyond the seeds.
struct EncoderOptions {
  // false (as Ollama): one encoder block shared by every sequence; Remove ignores which sequence.
  // true: one block per sequence, selected by the batch's sequence; every batch must then hold
  // tokens of one sequence only (else StartForward is kInvalidArgument), and CopyPrefix copies the
  // source's encoder data when its multimodal position lies inside the prefix. EncoderCached(),
  // Put and Get refer to the sequence of the last StartForward.
  bool per_sequence = false;
};
std::unique_ptr<EncoderCache> NewEncoderCache(const EncoderOptions& options);

class WrapperCache : public Cache {
 public:
  virtual void SetLayerType(int type) = 0;  // which child the next Put/Get go to
  virtual Cache* UnderlyingCache() = 0;     // the child selected now

  // Beyond the seeds:
  virtual int NumChildren() const = 0;
  virtual Cache* Child(int i) = 0;  // nullptr when i is out of range
  // MemoryBytes() of each child, in order (MemoryBytes() is their sum): lets a runtime plan memory
  // per layer type instead of assuming every layer holds a full-context cache.
  virtual std::vector<size_t> ChildMemoryBytes() const = 0;
};
std::unique_ptr<WrapperCache> NewWrapperCache(std::vector<std::unique_ptr<Cache>> caches);

}  // namespace kv

#endif  // KVCACHE_CORE_CACHE_H_
