// Highway per-target translation unit for kernels/convert.h: ConvertRow, RowToF32, ScatterToCells
// and ViewToF32. Each exported function dispatches once per call and loops over every row inside.
//
// Exactness (tested bit-for-bit against kernels/convert_ref.cc on every compiled target):
// - f32 -> f16: x86 F16C (AVX2, AVX3) converts with round to nearest even like F32ToF16, but keeps
//   NaN payload bits that F32ToF16 drops, so NaN lanes are rewritten to sign | 0x7E00. SSE4 and
//   SCALAR have no F16C and Highway 1.0.3's software DemoteTo truncates and mishandles inf/NaN, so
//   those targets use F16FromF32Soft below (integer ops plus one exact f32 add for subnormals).
// - f16 -> f32: F16C's VCVTPH2PS quiets signaling NaNs while F16ToF32 keeps them, so every target
//   uses the integer expansion F16BitsToF32 (kernels/f16-inl.h; exact: subnormals are mant *
//   2^-24).
// - bf16: round to nearest even with integer ops (Highway 1.0.3's DemoteTo truncates).
// - q8_0 / q4_0: the same f32 operations as layouts/quant.h in the same order. The product x * id
//   goes through KeepRounded() (kernels/fp_barrier-inl.h) so that the compiler cannot contract it
//   with the following add/sub into an FMA (GCC contracts intrinsics on FMA targets even in ISO
//   mode), which would change codes. armv7 NEON flushes subnormals, returns the default NaN and
//   approximates division: the scales divide on its scalar VFP unit and the blocks that could
//   differ take the reference (see KV_CONVERT_SIMD_NOT_IEEE).
//
// Memory traffic: ConvertRow reads n * src_size bytes and writes RowBytes(dst, n); nothing else.
// No heap allocation: strided sources and row tails go through small stack buffers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/convert.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/convert.h"
#include "kernels/f16-inl.h"
#include "kernels/fp_barrier-inl.h"
#include "kernels/highway_targets.h"
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

// u32 lanes holding values <= 0xFFFF as u16 lanes.
HWY_INLINE hn::Vec<DU16> NarrowToU16(hn::Vec<DU32> v) {
  return hn::DemoteTo(DU16(), hn::BitCast(DI32(), v));
}

// Non-temporal store of u16 lanes to a vector-aligned p. Where the lanes fill only part of a
// 128-bit register (SSE4, SCALAR), which Stream would write whole, a plain store.
HWY_INLINE void StreamU16(hn::Vec<DU16> v, uint16_t* p) {
  if constexpr (hn::MaxLanes(DU16()) * sizeof(uint16_t) >= 16) {
    hn::Stream(v, DU16(), p);
  } else {
    hn::StoreU(v, DU16(), p);
  }
}

// ---- element types: load Lanes(DF) elements as f32, store f32 lanes ----------------------------

struct F32T {
  using T = float;
  static constexpr DType kDType = DType::kF32;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) { return hn::LoadU(DF(), p); }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) { hn::StoreU(v, DF(), p); }
  static HWY_INLINE void Stream(hn::Vec<DF> v, T* p) { hn::Stream(v, DF(), p); }
};

struct F16T {
  using T = uint16_t;
  static constexpr DType kDType = DType::kF16;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) {
    return F16BitsToF32(DF(), hn::PromoteTo(DU32(), hn::LoadU(DU16(), p)));
  }
  static HWY_INLINE hn::Vec<DU16> Bits(hn::Vec<DF> v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
    // F16C: round to nearest even, overflow to inf, subnormals exact. Only NaN payloads differ.
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hn::Rebind<int16_t, DF> di16;
    const auto h = hn::BitCast(di16, hn::DemoteTo(dh, v));
    const auto is_nan = hn::Gt(hn::And(h, hn::Set(di16, 0x7FFF)), hn::Set(di16, 0x7C00));
    const auto fixed =
        hn::IfThenElse(is_nan, hn::And(h, hn::Set(di16, static_cast<int16_t>(0xFE00))), h);
    return hn::BitCast(DU16(), fixed);
#else
    return NarrowToU16(F16FromF32Soft(v));
#endif
  }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) { hn::StoreU(Bits(v), DU16(), p); }
  static HWY_INLINE void Stream(hn::Vec<DF> v, T* p) { StreamU16(Bits(v), p); }
};

