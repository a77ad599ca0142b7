// TEMPORARY: forwards to the scalar references until the Highway translation unit replaces this file.
#include "kernels/convert.h"

namespace kv::kernels {
void ConvertRow(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  ConvertRowRef(src, src_dtype, dst, dst_dtype, n);
}
void RowToF32(const void* src, DType src_dtype, float* dst, int64_t n) { RowToF32Ref(src, src_dtype, dst, n); }
void ScatterToCells(const TensorView& src, std::span<const int32_t> cells, const CellBlockLayout& layout,
                    void* block) {
  ScatterToCellsRef(src, cells, layout, block);
}
void ViewToF32(const TensorView& v, float* out) { ViewToF32Ref(v, out); }
}  // namespace kv::kernels
