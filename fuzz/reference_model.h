// A deliberately plain model of SEMANTICS.md sections 1-8 (the causal family), for differential
// tests and fuzzers: vectors of cells with a std::vector of sequences each, every rule written as
// the sentence in SEMANTICS.md says it, no SIMD, no indexes, no cleverness. Performance is
// irrelevant here; obviousness is the point.
#ifndef KVCACHE_FUZZ_REFERENCE_MODEL_H_
#define KVCACHE_FUZZ_REFERENCE_MODEL_H_

#include <algorithm>
#include <climits>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "layouts/dtype.h"
#include "layouts/quant.h"

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

// ---- API-level models (fuzzers) ---------------------------------------------------------------
// The classes below wrap the plain rules above into the whole Cache interface, so that a fuzzer can
// drive a real cache and a model with the same calls and compare every answer: status codes,
// history contents (as f32, after the storage dtype's rounding), the mask, CanResume. Data are
// plain vectors of floats; conversions use the scalar functions of layouts/quant.h.

// A row of n floats as the storage dtype `t` keeps it (stored, then read back).
inline std::vector<float> RoundRow(kv::DType t, std::vector<float> row) {
  const int64_t n = static_cast<int64_t>(row.size());
  if (t == kv::DType::kF32 || n == 0) return row;
  std::vector<uint8_t> buf(kv::RowBytes(t, n) + 64);
  kv::StoreRowFromF32(row.data(), n, t, buf.data());
  kv::LoadRowAsF32(buf.data(), n, t, row.data());
  return row;
}

struct ModelConfig {
  int32_t padding = 1;
  bool permuted_v = false;
  kv::DType mask_dtype = kv::DType::kF32;
  bool inclusive_window = false;
};

// A Put input: dims ne (ne[0] fastest) and the values (already rounded to `dtype`), contiguous.
struct ModelTensor {
  kv::DType dtype = kv::DType::kF32;
  int64_t ne[4] = {1, 1, 1, 1};
  std::vector<float> data;
  float At(int64_t i0, int64_t i1, int64_t i2, int64_t i3 = 0) const {
    return data[static_cast<size_t>(((i3 * ne[2] + i2) * ne[1] + i1) * ne[0] + i0)];
  }
};

// What Get should return: each view flattened with ne[0] fastest (as kernels::ViewToF32 does).
struct ModelHistory {
  bool has_kv = false;
  kv::DType kv_dtype = kv::DType::kF32, v_dtype = kv::DType::kF32;
  int64_t k_ne[4] = {1, 1, 1, 1}, v_ne[4] = {1, 1, 1, 1};
  std::vector<float> k, v;
  bool has_mask = false;
  kv::DType mask_dtype = kv::DType::kF32;
  int64_t mask_cols = 0, mask_rows = 0;  // ne[0] = history length, ne[1] = batch
  std::vector<uint8_t> visible;          // [rows][cols]
};

// One ShiftFn call: the layer and the per-row deltas of the view passed.
struct ModelShift {
  int layer;
  std::vector<int32_t> delta;
  bool operator==(const ModelShift& o) const { return layer == o.layer && delta == o.delta; }
};

class CacheModel {
 public:
  virtual ~CacheModel() = default;
  virtual Result SetConfig(const ModelConfig& c) = 0;
  virtual Result Init(kv::DType dtype, int max_sequences, int capacity, int max_batch) = 0;
  // What SetConfig / Init would return, changing nothing (Cache::CheckConfig / CheckInit).
  virtual Result CheckConfig(const ModelConfig& c) const = 0;
  virtual Result CheckInit(kv::DType dtype, int max_sequences, int capacity,
                           int max_batch) const = 0;
  virtual Result StartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                              const std::vector<int32_t>& multimodal, bool reserve) = 0;
  // What StartForward would return, changing nothing (Cache::CheckStartForward).
  virtual Result CheckStartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                                   const std::vector<int32_t>& multimodal, bool reserve) const = 0;
  virtual void SetLayer(int layer) = 0;
  virtual Result Put(const ModelTensor& k, const ModelTensor& v) = 0;
  virtual ModelHistory Get() const = 0;
  virtual Result CopyPrefix(int src, int dst, int32_t len) = 0;
  virtual bool CanResume(int seq, int32_t pos) const = 0;
  // Shift calls the cache must make are appended to *shifts.
  virtual Result Remove(int seq, int32_t begin, int32_t end, std::vector<ModelShift>* shifts) = 0;
  virtual void Close() = 0;
  virtual bool SupportsCopyPrefix() const { return true; }
};

