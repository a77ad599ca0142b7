// Highway per-target translation unit for kernels/convert.h: ConvertRow, RowToF32, ScatterToCells
// and ViewToF32. Each exported function dispatches once per call and loops over every row inside.
//
// Exactness (tested bit-for-bit against kernels/convert_ref.cc on every compiled target):
// - f32 -> f16: x86 F16C (AVX2, AVX3) converts with round to nearest even like F32ToF16, but keeps
//   NaN payload bits that F32ToF16 drops, so NaN lanes are rewritten to sign | 0x7E00. SSE4 and
//   SCALAR have no F16C and Highway 1.0.3's software DemoteTo truncates and mishandles inf/NaN, so
//   those targets use F16FromF32Soft below (integer ops plus one exact f32 add for subnormals).
// - f16 -> f32: F16C's VCVTPH2PS quiets signaling NaNs while F16ToF32 keeps them, so every target
//   uses the integer expansion F16ToF32Soft (exact: subnormals are mant * 2^-24).
// - bf16: round to nearest even with integer ops (Highway 1.0.3's DemoteTo truncates).
// - q8_0 / q4_0: the same f32 operations as layouts/quant.h in the same order. The product x * id
//   goes through KeepRounded() (kernels/fp_barrier-inl.h) so that the compiler cannot contract it
//   with the following add/sub into an FMA (GCC contracts intrinsics on FMA targets even in ISO
//   mode), which would change codes.
//
// Memory traffic: ConvertRow reads n * src_size bytes and writes RowBytes(dst, n); nothing else.
// No heap allocation: strided sources and row tails go through small stack buffers.
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/convert.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/convert.h"
#include "kernels/fp_barrier-inl.h"
#include "layouts/quant.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::CappedTag<float, 32>;  // q8_0/q4_0 blocks are 32 floats: never wider than a block
using DU32 = hn::RebindToUnsigned<DF>;
using DI32 = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;

// ---- f16 / bf16 lane conversions -----------------------------------------------------------

// f16 bits (zero-extended to u32 lanes) to f32, exactly as F16ToF32.
HWY_INLINE hn::Vec<DF> F16ToF32Soft(hn::Vec<DU32> h) {
  const DF df;
  const DU32 du;
  const DI32 di;
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

// f32 to f16 bits in u32 lanes, exactly as F32ToF16 (round to nearest even, overflow to inf,
// subnormals rounded, NaN -> sign | 0x7E00).
template <class D = DF>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> F16FromF32Soft(hn::Vec<D> v) {
  const D df;
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto x = hn::BitCast(du, v);
  const auto sign = hn::And(hn::ShiftRight<16>(x), hn::Set(du, 0x8000u));
  const auto abs = hn::And(x, hn::Set(du, 0x7FFFFFFFu));
  const auto absi = hn::BitCast(di, abs);
  // Normal range: rebias and round the 13 dropped bits to nearest even; >= 65520 saturates to inf.
  auto r = hn::Sub(abs, hn::Set(du, 0x38000000u));
  r = hn::Add(r, hn::Add(hn::Set(du, 0xFFFu), hn::And(hn::ShiftRight<13>(r), hn::Set(du, 1u))));
  const auto normal = hn::Min(hn::ShiftRight<13>(r), hn::Set(du, 0x7C00u));
  // Below 2^-14: adding 0.5f puts the f16 subnormal unit (2^-24) at the last mantissa bit of the
  // sum, so the f32 add (round to nearest even) rounds exactly as F32ToF16 does.
  const auto magic = hn::Set(du, 0x3F000000u);
  const auto sub =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, abs), hn::BitCast(df, magic))), magic);
  const auto infnan = hn::IfThenElse(hn::RebindMask(du, hn::Gt(absi, hn::Set(di, 0x7F800000))),
                                     hn::Set(du, 0x7E00u), hn::Set(du, 0x7C00u));
  auto h = hn::IfThenElse(hn::RebindMask(du, hn::Lt(absi, hn::Set(di, 0x38800000))), sub, normal);
  h = hn::IfThenElse(hn::RebindMask(du, hn::Gt(absi, hn::Set(di, 0x7F7FFFFF))), infnan, h);
  return hn::Or(sign, h);
}

