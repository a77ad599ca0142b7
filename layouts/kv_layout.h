// Where a K or V row lives: the index math of every cache block, and the views built over them.
// Nothing else in the library computes an offset into a block.
//
// Cell blocks (causal family; one per layer for K and one for V):
//   plain, head-major:     block[kv_head][cell][head_dim]
//     row (head h, cell c) at h * head_stride + c * row_stride.
//   cells fastest (permuted V; float dtypes only): block[kv_head][dim][cell]
//     element (h, d, c) at h * head_stride + d * row_stride + c * elem_bytes.
// Head-major keeps each KV head's history one contiguous stream, which the attention kernels read
// front to back (measured on the established CPU flash-attention kernel: ~5x faster than cell-major
// at 32768 cells). Every head block starts 64-byte aligned. Float rows are padded to 64 bytes
// (unaligned rows ran up to 4.5x slower there); quantized rows are kept packed: their 34/18-byte
// blocks are never aligned anyway, and padding a 136-byte q8_0 row to 192 would cost 41% more
// traffic, which is what quantizing was meant to save.
//
// Sequence blocks (growing/rotating caches), [B, H, T, D] in the seeds' notation:
//   block[b][h][t][d], capacity T tokens; TensorView ne = {D, T, H, B}.
#ifndef KVCACHE_LAYOUTS_KV_LAYOUT_H_
#define KVCACHE_LAYOUTS_KV_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

