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
//   the encoder cached: the reserve graph is never a real image. While the encoder is not cached
//   (only reserved, or its image removed) Get's views keep their shapes with data null; Ollama
//   returns the tensors it last allocated.
// - EncoderOptions::per_sequence keeps one block per sequence (Ollama holds one for all).
// - Save / load (Serialize / Deserialize, stream kind 4; format and rules in core/persistence.h):
//   a load parses and checks the whole stream, allocates any larger blocks into locals, and only
//   then copies; a load also reuses blocks that are large enough (capacity only grows).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/cache.h"
#include "core/stream_impl.h"

namespace kv {
namespace {

// The same bound as the causal family: a layer index is an array index.
constexpr int kMaxLayers = 4096;

// A shape the encoder stores: every dimension positive, and its contiguous copy's bytes (from a
// view or a stream, neither bounded: ContiguousBytesFit) within size_t.
bool PositiveShapeFits(DType dtype, const int64_t ne[4], size_t* bytes) {
  for (int d = 0; d < 4; ++d) {
    if (ne[d] < 1) return false;
  }
  return ContiguousBytesFit(dtype, ne, bytes);
}

bool ValidInput(const TensorView& t) {
  size_t bytes = 0;
  return t.data != nullptr && IsFloatDType(t.dtype) && PositiveShapeFits(t.dtype, t.ne, &bytes);
}

// Precondition: ValidInput(t), or t's shape from a stream that ReadShape accepted.
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

  // A fresh arena with a K block of k_bytes and a V block of v_bytes (64-byte aligned, zeroed).
  static Status AllocateBlocks(size_t k_bytes, size_t v_bytes, const ArenaAllocator& allocator,
                               std::unique_ptr<Arena>* arena, void** k, void** v) {
    auto fresh = std::make_unique<Arena>(allocator);
    const size_t align = 64;
    KV_RETURN_IF_ERROR(fresh->Reserve((k_bytes + align - 1) / align * align +
                                      (v_bytes + align - 1) / align * align));
    KV_RETURN_IF_ERROR(fresh->Allocate(k_bytes, k));
    KV_RETURN_IF_ERROR(fresh->Allocate(v_bytes, v));
    *arena = std::move(fresh);
    return Status::Ok();
  }

  // Makes room for k_bytes / v_bytes. With `preserve`, the bytes the views describe survive a
  // reallocation. On failure nothing changes. Capacity never shrinks.
  Status Ensure(size_t k_bytes, size_t v_bytes, bool preserve, const ArenaAllocator& allocator) {
    if (k_bytes <= k_cap && v_bytes <= v_cap) return Status::Ok();
    k_bytes = std::max(k_bytes, k_cap);
    v_bytes = std::max(v_bytes, v_cap);
    std::unique_ptr<Arena> fresh;
    void* nk = nullptr;
    void* nv = nullptr;
    KV_RETURN_IF_ERROR(AllocateBlocks(k_bytes, v_bytes, allocator, &fresh, &nk, &nv));
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

  Status CheckConfig(const CacheConfig& config) const override {
    if (initialized_) {
      return Status::Error(Code::kInvalidArgument, "encoder: SetConfig must come before Init");
    }
    if (config.padding != 1) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: cannot enforce padding %d (only 1 is supported)",
                           config.padding);
    }
    return Status::Ok();
  }

  Status SetConfig(const CacheConfig& config) override {
    KV_RETURN_IF_ERROR(CheckConfig(config));
    config_ = config;
    return Status::Ok();
  }

  Status CheckInit(DType dtype, int max_sequences, int capacity, int max_batch) const override {
    if (!IsValidDType(dtype) || max_sequences < 1 || capacity < 1 || max_batch < 1) {
      return Status::Error(Code::kInvalidArgument,
                           "encoder: Init(dtype %d, sequences %d, capacity %d, batch %d) invalid",
                           static_cast<int>(dtype), max_sequences, capacity, max_batch);
    }
    return Status::Ok();
  }

  Status Init(DType dtype, int max_sequences, int capacity, int max_batch) override {
    KV_RETURN_IF_ERROR(CheckInit(dtype, max_sequences, capacity, max_batch));
    Close();
    // The storage dtype is not applied: K/V keep the dtype they are given (as Ollama).
    dtype_ = dtype;
    max_sequences_ = max_sequences;
    max_batch_ = max_batch;
    slots_.resize(options_.per_sequence ? static_cast<size_t>(max_sequences) : 1);
    initialized_ = true;
    return Status::Ok();
  }

  Status CheckStartForward(const Batch& batch, bool reserve) override {
    (void)reserve;
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
    return Status::Ok();
  }

