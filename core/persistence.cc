// Persistence (core/persistence.h has the format and the rules) and allocator injection for the
// causal family. Loading parses and checks the whole stream into locals and pointers into the
// caller's bytes, then checks compatibility and room, and only then mutates the cache.
#include "core/persistence.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/causal_cache_impl.h"
#include "core/crc32c.h"
#include "core/stream_impl.h"
#include "layouts/kv_layout.h"

namespace kv {
namespace {

using internal::BeginStream;
using internal::CopyElementsIn;
using internal::EndStream;
using internal::kHeaderBytes;
using internal::kKindCausal;
using internal::kKindSequence;
using internal::kKindWrapper;
using internal::kTrailerBytes;
using internal::LoadI32;
using internal::LoadU32;
using internal::MulAdd;
using internal::OpenStream;
using internal::PutBytes;
using internal::PutElements;
using internal::PutI32;
using internal::PutU32;
using internal::PutU64;
using internal::PutU8;
using internal::Reader;
using internal::SwapToOrFromStreamOrder;
using internal::Truncated;

// ---- files --------------------------------------------------------------------------------------

Status WriteFileAtomically(const char* path, const std::vector<uint8_t>& bytes) {
  if (path == nullptr || path[0] == '\0')
    return Status::Error(Code::kInvalidArgument, "save: empty path");
  const std::string tmp = std::string(path) + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::Error(Code::kInvalidArgument, "save: cannot create %s: %s", tmp.c_str(),
                         std::strerror(errno));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Status::Error(err == ENOSPC ? Code::kOutOfMemory : Code::kInvalidArgument,
                           "save: writing %s: %s", tmp.c_str(), std::strerror(err));
    }
    done += static_cast<size_t>(w);
  }
  // The data must be on disk before the rename makes it the file: otherwise a crash could leave
  // the new name pointing at an empty or partial file.
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return Status::Error(Code::kInvalidArgument, "save: fsync %s: %s", tmp.c_str(),
                         std::strerror(err));
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Status::Error(Code::kInvalidArgument, "save: close %s", tmp.c_str());
  }
  if (::rename(tmp.c_str(), path) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Status::Error(Code::kInvalidArgument, "save: rename to %s: %s", path,
                         std::strerror(err));
  }
  // Persist the rename itself (the directory entry). Best effort: some filesystems refuse.
  std::string dir(path);
  const size_t slash = dir.rfind('/');
  dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : dir.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t[], FreeDeleter>;

// Reads the whole file; malloc so that a huge file is kOutOfMemory, not an abort.
Status ReadFile(const char* path, Buffer* out, size_t* size) {
  if (path == nullptr || path[0] == '\0')
    return Status::Error(Code::kInvalidArgument, "load: empty path");
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return Status::Error(Code::kInvalidArgument, "load: cannot open %s: %s", path,
                         std::strerror(errno));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0) {
    ::close(fd);
    return Status::Error(Code::kInvalidArgument, "load: %s is not a regular file", path);
  }
  const size_t n = static_cast<size_t>(st.st_size);
  Buffer buf(static_cast<uint8_t*>(std::malloc(n == 0 ? 1 : n)));
  if (!buf) {
    ::close(fd);
    return Status::Error(Code::kOutOfMemory, "load: cannot allocate %zu bytes for %s", n, path);
  }
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(fd, buf.get() + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;  // shrank meanwhile: the checksum / size checks will say so
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  *out = std::move(buf);
  *size = done;
  return Status::Ok();
}

// Every *File function is its in-memory counterpart plus the same file I/O; these hold that I/O
// once. `serialize(std::vector<uint8_t>*)` fills the bytes that are then written atomically.
template <class Serialize>
Status SaveToFile(const char* path, Serialize&& serialize) {
  std::vector<uint8_t> bytes;
  KV_RETURN_IF_ERROR(serialize(&bytes));
  return WriteFileAtomically(path, bytes);
}

// Reads the whole file, then `load(std::span<const uint8_t>)` loads its bytes. The caller checks
// its cache pointer first, so a null cache is reported before the path is looked at.
template <class Load>
Status LoadFromFile(const char* path, Load&& load) {
  Buffer buf;
  size_t size = 0;
  KV_RETURN_IF_ERROR(ReadFile(path, &buf, &size));
  return load(std::span<const uint8_t>(buf.get(), size));
}

