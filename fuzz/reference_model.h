// A deliberately plain model of SEMANTICS.md sections 1-8 (the causal family), for differential
// tests and fuzzers: vectors of cells with a std::vector of sequences each, every rule written as
// the sentence in SEMANTICS.md says it, no SIMD, no indexes, no cleverness. Performance is
// irrelevant here; obviousness is the point.
#ifndef KVCACHE_FUZZ_REFERENCE_MODEL_H_
#define KVCACHE_FUZZ_REFERENCE_MODEL_H_

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

namespace kvref {

enum class Result { kOk, kCacheFull, kNotSupported, kInvalidArgument };

struct Cell {
  int32_t pos = 0;
  std::vector<int> seqs;  // empty: free
  bool Has(int s) const { return std::find(seqs.begin(), seqs.end(), s) != seqs.end(); }
  void Drop(int s) { seqs.erase(std::remove(seqs.begin(), seqs.end(), s), seqs.end()); }
};

struct ShiftCall {
  int first_cell;              // the first cell of the key view passed
  std::vector<int32_t> delta;  // per cell of the view
};

class CausalModel {
 public:
  // window/memory/chunk as given to the factories (0 = none / default).
  CausalModel(int32_t window, int32_t memory, int32_t chunk, bool has_shift)
      : req_window_(window), req_memory_(memory), chunk_(chunk), has_shift_(has_shift) {}

  int32_t padding = 1;
  bool inclusive_window = false;

  Result Init(int max_sequences, int capacity, int max_batch) {
    int64_t window = req_window_ == 0 ? INT32_MAX : req_window_;
    int64_t memory = req_memory_ == 0 ? window : req_memory_;
    if (memory != INT32_MAX && max_sequences > 1) memory = std::max(memory, window + 1);
    if (memory >= capacity) memory = INT32_MAX;
    if (memory < window) return Result::kInvalidArgument;
    int64_t n = memory == INT32_MAX ? int64_t{max_sequences} * capacity
                                    : max_sequences * memory + max_batch;
    n = (n + padding - 1) / padding * padding;
    window_ = window;
    memory_ = memory;
    max_sequences_ = max_sequences;
    max_batch_ = max_batch;
    cells.assign(n, Cell{});
    return Result::kOk;
  }

  // Returns the result; on kOk, fills history [hist_min, hist_max], batch cells and the mask.
  Result StartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq) {
    const int b = static_cast<int>(pos.size());
    if (b != static_cast<int>(seq.size()) || b < 1 || b > max_batch_)
      return Result::kInvalidArgument;
    for (int s : seq) {
      if (s < 0 || s >= max_sequences_) return Result::kInvalidArgument;
    }
    std::vector<Cell> next = cells;
    std::map<int, int64_t> lowest;  // sequence -> lowest position
    std::map<int, bool> in_batch;
    for (int i = 0; i < b; ++i) {
      if (!lowest.count(seq[i]) || pos[i] < lowest[seq[i]]) lowest[seq[i]] = pos[i];
      in_batch[seq[i]] = true;
    }
    int64_t hmin = INT64_MAX, hmax = -1;
    if (memory_ != INT32_MAX) {
      for (int s = 0; s < max_sequences_; ++s) {
        bool holds = false;
        int64_t last = INT64_MIN;
        for (const Cell& c : cells) {
          if (c.Has(s)) {
            holds = true;
            last = std::max<int64_t>(last, c.pos);
          }
        }
        if (!holds) continue;
        if (!in_batch.count(s)) lowest[s] = last + 1;
        for (Cell& c : next) {
          if (c.Has(s) && c.pos < lowest[s] - memory_) c.Drop(s);
        }
      }
      for (auto& [s, lo] : lowest) {
        if (!in_batch.count(s)) continue;
        for (size_t j = 0; j < next.size(); ++j) {
          if (next[j].Has(s) && next[j].pos >= lo - window_) {
            hmin = std::min<int64_t>(hmin, j);
            hmax = std::max<int64_t>(hmax, j);
          }
        }
      }
    } else {
      for (int i = 0; i < b; ++i) {
        for (size_t j = 0; j < next.size(); ++j) {
          if (next[j].Has(seq[i])) {
            hmin = std::min<int64_t>(hmin, j);
            hmax = std::max<int64_t>(hmax, j);
          }
        }
      }
    }
    std::vector<int> slots;
    for (size_t j = 0; j < next.size() && static_cast<int>(slots.size()) < b; ++j) {
      if (next[j].seqs.empty()) slots.push_back(static_cast<int>(j));
    }
    if (static_cast<int>(slots.size()) < b) return Result::kCacheFull;  // cells untouched
    for (int i = 0; i < b; ++i) {
      next[slots[i]].pos = pos[i];
      next[slots[i]].seqs = {seq[i]};
      hmin = std::min<int64_t>(hmin, slots[i]);
      hmax = std::max<int64_t>(hmax, slots[i]);
    }
    cells = next;
    batch_pos = pos;
    batch_seq = seq;
    batch_cells = slots;
    causal.assign(b, true);
    hist_min = static_cast<int>(hmin / padding * padding);
    hist_max = static_cast<int>((hmax + 1 + padding - 1) / padding * padding - 1);
    return Result::kOk;
  }