  Status StartForward(const Batch& batch, bool reserve) override {
    KV_RETURN_IF_ERROR(CheckStartForward(batch, reserve));
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
                           "encoder: K/V must be non-null f32/f16/bf16 with positive dims "
                           "whose contiguous copy fits in memory");
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
    h.v_layout = config_.permuted_v ? VLayout::kPermuted : VLayout::kPlain;
    // SEMANTICS.md §9: data null until cached. The shapes stay (a reserve pass's sizing reads
    // them); a reserve pass's zeros and a removed image's rows are not the encoder output.
    if (!slot.cached) h.k.data = h.v.data = nullptr;
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

  Status Serialize(std::vector<uint8_t>* out, int seq) const override;
  Status Deserialize(std::span<const uint8_t> bytes, int seq) override {
    return Load(bytes, seq, /*check_only=*/false);
  }
  Status CheckDeserialize(std::span<const uint8_t> bytes, int seq) override {
    return Load(bytes, seq, /*check_only=*/true);
  }

  size_t MemoryBytes() const override {
    size_t total = 0;
    for (const Slot& s : slots_) {
      for (const LayerStore& l : s.layers) total += l.Bytes();
    }
    return total;
  }

 private:
  // Deserialize, or with check_only its checks alone (everything up to the allocation).
  Status Load(std::span<const uint8_t> bytes, int seq, bool check_only);

  EncoderOptions options_;
  CacheConfig config_;
  DType dtype_ = DType::kF32;  // Init's dtype: recorded and checked by persistence, not applied
  ArenaAllocator allocator_ = SystemAllocator();
  bool initialized_ = false;
  int max_sequences_ = 0;
  int max_batch_ = 0;
  std::vector<Slot> slots_;
  int cur_slot_ = 0;
  int layer_ = 0;
  bool reserve_ = false;
};

// ---- persistence (stream kind 4; the format and the rules are in core/persistence.h) -----------

using internal::BeginStream;
using internal::CopyElementsIn;
using internal::EndStream;
using internal::kKindEncoder;
using internal::OpenStream;
using internal::PutElements;
using internal::PutI32;
using internal::PutU64;
using internal::PutU8;
using internal::Reader;
using internal::Truncated;

void PutShape(std::vector<uint8_t>* out, const TensorView& v) {
  for (int d = 0; d < 4; ++d) PutU64(out, static_cast<uint64_t>(v.ne[d]));
}

Status EncoderCacheImpl::Serialize(std::vector<uint8_t>* out, int seq) const {
  if (out == nullptr) return Status::Error(Code::kInvalidArgument, "save: null output");
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "save: encoder not initialized");
  if (seq < -1 || seq >= max_sequences_) {
    return Status::Error(Code::kInvalidArgument, "save: sequence %d outside [-1, %d)", seq,
                         max_sequences_);
  }
  // seq >= 0 saves the block that sequence reads: its own, or the shared one.
  size_t first = 0, count = slots_.size();
  if (seq >= 0) {
    first = options_.per_sequence ? static_cast<size_t>(seq) : 0;
    count = 1;
  }
  size_t total = internal::kHeaderBytes + 16 + internal::kTrailerBytes;
  for (size_t i = first; i < first + count; ++i) {
    total += 16;
    for (const LayerStore& l : slots_[i].layers) {
      total += 4;
      if (l.has_view) total += 64 + ContiguousBytes(l.k_view) + ContiguousBytes(l.v_view);
    }
  }
  out->reserve(total);
  BeginStream(out, kKindEncoder);
  PutU8(out, static_cast<uint8_t>(dtype_));
  PutU8(out, options_.per_sequence ? 1 : 0);
  PutU8(out, config_.permuted_v ? 1 : 0);
  PutU8(out, 0);
  PutI32(out, max_sequences_);
  PutI32(out, seq);
  PutI32(out, static_cast<int32_t>(count));
  for (size_t i = first; i < first + count; ++i) {
    const Slot& slot = slots_[i];
    PutU8(out, slot.cached ? 1 : 0);
    PutU8(out, 0);
    PutU8(out, 0);
    PutU8(out, 0);
    PutI32(out, slot.pos);
    PutI32(out, slot.cur_pos);
    // Trailing layers without contents carry nothing.
    size_t n_layers = slot.layers.size();
    while (n_layers > 0 && !slot.layers[n_layers - 1].has_view) --n_layers;
    PutI32(out, static_cast<int32_t>(n_layers));
    for (size_t l = 0; l < n_layers; ++l) {
      const LayerStore& ls = slot.layers[l];
      PutU8(out, ls.has_view ? 1 : 0);
      PutU8(out, ls.has_view ? static_cast<uint8_t>(ls.k_view.dtype) : 0);
      PutU8(out, ls.has_view ? static_cast<uint8_t>(ls.v_view.dtype) : 0);
      PutU8(out, 0);
      if (!ls.has_view) continue;
      PutShape(out, ls.k_view);
      PutShape(out, ls.v_view);
      PutElements(out, ls.k, ContiguousBytes(ls.k_view), ls.k_view.dtype);
      PutElements(out, ls.v, ContiguousBytes(ls.v_view), ls.v_view.dtype);
    }
  }
  EndStream(out);
  return Status::Ok();
}