// bf16 round to nearest even; NaN -> (bits >> 16) | 0x40 (quiet), as F32ToBF16. Result in u32
// lanes.
HWY_INLINE hn::Vec<DU32> BF16FromF32(hn::Vec<DF> v) {
  const DU32 du;
  const DI32 di;
  const auto x = hn::BitCast(du, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(x), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(x, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto quiet = hn::Or(hn::ShiftRight<16>(x), hn::Set(du, 0x40u));
  const auto absi = hn::BitCast(di, hn::And(x, hn::Set(du, 0x7FFFFFFFu)));
  return hn::IfThenElse(hn::RebindMask(du, hn::Gt(absi, hn::Set(di, 0x7F800000))), quiet, rounded);
}

// Narrows u32 lanes holding values <= 0xFFFF and stores them as u16.
template <class DU = DU32>
HWY_INLINE void StoreU16(hn::Vec<DU> v, uint16_t* p) {
  const hn::Rebind<uint16_t, DU> d16;
  const hn::RebindToSigned<DU> di;
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, v)), d16, p);
}

// ---- element types: load Lanes(DF) elements as f32, store f32 lanes ----------------------------

struct F32T {
  using T = float;
  static constexpr DType kDType = DType::kF32;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) { return hn::LoadU(DF(), p); }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) { hn::StoreU(v, DF(), p); }
};

struct F16T {
  using T = uint16_t;
  static constexpr DType kDType = DType::kF16;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) {
    return F16ToF32Soft(hn::PromoteTo(DU32(), hn::LoadU(DU16(), p)));
  }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
    // F16C: round to nearest even, overflow to inf, subnormals exact. Only NaN payloads differ.
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hn::Rebind<int16_t, DF> di16;
    const auto h = hn::BitCast(di16, hn::DemoteTo(dh, v));
    const auto is_nan = hn::Gt(hn::And(h, hn::Set(di16, 0x7FFF)), hn::Set(di16, 0x7C00));
    const auto fixed =
        hn::IfThenElse(is_nan, hn::And(h, hn::Set(di16, static_cast<int16_t>(0xFE00))), h);
    hn::StoreU(hn::BitCast(DU16(), fixed), DU16(), p);
#else
    StoreU16(F16FromF32Soft(v), p);
#endif
  }
};

struct BF16T {
  using T = uint16_t;
  static constexpr DType kDType = DType::kBF16;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) {
    return hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(DU32(), hn::LoadU(DU16(), p))));
  }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) { StoreU16(BF16FromF32(v), p); }
};

// ---- row converters ------------------------------------------------------------------------

// n elements, any n. The tail (< one vector) goes through stack buffers.
template <class S, class D>
void FloatRow(const void* src_v, void* dst_v, int64_t n) {
  const auto* src = static_cast<const typename S::T*>(src_v);
  auto* dst = static_cast<typename D::T*>(dst_v);
  const size_t N = hn::Lanes(DF());
  const size_t count = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + 2 * N <= count; i += 2 * N) {
    const auto a = S::Load(src + i);
    const auto b = S::Load(src + i + N);
    D::Store(a, dst + i);
    D::Store(b, dst + i + N);
  }
  for (; i + N <= count; i += N) D::Store(S::Load(src + i), dst + i);
  if (i < count) {
    const size_t rest = count - i;
    HWY_ALIGN typename S::T sbuf[HWY_MAX_BYTES / sizeof(float)] = {};
    HWY_ALIGN typename D::T dbuf[HWY_MAX_BYTES / sizeof(float)];
    std::memcpy(sbuf, src + i, rest * sizeof(typename S::T));
    D::Store(S::Load(sbuf), dbuf);
    std::memcpy(dst + i, dbuf, rest * sizeof(typename D::T));
  }
}

