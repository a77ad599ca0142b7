// MaskIndex: see core/mask_index.h.
#include "core/mask_index.h"

namespace kv {

void MaskIndex::Attach(uint64_t* words, size_t capacity) {
  words_ = words;
  capacity_ = words == nullptr ? 0 : capacity;
  Invalidate();
}

namespace {

// The first row of `of` that `mask` starts at, when `mask` is rows [r0, r0 + mask.ne[1]) of it
// (same element type, row length and strides); -1 otherwise.
int64_t RowsOf(const TensorView& of, const TensorView& mask) {
  if (mask.dtype != of.dtype || mask.ne[0] != of.ne[0] || mask.nb[0] != of.nb[0] ||
      mask.nb[1] != of.nb[1] || mask.data == nullptr || of.nb[1] == 0) {
    return -1;
  }
  const auto at = reinterpret_cast<uintptr_t>(mask.data);
  const auto base = reinterpret_cast<uintptr_t>(of.data);
  if (at < base || (at - base) % of.nb[1] != 0) return -1;
  const int64_t r0 = static_cast<int64_t>((at - base) / of.nb[1]);
  if (r0 > of.ne[1] || mask.ne[1] > of.ne[1] - r0) return -1;
  return r0;
}

}  // namespace

const uint64_t* MaskIndex::Lookup(const TensorView& mask) const {
  const int64_t r0 = RowsOf(described_, mask);
  if (r0 < 0) return nullptr;
  return words_ +
         static_cast<size_t>(r0) * static_cast<size_t>(kernels::MaskBitsRowWords(described_.ne[0]));
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
  // The owner's whole mask when `mask` is some of its rows: the other rows' calls find theirs.
  const bool whole = whole_.data != nullptr && RowsOf(whole_, mask) >= 0 &&
                     WordsFor(whole_.ne[0], whole_.ne[1]) <= capacity_;
  described_ = whole ? whole_ : mask;
  kernels::MaskBits(described_, pf, words_);
  fills_.fetch_add(1, std::memory_order_relaxed);
  state_.store(kReady, std::memory_order_release);
  return Lookup(mask);
}

}  // namespace kv
