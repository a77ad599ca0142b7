// RopeShiftFn: a ready-made ShiftFn that re-rotates RoPE'd keys with kernels::RopeShift.
//
//   auto cache = kv::NewCausalCache(kv::RopeShiftFn(/*base=*/10000.0f));
//
// Rotating a key from position p to p + delta rotates each pair by delta * theta_i with
// theta_i = freq_scale * base^(-2i / dims): normal style pairs (2i, 2i + 1), NeoX style
// (i, i + dims / 2). dims = 0 rotates all of head_dim; dims beyond `dims` are left as they are.
// Works in place on any storage dtype (quantized rows are dequantized, rotated, re-quantized).
#ifndef KVCACHE_CORE_ROPE_SHIFT_H_
#define KVCACHE_CORE_ROPE_SHIFT_H_

#include "core/types.h"

namespace kv {

// The returned function checks each call's view and returns kInvalidArgument, changing nothing,
// when: the dtype is invalid; key is not [head_dim, kv_heads, n] (ne[3] != 1, head_dim < 1,
// kv_heads < 1, n < 0); rows are not packed along dim 0; a quantized head_dim is not a multiple of
// 32; shift.size() != n; data is null with n > 0; the rotated dims are odd, negative or above
// head_dim; base is not finite and positive, or freq_scale is not finite. It ignores `layer`.
ShiftFn RopeShiftFn(float base, float freq_scale = 1.0f, int dims = 0, bool neox = false);

}  // namespace kv

#endif  // KVCACHE_CORE_ROPE_SHIFT_H_