struct BF16T {
  using T = uint16_t;
  static constexpr DType kDType = DType::kBF16;
  static HWY_INLINE hn::Vec<DF> Load(const T* p) {
    return hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(DU32(), hn::LoadU(DU16(), p))));
  }
  static HWY_INLINE hn::Vec<DU16> Bits(hn::Vec<DF> v) { return NarrowToU16(BF16FromF32(v)); }
  static HWY_INLINE void Store(hn::Vec<DF> v, T* p) { hn::StoreU(Bits(v), DU16(), p); }
  static HWY_INLINE void Stream(hn::Vec<DF> v, T* p) { StreamU16(Bits(v), p); }
};

// ---- row converters ------------------------------------------------------------------------

// n elements, any n. The tail (< one vector) goes through stack buffers.
// With kStream, the destination is written with non-temporal stores. Precondition then: dst is
// 64-byte aligned and n a multiple of 2 * Lanes(DF) (whole cache lines, no tail).
template <class S, class D, bool kStream = false>
void FloatRow(const void* src_v, void* dst_v, int64_t n) {
  const auto* src = static_cast<const typename S::T*>(src_v);
  auto* dst = static_cast<typename D::T*>(dst_v);
  const size_t N = hn::Lanes(DF());
  const size_t count = static_cast<size_t>(n);
  size_t i = 0;
  for (; i + 2 * N <= count; i += 2 * N) {
    const auto a = S::Load(src + i);
    const auto b = S::Load(src + i + N);
    if constexpr (kStream) {
      D::Stream(a, dst + i);
      D::Stream(b, dst + i + N);
    } else {
      D::Store(a, dst + i);
      D::Store(b, dst + i + N);
    }
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

// ---- q8_0 / q4_0 ---------------------------------------------------------------------------
//
// Rows are quantized kGroup blocks at a time, one block per lane: the per-block maxima are folded
// into the lanes of one vector (PairFold below) so that the division chain d = max / c, 1 / d and
// the f16 conversion of d run once per group, not once per block. The codes then use the
// reference's f32 operations in its order. Blocks the fast path cannot take exactly go through the
// scalar reference on an f32 copy, identical by construction: any NaN or infinity in the group
// (the reference's fmax skips NaN and its codes need SafeScaled) and a subnormal scale d (1/d loses
// precision or overflows; layouts/quant.h). Both are rare and never occur for finite activations
// of ordinary size.
//
// Why the fast path needs no clamp: for finite x with |x| <= amax and a normal d, |x * (1/d)| <=
// 127 * (1 + 4 * 2^-24) < 127.5 (q8_0) and <= 8 * (1 + 4 * 2^-24) (q4_0), so SafeScaled would
// change nothing.

constexpr size_t kGroup = hn::MaxLanes(DF());  // blocks per scale pass
static_assert(!HWY_HAVE_SCALABLE,
              "the block-to-lane fold needs a lane count known at compile time");
static_assert(kGroup <= 16, "q4_0 packs elements j and j + 16 of a block within one vector");

// One fold step over two vectors whose lanes are split into equal groups, each group holding
// partial results of one block (lo: the first blocks, hi: the next ones). Returns a vector with
// twice the groups at half the size, lo's in the lower half and hi's in the upper, block order
// kept: lane i of the lower half combines lanes 2i and 2i + 1 of lo (which share a group).
template <class Op, class V>
HWY_INLINE V PairFold(V lo, V hi, Op op) {
#if HWY_TARGET == HWY_SCALAR
  return op(lo, hi);  // never called: one lane is one block already
#else
  const hn::DFromV<V> d;
  return op(hn::ConcatEven(d, hi, lo), hn::ConcatOdd(d, hi, lo));
#endif
}

// Folds the leaf vectors of kBlocks consecutive blocks starting at `first` (leaf(b): a vector of
// partial results of block b) into one vector of kBlocks lane groups. With kBlocks == kGroup every
// lane holds one block's result: log2(kGroup) fold steps for the whole group instead of a
// horizontal reduction per block.
template <size_t kBlocks, class Leaf, class Fold>
HWY_INLINE auto FoldBlocks(size_t first, const Leaf& leaf, const Fold& fold) {
  if constexpr (kBlocks == 1) {
    return leaf(first);
  } else {
    return fold(FoldBlocks<kBlocks / 2>(first, leaf, fold),
                FoldBlocks<kBlocks / 2>(first + kBlocks / 2, leaf, fold));
  }
}

struct MaxOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Max(a, b);
  }
};
struct MinOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Min(a, b);
  }
};

