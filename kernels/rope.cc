// TEMPORARY: forwards to the scalar reference until the Highway translation unit replaces this file.
#include "kernels/rope.h"

namespace kv::kernels {
void RopeShift(const TensorView& key, std::span<const int32_t> delta, const RopeParams& params) {
  RopeShiftRef(key, delta, params);
}
}  // namespace kv::kernels
