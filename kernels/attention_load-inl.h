// Per-target loaders shared by kernels/attention.cc (prefill) and kernels/attention_decode.cc:
// a run of one K/V row's elements as f32 in registers, for every storage type, and quantized block
// scales. Included once per Highway target by each translation unit (the usual -inl.h toggle).
#if defined(KVCACHE_KERNELS_ATTENTION_LOAD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVCACHE_KERNELS_ATTENTION_LOAD_INL_H_
#undef KVCACHE_KERNELS_ATTENTION_LOAD_INL_H_
#else
#define KVCACHE_KERNELS_ATTENTION_LOAD_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "hwy/highway.h"
#include "kernels/attention_internal.h"
#include "kernels/f16-inl.h"
#include "kernels/fp_barrier-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
inline constexpr size_t kN = hn::MaxLanes(DF());
static_assert(32 % kN == 0, "a vector never straddles a quantized block");

// ---- loading a run of elements of one row as f32 ----------------------------------------------

// f16 -> f32, exact for every input: F16C where the CPU has it, else F16BitsToF32 (Highway
// 1.0.3's emulation reads inf/NaN as finite; kernels/f16-inl.h).
template <class D, class VH>
HWY_INLINE hn::Vec<D> PromoteF16(D df, VH h) {
#if HWY_TARGET >= HWY_SSE4 || defined(HWY_DISABLE_F16C)
  const hn::Rebind<uint16_t, D> du16;
  return F16BitsToF32(df, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::BitCast(du16, h)));
#else
  return hn::PromoteTo(df, h);
#endif
}

// Elements [i, i + kN) of a float-typed row. Precondition: i + kN <= row length.
template <DType T>
HWY_INLINE VF LoadFloat(DF df, const void* row, int64_t i) {
  if constexpr (T == DType::kF32) {
    return hn::LoadU(df, static_cast<const float*>(row) + i);
  } else if constexpr (T == DType::kF16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return PromoteF16(df, hn::LoadU(dh, static_cast<const hwy::float16_t*>(row) + i));
  } else {
    const hn::Rebind<hwy::bfloat16_t, DF> db;
    return hn::PromoteTo(df, hn::LoadU(db, static_cast<const hwy::bfloat16_t*>(row) + i));
  }
}

// The last n < kN elements starting at i, zero-filled, without reading past the row.
template <DType T>
HWY_INLINE VF LoadFloatTail(DF df, const void* row, int64_t i, int64_t n) {
  HWY_ALIGN float buf[kN] = {};
  for (int64_t t = 0; t < n; ++t) buf[t] = LoadAsF32(row, T, i + t);
  return hn::Load(df, buf);
}

// Mask values [i, i + kN) of one mask row, f32 or f16 (the kernels' contract, checked by Attend).
// Precondition: i + kN <= the row's length.
HWY_INLINE VF LoadMaskValues(DF df, DType mask_dtype, const void* row, int64_t i) {
  return mask_dtype == DType::kF16 ? LoadFloat<DType::kF16>(df, row, i)
                                   : LoadFloat<DType::kF32>(df, row, i);
}

// Codes of elements [i, i + kN) of a quantized row as f32 (not yet scaled). i % kN == 0.
template <DType T>
HWY_INLINE VF LoadCodes(DF df, const void* row, int64_t i) {
  const hn::Rebind<int32_t, DF> di;
  const int64_t blk = i / 32;
  const int64_t w = i % 32;
  if constexpr (T == DType::kQ8_0) {
    const char* b = static_cast<const char*>(row) + blk * sizeof(BlockQ8_0);
    const hn::Rebind<int8_t, DF> d8;
    return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, Q8Codes(b) + w)));
  } else {
    const char* b = static_cast<const char*>(row) + blk * sizeof(BlockQ4_0);
    const hn::Rebind<uint8_t, DF> du8;
    const hn::Rebind<uint32_t, DF> du;
    const auto bytes = hn::PromoteTo(du, hn::LoadU(du8, Q4Codes(b) + (w & 15)));
    const auto nib = w < 16 ? hn::And(bytes, hn::Set(du, 15u)) : hn::ShiftRight<4>(bytes);
    return hn::ConvertTo(df, hn::Sub(hn::BitCast(di, nib), hn::Set(di, 8)));
  }
}