// |x| as integer bits: ordered like |x| for finite values, and above every finite value for
// infinities (0x7F800000) and NaN (> 0x7F800000), which a float max would drop or propagate
// depending on operand order.
HWY_INLINE hn::Vec<DI32> AbsBits(hn::Vec<DF> v) {
  return hn::And(hn::BitCast(DI32(), v), hn::Set(DI32(), 0x7FFFFFFF));
}

// armv7 NEON is not IEEE: Advanced SIMD on armv7 always flushes subnormal inputs and results to
// zero, returns the default NaN instead of propagating a NaN operand, and has no division
// (Highway 1.0.3 divides by a reciprocal estimate and Newton steps, off by an ulp at times). The
// scalar VFP unit is IEEE (Linux leaves its flush-to-zero and default-NaN modes off), so the few
// operations where these differences would show run there.
#undef KV_CONVERT_SIMD_NOT_IEEE  // defined once per target pass of this file
#if HWY_ARCH_ARM_V7 && HWY_TARGET == HWY_NEON
#define KV_CONVERT_SIMD_NOT_IEEE 1
#else
#define KV_CONVERT_SIMD_NOT_IEEE 0
#endif

// num / den rounded once, as the reference's scalar division.
HWY_INLINE hn::Vec<DF> ExactDiv(hn::Vec<DF> num, hn::Vec<DF> den) {
#if KV_CONVERT_SIMD_NOT_IEEE
  // Lane by lane on VFP: once per group of blocks. GCC does not vectorize this loop for NEON
  // without -funsafe-math-optimizations, because NEON would flush.
  const DF df;
  HWY_ALIGN float n[hn::MaxLanes(DF())], q[hn::MaxLanes(DF())];
  hn::Store(num, df, n);
  hn::Store(den, df, q);
  for (size_t i = 0; i < hn::Lanes(df); ++i) n[i] /= q[i];
  return hn::Load(df, n);
#else
  return hn::Div(num, den);
#endif
}

// Lanes whose scale d takes the reference path: subnormal and nonzero, where 1 / d loses precision
// or overflows. Compared as integer bits, which no flushing changes. On a target that flushes
// subnormals, also every |d| < 2^-110, zero included: there the fast path would read a subnormal
// element as 0 (the block's min and max too), which is exact only if x / d rounds to the code of
// 0 anyway. With |d| >= 2^-110 a subnormal x has |x / d| < 2^-126 * 2^110 = 2^-16, code 0 (q8_0)
// or 8 (q4_0), as flushed. A block of zeros then takes the reference path there too.
HWY_INLINE hn::Mask<DF> ScaleNeedsReference(hn::Vec<DF> d) {
  const DI32 di;
  const auto bits = AbsBits(d);
#if KV_CONVERT_SIMD_NOT_IEEE
  return hn::RebindMask(DF(), hn::Lt(bits, hn::Set(di, (127 - 110) << 23)));  // 2^-110
#else
  return hn::RebindMask(DF(), hn::And(hn::Lt(bits, hn::Set(di, 0x00800000)),  // < 2^-126
                                      hn::Gt(bits, hn::Zero(di))));
#endif
}