// SaveCacheFile / LoadCacheFile for both cache types (Cache, WrapperCache): overload resolution on
// C picks the matching SaveCache / LoadCache.
template <class C>
Status SaveCacheFileOf(const C& cache, const char* path, int seq) {
  return SaveToFile(path, [&](std::vector<uint8_t>* out) { return SaveCache(cache, out, seq); });
}

template <class C>
Status LoadCacheFileOf(const char* path, C* cache, int seq) {
  if (cache == nullptr) return Status::Error(Code::kInvalidArgument, "LoadCacheFile: null cache");
  return LoadFromFile(path,
                      [&](std::span<const uint8_t> bytes) { return LoadCache(bytes, cache, seq); });
}

}  // namespace

// ---- the causal family
// ----------------------------------------------------------------------------

namespace internal {

Status CausalCacheImpl::SetAllocator(const ArenaAllocator& allocator) {
  if (allocator.allocate == nullptr || allocator.release == nullptr)
    return Status::Error(Code::kInvalidArgument, "SetAllocator: null allocate or release");
  // Regions already held were obtained from the old allocator and must go back to it.
  if (arena_.BytesReserved() != 0) {
    return Status::Error(Code::kInvalidArgument,
                         "SetAllocator: the cache holds storage; call before Init or after Close");
  }
  arena_.SetAllocator(allocator);
  return Status::Ok();
}

namespace {

// The per-layer record of a stream.
struct StreamLayer {
  bool allocated = false;
  int32_t k_head_dim = 0, v_head_dim = 0, kv_heads = 0;
  const uint8_t* rows = nullptr;  // K rows of every saved cell, then V rows
  size_t k_row = 0, v_row = 0;    // canonical bytes of one (cell, head) row
};

// Copies canonical (cell, head) rows of one saved cell between the stream and a block.
void CopyRowsOut(const CellBlockLayout& l, const void* block, int32_t cell, size_t row,
                 std::vector<uint8_t>* out) {
  const char* base = static_cast<const char*>(block);
  for (int32_t h = 0; h < l.kv_heads; ++h) {
    if (!l.cells_fastest) {
      PutElements(out, base + CellRowOffset(l, cell, h), row, l.dtype);
    } else {
      const size_t e = BlockBytes(l.dtype);
      for (int32_t d = 0; d < l.head_dim; ++d)
        PutElements(out, base + CellsFastestOffset(l, cell, h, d), e, l.dtype);
    }
  }
}

void CopyRowsIn(const CellBlockLayout& l, void* block, int32_t cell, size_t row,
                const uint8_t* in) {
  char* base = static_cast<char*>(block);
  for (int32_t h = 0; h < l.kv_heads; ++h) {
    if (!l.cells_fastest) {
      if (in != nullptr) {
        CopyElementsIn(base + CellRowOffset(l, cell, h), in + h * row, row, l.dtype);
      } else {
        std::memset(base + CellRowOffset(l, cell, h), 0, row);
      }
    } else {
      const size_t e = BlockBytes(l.dtype);
      for (int32_t d = 0; d < l.head_dim; ++d) {
        char* dst = base + CellsFastestOffset(l, cell, h, d);
        if (in != nullptr) {
          CopyElementsIn(dst, in + h * row + d * e, e, l.dtype);
        } else {
          std::memset(dst, 0, e);
        }
      }
    }
  }
}

}  // namespace

Status CausalCacheImpl::Serialize(std::vector<uint8_t>* out, int seq) const {
  if (out == nullptr) return Status::Error(Code::kInvalidArgument, "save: null output");
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "save: cache not initialized");
  if (seq < -1 || seq >= max_sequences_) {
    return Status::Error(Code::kInvalidArgument, "save: sequence %d outside [-1, %d)", seq,
                         max_sequences_);
  }
  const int32_t n_cells = table_.num_cells();
  const int32_t words = table_.seq_words();
  int32_t lo = 0, hi = n_cells - 1;
  if (seq >= 0) {
    lo = table_.first_cell(seq);
    hi = table_.last_cell(seq);
  }
  auto saved = [&](int32_t c) { return seq < 0 ? !table_.IsFree(c) : table_.Holds(c, seq); };
  uint32_t n = 0;
  for (int32_t c = lo; c <= hi; ++c) n += saved(c) ? 1 : 0;