template <DType T>
HWY_INLINE float BlockScale(const void* row, int64_t blk) {
  uint16_t bits;
  std::memcpy(&bits, static_cast<const char*>(row) + static_cast<size_t>(blk) * BlockBytes(T), 2);
#if HWY_TARGET == HWY_SCALAR
  return F16ToF32(bits);  // layouts/dtype.h, exact
#else
  // One vector f16 -> f32 conversion (F16C on AVX2/AVX-512; PromoteF16 is exact) instead of the
  // branchy bit arithmetic: the K loop converts one scale per row and block.
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<uint16_t, decltype(d1)> du1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(PromoteF16(d1, hn::BitCast(dh1, hn::Set(du1, bits))));
#endif
}

// ---- horizontal reductions of four vectors at once ----------------------------------------------

// The two reductions of Reduce4 and ReduceEach: the pairwise operation, and all lanes of one
// vector.
struct AddOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Add(a, b);
  }
  HWY_INLINE static float AllLanes(DF df, VF v) { return hn::GetLane(hn::SumOfLanes(df, v)); }
};
struct MaxOp {
  template <class V>
  HWY_INLINE V operator()(V a, V b) const {
    return hn::Max(a, b);
  }
  HWY_INLINE static float AllLanes(DF df, VF v) { return hn::GetLane(hn::MaxOfLanes(df, v)); }
};

#if HWY_TARGET != HWY_SCALAR
// [op over a0's lanes, .. op over a3's lanes] for op = Add or Max: two interleave rounds inside
// each 128-bit block, then halves combined down to 128 bits. About a third of the shuffles of four
// separate SumOfLanes / MaxOfLanes, which dominated the decode K loop (sums) and cost a tenth of a
// prefill tile's softmax (per row, a max and a sum).
template <class Op = AddOp>
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec128<float> v, Op = {}) {
  return v;
}
#if HWY_CAP_GE256
template <class Op = AddOp>
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec256<float> v, Op op = {}) {
  return op(hn::LowerHalf(v), hn::UpperHalf(hn::Full128<float>(), v));
}
#endif
#if HWY_CAP_GE512
template <class Op = AddOp>
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec512<float> v, Op op = {}) {
  return BlocksTo128(op(hn::LowerHalf(v), hn::UpperHalf(hn::Full256<float>(), v)), op);
}
#endif
// Each 128-bit block of the result holds [op x0, op x1, op x2, op x3] over that block's lanes.
template <class Op = AddOp>
HWY_INLINE VF PairSums(DF df, VF x, VF y, Op op = {}) {
  return op(hn::InterleaveLower(df, x, y), hn::InterleaveUpper(df, x, y));
}
template <class Op = AddOp>
HWY_INLINE VF QuadSums(DF df, VF x0, VF x1, VF x2, VF x3, Op op = {}) {
  const VF t0 = PairSums(df, x0, x1, op);
  const VF t1 = PairSums(df, x2, x3, op);
  const hn::Repartition<uint64_t, DF> du;
  return op(hn::BitCast(df, hn::InterleaveLower(du, hn::BitCast(du, t0), hn::BitCast(du, t1))),
            hn::BitCast(df, hn::InterleaveUpper(du, hn::BitCast(du, t0), hn::BitCast(du, t1))));
}
template <class Op = AddOp>
HWY_INLINE hn::Vec128<float> Reduce4(DF df, VF a0, VF a1, VF a2, VF a3, Op op = {}) {
  return BlocksTo128(QuadSums(df, a0, a1, a2, a3, op), op);
}
#endif