// The causal family through the whole interface (SEMANTICS.md 1-8 plus core/cache.h's extras).
class CausalCacheModel final : public CacheModel {
 public:
  struct Layer {
    bool allocated = false;
    int64_t kd = 0, vd = 0, heads = 0;
    bool input_known = false;  // the input dtypes of the layer's first Put; later Puts match
    kv::DType k_input = kv::DType::kF32, v_input = kv::DType::kF32;
    std::vector<std::vector<std::vector<float>>> k, v;  // [cell][head][elem], zero-filled
  };

  CausalCacheModel(int32_t window, int32_t memory, int32_t chunk, bool has_shift)
      : window_(window),
        memory_(memory),
        chunk_(chunk),
        has_shift_(has_shift),
        m_(window, memory, chunk, has_shift) {}

  // Cells Init would create, or -1 when Init must fail with kInvalidArgument.
  int64_t PlannedCells(kv::DType dtype, int max_sequences, int capacity, int max_batch) const {
    if (!kv::IsValidDType(dtype)) return -1;
    if (max_sequences < 1 || capacity < 1 || max_batch < 1) return -1;
    if (kv::IsQuantized(dtype) && config_.permuted_v) return -1;
    if (window_ < 0 || memory_ < 0 || chunk_ < 0) return -1;
    int64_t window = window_ == 0 ? INT32_MAX : window_;
    int64_t memory = memory_ == 0 ? window : memory_;
    if (memory != INT32_MAX && max_sequences > 1) memory = std::max(memory, window + 1);
    if (memory >= capacity) memory = INT32_MAX;
    if (memory < window) return -1;
    int64_t n = memory == INT32_MAX ? int64_t{max_sequences} * capacity
                                    : int64_t{max_sequences} * memory + max_batch;
    n = (n + config_.padding - 1) / config_.padding * config_.padding;
    if (n > INT32_MAX / 2) return -1;
    return n;
  }

  Result CheckConfig(const ModelConfig& c) const override {
    if (initialized_ || c.padding < 1) return Result::kInvalidArgument;
    if (c.mask_dtype != kv::DType::kF32 && c.mask_dtype != kv::DType::kF16)
      return Result::kInvalidArgument;
    return Result::kOk;
  }
  Result SetConfig(const ModelConfig& c) override {
    if (CheckConfig(c) != Result::kOk) return Result::kInvalidArgument;
    config_ = c;
    return Result::kOk;
  }
  Result CheckInit(kv::DType dtype, int max_sequences, int capacity, int max_batch) const override {
    return PlannedCells(dtype, max_sequences, capacity, max_batch) < 0 ? Result::kInvalidArgument
                                                                       : Result::kOk;
  }

  Result Init(kv::DType dtype, int max_sequences, int capacity, int max_batch) override {
    if (PlannedCells(dtype, max_sequences, capacity, max_batch) < 0)
      return Result::kInvalidArgument;
    Close();
    m_ = CausalModel(window_, memory_, chunk_, has_shift_);
    m_.padding = config_.padding;
    m_.inclusive_window = config_.inclusive_window;
    if (m_.Init(max_sequences, capacity, max_batch) != Result::kOk) return Result::kInvalidArgument;
    dtype_ = dtype;
    max_sequences_ = max_sequences;
    max_batch_ = max_batch;
    initialized_ = true;
    return Result::kOk;
  }

