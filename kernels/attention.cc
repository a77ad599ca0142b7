// Highway translation unit of the attention kernel (kernels/attention.h has the contract, the
// shapes and the memory-traffic derivation of each mode).
//
// Decode: task = (KV head, chunk of cells). Inside a task the chunk is walked in blocks of 128
// cells; for each batch row, the row's visible spans (found once per row before the tasks start)
// are intersected with the block, and for each visible piece the K rows are converted in registers
// once and dotted with up to 8 query heads of the group at a time; then one online-softmax update
// per head and one pass over the V rows with the heads' accumulators. Each task leaves (m, l, acc)
// partials; a merge combines the chunks, adds the sink and divides.
// Prefill: task = (KV head, tile of batch rows). K tiles of 4 vectors' worth of cells are converted
// (and transposed) into f32 once, V tiles likewise, and every query row of the tile (rows x heads
// of the group) runs register-blocked 4 x 4-vector FMA kernels over them with no horizontal sums.
//
// AVX3_DL (AVX-512 with VNNI) is compiled too: the integer V pass uses its vpdpwssd. Highway 1.0.3
// leaves the target out unless asked; it must be asked before any Highway header.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif
#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "layouts/quant.h"

#ifndef KVCACHE_KERNELS_ATTENTION_SHARED_
#define KVCACHE_KERNELS_ATTENTION_SHARED_
#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"

namespace kv::kernels {
namespace attn {

inline constexpr int64_t kBlockCells = 128;  // decode: cells per online-softmax update
inline constexpr int64_t kMaxPass = 8;       // decode: query heads served by one K row load
inline constexpr int64_t kRowPad = 16;       // row padding (floats) valid for every target

constexpr int64_t Pad(int64_t n) { return (n + kRowPad - 1) / kRowPad * kRowPad; }

struct Ctx {
  TensorView q, k, v, mask, out;
  AttentionKernelParams p;
  int64_t D, Dv, Hkv, L, B, Hq, G;
  int64_t Dp, Dvp;  // padded to kRowPad
  // decode
  const int32_t* spans = nullptr;  // pairs [start, end) of visible cells, per row
  const int64_t* span_off =
      nullptr;  // row b's pairs: spans[2 * span_off[b] .. 2 * span_off[b + 1])
  int64_t n_chunks = 1, chunk = 0;
  int64_t task_heads = 1;     // KV heads per task: task t = (heads [t / n_chunks * task_heads, ..),
                              // chunk t % n_chunks)
  float* partials = nullptr;  // [Hkv * n_chunks][B][G][Dvp + kRowPad]: acc, then m, l
  // prefill
  const int32_t* row_lo = nullptr;  // first visible cell of row b (L when none)
  const int32_t* row_hi = nullptr;  // last visible cell + 1 (0 when none)
  int64_t q_tile = 1, n_qtiles = 1;
};

inline int64_t PartialStride(const Ctx& c) { return c.Dvp + kRowPad; }

// One 64-byte-aligned float buffer per thread, grown to the largest size asked for.
// Per-thread scratch that only grows. Growth is geometric with a 256 KiB floor: the visible-span
// table needs B * (L / 2 + 1) entries, so growing to the exact size reallocated on every other
// decode step as the history lengthened. With the floor a single decoding sequence never
// reallocates below ~128K cells, and beyond that it reallocates O(log L) times.
inline float* ThreadScratch(size_t floats, int which) {
  constexpr size_t kMinFloats = size_t{1} << 16;
  thread_local hwy::AlignedFreeUniquePtr<float[]> buf[3];
  thread_local size_t cap[3] = {0, 0, 0};
  if (cap[which] < floats) {
    const size_t grown = std::max({floats, 2 * cap[which], kMinFloats});
    buf[which] = hwy::AllocateAligned<float>(grown);
    cap[which] = grown;
  }
  return buf[which].get();
}

// mask[b * L + j]: row b (batch token), cell j.
inline float MaskValue(const TensorView& mask, int64_t b, int64_t j) {
  return ElementAsF32(mask, j, b);
}

// Calls emit(s0, s1) for each maximal run [s0, s1) of cells j in [0, L) where masked(j) is false.
template <class Masked, class Emit>
void ForEachVisibleSpan(int64_t L, const Masked& masked, const Emit& emit) {
  int64_t j = 0;
  while (j < L) {
    while (j < L && masked(j)) ++j;
    if (j == L) break;
    const int64_t s0 = j;
    while (j < L && !masked(j)) ++j;
    emit(s0, j);
  }
}

// f16 scale of a quantized block to f32: exact for zero, subnormal and normal values (the bits are
// placed as an f32 with the exponent rebias done by one multiply); inf/NaN take the slow path.
inline float F16ScaleToF32(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u) return F16ToF32(h);
  const uint32_t bits =
      (static_cast<uint32_t>(h & 0x8000u) << 16) | (static_cast<uint32_t>(h & 0x7FFFu) << 13);
  return F32FromBits(bits) * 0x1p112f;
}

}  // namespace attn
}  // namespace kv::kernels
#endif  // KVCACHE_KERNELS_ATTENTION_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention.cc"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using attn::Ctx;
using attn::kBlockCells;
using attn::kMaxPass;
using attn::kRowPad;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
constexpr size_t kN = hn::MaxLanes(DF());
static_assert(32 % kN == 0, "a vector never straddles a quantized block");

// ---- loading a run of elements of one row as f32 ----------------------------------------------

// f16 -> f32, exact for every input. Targets without F16C get Highway 1.0.3's software conversion,
// which reads exponent 31 as 2^16 * (1 + m / 1024); those lanes (inf, NaN) are rebuilt here.
template <class D, class VH>
HWY_INLINE hn::Vec<D> PromoteF16(D df, VH h) {
  const hn::Vec<D> f = hn::PromoteTo(df, h);
#if HWY_TARGET >= HWY_SSE4 || defined(HWY_DISABLE_F16C)
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> du16;
  const auto bits = hn::PromoteTo(du, hn::BitCast(du16, h));
  const auto special = hn::Eq(hn::And(bits, hn::Set(du, 0x7C00u)), hn::Set(du, 0x7C00u));
  const auto rebuilt = hn::Or(
      hn::ShiftLeft<16>(hn::And(bits, hn::Set(du, 0x8000u))),
      hn::Or(hn::Set(du, 0x7F800000u), hn::ShiftLeft<13>(hn::And(bits, hn::Set(du, 0x3FFu)))));
  return hn::IfThenElse(hn::RebindMask(df, special), hn::BitCast(df, rebuilt), f);
#else
  return f;
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
  return attn::F16ScaleToF32(bits);
#else
  // One vector f16 -> f32 conversion (F16C on AVX2/AVX-512; PromoteF16 is exact) instead of the
  // branchy bit arithmetic: the K loop converts one scale per row and block.
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<uint16_t, decltype(d1)> du1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(PromoteF16(d1, hn::BitCast(dh1, hn::Set(du1, bits))));
#endif
}

// ---- decode
// --------------------------------------------------------------------------------------

constexpr int64_t kScaleStride = kBlockCells + kRowPad;
// K rows are prefetched about this many bytes ahead, 8 to 48 rows: f16 K at head_dim 64 (128-byte
// rows) ran 9-13% faster with 32 rows ahead than with 8 (1 and 2 threads, 32768 cells, calls
// alternating in one process); at head_dim 128 8 and 16 rows were within noise, and q8_0 rows
// (68 / 136 bytes) gained up to 5% from 16 -> 32. Earlier: 8 q8_0 rows left the K loop stalled.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kMaxQBlocks = kAttentionMaxHeadDim / 32;

// The f16 block scales of n quantized rows, converted with vector f16 -> f32 (exact) instead of
// one scalar conversion per (row, block, vector): out[blk * kScaleStride + j]. (A 32-bit
// GatherOffset per vector of rows instead of the 2-byte copies measured the same: ~8% of an
// in-cache q8_0 decode either way.)
template <DType T>
HWY_INLINE void GatherScales(DF df, const char* row0, size_t stride, int64_t n, int64_t nblk,
                             float* out) {
  HWY_ALIGN uint16_t tmp[kScaleStride];
  const hn::Rebind<hwy::float16_t, DF> dh;
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const char* p = row0 + static_cast<size_t>(blk) * BlockBytes(T);
    for (int64_t j = 0; j < n; ++j) std::memcpy(&tmp[j], p + static_cast<size_t>(j) * stride, 2);
    for (int64_t j = n; j < attn::Pad(n); ++j) tmp[j] = 0;
    for (int64_t j = 0; j < n; j += kN) {
      hn::Store(PromoteF16(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(tmp) + j)), df,
                out + blk * kScaleStride + j);
    }
  }
}

// Chunks of dims accumulated per pass over the cells: kVChunks * kG independent FMA chains (the
// chain runs along the cells) and each broadcast weight reused kVChunks times. AVX-512 has 32
// registers for 4 x 4 accumulators; narrower targets take 2.
#if HWY_TARGET <= HWY_AVX3
constexpr int64_t kVChunks = 4;
#else
constexpr int64_t kVChunks = 2;
#endif

