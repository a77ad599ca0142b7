// The causal family (causal, SWA, SWA with memory, chunked) over one CellTable, one Arena and the
// kernels. Behaviour: SEMANTICS.md sections 1-8; the comments cite the rule they implement.
//
// Every public call validates first and mutates after: an error leaves the cache as it was. The
// one exception is a ShiftFn that fails part-way through Remove (keys already re-rotated cannot be
// un-rotated exactly in quantized storage); that is documented on Remove.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/causal_cache_impl.h"
#include "kernels/convert.h"
#include "kernels/mask.h"
#include "layouts/kv_layout.h"

namespace kv {
namespace internal {

namespace {

// The per-pass arrays sized at Init, in one block; with a null base only `bytes` is meaningful.
struct PassArrays {
  int32_t* batch_pos;
  int32_t* batch_seq;
  uint8_t* batch_causal;
  int32_t* batch_cells;
  int64_t* trim_below;
  int64_t* lowest;
  uint8_t* seq_in_batch;
  uint64_t* would_free;
  int32_t* would_free_list;
  int32_t* shift_deltas;
  int32_t* slots;
  size_t bytes;
};

PassArrays CarvePassArrays(void* base, size_t max_batch, size_t max_sequences, size_t cells,
                           size_t free_words) {
  BlockCarver c(base);
  PassArrays a;
  a.batch_pos = c.Take<int32_t>(max_batch);
  a.batch_seq = c.Take<int32_t>(max_batch);
  a.batch_causal = c.Take<uint8_t>(max_batch);
  a.batch_cells = c.Take<int32_t>(max_batch);
  a.trim_below = c.Take<int64_t>(max_sequences);
  a.lowest = c.Take<int64_t>(max_sequences);
  a.seq_in_batch = c.Take<uint8_t>(max_sequences);
  a.would_free = c.Take<uint64_t>(free_words);
  a.would_free_list = c.Take<int32_t>(cells);
  a.shift_deltas = c.Take<int32_t>(max_batch);
  a.slots = c.Take<int32_t>(max_batch);
  a.bytes = c.size();
  return a;
}

}  // namespace

Status CausalCacheImpl::CheckConfig(const CacheConfig& config) const {
  if (initialized_) return Status::Error(Code::kInvalidArgument, "SetConfig must come before Init");
  if (config.padding < 1)
    return Status::Error(Code::kInvalidArgument, "padding %d < 1", config.padding);
  if (config.mask_dtype != DType::kF32 && config.mask_dtype != DType::kF16) {
    return Status::Error(Code::kInvalidArgument, "mask dtype must be f32 or f16, not %s",
                         DTypeName(config.mask_dtype));
  }
  return Status::Ok();
}

Status CausalCacheImpl::SetConfig(const CacheConfig& config) {
  KV_RETURN_IF_ERROR(CheckConfig(config));
  config_ = config;
  return Status::Ok();
}

namespace {

// Init's sizing (SEMANTICS.md §1) for a cache with these construction parameters and config.
struct InitPlan {
  int32_t window = 0, memory = 0, cells = 0;
};

Status PlanInit(DType dtype, int max_sequences, int capacity, int max_batch,
                int32_t requested_window, int32_t requested_memory, int32_t chunk,
                const CacheConfig& config, InitPlan* plan) {
  if (!IsValidDType(dtype)) return Status::Error(Code::kInvalidArgument, "invalid storage dtype");
  if (max_sequences < 1 || capacity < 1 || max_batch < 1) {
    return Status::Error(Code::kInvalidArgument,
                         "max_sequences %d, capacity %d, max_batch %d must be >= 1", max_sequences,
                         capacity, max_batch);
  }
  if (IsQuantized(dtype) && config.permuted_v) {
    return Status::Error(Code::kInvalidArgument, "%s storage cannot be used with permuted V",
                         DTypeName(dtype));
  }
  if (requested_window < 0 || requested_memory < 0 || chunk < 0) {
    return Status::Error(Code::kInvalidArgument, "window %d, memory %d, chunk %d must be >= 0",
                         requested_window, requested_memory, chunk);
  }
  int32_t window = requested_window == 0 ? kUnlimited : requested_window;
  int32_t memory = requested_memory == 0 ? window : requested_memory;
  if (memory != kUnlimited && max_sequences > 1)
    memory = std::max(memory, window == kUnlimited ? window : window + 1);
  if (memory >= capacity) memory = kUnlimited;
  if (memory < window) {
    return Status::Error(Code::kInvalidArgument,
                         "sliding window memory %d must be at least the window %d", memory, window);
  }
  int64_t cells = memory == kUnlimited ? int64_t{max_sequences} * capacity
                                       : int64_t{max_sequences} * memory + max_batch;
  cells = (cells + config.padding - 1) / config.padding * config.padding;
  if (cells > INT32_MAX / 2)
    return Status::Error(Code::kInvalidArgument, "%lld cells is too many", (long long)cells);
  plan->window = window;
  plan->memory = memory;
  plan->cells = static_cast<int32_t>(cells);
  return Status::Ok();
}

}  // namespace

Status CausalCacheImpl::CheckInit(DType dtype, int max_sequences, int capacity,
                                  int max_batch) const {
  InitPlan plan;
  return PlanInit(dtype, max_sequences, capacity, max_batch, requested_window_, requested_memory_,
                  chunk_, config_, &plan);
}

Status CausalCacheImpl::Init(DType dtype, int max_sequences, int capacity, int max_batch) {
  // SEMANTICS.md §1. Everything is computed into locals first; nothing changes on error.
  InitPlan plan;
  KV_RETURN_IF_ERROR(PlanInit(dtype, max_sequences, capacity, max_batch, requested_window_,
                              requested_memory_, chunk_, config_, &plan));
  const int32_t window = plan.window, memory = plan.memory, n_cells = plan.cells;
  // Everything Init needs is allocated before anything changes (through the arena's allocator, so
  // injected failures reach it): on kOutOfMemory the cache is exactly as it was, even re-Init.
  CellTable table;
  KV_RETURN_IF_ERROR(table.Init(n_cells, max_sequences, arena_.allocator()));
  const PassArrays sizes =
      CarvePassArrays(nullptr, max_batch, max_sequences, n_cells, table.free_bits().size());
  OwnedBlock pass;
  KV_RETURN_IF_ERROR(OwnedBlock::Allocate(arena_.allocator(), sizes.bytes, &pass));
  // One mask row over every cell: a decode step (B = 1) never grows the mask buffer.
  OwnedBlock mask;
  KV_RETURN_IF_ERROR(AllocateMaskBlock(static_cast<size_t>(n_cells), max_batch, &mask));

  // Commit.
  Close();
  table_ = static_cast<CellTable&&>(table);
  pass_block_ = static_cast<OwnedBlock&&>(pass);
  const PassArrays a = CarvePassArrays(pass_block_.data(), max_batch, max_sequences, n_cells,
                                       table_.free_bits().size());
  batch_pos_ = a.batch_pos;
  batch_seq_ = a.batch_seq;
  batch_causal_ = a.batch_causal;
  batch_cells_ = a.batch_cells;
  trim_below_ = a.trim_below;
  lowest_ = a.lowest;
  seq_in_batch_ = a.seq_in_batch;
  would_free_ = a.would_free;
  would_free_list_ = a.would_free_list;
  shift_deltas_ = a.shift_deltas;
  slots_ = a.slots;
  mask_block_ = static_cast<OwnedBlock&&>(mask);
  mask_capacity_ = static_cast<size_t>(n_cells);
  dtype_ = dtype;
  max_sequences_ = max_sequences;
  capacity_ = capacity;
  max_batch_ = max_batch;
  AttachMaskIndex();
  window_ = window;
  memory_ = memory;
  for (int i = 0; i < max_batch; ++i) batch_causal_[i] = 1;
  for (int s = 0; s < max_sequences; ++s) trim_below_[s] = INT64_MIN;
  would_free_count_ = 0;
  would_free_first_ = INT32_MAX;
  layers_.reserve(64);
  initialized_ = true;
  return Status::Ok();
}

void CausalCacheImpl::Close() {
  // Frees everything: K/V storage and the metadata Init allocated. The cache can be Init'ed again.
  initialized_ = false;
  have_batch_ = false;
  layers_.clear();
  arena_.Release();
  layer_ = 0;
  table_ = CellTable();
  mask_block_.Reset();
  mask_capacity_ = 0;
  mask_index_.Attach(nullptr, 0);
  pass_block_.Reset();
  batch_pos_ = batch_seq_ = batch_cells_ = would_free_list_ = shift_deltas_ = slots_ = nullptr;
  batch_causal_ = seq_in_batch_ = nullptr;
  trim_below_ = lowest_ = nullptr;
  would_free_ = nullptr;
}

size_t CausalCacheImpl::MemoryBytes() const {
  if (!initialized_) return 0;
  return arena_.BytesReserved() + mask_block_.bytes() + pass_block_.bytes() + table_.bytes();
}

Status CausalCacheImpl::EnsureMaskCapacity(size_t elements) {
  // Grows only for a larger batch x history than any seen before: decode (B = 1) never grows it
  // (Init sizes one row over every cell), and a reserve pass sizes it for the worst case at once.
  if (elements <= mask_capacity_) return Status::Ok();
  OwnedBlock grown;
  if (Status s = AllocateMaskBlock(elements, max_batch_, &grown); !s.ok()) {
    return Status::Error(Code::kOutOfMemory, "mask of %zu elements: %s", elements, s.message());
  }
  mask_block_ = static_cast<OwnedBlock&&>(grown);
  mask_capacity_ = elements;
  AttachMaskIndex();
  return Status::Ok();
}

namespace {
// Bytes of the mask block before its index bits: the f32 elements, rounded up to 64.
size_t MaskBytes(size_t elements) { return (elements * sizeof(float) + 63) / 64 * 64; }
}  // namespace

Status CausalCacheImpl::AllocateMaskBlock(size_t elements, int32_t max_batch,
                                          OwnedBlock* out) const {
  const size_t bits_bytes = MaskIndex::WordsForAny(elements, max_batch) * sizeof(uint64_t);
  return OwnedBlock::Allocate(arena_.allocator(), MaskBytes(elements) + bits_bytes, out);
}

void CausalCacheImpl::AttachMaskIndex() {
  char* base = static_cast<char*>(mask_block_.data());
  mask_index_.Attach(reinterpret_cast<uint64_t*>(base + MaskBytes(mask_capacity_)),
                     MaskIndex::WordsForAny(mask_capacity_, max_batch_));
}

void CausalCacheImpl::ClearTrimPlan() {
  for (int32_t i = 0; i < would_free_count_; ++i) would_free_[would_free_list_[i] / 64] = 0;
  would_free_count_ = 0;
  would_free_first_ = INT32_MAX;
}

void CausalCacheImpl::PlanTrim(std::span<const int32_t> positions,
                               std::span<const int32_t> sequences) {
  // lowest[s]: the smallest batch position for batch sequences; highest stored position + 1 for
  // every other sequence that holds cells. Cells with pos < lowest - memory drop s.
  for (int32_t s = 0; s < max_sequences_; ++s) {
    seq_in_batch_[s] = 0;
    trim_below_[s] = INT64_MIN;
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    const int32_t s = sequences[i];
    if (!seq_in_batch_[s]) {
      seq_in_batch_[s] = 1;
      lowest_[s] = positions[i];
    } else {
      lowest_[s] = std::min<int64_t>(lowest_[s], positions[i]);
    }
  }
  for (int32_t s = 0; s < max_sequences_; ++s) {
    if (table_.SeqEmpty(s)) continue;
    if (!seq_in_batch_[s]) lowest_[s] = int64_t{table_.max_pos(s)} + 1;
    trim_below_[s] = lowest_[s] - memory_;
  }
  // A cell becomes free when every holder drops it, i.e. pos < min over holders of trim_below.
  for (int32_t s = 0; s < max_sequences_; ++s) {
    if (table_.SeqEmpty(s) || table_.min_pos(s) >= trim_below_[s]) continue;
    for (int32_t c = table_.first_cell(s); c <= table_.last_cell(s); ++c) {
      if (!table_.Holds(c, s) || table_.pos(c) >= trim_below_[s]) continue;
      if ((would_free_[c / 64] >> (c % 64)) & 1u) continue;
      bool all_drop = true;
      if (table_.holders(c) > 1) {
        for (int32_t t = 0; t < max_sequences_ && all_drop; ++t) {
          if (t != s && table_.Holds(c, t) && table_.pos(c) >= trim_below_[t]) all_drop = false;
        }
      }
      if (all_drop) {
        would_free_[c / 64] |= uint64_t{1} << (c % 64);
        would_free_list_[would_free_count_++] = c;
        would_free_first_ = std::min(would_free_first_, c);
      }
    }
  }
}

Status CausalCacheImpl::ValidateBatch(const Batch& batch) const {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "StartForward before Init");
  const size_t b = batch.positions.size();
  if (b != batch.sequences.size()) {
    return Status::Error(Code::kInvalidArgument, "batch has %zu positions but %zu sequences", b,
                         batch.sequences.size());
  }
  if (b < 1 || b > static_cast<size_t>(max_batch_)) {
    return Status::Error(Code::kInvalidArgument, "batch size %zu outside [1, %d]", b, max_batch_);
  }
  for (size_t i = 0; i < b; ++i) {
    if (batch.sequences[i] < 0 || batch.sequences[i] >= max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "token %zu: sequence %d outside [0, %d)", i,
                           batch.sequences[i], max_sequences_);
    }
  }
  return Status::Ok();
}