  Result CheckStartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                           const std::vector<int32_t>&, bool reserve) const override {
    if (!initialized_) return Result::kInvalidArgument;
    if (!reserve) {
      CausalModel trial = m_;  // the cells change only on a copy
      return trial.StartForward(pos, seq);
    }
    const int b = static_cast<int>(pos.size());
    if (b != static_cast<int>(seq.size()) || b < 1 || b > max_batch_)
      return Result::kInvalidArgument;
    for (int s : seq) {
      if (s < 0 || s >= max_sequences_) return Result::kInvalidArgument;
    }
    return Result::kOk;
  }
  Result StartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                      const std::vector<int32_t>& mm, bool reserve) override {
    if (!initialized_) return Result::kInvalidArgument;
    if (!reserve) {
      const Result r = m_.StartForward(pos, seq);
      if (r != Result::kOk) return r;
    } else {
      // §3.1: cells 0..B-1, the whole table as history, no metadata change.
      const Result checked = CheckStartForward(pos, seq, mm, reserve);
      if (checked != Result::kOk) return checked;
      const int b = static_cast<int>(pos.size());
      m_.batch_pos = pos;
      m_.batch_seq = seq;
      m_.batch_cells.clear();
      for (int i = 0; i < b; ++i) m_.batch_cells.push_back(i);
      m_.causal.assign(b, true);
      m_.hist_min = 0;
      m_.hist_max = static_cast<int>(m_.cells.size()) - 1;
    }
    reserve_ = reserve;
    have_batch_ = true;
    BuildMask();
    return Result::kOk;
  }

  void SetCausal(const std::vector<int32_t>& except) {
    if (!initialized_ || !have_batch_) return;
    m_.SetCausal(except);
    BuildMask();
  }

  void SetLayer(int layer) override { layer_ = layer; }

  // Shape rules shared by Put and ReserveLayers.
  Result CheckShapes(const Layer* layer, int64_t kd, int64_t vd, int64_t heads) const {
    if (kd < 1 || vd < 1 || heads < 1 || kd > INT32_MAX / 64 || vd > INT32_MAX / 64 ||
        heads > 65536)
      return Result::kInvalidArgument;
    if (kv::IsQuantized(dtype_) && (kd % 32 != 0 || vd % 32 != 0)) return Result::kInvalidArgument;
    if (layer != nullptr && layer->allocated &&
        (layer->kd != kd || layer->vd != vd || layer->heads != heads))
      return Result::kInvalidArgument;
    return Result::kOk;
  }

  Result ReserveLayers(int layers, int kd, int vd, int heads) {
    if (!initialized_ || layers < 1 || layers > 4096) return Result::kInvalidArgument;
    if (CheckShapes(nullptr, kd, vd, heads) != Result::kOk) return Result::kInvalidArgument;
    for (int l = 0; l < layers && l < static_cast<int>(layers_.size()); ++l) {
      if (CheckShapes(&layers_[l], kd, vd, heads) != Result::kOk) return Result::kInvalidArgument;
    }
    if (static_cast<int>(layers_.size()) < layers) layers_.resize(layers);
    for (int l = 0; l < layers; ++l) {
      if (!layers_[l].allocated) Allocate(&layers_[l], kd, vd, heads);
    }
    return Result::kOk;
  }

  Result Put(const ModelTensor& k, const ModelTensor& v) override {
    if (!initialized_ || !have_batch_ || layer_ < 0 || layer_ >= 4096)
      return Result::kInvalidArgument;
    if (!kv::IsFloatDType(k.dtype) || !kv::IsFloatDType(v.dtype)) return Result::kInvalidArgument;
    const int64_t b = static_cast<int64_t>(m_.batch_pos.size());
    if (k.ne[3] != 1 || v.ne[3] != 1 || k.ne[2] != b || v.ne[2] != b)
      return Result::kInvalidArgument;
    if (k.ne[1] != v.ne[1]) return Result::kInvalidArgument;
    const Layer* existing = layer_ < static_cast<int>(layers_.size()) ? &layers_[layer_] : nullptr;
    if (CheckShapes(existing, k.ne[0], v.ne[0], k.ne[1]) != Result::kOk)
      return Result::kInvalidArgument;
    if (existing != nullptr && existing->input_known &&
        (k.dtype != existing->k_input || v.dtype != existing->v_input))
      return Result::kInvalidArgument;
    if (layer_ >= static_cast<int>(layers_.size())) layers_.resize(layer_ + 1);
    Layer& layer = layers_[layer_];
    if (!layer.allocated) Allocate(&layer, k.ne[0], v.ne[0], k.ne[1]);
    layer.input_known = true;
    layer.k_input = k.dtype;
    layer.v_input = v.dtype;
    if (reserve_) return Result::kOk;  // a reserve pass sizes storage only
    for (int64_t i = 0; i < b; ++i) {
      const int cell = m_.batch_cells[i];
      for (int64_t h = 0; h < k.ne[1]; ++h) {
        std::vector<float> kr(k.ne[0]), vr(v.ne[0]);
        for (int64_t e = 0; e < k.ne[0]; ++e) kr[e] = k.At(e, h, i);
        for (int64_t e = 0; e < v.ne[0]; ++e) vr[e] = v.At(e, h, i);
        layer.k[cell][h] = RoundRow(dtype_, kr);
        layer.v[cell][h] = RoundRow(dtype_, vr);
      }
    }
    return Result::kOk;
  }

  ModelHistory Get() const override {
    ModelHistory h;
    if (!initialized_ || !have_batch_) return h;
    const int64_t len = m_.hist_max - m_.hist_min + 1;
    h.has_mask = true;
    h.mask_dtype = config_.mask_dtype;
    h.mask_cols = len;
    h.mask_rows = static_cast<int64_t>(m_.batch_pos.size());
    h.visible = mask_;
    if (layer_ < 0 || layer_ >= static_cast<int>(layers_.size()) || !layers_[layer_].allocated)
      return h;
    const Layer& l = layers_[layer_];
    h.has_kv = true;
    h.kv_dtype = h.v_dtype = dtype_;
    h.k_ne[0] = l.kd, h.k_ne[1] = l.heads, h.k_ne[2] = len;
    for (int64_t c = 0; c < len; ++c)
      for (int64_t hd = 0; hd < l.heads; ++hd)
        for (int64_t e = 0; e < l.kd; ++e) h.k.push_back(l.k[m_.hist_min + c][hd][e]);
    if (config_.permuted_v) {  // [L, v_head_dim, kv_heads], cells fastest
      h.v_ne[0] = len, h.v_ne[1] = l.vd, h.v_ne[2] = l.heads;
      for (int64_t hd = 0; hd < l.heads; ++hd)
        for (int64_t e = 0; e < l.vd; ++e)
          for (int64_t c = 0; c < len; ++c) h.v.push_back(l.v[m_.hist_min + c][hd][e]);
    } else {
      h.v_ne[0] = l.vd, h.v_ne[1] = l.heads, h.v_ne[2] = len;
      for (int64_t c = 0; c < len; ++c)
        for (int64_t hd = 0; hd < l.heads; ++hd)
          for (int64_t e = 0; e < l.vd; ++e) h.v.push_back(l.v[m_.hist_min + c][hd][e]);
    }
    return h;
  }

  Result CopyPrefix(int src, int dst, int32_t len) override {
    if (!initialized_) return Result::kInvalidArgument;
    return m_.CopyPrefix(src, dst, len);
  }

  bool CanResume(int seq, int32_t pos) const override {
    return initialized_ && m_.CanResume(seq, pos);
  }

  Result Remove(int seq, int32_t begin, int32_t end, std::vector<ModelShift>* shifts) override {
    if (!initialized_) return Result::kInvalidArgument;
    std::vector<ShiftCall> calls;
    const Result r = m_.Remove(seq, begin, end, &calls);
    if (r != Result::kOk) return r;
    // Per chunk, every allocated layer in order: key rows += delta, rounded to the storage dtype.
    for (const ShiftCall& call : calls) {
      for (int l = 0; l < static_cast<int>(layers_.size()); ++l) {
        Layer& layer = layers_[l];
        if (!layer.allocated) continue;
        shifts->push_back(ModelShift{l, call.delta});
        for (size_t i = 0; i < call.delta.size(); ++i) {
          if (call.delta[i] == 0) continue;
          for (auto& row : layer.k[call.first_cell + i]) {
            for (float& x : row) x += static_cast<float>(call.delta[i]);
            row = RoundRow(dtype_, row);
          }
        }
      }
    }
    return Result::kOk;
  }

  void Close() override {
    initialized_ = false;
    have_batch_ = false;
    layers_.clear();
    layer_ = 0;
  }

  int32_t NumCells() const { return initialized_ ? static_cast<int32_t>(m_.cells.size()) : 0; }
  const CausalModel& inner() const { return m_; }
  int layer() const { return layer_; }
  bool initialized() const { return initialized_; }

 private:
  void Allocate(Layer* l, int64_t kd, int64_t vd, int64_t heads) {
    l->allocated = true;
    l->kd = kd, l->vd = vd, l->heads = heads;
    l->k.assign(m_.cells.size(), std::vector<std::vector<float>>(heads, std::vector<float>(kd)));
    l->v.assign(m_.cells.size(), std::vector<std::vector<float>>(heads, std::vector<float>(vd)));
  }
  void BuildMask() {
    const int rows = static_cast<int>(m_.batch_pos.size());
    const int cols = m_.hist_max - m_.hist_min + 1;
    mask_.assign(static_cast<size_t>(rows) * cols, 0);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) mask_[static_cast<size_t>(i) * cols + j] = m_.Visible(i, j);
  }

  int32_t window_, memory_, chunk_;
  bool has_shift_;
  CausalModel m_;
  ModelConfig config_;
  bool initialized_ = false;
  kv::DType dtype_ = kv::DType::kF32;
  int max_sequences_ = 0, max_batch_ = 0;
  bool have_batch_ = false, reserve_ = false;
  int layer_ = 0;
  std::vector<Layer> layers_;
  std::vector<uint8_t> mask_;  // built at StartForward and SetCausal, as the cache builds it
};