// Rounded integer-valued lanes (|t| < 2^22) to their low 8 bits: adding 1.5 * 2^23 puts t, in two's
// complement, in the low mantissa bits (exact for such t).
HWY_INLINE hn::Vec<hn::Rebind<uint8_t, DF>> LowByte(hn::Vec<DF> t) {
  const DF df;
  const auto bits = hn::BitCast(DU32(), hn::Add(t, hn::Set(df, 12582912.0f)));
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // vpmovdb keeps the low byte of each 32-bit lane. Not hn::TruncateTo: Highway 1.0.3's
  // u32 -> u8 TruncateTo of a 512-bit vector on AVX3_DL permutes 32-bit lanes (vpermd) with byte
  // indices meant for vpermb, and returns lanes 0, 4, 8, 12 whole instead of 16 low bytes.
  static_assert(hn::MaxLanes(DF()) == 16, "one 512-bit vector");
  return hn::Vec<hn::Rebind<uint8_t, DF>>{_mm512_cvtepi32_epi8(bits.raw)};
#else
  return hn::TruncateTo(hn::Rebind<uint8_t, DF>(), bits);
#endif
}

template <class S, class Quantize>
HWY_NOINLINE void QuantizeBlockViaReference(const typename S::T* src, void* block,
                                            Quantize quantize) {
  const DF df;
  HWY_ALIGN float x[32];
  for (size_t k = 0; k < 32; k += hn::Lanes(df)) hn::Store(S::Load(src + k), df, x + k);
  quantize(x, block);
}

// 1/d for each lane, or NaN where the block takes the reference path (1/d is never NaN: d is
// finite there); and the f16 bits of d.
HWY_INLINE void StoreScales(hn::Vec<DF> d, hn::Mask<DF> reference, float* id, uint16_t* dh) {
  const DF df;
  const auto inv = hn::IfThenElseZero(hn::Ne(d, hn::Zero(df)), ExactDiv(hn::Set(df, 1.0f), d));
  hn::Store(hn::IfThenElse(hn::Or(reference, ScaleNeedsReference(d)),
                           hn::Set(df, std::numeric_limits<float>::quiet_NaN()), inv),
            df, id);
  hn::StoreU(NarrowToU16(F16FromF32Soft(d)), DU16(), dh);
}

// q8_0: d = amax / 127, q = roundf(x * (1/d)). roundf (half away from zero) is
// trunc(p + copysign(0.49999997f, p)): adding the float just below 0.5 is exact for every tie
// (x.5 + 0.49999997 rounds to x + 1 under round to nearest even) and never carries 0.49999997 up
// (0.5 would); checked against std::roundf for every f32 in [0, 2^24].
struct Q8Kind {
  static constexpr size_t kBlockBytes = sizeof(BlockQ8_0);

  // p + copysign(0.49999997f, p): truncated toward zero, roundf(p).
  static HWY_INLINE hn::Vec<DF> AddHalfAway(hn::Vec<DF> p) {
    return hn::Add(p, hn::CopySign(hn::Set(DF(), 0.49999997f), p));
  }
  static constexpr void (*kReference)(const float*, void*) = &QuantizeBlockQ8_0;