// Integer arithmetic was measured and not kept, for precision: int16 V weights with vpdpwssd
// (AVX512_VNNI) cut this pass by more than half (q8_0 D 128, 1 thread: 1.49x f16 per call), but the
// 15-bit weights moved end_to_end_test's q8_0 logits against its stored-value reference by up to
// 9.6e-3 (tolerance 1e-2; f32 arithmetic gives 3e-6); an int8 query for the K side (llama.cpp's
// q8_0 x q8_0 dot) moved them by 1.3e-2 to 3.8e-2.
// Quantized plain V, dims [blk0 * 32, blk0 * 32 + kSpan): the weights p[g][j] * d_blk[j] are
// formed once per block (vectors over j), then each row's codes are converted once and FMAed into
// every head's accumulators, kC chunks per pass.
template <DType T, int kG, int64_t kC>
HWY_INLINE void AccumQuantGroup(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t blk0,
                                const float* p, int64_t p_stride, const float* vscale, float* acc,
                                int64_t acc_stride) {
  constexpr int64_t kPass = kC * static_cast<int64_t>(kN);
  constexpr int64_t kBlocks = kPass >= 32 ? kPass / 32 : 1;
  constexpr int64_t kSpan = kBlocks * 32;
  HWY_ALIGN float w[kBlocks][kG][kScaleStride];
  for (int64_t lb = 0; lb < kBlocks; ++lb) {
    for (int g = 0; g < kG; ++g) {
      for (int64_t j = 0; j < n; j += kN) {
        hn::Store(hn::Mul(hn::Load(df, p + g * p_stride + j),
                          hn::Load(df, vscale + (blk0 + lb) * kScaleStride + j)),
                  df, &w[lb][g][j]);
      }
    }
  }
  for (int64_t i = blk0 * 32; i < blk0 * 32 + kSpan; i += kPass) {
    VF a[kC][kG];
    for (int64_t c = 0; c < kC; ++c)
      for (int g = 0; g < kG; ++g) a[c][g] = hn::Load(df, acc + g * acc_stride + i + c * kN);
    for (int64_t j = 0; j < n; ++j) {
      const char* vr = vrow0 + static_cast<size_t>(j) * vstride;
      for (int64_t c = 0; c < kC; ++c) {
        const int64_t lb = (i + c * static_cast<int64_t>(kN)) / 32 - blk0;
        const VF vv = LoadCodes<T>(df, vr, i + c * kN);
        for (int g = 0; g < kG; ++g) a[c][g] = hn::MulAdd(hn::Set(df, w[lb][g][j]), vv, a[c][g]);
      }
    }
    for (int64_t c = 0; c < kC; ++c)
      for (int g = 0; g < kG; ++g) hn::Store(a[c][g], df, acc + g * acc_stride + i + c * kN);
  }
}

template <DType T, int kG>
HWY_INLINE void AccumQuant(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t Dv,
                           const float* p, int64_t p_stride, const float* vscale, float* acc,
                           int64_t acc_stride) {
  constexpr int64_t kC = kG <= 4 ? kVChunks : 1;
  constexpr int64_t kPass = kC * static_cast<int64_t>(kN);
  constexpr int64_t kBlocks = kPass >= 32 ? kPass / 32 : 1;
  int64_t blk = 0;
  for (; blk + kBlocks <= Dv / 32; blk += kBlocks) {
    AccumQuantGroup<T, kG, kC>(df, vrow0, vstride, n, blk, p, p_stride, vscale, acc, acc_stride);
  }
  for (; blk < Dv / 32; ++blk) {  // a block left over (Dv / 32 odd with two-block passes)
    constexpr int64_t kC1 = 32 / static_cast<int64_t>(kN) < kC ? 32 / static_cast<int64_t>(kN) : kC;
    AccumQuantGroup<T, kG, kC1>(df, vrow0, vstride, n, blk, p, p_stride, vscale, acc, acc_stride);
  }
}

#if HWY_TARGET == HWY_AVX3_DL
// ---- quantized plain V with integer products (AttentionKernelParams::integer_v) ----------------
// AVX3_DL only: with VNNI's vpdpwssd (16 x 2 int16 products summed into int32 in one instruction)
// the pass runs ~1.4x faster per q8_0 decode call at head_dim 128; with AVX-512's vpmaddwd + add
// it measured no faster than the f32 pass, and on AVX2 slower, so other targets run the f32 pass.
// acc[g] += sum_j p[g][j] * d_j * code_j with each weight w = p * d rounded to 16 bits against a
// bound on |w| over its group of 16 cells (one vector of weights), the 32 codes of a block widened
// to int16 and two cells interleaved, so that one vpdpwssd per head adds both cells' products for
// 16 dims; one f32 multiply-add per group and head turns the int32 sums back into floats.
// Error: with M = pmax * dmax >= the group's largest |w|, each weight is off by <= M / 65534; over
// a group's <= 16 cells (|code| <= c = 127, q4_0 8) divided by the softmax denominator l (>= every
// group's pmax), the output moves by at most 16 * 2^-16 * c * max d = 2.4e-4 * max|V| (max|V| =
// c * d for blocks quantized to the full code range). The roundings are independent: measured
// errors are ~10x below the bound. Int32 sums are exact (16 * 32767 * 127 < 2^31). Blocks with a
// non-finite scale take the f32 path (NaN/inf propagate as there).
using DI32 = hn::RebindToSigned<DF>;
using DI16 = hn::Repartition<int16_t, DF>;
using VI32 = hn::Vec<DI32>;
using VI16 = hn::Vec<DI16>;
static_assert(kN == 16, "one int16 vector holds one block's 32 codes");

// The 32 codes of one quantized block, widened to int16.
template <DType T>
HWY_INLINE VI16 LoadBlockCodes16(const char* block) {
  const DI16 d16;
  if constexpr (T == DType::kQ8_0) {
    const hn::Rebind<int8_t, DI16> d8;
    return hn::PromoteTo(d16, hn::LoadU(d8, Q8Codes(block)));
  } else {  // q4_0: low nibbles are elements 0-15, high nibbles 16-31
    const hn::Half<DI16> dh;
    const hn::Rebind<uint8_t, decltype(dh)> du8;
    const auto bytes = hn::BitCast(
        dh, hn::PromoteTo(hn::RebindToUnsigned<decltype(dh)>(), hn::LoadU(du8, Q4Codes(block))));
    const auto codes = hn::Combine(d16, hn::ShiftRight<4>(bytes), hn::And(bytes, hn::Set(dh, 15)));
    return hn::Sub(codes, hn::Set(d16, 8));
  }
}

// sum + the pairwise products of adjacent int16 lanes of a and b (vpdpwssd). Highway 1.0.3
// detects AVX512_VNNI for AVX3_DL but compiles the target without it (its target string names the
// VEX "avxvnni"), so the intrinsic cannot inline here: the instruction is written out.
HWY_INLINE VI32 PairDot(VI16 a, VI16 b, VI32 sum) {
  __m512i acc = sum.raw;
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a.raw), "v"(b.raw));
  return VI32{acc};
}

// Interleaving two cells' codes works inside 128-bit blocks: block t of `lo` holds dims 8t .. 8t+3
// and of `hi` 8t+4 .. 8t+7. d0 / d1 get dims 0..15 / 16..31 in order.
HWY_INLINE void UnzipDims(VF lo, VF hi, VF& d0, VF& d1) {
  const __m512 a = _mm512_shuffle_f32x4(lo.raw, hi.raw, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 b = _mm512_shuffle_f32x4(lo.raw, hi.raw, _MM_SHUFFLE(3, 2, 3, 2));
  d0 = VF{_mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(3, 1, 2, 0))};
  d1 = VF{_mm512_shuffle_f32x4(b, b, _MM_SHUFFLE(3, 1, 2, 0))};
}

