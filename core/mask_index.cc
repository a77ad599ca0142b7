// MaskIndex: see core/mask_index.h.
#include "core/mask_index.h"

namespace kv {

void MaskIndex::Attach(uint64_t* words, size_t capacity) {
  words_ = words;
  capacity_ = words == nullptr ? 0 : capacity;
  Invalidate();
}

const uint64_t* MaskIndex::Lookup(const TensorView& mask) const {
  const TensorView& d = described_;
  if (mask.dtype != d.dtype || mask.ne[0] != d.ne[0] || mask.nb[0] != d.nb[0] ||
      mask.nb[1] != d.nb[1] || mask.data == nullptr || d.nb[1] == 0) {
    return nullptr;
  }
  const auto at = reinterpret_cast<uintptr_t>(mask.data);
  const auto base = reinterpret_cast<uintptr_t>(d.data);
  if (at < base || (at - base) % d.nb[1] != 0) return nullptr;
  const int64_t r0 = static_cast<int64_t>((at - base) / d.nb[1]);
  if (r0 > d.ne[1] || mask.ne[1] > d.ne[1] - r0) return nullptr;
  return words_ + static_cast<size_t>(r0) * static_cast<size_t>(kernels::MaskBitsRowWords(d.ne[0]));
}

const uint64_t* MaskIndex::BitsFor(const TensorView& mask, const kernels::ParallelForFn& pf) {
  if (mask.data == nullptr || words_ == nullptr) return nullptr;
  int state = state_.load(std::memory_order_acquire);
  if (state == kReady) return Lookup(mask);
  if (state != kEmpty || WordsFor(mask.ne[0], mask.ne[1]) > capacity_) return nullptr;
  // Claim the fill; losing the race means another thread is filling (or has filled) now.
  if (!state_.compare_exchange_strong(state, kFilling, std::memory_order_acquire)) {
    return state == kReady ? Lookup(mask) : nullptr;
  }
  kernels::MaskBits(mask, pf, words_);
  described_ = mask;
  fills_.fetch_add(1, std::memory_order_relaxed);
  state_.store(kReady, std::memory_order_release);
  return words_;
}

}  // namespace kv