  void SetCausal(const std::vector<int32_t>& except) {
    causal.assign(batch_pos.size(), true);
    for (int32_t i : except) {
      if (i >= 0 && i < static_cast<int32_t>(causal.size())) causal[i] = false;
    }
  }

  // mask[i][j] for history index j (cell hist_min + j): true = visible.
  bool Visible(int i, int j) const {
    const Cell& c = cells[hist_min + j];
    const int64_t P = batch_pos[i];
    if (!c.Has(batch_seq[i])) return false;
    if (causal[i] && c.pos > P) return false;
    if (chunk_ > 0) {
      const int64_t m = ((P % chunk_) + chunk_) % chunk_;
      if (c.pos < P - m) return false;
    }
    if (window_ != INT32_MAX) {
      if (inclusive_window ? c.pos <= P - window_ : c.pos < P - window_) return false;
    }
    return true;
  }

  Result CopyPrefix(int src, int dst, int32_t len) {
    if (src < 0 || dst < 0 || src >= max_sequences_ || dst >= max_sequences_)
      return Result::kInvalidArgument;
    if (src == dst) {
      for (Cell& c : cells) {
        if (c.Has(dst) && c.pos >= len) c.Drop(dst);
      }
      return Result::kOk;
    }
    for (Cell& c : cells) c.Drop(dst);
    for (Cell& c : cells) {
      if (c.Has(src) && c.pos < len) c.seqs.push_back(dst);
    }
    return Result::kOk;
  }

  bool CanResume(int s, int32_t p) const {
    if (memory_ == INT32_MAX) return true;
    if (s < 0 || s >= max_sequences_) return false;
    int64_t first = INT64_MAX, last = INT64_MIN;
    for (const Cell& c : cells) {
      if (c.Has(s)) {
        first = std::min<int64_t>(first, c.pos);
        last = std::max<int64_t>(last, c.pos);
      }
    }
    if (last == INT64_MIN) return false;
    return std::max<int64_t>(0, int64_t{p} - window_) >= first && p <= last + 1;
  }

  // On kOk with a shift, `shifts` receives the calls the cache must make (one per chunk; the
  // layer loop is the caller's business).
  Result Remove(int s, int32_t begin, int32_t end, std::vector<ShiftCall>* shifts) {
    if (s < 0 || s >= max_sequences_ || begin < 0 || begin > end) return Result::kInvalidArgument;
    const bool shifting = end != INT32_MAX && end > begin;
    bool needs_shift = false;
    for (const Cell& c : cells) {
      if (c.Has(s) && shifting && c.pos >= end) {
        if (c.seqs.size() > 1) return Result::kNotSupported;
        needs_shift = true;
      }
    }
    if (needs_shift && !has_shift_) return Result::kNotSupported;
    const int32_t offset = begin - end;
    std::vector<bool> moved(cells.size(), false);
    for (size_t j = 0; j < cells.size(); ++j) {
      Cell& c = cells[j];
      if (!c.Has(s)) continue;
      if (c.pos >= begin && c.pos < end) {
        c.Drop(s);
      } else if (needs_shift && c.pos >= end) {
        c.pos += offset;
        moved[j] = true;
      }
    }
    if (!needs_shift) return Result::kOk;
    int first = -1, last = -1;
    for (size_t j = 0; j < cells.size(); ++j) {
      if (cells[j].Has(s)) {
        if (first < 0) first = static_cast<int>(j);
        last = static_cast<int>(j);
      }
    }
    for (int start = first; start <= last; start += max_batch_) {
      const int size = std::min(last - start + 1, max_batch_);
      int lo = -1, hi = -1;
      for (int i = 0; i < size; ++i) {
        if (moved[start + i]) {
          if (lo < 0) lo = i;
          hi = i;
        }
      }
      if (lo < 0) continue;
      ShiftCall call{start + lo, {}};
      for (int i = lo; i <= hi; ++i) call.delta.push_back(moved[start + i] ? offset : 0);
      shifts->push_back(call);
    }
    return Result::kOk;
  }

  std::vector<Cell> cells;
  std::vector<int32_t> batch_pos, batch_seq;
  std::vector<int> batch_cells;
  std::vector<bool> causal;
  int hist_min = 0, hist_max = -1;

 private:
  int32_t req_window_, req_memory_, chunk_;
  bool has_shift_;
  int64_t window_ = INT32_MAX, memory_ = INT32_MAX;
  int max_sequences_ = 0, max_batch_ = 0;
};

}  // namespace kvref

#endif  // KVCACHE_FUZZ_REFERENCE_MODEL_H_