template <DType T, int kG>
HWY_INLINE void AccumQuantInt(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t Dv,
                              const float* p, int64_t p_stride, const float* vscale, float* acc,
                              int64_t acc_stride) {
  const DI32 di;
  const DI16 d16;
  const hn::Rebind<int16_t, DF> dq;
  constexpr int64_t kWq = kBlockCells + kRowPad;
  constexpr int64_t kGroups = kBlockCells / static_cast<int64_t>(kN);
  // Each group's weights are rounded against the bound pmax * dmax (largest p of the head in the
  // group times the largest |d| of the block in the group): kG + blocks reductions per group
  // instead of kG * blocks. A group whose p are all below 2^-60 is dropped: l >= 1 (it holds the
  // running maximum's own weight), so it could move the output by < 16 * 2^-60 * max|V|.
  float pmax[kG][kGroups], pinv[kG][kGroups];
  for (int g = 0; g < kG; ++g) {
    for (int64_t j = 0, grp = 0; j < n; j += kN, ++grp) {
      const float m = hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, p + g * p_stride + j)));
      pmax[g][grp] = m >= 0x1p-60f ? m : 0.0f;
      pinv[g][grp] = m >= 0x1p-60f ? 1.0f / m : 0.0f;
    }
  }
  HWY_ALIGN int16_t wq[kG][kWq];
  float gstep[kG][kGroups];
  for (int64_t blk = 0; blk < Dv / 32; ++blk) {
    const float* d = vscale + blk * kScaleStride;
    float dmax[kGroups], dinv[kGroups];
    bool finite = true;
    for (int64_t j = 0, grp = 0; j < n; j += kN, ++grp) {
      const VF dv = hn::Load(df, d + j);
      finite &= hn::AllTrue(df, hn::IsFinite(dv));
      dmax[grp] = hn::GetLane(hn::MaxOfLanes(df, hn::Abs(dv)));
      // A nonzero f16 scale is >= 2^-24: with pinv <= 2^60 the product below stays finite.
      dinv[grp] = dmax[grp] > 0.0f ? 32767.0f / dmax[grp] : 0.0f;
    }
    if (!finite) {  // inf / NaN scales: the f32 path, which propagates them
      AccumQuantGroup<T, kG, 2>(df, vrow0, vstride, n, blk, p, p_stride, vscale, acc, acc_stride);
      continue;
    }
    for (int g = 0; g < kG; ++g) {
      for (int64_t j = 0, grp = 0; j < n; j += kN, ++grp) {
        const VF w = hn::Mul(hn::Load(df, p + g * p_stride + j), hn::Load(df, d + j));
        const VF inv = hn::Set(df, pinv[g][grp] * dinv[grp]);
        hn::Store(hn::DemoteTo(dq, hn::NearestInt(hn::Mul(w, inv))), dq, &wq[g][j]);
        gstep[g][grp] = pmax[g][grp] * dmax[grp] * (1.0f / 32767.0f);
      }
    }
    const char* vblk = vrow0 + static_cast<size_t>(blk) * BlockBytes(T);
    constexpr int kP = kG < 4 ? kG : 4;  // heads per pass: 2 x kP int32 and f32 accumulators
    for (int g0 = 0; g0 < kG; g0 += kP) {
      VF pa[kP][2];
      for (int g = 0; g < kP; ++g) pa[g][0] = pa[g][1] = hn::Zero(df);
      for (int64_t j0 = 0, grp = 0; j0 < n; j0 += kN, ++grp) {
        VI32 ia[kP][2];
        for (int g = 0; g < kP; ++g) ia[g][0] = ia[g][1] = hn::Zero(di);
        const int64_t j1 = std::min<int64_t>(n, j0 + kN);
        for (int64_t j = j0; j < j1; j += 2) {
          const char* r0 = vblk + static_cast<size_t>(j) * vstride;
          const VI16 c0 = LoadBlockCodes16<T>(r0);
          // An odd last cell pairs with zeros (its partner's weight is 0 too: p is zero-padded).
          const VI16 c1 = j + 1 < n ? LoadBlockCodes16<T>(r0 + vstride) : hn::Zero(d16);
          const VI16 lo = hn::InterleaveLower(d16, c0, c1);
          const VI16 hi = hn::InterleaveUpper(d16, c0, c1);
          for (int g = 0; g < kP; ++g) {
            int32_t pair;  // the two cells' weights, as vpdpwssd pairs them
            std::memcpy(&pair, &wq[g0 + g][j], sizeof(pair));
            const VI16 wv = hn::BitCast(d16, hn::Set(di, pair));
            ia[g][0] = PairDot(lo, wv, ia[g][0]);
            ia[g][1] = PairDot(hi, wv, ia[g][1]);
          }
        }
        for (int g = 0; g < kP; ++g) {
          const VF step = hn::Set(df, gstep[g0 + g][grp]);
          pa[g][0] = hn::MulAdd(hn::ConvertTo(df, ia[g][0]), step, pa[g][0]);
          pa[g][1] = hn::MulAdd(hn::ConvertTo(df, ia[g][1]), step, pa[g][1]);
        }
      }
      for (int g = 0; g < kP; ++g) {
        VF d0, d1;
        UnzipDims(pa[g][0], pa[g][1], d0, d1);
        float* a = acc + (g0 + g) * acc_stride + blk * 32;
        hn::Store(hn::Add(hn::Load(df, a), d0), df, a);
        hn::Store(hn::Add(hn::Load(df, a + kN), d1), df, a + kN);
      }
    }
  }
}
#endif  // AVX3_DL

#if HWY_TARGET != HWY_SCALAR
// Horizontal sums of four vectors at once, [sum a0, sum a1, sum a2, sum a3]: two interleave-add
// rounds inside each 128-bit block, then halves added down to 128 bits. About a third of the
// shuffles of four separate SumOfLanes, which dominated the decode K loop.
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec128<float> v) { return v; }
#if HWY_CAP_GE256
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec256<float> v) {
  return hn::Add(hn::LowerHalf(v), hn::UpperHalf(hn::Full128<float>(), v));
}
#endif
#if HWY_CAP_GE512
HWY_INLINE hn::Vec128<float> BlocksTo128(hn::Vec512<float> v) {
  return BlocksTo128(hn::Add(hn::LowerHalf(v), hn::UpperHalf(hn::Full256<float>(), v)));
}
#endif
// Each 128-bit block of the result holds [sum x0, sum x1, sum x2, sum x3] over that block's lanes:
// two interleave-add rounds inside the blocks.
HWY_INLINE VF PairSums(DF df, VF x, VF y) {
  return hn::Add(hn::InterleaveLower(df, x, y), hn::InterleaveUpper(df, x, y));
}
HWY_INLINE VF QuadSums(DF df, VF x0, VF x1, VF x2, VF x3) {
  const VF t0 = PairSums(df, x0, x1);
  const VF t1 = PairSums(df, x2, x3);
  const hn::Repartition<uint64_t, DF> du;
  return hn::Add(
      hn::BitCast(df, hn::InterleaveLower(du, hn::BitCast(du, t0), hn::BitCast(du, t1))),
      hn::BitCast(df, hn::InterleaveUpper(du, hn::BitCast(du, t0), hn::BitCast(du, t1))));
}
HWY_INLINE hn::Vec128<float> Reduce4(DF df, VF a0, VF a1, VF a2, VF a3) {
  return BlocksTo128(QuadSums(df, a0, a1, a2, a3));
}
#endif

// s[g] = dot(krow, qs + g * Dp) for kG heads; K converted once per vector, used by every head.
template <DType T, int kG>
HWY_INLINE void DotHeads(DF df, const void* krow, const float* qs, int64_t Dp, int64_t D, float* s,
                         int64_t s_stride) {
  VF acc[kG];
  for (int g = 0; g < kG; ++g) acc[g] = hn::Zero(df);
  if constexpr (IsQuantized(T)) {
    for (int64_t blk = 0; blk < D / 32; ++blk) {
      const VF scale = hn::Set(df, BlockScale<T>(krow, blk));
      for (int64_t w = 0; w < 32; w += kN) {
        const int64_t i = blk * 32 + w;
        const VF kv = hn::Mul(LoadCodes<T>(df, krow, i), scale);
        for (int g = 0; g < kG; ++g)
          acc[g] = hn::MulAdd(hn::LoadU(df, qs + g * Dp + i), kv, acc[g]);
      }
    }
  } else {
    int64_t i = 0;
    for (; i + static_cast<int64_t>(kN) <= D; i += kN) {
      const VF kv = LoadFloat<T>(df, krow, i);
      for (int g = 0; g < kG; ++g) acc[g] = hn::MulAdd(hn::LoadU(df, qs + g * Dp + i), kv, acc[g]);
    }
    if (i < D) {
      const VF kv = LoadFloatTail<T>(df, krow, i, D - i);
      for (int g = 0; g < kG; ++g) acc[g] = hn::MulAdd(hn::LoadU(df, qs + g * Dp + i), kv, acc[g]);
    }
  }
  int g = 0;
#if HWY_TARGET != HWY_SCALAR
  for (; g + 4 <= kG; g += 4) {
    HWY_ALIGN float four[4];
    hn::Store(Reduce4(df, acc[g], acc[g + 1], acc[g + 2], acc[g + 3]), hn::Full128<float>(), four);
    for (int t = 0; t < 4; ++t) s[(g + t) * s_stride] = four[t];
  }
#endif
  for (; g < kG; ++g) s[g * s_stride] = hn::GetLane(hn::SumOfLanes(df, acc[g]));
}

// acc[g][0..Dv) += sum_j p[g][j] * V[j] for n plain V rows starting at vrow0, `vstride` apart.
// Elements [i, i + kN) of row `row` as f32 with its block scale applied (quantized) or not.
template <DType T>
HWY_INLINE VF LoadK(DF df, const void* row, int64_t i, int64_t D, VF scale) {
  if constexpr (IsQuantized(T)) {
    (void)D;
    return hn::Mul(LoadCodes<T>(df, row, i), scale);
  } else {
    (void)scale;
    return i + static_cast<int64_t>(kN) <= D ? LoadFloat<T>(df, row, i)
                                             : LoadFloatTail<T>(df, row, i, D - i);
  }
}

