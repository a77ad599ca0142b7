// RopeShiftFn: validates the view a cache hands over, then calls kernels::RopeShift.
#include "core/rope_shift.h"

#include <cmath>
#include <cstdint>

#include "kernels/rope.h"
#include "layouts/dtype.h"

namespace kv {
namespace {

Status Invalid(const char* what) {
  return Status::Error(Code::kInvalidArgument, "RopeShiftFn: %s", what);
}

Status CheckShift(const TensorView& key, std::span<const int32_t> shift,
                  const kernels::RopeParams& p) {
  if (!IsValidDType(key.dtype)) return Invalid("invalid key dtype");
  if (!std::isfinite(p.base) || !(p.base > 0.0f))
    return Invalid("base must be finite and positive");
  if (!std::isfinite(p.freq_scale)) return Invalid("freq_scale must be finite");
  if (key.ne[0] < 1 || key.ne[1] < 1 || key.ne[2] < 0 || key.ne[3] != 1) {
    return Invalid("key must be [head_dim, kv_heads, n]");
  }
  if (static_cast<int64_t>(shift.size()) != key.ne[2]) {
    return Status::Error(Code::kInvalidArgument, "RopeShiftFn: %zu deltas for %lld rows",
                         shift.size(), static_cast<long long>(key.ne[2]));
  }
  if (IsQuantized(key.dtype) && key.ne[0] % kQuantBlockElems != 0) {
    return Invalid("quantized head_dim must be a multiple of 32");
  }
  if (!HasPackedRows(key)) return Invalid("key rows must be packed along dim 0");
  const int64_t dims = p.dims > 0 ? p.dims : key.ne[0];
  if (p.dims < 0 || dims % 2 != 0 || dims > key.ne[0]) {
    return Status::Error(Code::kInvalidArgument,
                         "RopeShiftFn: dims %lld must be even and <= head_dim %lld",
                         static_cast<long long>(dims), static_cast<long long>(key.ne[0]));
  }
  if (key.ne[2] > 0 && key.data == nullptr) return Invalid("key data is null");
  return Status::Ok();
}

}  // namespace

ShiftFn RopeShiftFn(float base, float freq_scale, int dims, bool neox) {
  kernels::RopeParams params;
  params.dims = dims;
  params.base = base;
  params.freq_scale = freq_scale;
  params.neox = neox;
  return [params](int /*layer*/, TensorView key, std::span<const int32_t> shift) -> Status {
    KV_RETURN_IF_ERROR(CheckShift(key, shift, params));
    kernels::RopeShift(key, shift, params);
    return Status::Ok();
  };
}

}  // namespace kv