Status CausalCacheImpl::CheckStartForward(const Batch& batch, bool reserve) {
  KV_RETURN_IF_ERROR(ValidateBatch(batch));
  if (reserve) return Status::Ok();
  int32_t new_min = 0, new_max = 0;
  KV_RETURN_IF_ERROR(PlanForward(batch, &new_min, &new_max));
  ClearTrimPlan();
  return Status::Ok();
}

Status CausalCacheImpl::PlanForward(const Batch& batch, int32_t* new_min, int32_t* new_max) {
  // Plan (reads only): which cells trimming would free, then the first B free cells counting those.
  const int32_t bs = static_cast<int32_t>(batch.positions.size());
  const std::span<const int32_t> positions = batch.positions;
  const std::span<const int32_t> sequences = batch.sequences;
  const int32_t n_cells = table_.num_cells();
  if (MemoryLimited()) PlanTrim(positions, sequences);
  const std::span<const uint64_t> also_free =
      MemoryLimited() ? std::span<const uint64_t>(would_free_, table_.free_bits().size())
                      : std::span<const uint64_t>();
  const int32_t found = table_.FindFree(bs, also_free, would_free_first_, slots_);
  if (found < bs) {
    // SEMANTICS.md §3.3: kCacheFull and the cache exactly as before (Ollama trims first; we do
    // not). The previous pass's batch, history and mask are untouched too.
    ClearTrimPlan();
    return Status::Error(Code::kCacheFull,
                         "could not find a kv cache slot: %d cells, %d free, batch %d", n_cells,
                         found, bs);
  }
  // The history range (§3.2 / unlimited: union of ranges), also computed before any change: cells
  // of batch sequences that trimming keeps and that the window shows. Trimming drops only cells
  // with pos < lowest - memory <= lowest - window, so none of these is dropped.
  int64_t hmin = INT64_MAX, hmax = -1;
  for (int32_t i = 0; i < bs; ++i) {
    const int32_t s = sequences[i];
    if (table_.SeqEmpty(s)) continue;
    if (!MemoryLimited()) {
      hmin = std::min<int64_t>(hmin, table_.first_cell(s));
      hmax = std::max<int64_t>(hmax, table_.last_cell(s));
    } else if (seq_in_batch_[s] == 1) {
      seq_in_batch_[s] = 2;  // scanned
      const int64_t visible_from = lowest_[s] - window_;
      for (int32_t c = table_.first_cell(s); c <= table_.last_cell(s); ++c) {
        if (table_.Holds(c, s) && table_.pos(c) >= visible_from) {
          hmin = std::min<int64_t>(hmin, c);
          hmax = std::max<int64_t>(hmax, c);
        }
      }
    }
  }
  for (int32_t i = 0; i < bs; ++i) {
    hmin = std::min<int64_t>(hmin, slots_[i]);
    hmax = std::max<int64_t>(hmax, slots_[i]);
  }
  // §3.5: pad the history range outward.
  const int64_t p = config_.padding;
  *new_min = static_cast<int32_t>(hmin / p * p);
  *new_max = static_cast<int32_t>((hmax + 1 + p - 1) / p * p - 1);
  return Status::Ok();
}