  // Scales of the `count` <= kGroup blocks at src.
  template <class S>
  static HWY_INLINE void Scales(const typename S::T* src, size_t count, float* id, uint16_t* dh) {
    const DF df;
    const DI32 di;
    constexpr size_t N = hn::MaxLanes(DF());
    const auto leaf = [&](size_t b) {
      if (b >= count) return hn::Zero(di);
      auto m = AbsBits(S::Load(src + 32 * b));
      for (size_t k = N; k < 32; k += N) m = hn::Max(m, AbsBits(S::Load(src + 32 * b + k)));
      return m;
    };
    const auto fold = [](hn::Vec<DI32> lo, hn::Vec<DI32> hi) { return PairFold(lo, hi, MaxOp()); };
    const auto amax_bits = FoldBlocks<kGroup>(0, leaf, fold);
    const auto nonfinite = hn::RebindMask(df, hn::Gt(amax_bits, hn::Set(di, 0x7F7FFFFF)));
    StoreScales(ExactDiv(hn::BitCast(df, amax_bits), hn::Set(df, 127.0f)), nonfinite, id, dh);
  }

  // The codes of the block at src, given vid = 1/d in every lane.
  template <class S>
  static HWY_INLINE void Codes(const typename S::T* src, hn::Vec<DF> vid, void* block) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    // vcvttps2dq is trunc() for |t| < 2^31 (here |t| < 128) and vpmovdb keeps the low byte and
    // stores it: 5 instructions per 16 codes instead of 8 (Highway's TruncateTo is a vpshufb and
    // a vpermd on AVX-512, and ConvertTo adds an overflow fix-up that |t| < 128 never needs).
    static_assert(hn::MaxLanes(DF()) == 16, "one 512-bit vector: half a block");
    for (size_t k = 0; k < 32; k += 16) {
      const auto p = KeepRounded(hn::Mul(S::Load(src + k), vid));
      const auto t = AddHalfAway(p);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(Q8Codes(block) + k),
                       _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t.raw)));
    }
#elif HWY_TARGET == HWY_AVX2
    // The same with AVX2's saturating packs (exact for |t| < 128): the 32 codes of the block in
    // lane order A0 B0 C0 D0 | A1 B1 C1 D1 (4-code groups of vectors A..D), put back in order by
    // one vpermd: 5 instructions per 8 codes and 4 per block instead of 10 per 8 codes.
    static_assert(hn::MaxLanes(DF()) == 8, "one 256-bit vector: a quarter of a block");
    __m256i t[4];
    for (size_t k = 0; k < 4; ++k) {
      const auto p = KeepRounded(hn::Mul(S::Load(src + 8 * k), vid));
      t[k] = _mm256_cvttps_epi32(AddHalfAway(p).raw);
    }
    const __m256i bytes =
        _mm256_packs_epi16(_mm256_packs_epi32(t[0], t[1]), _mm256_packs_epi32(t[2], t[3]));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(Q8Codes(block)),
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    const DF df;
    for (size_t k = 0; k < 32; k += hn::Lanes(df)) {
      const auto p = KeepRounded(hn::Mul(S::Load(src + k), vid));
      hn::StoreU(LowByte(hn::Trunc(AddHalfAway(p))), hn::Rebind<uint8_t, DF>(),
                 reinterpret_cast<uint8_t*>(Q8Codes(block)) + k);
    }
#endif
  }
};

// q4_0: m = the first element of largest magnitude (strict < in the reference), d = m / -8,
// q = min(15, trunc(x * (1/d) + 8.5)). m comes from the block's max and min: if one has the larger
// magnitude, every element of that magnitude has its sign; only a tie (+a and -a both present)
// needs the first occurrence, found by a scan. All zero: m = +0 (so d = -0, as in the reference).
struct Q4Kind {
  static constexpr size_t kBlockBytes = sizeof(BlockQ4_0);
  static constexpr void (*kReference)(const float*, void*) = &QuantizeBlockQ4_0;

