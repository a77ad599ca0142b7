// Conversions between the C API's plain structs (core/kvcache_c.h) and the C++ views, for C++ code
// that uses both APIs (and for the C API's implementation). Field for field, no allocation. Also
// the C++ object behind a C cache handle.
#ifndef KVCACHE_CORE_KVCACHE_C_INTEROP_H_
#define KVCACHE_CORE_KVCACHE_C_INTEROP_H_

#include <cstring>

#include "core/cache.h"
#include "core/kvcache_c.h"
#include "core/types.h"
#include "layouts/tensor_view.h"

namespace kv {

// A C dtype outside kv::DType's uint8_t range maps to 255, an invalid DType that every C++ call
// rejects (kInvalidArgument) instead of a conversion with undefined behaviour.
inline DType DTypeFromC(kvc_dtype d) {
  const int v = static_cast<int>(d);
  return static_cast<DType>(v >= 0 && v < 255 ? v : 255);
}

inline TensorView ViewFromC(const kvc_tensor& t) {
  TensorView v;
  v.data = t.data;
  v.dtype = DTypeFromC(t.dtype);
  static_assert(sizeof(v.ne) == sizeof(t.ne) && sizeof(v.nb) == sizeof(t.nb));
  std::memcpy(v.ne, t.ne, sizeof(v.ne));
  std::memcpy(v.nb, t.nb, sizeof(v.nb));
  return v;
}

inline kvc_tensor ViewToC(const TensorView& v) {
  kvc_tensor t;
  t.data = v.data;
  t.dtype = static_cast<kvc_dtype>(static_cast<int>(v.dtype));
  std::memcpy(t.ne, v.ne, sizeof(t.ne));
  std::memcpy(t.nb, v.nb, sizeof(t.nb));
  return t;
}

static_assert(KVC_V_AUTO == static_cast<int>(VLayout::kAuto) &&
              KVC_V_PLAIN == static_cast<int>(VLayout::kPlain) &&
              KVC_V_PERMUTED == static_cast<int>(VLayout::kPermuted));

// C code written before kvc_history had v_layout fills the struct field by field and leaves it
// indeterminate: a layout is taken only when it is one of the two and v's shape fits it, anything
// else is KVC_V_AUTO. So such code reads V as before, and kvc_get's histories as they are.
inline VLayout VLayoutFromC(const kvc_history& h) {
  const int32_t layout = h.v_layout;
  const bool fits_plain = h.v.ne[1] == h.k.ne[1] && h.v.ne[2] == h.k.ne[2];
  const bool fits_permuted = h.v.ne[0] == h.k.ne[2] && h.v.ne[2] == h.k.ne[1];
  if (layout == KVC_V_PLAIN && fits_plain) return VLayout::kPlain;
  if (layout == KVC_V_PERMUTED && fits_permuted) return VLayout::kPermuted;
  return VLayout::kAuto;
}

inline History HistoryFromC(const kvc_history& h) {
  return {ViewFromC(h.k), ViewFromC(h.v), ViewFromC(h.mask), static_cast<MaskIndex*>(h.mask_index),
          VLayoutFromC(h)};
}

inline kvc_history HistoryToC(const History& h) {
  return {ViewToC(h.k), ViewToC(h.v), ViewToC(h.mask), h.mask_index,
          static_cast<int32_t>(h.v_layout)};
}

// The C++ object behind a C handle, which keeps owning it (valid until the handle is freed):
// C++ code handed a kvc_cache can use the C++ API on it. nullptr for a NULL handle, and from the
// variant getters for a handle of another kind. Defined in core/c_api.cc.
Cache* CacheFromC(kvc_cache* cache);
CausalCache* CausalFromC(kvc_cache* cache);
EncoderCache* EncoderFromC(kvc_cache* cache);
WrapperCache* WrapperFromC(kvc_cache* cache);

}  // namespace kv

#endif  // KVCACHE_CORE_KVCACHE_C_INTEROP_H_