Status CausalCacheImpl::StartForward(const Batch& batch, bool reserve) {
  KV_RETURN_IF_ERROR(ValidateBatch(batch));
  const size_t b = batch.positions.size();
  const int32_t n_cells = table_.num_cells();
  if (reserve) {
    // SEMANTICS.md §3.1: cells 0..B-1, the whole table as history, no metadata change.
    KV_RETURN_IF_ERROR(EnsureMaskCapacity(b * static_cast<size_t>(n_cells)));
    batch_size_ = static_cast<int32_t>(b);
    for (size_t i = 0; i < b; ++i) {
      batch_pos_[i] = batch.positions[i];
      batch_seq_[i] = batch.sequences[i];
      batch_causal_[i] = 1;
      batch_cells_[i] = static_cast<int32_t>(i);
    }
    reserve_ = true;
    have_batch_ = true;
    hist_min_ = 0;
    hist_max_ = n_cells - 1;
    BuildMask();
    return Status::Ok();
  }

  const int32_t bs = static_cast<int32_t>(b);
  const std::span<const int32_t> positions = batch.positions;
  const std::span<const int32_t> sequences = batch.sequences;
  int32_t new_min = 0, new_max = 0;
  KV_RETURN_IF_ERROR(PlanForward(batch, &new_min, &new_max));
  if (Status s = EnsureMaskCapacity(static_cast<size_t>(new_max - new_min + 1) * bs); !s.ok()) {
    ClearTrimPlan();
    return s;
  }

  // Commit: trim (§3.2), then give each token its cell (§3.4).
  if (MemoryLimited()) {
    for (int32_t s = 0; s < max_sequences_; ++s) {
      if (table_.SeqEmpty(s) || table_.min_pos(s) >= trim_below_[s]) continue;
      for (int32_t c = table_.first_cell(s); c <= table_.last_cell(s); ++c) {
        if (table_.Holds(c, s) && table_.pos(c) < trim_below_[s]) table_.Drop(c, s);
      }
      table_.Refresh(s);
    }
    ClearTrimPlan();
  }
  batch_size_ = bs;
  for (int32_t i = 0; i < bs; ++i) {
    batch_pos_[i] = positions[i];
    batch_seq_[i] = sequences[i];
    batch_cells_[i] = slots_[i];
    batch_causal_[i] = 1;
  }
  for (int32_t i = 0; i < bs; ++i) table_.Assign(batch_cells_[i], batch_pos_[i], batch_seq_[i]);
  hist_min_ = new_min;
  hist_max_ = new_max;
  reserve_ = false;
  have_batch_ = true;
  BuildMask();
  return Status::Ok();
}

