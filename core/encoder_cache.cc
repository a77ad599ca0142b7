// The encoder cache (SEMANTICS.md section 9): position-independent K/V (cross-attention, vision
// encoders) stored once per layer exactly as given and read by every later forward pass.
//
// Storage: each (sequence slot, layer) owns one Arena holding a contiguous K block and a contiguous
// V block (64-byte aligned, zero-filled). A Put of the same or a smaller size reuses the blocks; a
// larger one (a bigger image) replaces that layer's arena. That is the only allocation after the
// first Put, and it is not steady state: an image of a new size arrives.
//
// Choices beyond Ollama's encoder.go (documented in core/cache.h and here):
// - A reserve pass's Put sizes storage (preserving any cached data) but neither copies nor marks
//   the encoder cached: the reserve graph is never a real image.
// - EncoderOptions::per_sequence keeps one block per sequence (Ollama holds one for all).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/cache.h"

namespace kv {
namespace {

// The same bound as the causal family: a layer index is an array index.
constexpr int kMaxLayers = 4096;

bool ValidInput(const TensorView& t) {
  if (t.data == nullptr || !IsFloatDType(t.dtype)) return false;
  for (int d = 0; d < 4; ++d) {
    if (t.ne[d] < 1) return false;
  }
  return true;
}

size_t ContiguousBytes(const TensorView& t) {
  return static_cast<size_t>(NumElements(t)) * BlockBytes(t.dtype);
}

// Copies `src` (any strides, float dtype) into contiguous `dst` of the same dtype. With `permute`,
// dst is [ne2, ne0, ne1, ne3]: element (i0, i1, i2, i3) lands at i2 + ne2 * (i0 + ne0 * (i1 + ne1 *
// i3)), i.e. tokens fastest (Ollama's value.Permute(ctx, 1, 2, 0, 3) for permuted V).
void CopyToContiguous(const TensorView& src, void* dst, bool permute) {
  const size_t es = BlockBytes(src.dtype);
  char* out = static_cast<char*>(dst);
  const int64_t n0 = src.ne[0], n1 = src.ne[1], n2 = src.ne[2], n3 = src.ne[3];
  for (int64_t i3 = 0; i3 < n3; ++i3) {
    for (int64_t i2 = 0; i2 < n2; ++i2) {
      for (int64_t i1 = 0; i1 < n1; ++i1) {
        const char* row = static_cast<const char*>(RowPtr(src, i1, i2, i3));
        if (!permute) {
          char* o = out + static_cast<size_t>(((i3 * n2 + i2) * n1 + i1) * n0) * es;
          if (src.nb[0] == es) {
            std::memcpy(o, row, static_cast<size_t>(n0) * es);
          } else {
            for (int64_t i0 = 0; i0 < n0; ++i0) std::memcpy(o + i0 * es, row + i0 * src.nb[0], es);
          }
        } else {
          for (int64_t i0 = 0; i0 < n0; ++i0) {
            const size_t idx = static_cast<size_t>(i2 + n2 * (i0 + n0 * (i1 + n1 * i3)));
            std::memcpy(out + idx * es, row + i0 * src.nb[0], es);
          }
        }
      }
    }
  }
}

TensorView ContiguousView(void* data, DType dtype, const int64_t ne[4]) {
  return MakeView(data, dtype, {ne[0], ne[1], ne[2], ne[3]});
}

// One layer's K and V for one sequence slot.
struct LayerStore {
  std::unique_ptr<Arena> arena;
  void* k = nullptr;
  void* v = nullptr;
  size_t k_cap = 0, v_cap = 0;
  bool has_view = false;  // k_view / v_view describe valid contents (or reserved zeros)
  TensorView k_view, v_view;

  size_t Bytes() const { return arena ? arena->BytesReserved() : 0; }

  // Makes room for k_bytes / v_bytes. With `preserve`, the bytes the views describe survive a
  // reallocation. On failure nothing changes.
  Status Ensure(size_t k_bytes, size_t v_bytes, bool preserve, const ArenaAllocator& allocator) {
    if (k_bytes <= k_cap && v_bytes <= v_cap) return Status::Ok();
    k_bytes = std::max(k_bytes, k_cap);
    v_bytes = std::max(v_bytes, v_cap);
    auto fresh = std::make_unique<Arena>(allocator);
    const size_t align = 64;
    KV_RETURN_IF_ERROR(fresh->Reserve((k_bytes + align - 1) / align * align +
                                      (v_bytes + align - 1) / align * align));
    void* nk = nullptr;
    void* nv = nullptr;
    KV_RETURN_IF_ERROR(fresh->Allocate(k_bytes, &nk));
    KV_RETURN_IF_ERROR(fresh->Allocate(v_bytes, &nv));
    if (preserve && has_view) {
      std::memcpy(nk, k, k_cap);
      std::memcpy(nv, v, v_cap);
      k_view.data = nk;
      v_view.data = nv;
    }
    arena = std::move(fresh);
    k = nk;
    v = nv;
    k_cap = k_bytes;
    v_cap = v_bytes;
    return Status::Ok();
  }
};

// Per sequence slot: the recorded position and whether it is cached.
struct Slot {
  bool cached = false;
  int32_t pos = 0;      // position of the cached data
  int32_t cur_pos = 0;  // position recorded by the last StartForward with multimodal tokens
  std::vector<LayerStore> layers;
};

class EncoderCacheImpl final : public EncoderCache {
 public:
  explicit EncoderCacheImpl(const EncoderOptions& options) : options_(options) {}

