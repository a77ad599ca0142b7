// Scalar references for kernels/convert.h: plain loops over layouts/quant.h and layouts/dtype.h.
#include <vector>

#include "kernels/convert.h"
#include "layouts/quant.h"

namespace kv::kernels {

void ConvertRowRef(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  std::vector<float> tmp(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tmp[i] = LoadAsF32(src, src_dtype, i);
  StoreRowFromF32(tmp.data(), n, dst_dtype, dst);
}

void RowToF32Ref(const void* src, DType src_dtype, float* dst, int64_t n) {
  LoadRowAsF32(src, n, src_dtype, dst);
}

void ScatterToCellsRef(const TensorView& src, std::span<const int32_t> cells,
                       const CellBlockLayout& layout, void* block) {
  const int64_t d = layout.head_dim;
  std::vector<float> row(static_cast<size_t>(d));
  char* base = static_cast<char*>(block);
  for (size_t t = 0; t < cells.size(); ++t) {
    for (int32_t h = 0; h < layout.kv_heads; ++h) {
      const char* s = static_cast<const char*>(src.data) + h * src.nb[1] + t * src.nb[2];
      for (int64_t i = 0; i < d; ++i) {
        const float x = LoadAsF32(s + i * src.nb[0], src.dtype, 0);
        row[i] = x;
      }
      if (layout.cells_fastest) {
        for (int64_t i = 0; i < d; ++i) {
          StoreFromF32(base + CellsFastestOffset(layout, cells[t], h, static_cast<int32_t>(i)),
                       layout.dtype, 0, row[i]);
        }
      } else {
        StoreRowFromF32(row.data(), d, layout.dtype, base + CellRowOffset(layout, cells[t], h));
      }
    }
  }
}

void ViewToF32Ref(const TensorView& v, float* out) {
  const int64_t n0 = v.ne[0];
  std::vector<float> row(static_cast<size_t>(n0));
  size_t o = 0;
  for (int64_t i3 = 0; i3 < v.ne[3]; ++i3) {
    for (int64_t i2 = 0; i2 < v.ne[2]; ++i2) {
      for (int64_t i1 = 0; i1 < v.ne[1]; ++i1) {
        const char* r = static_cast<const char*>(RowPtr(v, i1, i2, i3));
        if (IsQuantized(v.dtype)) {
          LoadRowAsF32(r, n0, v.dtype, out + o);
        } else {
          for (int64_t i0 = 0; i0 < n0; ++i0) out[o + i0] = LoadAsF32(r + i0 * v.nb[0], v.dtype, 0);
        }
        o += static_cast<size_t>(n0);
      }
    }
  }
}

}  // namespace kv::kernels