void CausalCacheImpl::BuildMask() {
  kernels::MaskCells cells;
  cells.pos = table_.pos_data() + hist_min_;
  cells.seq_bits = table_.seq_bits_data() + hist_min_;
  cells.seq_word_stride = static_cast<size_t>(table_.num_cells());
  cells.n = hist_max_ - hist_min_ + 1;
  kernels::MaskTokens tokens;
  tokens.pos = std::span<const int32_t>(batch_pos_, batch_size_);
  tokens.seq = std::span<const int32_t>(batch_seq_, batch_size_);
  tokens.causal = std::span<const uint8_t>(batch_causal_, batch_size_);
  kernels::MaskRules rules;
  rules.window = window_ == kUnlimited ? kernels::kNoWindow : window_;
  rules.window_inclusive = config_.window_convention == WindowConvention::kInclusive;
  rules.chunk = chunk_;
  kernels::BuildMask(cells, tokens, rules, config_.mask_dtype, mask());
  mask_index_.Invalidate(MaskView());
}

void CausalCacheImpl::SetCausal(std::span<const int32_t> except) {
  // Lifts only the causal rule for those batch indices, until the next StartForward (§4).
  // Indices outside the batch are ignored.
  if (!have_batch_) return;
  for (int32_t i = 0; i < batch_size_; ++i) batch_causal_[i] = 1;
  for (int32_t i : except) {
    if (i >= 0 && i < batch_size_) batch_causal_[i] = 0;
  }
  BuildMask();
}