  // Size it once: the stream can be large, and growing it by doubling would copy it repeatedly.
  size_t total = kHeaderBytes + 64 + layers_.size() * 16 + size_t{n} * 8 + kTrailerBytes;
  if (seq < 0) total += size_t{n} * words * 8;
  for (const LayerStorage& l : layers_) {
    if (l.allocated) {
      total += size_t{n} * l.k_layout.kv_heads *
               (RowBytes(dtype_, l.k_layout.head_dim) + RowBytes(dtype_, l.v_layout.head_dim));
    }
  }
  out->reserve(total);
  BeginStream(out, kKindCausal);
  PutU8(out, static_cast<uint8_t>(dtype_));
  PutU8(out, config_.permuted_v ? 1 : 0);
  PutU8(out, 0);
  PutU8(out, 0);
  PutI32(out, window_);
  PutI32(out, memory_);
  PutI32(out, chunk_);
  PutI32(out, config_.padding);
  PutI32(out, max_sequences_);
  PutI32(out, capacity_);
  PutI32(out, max_batch_);
  PutI32(out, n_cells);
  PutI32(out, seq);
  // Trailing layers without storage carry nothing (a failed first Put leaves one behind).
  size_t n_layers = layers_.size();
  while (n_layers > 0 && !layers_[n_layers - 1].allocated) --n_layers;
  PutI32(out, static_cast<int32_t>(n_layers));
  for (size_t li = 0; li < n_layers; ++li) {
    const LayerStorage& l = layers_[li];
    PutU8(out, l.allocated ? 1 : 0);
    PutU8(out, 0);
    PutU8(out, 0);
    PutU8(out, 0);
    PutI32(out, l.allocated ? l.k_layout.head_dim : 0);
    PutI32(out, l.allocated ? l.v_layout.head_dim : 0);
    PutI32(out, l.allocated ? l.k_layout.kv_heads : 0);
  }
  PutU32(out, n);
  for (int32_t c = lo; c <= hi; ++c) {
    if (!saved(c)) continue;
    PutI32(out, c);
    PutI32(out, table_.pos(c));
  }
  if (seq < 0) {
    const uint64_t* bits = table_.seq_bits_data();
    for (int32_t c = lo; c <= hi; ++c) {
      if (!saved(c)) continue;
      for (int32_t w = 0; w < words; ++w) PutU64(out, bits[static_cast<size_t>(w) * n_cells + c]);
    }
  }
  for (const LayerStorage& l : layers_) {
    if (!l.allocated) continue;
    const size_t kr = RowBytes(dtype_, l.k_layout.head_dim);
    const size_t vr = RowBytes(dtype_, l.v_layout.head_dim);
    for (int32_t c = lo; c <= hi; ++c) {
      if (saved(c)) CopyRowsOut(l.k_layout, l.k, c, kr, out);
    }
    for (int32_t c = lo; c <= hi; ++c) {
      if (saved(c)) CopyRowsOut(l.v_layout, l.v, c, vr, out);
    }
  }
  EndStream(out);
  return Status::Ok();
}