// Same dtype f16 -> f16: identity except NaN, which F16ToF32 + F32ToF16 turn into sign | 0x7E00.
void F16Copy(const void* src_v, void* dst_v, int64_t n) {
  const hn::ScalableTag<int16_t> d;
  const auto* src = static_cast<const int16_t*>(src_v);
  auto* dst = static_cast<int16_t*>(dst_v);
  const size_t N = hn::Lanes(d);
  const size_t count = static_cast<size_t>(n);
  size_t i = 0;
  const auto fix = [&](hn::Vec<decltype(d)> h) {
    const auto is_nan = hn::Gt(hn::And(h, hn::Set(d, 0x7FFF)), hn::Set(d, 0x7C00));
    return hn::IfThenElse(
        is_nan, hn::Or(hn::And(h, hn::Set(d, static_cast<int16_t>(0x8000))), hn::Set(d, 0x7E00)),
        h);
  };
  for (; i + N <= count; i += N) hn::StoreU(fix(hn::LoadU(d, src + i)), d, dst + i);
  for (; i < count; ++i)
    dst[i] = static_cast<int16_t>(F32ToF16(F16ToF32(static_cast<uint16_t>(src[i]))));
}

// Same dtype bf16 -> bf16: identity except NaN, which gets the quiet bit (0x40).
void BF16Copy(const void* src_v, void* dst_v, int64_t n) {
  const hn::ScalableTag<int16_t> d;
  const auto* src = static_cast<const int16_t*>(src_v);
  auto* dst = static_cast<int16_t*>(dst_v);
  const size_t N = hn::Lanes(d);
  const size_t count = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + N <= count; i += N) {
    const auto h = hn::LoadU(d, src + i);
    const auto is_nan = hn::Gt(hn::And(h, hn::Set(d, 0x7FFF)), hn::Set(d, 0x7F80));
    hn::StoreU(hn::IfThenElse(is_nan, hn::Or(h, hn::Set(d, 0x40)), h), d, dst + i);
  }
  for (; i < count; ++i)
    dst[i] = static_cast<int16_t>(F32ToBF16(BF16ToF32(static_cast<uint16_t>(src[i]))));
}