Status CausalCacheImpl::ValidateLayerShapes(const LayerStorage& layer, int64_t k_head_dim,
                                            int64_t v_head_dim, int64_t kv_heads) const {
  if (k_head_dim < 1 || v_head_dim < 1 || kv_heads < 1 || k_head_dim > INT32_MAX / 64 ||
      v_head_dim > INT32_MAX / 64 || kv_heads > 65536) {
    return Status::Error(Code::kInvalidArgument,
                         "bad K/V shape: k_head_dim %lld, v_head_dim %lld, kv_heads %lld",
                         (long long)k_head_dim, (long long)v_head_dim, (long long)kv_heads);
  }
  if (IsQuantized(dtype_) &&
      (k_head_dim % kQuantBlockElems != 0 || v_head_dim % kQuantBlockElems != 0)) {
    return Status::Error(Code::kInvalidArgument,
                         "%s storage needs head_dim %% 32 == 0 (k %lld, v %lld)", DTypeName(dtype_),
                         (long long)k_head_dim, (long long)v_head_dim);
  }
  if (layer.allocated &&
      (layer.k_layout.head_dim != k_head_dim || layer.v_layout.head_dim != v_head_dim ||
       layer.k_layout.kv_heads != kv_heads)) {
    return Status::Error(Code::kInvalidArgument,
                         "layer %d was [%d, %d] / [%d, %d], now [%lld, %lld] / [%lld, %lld]",
                         layer_, layer.k_layout.head_dim, layer.k_layout.kv_heads,
                         layer.v_layout.head_dim, layer.v_layout.kv_heads, (long long)k_head_dim,
                         (long long)kv_heads, (long long)v_head_dim, (long long)kv_heads);
  }
  return Status::Ok();
}

Status CausalCacheImpl::LayerBytes(int32_t k_head_dim, int32_t v_head_dim, int32_t kv_heads,
                                   size_t* bytes) const {
  const int32_t n = table_.num_cells();
  size_t k = 0, v = 0;
  if (!CellBlockBytesFit(dtype_, k_head_dim, kv_heads, n, false, &k) ||
      !CellBlockBytesFit(dtype_, v_head_dim, kv_heads, n, config_.permuted_v, &v) ||
      __builtin_add_overflow(k, v, bytes)) {
    return Status::Error(Code::kOutOfMemory,
                         "a layer of [%d, %d] / [%d, %d] over %d cells needs more than 2^64 bytes",
                         k_head_dim, kv_heads, v_head_dim, kv_heads, n);
  }
  return Status::Ok();
}

Status CausalCacheImpl::AllocateLayer(LayerStorage* layer, int32_t k_head_dim, int32_t v_head_dim,
                                      int32_t kv_heads) {
  size_t bytes = 0;
  KV_RETURN_IF_ERROR(LayerBytes(k_head_dim, v_head_dim, kv_heads, &bytes));
  const int32_t n = table_.num_cells();
  const CellBlockLayout kl = MakeCellBlockLayout(dtype_, k_head_dim, kv_heads, n, false);
  const CellBlockLayout vl =
      MakeCellBlockLayout(dtype_, v_head_dim, kv_heads, n, config_.permuted_v);
  void* k = nullptr;
  void* v = nullptr;
  // K and V are carved together so that a failure leaves no half-allocated layer behind.
  KV_RETURN_IF_ERROR(arena_.Allocate(bytes, &k));
  v = static_cast<char*>(k) + kl.bytes;
  layer->k_layout = kl;
  layer->v_layout = vl;
  layer->k = k;
  layer->v = v;
  layer->allocated = true;
  return Status::Ok();
}

