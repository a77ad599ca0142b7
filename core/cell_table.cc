#include "core/cell_table.h"

#include <algorithm>
#include <bit>
#include <climits>

namespace kv {

namespace {

// The one layout of a table's arrays; run with a null carver base to size, then to place.
struct TableArrays {
  int32_t* pos;
  uint64_t* seq_bits;
  int32_t* holders;
  uint64_t* free_bits;
  int32_t* first_cell;
  int32_t* last_cell;
  int32_t* min_pos;
  int32_t* max_pos;
  int32_t* num_cells_of;
};

TableArrays Carve(BlockCarver* c, size_t cells, size_t seqs, size_t seq_words, size_t free_words) {
  TableArrays a;
  a.pos = c->Take<int32_t>(cells);
  a.seq_bits = c->Take<uint64_t>(seq_words * cells);
  a.holders = c->Take<int32_t>(cells);
  a.free_bits = c->Take<uint64_t>(free_words);
  a.first_cell = c->Take<int32_t>(seqs);
  a.last_cell = c->Take<int32_t>(seqs);
  a.min_pos = c->Take<int32_t>(seqs);
  a.max_pos = c->Take<int32_t>(seqs);
  a.num_cells_of = c->Take<int32_t>(seqs);
  return a;
}

}  // namespace

Status CellTable::Init(int32_t num_cells, int32_t max_sequences, const ArenaAllocator& allocator) {
  if (num_cells <= 0 || max_sequences <= 0) {
    return Status::Error(Code::kInvalidArgument, "cell table: %d cells, %d sequences", num_cells,
                         max_sequences);
  }
  const size_t seq_words = (static_cast<size_t>(max_sequences) + 63) / 64;
  const size_t free_words = (static_cast<size_t>(num_cells) + 63) / 64;
  BlockCarver sizing(nullptr);
  Carve(&sizing, num_cells, max_sequences, seq_words, free_words);
  OwnedBlock block;
  if (Status s = OwnedBlock::Allocate(allocator, sizing.size(), &block); !s.ok()) {
    return Status::Error(Code::kOutOfMemory, "cell table for %d cells: %s", num_cells, s.message());
  }
  BlockCarver placing(block.data());
  const TableArrays a = Carve(&placing, num_cells, max_sequences, seq_words, free_words);
  // Commit.
  block_ = static_cast<OwnedBlock&&>(block);
  num_cells_ = num_cells;
  max_sequences_ = max_sequences;
  seq_words_ = static_cast<int32_t>(seq_words);
  free_words_ = free_words;
  pos_ = a.pos;
  seq_bits_ = a.seq_bits;
  holders_ = a.holders;
  free_bits_ = a.free_bits;
  first_cell_ = a.first_cell;
  last_cell_ = a.last_cell;
  min_pos_ = a.min_pos;
  max_pos_ = a.max_pos;
  num_cells_of_ = a.num_cells_of;
  Clear();
  return Status::Ok();
}

void CellTable::Clear() {
  const size_t cells = static_cast<size_t>(num_cells_);
  const size_t seqs = static_cast<size_t>(max_sequences_);
  std::fill(pos_, pos_ + cells, 0);
  std::fill(seq_bits_, seq_bits_ + static_cast<size_t>(seq_words_) * cells, 0);
  std::fill(holders_, holders_ + cells, 0);
  std::fill(free_bits_, free_bits_ + free_words_, ~uint64_t{0});
  if (num_cells_ % 64 != 0) free_bits_[free_words_ - 1] = (uint64_t{1} << (num_cells_ % 64)) - 1;
  free_hint_ = 0;
  std::fill(first_cell_, first_cell_ + seqs, INT32_MAX);
  std::fill(last_cell_, last_cell_ + seqs, -1);
  std::fill(min_pos_, min_pos_ + seqs, INT32_MAX);
  std::fill(max_pos_, max_pos_ + seqs, INT32_MIN);
  std::fill(num_cells_of_, num_cells_of_ + seqs, 0);
}

void CellTable::MarkFree(int32_t cell) {
  free_bits_[cell / 64] |= uint64_t{1} << (cell % 64);
  free_hint_ = std::min(free_hint_, cell);
}

void CellTable::MarkHeld(int32_t cell) { free_bits_[cell / 64] &= ~(uint64_t{1} << (cell % 64)); }

void CellTable::Assign(int32_t cell, int32_t pos, int32_t seq) {
  pos_[cell] = pos;
  MarkHeld(cell);
  if (cell == free_hint_) free_hint_ = cell + 1;
  Share(cell, seq);
}

void CellTable::Share(int32_t cell, int32_t seq) {
  seq_bits_[static_cast<size_t>(seq / 64) * num_cells_ + cell] |= uint64_t{1} << (seq % 64);
  ++holders_[cell];
  ++num_cells_of_[seq];
  first_cell_[seq] = std::min(first_cell_[seq], cell);
  last_cell_[seq] = std::max(last_cell_[seq], cell);
  min_pos_[seq] = std::min(min_pos_[seq], pos_[cell]);
  max_pos_[seq] = std::max(max_pos_[seq], pos_[cell]);
}

bool CellTable::Drop(int32_t cell, int32_t seq) {
  seq_bits_[static_cast<size_t>(seq / 64) * num_cells_ + cell] &= ~(uint64_t{1} << (seq % 64));
  --num_cells_of_[seq];
  if (--holders_[cell] == 0) {
    MarkFree(cell);
    return true;
  }
  return false;
}

void CellTable::Refresh(int32_t seq) {
  int32_t first = INT32_MAX, last = -1, lo = INT32_MAX, hi = INT32_MIN;
  if (num_cells_of_[seq] > 0) {
    const uint64_t* words = seq_bits_ + static_cast<size_t>(seq / 64) * num_cells_;
    const uint64_t bit = uint64_t{1} << (seq % 64);
    for (int32_t c = first_cell_[seq]; c <= last_cell_[seq]; ++c) {
      if (words[c] & bit) {
        first = std::min(first, c);
        last = c;
        lo = std::min(lo, pos_[c]);
        hi = std::max(hi, pos_[c]);
      }
    }
  }
  first_cell_[seq] = first;
  last_cell_[seq] = last;
  min_pos_[seq] = lo;
  max_pos_[seq] = hi;
}

int32_t CellTable::FindFree(int32_t n, std::span<const uint64_t> also_free, int32_t also_free_first,
                            int32_t* out) const {
  int32_t found = 0;
  int32_t start = free_hint_;
  if (!also_free.empty()) start = std::min(start, also_free_first);
  const size_t words = free_words_;
  for (size_t w = static_cast<size_t>(start) / 64; w < words && found < n; ++w) {
    uint64_t bits = free_bits_[w] | (also_free.empty() ? 0 : also_free[w]);
    while (bits != 0 && found < n) {
      out[found++] = static_cast<int32_t>(w * 64 + std::countr_zero(bits));
      bits &= bits - 1;
    }
  }
  return found;
}

Status CellTable::CheckInvariants() const {
  std::vector<int32_t> count(max_sequences_, 0), first(max_sequences_, INT32_MAX),
      last(max_sequences_, -1);
  std::vector<int32_t> lo(max_sequences_, INT32_MAX), hi(max_sequences_, INT32_MIN);
  for (int32_t c = 0; c < num_cells_; ++c) {
    int32_t h = 0;
    for (int32_t s = 0; s < max_sequences_; ++s) {
      if (!Holds(c, s)) continue;
      ++h;
      ++count[s];
      first[s] = std::min(first[s], c);
      last[s] = std::max(last[s], c);
      lo[s] = std::min(lo[s], pos_[c]);
      hi[s] = std::max(hi[s], pos_[c]);
    }
    if (h != holders_[c])
      return Status::Error(Code::kCorrupt, "cell %d: holders %d, bits say %d", c, holders_[c], h);
    const bool free_bit = (free_bits_[c / 64] >> (c % 64)) & 1u;
    if (free_bit != (h == 0))
      return Status::Error(Code::kCorrupt, "cell %d: free bit %d, holders %d", c, free_bit, h);
    if (h == 0 && c < free_hint_)
      return Status::Error(Code::kCorrupt, "cell %d free below hint %d", c, free_hint_);
  }
  for (size_t w = 0; w < free_words_; ++w) {
    const int64_t beyond = static_cast<int64_t>(w + 1) * 64 - num_cells_;
    if (beyond > 0 && (free_bits_[w] >> (64 - beyond)) != 0) {
      return Status::Error(Code::kCorrupt, "free bits beyond the last cell");
    }
  }
  for (int32_t s = 0; s < max_sequences_; ++s) {
    if (count[s] != num_cells_of_[s]) {
      return Status::Error(Code::kCorrupt, "seq %d: %d cells counted, %d recorded", s, count[s],
                           num_cells_of_[s]);
    }
    if (count[s] == 0) continue;
    // Ranges may be supersets between a Drop and its Refresh; public operations leave them exact,
    // but a superset is still correct for every reader, so that is what is checked here.
    if (first_cell_[s] > first[s] || last_cell_[s] < last[s]) {
      return Status::Error(Code::kCorrupt, "seq %d: range [%d, %d] misses [%d, %d]", s,
                           first_cell_[s], last_cell_[s], first[s], last[s]);
    }
    if (min_pos_[s] != lo[s] || max_pos_[s] != hi[s]) {
      return Status::Error(Code::kCorrupt, "seq %d: positions [%d, %d], cells say [%d, %d]", s,
                           min_pos_[s], max_pos_[s], lo[s], hi[s]);
    }
  }
  return Status::Ok();
}

}  // namespace kv