  template <class S>
  static HWY_INLINE void Scales(const typename S::T* src, size_t count, float* id, uint16_t* dh) {
    const DF df;
    const DI32 di;
    constexpr size_t N = hn::MaxLanes(DF());
    using V = hn::Vec<DF>;
    struct MinMax {
      V lo, hi;
    };
    auto abs_bits = hn::Zero(di);  // the group's largest |x| bits, for the non-finite check
    const auto leaf = [&](size_t b) {
      if (b >= count) return MinMax{hn::Zero(df), hn::Zero(df)};
      MinMax r{S::Load(src + 32 * b), S::Load(src + 32 * b)};
      abs_bits = hn::Max(abs_bits, AbsBits(r.lo));
      for (size_t k = N; k < 32; k += N) {
        const auto v = S::Load(src + 32 * b + k);
        abs_bits = hn::Max(abs_bits, AbsBits(v));
        r.lo = hn::Min(r.lo, v);
        r.hi = hn::Max(r.hi, v);
      }
      return r;
    };
    const auto fold = [](MinMax a, MinMax b) {
      return MinMax{PairFold(a.lo, b.lo, MinOp()), PairFold(a.hi, b.hi, MaxOp())};
    };
    const MinMax mm = FoldBlocks<kGroup>(0, leaf, fold);
    const bool nonfinite = hn::GetLane(hn::MaxOfLanes(di, abs_bits)) > 0x7F7FFFFF;
    const auto neg_lo = hn::Neg(mm.lo);
    const auto signed_max = hn::IfThenElse(hn::Gt(neg_lo, mm.hi), mm.lo, mm.hi);
    auto m = hn::IfThenElseZero(hn::Ne(signed_max, hn::Zero(df)), signed_max);
    const auto tie = hn::And(hn::Eq(neg_lo, mm.hi), hn::Ne(mm.hi, hn::Zero(df)));
    if (!nonfinite && !hn::AllFalse(df, tie)) m = FirstOfLargestMagnitude<S>(src, count, m, tie);
    StoreScales(ExactDiv(m, hn::Set(df, -8.0f)), hn::FirstN(df, nonfinite ? kGroup : 0), id, dh);
  }

  // For the lanes in `tie`: the block's first element whose magnitude is |m|.
  template <class S>
  static HWY_NOINLINE hn::Vec<DF> FirstOfLargestMagnitude(const typename S::T* src, size_t count,
                                                          hn::Vec<DF> m, hn::Mask<DF> tie) {
    const DF df;
    HWY_ALIGN float ms[kGroup];
    HWY_ALIGN float is_tie[kGroup];
    hn::Store(m, df, ms);
    hn::Store(hn::IfThenElseZero(tie, hn::Set(df, 1.0f)), df, is_tie);
    for (size_t b = 0; b < count; ++b) {
      if (is_tie[b] == 0.0f) continue;
      for (int j = 0; j < 32; ++j) {
        const float x = LoadAsF32(src + 32 * b, S::kDType, j);
        if (std::fabs(x) == std::fabs(ms[b])) {
          ms[b] = x;
          break;
        }
      }
    }
    return hn::Load(df, ms);
  }

  template <class S>
  static HWY_INLINE void Codes(const typename S::T* src, hn::Vec<DF> vid, void* block) {
    const DF df;
    const auto code = [&](hn::Vec<DF> x) {
      const auto p = KeepRounded(hn::Mul(x, vid));
      return hn::Min(hn::Trunc(hn::Add(p, hn::Set(df, 8.5f))), hn::Set(df, 15.0f));
    };
    for (size_t j = 0; j < 16; j += hn::Lanes(df)) {
      // Element j in the low nibble, j + 16 in the high one; the sum is an exact integer.
      const auto packed =
          hn::Add(hn::Mul(code(S::Load(src + 16 + j)), hn::Set(df, 16.0f)), code(S::Load(src + j)));
      hn::StoreU(LowByte(packed), hn::Rebind<uint8_t, DF>(), Q4Codes(block) + j);
    }
  }
};

// The source of a large Put is read once, from L3 or memory (for q8_0 4x the bytes written), and
// the rows of one token span a single 4 KiB page, where the hardware prefetchers stop. Each block
// therefore asks for the source lines kPrefetchBytes ahead, the rows of the tokens that follow in
// the usual layout; 512 tokens x 8 heads x 128 f32 to q8_0: 140 -> 115 us (perf/bench_put). A
// prefetch never faults, so running past the end of the source is harmless.
constexpr size_t kPrefetchBytes = 8192;
template <typename T>
HWY_INLINE void PrefetchAhead(const T* block_src) {
  const char* p = reinterpret_cast<const char*>(block_src) + kPrefetchBytes;
  hwy::Prefetch(p);
  hwy::Prefetch(p + 64);  // a block of 32 f32 is two lines
}