Status CausalCacheImpl::ReserveLayers(int layers, int k_head_dim, int v_head_dim, int kv_heads) {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "ReserveLayers before Init");
  if (layers < 1 || layers > kMaxLayers) {
    return Status::Error(Code::kInvalidArgument, "layers %d outside [1, %d]", layers, kMaxLayers);
  }
  LayerStorage probe;
  KV_RETURN_IF_ERROR(ValidateLayerShapes(probe, k_head_dim, v_head_dim, kv_heads));
  size_t per_layer = 0;
  KV_RETURN_IF_ERROR(LayerBytes(k_head_dim, v_head_dim, kv_heads, &per_layer));
  size_t needed = 0;
  for (int l = 0; l < layers; ++l) {
    if (l < static_cast<int>(layers_.size()) && layers_[l].allocated) {
      KV_RETURN_IF_ERROR(ValidateLayerShapes(layers_[l], k_head_dim, v_head_dim, kv_heads));
    } else if (__builtin_add_overflow(needed, per_layer, &needed)) {
      return Status::Error(Code::kOutOfMemory, "%d layers of %zu bytes need more than 2^64 bytes",
                           layers, per_layer);
    }
  }
  if (needed == 0) return Status::Ok();
  KV_RETURN_IF_ERROR(arena_.Reserve(needed));
  if (static_cast<int>(layers_.size()) < layers) layers_.resize(layers);
  for (int l = 0; l < layers; ++l) {
    if (!layers_[l].allocated) {
      // Cannot fail: the region just reserved holds every one of them.
      KV_RETURN_IF_ERROR(AllocateLayer(&layers_[l], k_head_dim, v_head_dim, kv_heads));
    }
  }
  return Status::Ok();
}

Status CausalCacheImpl::Put(const TensorView& key, const TensorView& value) {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "Put before Init");
  if (!have_batch_) return Status::Error(Code::kInvalidArgument, "Put before StartForward");
  if (layer_ < 0 || layer_ >= kMaxLayers) {
    return Status::Error(Code::kInvalidArgument, "layer %d outside [0, %d)", layer_, kMaxLayers);
  }
  if (key.data == nullptr || value.data == nullptr)
    return Status::Error(Code::kInvalidArgument, "null K or V");
  if (!IsFloatDType(key.dtype) || !IsFloatDType(value.dtype)) {
    return Status::Error(Code::kInvalidArgument, "K/V input must be f32, f16 or bf16 (got %s, %s)",
                         DTypeName(key.dtype), DTypeName(value.dtype));
  }
  if (key.ne[3] != 1 || value.ne[3] != 1 || key.ne[2] != batch_size_ ||
      value.ne[2] != batch_size_) {
    return Status::Error(Code::kInvalidArgument, "K/V batch dims %lld/%lld, batch has %d tokens",
                         (long long)key.ne[2], (long long)value.ne[2], batch_size_);
  }
  if (key.ne[1] != value.ne[1]) {
    return Status::Error(Code::kInvalidArgument, "K has %lld kv heads, V has %lld",
                         (long long)key.ne[1], (long long)value.ne[1]);
  }
  static const LayerStorage kFresh;  // a layer not Put yet
  const LayerStorage& existing =
      layer_ < static_cast<int>(layers_.size()) ? layers_[layer_] : kFresh;
  KV_RETURN_IF_ERROR(ValidateLayerShapes(existing, key.ne[0], value.ne[0], key.ne[1]));
  if (existing.input_known && (key.dtype != existing.k_input || value.dtype != existing.v_input)) {
    return Status::Error(Code::kInvalidArgument, "layer %d was given K/V in %s/%s, now %s/%s",
                         layer_, DTypeName(existing.k_input), DTypeName(existing.v_input),
                         DTypeName(key.dtype), DTypeName(value.dtype));
  }
  if (layer_ >= static_cast<int>(layers_.size())) layers_.resize(layer_ + 1);
  LayerStorage& layer = layers_[layer_];
  if (!layer.allocated) {
    KV_RETURN_IF_ERROR(AllocateLayer(&layer, static_cast<int32_t>(key.ne[0]),
                                     static_cast<int32_t>(value.ne[0]),
                                     static_cast<int32_t>(key.ne[1])));
  }
  layer.input_known = true;
  layer.k_input = key.dtype;
  layer.v_input = value.dtype;
  // A reserve pass sizes storage only: writing to cells 0..B-1 would clobber live tokens.
  if (reserve_) return Status::Ok();
  const std::span<const int32_t> cells(batch_cells_, batch_size_);
  kernels::ScatterToCells(key, cells, layer.k_layout, layer.k);
  kernels::ScatterToCells(value, cells, layer.v_layout, layer.v);
  return Status::Ok();
}

