// The growing and rotating caches. Design and memory traffic: core/sequence_cache.h.
//
// One class serves both: the growing cache is the rotating one with no size limit and no sinks.
// Logical state (positions are token indices since the first Update):
//   sinks_  = min(keep, offset): positions [0, sinks_) are always held (attention sinks);
//   recent_ = the newest recent_ positions [offset - recent_, offset) are held; offset - recent_ >=
//             sinks_, and when it is greater (something was evicted) sinks_ == keep.
// Buffer state, per (b, h) of the K and V blocks:
//   rows [start_, start_ + sinks_)                            the sinks,
//   rows [start_ + sinks_, start_ + sinks_ + gap_)            dead rows (see below),
//   rows [start_ + sinks_ + gap_, ... + recent_)              the recent tokens.
// gap_ is 0 except after a multi-token update that returned more than max_size rows: its view must
// stay valid until the next call, so the rows it dropped from the held set stay in place and the
// next Update closes the gap by moving the sinks forward.
#include "core/sequence_cache.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "core/arena.h"
#include "kernels/convert.h"
#include "layouts/kv_layout.h"

namespace kv {
namespace {

constexpr int64_t kStep = 256;  // capacity granularity in tokens (the seed's step)

int64_t RoundUpTokens(int64_t n) { return (n + kStep - 1) / kStep * kStep; }

size_t ElemBytes(DType t) { return BlockBytes(t); }  // float input types only

class SeqCache final : public SequenceCache {
 public:
  // max_size <= 0: the growing cache. config_error: non-null when the arguments were invalid.
  SeqCache(DType dtype, int32_t max_size, int32_t keep, int64_t slack, const char* config_error)
      : dtype_(dtype),
        rotating_(max_size > 0),
        max_size_(max_size > 0 ? max_size : 0),
        keep_(max_size > 0 ? keep : 0),
        target_(max_size > 0 ? RoundUpTokens(static_cast<int64_t>(max_size) + slack) : INT64_MAX),
        config_error_(config_error) {}

  Status Update(const TensorView& key, const TensorView& value, int n, TensorView* keys_out,
                TensorView* values_out) override;
  int Offset() const override { return offset_; }
  int Len() const override { return sinks_ + recent_; }
  void Reset() override {
    offset_ = sinks_ = recent_ = gap_ = start_ = 0;
    shaped_ = false;  // the next Update may bring new shapes; the block is reused when they match
  }
  Status Trim(int n) override;
  Status SaveState(SequenceCacheState* state) const override;
  Status RestoreState(const SequenceCacheState& state) override;
  SequenceCacheStats Stats() const override {
    SequenceCacheStats s = stats_;
    s.capacity = capacity_;
    return s;
  }

 private:
  Status ValidateShapes(int64_t dk, int64_t dv, int64_t heads, int64_t batch) const;
  // Allocates K and V blocks of `capacity` tokens into the spare arena; nothing changes on failure.
  Status AllocateBlocks(int32_t dk, int32_t dv, int32_t heads, int32_t batch, int64_t capacity,
                        SequenceBlockLayout* kl, SequenceBlockLayout* vl, void** kb, void** vb);
  // Makes the spare arena (holding kb/vb) current and frees the old blocks.
  void AdoptBlocks(const SequenceBlockLayout& kl, const SequenceBlockLayout& vl, void* kb,
                   void* vb);
  // Moves `count` tokens of every (b, h) from row `from` to row `to` inside the K and V blocks.
  void MoveRun(int32_t from, int32_t to, int32_t count);
  // Copies `count` tokens of every (b, h) from the current blocks to blocks laid out as kl/vl.
  void CopyRun(int32_t from, const SequenceBlockLayout& kl, const SequenceBlockLayout& vl, void* kb,
               void* vb, int32_t to, int32_t count);
  // Converts the n input tokens of every (b, h) into rows [to, to + n).
  void WriteRows(const TensorView& src, const SequenceBlockLayout& l, void* block, int32_t to,
                 int n);
  bool BlocksMatch(int32_t dk, int32_t dv, int32_t heads, int32_t batch) const {
    return kblock_ != nullptr && kl_.head_dim == dk && vl_.head_dim == dv && kl_.heads == heads &&
           kl_.batch == batch;
  }

