// Per-target f16 -> f32 shared by the kernels (kernels/convert.cc, kernels/attention*.cc).
//
// Why a software expansion: Highway 1.0.3's PromoteTo from float16_t is exact only where the CPU
// has F16C (AVX2 and AVX-512 here, and there it quiets signaling NaNs). On SSSE3, SSE4 and SCALAR
// it is emulated and reads exponent 31 as a finite exponent, so a stored inf comes out as
// 2^16 * (1 + m / 1024). F16BitsToF32 gives exactly F16ToF32's values (layouts/dtype.h) on every
// target, NaN payloads included: integer operations plus one exact multiply for subnormals.
//
// Include inside a Highway per-target translation unit, after hwy/highway.h.
#if defined(KVCACHE_KERNELS_F16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVCACHE_KERNELS_F16_INL_H_
#undef KVCACHE_KERNELS_F16_INL_H_
#else
#define KVCACHE_KERNELS_F16_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {

// f16 bits, zero-extended to the u32 lanes of h, to f32 exactly as F16ToF32.
template <class DF>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<DF> F16BitsToF32(
    DF df, hwy::HWY_NAMESPACE::Vec<hwy::HWY_NAMESPACE::RebindToUnsigned<DF>> h) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto a = hn::And(h, hn::Set(du, 0x7FFFu));
  const auto shifted = hn::ShiftLeft<13>(a);
  const auto normal = hn::Add(shifted, hn::Set(du, 0x38000000u));
  const auto infnan = hn::Or(shifted, hn::Set(du, 0x7F800000u));
  // Zero or subnormal: mant * 2^-24, exact in f32.
  const auto sub = hn::BitCast(
      du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, a)), hn::Set(df, 1.0f / 16777216.0f)));
  const auto ai = hn::BitCast(di, a);
  auto bits = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7BFF))), infnan, normal);
  bits = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, hn::Set(di, 0x0400))), sub, bits);
  return hn::BitCast(df, hn::Or(sign, bits));
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#endif  // KVCACHE_KERNELS_F16_INL_H_
