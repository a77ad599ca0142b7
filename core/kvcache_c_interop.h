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

inline History HistoryFromC(const kvc_history& h) {
  return {ViewFromC(h.k), ViewFromC(h.v), ViewFromC(h.mask), static_cast<MaskIndex*>(h.mask_index)};
}

inline kvc_history HistoryToC(const History& h) {
  return {ViewToC(h.k), ViewToC(h.v), ViewToC(h.mask), h.mask_index};
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