// Two K rows at once: each q vector loaded once for both rows (the K loop is load-port bound).
// s[g * s_stride] and s[g * s_stride + 1] receive rows 0 and 1.
template <DType T, int kG>
HWY_INLINE void DotHeads2(DF df, const void* krow0, const void* krow1, const float* qs, int64_t Dp,
                          int64_t D, float* s, int64_t s_stride) {
  VF acc0[kG], acc1[kG];
  for (int g = 0; g < kG; ++g) acc0[g] = acc1[g] = hn::Zero(df);
  if constexpr (IsQuantized(T)) {
    // Block by block with the vectors of a block unrolled: no per-vector block index arithmetic.
    const char* b0 = static_cast<const char*>(krow0);
    const char* b1 = static_cast<const char*>(krow1);
    const float* q = qs;
    for (int64_t blk = 0; blk < D / 32; ++blk) {
      const VF sc0 = hn::Set(df, BlockScale<T>(b0, 0));
      const VF sc1 = hn::Set(df, BlockScale<T>(b1, 0));
      for (int64_t w = 0; w < 32; w += kN) {
        const VF k0 = hn::Mul(LoadCodes<T>(df, b0, w), sc0);
        const VF k1 = hn::Mul(LoadCodes<T>(df, b1, w), sc1);
        for (int g = 0; g < kG; ++g) {
          const VF qv = hn::LoadU(df, q + g * Dp + w);
          acc0[g] = hn::MulAdd(qv, k0, acc0[g]);
          acc1[g] = hn::MulAdd(qv, k1, acc1[g]);
        }
      }
      b0 += BlockBytes(T);
      b1 += BlockBytes(T);
      q += 32;
    }
  } else {
    for (int64_t i = 0; i < D; i += kN) {
      const VF k0 = LoadK<T>(df, krow0, i, D, hn::Zero(df));
      const VF k1 = LoadK<T>(df, krow1, i, D, hn::Zero(df));
      for (int g = 0; g < kG; ++g) {
        const VF qv = hn::LoadU(df, qs + g * Dp + i);
        acc0[g] = hn::MulAdd(qv, k0, acc0[g]);
        acc1[g] = hn::MulAdd(qv, k1, acc1[g]);
      }
    }
  }
  int g = 0;
#if HWY_TARGET != HWY_SCALAR
  for (; g + 4 <= kG; g += 4) {
    HWY_ALIGN float four[2][4];
    hn::Store(Reduce4(df, acc0[g], acc0[g + 1], acc0[g + 2], acc0[g + 3]), hn::Full128<float>(),
              four[0]);
    hn::Store(Reduce4(df, acc1[g], acc1[g + 1], acc1[g + 2], acc1[g + 3]), hn::Full128<float>(),
              four[1]);
    for (int t = 0; t < 4; ++t) {
      s[(g + t) * s_stride] = four[0][t];
      s[(g + t) * s_stride + 1] = four[1][t];
    }
  }
#endif
  for (; g < kG; ++g) {
    s[g * s_stride] = hn::GetLane(hn::SumOfLanes(df, acc0[g]));
    s[g * s_stride + 1] = hn::GetLane(hn::SumOfLanes(df, acc1[g]));
  }
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Four K rows x four heads, AVX-512 only (25 of its 32 registers; AVX2 would spill). Each q vector
// is loaded once for four rows, and the 16 dot products are summed in one transposing reduction:
// 45 shuffles and adds and four 128-bit stores instead of two DotHeads2 reductions (52) and 16
// scalar stores, which took 17% of a q8_0 decode (perf). Every dtype: on the Zen 5 of session 4
// (history in cache, 1 thread) f16 decode got 6% (head_dim 128) to 17% (64) faster; an earlier
// machine had measured f16 5% slower. Float K rows need D % kN == 0 (no tail handling here).
// s[g * s_stride + r] receives row r, head g.
// Blocks [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of 128 bits.
HWY_INLINE VF BlockPairSums(VF a, VF b) {
  return VF{_mm512_add_ps(_mm512_shuffle_f32x4(a.raw, b.raw, 0x88),
                          _mm512_shuffle_f32x4(a.raw, b.raw, 0xDD))};
}

template <DType T>
HWY_INLINE void DotHeads4(DF df, const char* krow0, size_t kstride, const float* qs, int64_t Dp,
                          int64_t D, float* s, int64_t s_stride) {
  constexpr int kR = 4, kG = 4;
  VF acc[kR][kG];
  for (int r = 0; r < kR; ++r)
    for (int g = 0; g < kG; ++g) acc[r][g] = hn::Zero(df);
  const float* q = qs;
  if constexpr (!IsQuantized(T)) {
    for (int64_t i = 0; i < D; i += kN) {
      VF k[kR];
      for (int r = 0; r < kR; ++r) k[r] = LoadFloat<T>(df, krow0 + r * kstride, i);
      for (int g = 0; g < kG; ++g) {
        const VF qv = hn::LoadU(df, q + g * Dp + i);
        for (int r = 0; r < kR; ++r) acc[r][g] = hn::MulAdd(qv, k[r], acc[r][g]);
      }
    }
  } else {
    for (int64_t blk = 0; blk < D / 32; ++blk) {
      const char* b = krow0 + blk * BlockBytes(T);
      VF sc[kR];
      for (int r = 0; r < kR; ++r) sc[r] = hn::Set(df, BlockScale<T>(b + r * kstride, 0));
      for (int64_t w = 0; w < 32; w += kN) {
        VF k[kR];
        for (int r = 0; r < kR; ++r) k[r] = hn::Mul(LoadCodes<T>(df, b + r * kstride, w), sc[r]);
        for (int g = 0; g < kG; ++g) {
          const VF qv = hn::LoadU(df, q + g * Dp + w);
          for (int r = 0; r < kR; ++r) acc[r][g] = hn::MulAdd(qv, k[r], acc[r][g]);
        }
      }
      q += 32;
    }
  }
  // u[g]: block b holds head g's partial sums of rows 0..3 over block b's lanes.
  VF u[kG];
  for (int g = 0; g < kG; ++g) u[g] = QuadSums(df, acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
  // Block g of `all`: head g, rows 0..3.
  const VF all = BlockPairSums(BlockPairSums(u[0], u[1]), BlockPairSums(u[2], u[3]));
  HWY_ALIGN float out[16];
  hn::Store(all, df, out);
  const hn::Full128<float> d4;
  for (int g = 0; g < kG; ++g) hn::StoreU(hn::Load(d4, out + 4 * g), d4, s + g * s_stride);
}
#endif  // AVX3

// Float dtypes. Dimension chunks outside, cells inside: each head's accumulator chunk stays in a
// register.
template <DType T, int kG>
HWY_INLINE void AccumPlain(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t Dv,
                           const float* p, int64_t p_stride, float* acc, int64_t acc_stride) {
  int64_t i = 0;
  if constexpr (kG <= 4) {  // kVChunks chunks per pass (see kVChunks)
    constexpr int64_t kC = kVChunks;
    for (; i + kC * static_cast<int64_t>(kN) <= Dv; i += kC * kN) {
      VF a[kC][kG];
      for (int64_t c = 0; c < kC; ++c)
        for (int g = 0; g < kG; ++g) a[c][g] = hn::Load(df, acc + g * acc_stride + i + c * kN);
      for (int64_t j = 0; j < n; ++j) {
        const char* vr = vrow0 + static_cast<size_t>(j) * vstride;
        VF vv[kC];
        for (int64_t c = 0; c < kC; ++c) vv[c] = LoadFloat<T>(df, vr, i + c * kN);
        for (int g = 0; g < kG; ++g) {
          const VF pg = hn::Set(df, p[g * p_stride + j]);
          for (int64_t c = 0; c < kC; ++c) a[c][g] = hn::MulAdd(pg, vv[c], a[c][g]);
        }
      }
      for (int64_t c = 0; c < kC; ++c)
        for (int g = 0; g < kG; ++g) hn::Store(a[c][g], df, acc + g * acc_stride + i + c * kN);
    }
  }
  for (; i < Dv; i += kN) {
    const bool tail = i + static_cast<int64_t>(kN) > Dv;  // acc is padded
    VF a[kG];
    for (int g = 0; g < kG; ++g) a[g] = hn::Load(df, acc + g * acc_stride + i);
    for (int64_t j = 0; j < n; ++j) {
      const char* vr = vrow0 + static_cast<size_t>(j) * vstride;
      const VF vv = tail ? LoadFloatTail<T>(df, vr, i, Dv - i) : LoadFloat<T>(df, vr, i);
      for (int g = 0; g < kG; ++g) a[g] = hn::MulAdd(hn::Set(df, p[g * p_stride + j]), vv, a[g]);
    }
    for (int g = 0; g < kG; ++g) hn::Store(a[g], df, acc + g * acc_stride + i);
  }
}

// Permuted V (cells fastest): acc[g][d] += dot(p[g][0..n), V[d][c0..c0+n)).
template <DType T, int kG>
HWY_INLINE void AccumPermuted(DF df, const char* vhead, size_t dim_stride, int64_t c0, int64_t n,
                              int64_t Dv, const float* p, int64_t p_stride, float* acc,
                              int64_t acc_stride) {
  constexpr size_t kElem = BlockBytes(T);
  for (int64_t d = 0; d < Dv; ++d) {
    const char* line =
        vhead + static_cast<size_t>(d) * dim_stride + static_cast<size_t>(c0) * kElem;
    VF a[kG];
    for (int g = 0; g < kG; ++g) a[g] = hn::Zero(df);
    int64_t j = 0;
    for (; j + static_cast<int64_t>(kN) <= n; j += kN) {
      const VF vv = LoadFloat<T>(df, line, j);
      for (int g = 0; g < kG; ++g) a[g] = hn::MulAdd(hn::LoadU(df, p + g * p_stride + j), vv, a[g]);
    }
    if (j < n) {
      const VF vv = LoadFloatTail<T>(df, line, j, n - j);
      for (int g = 0; g < kG; ++g) a[g] = hn::MulAdd(hn::LoadU(df, p + g * p_stride + j), vv, a[g]);
    }
    for (int g = 0; g < kG; ++g) acc[g * acc_stride + d] += hn::GetLane(hn::SumOfLanes(df, a[g]));
  }
}

// Softcap (optional) and mask on n scores of one head.
HWY_INLINE void ShapeScores(DF df, const Ctx& c, int64_t b, int64_t c0, int64_t n, float* s) {
  if (c.p.softcap != 0) {
    const VF cap = hn::Set(df, c.p.softcap);
    const VF inv = hn::Set(df, 1.0f / c.p.softcap);
    for (int64_t j = 0; j < n; j += kN) {
      const VF x = hn::Load(df, s + j);
      hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(x, inv))), df, s + j);
    }
  }
  if (c.mask.data != nullptr) {
    // Visible cells carry 0 in the caches' masks; other finite values are honoured. The caches
    // always pass a mask: vector loads (f32 / f16, elements packed) instead of a scalar per cell.
    const char* mrow = static_cast<const char*>(c.mask.data) +
                       static_cast<size_t>(b) * c.mask.nb[1] +
                       static_cast<size_t>(c0) * c.mask.nb[0];
    int64_t j = 0;
    if (c.mask.dtype == DType::kF32) {
      for (; j + static_cast<int64_t>(kN) <= n; j += kN) {
        hn::Store(hn::Add(hn::Load(df, s + j), LoadFloat<DType::kF32>(df, mrow, j)), df, s + j);
      }
    } else if (c.mask.dtype == DType::kF16) {
      for (; j + static_cast<int64_t>(kN) <= n; j += kN) {
        hn::Store(hn::Add(hn::Load(df, s + j), LoadFloat<DType::kF16>(df, mrow, j)), df, s + j);
      }
    }
    for (; j < n; ++j) s[j] += attn::MaskValue(c.mask, b, c0 + j);
  }
}