  Status SetConfig(const CacheConfig& config) override {
    if (initialized_) {
      return Status::Error(Code::kInvalidArgument, "encoder: SetConfig must come before Init");
    }
    if (config.padding != 1) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: cannot enforce padding %d (only 1 is supported)",
                           config.padding);
    }
    config_ = config;
    return Status::Ok();
  }

  Status Init(DType dtype, int max_sequences, int capacity, int max_batch) override {
    if (!IsValidDType(dtype) || max_sequences < 1 || capacity < 1 || max_batch < 1) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: Init(dtype %d, sequences %d, capacity %d, batch %d) invalid",
                           static_cast<int>(dtype), max_sequences, capacity, max_batch);
    }
    Close();
    // The storage dtype is not applied: K/V keep the dtype they are given (as Ollama).
    max_sequences_ = max_sequences;
    max_batch_ = max_batch;
    slots_.resize(options_.per_sequence ? static_cast<size_t>(max_sequences) : 1);
    initialized_ = true;
    return Status::Ok();
  }

  Status StartForward(const Batch& batch, bool reserve) override {
    if (!initialized_) return Status::Error(Code::kInvalidArgument, "encoder: not initialized");
    const size_t b = batch.positions.size();
    if (b != batch.sequences.size() || b < 1 || b > static_cast<size_t>(max_batch_)) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: batch of %zu positions / %zu sequences (max batch %d)", b,
                           batch.sequences.size(), max_batch_);
    }
    for (int32_t s : batch.sequences) {
      if (s < 0 || s >= max_sequences_) {
        return Status::Error(Code::kInvalidArgument, "encoder: sequence %d out of [0, %d)", s,
                             max_sequences_);
      }
      if (options_.per_sequence && s != batch.sequences[0]) {
        return Status::Error(Code::kInvalidArgument,
                             "encoder: per-sequence mode needs one sequence per batch (%d and %d)",
                             batch.sequences[0], s);
      }
    }
    for (int32_t m : batch.multimodal) {
      if (m < 0 || static_cast<size_t>(m) >= b) {
        return Status::Error(Code::kInvalidArgument, "encoder: multimodal index %d out of [0, %zu)",
                             m, b);
      }
    }
    cur_slot_ = options_.per_sequence ? batch.sequences[0] : 0;
    // We work with the most recent image (as Ollama): the batch's last multimodal token.
    if (!batch.multimodal.empty()) {
      slots_[cur_slot_].cur_pos = batch.positions[batch.multimodal.back()];
    }
    reserve_ = reserve;
    return Status::Ok();
  }

  void SetLayer(int layer) override { layer_ = layer; }

  bool EncoderCached() const override { return initialized_ && slots_[cur_slot_].cached; }

  Status Put(const TensorView& key, const TensorView& value) override {
    if (!initialized_) return Status::Error(Code::kInvalidArgument, "encoder: not initialized");
    if (layer_ < 0 || layer_ >= kMaxLayers) {
      return Status::Error(Code::kInvalidArgument, "encoder: layer %d outside [0, %d)", layer_,
                           kMaxLayers);
    }
    if (!ValidInput(key) || !ValidInput(value)) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: K/V must be non-null f32/f16/bf16 with positive dims");
    }
    Slot& slot = slots_[cur_slot_];
    if (static_cast<size_t>(layer_) >= slot.layers.size()) slot.layers.resize(layer_ + 1);
    LayerStore& ls = slot.layers[layer_];
    const size_t kb = ContiguousBytes(key), vb = ContiguousBytes(value);
    const bool permute = config_.permuted_v;
    int64_t vne[4] = {value.ne[0], value.ne[1], value.ne[2], value.ne[3]};
    if (permute) {
      vne[0] = value.ne[2];
      vne[1] = value.ne[0];
      vne[2] = value.ne[1];
    }
    if (reserve_) {
      // Size the storage for this shape, keep what is cached, mark nothing.
      KV_RETURN_IF_ERROR(ls.Ensure(kb, vb, /*preserve=*/true, allocator_));
      if (!ls.has_view) {
        ls.k_view = ContiguousView(ls.k, key.dtype, key.ne);
        ls.v_view = ContiguousView(ls.v, value.dtype, vne);
        ls.has_view = true;
      }
      return Status::Ok();
    }
    KV_RETURN_IF_ERROR(ls.Ensure(kb, vb, /*preserve=*/false, allocator_));
    CopyToContiguous(key, ls.k, false);
    CopyToContiguous(value, ls.v, permute);
    ls.k_view = ContiguousView(ls.k, key.dtype, key.ne);
    ls.v_view = ContiguousView(ls.v, value.dtype, vne);
    ls.has_view = true;
    slot.pos = slot.cur_pos;
    slot.cached = true;
    return Status::Ok();
  }

  History Get() override {
    History h;  // no mask: every batch token sees the whole encoder output
    if (!initialized_ || layer_ < 0) return h;
    const Slot& slot = slots_[cur_slot_];
    if (static_cast<size_t>(layer_) >= slot.layers.size()) return h;
    const LayerStore& ls = slot.layers[layer_];
    if (!ls.has_view) return h;
    h.k = ls.k_view;
    h.v = ls.v_view;
    return h;
  }

  bool SupportsCopyPrefix() const override { return options_.per_sequence; }

  Status CopyPrefix(int src_seq, int dst_seq, int32_t len) override {
    if (!options_.per_sequence) {
      return Status::Error(Code::kNotSupported,
                           "encoder: CopyPrefix needs EncoderOptions::per_sequence");
    }
    if (!initialized_ || src_seq < 0 || src_seq >= max_sequences_ || dst_seq < 0 ||
        dst_seq >= max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "encoder: CopyPrefix(%d, %d) out of range",
                           src_seq, dst_seq);
    }
    if (src_seq == dst_seq) return Status::Ok();
    Slot& src = slots_[src_seq];
    Slot& dst = slots_[dst_seq];
    if (!src.cached || src.pos >= len) {
      dst.cached = false;  // dst keeps only a prefix that holds no image
      return Status::Ok();
    }
    // Make room in every layer first, then copy: a failed allocation changes nothing visible.
    if (dst.layers.size() < src.layers.size()) dst.layers.resize(src.layers.size());
    for (size_t l = 0; l < src.layers.size(); ++l) {
      const LayerStore& s = src.layers[l];
      if (!s.has_view) continue;
      KV_RETURN_IF_ERROR(dst.layers[l].Ensure(ContiguousBytes(s.k_view), ContiguousBytes(s.v_view),
                                              /*preserve=*/true, allocator_));
    }
    for (size_t l = 0; l < src.layers.size(); ++l) {
      const LayerStore& s = src.layers[l];
      LayerStore& d = dst.layers[l];
      if (!s.has_view) {
        d.has_view = false;
        continue;
      }
      std::memcpy(d.k, s.k, ContiguousBytes(s.k_view));
      std::memcpy(d.v, s.v, ContiguousBytes(s.v_view));
      d.k_view = s.k_view;
      d.v_view = s.v_view;
      d.k_view.data = d.k;
      d.v_view.data = d.v;
      d.has_view = true;
    }
    for (size_t l = src.layers.size(); l < dst.layers.size(); ++l) dst.layers[l].has_view = false;
    dst.cached = true;
    dst.pos = src.pos;
    return Status::Ok();
  }

  bool CanResume(int, int32_t) const override { return true; }

  Status Remove(int seq, int32_t begin, int32_t end) override {
    if (!initialized_ || seq < 0 || seq >= max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "encoder: Remove of sequence %d out of range",
                           seq);
    }
    Slot& slot = slots_[options_.per_sequence ? seq : 0];
    // SEMANTICS.md §9, as Ollama: the recorded position never moves, even when a causal child
    // shifts later tokens down.
    if (slot.pos >= begin && slot.pos < end) slot.cached = false;
    return Status::Ok();
  }

  void Close() override {
    slots_.clear();
    initialized_ = false;
    cur_slot_ = 0;
    layer_ = 0;
    reserve_ = false;
  }

  Status SetAllocator(const ArenaAllocator& allocator) override {
    if (MemoryBytes() != 0) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: SetAllocator while holding storage (call before Init or after "
                           "Close)");
    }
    if (allocator.allocate == nullptr || allocator.release == nullptr) {
      return Status::Error(Code::kInvalidArgument, "encoder: allocator without functions");
    }
    allocator_ = allocator;
    return Status::Ok();
  }

  size_t MemoryBytes() const override {
    size_t total = 0;
    for (const Slot& s : slots_) {
      for (const LayerStore& l : s.layers) total += l.Bytes();
    }
    return total;
  }

 private:
  EncoderOptions options_;
  CacheConfig config_;
  ArenaAllocator allocator_ = SystemAllocator();
  bool initialized_ = false;
  int max_sequences_ = 0;
  int max_batch_ = 0;
  std::vector<Slot> slots_;
  int cur_slot_ = 0;
  int layer_ = 0;
  bool reserve_ = false;
};

}  // namespace

std::unique_ptr<EncoderCache> NewEncoderCache() { return NewEncoderCache(EncoderOptions{}); }

std::unique_ptr<EncoderCache> NewEncoderCache(const EncoderOptions& options) {
  return std::make_unique<EncoderCacheImpl>(options);
}

}  // namespace kv