TensorView CausalCacheImpl::MaskView() const {
  TensorView m;
  const int32_t len = hist_max_ - hist_min_ + 1;
  m.data = mask();
  m.dtype = config_.mask_dtype;
  m.ne[0] = len;
  m.ne[1] = batch_size_;
  m.nb[0] = BlockBytes(config_.mask_dtype);
  m.nb[1] = m.nb[0] * static_cast<size_t>(len);
  m.nb[2] = m.nb[3] = m.nb[1] * static_cast<size_t>(batch_size_);
  return m;
}

History CausalCacheImpl::Get() {
  History h;
  if (!initialized_ || !have_batch_) return h;
  const int32_t len = hist_max_ - hist_min_ + 1;
  h.mask = MaskView();
  h.mask_index = &mask_index_;
  h.v_layout = config_.permuted_v ? VLayout::kPermuted : VLayout::kPlain;
  if (layer_ >= 0 && layer_ < static_cast<int>(layers_.size()) && layers_[layer_].allocated) {
    const LayerStorage& layer = layers_[layer_];
    h.k = CellBlockView(layer.k_layout, layer.k, hist_min_, len);
    h.v = CellBlockView(layer.v_layout, layer.v, hist_min_, len);
  }
  return h;
}

Status CausalCacheImpl::CopyPrefix(int src_seq, int dst_seq, int32_t len) {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "CopyPrefix before Init");
  if (src_seq < 0 || src_seq >= max_sequences_ || dst_seq < 0 || dst_seq >= max_sequences_) {
    return Status::Error(Code::kInvalidArgument, "sequences %d -> %d outside [0, %d)", src_seq,
                         dst_seq, max_sequences_);
  }
  if (src_seq == dst_seq) {
    // The literal rule would empty the sequence; keeping its own prefix is what a caller means.
    for (int32_t c = table_.first_cell(dst_seq); c <= table_.last_cell(dst_seq); ++c) {
      if (table_.Holds(c, dst_seq) && table_.pos(c) >= len) table_.Drop(c, dst_seq);
    }
    table_.Refresh(dst_seq);
    return Status::Ok();
  }
  // §6: dst loses every cell it held; then every cell of src with pos < len also belongs to dst.
  for (int32_t c = table_.first_cell(dst_seq); c <= table_.last_cell(dst_seq); ++c) {
    if (table_.Holds(c, dst_seq)) table_.Drop(c, dst_seq);
  }
  table_.Refresh(dst_seq);
  if (!table_.SeqEmpty(src_seq)) {
    for (int32_t c = table_.first_cell(src_seq); c <= table_.last_cell(src_seq); ++c) {
      if (table_.Holds(c, src_seq) && table_.pos(c) < len) table_.Share(c, dst_seq);
    }
  }
  return Status::Ok();
}

bool CausalCacheImpl::CanResume(int seq, int32_t pos) const {
  // §7.
  if (!initialized_) return false;
  if (!MemoryLimited()) return true;
  if (seq < 0 || seq >= max_sequences_ || table_.SeqEmpty(seq)) return false;
  const int64_t window_start = std::max<int64_t>(0, int64_t{pos} - window_);
  return window_start >= table_.min_pos(seq) && int64_t{pos} <= int64_t{table_.max_pos(seq)} + 1;
}

Status CausalCacheImpl::Remove(int seq, int32_t begin, int32_t end) {
  // §8. All checks come before any change.
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "Remove before Init");
  if (seq < 0 || seq >= max_sequences_) {
    return Status::Error(Code::kInvalidArgument, "sequence %d outside [0, %d)", seq,
                         max_sequences_);
  }
  if (begin < 0 || begin > end)
    return Status::Error(Code::kInvalidArgument, "bad range [%d, %d)", begin, end);
  if (table_.SeqEmpty(seq)) return Status::Ok();
  const bool shifting = end != kPosMax && end > begin;
  const int32_t offset = shifting ? begin - end : 0;
  bool needs_shift = false;
  if (shifting) {
    for (int32_t c = table_.first_cell(seq); c <= table_.last_cell(seq); ++c) {
      if (!table_.Holds(c, seq) || table_.pos(c) < end) continue;
      if (table_.holders(c) > 1) {
        return Status::Error(Code::kNotSupported,
                             "cell %d (pos %d) must shift but is shared with another sequence", c,
                             table_.pos(c));
      }
      needs_shift = true;
    }
    if (needs_shift && !shift_) {
      return Status::Error(Code::kNotSupported,
                           "removing [%d, %d) shifts later tokens, and the cache has no ShiftFn",
                           begin, end);
    }
  }
  // Keys first, while the table still says which cells move: a ShiftFn that fails then leaves the
  // cache as it was (ShiftKeys undoes the calls that had succeeded).
  if (needs_shift) KV_RETURN_IF_ERROR(ShiftKeys(seq, begin, end, offset));
  for (int32_t c = table_.first_cell(seq); c <= table_.last_cell(seq); ++c) {
    if (!table_.Holds(c, seq)) continue;
    const int32_t p = table_.pos(c);
    if (p >= begin && p < end) {
      table_.Drop(c, seq);
    } else if (needs_shift && p >= end) {
      table_.SetPos(c, p + offset);
    }
  }
  table_.Refresh(seq);
  return Status::Ok();
}