void F32Copy(const void* src, void* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

// Largest |x| of the 32 elements at src.
// NaN lanes as 0: the reference's fmax and `<` skip NaN, while x86 max/min propagate it
// depending on operand order. Only non-finite input reaches this (layouts/quant.h SafeScaled).
HWY_INLINE hn::Vec<DF> WithoutNaN(hn::Vec<DF> v) { return hn::IfThenElseZero(hn::Eq(v, v), v); }

template <class S>
HWY_INLINE float BlockAmax(const typename S::T* src) {
  const DF df;
  const size_t N = hn::Lanes(df);
  auto vmax = hn::Zero(df);
  for (size_t k = 0; k < 32; k += N) vmax = hn::Max(vmax, hn::Abs(WithoutNaN(S::Load(src + k))));
  return hn::GetLane(hn::MaxOfLanes(df, vmax));
}

// roundf (round half away from zero) to int: trunc(p + copysign(0.49999997f, p)). Adding the
// float just below 0.5 is exact for every tie (x.5 + 0.49999997 rounds to x + 1 under round to
// nearest even) and never carries 0.49999997 up (0.5 would); checked against std::roundf for every
// f32 in [0, 2^24] (|p| <= 127 here). ConvertTo truncates.
// layouts/quant.h SafeScaled: NaN -> 0, clamped to [lo, hi] (a no-op for finite input).
HWY_INLINE hn::Vec<DF> SafeScaled(hn::Vec<DF> p, float lo, float hi) {
  const DF df;
  const auto finite_or_inf = hn::IfThenElseZero(hn::Eq(p, p), p);
  return hn::Min(hn::Max(finite_or_inf, hn::Set(df, lo)), hn::Set(df, hi));
}

HWY_INLINE hn::Vec<DI32> RoundHalfAway(hn::Vec<DF> p) {
  const DF df;
  const auto sign = hn::And(p, hn::Set(df, -0.0f));
  return hn::ConvertTo(DI32(), hn::Add(p, hn::Or(sign, hn::Set(df, 0.49999997f))));
}

// Blocks per group whose scales are computed together in vectors (one lane per block): the
// division chain amax -> d -> 1/d -> f16 is long, lanes make it one pass per group.
constexpr int64_t kScaleGroup = 32;

// d = amax / 127 (or max / -8), id = 1/d or 0, and the f16 bits of d, for `count` blocks; lanes
// past `count` read the zero padding of `num`.
HWY_INLINE void BlockScales(const float* num, float divisor, int64_t count, float* id,
                            uint16_t* dh) {
  const hn::CappedTag<float, 8> df;  // a 128-element row has 4 blocks; narrow divisions are faster
  const size_t N = hn::Lanes(df);
  for (size_t k = 0; k < static_cast<size_t>(count); k += N) {
    const auto d = hn::Div(hn::LoadU(df, num + k), hn::Set(df, divisor));
    const auto inv = hn::IfThenElseZero(hn::Ne(d, hn::Zero(df)), hn::Div(hn::Set(df, 1.0f), d));
    hn::StoreU(inv, df, id + k);
    using DS = decltype(df);
    StoreU16<hn::RebindToUnsigned<DS>>(F16FromF32Soft<DS>(d), dh + k);
  }
}

// A block whose scale is subnormal (1/d overflows; layouts/quant.h) goes through the reference on
// an f32 copy: rare, and identical to the reference by construction.
template <class S, class Quantize>
HWY_NOINLINE void QuantizeBlockViaReference(const typename S::T* src, void* block,
                                            Quantize quantize) {
  const DF df;
  HWY_ALIGN float x[32];
  for (size_t k = 0; k < 32; k += hn::Lanes(df)) hn::Store(S::Load(src + k), df, x + k);
  quantize(x, block);
}

template <class S>
void Q8Row(const void* src_v, void* dst_v, int64_t n) {
  const DF df;
  const hn::Rebind<int8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const auto* src = static_cast<const typename S::T*>(src_v);
  auto* out = static_cast<char*>(dst_v);
  HWY_ALIGN float amax[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  HWY_ALIGN float id[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  HWY_ALIGN uint16_t dh[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  const int64_t blocks = n / 32;
  for (int64_t g0 = 0; g0 < blocks; g0 += kScaleGroup) {
    const int64_t count = blocks - g0 < kScaleGroup ? blocks - g0 : kScaleGroup;
    for (int64_t b = 0; b < count; ++b) amax[b] = BlockAmax<S>(src + 32 * b);
    for (size_t b = static_cast<size_t>(count); b < static_cast<size_t>(count) + N; ++b)
      amax[b] = 0.0f;
    BlockScales(amax, 127.0f, count, id, dh);
    for (int64_t b = 0; b < count; ++b, src += 32, out += sizeof(BlockQ8_0)) {
      if (!std::isfinite(id[b])) {
        QuantizeBlockViaReference<S>(src, out, &QuantizeBlockQ8_0);
        continue;
      }
      SetBlockScale(out, dh[b]);
      const auto vid = hn::Set(df, id[b]);
      for (size_t k = 0; k < 32; k += N) {
        const auto p = KeepRounded(hn::Mul(S::Load(src + k), vid));
        hn::StoreU(hn::DemoteTo(d8, RoundHalfAway(SafeScaled(p, -127.0f, 127.0f))), d8,
                   Q8Codes(out) + k);
      }
    }
  }
}

// q4_0's signed maximum: the first element of largest magnitude (strict < in the reference).
// From the block's max and min: if one has the larger magnitude, every element of that magnitude
// has its sign; only a tie (+a and -a both present) needs the first occurrence. All zero: +0.
template <class S>
HWY_INLINE float BlockSignedMax(const typename S::T* src) {
  const DF df;
  const size_t N = hn::Lanes(df);
  auto vmax = WithoutNaN(S::Load(src));
  auto vmin = vmax;
  for (size_t k = N; k < 32; k += N) {
    const auto v = WithoutNaN(S::Load(src + k));
    vmax = hn::Max(vmax, v);
    vmin = hn::Min(vmin, v);
  }
  const float hi = hn::GetLane(hn::MaxOfLanes(df, vmax));
  const float lo = hn::GetLane(hn::MinOfLanes(df, vmin));
  if (hi > -lo) return hi;
  if (-lo > hi) return lo;
  if (hi == 0.0f) return 0.0f;
  for (int j = 0; j < 32; ++j) {
    const float x = LoadAsF32(src, S::kDType, j);
    if (x == hi || x == lo) return x;
  }
  return hi;  // unreachable
}

template <class S>
void Q4Row(const void* src_v, void* dst_v, int64_t n) {
  const DF df;
  const DI32 di;
  const hn::Rebind<uint8_t, DF> d8;
  const hn::CappedTag<uint8_t, 16> dp;
  const size_t N = hn::Lanes(df);
  const size_t NP = hn::Lanes(dp);
  const auto* src = static_cast<const typename S::T*>(src_v);
  auto* out = static_cast<char*>(dst_v);
  HWY_ALIGN float max[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  HWY_ALIGN float id[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  HWY_ALIGN uint16_t dh[kScaleGroup + HWY_MAX_BYTES / sizeof(float)];
  const int64_t blocks = n / 32;
  for (int64_t g0 = 0; g0 < blocks; g0 += kScaleGroup) {
    const int64_t count = blocks - g0 < kScaleGroup ? blocks - g0 : kScaleGroup;
    for (int64_t b = 0; b < count; ++b) max[b] = BlockSignedMax<S>(src + 32 * b);
    for (size_t b = static_cast<size_t>(count); b < static_cast<size_t>(count) + N; ++b) {
      max[b] = 0.0f;
    }
    BlockScales(max, -8.0f, count, id, dh);
    for (int64_t b = 0; b < count; ++b, src += 32, out += sizeof(BlockQ4_0)) {
      if (!std::isfinite(id[b])) {
        QuantizeBlockViaReference<S>(src, out, &QuantizeBlockQ4_0);
        continue;
      }
      SetBlockScale(out, dh[b]);
      const auto vid = hn::Set(df, id[b]);
      HWY_ALIGN uint8_t q[32];
      for (size_t k = 0; k < 32; k += N) {
        const auto p = KeepRounded(hn::Mul(S::Load(src + k), vid));
        const auto safe = SafeScaled(p, -8.5f, 8.0f);
        const auto qi =
            hn::Min(hn::ConvertTo(di, hn::Add(safe, hn::Set(df, 8.5f))), hn::Set(di, 15));
        hn::StoreU(hn::DemoteTo(d8, qi), d8, q + k);
      }
      for (size_t j = 0; j < 16; j += NP) {
        const auto lo = hn::LoadU(dp, q + j);
        const auto hi = hn::LoadU(dp, q + 16 + j);
        hn::StoreU(hn::Or(lo, hn::ShiftLeft<4>(hi)), dp, Q4Codes(out) + j);
      }
    }
  }
}

using RowFn = void (*)(const void* src, void* dst, int64_t n);

template <class S>
RowFn PickFromSrc(DType dst) {
  switch (dst) {
    case DType::kF32:
      return &FloatRow<S, F32T>;
    case DType::kF16:
      return &FloatRow<S, F16T>;
    case DType::kBF16:
      return &FloatRow<S, BF16T>;
    case DType::kQ8_0:
      return &Q8Row<S>;
    case DType::kQ4_0:
      return &Q4Row<S>;
  }
  return nullptr;
}

// The row converter for (src, dst). Precondition: IsFloatDType(src).
RowFn PickRowFn(DType src, DType dst) {
  if (src == dst) {
    if (src == DType::kF32) return &F32Copy;
    if (src == DType::kF16) return &F16Copy;
    if (src == DType::kBF16) return &BF16Copy;
  }
  switch (src) {
    case DType::kF32:
      return PickFromSrc<F32T>(dst);
    case DType::kF16:
      return PickFromSrc<F16T>(dst);
    case DType::kBF16:
      return PickFromSrc<BF16T>(dst);
    default:
      return nullptr;
  }
}

void ConvertRowImpl(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  PickRowFn(src_dtype, dst_dtype)(src, dst, n);
}

// ---- to f32 --------------------------------------------------------------------------------

void DequantQ8Row(const void* src, float* dst, int64_t n) {
  const DF df;
  const DI32 di;
  const hn::Rebind<int8_t, DF> d8;
  const size_t N = hn::Lanes(df);
  const auto* in = static_cast<const char*>(src);
  for (int64_t b = 0; b < n / 32; ++b, in += sizeof(BlockQ8_0), dst += 32) {
    const auto vd = hn::Set(df, F16ToF32(BlockScale(in)));
    for (size_t k = 0; k < 32; k += N) {
      const auto q = hn::PromoteTo(di, hn::LoadU(d8, Q8Codes(in) + k));
      hn::StoreU(hn::Mul(vd, hn::ConvertTo(df, q)), df, dst + k);
    }
  }
}

void DequantQ4Row(const void* src, float* dst, int64_t n) {
  const hn::CappedTag<float, 16> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> d8;
  const size_t N = hn::Lanes(df);
  const auto* in = static_cast<const char*>(src);
  for (int64_t b = 0; b < n / 32; ++b, in += sizeof(BlockQ4_0), dst += 32) {
    const auto vd = hn::Set(df, F16ToF32(BlockScale(in)));
    const auto k8 = hn::Set(di, 8);
    for (size_t j = 0; j < 16; j += N) {
      const auto bytes = hn::BitCast(
          di, hn::PromoteTo(hn::RebindToUnsigned<decltype(di)>(), hn::LoadU(d8, Q4Codes(in) + j)));
      const auto lo = hn::Sub(hn::And(bytes, hn::Set(di, 0x0F)), k8);
      const auto hi = hn::Sub(hn::ShiftRight<4>(bytes), k8);
      hn::StoreU(hn::Mul(vd, hn::ConvertTo(df, lo)), df, dst + j);
      hn::StoreU(hn::Mul(vd, hn::ConvertTo(df, hi)), df, dst + 16 + j);
    }
  }
}

HWY_INLINE void RowToF32Inline(const void* src, DType src_dtype, float* dst, int64_t n) {
  switch (src_dtype) {
    case DType::kF32:
      F32Copy(src, dst, n);
      break;
    case DType::kF16:
      FloatRow<F16T, F32T>(src, dst, n);
      break;
    case DType::kBF16:
      FloatRow<BF16T, F32T>(src, dst, n);
      break;
    case DType::kQ8_0:
      DequantQ8Row(src, dst, n);
      break;
    case DType::kQ4_0:
      DequantQ4Row(src, dst, n);
      break;
  }
}

void RowToF32Impl(const void* src, DType src_dtype, float* dst, int64_t n) {
  RowToF32Inline(src, src_dtype, dst, n);
}

void ViewToF32Impl(const TensorView& v, float* out) {
  const int64_t n0 = v.ne[0];
  const size_t esz = BlockBytes(v.dtype);
  // Quantized rows are read block by block, packed (a quantized nb[0] is the block size).
  const bool packed = IsQuantized(v.dtype) || v.nb[0] == esz;
  for (int64_t i3 = 0; i3 < v.ne[3]; ++i3) {
    for (int64_t i2 = 0; i2 < v.ne[2]; ++i2) {
      for (int64_t i1 = 0; i1 < v.ne[1]; ++i1) {
        const char* r = static_cast<const char*>(RowPtr(v, i1, i2, i3));
        if (packed) {
          RowToF32Inline(r, v.dtype, out, n0);
        } else {
          for (int64_t i0 = 0; i0 < n0; ++i0) out[i0] = LoadAsF32(r + i0 * v.nb[0], v.dtype, 0);
        }
        out += n0;
      }
    }
  }
}

// ---- scatter -------------------------------------------------------------------------------

// Elements per chunk of a strided source row: a multiple of 32 (quantized rows), 1 KiB of f32.
constexpr int64_t kChunk = 256;

// Converts one source row of n elements with element stride nb0 to dst (a row of dst_dtype).
// Packed rows go straight through `fn`; strided ones are gathered into f32 chunks first (exact:
// every source dtype widens to f32 without rounding) and converted with `from_f32`.
HWY_INLINE void ConvertAnyRow(const char* src, size_t nb0, DType src_dtype, bool packed, RowFn fn,
                              RowFn from_f32, DType dst_dtype, char* dst, int64_t n) {
  if (packed) {
    fn(src, dst, n);
    return;
  }
  HWY_ALIGN float buf[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = n - c0 < kChunk ? n - c0 : kChunk;
    for (int64_t i = 0; i < len; ++i)
      buf[i] = LoadAsF32(src + static_cast<size_t>(c0 + i) * nb0, src_dtype, 0);
    from_f32(buf, dst + RowBytes(dst_dtype, c0), len);
  }
}

// Cells-fastest (permuted V) write: element d of head h of token t lands at
// CellsFastestOffset(cells[t], h, d). Tokens whose cells are consecutive are converted as a tile of
// up to kTile rows in L1 and then written one dim at a time as kTile contiguous elements.
template <typename T>
void ScatterCellsFastest(const TensorView& src, std::span<const int32_t> cells,
                         const CellBlockLayout& layout, char* block, RowFn fn, RowFn from_f32,
                         bool packed) {
  constexpr int kTile = 16;
  constexpr int64_t kDims = 128;  // dims per tile pass: 16 x 128 x 4 bytes = 8 KiB of stack
  HWY_ALIGN T tile[kTile][kDims];
  const int64_t hd = layout.head_dim;
  const size_t n = cells.size();
  for (int32_t h = 0; h < layout.kv_heads; ++h) {
    size_t t0 = 0;
    while (t0 < n) {
      size_t run = 1;
      while (t0 + run < n && run < kTile &&
             cells[t0 + run] == cells[t0] + static_cast<int32_t>(run))
        ++run;
      for (int64_t d0 = 0; d0 < hd; d0 += kDims) {
        const int64_t dl = hd - d0 < kDims ? hd - d0 : kDims;
        for (size_t g = 0; g < run; ++g) {
          const char* s = static_cast<const char*>(src.data) + h * src.nb[1] +
                          (t0 + g) * src.nb[2] + static_cast<size_t>(d0) * src.nb[0];
          ConvertAnyRow(s, src.nb[0], src.dtype, packed, fn, from_f32, layout.dtype,
                        reinterpret_cast<char*>(tile[g]), dl);
        }
        char* base = block + CellsFastestOffset(layout, cells[t0], h, static_cast<int32_t>(d0));
        for (int64_t d = 0; d < dl; ++d) {
          T* line = reinterpret_cast<T*>(base + static_cast<size_t>(d) * layout.row_stride);
          for (size_t g = 0; g < run; ++g) line[g] = tile[g][d];
        }
      }
      t0 += run;
    }
  }
}

void ScatterToCellsImpl(const TensorView& src, std::span<const int32_t> cells,
                        const CellBlockLayout& layout, void* block_v) {
  char* block = static_cast<char*>(block_v);
  const bool packed = src.nb[0] == BlockBytes(src.dtype);
  const RowFn fn = PickRowFn(src.dtype, layout.dtype);
  const RowFn from_f32 = PickRowFn(DType::kF32, layout.dtype);
  if (layout.cells_fastest) {
    if (IsQuantized(layout.dtype))
      return;  // precondition: permuted V is float-only (ref writes nothing)
    if (BlockBytes(layout.dtype) == 4) {
      ScatterCellsFastest<uint32_t>(src, cells, layout, block, fn, from_f32, packed);
    } else {
      ScatterCellsFastest<uint16_t>(src, cells, layout, block, fn, from_f32, packed);
    }
    return;
  }
  const int64_t hd = layout.head_dim;
  for (size_t t = 0; t < cells.size(); ++t) {
    const char* st = static_cast<const char*>(src.data) + t * src.nb[2];
    for (int32_t h = 0; h < layout.kv_heads; ++h) {
      ConvertAnyRow(st + h * src.nb[1], src.nb[0], src.dtype, packed, fn, from_f32, layout.dtype,
                    block + CellRowOffset(layout, cells[t], h), hd);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {

HWY_EXPORT(ConvertRowImpl);
HWY_EXPORT(RowToF32Impl);
HWY_EXPORT(ScatterToCellsImpl);
HWY_EXPORT(ViewToF32Impl);

void ConvertRow(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(ConvertRowImpl)(src, src_dtype, dst, dst_dtype, n);
}

void RowToF32(const void* src, DType src_dtype, float* dst, int64_t n) {
  HWY_DYNAMIC_DISPATCH(RowToF32Impl)(src, src_dtype, dst, n);
}

void ScatterToCells(const TensorView& src, std::span<const int32_t> cells,
                    const CellBlockLayout& layout, void* block) {
  HWY_DYNAMIC_DISPATCH(ScatterToCellsImpl)(src, cells, layout, block);
}

void ViewToF32(const TensorView& v, float* out) { HWY_DYNAMIC_DISPATCH(ViewToF32Impl)(v, out); }

}  // namespace kv::kernels
#endif  // HWY_ONCE