// The encoder cache (SEMANTICS.md §9 and core/encoder_cache.cc's documented choices).
class EncoderCacheModel final : public CacheModel {
 public:
  explicit EncoderCacheModel(bool per_sequence) : per_sequence_(per_sequence) {}

  Result CheckConfig(const ModelConfig& c) const override {
    return initialized_ || c.padding != 1 ? Result::kInvalidArgument : Result::kOk;
  }
  Result SetConfig(const ModelConfig& c) override {
    if (CheckConfig(c) != Result::kOk) return Result::kInvalidArgument;
    permuted_v_ = c.permuted_v;
    return Result::kOk;
  }
  Result CheckInit(kv::DType dtype, int max_sequences, int capacity, int max_batch) const override {
    return !kv::IsValidDType(dtype) || max_sequences < 1 || capacity < 1 || max_batch < 1
               ? Result::kInvalidArgument
               : Result::kOk;
  }
  Result Init(kv::DType dtype, int max_sequences, int capacity, int max_batch) override {
    if (CheckInit(dtype, max_sequences, capacity, max_batch) != Result::kOk)
      return Result::kInvalidArgument;
    Close();
    max_sequences_ = max_sequences;
    max_batch_ = max_batch;
    slots_.assign(per_sequence_ ? max_sequences : 1, Slot{});
    initialized_ = true;
    return Result::kOk;
  }
  Result CheckStartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                           const std::vector<int32_t>& mm, bool) const override {
    if (!initialized_) return Result::kInvalidArgument;
    const size_t b = pos.size();
    if (b != seq.size() || b < 1 || b > static_cast<size_t>(max_batch_))
      return Result::kInvalidArgument;
    for (int32_t s : seq) {
      if (s < 0 || s >= max_sequences_) return Result::kInvalidArgument;
      if (per_sequence_ && s != seq[0]) return Result::kInvalidArgument;
    }
    for (int32_t m : mm) {
      if (m < 0 || static_cast<size_t>(m) >= b) return Result::kInvalidArgument;
    }
    return Result::kOk;
  }
  Result StartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                      const std::vector<int32_t>& mm, bool reserve) override {
    const Result checked = CheckStartForward(pos, seq, mm, reserve);
    if (checked != Result::kOk) return checked;
    cur_ = per_sequence_ ? seq[0] : 0;
    if (!mm.empty()) slots_[cur_].cur_pos = pos[mm.back()];  // the batch's last image
    reserve_ = reserve;
    return Result::kOk;
  }
  void SetLayer(int layer) override { layer_ = layer; }
  static bool Valid(const ModelTensor& t) {
    if (!kv::IsFloatDType(t.dtype)) return false;
    for (int d = 0; d < 4; ++d) {
      if (t.ne[d] < 1) return false;
    }
    return true;
  }
  Result Put(const ModelTensor& k, const ModelTensor& v) override {
    if (!initialized_ || layer_ < 0 || !Valid(k) || !Valid(v)) return Result::kInvalidArgument;
    Slot& slot = slots_[cur_];
    if (layer_ >= static_cast<int>(slot.layers.size())) slot.layers.resize(layer_ + 1);
    Stored& st = slot.layers[layer_];
    ModelTensor vs = v;
    if (permuted_v_) {  // [ne2, ne0, ne1, ne3]: tokens fastest
      vs.ne[0] = v.ne[2], vs.ne[1] = v.ne[0], vs.ne[2] = v.ne[1];
      for (int64_t i3 = 0; i3 < v.ne[3]; ++i3)
        for (int64_t i2 = 0; i2 < v.ne[2]; ++i2)
          for (int64_t i1 = 0; i1 < v.ne[1]; ++i1)
            for (int64_t i0 = 0; i0 < v.ne[0]; ++i0)
              vs.data[i2 + v.ne[2] * (i0 + v.ne[0] * (i1 + v.ne[1] * i3))] = v.At(i0, i1, i2, i3);
    }
    if (reserve_) {
      // Sizes storage; keeps what is cached; a first reserve shows zeros of the reserved shape.
      if (!st.has) {
        st.has = true;
        st.k = k;
        st.v = vs;
        std::fill(st.k.data.begin(), st.k.data.end(), 0.0f);
        std::fill(st.v.data.begin(), st.v.data.end(), 0.0f);
      }
      return Result::kOk;
    }
    st.has = true;
    st.k = k;
    st.v = vs;
    slot.pos = slot.cur_pos;
    slot.cached = true;
    return Result::kOk;
  }
  ModelHistory Get() const override {
    ModelHistory h;
    if (!initialized_ || layer_ < 0) return h;
    const Slot& slot = slots_[cur_];
    if (layer_ >= static_cast<int>(slot.layers.size()) || !slot.layers[layer_].has) return h;
    if (!slot.cached) return h;  // data null until cached (the shapes are not compared)
    const Stored& st = slot.layers[layer_];
    h.has_kv = true;
    h.kv_dtype = st.k.dtype;
    h.v_dtype = st.v.dtype;
    for (int d = 0; d < 4; ++d) h.k_ne[d] = st.k.ne[d], h.v_ne[d] = st.v.ne[d];
    h.k = st.k.data;
    h.v = st.v.data;
    return h;
  }
  bool SupportsCopyPrefix() const override { return per_sequence_; }
  Result CopyPrefix(int src, int dst, int32_t len) override {
    if (!per_sequence_) return Result::kNotSupported;
    if (!initialized_ || src < 0 || dst < 0 || src >= max_sequences_ || dst >= max_sequences_)
      return Result::kInvalidArgument;
    if (src == dst) return Result::kOk;
    Slot& s = slots_[src];
    Slot& d = slots_[dst];
    if (!s.cached || s.pos >= len) {
      d.cached = false;
      return Result::kOk;
    }
    if (d.layers.size() < s.layers.size()) d.layers.resize(s.layers.size());
    for (size_t l = 0; l < d.layers.size(); ++l) {
      if (l < s.layers.size() && s.layers[l].has) {
        d.layers[l] = s.layers[l];
      } else {
        d.layers[l].has = false;
      }
    }
    d.cached = true;
    d.pos = s.pos;
    return Result::kOk;
  }
  bool CanResume(int, int32_t) const override { return true; }
  Result Remove(int seq, int32_t begin, int32_t end, std::vector<ModelShift>*) override {
    if (!initialized_ || seq < 0 || seq >= max_sequences_) return Result::kInvalidArgument;
    // As Ollama: the recorded position never moves, even when a causal sibling shifts tokens.
    Slot& slot = slots_[per_sequence_ ? seq : 0];
    if (slot.pos >= begin && slot.pos < end) slot.cached = false;
    return Result::kOk;
  }
  void Close() override {
    slots_.clear();
    initialized_ = false;
    cur_ = 0;
    layer_ = 0;
    reserve_ = false;
  }
  bool EncoderCached() const { return initialized_ && slots_[cur_].cached; }

 private:
  struct Stored {
    bool has = false;
    ModelTensor k, v;
  };
  struct Slot {
    bool cached = false;
    int32_t pos = 0, cur_pos = 0;
    std::vector<Stored> layers;
  };
  bool per_sequence_;
  bool permuted_v_ = false;
  bool initialized_ = false;
  int max_sequences_ = 0, max_batch_ = 0;
  std::vector<Slot> slots_;
  int cur_ = 0, layer_ = 0;
  bool reserve_ = false;
};