Status CausalCacheImpl::Load(std::span<const uint8_t> bytes, int seq, bool check_only) {
  if (!initialized_) return Status::Error(Code::kInvalidArgument, "load: cache not initialized");
  Reader r;
  KV_RETURN_IF_ERROR(OpenStream(bytes, kKindCausal, &r));

  // 1. Parse and check the stream on its own (kCorrupt: it is malformed whatever the target).
  uint8_t dtype_u8 = 0, permuted = 0, z0 = 0, z1 = 0;
  int32_t window = 0, memory = 0, chunk = 0, padding = 0, max_seqs = 0, capacity = 0, max_batch = 0,
          cells = 0, saved_seq = 0, n_layers = 0;
  if (!r.U8(&dtype_u8) || !r.U8(&permuted) || !r.U8(&z0) || !r.U8(&z1) || !r.I32(&window) ||
      !r.I32(&memory) || !r.I32(&chunk) || !r.I32(&padding) || !r.I32(&max_seqs) ||
      !r.I32(&capacity) || !r.I32(&max_batch) || !r.I32(&cells) || !r.I32(&saved_seq) ||
      !r.I32(&n_layers)) {
    return Truncated("the cache header");
  }
  const DType dtype = static_cast<DType>(dtype_u8);
  if (!IsValidDType(dtype) || permuted > 1 || z0 != 0 || z1 != 0)
    return Status::Error(Code::kCorrupt, "cache stream: bad dtype/flags %u/%u", dtype_u8, permuted);
  if (max_seqs < 1 || cells < 1 || cells > INT32_MAX / 2 || padding < 1 || capacity < 1 ||
      max_batch < 1 || window < 1 || memory < 1 || chunk < 0 || saved_seq < -1 ||
      saved_seq >= max_seqs || n_layers < 0 || n_layers > kMaxLayers) {
    return Status::Error(Code::kCorrupt,
                         "cache stream: impossible shape (sequences %d, cells %d, layers %d, "
                         "saved sequence %d)",
                         max_seqs, cells, n_layers, saved_seq);
  }
  std::vector<StreamLayer> sl(static_cast<size_t>(n_layers));
  for (StreamLayer& l : sl) {
    uint8_t alloc = 0, a = 0, b = 0, c = 0;
    if (!r.U8(&alloc) || !r.U8(&a) || !r.U8(&b) || !r.U8(&c) || !r.I32(&l.k_head_dim) ||
        !r.I32(&l.v_head_dim) || !r.I32(&l.kv_heads)) {
      return Truncated("a layer record");
    }
    if (alloc > 1 || a != 0 || b != 0 || c != 0)
      return Status::Error(Code::kCorrupt, "cache stream: bad layer flags");
    l.allocated = alloc == 1;
    if (!l.allocated) {
      if (l.k_head_dim != 0 || l.v_head_dim != 0 || l.kv_heads != 0)
        return Status::Error(Code::kCorrupt, "cache stream: shapes on an empty layer");
      continue;
    }
    if (l.k_head_dim < 1 || l.v_head_dim < 1 || l.kv_heads < 1 || l.k_head_dim > INT32_MAX / 64 ||
        l.v_head_dim > INT32_MAX / 64 || l.kv_heads > 65536 ||
        (IsQuantized(dtype) &&
         (l.k_head_dim % kQuantBlockElems != 0 || l.v_head_dim % kQuantBlockElems != 0))) {
      return Status::Error(Code::kCorrupt, "cache stream: bad layer shape [%d, %d] / [%d, %d]",
                           l.k_head_dim, l.kv_heads, l.v_head_dim, l.kv_heads);
    }
    l.k_row = RowBytes(dtype, l.k_head_dim);
    l.v_row = RowBytes(dtype, l.v_head_dim);
  }
  uint32_t n_saved = 0;
  if (!r.U32(&n_saved)) return Truncated("the cell count");
  if (n_saved > static_cast<uint32_t>(cells)) {
    return Status::Error(Code::kCorrupt, "cache stream: %u cells saved of %d", n_saved, cells);
  }
  const size_t n = n_saved;
  const uint8_t* cell_recs = nullptr;
  if (!r.Bytes(n * 8, &cell_recs)) return Truncated("the cell records");
  for (size_t i = 0; i < n; ++i) {
    const int32_t c = LoadI32(cell_recs + 8 * i);
    const int32_t prev = i == 0 ? -1 : LoadI32(cell_recs + 8 * (i - 1));
    if (c < 0 || c >= cells || c <= prev) {
      return Status::Error(Code::kCorrupt,
                           "cache stream: cell %d out of range or out of order (cells %d)", c,
                           cells);
    }
  }
  const size_t words = (static_cast<size_t>(max_seqs) + 63) / 64;
  const uint8_t* bits = nullptr;
  if (saved_seq < 0) {
    size_t bits_bytes = 0;
    if (!MulAdd(n, words * 8, 0, &bits_bytes) || !r.Bytes(bits_bytes, &bits))
      return Truncated("the sequence bits");
    const uint64_t last_mask =
        max_seqs % 64 == 0 ? ~uint64_t{0} : (uint64_t{1} << (max_seqs % 64)) - 1;
    for (size_t i = 0; i < n; ++i) {
      uint64_t any = 0;
      for (size_t w = 0; w < words; ++w) {
        const uint8_t* p = bits + (i * words + w) * 8;
        const uint64_t v = static_cast<uint64_t>(LoadU32(p + 4)) << 32 | LoadU32(p);
        if (w == words - 1 && (v & ~last_mask) != 0)
          return Status::Error(Code::kCorrupt, "cache stream: sequence bit beyond %d", max_seqs);
        any |= v;
      }
      if (any == 0) return Status::Error(Code::kCorrupt, "cache stream: saved cell held by none");
    }
  }
  for (StreamLayer& l : sl) {
    if (!l.allocated) continue;
    // In 64 bits: on a 32-bit machine one cell's rows of a valid shape can exceed size_t, which
    // makes the stream truncated only if it saves a cell (then those bytes cannot be in memory).
    // With no cell saved it is well formed, and whether the layer fits here is a question for
    // step 2 (kOutOfMemory).
    uint64_t row = 0, layer_bytes = 0;
    if (__builtin_mul_overflow(uint64_t{l.k_row} + l.v_row, static_cast<uint64_t>(l.kv_heads),
                               &row) ||
        __builtin_mul_overflow(row, uint64_t{n}, &layer_bytes) || layer_bytes > r.left() ||
        !r.Bytes(static_cast<size_t>(layer_bytes), &l.rows)) {
      return Truncated("the K/V rows");
    }
  }
  if (r.left() != 0)
    return Status::Error(Code::kCorrupt, "cache stream: %zu bytes after the rows", r.left());

  // 2. Compatibility with this cache (kInvalidArgument: a good stream for another cache).
  if (dtype != dtype_ || window != window_ || memory != memory_ || chunk != chunk_) {
    return Status::Error(Code::kInvalidArgument,
                         "load: stream is %s window %d memory %d chunk %d, cache is %s window %d "
                         "memory %d chunk %d",
                         DTypeName(dtype), window, memory, chunk, DTypeName(dtype_), window_,
                         memory_, chunk_);
  }
  const bool whole = saved_seq < 0;
  int32_t dst = -1;
  if (whole) {
    if (seq != -1) {
      return Status::Error(Code::kInvalidArgument,
                           "load: stream holds the whole cache; sequence %d must be -1", seq);
    }
    if (padding != config_.padding || max_seqs != max_sequences_ || capacity != capacity_ ||
        max_batch != max_batch_ || cells != table_.num_cells()) {
      return Status::Error(Code::kInvalidArgument,
                           "load: stream cache is (sequences %d, capacity %d, batch %d, padding "
                           "%d, cells %d), this one (%d, %d, %d, %d, %d)",
                           max_seqs, capacity, max_batch, padding, cells, max_sequences_, capacity_,
                           max_batch_, config_.padding, table_.num_cells());
    }
  } else {
    dst = seq == -1 ? saved_seq : seq;
    if (dst < 0 || dst >= max_sequences_) {
      return Status::Error(Code::kInvalidArgument, "load: sequence %d outside [0, %d)", dst,
                           max_sequences_);
    }
  }
  size_t needed = 0;
  for (int32_t l = 0; l < n_layers; ++l) {
    const StreamLayer& s = sl[l];
    if (!s.allocated) continue;
    if (l < static_cast<int32_t>(layers_.size()) && layers_[l].allocated) {
      const LayerStorage& t = layers_[l];
      if (t.k_layout.head_dim != s.k_head_dim || t.v_layout.head_dim != s.v_head_dim ||
          t.k_layout.kv_heads != s.kv_heads) {
        return Status::Error(Code::kInvalidArgument,
                             "load: layer %d is [%d, %d] / [%d, %d] in the stream, [%d, %d] / "
                             "[%d, %d] here",
                             l, s.k_head_dim, s.kv_heads, s.v_head_dim, s.kv_heads,
                             t.k_layout.head_dim, t.k_layout.kv_heads, t.v_layout.head_dim,
                             t.v_layout.kv_heads);
      }
    } else {
      size_t layer_bytes = 0;
      KV_RETURN_IF_ERROR(LayerBytes(s.k_head_dim, s.v_head_dim, s.kv_heads, &layer_bytes));
      if (__builtin_add_overflow(needed, layer_bytes, &needed)) {
        return Status::Error(Code::kOutOfMemory,
                             "load: the stream's layers need more than 2^64 "
                             "bytes here");
      }
    }
  }

  // 3. Room: cells for a sequence (the lowest free ones, counting those dst releases).
  std::vector<int32_t> placed;
  if (!whole) {
    placed.reserve(n);
    for (int32_t c = 0; c < table_.num_cells() && placed.size() < n; ++c) {
      if (table_.IsFree(c) || (table_.holders(c) == 1 && table_.Holds(c, dst))) placed.push_back(c);
    }
    if (placed.size() < n) {
      return Status::Error(Code::kCacheFull, "load: %zu cells needed, %zu available", n,
                           placed.size());
    }
  }
  if (check_only) return Status::Ok();
  // Storage for layers this cache has not allocated yet, in one allocation that either succeeds
  // or leaves everything as it was.
  if (needed > 0) KV_RETURN_IF_ERROR(arena_.Reserve(needed));

  // 4. Commit. Nothing below can fail.
  if (static_cast<int32_t>(layers_.size()) < n_layers) layers_.resize(n_layers);
  for (int32_t l = 0; l < n_layers; ++l) {
    if (sl[l].allocated && !layers_[l].allocated) {
      KV_RETURN_IF_ERROR(
          AllocateLayer(&layers_[l], sl[l].k_head_dim, sl[l].v_head_dim, sl[l].kv_heads));
    }
  }
  if (whole) {
    table_.Clear();
    for (size_t i = 0; i < n; ++i) {
      const int32_t c = LoadI32(cell_recs + 8 * i);
      const int32_t pos = LoadI32(cell_recs + 8 * i + 4);
      bool first = true;
      for (size_t w = 0; w < words; ++w) {
        const uint8_t* p = bits + (i * words + w) * 8;
        uint64_t v = static_cast<uint64_t>(LoadU32(p + 4)) << 32 | LoadU32(p);
        while (v != 0) {
          const int32_t s = static_cast<int32_t>(w * 64) + __builtin_ctzll(v);
          v &= v - 1;
          if (first) {
            table_.Assign(c, pos, s);
            first = false;
          } else {
            table_.Share(c, s);
          }
        }
      }
    }
  } else {
    if (!table_.SeqEmpty(dst)) {
      for (int32_t c = table_.first_cell(dst); c <= table_.last_cell(dst); ++c) {
        if (table_.Holds(c, dst)) table_.Drop(c, dst);
      }
      table_.Refresh(dst);
    }
    for (size_t i = 0; i < n; ++i) table_.Assign(placed[i], LoadI32(cell_recs + 8 * i + 4), dst);
  }
  for (int32_t l = 0; l < static_cast<int32_t>(layers_.size()); ++l) {
    LayerStorage& t = layers_[l];
    if (!t.allocated) continue;
    const bool in_stream = l < n_layers && sl[l].allocated;
    if (whole && !in_stream) {
      // The saved cache had no rows for this layer: make it what a fresh allocation would be.
      std::memset(t.k, 0, t.k_layout.bytes);
      std::memset(t.v, 0, t.v_layout.bytes);
      continue;
    }
    const size_t kr = RowBytes(dtype_, t.k_layout.head_dim);
    const size_t vr = RowBytes(dtype_, t.v_layout.head_dim);
    const size_t heads = static_cast<size_t>(t.k_layout.kv_heads);
    const uint8_t* k_in = in_stream ? sl[l].rows : nullptr;
    const uint8_t* v_in = in_stream ? sl[l].rows + n * heads * kr : nullptr;
    for (size_t i = 0; i < n; ++i) {
      const int32_t c = whole ? LoadI32(cell_recs + 8 * i) : placed[i];
      CopyRowsIn(t.k_layout, t.k, c, kr, k_in ? k_in + i * heads * kr : nullptr);
      CopyRowsIn(t.v_layout, t.v, c, vr, v_in ? v_in + i * heads * vr : nullptr);
    }
  }
  // No forward pass is current: the old batch's cells and mask no longer describe the table.
  have_batch_ = false;
  reserve_ = false;
  batch_size_ = 0;
  hist_min_ = 0;
  hist_max_ = -1;
  return Status::Ok();
}

}  // namespace internal

