// TensorView: a non-owning, strided view of up to 4 dimensions, in ggml order (ne[0] is fastest).
//
// For quantized dtypes the unit along dim 0 is a block of 32 elements: nb[0] is the bytes of one
// block and a row of ne[0] elements is its blocks back to back (nb[1] is a row's bytes when the
// view is contiguous).
#ifndef KVCACHE_LAYOUTS_TENSOR_VIEW_H_
#define KVCACHE_LAYOUTS_TENSOR_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "layouts/dtype.h"

namespace kv {

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t ne[4] = {1, 1, 1, 1};  // elements per dimension
  size_t nb[4] = {0, 0, 0, 0};   // byte stride per dimension
};

// A contiguous view of `ne` (1 to 4 dimensions; missing ones are 1). For quantized dtypes ne[0]
// must be a multiple of 32 (not checked here: views are plain data; consumers validate).
inline TensorView MakeView(void* data, DType dtype, std::initializer_list<int64_t> ne) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  int i = 0;
  for (int64_t n : ne) {
    if (i == 4) break;
    v.ne[i++] = n;
  }
  v.nb[0] = BlockBytes(dtype);
  v.nb[1] = RowBytes(dtype, v.ne[0]);
  v.nb[2] = v.nb[1] * static_cast<size_t>(v.ne[1]);
  v.nb[3] = v.nb[2] * static_cast<size_t>(v.ne[2]);
  return v;
}

inline int64_t NumElements(const TensorView& v) { return v.ne[0] * v.ne[1] * v.ne[2] * v.ne[3]; }

// The bytes of a contiguous tensor of shape ne in dtype, counted in 64 bits with every product
// checked: false for a negative dimension or a count that does not fit in size_t. Use it before
// sizing anything from a shape that nothing bounds: a view may broadcast (stride 0), so a view of
// a few bytes can declare any shape, and a stream any (a dimension of 2^32 + 8 is 8 in a 32-bit
// size_t). Where it returns true, NumElements of that shape does not overflow either.
// Precondition for quantized dtypes: ne[0] % 32 == 0.
inline bool ContiguousBytesFit(DType dtype, const int64_t ne[4], size_t* bytes) {
  uint64_t n = BlockBytes(dtype);
  for (int d = 0; d < 4; ++d) {
    const int64_t units = d == 0 ? ne[0] / BlockElems(dtype) : ne[d];
    if (units < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(units), &n)) return false;
  }
  if (n > SIZE_MAX) return false;
  *bytes = static_cast<size_t>(n);
  return true;
}

// True when dim 0 is packed (elements, or blocks for quantized dtypes, back to back).
inline bool HasPackedRows(const TensorView& v) { return v.nb[0] == BlockBytes(v.dtype); }

// Address of row (i1, i2, i3), i.e. of element 0 along dim 0.
inline void* RowPtr(const TensorView& v, int64_t i1, int64_t i2 = 0, int64_t i3 = 0) {
  return static_cast<char*>(v.data) + static_cast<size_t>(i1) * v.nb[1] +
         static_cast<size_t>(i2) * v.nb[2] + static_cast<size_t>(i3) * v.nb[3];
}

// Rows [r0, r1) along dim 1 of v (a batch's rows of q or out, or of the mask [L, B]): the same
// strides, data moved to row r0, ne[1] = r1 - r0. A view without data (no mask) stays as it is.
inline TensorView RowsView(const TensorView& v, int64_t r0, int64_t r1) {
  TensorView rows = v;
  if (v.data == nullptr) return rows;
  rows.data = static_cast<char*>(v.data) + static_cast<size_t>(r0) * v.nb[1];
  rows.ne[1] = r1 - r0;
  return rows;
}

// Element (i0, i1) of a float-typed view (f32, f16 or bf16) as f32; any alignment.
inline float ElementAsF32(const TensorView& v, int64_t i0, int64_t i1) {
  const char* p = static_cast<const char*>(v.data) + static_cast<size_t>(i1) * v.nb[1] +
                  static_cast<size_t>(i0) * v.nb[0];
  if (v.dtype == DType::kF32) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return v.dtype == DType::kF16 ? F16ToF32(h) : BF16ToF32(h);
}

}  // namespace kv

#endif  // KVCACHE_LAYOUTS_TENSOR_VIEW_H_