// `rows` rows of row_elems elements each (row_elems % 32 == 0), back to back at src, to q8_0 or
// q4_0 rows at dst[0..rows), kChunk blocks at a time in two passes: every group's scales first, so
// that the division chains of consecutive groups overlap instead of stalling the codes, then the
// codes (the chunk's source, 16 KiB of f32 at most, is still in L1). Several rows per call because
// a 128-dim row is only 4 blocks and the scale pass works on kGroup blocks at a time; the codes go
// straight to each row (a stage in L1 plus a memcpy per row cost 17% of a 512-token scatter).
template <class S, class Kind>
void QuantizedRows(const void* src_v, int64_t row_elems, int64_t rows, char* const* dst) {
  constexpr size_t kChunk = 4 * kGroup;
  const auto* src = static_cast<const typename S::T*>(src_v);
  HWY_ALIGN float id[kChunk];
  HWY_ALIGN uint16_t dh[kChunk];
  const size_t per_row = static_cast<size_t>(row_elems) / 32;
  const size_t blocks = per_row * static_cast<size_t>(rows);
  size_t row = 0, in_row = 0;  // the next block's destination
  for (size_t c0 = 0; c0 < blocks; c0 += kChunk) {
    const size_t chunk = blocks - c0 < kChunk ? blocks - c0 : kChunk;
    for (size_t g = 0; g < chunk; g += kGroup)
      Kind::template Scales<S>(src + 32 * g, chunk - g < kGroup ? chunk - g : kGroup, id + g,
                               dh + g);
    for (size_t b = 0; b < chunk; ++b, src += 32) {
      PrefetchAhead(src);
      char* out = dst[row] + in_row * Kind::kBlockBytes;
      if (++in_row == per_row) in_row = 0, ++row;
      if (std::isnan(id[b])) {
        QuantizeBlockViaReference<S>(src, out, Kind::kReference);
        continue;
      }
      SetBlockScale(out, dh[b]);
      Kind::template Codes<S>(src, hn::Set(DF(), id[b]), out);
    }
  }
}

// One row of n elements (n % 32 == 0).
template <class S, class Kind>
void QuantizedRow(const void* src, void* dst, int64_t n) {
  char* const out = static_cast<char*>(dst);
  QuantizedRows<S, Kind>(src, n, 1, &out);
}

// pick(S()) for the source tag S of a float dtype; nullptr for the others.
template <class Pick>
auto PickForFloatSource(DType src, Pick pick) -> decltype(pick(F32T())) {
  switch (src) {
    case DType::kF32:
      return pick(F32T());
    case DType::kF16:
      return pick(F16T());
    case DType::kBF16:
      return pick(BF16T());
    default:
      return nullptr;
  }
}

using RowsFn = void (*)(const void* src, int64_t row_elems, int64_t rows, char* const* dst);

// The several-rows quantizer for a float source and a quantized destination, nullptr otherwise.
RowsFn PickQuantizedRowsFn(DType src, DType dst) {
  return PickForFloatSource(src, [dst](auto s) -> RowsFn {
    using S = decltype(s);
    if (dst == DType::kQ8_0) return &QuantizedRows<S, Q8Kind>;
    if (dst == DType::kQ4_0) return &QuantizedRows<S, Q4Kind>;
    return nullptr;
  });
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
      return &QuantizedRow<S, Q8Kind>;
    case DType::kQ4_0:
      return &QuantizedRow<S, Q4Kind>;
  }
  return nullptr;
}

