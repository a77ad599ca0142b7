// TEMPORARY: forwards to the scalar reference until the Highway translation unit replaces this file.
#include "kernels/mask.h"

namespace kv::kernels {
void BuildMask(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules, DType mask_dtype,
               void* out) {
  BuildMaskRef(cells, tokens, rules, mask_dtype, out);
}
}  // namespace kv::kernels