// One online-softmax step for one head over n scores: turns s into p, rescales the state.
// state: acc[0..Dvp), then m at [Dvp], l at [Dvp + 1]. Precondition: n >= 1, all s finite.
HWY_INLINE void SoftmaxStep(DF df, int64_t n, int64_t Dvp, float* s, float* state) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  VF vmax = hn::Set(df, neg_inf);
  int64_t j = 0;
  for (; j + static_cast<int64_t>(kN) <= n; j += kN) vmax = hn::Max(vmax, hn::Load(df, s + j));
  float m_blk = hn::GetLane(hn::MaxOfLanes(df, vmax));
  for (; j < n; ++j) m_blk = std::max(m_blk, s[j]);
  const float m_old = state[Dvp];
  const float m_new = std::max(m_old, m_blk);
  const VF vm = hn::Set(df, m_new);
  const VF vlow = hn::Set(df, -std::numeric_limits<float>::max());
  VF vsum = hn::Zero(df);
  for (j = 0; j < n; j += kN) {
    // Clamped: Exp is valid on [-FLT_MAX, 104]; a difference of extreme logits may reach -inf.
    VF e = hn::Exp(df, hn::Max(hn::Sub(hn::Load(df, s + j), vm), vlow));
    if (j + static_cast<int64_t>(kN) > n) e = hn::IfThenElseZero(hn::FirstN(df, n - j), e);
    vsum = hn::Add(vsum, e);
    hn::Store(e, df, s + j);
  }
  const float sum = hn::GetLane(hn::SumOfLanes(df, vsum));
  if (m_new != m_old) {
    const float alpha = std::exp(m_old - m_new);  // 0 on the first visible cell (m_old = -inf)
    const VF va = hn::Set(df, alpha);
    for (int64_t i = 0; i < Dvp; i += kN) {
      hn::Store(hn::Mul(hn::Load(df, state + i), va), df, state + i);
    }
    state[Dvp + 1] *= alpha;
  }
  state[Dvp] = m_new;
  state[Dvp + 1] += sum;
}

// Cells [c0, c0 + n) (all visible to row b) for heads g0 .. g0 + kG of KV head h.
template <DType T, bool kPermV, int kG>
HWY_NOINLINE void DecodeCells(const Ctx& c, int64_t h, int64_t b, int64_t g0, int64_t c0, int64_t n,
                              const float* qs, float* rows) {
  const DF df;
  HWY_ALIGN float s[kG][kBlockCells + kRowPad];
  const char* kbase = static_cast<const char*>(c.k.data) + static_cast<size_t>(h) * c.k.nb[1];
  const char* vrow0 = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[1] +
                      static_cast<size_t>(c0) * c.v.nb[2];
  HWY_ALIGN float vd[IsQuantized(T) ? kMaxQBlocks : 1][kScaleStride];

  // Software prefetch: K rows kPrefetchBytes ahead (a single thread keeps too few misses in flight
  // on its own to reach the read bandwidth), and this piece's V rows ahead of the V pass.
  const size_t krow_bytes = RowBytes(T, c.D);
  const size_t vrow_bytes = kPermV ? 0 : RowBytes(T, c.Dv);
  const int64_t ahead =
      std::clamp<int64_t>(kPrefetchBytes / static_cast<int64_t>(krow_bytes), 8, 48);
  const char* k_ahead = kbase + static_cast<size_t>(c0 + ahead) * c.k.nb[2];
  const size_t kst = c.k.nb[2], vst = c.v.nb[2];
  const auto prefetch = [=](int64_t j) {
    const char* ka = k_ahead + static_cast<size_t>(j) * kst;
    for (size_t o = 0; o < krow_bytes; o += 64) hwy::Prefetch(ka + o);
    const char* va = vrow0 + static_cast<size_t>(j) * vst;
    for (size_t o = 0; o < vrow_bytes; o += 64) hwy::Prefetch(va + o);
  };
  int64_t j = 0;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kG == 4) {
    const int64_t n4 = IsQuantized(T) || c.D % static_cast<int64_t>(kN) == 0 ? n : 0;
    for (; j + 4 <= n4; j += 4) {
      for (int64_t r = 0; r < 4; ++r) prefetch(j + r);
      DotHeads4<T>(df, kbase + static_cast<size_t>(c0 + j) * c.k.nb[2], c.k.nb[2], qs + g0 * c.Dp,
                   c.Dp, c.D, &s[0][j], kBlockCells + kRowPad);
    }
  }
#endif
  for (; j + 2 <= n; j += 2) {
    for (int64_t r = 0; r < 2; ++r) prefetch(j + r);
    const char* k0 = kbase + static_cast<size_t>(c0 + j) * c.k.nb[2];
    DotHeads2<T, kG>(df, k0, k0 + c.k.nb[2], qs + g0 * c.Dp, c.Dp, c.D, &s[0][j],
                     kBlockCells + kRowPad);
  }
  if (j < n) {
    DotHeads<T, kG>(df, kbase + static_cast<size_t>(c0 + j) * c.k.nb[2], qs + g0 * c.Dp, c.Dp, c.D,
                    &s[0][j], kBlockCells + kRowPad);
  }
  const int64_t rs = attn::PartialStride(c);
  float* state = rows + g0 * rs;
  for (int g = 0; g < kG; ++g) {
    for (int64_t j = n; j < static_cast<int64_t>(attn::Pad(n)); ++j) s[g][j] = 0.0f;
    ShapeScores(df, c, b, c0, n, s[g]);
    SoftmaxStep(df, n, c.Dvp, s[g], state + g * rs);
  }
  if constexpr (kPermV) {
    const char* vhead = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[2];
    AccumPermuted<T, kG>(df, vhead, c.v.nb[1], c0, n, c.Dv, &s[0][0], kBlockCells + kRowPad, state,
                         rs);
  } else if constexpr (IsQuantized(T)) {
    // The V rows were prefetched during the K pass: the scales gather from cache.
    GatherScales<T>(df, vrow0, c.v.nb[2], n, c.Dv / 32, &vd[0][0]);
#if HWY_TARGET == HWY_AVX3_DL
    if (c.p.integer_v) {
      AccumQuantInt<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad,
                           &vd[0][0], state, rs);
      return;
    }
#endif
    AccumQuant<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad, &vd[0][0],
                      state, rs);
  } else {
    AccumPlain<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad, state, rs);
  }
}

template <DType T, bool kPermV>
HWY_INLINE void DecodeCellsAllHeads(const Ctx& c, int64_t h, int64_t b, int64_t c0, int64_t n,
                                    const float* qs, float* rows) {
  int64_t g = 0;
  for (; g + 8 <= c.G; g += 8) DecodeCells<T, kPermV, 8>(c, h, b, g, c0, n, qs, rows);
  const int64_t r = c.G - g;
  if (r >= 4) {
    DecodeCells<T, kPermV, 4>(c, h, b, g, c0, n, qs, rows);
    g += 4;
  }
  if (c.G - g >= 2) {
    DecodeCells<T, kPermV, 2>(c, h, b, g, c0, n, qs, rows);
    g += 2;
  }
  if (c.G - g >= 1) DecodeCells<T, kPermV, 1>(c, h, b, g, c0, n, qs, rows);
}

// Spans shorter than this are gathered (see DecodeGathered).
constexpr int64_t kShortSpan = 16;

// Cells `cells[0..n)` (ascending, all visible to row b) for every query head of KV head h, from a
// contiguous copy: head h's K and V rows and row b's mask values are copied to per-thread scratch,
// and DecodeCellsAllHeads runs on a Ctx whose views describe the copy as cells [0, n). Batched
// decode puts each sequence's new tokens in interleaved cells, so without this every row sees
// runs of one-cell spans, each paying a softmax step and a pass over the accumulators. Plain V
// only (a permuted V row is one element per dimension line).
template <DType T>
HWY_NOINLINE void DecodeGathered(const Ctx& c, int64_t h, int64_t b, const int32_t* cells,
                                 int64_t n, const float* qs, float* rows) {
  const size_t krb = RowBytes(T, c.D), vrb = RowBytes(T, c.Dv);
  const size_t kbytes = (static_cast<size_t>(n) * krb + 63) / 64 * 64;
  const size_t vbytes = (static_cast<size_t>(n) * vrb + 63) / 64 * 64;
  char* kbuf = reinterpret_cast<char*>(
      attn::ThreadScratch((kbytes + vbytes) / 4 + static_cast<size_t>(attn::Pad(n)), 2));
  char* vbuf = kbuf + kbytes;
  float* mbuf = reinterpret_cast<float*>(vbuf + vbytes);
  const char* ksrc = static_cast<const char*>(c.k.data) + static_cast<size_t>(h) * c.k.nb[1];
  const char* vsrc = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[1];
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(kbuf + static_cast<size_t>(i) * krb,
                ksrc + static_cast<size_t>(cells[i]) * c.k.nb[2], krb);
    std::memcpy(vbuf + static_cast<size_t>(i) * vrb,
                vsrc + static_cast<size_t>(cells[i]) * c.v.nb[2], vrb);
    mbuf[i] = attn::MaskValue(c.mask, b, cells[i]);
  }
  Ctx g = c;
  g.k.data = kbuf;
  g.k.nb[1] = 0;  // the copy holds head h only
  g.k.nb[2] = krb;
  g.v.data = vbuf;
  g.v.nb[1] = 0;
  g.v.nb[2] = vrb;
  g.mask.data = mbuf;  // row b's values, read as row 0 of an f32 mask
  g.mask.dtype = DType::kF32;
  g.mask.nb[0] = sizeof(float);
  g.mask.nb[1] = 0;
  DecodeCellsAllHeads<T, false>(g, 0, b, 0, n, qs, rows);
}

