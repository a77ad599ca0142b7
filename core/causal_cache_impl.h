// The causal family's implementation class, shared by the files that implement it
// (core/causal_cache.cc, and persistence). Not installed: internal to the library.
#ifndef KVCACHE_CORE_CAUSAL_CACHE_IMPL_H_
#define KVCACHE_CORE_CAUSAL_CACHE_IMPL_H_

#include <climits>
#include <cstdlib>
#include <memory>
#include <span>
#include <vector>

#include "core/arena.h"
#include "core/cache.h"
#include "core/cell_table.h"
#include "core/mask_index.h"
#include "layouts/kv_layout.h"

namespace kv {
namespace internal {

constexpr int32_t kUnlimited = INT32_MAX;
constexpr int kMaxLayers = 4096;

struct LayerStorage {
  bool allocated = false;
  // The input dtypes of the layer's first Put; every later Put must match (SEMANTICS.md section
  // 5). A saved session does not record them: a layer that a load allocates learns them at its
  // next Put.
  bool input_known = false;
  DType k_input = DType::kF32, v_input = DType::kF32;
  CellBlockLayout k_layout;
  CellBlockLayout v_layout;
  void* k = nullptr;
  void* v = nullptr;
};

class CausalCacheImpl final : public CausalCache {
 public:
  CausalCacheImpl(int32_t window, int32_t memory, int32_t chunk, ShiftFn shift)
      : requested_window_(window),
        requested_memory_(memory),
        chunk_(chunk),
        shift_(std::move(shift)) {}

  Status SetConfig(const CacheConfig& config) override;
  Status Init(DType dtype, int max_sequences, int capacity, int max_batch) override;
  Status CheckConfig(const CacheConfig& config) const override;
  Status CheckInit(DType dtype, int max_sequences, int capacity, int max_batch) const override;
  Status StartForward(const Batch& batch, bool reserve) override;
  Status CheckStartForward(const Batch& batch, bool reserve) override;
  void SetLayer(int layer) override { layer_ = layer; }
  Status Put(const TensorView& key, const TensorView& value) override;
  History Get() override;
  Status CopyPrefix(int src_seq, int dst_seq, int32_t len) override;
  bool CanResume(int seq, int32_t pos) const override;
  Status Remove(int seq, int32_t begin, int32_t end) override;
  // Remove's ShiftFn calls for the cells of seq at pos >= end (see the definition).
  Status ShiftKeys(int seq, int32_t begin, int32_t end, int32_t offset);
  void Close() override;
  size_t MemoryBytes() const override;

  void SetCausal(std::span<const int32_t> except) override;
  Status ReserveLayers(int layers, int k_head_dim, int v_head_dim, int kv_heads) override;
  int32_t NumCells() const override { return initialized_ ? table_.num_cells() : 0; }
  Status CheckConsistency() const override { return table_.CheckInvariants(); }

  // Persistence and allocator injection: core/persistence.cc.
  Status Serialize(std::vector<uint8_t>* out, int seq) const override;
  Status Deserialize(std::span<const uint8_t> bytes, int seq) override {
    return Load(bytes, seq, /*check_only=*/false);
  }
  Status CheckDeserialize(std::span<const uint8_t> bytes, int seq) override {
    return Load(bytes, seq, /*check_only=*/true);
  }
  Status SetAllocator(const ArenaAllocator& allocator) override;