// The streaming row converter for a float source and a float destination of another dtype (or
// f32 -> f32), nullptr for the rest (quantized rows are not whole cache lines).
RowFn PickStreamRowFn(DType src, DType dst) {
  if (src == dst && src != DType::kF32) return nullptr;
  return PickForFloatSource(src, [dst](auto s) -> RowFn {
    using S = decltype(s);
    switch (dst) {
      case DType::kF32:
        return &FloatRow<S, F32T, true>;
      case DType::kF16:
        return &FloatRow<S, F16T, true>;
      case DType::kBF16:
        return &FloatRow<S, BF16T, true>;
      default:
        return nullptr;
    }
  });
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
    const float scale = F16ToF32(BlockScale(in));
#if KV_CONVERT_SIMD_NOT_IEEE
    if (std::isnan(scale)) {  // the reference's scalar products keep the NaN's payload
      DequantizeBlockQ8_0(in, dst);
      continue;
    }
#endif
    const auto vd = hn::Set(df, scale);
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
    const float scale = F16ToF32(BlockScale(in));
#if KV_CONVERT_SIMD_NOT_IEEE
    if (std::isnan(scale)) {  // as in DequantQ8Row
      DequantizeBlockQ4_0(in, dst);
      continue;
    }
#endif
    const auto vd = hn::Set(df, scale);
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

// Bytes one ScatterToCells call writes from which float rows are streamed: a quarter of a
// typical L2 (a 512-token prefill of 8 heads x 128 f16 writes 1 MiB; a decode step 2 KiB).
constexpr size_t kStreamMinBytes = size_t{256} << 10;

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
  const size_t row_bytes = RowBytes(layout.dtype, hd);
  // Quantized rows of one token are quantized together, straight into their cells, when the
  // source holds its heads back to back (QuantizedRows).
  const RowsFn rows_fn = PickQuantizedRowsFn(src.dtype, layout.dtype);
  if (rows_fn != nullptr && packed &&
      src.nb[1] == static_cast<size_t>(hd) * BlockBytes(src.dtype)) {
    constexpr int32_t kRowsPerCall = 64;
    char* dst[kRowsPerCall];
    for (size_t t = 0; t < cells.size(); ++t) {
      const char* st = static_cast<const char*>(src.data) + t * src.nb[2];
      for (int32_t h0 = 0; h0 < layout.kv_heads; h0 += kRowsPerCall) {
        const int32_t rows = std::min(kRowsPerCall, layout.kv_heads - h0);
        for (int32_t r = 0; r < rows; ++r) dst[r] = block + CellRowOffset(layout, cells[t], h0 + r);
        rows_fn(st + h0 * src.nb[1], hd, rows, dst);
      }
    }
    return;
  }
  // A large batch of float rows that are whole cache lines is written with non-temporal stores:
  // the lines are not read for ownership first (the copy then costs what a large memcpy costs,
  // which avoids those reads too), and a batch this large would push its rows out of L1/L2 before
  // anything reads them anyway. Small batches (decode) keep plain stores: attention reads those
  // rows right after.
  const RowFn stream_fn = PickStreamRowFn(src.dtype, layout.dtype);
  const bool stream =
      stream_fn != nullptr && packed && row_bytes % 64 == 0 &&
      static_cast<size_t>(hd) % (2 * hn::Lanes(DF())) == 0 &&
      cells.size() * static_cast<size_t>(layout.kv_heads) * row_bytes >= kStreamMinBytes;
  if (stream) {
    for (size_t t = 0; t < cells.size(); ++t) {
      const char* st = static_cast<const char*>(src.data) + t * src.nb[2];
      for (int32_t h = 0; h < layout.kv_heads; ++h) {
        char* row = block + CellRowOffset(layout, cells[t], h);
        const bool aligned = (reinterpret_cast<uintptr_t>(row) & 63) == 0;
        (aligned ? stream_fn : fn)(st + h * src.nb[1], row, hd);
      }
    }
    hwy::FlushStream();  // order the non-temporal stores before anything that follows
    return;
  }
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
