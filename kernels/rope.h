// RoPE re-rotation of stored K rows by per-row position deltas (context shift).
//
// Rotating a RoPE'd key from position p to p + delta is a rotation by delta * theta_i of each pair:
//   normal: pairs (2i, 2i + 1); NeoX: pairs (i, i + dims / 2); i < dims / 2,
//   theta_i = freq_scale * base^(-2i / dims).
// Angles are reduced in double precision so large deltas stay accurate; the rotation has unit
// magnitude (cos^2 + sin^2 = 1 to f32 rounding). Dims beyond `dims` are left as they are.
#ifndef KVCACHE_KERNELS_ROPE_H_
#define KVCACHE_KERNELS_ROPE_H_

#include <cstdint>
#include <span>

#include "layouts/tensor_view.h"

namespace kv::kernels {

struct RopeParams {
  int32_t dims = 0;  // rotated dims per head (even); 0: all of head_dim
  float base = 10000.0f;
  float freq_scale = 1.0f;
  bool neox = false;
};

// key: [head_dim, kv_heads, n] in any storage dtype (rows packed along dim 0; any nb[1], nb[2]).
// Row i (every head) is rotated by delta[i] positions in place; delta 0 leaves it untouched.
// Quantized rows are dequantized, rotated and re-quantized.
// Precondition: delta.size() == key.ne[2].
void RopeShift(const TensorView& key, std::span<const int32_t> delta, const RopeParams& params);
void RopeShiftRef(const TensorView& key, std::span<const int32_t> delta, const RopeParams& params);

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_ROPE_H_
