// MaskIndex: a cache's memo of its mask's row bitmaps (kernels::MaskBits: each row's hidden cells
// and nonzero values, 1/16 of an f32 mask), so that the layers of a forward pass read the mask
// once instead of once per layer.
//
// Why: Attend finds each row's visible cells from its mask row before it computes anything, and
// every layer of a pass hands it the same mask. Reading all of it, 4 bytes per row and cell, in
// each of 16 layers took 10% of `kvperf --sequences 64 --system 1024 --context 512` (session 31's
// profile), where a prompt of one of 64 sequences sees ~1500 of ~34000 cells: prefill computed
// little and the scan read everything. With the bits, a layer walks 2 bits per row and cell.
//
// Use: the owner (a cache) attaches memory for the bits and calls Invalidate whenever it writes
// its mask or frees its memory; its History carries a pointer to the index (History::mask_index);
// Attend asks for the bits of the mask it is given. The first Attend after Invalidate computes
// them, the rest reuse them. The caches name their whole mask when they invalidate, so that a
// runtime that hands Attend some rows of it at a time still computes the bits once. A runtime that
// builds its History by hand can own one the same way:
//
//   std::vector<uint64_t> words(kv::MaskIndex::WordsFor(max_cells, max_rows));
//   kv::MaskIndex index;
//   index.Attach(words.data(), words.size());
//   kv::History h{k, v, mask};
//   h.mask_index = &index;
//   for (layer ...) kv::Attend(q[layer], h, params, &out[layer], pool);  // reads `mask` once
//   ... write new values into the mask ...
//   index.Invalidate();  // before the next Attend: the index cannot see writes into the mask
//
// (C: kvc_mask_index_new, core/kvcache_c.h.) A mask of another address or shape than the one the
// bits describe, or larger than the memory, is read directly, as without an index.
//
// Threads: Attend may run on several threads at once over one History. The first to ask computes
// the bits; one that asks while they are being computed reads the mask itself this once (it does
// not wait). Attach and Invalidate are the owner's writes, never concurrent with Attend (its
// History is not valid while the cache changes: core/cache.h).
#ifndef KVCACHE_CORE_MASK_INDEX_H_
#define KVCACHE_CORE_MASK_INDEX_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"
#include "layouts/tensor_view.h"

namespace kv {

class MaskIndex {
 public:
  MaskIndex() = default;
  MaskIndex(const MaskIndex&) = delete;
  MaskIndex& operator=(const MaskIndex&) = delete;

  // Words needed for a mask of `rows` rows of `cells` elements.
  static constexpr size_t WordsFor(int64_t cells, int64_t rows) {
    return static_cast<size_t>(rows) * static_cast<size_t>(kernels::MaskBitsRowWords(cells));
  }
  // Words that hold the bits of any mask of at most `elements` elements in at most `max_rows`
  // rows: a row rounds its cells up to whole words, so rows * 2 * ceil(cells / 64) <=
  // 2 * (elements / 64 + rows).
  static constexpr size_t WordsForAny(size_t elements, int64_t max_rows) {
    return 2 * (elements / 64 + static_cast<size_t>(max_rows));
  }

  // Memory for the bits: `capacity` words, 8-byte aligned, that the owner keeps until the next
  // Attach (null, 0: none; BitsFor then returns null). Forgets the bits.
  void Attach(uint64_t* words, size_t capacity);
  // The mask's contents, or the memory it lies in, changed: forget the bits.
  void Invalidate() { Invalidate(TensorView{}); }
  // The same, naming the owner's whole mask now: the first BitsFor of any of its rows computes the
  // bits of all of them (when they fit), so that calls that each take some rows (a runtime that
  // splits a batch's queries over several Attend calls) share one computation. A view with data
  // null names none.
  void Invalidate(const TensorView& whole) {
    whole_ = whole;
    state_.store(kEmpty, std::memory_order_relaxed);
  }

  // The bits of `mask` ([L, B], f32 or f16, as Attend validated it) in kernels::MaskBits' layout,
  // computed now (on pf's threads) when none are held, for the whole mask when `mask` is some of
  // its rows; null when this index cannot give them: no memory attached or too little, another
  // thread computing them now, or a mask that is not the one the held bits describe nor some of
  // its rows (a view of rows [r0, r1) of it gets the bits of those rows).
  const uint64_t* BitsFor(const TensorView& mask, const kernels::ParallelForFn& pf);

  // How many times the bits were computed since construction (for tests and benchmarks).
  uint64_t fills() const { return fills_.load(std::memory_order_relaxed); }

 private:
  enum State : int { kEmpty, kFilling, kReady };
  // The held bits' rows for `mask` (kReady), or null.
  const uint64_t* Lookup(const TensorView& mask) const;

  std::atomic<int> state_{kEmpty};
  TensorView described_{};  // the mask the held bits describe (kReady)
  TensorView whole_{};      // the owner's whole mask (Invalidate(whole)), or data null
  uint64_t* words_ = nullptr;
  size_t capacity_ = 0;
  std::atomic<uint64_t> fills_{0};
};

}  // namespace kv

#endif  // KVCACHE_CORE_MASK_INDEX_H_