// ---- public functions
// -----------------------------------------------------------------------------

Status SaveCache(const Cache& cache, std::vector<uint8_t>* out, int seq) {
  if (out == nullptr) return Status::Error(Code::kInvalidArgument, "SaveCache: null output");
  return cache.Serialize(out, seq);
}

Status LoadCache(std::span<const uint8_t> bytes, Cache* cache, int seq) {
  if (cache == nullptr) return Status::Error(Code::kInvalidArgument, "LoadCache: null cache");
  return cache->Deserialize(bytes, seq);
}

Status SaveCacheFile(const Cache& cache, const char* path, int seq) {
  return SaveCacheFileOf(cache, path, seq);
}

Status LoadCacheFile(const char* path, Cache* cache, int seq) {
  return LoadCacheFileOf(path, cache, seq);
}

Status SaveCache(const WrapperCache& cache, std::vector<uint8_t>* out, int seq) {
  if (out == nullptr) return Status::Error(Code::kInvalidArgument, "SaveCache: null output");
  // Child() is not const; saving only reads the children.
  WrapperCache& w = const_cast<WrapperCache&>(cache);
  const int n = w.NumChildren();
  std::vector<std::vector<uint8_t>> children(static_cast<size_t>(n));
  size_t total = kHeaderBytes + 4 + kTrailerBytes;
  for (int i = 0; i < n; ++i) {
    const Cache* c = w.Child(i);
    if (c == nullptr)
      return Status::Error(Code::kInvalidArgument, "SaveCache: child %d is null", i);
    Status s = c->Serialize(&children[i], seq);
    if (!s.ok()) return Status::Error(s.code(), "SaveCache: child %d: %s", i, s.message());
    total += 8 + children[i].size();
  }
  out->reserve(total);
  BeginStream(out, kKindWrapper);
  PutU32(out, static_cast<uint32_t>(n));
  for (const auto& c : children) {
    PutU64(out, c.size());
    PutBytes(out, c.data(), c.size());
  }
  EndStream(out);
  return Status::Ok();
}