  // Configuration.
  const DType dtype_;
  const bool rotating_;
  const int32_t max_size_;  // 0: unlimited
  const int32_t keep_;
  const int64_t target_;  // block capacity aimed at (rotating: max_size + slack; else unlimited)
  const char* const config_error_;

  // Shapes fixed by the first Update (until Reset / RestoreState).
  bool shaped_ = false;
  int32_t dk_ = 0, dv_ = 0, heads_ = 0, batch_ = 0;

  // Blocks: arenas_[cur_] owns the current K and V blocks; the other one receives the next blocks
  // during growth so that a failed allocation leaves the current ones untouched.
  Arena arenas_[2];
  int cur_ = 0;
  SequenceBlockLayout kl_, vl_;
  void* kblock_ = nullptr;
  void* vblock_ = nullptr;
  int64_t capacity_ = 0;

  // Logical and buffer state (see the file comment).
  int32_t offset_ = 0, sinks_ = 0, recent_ = 0, gap_ = 0, start_ = 0;

  std::vector<uint8_t> scratch_;  // one input row gathered when dim 0 is strided
  SequenceCacheStats stats_;
};

Status SeqCache::ValidateShapes(int64_t dk, int64_t dv, int64_t heads, int64_t batch) const {
  if (dk < 1 || dv < 1 || heads < 1 || batch < 1 || dk > INT32_MAX || dv > INT32_MAX ||
      heads > INT32_MAX || batch > INT32_MAX) {
    return Status::Error(Code::kInvalidArgument,
                         "shapes must be positive: Dk %lld Dv %lld H %lld B %lld",
                         static_cast<long long>(dk), static_cast<long long>(dv),
                         static_cast<long long>(heads), static_cast<long long>(batch));
  }
  if (IsQuantized(dtype_) && (dk % kQuantBlockElems != 0 || dv % kQuantBlockElems != 0)) {
    return Status::Error(Code::kInvalidArgument,
                         "%s storage needs head dims multiple of 32 (Dk %lld Dv %lld)",
                         DTypeName(dtype_), static_cast<long long>(dk), static_cast<long long>(dv));
  }
  return Status::Ok();
}

Status SeqCache::AllocateBlocks(int32_t dk, int32_t dv, int32_t heads, int32_t batch,
                                int64_t capacity, SequenceBlockLayout* kl, SequenceBlockLayout* vl,
                                void** kb, void** vb) {
  if (capacity > INT32_MAX) {
    return Status::Error(Code::kOutOfMemory, "capacity %lld tokens exceeds int32",
                         static_cast<long long>(capacity));
  }
  // Reject sizes whose byte counts would overflow size_t (long double has the range to tell).
  const long double rows = static_cast<long double>(capacity) * heads * batch;
  const long double bytes = rows * (RoundUp(RowBytes(dtype_, dk), kBlockAlign) +
                                    RoundUp(RowBytes(dtype_, dv), kBlockAlign));
  if (bytes > static_cast<long double>(SIZE_MAX / 4)) {
    return Status::Error(Code::kOutOfMemory, "cache block of %Lg bytes is too large", bytes);
  }
  *kl = MakeSequenceBlockLayout(dtype_, dk, heads, batch, static_cast<int32_t>(capacity));
  *vl = MakeSequenceBlockLayout(dtype_, dv, heads, batch, static_cast<int32_t>(capacity));
  Arena& spare = arenas_[1 - cur_];
  spare.Release();
  Status s = spare.Reserve(kl->bytes + vl->bytes);  // one region for both blocks
  if (s.ok()) s = spare.Allocate(kl->bytes, kb);
  if (s.ok()) s = spare.Allocate(vl->bytes, vb);
  if (!s.ok()) {
    spare.Release();
    return s;
  }
  ++stats_.allocations;
  return Status::Ok();
}

void SeqCache::AdoptBlocks(const SequenceBlockLayout& kl, const SequenceBlockLayout& vl, void* kb,
                           void* vb) {
  arenas_[cur_].Release();
  cur_ = 1 - cur_;
  kl_ = kl;
  vl_ = vl;
  kblock_ = kb;
  vblock_ = vb;
  capacity_ = kl.capacity;
}

void SeqCache::MoveRun(int32_t from, int32_t to, int32_t count) {
  if (count <= 0 || from == to) return;
  for (int pass = 0; pass < 2; ++pass) {
    const SequenceBlockLayout& l = pass == 0 ? kl_ : vl_;
    char* base = static_cast<char*>(pass == 0 ? kblock_ : vblock_);
    const size_t bytes = SequenceRunBytes(l, count);
    for (int32_t b = 0; b < l.batch; ++b) {
      for (int32_t h = 0; h < l.heads; ++h) {
        std::memmove(base + SequenceRowOffset(l, b, h, to), base + SequenceRowOffset(l, b, h, from),
                     bytes);
      }
    }
    stats_.bytes_moved += bytes * static_cast<uint64_t>(l.batch) * static_cast<uint64_t>(l.heads);
  }
}

void SeqCache::CopyRun(int32_t from, const SequenceBlockLayout& kl, const SequenceBlockLayout& vl,
                       void* kb, void* vb, int32_t to, int32_t count) {
  if (count <= 0) return;
  for (int pass = 0; pass < 2; ++pass) {
    const SequenceBlockLayout& src_l = pass == 0 ? kl_ : vl_;
    const SequenceBlockLayout& dst_l = pass == 0 ? kl : vl;
    const char* src = static_cast<const char*>(pass == 0 ? kblock_ : vblock_);
    char* dst = static_cast<char*>(pass == 0 ? kb : vb);
    const size_t bytes = SequenceRunBytes(src_l, count);  // same row stride in both layouts
    for (int32_t b = 0; b < src_l.batch; ++b) {
      for (int32_t h = 0; h < src_l.heads; ++h) {
        std::memcpy(dst + SequenceRowOffset(dst_l, b, h, to),
                    src + SequenceRowOffset(src_l, b, h, from), bytes);
      }
    }
    stats_.bytes_moved +=
        bytes * static_cast<uint64_t>(src_l.batch) * static_cast<uint64_t>(src_l.heads);
  }
}

void SeqCache::WriteRows(const TensorView& src, const SequenceBlockLayout& l, void* block,
                         int32_t to, int n) {
  const size_t es = ElemBytes(src.dtype);
  const bool packed = src.nb[0] == es;
  char* base = static_cast<char*>(block);
  for (int32_t b = 0; b < l.batch; ++b) {
    for (int32_t h = 0; h < l.heads; ++h) {
      for (int t = 0; t < n; ++t) {
        const char* row = static_cast<const char*>(RowPtr(src, t, h, b));
        if (!packed) {  // gather the strided elements into one contiguous row first
          for (int32_t i = 0; i < l.head_dim; ++i)
            std::memcpy(&scratch_[i * es], row + i * src.nb[0], es);
          row = reinterpret_cast<const char*>(scratch_.data());
        }
        kernels::ConvertRow(row, src.dtype, base + SequenceRowOffset(l, b, h, to + t), dtype_,
                            l.head_dim);
      }
    }
  }
  stats_.bytes_written +=
      l.row_bytes * static_cast<uint64_t>(l.batch) * l.heads * static_cast<uint64_t>(n);
}

Status SeqCache::Update(const TensorView& key, const TensorView& value, int n, TensorView* keys_out,
                        TensorView* values_out) {
  // ---- validate (nothing changes on any error) ----
  if (config_error_ != nullptr) return Status::Error(Code::kInvalidArgument, "%s", config_error_);
  if (keys_out == nullptr || values_out == nullptr) {
    return Status::Error(Code::kInvalidArgument, "Update: null output view");
  }
  if (n <= 0) return Status::Error(Code::kInvalidArgument, "Update: n must be positive, got %d", n);
  if (key.data == nullptr || value.data == nullptr) {
    return Status::Error(Code::kInvalidArgument, "Update: null key or value data");
  }
  if (!IsFloatDType(key.dtype) || !IsFloatDType(value.dtype)) {
    return Status::Error(Code::kInvalidArgument,
                         "Update: key/value must be f32, f16 or bf16 (got %s, %s)",
                         DTypeName(key.dtype), DTypeName(value.dtype));
  }
  if (key.ne[1] != n || value.ne[1] != n) {
    return Status::Error(Code::kInvalidArgument, "Update: n %d but key has %lld tokens, value %lld",
                         n, static_cast<long long>(key.ne[1]), static_cast<long long>(value.ne[1]));
  }
  if (key.ne[2] != value.ne[2] || key.ne[3] != value.ne[3]) {
    return Status::Error(Code::kInvalidArgument, "Update: key and value disagree on H or B");
  }
  KV_RETURN_IF_ERROR(ValidateShapes(key.ne[0], value.ne[0], key.ne[2], key.ne[3]));
  const int32_t dk = static_cast<int32_t>(key.ne[0]), dv = static_cast<int32_t>(value.ne[0]);
  const int32_t heads = static_cast<int32_t>(key.ne[2]), batch = static_cast<int32_t>(key.ne[3]);
  if (shaped_ && (dk != dk_ || dv != dv_ || heads != heads_ || batch != batch_)) {
    return Status::Error(
        Code::kInvalidArgument,
        "Update: shape changed: Dk %d Dv %d H %d B %d, cache holds Dk %d Dv %d H %d B %d", dk, dv,
        heads, batch, dk_, dv_, heads_, batch_);
  }
  if (offset_ > INT32_MAX - n)
    return Status::Error(Code::kInvalidArgument, "Update: offset would overflow");

  // ---- plan ----
  const int32_t held = sinks_ + recent_;
  // Drop so that min(held, max_size - 1) stay before the n new tokens (SEMANTICS.md 11); 0 or 1.
  const int32_t drop = rotating_ ? std::max(0, held - (max_size_ - 1)) : 0;
  const int32_t kept_recent = recent_ - drop;
  const int32_t kept = sinks_ + kept_recent;
  const int64_t need = static_cast<int64_t>(kept) + n;
  const int32_t recent_src = start_ + sinks_ + gap_ + drop;  // first kept recent row
  const bool usable = BlocksMatch(dk, dv, heads, batch);
  const bool fits_in_place =
      usable && recent_src + static_cast<int64_t>(kept_recent) + n <= capacity_;
  // Compacting a block smaller than the target would happen every few tokens: grow instead.
  const bool fits_compacted = usable && need <= capacity_ && capacity_ >= target_;
  const size_t scratch_bytes =
      static_cast<size_t>(std::max(dk, dv)) * 4;  // f32 is the widest input

  int32_t new_start = 0;
  if (!fits_in_place && !fits_compacted) {
    const int64_t old_cap = usable ? capacity_ : 0;
    int64_t grow = old_cap + old_cap / 2;
    if (need <= target_) grow = std::min(grow, target_);
    const int64_t cap = RoundUpTokens(std::max(need, grow));
    SequenceBlockLayout kl, vl;
    void* kb = nullptr;
    void* vb = nullptr;
    KV_RETURN_IF_ERROR(AllocateBlocks(dk, dv, heads, batch, cap, &kl, &vl, &kb, &vb));
    if (scratch_.size() < scratch_bytes)
      scratch_.resize(scratch_bytes);  // the only other allocation
    if (usable) {
      CopyRun(start_, kl, vl, kb, vb, 0, sinks_);
      CopyRun(recent_src, kl, vl, kb, vb, sinks_, kept_recent);
    }
    AdoptBlocks(kl, vl, kb, vb);
  } else {
    if (scratch_.size() < scratch_bytes) scratch_.resize(scratch_bytes);
    if (fits_in_place) {
      // Close the gap (dead rows + the dropped token) by moving the few sinks forward.
      new_start = recent_src - sinks_;
      MoveRun(start_, new_start, sinks_);
    } else {
      // The run reached the end of the block: move it back to the front once.
      MoveRun(start_, 0, sinks_);
      MoveRun(recent_src, sinks_, kept_recent);
    }
  }

  // ---- write and return ----
  const int32_t write_at = new_start + kept;
  WriteRows(key, kl_, kblock_, write_at, n);
  WriteRows(value, vl_, vblock_, write_at, n);
  const int32_t total = kept + n;
  *keys_out = SequenceBlockView(kl_, kblock_, new_start, total);
  *values_out = SequenceBlockView(vl_, vblock_, new_start, total);

  shaped_ = true;
  dk_ = dk;
  dv_ = dv;
  heads_ = heads;
  batch_ = batch;
  offset_ += n;
  start_ = new_start;
  // The run is [sinks | newest tokens]: its first min(keep, offset) rows are the sinks (either
  // sinks_ was keep already, or nothing was ever evicted and the run starts at position 0).
  sinks_ = std::min(keep_, offset_);
  if (rotating_ && total > max_size_) {
    recent_ = max_size_ - sinks_;
    gap_ = total - max_size_;
  } else {
    recent_ = total - sinks_;
    gap_ = 0;
  }
  return Status::Ok();
}

Status SeqCache::Trim(int n) {
  if (config_error_ != nullptr) return Status::Error(Code::kInvalidArgument, "%s", config_error_);
  if (n < 0) return Status::Error(Code::kInvalidArgument, "Trim: n must be >= 0, got %d", n);
  const int32_t held = sinks_ + recent_;
  if (offset_ == held) {  // nothing evicted: every position [0, offset) is held
    if (n > offset_) {
      return Status::Error(Code::kInvalidArgument, "Trim: %d tokens requested, %d held", n,
                           offset_);
    }
    offset_ -= n;
    sinks_ = std::min(keep_, offset_);
    recent_ = offset_ - sinks_;
  } else {
    if (n > recent_) {
      return Status::Error(
          Code::kInvalidArgument,
          "Trim: only the newest %d tokens are held contiguously; %d requested (older "
          "ones were evicted)",
          recent_, n);
    }
    offset_ -= n;
    recent_ -= n;
  }
  return Status::Ok();
}

Status SeqCache::SaveState(SequenceCacheState* state) const {
  if (state == nullptr) return Status::Error(Code::kInvalidArgument, "SaveState: null state");
  SequenceCacheState s;
  s.dtype = dtype_;
  s.max_size = max_size_;
  s.keep = keep_;
  s.offset = offset_;
  s.len = sinks_ + recent_;
  if (offset_ > 0) {
    s.key_dim = dk_;
    s.value_dim = dv_;
    s.heads = heads_;
    s.batch = batch_;
    for (int pass = 0; pass < 2; ++pass) {
      const SequenceBlockLayout& l = pass == 0 ? kl_ : vl_;
      const char* base = static_cast<const char*>(pass == 0 ? kblock_ : vblock_);
      std::vector<uint8_t>& out = pass == 0 ? s.keys : s.values;
      out.resize(l.row_bytes * static_cast<size_t>(s.len) * l.heads * l.batch);
      uint8_t* o = out.data();
      for (int32_t b = 0; b < l.batch; ++b) {
        for (int32_t h = 0; h < l.heads; ++h) {
          for (int32_t i = 0; i < s.len; ++i) {
            const int32_t row = i < sinks_ ? start_ + i : start_ + gap_ + i;
            std::memcpy(o, base + SequenceRowOffset(l, b, h, row), l.row_bytes);
            o += l.row_bytes;
          }
        }
      }
    }
  }
  *state = std::move(s);
  return Status::Ok();
}

Status SeqCache::RestoreState(const SequenceCacheState& s) {
  if (config_error_ != nullptr) return Status::Error(Code::kInvalidArgument, "%s", config_error_);
  if (s.dtype != dtype_ || s.max_size != max_size_ || s.keep != keep_) {
    return Status::Error(
        Code::kInvalidArgument,
        "RestoreState: state is %s max_size %d keep %d, cache is %s max_size %d keep %d",
        DTypeName(s.dtype), s.max_size, s.keep, DTypeName(dtype_), max_size_, keep_);
  }
  if (s.offset < 0 || s.len < 0 || s.len > s.offset) {
    return Status::Error(Code::kInvalidArgument, "RestoreState: offset %d, len %d", s.offset,
                         s.len);
  }
  if (s.offset == 0) {
    if (!s.keys.empty() || !s.values.empty()) {
      return Status::Error(Code::kCorrupt, "RestoreState: empty state with row bytes");
    }
    Reset();
    return Status::Ok();
  }
  const int32_t sinks = std::min(keep_, s.offset);
  if (s.len < sinks || (rotating_ && s.len > max_size_) || (!rotating_ && s.len != s.offset)) {
    return Status::Error(Code::kInvalidArgument, "RestoreState: len %d impossible for offset %d",
                         s.len, s.offset);
  }
  KV_RETURN_IF_ERROR(ValidateShapes(s.key_dim, s.value_dim, s.heads, s.batch));
  const size_t rows = static_cast<size_t>(s.len) * s.heads * s.batch;
  if (s.keys.size() != rows * RowBytes(dtype_, s.key_dim) ||
      s.values.size() != rows * RowBytes(dtype_, s.value_dim)) {
    return Status::Error(Code::kCorrupt, "RestoreState: %zu key / %zu value bytes for %zu rows",
                         s.keys.size(), s.values.size(), rows);
  }
  SequenceBlockLayout kl, vl;
  void* kb = nullptr;
  void* vb = nullptr;
  KV_RETURN_IF_ERROR(AllocateBlocks(s.key_dim, s.value_dim, s.heads, s.batch,
                                    RoundUpTokens(std::max<int64_t>(s.len, 1)), &kl, &vl, &kb,
                                    &vb));
  const size_t scratch_bytes = static_cast<size_t>(std::max(s.key_dim, s.value_dim)) * 4;
  if (scratch_.size() < scratch_bytes) scratch_.resize(scratch_bytes);
  for (int pass = 0; pass < 2; ++pass) {
    const SequenceBlockLayout& l = pass == 0 ? kl : vl;
    char* base = static_cast<char*>(pass == 0 ? kb : vb);
    const uint8_t* in = pass == 0 ? s.keys.data() : s.values.data();
    for (int32_t b = 0; b < l.batch; ++b) {
      for (int32_t h = 0; h < l.heads; ++h) {
        for (int32_t i = 0; i < s.len; ++i) {
          std::memcpy(base + SequenceRowOffset(l, b, h, i), in, l.row_bytes);
          in += l.row_bytes;
        }
      }
    }
  }
  AdoptBlocks(kl, vl, kb, vb);
  shaped_ = true;
  dk_ = s.key_dim;
  dv_ = s.value_dim;
  heads_ = s.heads;
  batch_ = s.batch;
  offset_ = s.offset;
  sinks_ = sinks;
  recent_ = s.len - sinks;
  gap_ = 0;
  start_ = 0;
  return Status::Ok();
}

}  // namespace

std::unique_ptr<SequenceCache> NewKVCache(DType dtype) {
  const char* error = IsValidDType(dtype) ? nullptr : "NewKVCache: invalid dtype";
  return std::make_unique<SeqCache>(IsValidDType(dtype) ? dtype : DType::kF32, 0, 0, 0, error);
}

std::unique_ptr<SequenceCache> NewRotatingKVCache(int max_size, int keep, DType dtype, int slack) {
  const char* error = nullptr;
  if (max_size < 1) {
    error = "NewRotatingKVCache: max_size must be >= 1";
  } else if (keep < 0 || keep >= max_size) {
    error = "NewRotatingKVCache: keep must be in [0, max_size)";
  } else if (slack < 1) {
    error = "NewRotatingKVCache: slack must be >= 1";
  } else if (!IsValidDType(dtype)) {
    error = "NewRotatingKVCache: invalid dtype";
  }
  if (error != nullptr) {
    // Still a rotating cache (max_size 1) so the object is well-formed; every mutator reports
    // error.
    return std::make_unique<SeqCache>(DType::kF32, 1, 0, 1, error);
  }
  return std::make_unique<SeqCache>(dtype, max_size, keep, slack, nullptr);
}

std::unique_ptr<SequenceCache> NewRotatingKVCache(int max_size, int keep, DType dtype) {
  const int slack = max_size > 0 ? std::max(256, max_size / 2) : 1;
  return NewRotatingKVCache(max_size, keep, dtype, slack);
}

}  // namespace kv