template <DType T, bool kPermV>
void DecodeHeadChunk(const Ctx& c, int64_t h, int64_t chunk) {
  const DF df;
  const int64_t lo = chunk * c.chunk;
  const int64_t hi = std::min(c.L, lo + c.chunk);
  const int64_t rs = attn::PartialStride(c);
  float* part = c.partials + (h * c.n_chunks + chunk) * c.B * c.G * rs;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < c.B * c.G; ++r) {
    float* row = part + r * rs;
    for (int64_t i = 0; i < c.Dvp; i += kN) hn::Store(hn::Zero(df), df, row + i);
    row[c.Dvp] = neg_inf;
    row[c.Dvp + 1] = 0.0f;
  }
  // The group's query rows, pre-scaled and zero-padded: [B][G][Dp].
  float* qs = attn::ThreadScratch(static_cast<size_t>(c.B * c.G * c.Dp), 1);
  const VF vscale = hn::Set(df, c.p.scale);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t g = 0; g < c.G; ++g) {
      const float* src = static_cast<const float*>(RowPtr(c.q, b, h * c.G + g));
      float* dst = qs + (b * c.G + g) * c.Dp;
      int64_t i = 0;
      for (; i + static_cast<int64_t>(kN) <= c.D; i += kN) {
        hn::Store(hn::Mul(hn::LoadU(df, src + i), vscale), df, dst + i);
      }
      for (; i < c.Dp; ++i) dst[i] = i < c.D ? src[i] * c.p.scale : 0.0f;
    }
  }
  // Per row, a cursor into its spans: the first span ending after lo.
  constexpr int64_t kMaxB = 64;
  int64_t cursor[kMaxB];
  for (int64_t b = 0; b < c.B; ++b) {
    const int32_t* sp = c.spans + 2 * c.span_off[b];
    const int64_t ns = c.span_off[b + 1] - c.span_off[b];
    int64_t l = 0, r = ns;  // first span with end > lo
    while (l < r) {
      const int64_t mid = (l + r) / 2;
      if (sp[2 * mid + 1] <= lo)
        l = mid + 1;
      else
        r = mid;
    }
    cursor[b] = l;
  }
  for (int64_t blk0 = lo; blk0 < hi; blk0 += kBlockCells) {
    const int64_t blk1 = std::min(hi, blk0 + kBlockCells);
    for (int64_t b = 0; b < c.B; ++b) {
      const int32_t* sp = c.spans + 2 * c.span_off[b];
      const int64_t ns = c.span_off[b + 1] - c.span_off[b];
      int64_t& cur = cursor[b];
      int32_t short_cells[kBlockCells];  // cells of this block's short spans, gathered
      int64_t n_short = 0, short_spans = 0;
      while (cur < ns && sp[2 * cur] < blk1) {
        const int64_t s0 = std::max<int64_t>(sp[2 * cur], blk0);
        const int64_t s1 = std::min<int64_t>(sp[2 * cur + 1], blk1);
        if (s1 > s0 && !kPermV && s1 - s0 < kShortSpan) {
          for (int64_t j = s0; j < s1; ++j) short_cells[n_short++] = static_cast<int32_t>(j);
          ++short_spans;
        } else if (s1 > s0) {
          DecodeCellsAllHeads<T, kPermV>(c, h, b, s0, s1 - s0, qs + b * c.G * c.Dp,
                                         part + b * c.G * rs);
        }
        if (sp[2 * cur + 1] > blk1) break;  // the span goes on into the next block
        ++cur;
      }
      if constexpr (!kPermV) {
        if (short_spans == 1) {  // contiguous: nothing to gain from a copy
          DecodeCellsAllHeads<T, kPermV>(c, h, b, short_cells[0], n_short, qs + b * c.G * c.Dp,
                                         part + b * c.G * rs);
        } else if (short_spans > 1) {
          DecodeGathered<T>(c, h, b, short_cells, n_short, qs + b * c.G * c.Dp,
                            part + b * c.G * rs);
        }
      }
    }
  }
}

// Task t: KV heads [t / n_chunks * task_heads, ..) over chunk t % n_chunks, one head after the
// other.
template <DType T, bool kPermV>
void DecodeTask(const Ctx& c, int64_t task) {
  const int64_t h0 = task / c.n_chunks * c.task_heads;
  const int64_t h1 = std::min(c.Hkv, h0 + c.task_heads);
  for (int64_t h = h0; h < h1; ++h) DecodeHeadChunk<T, kPermV>(c, h, task % c.n_chunks);
}

// Combines the chunks' partials of every (b, query head), adds the sink, divides, writes out.
void DecodeMerge(const Ctx& c) {
  const DF df;
  const int64_t rs = attn::PartialStride(c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t hq = 0; hq < c.Hq; ++hq) {
    const int64_t h = hq / c.G;
    const int64_t g = hq % c.G;
    for (int64_t b = 0; b < c.B; ++b) {
      auto row_of = [&](int64_t chunk) {
        return c.partials + ((h * c.n_chunks + chunk) * c.B * c.G + b * c.G + g) * rs;
      };
      float m = c.p.sinks != nullptr ? c.p.sinks[hq] : neg_inf;
      for (int64_t ch = 0; ch < c.n_chunks; ++ch) m = std::max(m, row_of(ch)[c.Dvp]);
      float* o = static_cast<float*>(RowPtr(c.out, b, hq));
      if (m == neg_inf) {
        for (int64_t i = 0; i < c.Dv; ++i) o[i] = 0.0f;
        continue;
      }
      float l = c.p.sinks != nullptr ? std::exp(c.p.sinks[hq] - m) : 0.0f;
      // Accumulate into chunk 0's row (this merge owns the partials now).
      float* acc = row_of(0);
      const float w0 = acc[c.Dvp] == neg_inf ? 0.0f : std::exp(acc[c.Dvp] - m);
      l += w0 * acc[c.Dvp + 1];
      for (int64_t i = 0; i < c.Dvp; i += kN) {
        hn::Store(hn::Mul(hn::Load(df, acc + i), hn::Set(df, w0)), df, acc + i);
      }
      for (int64_t ch = 1; ch < c.n_chunks; ++ch) {
        const float* r = row_of(ch);
        if (r[c.Dvp] == neg_inf) continue;
        const float w = std::exp(r[c.Dvp] - m);
        l += w * r[c.Dvp + 1];
        for (int64_t i = 0; i < c.Dvp; i += kN) {
          hn::Store(hn::MulAdd(hn::Load(df, r + i), hn::Set(df, w), hn::Load(df, acc + i)), df,
                    acc + i);
        }
      }
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      for (int64_t i = 0; i < c.Dv; ++i) o[i] = acc[i] * inv;
    }
  }
}

// ---- prefill
// -------------------------------------------------------------------------------------

constexpr int64_t kTC = 4 * static_cast<int64_t>(kN);  // cells per tile: 4 vectors

// Row j of K or V (any dtype) to f32, zero-padded to `padded` floats.
template <DType T>
HWY_INLINE void RowToF32Padded(DF df, const void* row, int64_t n, int64_t padded, float* dst) {
  if constexpr (IsQuantized(T)) {
    for (int64_t blk = 0; blk < n / 32; ++blk) {
      const VF scale = hn::Set(df, BlockScale<T>(row, blk));
      for (int64_t w = 0; w < 32; w += kN) {
        hn::Store(hn::Mul(LoadCodes<T>(df, row, blk * 32 + w), scale), df, dst + blk * 32 + w);
      }
    }
  } else {
    int64_t i = 0;
    for (; i + static_cast<int64_t>(kN) <= n; i += kN)
      hn::Store(LoadFloat<T>(df, row, i), df, dst + i);
    if (i < n) hn::Store(LoadFloatTail<T>(df, row, i, n - i), df, dst + i);
  }
  for (int64_t i = n; i < padded; ++i) dst[i] = 0.0f;
}