Status LoadCache(std::span<const uint8_t> bytes, WrapperCache* cache, int seq) {
  if (cache == nullptr) return Status::Error(Code::kInvalidArgument, "LoadCache: null cache");
  Reader r;
  KV_RETURN_IF_ERROR(OpenStream(bytes, kKindWrapper, &r));
  uint32_t n = 0;
  if (!r.U32(&n)) return Truncated("the child count");
  if (n > r.left() / 8) return Status::Error(Code::kCorrupt, "cache stream: %u children", n);
  std::vector<std::span<const uint8_t>> spans;
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t len = 0;
    const uint8_t* p = nullptr;
    if (!r.U64(&len) || len > r.left() || !r.Bytes(static_cast<size_t>(len), &p))
      return Truncated("a child stream");
    spans.emplace_back(p, static_cast<size_t>(len));
  }
  if (r.left() != 0)
    return Status::Error(Code::kCorrupt, "cache stream: %zu bytes after the children", r.left());
  if (static_cast<int64_t>(n) != cache->NumChildren()) {
    return Status::Error(Code::kInvalidArgument, "load: stream has %u children, cache has %d", n,
                         cache->NumChildren());
  }
  // Ask every child about its stream first: a child that would refuse it refuses before any
  // child has changed (not even its forward pass), and before any backup is written. Then back
  // every child up: a child without persistence refuses there, still before any change.
  for (uint32_t i = 0; i < n; ++i) {
    if (cache->Child(static_cast<int>(i)) == nullptr)
      return Status::Error(Code::kInvalidArgument, "load: child %u is null", i);
    Status s = cache->Child(static_cast<int>(i))->CheckDeserialize(spans[i], seq);
    if (!s.ok()) return Status::Error(s.code(), "load: child %u: %s", i, s.message());
  }
  std::vector<std::vector<uint8_t>> backups(n);
  for (uint32_t i = 0; i < n; ++i) {
    Status s = cache->Child(static_cast<int>(i))->Serialize(&backups[i], -1);
    if (!s.ok()) return Status::Error(s.code(), "load: child %u: %s", i, s.message());
  }
  for (uint32_t i = 0; i < n; ++i) {
    Status s = cache->Child(static_cast<int>(i))->Deserialize(spans[i], seq);
    if (s.ok()) continue;
    // Out of memory (or a child without CheckDeserialize). Restoring a cache's own whole-cache
    // stream needs no new storage, so it cannot fail.
    for (uint32_t j = 0; j < i; ++j)
      (void)cache->Child(static_cast<int>(j))->Deserialize(backups[j], -1);
    return Status::Error(s.code(), "load: child %u: %s", i, s.message());
  }
  return Status::Ok();
}