namespace {

struct StreamLayer {
  bool present = false;
  DType k_dtype = DType::kF32, v_dtype = DType::kF32;
  int64_t k_ne[4] = {0, 0, 0, 0}, v_ne[4] = {0, 0, 0, 0};
  size_t k_bytes = 0, v_bytes = 0;
  const uint8_t* k = nullptr;  // into the caller's bytes
  const uint8_t* v = nullptr;
  // Storage to adopt when the target layer's blocks are too small (prepared before any change).
  std::unique_ptr<Arena> arena;
  void* new_k = nullptr;
  void* new_v = nullptr;
};

struct StreamSlot {
  bool cached = false;
  int32_t pos = 0, cur_pos = 0;
  std::vector<StreamLayer> layers;
};

// A positive shape in a float dtype whose contiguous byte count fits in size_t (as Put accepts).
bool ReadShape(Reader* r, uint8_t dtype_u8, int64_t ne[4], size_t* bytes) {
  const DType dtype = static_cast<DType>(dtype_u8);
  if (!IsValidDType(dtype) || !IsFloatDType(dtype)) return false;
  for (int d = 0; d < 4; ++d) {
    if (!r->I64(&ne[d])) return false;
  }
  return PositiveShapeFits(dtype, ne, bytes);
}

}  // namespace