 private:
  bool MemoryLimited() const { return memory_ != kUnlimited; }
  Status ValidateLayerShapes(const LayerStorage& layer, int64_t k_head_dim, int64_t v_head_dim,
                             int64_t kv_heads) const;
  // Bytes of one layer's K and V blocks over this cache's cells; kOutOfMemory when the count does
  // not fit in size_t (shapes ValidateLayerShapes accepts can overflow it with many cells).
  Status LayerBytes(int32_t k_head_dim, int32_t v_head_dim, int32_t kv_heads, size_t* bytes) const;
  // Precondition: the shape passed ValidateLayerShapes.
  Status AllocateLayer(LayerStorage* layer, int32_t k_head_dim, int32_t v_head_dim,
                       int32_t kv_heads);
  Status EnsureMaskCapacity(size_t elements);
  // Deserialize, or with check_only its checks alone (everything up to the allocation).
  Status Load(std::span<const uint8_t> bytes, int seq, bool check_only);
  void BuildMask();
  // Window trimming (SEMANTICS.md §3.2), computed without mutating: per sequence, the position
  // below which its cells are dropped (INT64_MIN: none). Marks cells that would become free.
  void PlanTrim(std::span<const int32_t> positions, std::span<const int32_t> sequences);
  void ClearTrimPlan();
  // StartForward's argument checks (§3): kInvalidArgument before Init or for a bad batch.
  Status ValidateBatch(const Batch& batch) const;
  // StartForward's plan for a non-reserve batch, changing nothing but scratch: the trim plan
  // (PlanTrim), the batch's cells in slots_ (§3.3) and the padded history range (§3.5). kCacheFull
  // when fewer than B cells would be free (the trim plan is cleared then); on success the trim
  // plan stays for the commit, or for ClearTrimPlan.
  Status PlanForward(const Batch& batch, int32_t* new_min, int32_t* new_max);

  // Construction parameters (Init derives the effective ones).
  int32_t requested_window_;
  int32_t requested_memory_;
  int32_t chunk_;
  ShiftFn shift_;
  CacheConfig config_;

  // After Init.
  bool initialized_ = false;
  DType dtype_ = DType::kF16;
  int32_t max_sequences_ = 0;
  int32_t capacity_ = 0;
  int32_t max_batch_ = 0;
  int32_t window_ = kUnlimited;
  int32_t memory_ = kUnlimited;
  CellTable table_;
  Arena arena_;
  std::vector<LayerStorage> layers_;
  int layer_ = 0;

  // The current forward pass.
  bool have_batch_ = false;
  bool reserve_ = false;
  int32_t batch_size_ = 0;
  int32_t* batch_pos_ = nullptr;     // [max_batch]  (these live in pass_block_)
  int32_t* batch_seq_ = nullptr;     // [max_batch]
  uint8_t* batch_causal_ = nullptr;  // [max_batch]: 1 = causal rule applies
  int32_t* batch_cells_ = nullptr;   // [max_batch]: target cell of each token
  int32_t hist_min_ = 0;             // history range [hist_min_, hist_max_], padded
  int32_t hist_max_ = -1;
  // [B][L] mask, f32 or f16 (then the first half of the bytes), from the arena's allocator so that
  // running out of memory is a Status, not an abort. After mask_capacity_ f32 elements (rounded up
  // to 64 bytes) the block holds the words of mask_index_'s bits, sized for any batch and history
  // that fit (MaskIndex::WordsForAny): Attend never allocates them.
  OwnedBlock mask_block_;
  size_t mask_capacity_ = 0;  // f32 elements
  float* mask() const { return static_cast<float*>(mask_block_.data()); }
  // The pass's whole mask, [L, B] as Get returns it (also what mask_index_ is told it is).
  TensorView MaskView() const;
  // Allocates a mask block for `elements` f32 elements and their index bits (see mask_block_).
  Status AllocateMaskBlock(size_t elements, int32_t max_batch, OwnedBlock* out) const;
  // Points mask_index_ at the bits' words of mask_block_ (see mask_block_).
  void AttachMaskIndex();
  // The bits of the mask's rows, computed once per pass by the first Attend (History::mask_index).
  // Invalidated wherever the mask is written (BuildMask) or its block replaced.
  MaskIndex mask_index_;

  // Scratch, carved from pass_block_ at Init so StartForward and Remove never allocate.
  OwnedBlock pass_block_;
  int64_t* trim_below_ = nullptr;       // [max_sequences]
  int64_t* lowest_ = nullptr;           // [max_sequences]
  uint8_t* seq_in_batch_ = nullptr;     // [max_sequences]
  uint64_t* would_free_ = nullptr;      // like the table's free bits
  int32_t* would_free_list_ = nullptr;  // [cells]: cells set in would_free_
  int32_t would_free_count_ = 0;
  int32_t would_free_first_ = INT32_MAX;
  int32_t* shift_deltas_ = nullptr;  // [max_batch]
  int32_t* slots_ = nullptr;         // [max_batch]
};

}  // namespace internal
}  // namespace kv

#endif  // KVCACHE_CORE_CAUSAL_CACHE_IMPL_H_