// S[r][0..kTC) = sum_d Q[r][d] * KT[d][0..kTC) for kR rows: kR x 4 accumulators, no reductions.
template <int kR>
HWY_INLINE void TileScores(DF df, const float* qrows, int64_t Dp, int64_t D, const float* kt,
                           float* s) {
  VF a[kR][4];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = hn::Zero(df);
  for (int64_t d = 0; d < D; ++d) {
    const float* ktd = kt + d * kTC;
    const VF k0 = hn::Load(df, ktd), k1 = hn::Load(df, ktd + kN), k2 = hn::Load(df, ktd + 2 * kN),
             k3 = hn::Load(df, ktd + 3 * kN);
    for (int r = 0; r < kR; ++r) {
      const VF qv = hn::Set(df, qrows[r * Dp + d]);
      a[r][0] = hn::MulAdd(qv, k0, a[r][0]);
      a[r][1] = hn::MulAdd(qv, k1, a[r][1]);
      a[r][2] = hn::MulAdd(qv, k2, a[r][2]);
      a[r][3] = hn::MulAdd(qv, k3, a[r][3]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < 4; ++v) hn::Store(a[r][v], df, s + r * kTC + v * kN);
}

// acc[r][i..i + kV*kN) += sum_j P[r][j] * V[j][i..] for kR rows.
template <int kR, int kV>
HWY_INLINE void TileAccum(DF df, const float* p, const float* vt, int64_t Dvp, int64_t i,
                          float* acc, int64_t acc_stride) {
  VF a[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) a[r][v] = hn::Load(df, acc + r * acc_stride + i + v * kN);
  for (int64_t j = 0; j < kTC; ++j) {
    VF vv[kV];
    for (int v = 0; v < kV; ++v) vv[v] = hn::Load(df, vt + j * Dvp + i + v * kN);
    for (int r = 0; r < kR; ++r) {
      const VF pv = hn::Set(df, p[r * kTC + j]);
      for (int v = 0; v < kV; ++v) a[r][v] = hn::MulAdd(pv, vv[v], a[r][v]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) hn::Store(a[r][v], df, acc + r * acc_stride + i + v * kN);
}

template <int kR>
HWY_INLINE void TileAccumRows(DF df, const float* p, const float* vt, int64_t Dvp, float* acc,
                              int64_t acc_stride) {
  int64_t i = 0;
  for (; i + 4 * static_cast<int64_t>(kN) <= Dvp; i += 4 * kN) {
    TileAccum<kR, 4>(df, p, vt, Dvp, i, acc, acc_stride);
  }
  for (; i < Dvp; i += kN) TileAccum<kR, 1>(df, p, vt, Dvp, i, acc, acc_stride);
}

template <DType T, bool kPermV>
void PrefillTask(const Ctx& c, int64_t task) {
  const DF df;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t h = task / c.n_qtiles;
  const int64_t b0 = (task % c.n_qtiles) * c.q_tile;
  const int64_t nb = std::min(c.q_tile, c.B - b0);
  const int64_t R = nb * c.G;  // query rows: row r = (b0 + r / G, head h * G + r % G)
  const int64_t rs = c.Dvp + kRowPad;
  // Scratch: q rows [R][Dp], state rows [R][rs], KT [Dp][kTC], V tile [kTC][Dvp], S [R][kTC].
  const size_t need = static_cast<size_t>(R * c.Dp + R * rs + c.Dp * kTC + kTC * c.Dvp + R * kTC);
  float* qs = attn::ThreadScratch(need, 1);
  float* st = qs + R * c.Dp;
  float* kt = st + R * rs;
  float* vt = kt + c.Dp * kTC;
  float* sc = vt + kTC * c.Dvp;
  const VF vscale = hn::Set(df, c.p.scale);
  int64_t lo = c.L, hi = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = b0 + r / c.G;
    const float* src = static_cast<const float*>(RowPtr(c.q, b, h * c.G + r % c.G));
    float* dst = qs + r * c.Dp;
    int64_t i = 0;
    for (; i + static_cast<int64_t>(kN) <= c.D; i += kN) {
      hn::Store(hn::Mul(hn::LoadU(df, src + i), vscale), df, dst + i);
    }
    for (; i < c.Dp; ++i) dst[i] = i < c.D ? src[i] * c.p.scale : 0.0f;
    float* row = st + r * rs;
    for (int64_t i2 = 0; i2 < c.Dvp; i2 += kN) hn::Store(hn::Zero(df), df, row + i2);
    row[c.Dvp] = neg_inf;
    row[c.Dvp + 1] = 0.0f;
    lo = std::min<int64_t>(lo, c.row_lo[b]);
    hi = std::max<int64_t>(hi, c.row_hi[b]);
  }
  const char* kbase = static_cast<const char*>(c.k.data) + static_cast<size_t>(h) * c.k.nb[1];
  for (int64_t t0 = lo; t0 < hi; t0 += kTC) {
    const int64_t n = std::min(kTC, hi - t0);
    // K tile transposed: kt[d][j].
    HWY_ALIGN float krow[attn::Pad(kAttentionMaxHeadDim)];
    for (int64_t j = 0; j < kTC; ++j) {
      if (j < n) {
        RowToF32Padded<T>(df, kbase + static_cast<size_t>(t0 + j) * c.k.nb[2], c.D, c.D, krow);
        for (int64_t d = 0; d < c.D; ++d) kt[d * kTC + j] = krow[d];
      } else {
        for (int64_t d = 0; d < c.D; ++d) kt[d * kTC + j] = 0.0f;
      }
    }
    // V tile: vt[j][d].
    for (int64_t j = 0; j < kTC; ++j) {
      float* dst = vt + j * c.Dvp;
      if (j >= n) {
        for (int64_t d = 0; d < c.Dvp; ++d) dst[d] = 0.0f;
      } else if constexpr (kPermV) {
        const char* vh = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[2] +
                         static_cast<size_t>(t0 + j) * c.v.nb[0];
        for (int64_t d = 0; d < c.Dv; ++d)
          dst[d] = LoadAsF32(vh + static_cast<size_t>(d) * c.v.nb[1], T, 0);
        for (int64_t d = c.Dv; d < c.Dvp; ++d) dst[d] = 0.0f;
      } else {
        RowToF32Padded<T>(df,
                          static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[1] +
                              static_cast<size_t>(t0 + j) * c.v.nb[2],
                          c.Dv, c.Dvp, dst);
      }
    }
    // Scores for every row, 4 rows at a time.
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) TileScores<4>(df, qs + r * c.Dp, c.Dp, c.D, kt, sc + r * kTC);
    for (; r < R; ++r) TileScores<1>(df, qs + r * c.Dp, c.Dp, c.D, kt, sc + r * kTC);
    // Softcap, mask, online softmax per row; p overwrites s (0 where hidden).
    for (r = 0; r < R; ++r) {
      const int64_t b = b0 + r / c.G;
      float* s = sc + r * kTC;
      float* row = st + r * rs;
      if (c.p.softcap != 0) {
        const VF cap = hn::Set(df, c.p.softcap);
        const VF inv = hn::Set(df, 1.0f / c.p.softcap);
        for (int64_t j = 0; j < kTC; j += kN) {
          hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::Load(df, s + j), inv))), df, s + j);
        }
      }
      // Cells outside the row's visible box (or past the history) become -inf; inside, the mask
      // value is added (-inf hides). Vectorized: this runs per row and tile.
      const float vlo = static_cast<float>(std::max<int64_t>(c.row_lo[b] - t0, 0));
      const float vhi = static_cast<float>(std::min<int64_t>(c.row_hi[b] - t0, n));
      const VF vvlo = hn::Set(df, vlo), vvhi = hn::Set(df, vhi);
      const char* mrow = c.mask.data == nullptr ? nullptr
                                                : static_cast<const char*>(c.mask.data) +
                                                      static_cast<size_t>(b) * c.mask.nb[1] +
                                                      static_cast<size_t>(t0) * c.mask.nb[0];
      for (int64_t j = 0; j < kTC; j += kN) {
        const VF idx = hn::Iota(df, static_cast<float>(j));
        VF x = hn::Load(df, s + j);
        if (mrow != nullptr) {
          VF mv;
          if (j + static_cast<int64_t>(kN) <= n) {
            mv = c.mask.dtype == DType::kF16 ? LoadFloat<DType::kF16>(df, mrow, j)
                                             : LoadFloat<DType::kF32>(df, mrow, j);
          } else {
            HWY_ALIGN float tmp[kN] = {};
            for (int64_t t = j; t < n; ++t) tmp[t - j] = attn::MaskValue(c.mask, b, t0 + t);
            mv = hn::Load(df, tmp);
          }
          x = hn::Add(x, mv);
        }
        const auto inside = hn::And(hn::Ge(idx, vvlo), hn::Lt(idx, vvhi));
        hn::Store(hn::IfThenElse(inside, x, hn::Set(df, neg_inf)), df, s + j);
      }
      VF vmax = hn::Set(df, neg_inf);
      for (int64_t j = 0; j < kTC; j += kN) vmax = hn::Max(vmax, hn::Load(df, s + j));
      const float m_blk = hn::GetLane(hn::MaxOfLanes(df, vmax));
      if (m_blk == neg_inf) {  // nothing visible to this row here
        for (int64_t j = 0; j < kTC; ++j) s[j] = 0.0f;
        continue;
      }
      const float m_old = row[c.Dvp];
      const float m_new = std::max(m_old, m_blk);
      const VF vm = hn::Set(df, m_new);
      const VF vninf = hn::Set(df, neg_inf);
      const VF vlow = hn::Set(df, -std::numeric_limits<float>::max());
      VF vsum = hn::Zero(df);
      for (int64_t j = 0; j < kTC; j += kN) {
        const VF x = hn::Load(df, s + j);
        const VF e =
            hn::IfThenZeroElse(hn::Eq(x, vninf), hn::Exp(df, hn::Max(hn::Sub(x, vm), vlow)));
        vsum = hn::Add(vsum, e);
        hn::Store(e, df, s + j);
      }
      if (m_new != m_old) {
        const float alpha = std::exp(m_old - m_new);
        const VF va = hn::Set(df, alpha);
        for (int64_t i = 0; i < c.Dvp; i += kN)
          hn::Store(hn::Mul(hn::Load(df, row + i), va), df, row + i);
        row[c.Dvp + 1] *= alpha;
      }
      row[c.Dvp] = m_new;
      row[c.Dvp + 1] += hn::GetLane(hn::SumOfLanes(df, vsum));
    }
    for (r = 0; r + 4 <= R; r += 4) TileAccumRows<4>(df, sc + r * kTC, vt, c.Dvp, st + r * rs, rs);
    for (; r < R; ++r) TileAccumRows<1>(df, sc + r * kTC, vt, c.Dvp, st + r * rs, rs);
  }
  // Finish: sink, divide, write.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = b0 + r / c.G;
    const int64_t hq = h * c.G + r % c.G;
    const float* row = st + r * rs;
    float* o = static_cast<float*>(RowPtr(c.out, b, hq));
    float m = row[c.Dvp];
    float l = row[c.Dvp + 1];
    float w = 1.0f;
    if (c.p.sinks != nullptr) {
      const float mm = std::max(m, c.p.sinks[hq]);
      w = m == neg_inf ? 0.0f : std::exp(m - mm);
      l = l * w + std::exp(c.p.sinks[hq] - mm);
      m = mm;
    }
    if (m == neg_inf || !(l > 0)) {
      for (int64_t i = 0; i < c.Dv; ++i) o[i] = 0.0f;
      continue;
    }
    const float f = w / l;
    for (int64_t i = 0; i < c.Dv; ++i) o[i] = row[i] * f;
  }
}