// out[i] = op over the lanes of v[i] for i < kCount: four vectors at a time (Reduce4), the rest one
// by one.
template <int kCount, class Op>
HWY_INLINE void ReduceEach(DF df, const VF* v, Op op, float* HWY_RESTRICT out) {
  int i = 0;
#if HWY_TARGET != HWY_SCALAR
  for (; i + 4 <= kCount; i += 4) {
    hn::StoreU(Reduce4(df, v[i], v[i + 1], v[i + 2], v[i + 3], op), hn::Full128<float>(), out + i);
  }
#endif
  (void)op;
  for (; i < kCount; ++i) out[i] = Op::AllLanes(df, v[i]);
}

// ---- the online softmax -------------------------------------------------------------------------

// e^x for softmax weights, x = a logit minus the running max (<= 0 where it matters; lanes above 0
// are only ever padding, clamped to 88 so they stay finite). Below -87 the result is clamped to
// e^-87 ~ 1.6e-38 (the smallest power of two formed below is 2^-126): callers zero hidden cells
// themselves, and a visible weight that small moves nothing next to the max's weight of 1.
// x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that k ln2 is exact), e^r by its Taylor
// series to degree 7 in FMAs (truncation < 6e-9 relative, under half an ULP), 2^k built in the
// exponent field: at most 0.93 ULP from e^x (a scalar copy of these steps against double exp, every
// 4th float of [-87, 0]), exact at x == 0. 17 operations against the ~25 of Highway's general Exp
// (which covers the whole range and denormals) on a path that runs once per score: prefill and
// decode 2-5% faster per call (f16 / q8_0, head_dim 64 / 128, calls alternating in one process).
// On AVX-512 vscalefps forms p * 2^k from k as a float (13 operations): the same result bit for
// bit (both round the exact product once; checked over all 2^32 inputs), decode in cache 1-2%
// faster per call (session 15, Zen 4, where every vector operation here takes an FP pipe slot).
HWY_INLINE VF SoftmaxExp(DF df, VF x) {
  const hn::RebindToSigned<DF> di;
  x = hn::Min(hn::Max(x, hn::Set(df, -87.0f)), hn::Set(df, 88.0f));
#if HWY_TARGET <= HWY_AVX3
  const VF k = hn::Round(hn::Mul(x, hn::Set(df, 1.44269504088896341f)));
#else
  // k by adding 1.5 * 2^23: the sum rounds to an integer (to even, as Round does) and keeps k in
  // its low mantissa bits, which the shift below moves into 2^k's exponent, so no float -> int
  // conversion (Highway's ConvertTo adds 4 operations of out-of-range fix-up on AVX2 that
  // -126 <= k <= 127 never needs). The product stays rounded on its own (KeepRounded: fused into an
  // FMA it would round ties differently): the same k, bit for bit, as Round (all 2^32 inputs
  // checked, session 22).
  const VF magic = hn::Set(df, 12582912.0f);
  const VF k_plus_magic =
      hn::Add(KeepRounded(hn::Mul(x, hn::Set(df, 1.44269504088896341f))), magic);
  const VF k = hn::Sub(k_plus_magic, magic);
#endif
  VF r = hn::MulAdd(k, hn::Set(df, -0.693145751953125f), x);
  r = hn::MulAdd(k, hn::Set(df, -1.428606765330187e-6f), r);
  VF p = hn::Set(df, 1.0f / 5040.0f);
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f / 720.0f));
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f / 120.0f));
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f / 24.0f));
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f / 6.0f));
  p = hn::MulAdd(p, r, hn::Set(df, 0.5f));
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(df, 1.0f));
#if HWY_TARGET <= HWY_AVX3
  (void)di;
  return VF{_mm512_scalef_ps(p.raw, k.raw)};  // p * 2^k in one instruction, the same rounding
#else
  // k_plus_magic's bits are 0x4B400000 + k; shifted by 23 the constant's bits leave the word.
  const auto two_k = hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, k_plus_magic), hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(df, two_k));
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#endif  // KVCACHE_KERNELS_ATTENTION_LOAD_INL_H_