// The wrapper (SEMANTICS.md §10 and core/cache.h): children in order, first error returned.
class WrapperCacheModel final : public CacheModel {
 public:
  explicit WrapperCacheModel(std::vector<CacheModel*> children) : c_(std::move(children)) {}
  // Every child is asked first: an argument error changes no child (a model never runs out of
  // memory, so once asked every Init succeeds).
  Result CheckConfig(const ModelConfig& cfg) const override {
    for (const CacheModel* c : c_) {
      const Result r = c->CheckConfig(cfg);
      if (r != Result::kOk) return r;
    }
    return Result::kOk;
  }
  Result SetConfig(const ModelConfig& cfg) override {
    const Result checked = CheckConfig(cfg);
    if (checked != Result::kOk) return checked;
    for (CacheModel* c : c_) (void)c->SetConfig(cfg);
    return Result::kOk;
  }
  Result CheckInit(kv::DType dtype, int max_sequences, int capacity, int max_batch) const override {
    for (const CacheModel* c : c_) {
      const Result r = c->CheckInit(dtype, max_sequences, capacity, max_batch);
      if (r != Result::kOk) return r;
    }
    return Result::kOk;
  }
  Result Init(kv::DType dtype, int max_sequences, int capacity, int max_batch) override {
    const Result checked = CheckInit(dtype, max_sequences, capacity, max_batch);
    if (checked != Result::kOk) return checked;
    for (CacheModel* c : c_) (void)c->Init(dtype, max_sequences, capacity, max_batch);
    return Result::kOk;
  }
  Result CheckStartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                           const std::vector<int32_t>& mm, bool reserve) const override {
    for (const CacheModel* c : c_) {
      const Result r = c->CheckStartForward(pos, seq, mm, reserve);
      if (r != Result::kOk) return r;
    }
    return Result::kOk;
  }
  // Every child is asked first: a batch one child refuses changes no child. Once asked, every
  // child accepts it (a model never runs out of memory, the one case the cache still unwinds).
  Result StartForward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
                      const std::vector<int32_t>& mm, bool reserve) override {
    const Result checked = CheckStartForward(pos, seq, mm, reserve);
    if (checked != Result::kOk) return checked;
    for (CacheModel* c : c_) (void)c->StartForward(pos, seq, mm, reserve);
    type_ = 0;
    return Result::kOk;
  }
  void SetLayer(int layer) override {
    for (CacheModel* c : c_) c->SetLayer(layer);
  }
  void SetLayerType(int type) { type_ = type; }
  CacheModel* Selected() const {
    return type_ >= 0 && type_ < static_cast<int>(c_.size()) ? c_[type_] : nullptr;
  }
  Result Put(const ModelTensor& k, const ModelTensor& v) override {
    CacheModel* c = Selected();
    return c == nullptr ? Result::kInvalidArgument : c->Put(k, v);
  }
  ModelHistory Get() const override {
    CacheModel* c = Selected();
    return c == nullptr ? ModelHistory{} : c->Get();
  }
  bool SupportsCopyPrefix() const override {
    for (CacheModel* c : c_) {
      if (!c->SupportsCopyPrefix()) return false;
    }
    return true;
  }
  Result CopyPrefix(int src, int dst, int32_t len) override {
    if (!SupportsCopyPrefix()) return Result::kNotSupported;
    for (CacheModel* c : c_) {
      const Result r = c->CopyPrefix(src, dst, len);
      if (r != Result::kOk) return r;
    }
    return Result::kOk;
  }
  bool CanResume(int seq, int32_t pos) const override {
    for (CacheModel* c : c_) {
      if (!c->CanResume(seq, pos)) return false;
    }
    return true;
  }
  Result Remove(int seq, int32_t begin, int32_t end, std::vector<ModelShift>* shifts) override {
    for (CacheModel* c : c_) {
      const Result r = c->Remove(seq, begin, end, shifts);
      if (r != Result::kOk) return r;
    }
    return Result::kOk;
  }
  void Close() override {
    for (CacheModel* c : c_) c->Close();
  }

 private:
  std::vector<CacheModel*> c_;
  int type_ = 0;
};