// ---- dispatch
// ------------------------------------------------------------------------------------

template <DType T, bool kPermV>
void RunTyped(const Ctx& c, bool decode, const ParallelForFn& pf) {
  using TaskFn = void (*)(void*, int64_t);
  TaskFn fn;
  int64_t n;
  if (decode) {
    fn = [](void* ctx, int64_t i) { DecodeTask<T, kPermV>(*static_cast<const Ctx*>(ctx), i); };
    n = (c.Hkv + c.task_heads - 1) / c.task_heads * c.n_chunks;
  } else {
    fn = [](void* ctx, int64_t i) { PrefillTask<T, kPermV>(*static_cast<const Ctx*>(ctx), i); };
    n = c.Hkv * c.n_qtiles;
  }
  void* ctx = const_cast<Ctx*>(&c);
  if (pf.run == nullptr || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i);
  } else {
    pf.run(pf.user, n, fn, ctx);
  }
  if (decode) DecodeMerge(c);
}

void AttentionImpl(const Ctx& c, bool decode, const ParallelForFn& pf) {
  const bool perm = c.p.v_permuted;
  switch (c.k.dtype) {
    case DType::kF32:
      return perm ? RunTyped<DType::kF32, true>(c, decode, pf)
                  : RunTyped<DType::kF32, false>(c, decode, pf);
    case DType::kF16:
      return perm ? RunTyped<DType::kF16, true>(c, decode, pf)
                  : RunTyped<DType::kF16, false>(c, decode, pf);
    case DType::kBF16:
      return perm ? RunTyped<DType::kBF16, true>(c, decode, pf)
                  : RunTyped<DType::kBF16, false>(c, decode, pf);
    case DType::kQ8_0:
      return RunTyped<DType::kQ8_0, false>(c, decode, pf);
    case DType::kQ4_0:
      return RunTyped<DType::kQ4_0, false>(c, decode, pf);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {

HWY_EXPORT(AttentionImpl);

void Attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& mask, const AttentionKernelParams& params, const ParallelForFn& pf,
               TensorView* out) {
  attn::Ctx c;
  c.q = q;
  c.k = k;
  c.v = v;
  c.mask = mask;
  c.out = *out;
  c.p = params;
  c.D = k.ne[0];
  c.Hkv = k.ne[1];
  c.L = k.ne[2];
  c.B = q.ne[1];
  c.Hq = q.ne[2];
  c.G = c.Hq / c.Hkv;
  c.Dv = params.v_permuted ? v.ne[1] : v.ne[0];
  c.Dp = attn::Pad(c.D);
  c.Dvp = attn::Pad(c.Dv);
  const int threads = std::max(1, pf.run != nullptr ? pf.num_threads : 1);
  const bool decode =
      params.mode == AttentionMode::kDecode || (params.mode == AttentionMode::kAuto && c.B < 8);
  constexpr int64_t kMaxDecodeB = 64;  // DecodeTask's cursor array
  const bool use_decode = decode && c.B <= kMaxDecodeB;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Visible spans (decode) or the visible box (prefill) of each row, found once from the mask.
  // Call-level scratch layout: [span_off: B + 1 int64][row_lo, row_hi: B int32
  // each][spans][partials].
  const size_t span_cap =
      use_decode ? static_cast<size_t>(c.B) * static_cast<size_t>(c.L / 2 + 1) : 0;
  if (use_decode) {
    // One thread runs a single task over every head: nothing to merge. With more threads a long
    // history is split into chunks of cells, each task walking every KV head of its chunk one
    // after the other: on 2 threads at 32768 cells that was 7-13% faster than one task per KV head
    // over the whole history (calls alternating, session 5). Shorter histories keep tasks per KV
    // head (split into chunks only when there are fewer heads than tasks wanted): at 4096 cells
    // they were up to 10% faster than 8 chunks of 512 cells (head_dim 64). Walking every head of
    // a 128-cell block before the next block (whole rows at a time) was 5-25% slower than head
    // after head.
    const int64_t target_tasks = 4 * static_cast<int64_t>(threads);
    constexpr int64_t kMinChunk = 512;  // below this, the merge costs more than the split saves
    constexpr int64_t kMinCellChunk = 4096;  // chunks of all heads: no shorter than this
    int64_t chunks = 1;
    c.task_heads = c.Hkv;
    if (threads > 1 && c.L >= target_tasks * kMinCellChunk) {
      chunks = target_tasks;
    } else if (threads > 1) {
      chunks = c.Hkv >= target_tasks ? 1 : (target_tasks + c.Hkv - 1) / c.Hkv;
      chunks = std::max<int64_t>(1, std::min(chunks, (c.L + kMinChunk - 1) / kMinChunk));
      c.task_heads = 1;
    }
    c.chunk = (c.L + chunks - 1) / chunks;
    c.chunk = (c.chunk + attn::kBlockCells - 1) / attn::kBlockCells * attn::kBlockCells;
    if (c.chunk == 0) c.chunk = 1;
    c.n_chunks = std::max<int64_t>(1, (c.L + c.chunk - 1) / c.chunk);
  }
  const size_t partial_floats =
      use_decode ? static_cast<size_t>(c.Hkv * c.n_chunks * c.B * c.G * attn::PartialStride(c)) : 0;
  const size_t header_bytes = (static_cast<size_t>(c.B) + 1) * 8 + static_cast<size_t>(c.B) * 8;
  const size_t total_bytes = header_bytes + span_cap * 8 + partial_floats * 4 + 192;
  float* base = attn::ThreadScratch((total_bytes + 3) / 4, 0);
  char* p8 = reinterpret_cast<char*>(base);
  int64_t* span_off = reinterpret_cast<int64_t*>(p8);
  int32_t* row_lo = reinterpret_cast<int32_t*>(p8 + (c.B + 1) * 8);
  int32_t* row_hi = row_lo + c.B;
  int32_t* spans = row_hi + c.B;
  float* partials = reinterpret_cast<float*>(
      p8 + attn::Pad(static_cast<int64_t>((header_bytes + span_cap * 8 + 63) / 4)) * 4);

  span_off[0] = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    int64_t ns = span_off[b];
    int32_t lo = static_cast<int32_t>(c.L), hi = 0;
    if (mask.data == nullptr) {
      if (c.L > 0) {
        lo = 0;
        hi = static_cast<int32_t>(c.L);
        if (use_decode) {
          spans[2 * ns] = 0;
          spans[2 * ns + 1] = static_cast<int32_t>(c.L);
          ++ns;
        }
      }
    } else {
      const auto emit = [&](int64_t s0, int64_t s1) {
        if (use_decode) {
          spans[2 * ns] = static_cast<int32_t>(s0);
          spans[2 * ns + 1] = static_cast<int32_t>(s1);
          ++ns;
        }
        lo = std::min<int32_t>(lo, static_cast<int32_t>(s0));
        hi = static_cast<int32_t>(s1);
      };
      // Every cell of every row is looked at on each call: f32 and f16 masks are compared as bits
      // with the one encoding of -inf (the only one that converts to -inf) instead of converting
      // each element.
      const char* mrow = static_cast<const char*>(mask.data) + static_cast<size_t>(b) * mask.nb[1];
      const size_t mstride = mask.nb[0];
      const auto scan_bits = [&](auto neg_inf_bits) {
        attn::ForEachVisibleSpan(
            c.L,
            [&](int64_t j) {
              decltype(neg_inf_bits) bits;
              std::memcpy(&bits, mrow + static_cast<size_t>(j) * mstride, sizeof(bits));
              return bits == neg_inf_bits;
            },
            emit);
      };
      if (mask.dtype == DType::kF32) {
        scan_bits(uint32_t{0xFF800000u});
      } else if (mask.dtype == DType::kF16) {
        scan_bits(uint16_t{0xFC00u});
      } else {
        attn::ForEachVisibleSpan(
            c.L, [&](int64_t j) { return attn::MaskValue(mask, b, j) == neg_inf; }, emit);
      }
    }
    span_off[b + 1] = ns;
    row_lo[b] = lo;
    row_hi[b] = hi;
  }
  c.spans = spans;
  c.span_off = span_off;
  c.row_lo = row_lo;
  c.row_hi = row_hi;
  c.partials = partials;
  if (!use_decode) {
    // About 128 query rows per task: the K/V tile conversion (scalar transposition of K) is
    // amortized over that many rows.
    c.q_tile = std::clamp<int64_t>(128 / c.G, 1, 64);
    c.n_qtiles = (c.B + c.q_tile - 1) / c.q_tile;
  }
  HWY_DYNAMIC_DISPATCH(AttentionImpl)(c, use_decode, pf);
}

}  // namespace kv::kernels
#endif  // HWY_ONCE
