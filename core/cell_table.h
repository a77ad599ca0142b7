// CellTable: the metadata of a cell cache, as flat arrays with one meaning each.
//
// One cell = one token slot = one row of K and of V in every layer.
//   per cell:      pos[c]                       position of the token the cell holds
//                  seq_bits[w * num_cells + c]  bit (s % 64) of word w = s / 64: cell holds
//                  sequence s holders[c]                   number of sequences holding the cell (0:
//                  free) free_bits[c / 64]            bit (c % 64) set: cell is free (derived from
//                  holders)
//   per sequence:  first_cell[s], last_cell[s]  exact range of the cells holding s (empty: first >
//   last)
//                  min_pos[s], max_pos[s]       lowest and highest stored position of s
//                  num_cells_of[s]              cells holding s
// The derived fields (holders, free_bits, the per-sequence ones) are updated in exactly two places:
// Add() and Drop(), plus Refresh() which re-tightens a sequence's range after drops.
// Bits of free_bits beyond num_cells are always 0. Word-major seq_bits lets the mask kernel read
// one contiguous word array per sequence word.
#ifndef KVCACHE_CORE_CELL_TABLE_H_
#define KVCACHE_CORE_CELL_TABLE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "core/arena.h"
#include "core/status.h"

namespace kv {

class CellTable {
 public:
  // Sizes every array in one block from `allocator`; all cells free. On failure (kOutOfMemory,
  // kInvalidArgument) the table is unchanged. Allocates: call at Init only.
  Status Init(int32_t num_cells, int32_t max_sequences,
              const ArenaAllocator& allocator = SystemAllocator());
  void Clear();  // every cell free, every sequence empty (no allocation)

  int32_t num_cells() const { return num_cells_; }
  int32_t max_sequences() const { return max_sequences_; }
  int32_t seq_words() const { return seq_words_; }
  size_t bytes() const { return block_.bytes(); }  // memory the table holds

  bool Holds(int32_t cell, int32_t seq) const {
    return (seq_bits_[static_cast<size_t>(seq / 64) * num_cells_ + cell] >> (seq % 64)) & 1u;
  }
  bool IsFree(int32_t cell) const { return holders_[cell] == 0; }
  int32_t pos(int32_t cell) const { return pos_[cell]; }
  int32_t holders(int32_t cell) const { return holders_[cell]; }

  bool SeqEmpty(int32_t seq) const { return num_cells_of_[seq] == 0; }
  int32_t first_cell(int32_t seq) const { return first_cell_[seq]; }
  int32_t last_cell(int32_t seq) const { return last_cell_[seq]; }
  int32_t min_pos(int32_t seq) const { return min_pos_[seq]; }  // valid when !SeqEmpty
  int32_t max_pos(int32_t seq) const { return max_pos_[seq]; }  // valid when !SeqEmpty
  int32_t num_cells_of(int32_t seq) const { return num_cells_of_[seq]; }

  // The arrays, for kernels (mask) and tests.
  const int32_t* pos_data() const { return pos_; }
  const uint64_t* seq_bits_data() const { return seq_bits_; }
  std::span<const uint64_t> free_bits() const { return {free_bits_, free_words_}; }

  // Gives a free cell its token: position `pos`, sequence set {seq}. Precondition: IsFree(cell).
  void Assign(int32_t cell, int32_t pos, int32_t seq);
  // Adds seq to a held cell (sharing). Precondition: !IsFree(cell) && !Holds(cell, seq).
  // Keeps seq's range exact. Returns nothing interesting: the cell was held already.
  void Share(int32_t cell, int32_t seq);
  // Removes seq from a cell. Precondition: Holds(cell, seq). Returns true when the cell became
  // free. seq's range stays a superset until Refresh(seq).
  bool Drop(int32_t cell, int32_t seq);
  // Re-tightens seq's cell range and recomputes its min/max position by scanning the old range.
  void Refresh(int32_t seq);
  // Moves a cell's position (context shift). Keeps min/max pos of its holders a superset; callers
  // Refresh the sequence afterwards.
  void SetPos(int32_t cell, int32_t pos) { pos_[cell] = pos; }

  // Writes the first n free cells in index order to out; cells whose bit is set in `also_free`
  // (same shape as free_bits; may be empty) count as free too. Returns how many were found (< n
  // when there are not enough). Reads only; starts at the lowest-free-cell hint, so finding a cell
  // costs the distance to it in words, not the table size.
  int32_t FindFree(int32_t n, std::span<const uint64_t> also_free, int32_t also_free_first,
                   int32_t* out) const;

  // Checks every invariant by brute force (for tests). Returns an error naming the first violation.
  Status CheckInvariants() const;

 private:
  void MarkFree(int32_t cell);
  void MarkHeld(int32_t cell);

  // Every array lives in block_ (BlockCarver layout, see Init).
  OwnedBlock block_;
  int32_t num_cells_ = 0;
  int32_t max_sequences_ = 0;
  int32_t seq_words_ = 0;
  size_t free_words_ = 0;
  int32_t* pos_ = nullptr;           // [num_cells]
  uint64_t* seq_bits_ = nullptr;     // [seq_words][num_cells]
  int32_t* holders_ = nullptr;       // [num_cells]
  uint64_t* free_bits_ = nullptr;    // [free_words]
  int32_t free_hint_ = 0;            // no free cell below this index
  int32_t* first_cell_ = nullptr;    // [max_sequences]
  int32_t* last_cell_ = nullptr;     // [max_sequences]
  int32_t* min_pos_ = nullptr;       // [max_sequences]
  int32_t* max_pos_ = nullptr;       // [max_sequences]
  int32_t* num_cells_of_ = nullptr;  // [max_sequences]
};

}  // namespace kv

#endif  // KVCACHE_CORE_CELL_TABLE_H_