namespace kv {

inline constexpr size_t kBlockAlign = 64;

constexpr size_t RoundUp(size_t n, size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// Bytes between consecutive rows of `row_bytes`: float rows padded to 64 bytes, quantized rows
// packed (see the file comment for why).
constexpr size_t RowStride(DType dtype, size_t row_bytes) {
  return IsQuantized(dtype) ? row_bytes : RoundUp(row_bytes, kBlockAlign);
}

struct CellBlockLayout {
  DType dtype = DType::kF32;
  int32_t head_dim = 0;
  int32_t kv_heads = 0;
  int32_t cells = 0;
  bool cells_fastest = false;  // permuted V
  // plain: bytes of one (head, cell) row; cells fastest: bytes of one (head, dim) line of cells
  size_t row_bytes = 0;
  size_t row_stride = 0;   // plain: bytes between cells of one head; cells fastest: between dims
  size_t head_stride = 0;  // bytes between heads (a multiple of 64)
  size_t bytes = 0;        // the whole block (a multiple of 64)
};

// Preconditions: head_dim > 0, kv_heads > 0, cells > 0; quantized: head_dim % 32 == 0 and not
// cells_fastest. Checked by the caller (core validates before it builds a layout).
inline CellBlockLayout MakeCellBlockLayout(DType dtype, int32_t head_dim, int32_t kv_heads,
                                           int32_t cells, bool cells_fastest) {
  CellBlockLayout l;
  l.dtype = dtype;
  l.head_dim = head_dim;
  l.kv_heads = kv_heads;
  l.cells = cells;
  l.cells_fastest = cells_fastest;
  if (cells_fastest) {
    l.row_bytes = BlockBytes(dtype) * static_cast<size_t>(cells);
    l.row_stride = RoundUp(l.row_bytes, kBlockAlign);
    l.head_stride = l.row_stride * static_cast<size_t>(head_dim);
  } else {
    l.row_bytes = RowBytes(dtype, head_dim);
    l.row_stride = RowStride(dtype, l.row_bytes);
    l.head_stride = RoundUp(l.row_stride * static_cast<size_t>(cells), kBlockAlign);
  }
  l.bytes = l.head_stride * static_cast<size_t>(kv_heads);
  return l;
}

// MakeCellBlockLayout(...).bytes computed with every product checked: false when the count does
// not fit in size_t. Shapes within the per-field limits core accepts (head_dim < 2^25, kv_heads <=
// 65536, cells < 2^30) can exceed it: [2^25 - 1, 65536] f32 rows over 2^21 cells are 2^64 bytes.
// Same preconditions as MakeCellBlockLayout.
inline bool CellBlockBytesFit(DType dtype, int32_t head_dim, int32_t kv_heads, int32_t cells,
                              bool cells_fastest, size_t* bytes) {
  // The strides themselves are small (int32 fields); their products are what can overflow.
  const size_t stride = cells_fastest
                            ? RoundUp(BlockBytes(dtype) * static_cast<size_t>(cells), kBlockAlign)
                            : RowStride(dtype, RowBytes(dtype, head_dim));
  const size_t lines = static_cast<size_t>(cells_fastest ? head_dim : cells);
  size_t head = 0;
  if (__builtin_mul_overflow(stride, lines, &head) || head > SIZE_MAX - kBlockAlign) return false;
  return !__builtin_mul_overflow(RoundUp(head, kBlockAlign), static_cast<size_t>(kv_heads), bytes);
}

// Byte offset of row (head, cell) in a plain block.
inline size_t CellRowOffset(const CellBlockLayout& l, int32_t cell, int32_t head) {
  return static_cast<size_t>(head) * l.head_stride + static_cast<size_t>(cell) * l.row_stride;
}

// Byte offset of element (head, dim, cell) in a cells-fastest block.
inline size_t CellsFastestOffset(const CellBlockLayout& l, int32_t cell, int32_t head,
                                 int32_t dim) {
  return static_cast<size_t>(head) * l.head_stride + static_cast<size_t>(dim) * l.row_stride +
         static_cast<size_t>(cell) * BlockBytes(l.dtype);
}

// The view of cells [first, first + n) of a block, as Get returns it:
//   plain:         ne = {head_dim, kv_heads, n}
//   cells fastest: ne = {n, head_dim, kv_heads}
inline TensorView CellBlockView(const CellBlockLayout& l, void* block, int32_t first, int32_t n) {
  TensorView v;
  v.dtype = l.dtype;
  if (l.cells_fastest) {
    v.data = static_cast<char*>(block) + CellsFastestOffset(l, first, 0, 0);
    v.ne[0] = n;
    v.ne[1] = l.head_dim;
    v.ne[2] = l.kv_heads;
    v.nb[0] = BlockBytes(l.dtype);
    v.nb[1] = l.row_stride;
    v.nb[2] = l.head_stride;
  } else {
    v.data = static_cast<char*>(block) + CellRowOffset(l, first, 0);
    v.ne[0] = l.head_dim;
    v.ne[1] = l.kv_heads;
    v.ne[2] = n;
    v.nb[0] = BlockBytes(l.dtype);
    v.nb[1] = l.head_stride;
    v.nb[2] = l.row_stride;
  }
  v.ne[3] = 1;
  v.nb[3] = l.bytes;
  return v;
}

// [B, H, T, D] block of the growing/rotating caches; `capacity` tokens per (b, h).
struct SequenceBlockLayout {
  DType dtype = DType::kF32;
  int32_t head_dim = 0;   // D
  int32_t heads = 0;      // H
  int32_t batch = 0;      // B
  int32_t capacity = 0;   // T held at most
  size_t row_bytes = 0;   // one token's D elements
  size_t row_stride = 0;  // between tokens (packed for quantized, else padded to 64 like cell rows)
  size_t head_stride = 0;
  size_t batch_stride = 0;
  size_t bytes = 0;
};

inline SequenceBlockLayout MakeSequenceBlockLayout(DType dtype, int32_t head_dim, int32_t heads,
                                                   int32_t batch, int32_t capacity) {
  SequenceBlockLayout l;
  l.dtype = dtype;
  l.head_dim = head_dim;
  l.heads = heads;
  l.batch = batch;
  l.capacity = capacity;
  l.row_bytes = RowBytes(dtype, head_dim);
  l.row_stride = RowStride(dtype, l.row_bytes);
  l.head_stride = RoundUp(l.row_stride * static_cast<size_t>(capacity), kBlockAlign);
  l.batch_stride = l.head_stride * static_cast<size_t>(heads);
  l.bytes = l.batch_stride * static_cast<size_t>(batch);
  return l;
}

inline size_t SequenceRowOffset(const SequenceBlockLayout& l, int32_t b, int32_t h, int32_t t) {
  return static_cast<size_t>(b) * l.batch_stride + static_cast<size_t>(h) * l.head_stride +
         static_cast<size_t>(t) * l.row_stride;
}

// Bytes of `count` consecutive tokens of one (b, h), padding included: the run starting at
// SequenceRowOffset(l, b, h, t) is one memmove of this many bytes (rows of a head are back to
// back).
inline size_t SequenceRunBytes(const SequenceBlockLayout& l, int32_t count) {
  return static_cast<size_t>(count) * l.row_stride;
}

// View of tokens [first, first + n) of every (b, h): ne = {D, n, H, B}.
inline TensorView SequenceBlockView(const SequenceBlockLayout& l, void* block, int32_t first,
                                    int32_t n) {
  TensorView v;
  v.data = static_cast<char*>(block) + SequenceRowOffset(l, 0, 0, first);
  v.dtype = l.dtype;
  v.ne[0] = l.head_dim;
  v.ne[1] = n;
  v.ne[2] = l.heads;
  v.ne[3] = l.batch;
  v.nb[0] = BlockBytes(l.dtype);
  v.nb[1] = l.row_stride;
  v.nb[2] = l.head_stride;
  v.nb[3] = l.batch_stride;
  return v;
}

}  // namespace kv

#endif  // KVCACHE_LAYOUTS_KV_LAYOUT_H_
