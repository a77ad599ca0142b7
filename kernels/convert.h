// Convert, scatter and gather kernels: how rows get into and out of cache blocks.
//
// Every function has a scalar reference (suffix Ref) that the Highway-dispatched version must
// match: bit-exactly for conversions to f32/f16/bf16 (round to nearest even) and for q8_0/q4_0
// (llama.cpp's reference quantizers, layouts/quant.h). The dispatched versions pick the best target
// once per call and loop over many rows inside it.
#ifndef KVCACHE_KERNELS_CONVERT_H_
#define KVCACHE_KERNELS_CONVERT_H_

#include <cstdint>
#include <span>

#include "layouts/dtype.h"
#include "layouts/kv_layout.h"
#include "layouts/tensor_view.h"

namespace kv::kernels {

// n contiguous elements of src (f32, f16 or bf16) to dst in any dtype.
// Precondition: IsFloatDType(src_dtype); quantized dst: n % 32 == 0.
void ConvertRow(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);
void ConvertRowRef(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);

// n contiguous elements of src in any dtype to f32. Quantized: n % 32 == 0.
void RowToF32(const void* src, DType src_dtype, float* dst, int64_t n);
void RowToF32Ref(const void* src, DType src_dtype, float* dst, int64_t n);

// Put's write: src is [head_dim, kv_heads, n] (f32/f16/bf16, any strides; nb[0] may differ from the
// element size), token i goes to cell cells[i] of `block`, every head. Plain or cells-fastest
// layout. Preconditions: src.ne[0] == layout.head_dim, src.ne[1] == layout.kv_heads,
// src.ne[2] == cells.size(), every cell in [0, layout.cells); cells need not be contiguous or
// sorted. A call that writes >= 256 KiB of float rows that are whole, 64-byte aligned cache lines
// writes them with non-temporal stores (no read for ownership; the rows leave the caches), ordered
// by a store fence before it returns. Smaller calls (decode) use plain stores.
void ScatterToCells(const TensorView& src, std::span<const int32_t> cells,
                    const CellBlockLayout& layout, void* block);
void ScatterToCellsRef(const TensorView& src, std::span<const int32_t> cells,
                       const CellBlockLayout& layout, void* block);

// Any view (any dtype, any strides; up to 4 dims) to a contiguous f32 array of NumElements(v),
// ne[0] fastest. For tests, the reference model and the RoPE shift.
void ViewToF32(const TensorView& v, float* out);
void ViewToF32Ref(const TensorView& v, float* out);

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_CONVERT_H_