Status EncoderCacheImpl::Load(std::span<const uint8_t> bytes, int seq, bool check_only) {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "load: encoder not initialized");
  Reader r;
  KV_RETURN_IF_ERROR(OpenStream(bytes, kKindEncoder, &r));

  // 1. Parse and check the stream on its own (kCorrupt: malformed whatever the target).
  uint8_t dtype_u8 = 0, per_seq = 0, permuted = 0, z = 0;
  int32_t max_seqs = 0, saved_seq = 0, n_slots = 0;
  if (!r.U8(&dtype_u8) || !r.U8(&per_seq) || !r.U8(&permuted) || !r.U8(&z) || !r.I32(&max_seqs) ||
      !r.I32(&saved_seq) || !r.I32(&n_slots)) {
    return Truncated("the encoder header");
  }
  const DType dtype = static_cast<DType>(dtype_u8);
  if (!IsValidDType(dtype) || per_seq > 1 || permuted > 1 || z != 0)
    return Status::Error(Code::kCorrupt, "cache stream: bad dtype/flags %u/%u/%u", dtype_u8,
                         per_seq, permuted);
  const int32_t want_slots = saved_seq >= 0 ? 1 : (per_seq ? max_seqs : 1);
  if (max_seqs < 1 || saved_seq < -1 || saved_seq >= max_seqs || n_slots != want_slots ||
      static_cast<size_t>(n_slots) > r.left() / 16) {
    return Status::Error(
        Code::kCorrupt, "cache stream: impossible encoder shape (sequences %d, saved %d, slots %d)",
        max_seqs, saved_seq, n_slots);
  }
  std::vector<StreamSlot> ss(static_cast<size_t>(n_slots));
  for (StreamSlot& s : ss) {
    uint8_t cached = 0, a = 0, b = 0, c = 0;
    int32_t n_layers = 0;
    if (!r.U8(&cached) || !r.U8(&a) || !r.U8(&b) || !r.U8(&c) || !r.I32(&s.pos) ||
        !r.I32(&s.cur_pos) || !r.I32(&n_layers)) {
      return Truncated("an encoder slot");
    }
    if (cached > 1 || a != 0 || b != 0 || c != 0 || n_layers < 0 || n_layers > kMaxLayers ||
        static_cast<size_t>(n_layers) > r.left() / 4) {
      return Status::Error(Code::kCorrupt, "cache stream: bad encoder slot (flag %u, layers %d)",
                           cached, n_layers);
    }
    s.cached = cached != 0;
    s.layers.resize(static_cast<size_t>(n_layers));
    for (StreamLayer& l : s.layers) {
      uint8_t present = 0, kd = 0, vd = 0, zz = 0;
      if (!r.U8(&present) || !r.U8(&kd) || !r.U8(&vd) || !r.U8(&zz))
        return Truncated("an encoder layer");
      if (present > 1 || zz != 0 || (present == 0 && (kd != 0 || vd != 0)))
        return Status::Error(Code::kCorrupt, "cache stream: bad encoder layer record");
      if (present == 0) continue;
      l.present = true;
      l.k_dtype = static_cast<DType>(kd);
      l.v_dtype = static_cast<DType>(vd);
      if (!ReadShape(&r, kd, l.k_ne, &l.k_bytes) || !ReadShape(&r, vd, l.v_ne, &l.v_bytes))
        return Status::Error(Code::kCorrupt, "cache stream: bad encoder K/V dtype or shape");
      if (!r.Bytes(l.k_bytes, &l.k) || !r.Bytes(l.v_bytes, &l.v)) return Truncated("encoder rows");
    }
  }
  if (r.left() != 0)
    return Status::Error(Code::kCorrupt, "cache stream: %zu bytes after the encoder", r.left());

  // 2. Compatibility with this cache (kInvalidArgument: a good stream for another cache).
  if (dtype != dtype_ || (per_seq != 0) != options_.per_sequence ||
      (permuted != 0) != config_.permuted_v) {
    return Status::Error(Code::kInvalidArgument,
                         "load: stream encoder is %s per_sequence %d permuted_v %d, this one %s "
                         "%d %d",
                         DTypeName(dtype), per_seq, permuted, DTypeName(dtype_),
                         options_.per_sequence ? 1 : 0, config_.permuted_v ? 1 : 0);
  }
  size_t first = 0;
  if (saved_seq < 0) {
    if (seq != -1) {
      return Status::Error(Code::kInvalidArgument,
                           "load: stream holds the whole encoder; sequence %d must be -1", seq);
    }
    if (max_seqs != max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "load: stream has %d sequences, cache has %d",
                           max_seqs, max_sequences_);
    }
  } else {
    const int dst = seq == -1 ? saved_seq : seq;
    if (dst < 0 || dst >= max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "load: sequence %d outside [0, %d)", dst,
                           max_sequences_);
    }
    first = options_.per_sequence ? static_cast<size_t>(dst) : 0;
  }
  if (check_only) return Status::Ok();

  // 3. Room: storage for every layer whose blocks are too small, allocated now into the stream
  // records; an allocation failure drops them and leaves the cache as it was. Capacity never
  // shrinks, so reloading a stream this cache held before (a wrapper's rollback) allocates nothing.
  for (size_t i = 0; i < ss.size(); ++i) {
    const Slot& t = slots_[first + i];
    for (size_t l = 0; l < ss[i].layers.size(); ++l) {
      StreamLayer& s = ss[i].layers[l];
      if (!s.present) continue;
      const size_t k_cap = l < t.layers.size() ? t.layers[l].k_cap : 0;
      const size_t v_cap = l < t.layers.size() ? t.layers[l].v_cap : 0;
      if (s.k_bytes <= k_cap && s.v_bytes <= v_cap) continue;
      KV_RETURN_IF_ERROR(LayerStore::AllocateBlocks(std::max(s.k_bytes, k_cap),
                                                    std::max(s.v_bytes, v_cap), allocator_,
                                                    &s.arena, &s.new_k, &s.new_v));
    }
  }

  // 4. Commit. Nothing below can fail.
  for (size_t i = 0; i < ss.size(); ++i) {
    Slot& t = slots_[first + i];
    StreamSlot& s = ss[i];
    if (t.layers.size() < s.layers.size()) t.layers.resize(s.layers.size());
    for (size_t l = 0; l < t.layers.size(); ++l) {
      LayerStore& ls = t.layers[l];
      if (l >= s.layers.size() || !s.layers[l].present) {
        ls.has_view = false;  // storage (if any) stays for the next Put
        continue;
      }
      StreamLayer& sl = s.layers[l];
      if (sl.arena) {
        ls.k_cap = std::max(sl.k_bytes, ls.k_cap);
        ls.v_cap = std::max(sl.v_bytes, ls.v_cap);
        ls.arena = std::move(sl.arena);
        ls.k = sl.new_k;
        ls.v = sl.new_v;
      }
      CopyElementsIn(ls.k, sl.k, sl.k_bytes, sl.k_dtype);
      CopyElementsIn(ls.v, sl.v, sl.v_bytes, sl.v_dtype);
      ls.k_view = ContiguousView(ls.k, sl.k_dtype, sl.k_ne);
      ls.v_view = ContiguousView(ls.v, sl.v_dtype, sl.v_ne);
      ls.has_view = true;
    }
    t.cached = s.cached;
    t.pos = s.pos;
    t.cur_pos = s.cur_pos;
  }
  // No forward pass is current (as after Init): StartForward selects the slot again.
  cur_slot_ = 0;
  reserve_ = false;
  return Status::Ok();
}

}  // namespace

std::unique_ptr<EncoderCache> NewEncoderCache() { return NewEncoderCache(EncoderOptions{}); }

std::unique_ptr<EncoderCache> NewEncoderCache(const EncoderOptions& options) {
  return std::make_unique<EncoderCacheImpl>(options);
}

}  // namespace kv