Status SaveCacheFile(const WrapperCache& cache, const char* path, int seq) {
  return SaveCacheFileOf(cache, path, seq);
}

Status LoadCacheFile(const char* path, WrapperCache* cache, int seq) {
  return LoadCacheFileOf(path, cache, seq);
}

Status SaveSequenceCache(const SequenceCache& cache, std::vector<uint8_t>* out) {
  if (out == nullptr)
    return Status::Error(Code::kInvalidArgument, "SaveSequenceCache: null output");
  SequenceCacheState s;
  KV_RETURN_IF_ERROR(cache.SaveState(&s));
  out->reserve(kHeaderBytes + 52 + s.keys.size() + s.values.size() + kTrailerBytes);
  BeginStream(out, kKindSequence);
  PutU8(out, static_cast<uint8_t>(s.dtype));
  PutU8(out, 0);
  PutU8(out, 0);
  PutU8(out, 0);
  for (int32_t v : {s.max_size, s.keep, s.offset, s.len, s.key_dim, s.value_dim, s.heads, s.batch})
    PutI32(out, v);
  PutU64(out, s.keys.size());
  PutU64(out, s.values.size());
  PutElements(out, s.keys.data(), s.keys.size(), s.dtype);
  PutElements(out, s.values.data(), s.values.size(), s.dtype);
  EndStream(out);
  return Status::Ok();
}