// The growing and rotating caches (SEMANTICS.md §11) the obvious way: a deque of (position,
// serial), the sinks being the tokens at positions < keep. max_size 0: the growing cache.
struct SequenceModel {
  int max_size = 0, keep = 0, offset = 0;
  std::deque<std::pair<int, int>> held;
  // Evictions asked for while every held token was a sink. With keep < max_size this stays 0;
  // a test asserts it, so a model (or configuration) that cannot make room is caught.
  int failed_evictions = 0;

  void EvictOldestNonSinks(int count) {
    for (int i = 0; i < count; ++i) {
      bool evicted = false;
      for (auto it = held.begin(); it != held.end(); ++it) {
        if (it->first >= keep) {
          held.erase(it);
          evicted = true;
          break;
        }
      }
      if (!evicted) ++failed_evictions;
    }
  }
  // Appends n tokens with serials first_serial...; returns the serials the update shows.
  std::vector<int> Update(int first_serial, int n) {
    if (max_size > 0)
      EvictOldestNonSinks(std::max(0, static_cast<int>(held.size()) - (max_size - 1)));
    for (int i = 0; i < n; ++i) held.emplace_back(offset + i, first_serial + i);
    offset += n;
    std::vector<int> out;
    for (const auto& e : held) out.push_back(e.second);
    if (max_size > 0) EvictOldestNonSinks(std::max(0, static_cast<int>(held.size()) - max_size));
    return out;
  }
  // Allowed while every dropped token is held (the newest n positions).
  bool Trim(int n) {
    if (n < 0 || n > static_cast<int>(held.size())) return false;
    for (int i = 0; i < n; ++i) {
      if (held[held.size() - 1 - i].first != offset - 1 - i) return false;
    }
    held.resize(held.size() - n);
    offset -= n;
    return true;
  }
  void Reset() {
    offset = 0;
    held.clear();
  }
};

}  // namespace kvref

#endif  // KVCACHE_FUZZ_REFERENCE_MODEL_H_