// The ShiftFn calls of Remove(seq, begin, end), made before the table changes but exactly as they
// would be after it (Ollama's order): seq's cell range once [begin, end) is dropped, walked in
// chunks of max_batch cells; within a chunk the span from the first to the last moving cell (those
// of seq at pos >= end), delta `offset` for those and 0 for cells in between. If call k fails,
// calls k-1 .. 0 are made again with the opposite deltas, newest first, and call k's error is
// returned: for an invertible ShiftFn (RoPE, in f32 up to rounding; exactly for a ShiftFn that
// fails on its first call) nothing has changed.
Status CausalCacheImpl::ShiftKeys(int seq, int32_t begin, int32_t end, int32_t offset) {
  int32_t first = -1, last = -1;  // seq's cells that stay
  for (int32_t c = table_.first_cell(seq); c <= table_.last_cell(seq); ++c) {
    if (!table_.Holds(c, seq) || (table_.pos(c) >= begin && table_.pos(c) < end)) continue;
    if (first < 0) first = c;
    last = c;
  }
  if (first < 0) return Status::Ok();
  // Fills shift_deltas_ for the chunk at `start` with `delta` on moving cells; returns [lo, hi]
  // of the moving cells in it (lo = -1: none).
  auto chunk_deltas = [&](int32_t start, int32_t delta, int32_t* lo, int32_t* hi) {
    const int32_t size = std::min(last - start + 1, max_batch_);
    *lo = *hi = -1;
    for (int32_t i = 0; i < size; ++i) {
      const int32_t c = start + i;
      const bool moved = table_.Holds(c, seq) && table_.pos(c) >= end;
      shift_deltas_[i] = moved ? delta : 0;
      if (moved) {
        if (*lo < 0) *lo = i;
        *hi = i;
      }
    }
  };
  // One ShiftFn call: layer l's keys of cells [start + lo, start + hi], deltas as filled.
  auto call = [&](int32_t start, int32_t lo, int32_t hi, int l) {
    const TensorView key =
        CellBlockView(layers_[l].k_layout, layers_[l].k, start + lo, hi - lo + 1);
    return shift_(l, key, std::span<const int32_t>(shift_deltas_ + lo, hi - lo + 1));
  };
  const int layers = static_cast<int>(layers_.size());
  for (int32_t start = first; start <= last; start += max_batch_) {
    int32_t lo, hi;
    chunk_deltas(start, offset, &lo, &hi);
    if (lo < 0) continue;
    for (int l = 0; l < layers; ++l) {
      if (!layers_[l].allocated) continue;
      const Status s = call(start, lo, hi, l);
      if (s.ok()) continue;
      // Undo, newest first: this chunk's earlier layers (its deltas negated in place), then every
      // layer of the earlier chunks.
      for (int32_t i = lo; i <= hi; ++i) shift_deltas_[i] = -shift_deltas_[i];
      for (int ul = l - 1; ul >= 0; --ul) {
        if (layers_[ul].allocated) (void)call(start, lo, hi, ul);
      }
      for (int32_t st = start - max_batch_; st >= first; st -= max_batch_) {
        int32_t ulo, uhi;
        chunk_deltas(st, -offset, &ulo, &uhi);
        if (ulo < 0) continue;
        for (int ul = layers - 1; ul >= 0; --ul) {
          if (layers_[ul].allocated) (void)call(st, ulo, uhi, ul);
        }
      }
      return s;
    }
  }
  return Status::Ok();
}

}  // namespace internal

using internal::CausalCacheImpl;

std::unique_ptr<CausalCache> NewCausalCache(ShiftFn shift) {
  return std::make_unique<CausalCacheImpl>(0, 0, 0, std::move(shift));
}
std::unique_ptr<CausalCache> NewSWACache(int32_t window, ShiftFn shift) {
  return std::make_unique<CausalCacheImpl>(window, 0, 0, std::move(shift));
}
std::unique_ptr<CausalCache> NewSWAMemCache(int32_t window, int32_t memory, ShiftFn shift) {
  return std::make_unique<CausalCacheImpl>(window, memory, 0, std::move(shift));
}
std::unique_ptr<CausalCache> NewChunkedAttentionCache(int32_t chunk, ShiftFn shift) {
  return std::make_unique<CausalCacheImpl>(0, 0, chunk, std::move(shift));
}

}  // namespace kv