Status LoadSequenceCache(std::span<const uint8_t> bytes, SequenceCache* cache) {
  if (cache == nullptr)
    return Status::Error(Code::kInvalidArgument, "LoadSequenceCache: null cache");
  Reader r;
  KV_RETURN_IF_ERROR(OpenStream(bytes, kKindSequence, &r));
  SequenceCacheState s;
  uint8_t dtype_u8 = 0, a = 0, b = 0, c = 0;
  uint64_t kb = 0, vb = 0;
  if (!r.U8(&dtype_u8) || !r.U8(&a) || !r.U8(&b) || !r.U8(&c) || !r.I32(&s.max_size) ||
      !r.I32(&s.keep) || !r.I32(&s.offset) || !r.I32(&s.len) || !r.I32(&s.key_dim) ||
      !r.I32(&s.value_dim) || !r.I32(&s.heads) || !r.I32(&s.batch) || !r.U64(&kb) || !r.U64(&vb)) {
    return Truncated("the sequence cache header");
  }
  s.dtype = static_cast<DType>(dtype_u8);
  if (!IsValidDType(s.dtype) || a != 0 || b != 0 || c != 0)
    return Status::Error(Code::kCorrupt, "cache stream: bad dtype/flags");
  // Byte counts must agree with the shapes before anything is copied (RestoreState checks again).
  if (s.len < 0 || s.key_dim < 0 || s.value_dim < 0 || s.heads < 0 || s.batch < 0)
    return Status::Error(Code::kCorrupt, "cache stream: negative shape");
  if (s.offset > 0 && (s.key_dim == 0 || s.value_dim == 0 || s.heads == 0 || s.batch == 0 ||
                       (IsQuantized(s.dtype) && (s.key_dim % kQuantBlockElems != 0 ||
                                                 s.value_dim % kQuantBlockElems != 0))))
    return Status::Error(Code::kCorrupt, "cache stream: bad sequence cache shape");
  size_t rows = 0, kwant = 0, vwant = 0;
  if (!MulAdd(static_cast<size_t>(s.len), static_cast<size_t>(s.heads), 0, &rows) ||
      !MulAdd(rows, static_cast<size_t>(s.batch), 0, &rows) ||
      !MulAdd(rows, RowBytes(s.dtype, s.key_dim), 0, &kwant) ||
      !MulAdd(rows, RowBytes(s.dtype, s.value_dim), 0, &vwant) || kb != kwant || vb != vwant ||
      kb > r.left() || vb != r.left() - kb) {
    return Status::Error(Code::kCorrupt,
                         "cache stream: %llu key and %llu value bytes disagree with the shapes",
                         static_cast<unsigned long long>(kb), static_cast<unsigned long long>(vb));
  }
  const uint8_t* kp = nullptr;
  const uint8_t* vp = nullptr;
  if (!r.Bytes(kb, &kp) || !r.Bytes(vb, &vp)) return Truncated("the rows");
  s.keys.assign(kp, kp + kb);
  s.values.assign(vp, vp + vb);
  SwapToOrFromStreamOrder(s.keys.data(), s.keys.size(), s.dtype);
  SwapToOrFromStreamOrder(s.values.data(), s.values.size(), s.dtype);
  return cache->RestoreState(s);
}

Status SaveSequenceCacheFile(const SequenceCache& cache, const char* path) {
  return SaveToFile(path, [&](std::vector<uint8_t>* out) { return SaveSequenceCache(cache, out); });
}

Status LoadSequenceCacheFile(const char* path, SequenceCache* cache) {
  if (cache == nullptr)
    return Status::Error(Code::kInvalidArgument, "LoadSequenceCacheFile: null cache");
  return LoadFromFile(
      path, [&](std::span<const uint8_t> bytes) { return LoadSequenceCache(bytes, cache); });
}

}  // namespace kv
