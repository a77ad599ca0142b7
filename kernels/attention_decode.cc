// Highway translation unit of decode attention (kernels/attention.h has the contract, the shapes
// and the memory-traffic derivation; kernels/attention.cc sets up the call and finds the spans).
//
// Task = (KV head, chunk of cells). Inside a task the chunk is walked in blocks of 128 cells; for
// each batch row, the row's visible spans are intersected with the block, and for each visible
// piece the K rows are converted in registers once and dotted with up to 8 query heads of the
// group at a time; then one online-softmax update per head and one pass over the V rows with the
// heads' accumulators. That walk is the same for every KV head: it is found once per call
// (BuildDecodePlan, kernels/decode_plan.h, in RunDecodeTyped) and each head replays its chunk's
// steps. Each task leaves (m, l, acc) partials; a merge combines the chunks, adds the sink and
// divides. Pieces shorter than 16 cells are not run one by one (each would pay a softmax step):
// one-cell pieces every k-th cell (batched decode's interleaved new tokens) are read in place
// through a strided view (DecodeStrided), other short pieces are copied together first
// (DecodeGathered).
//
// The K pass, by storage type and target:
// - f16 K on AVX-512, head_dim <= 64, groups of 4 / 8 heads: DotHeadsPairs8 transposes 8 rows in
//   pairs of dims, so the lanes end up holding the logits (no reduction of partial sums);
// - q8_0 K on AVX3_DL: IntDotHeads16 transposes 16 rows' codes and sums them with vpdpbusd against
//   the query rounded to 24 bits (default) or 16 bits (integer_k; IntDotHeads4 for the rest);
// - otherwise DotHeads4 (kG == 4), DotHeads2 and DotHeads: f32 FMAs per row, then a transposing
//   reduction of the partial sums (QuadSums).
// The V pass: AccumPlain (float), AccumQuant (quantized: each row's codes scaled once, shared by
// the heads; or, QuantVScaling::kWeights on Intel AVX-512, the softmax weights scaled instead),
// AccumQuantInt (integer_v, opt-in), AccumPermuted (permuted V).
//
// Cost, per cell and KV head (Zen 4: one 512-bit FMA per cycle; 1 thread, head_dim 64, 4 query
// heads per KV head, history in cache): f16 ~12.9 ns, of which the 32 FMAs of the two passes alone
// need 8.7; the rest is the f16 conversions, the K pass's transposes, the softmax (~1.6) and each
// piece's setup. q8_0 ~13-14 ns: its integer K dots cost less than f16's FMAs, but its f32 V pass
// does f16's FMAs plus a widen, convert and scale per 16 codes. So on one thread both dtypes are
// bound by arithmetic, not by memory, and q8_0 runs about as fast as f16 per call (README, Known
// gaps). Every measurement behind these choices, and every alternative tried and dropped, is in
// perf/HISTORY.md ("Kernel notes"); read it before trying to make decode faster.
//
// AVX3_DL (AVX-512 with VNNI) is compiled too, as in every Highway unit
// (kernels/highway_targets.h): the integer V and K passes use its vpdpwssd and vpdpbusd.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/attention_internal.h"
#include "kernels/highway_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention_decode.cc"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/attention_load-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
using attn::Ctx;
using attn::kBlockCells;
using attn::kMaxPass;
using attn::KPrefetch;
using attn::kRowPad;
using attn::LineCursor;
using attn::RequestedRows;
using attn::RowCursor;

// ---- decode
// --------------------------------------------------------------------------------------

constexpr int64_t kScaleStride = kBlockCells + kRowPad;
// A cold piece's K pass (see DecodeCells) asks for its K rows about this many bytes ahead, 8 to 48
// rows. Software prefetch is what keeps one core's memory busy here: without it decode ran at half
// the speed (the hardware prefetchers alone do not keep up with these streams, though a plain sum
// reaches the read bandwidth), and more requests than DecodeCells makes cost more than they hide.
// The hint (prefetcht0 / prefetcht2) is picked per CPU: PrefetchLevel (kernels/attention.h);
// bench_attention's BM_DecodePrefetchLevels measures both. The distances, hints, block sizes and
// request orders that were measured are in perf/HISTORY.md ("Kernel notes").
constexpr int64_t kPrefetchBytes = 4096;

// One batch row's query heads of a KV head's group: f32 pre-scaled rows [G][Dp], and for the
// integer K pass (AttentionKernelParams::integer_k) the same rows rounded to int16, [G][2 * D] in
// IntDotHeads4's order, with each row's step (NaN: that row takes the f32 pass).
struct QRows {
  const float* f = nullptr;
  const int16_t* i = nullptr;     // nullptr: no 16-bit integer K pass in this call
  const int8_t* bytes = nullptr;  // the same rows split into bytes, [G][kQBytesPerBlock * D / 32]
  // The rows rounded to 24 bits (the default q8_0 K pass on AVX3_DL) and split into three bytes,
  // [G][kQBytesPerBlock24 * D / 32]; nullptr: none. Exclusive with i / bytes; step serves both.
  const int8_t* bytes24 = nullptr;
  const float* step = nullptr;
  // f16 K on AVX-512 with D % 16 == 0: the query pattern of each group of 4 heads for
  // DotHeadsPairs8, [G / 4][D * kPairPatternFloatsPerDim]; nullptr: none.
  const float* pairs = nullptr;
};

// IntDotHeads16's query layout, per head and block of 32 dims: the high bytes' 8 dwords, the low
// bytes' 8 dwords, the block's correction (int32) and padding to 16-byte multiples.
constexpr int64_t kQBytesPerBlock = 80;
// IntDotHeads16<kH, true>'s, per head and block: the high, middle and low bytes' 8 dwords each,
// the three planes' corrections (int32) and padding to 16-byte multiples.
constexpr int64_t kQBytesPerBlock24 = 112;
// DotHeadsPairs8's query pattern (AVX-512, f16 K): D * 16 floats per group of 4 heads.
constexpr int64_t kPairPatternFloatsPerDim = 16;

// The f16 block scales of n quantized rows, converted with vector f16 -> f32 (exact) instead of
// one scalar conversion per (row, block, vector): out[blk * kScaleStride + j]. On AVX-512 a
// masked 32-bit gather fetches 16 rows' scales at once (the dword at the block's start: the scale
// and the first code bytes, inside the row); below it, 2-byte copies. On the Zen 4 (session 15)
// the gather and the copies measured the same, ~8% of an in-cache q8_0 decode either way; on the
// Xeon of session 23 the gather made QuantVScaling::kWeights' q8_0 / q4_0 decode 2-3.5% faster
// per call (in cache, 1 thread, head_dim 64 / 128, two alternating runs).
#if HWY_TARGET <= HWY_AVX3
// Byte offsets of rows 0..15, `stride` apart (the caller keeps 15 * stride < 2^31).
HWY_INLINE __m512i RowOffsets16(size_t stride) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int32_t>(stride)));
}

// The f16 block scales of up to 16 quantized rows as f32, one gather: the dword at each row's
// block start (block0 + row_offsets[r]) holds the scale, then code bytes of the same block. Rows
// outside `valid` are not read and give 0.
HWY_INLINE __m512 GatherBlockScales16(const char* block0, __m512i row_offsets,
                                      __mmask16 valid = 0xFFFF) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
      _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_offsets, block0, 1)));
}
#endif

template <DType T>
HWY_INLINE void GatherScales(DF df, const char* row0, size_t stride, int64_t n, int64_t nblk,
                             float* out) {
#if HWY_TARGET <= HWY_AVX3
  if (stride * static_cast<size_t>(attn::Pad(n)) < (size_t{1} << 31)) {  // int32 offsets
    const __m512i offsets = RowOffsets16(stride);
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const char* p = row0 + static_cast<size_t>(blk) * BlockBytes(T);
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid =
            n - j >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n - j)) - 1);
        _mm512_store_ps(out + blk * kScaleStride + j,
                        GatherBlockScales16(p + static_cast<size_t>(j) * stride, offsets, valid));
      }
    }
    return;
  }
#endif
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

// acc + *w * v. On AVX-512 the weight is broadcast inside the FMA (a {1to16} memory operand): a
// separate vbroadcastss of a 512-bit register costs an FP pipe slot on Zen 4 (16 of them take 16
// cycles alone, microbenchmark), which the embedded broadcast does not (16 FMAs with it run in
// the 16 cycles of 16 plain ones). The V passes need one weight per cell and head: f16 decode in
// cache 2.5% faster per call (session 15, Zen 4, 1 thread). GCC keeps one broadcast register per
// weight when it is used more than once, so the instruction is written out.
HWY_INLINE VF MulAddBroadcast(const float* w, VF v, VF acc) {
#if HWY_TARGET <= HWY_AVX3
  __m512 a = acc.raw;
  asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(a) : "v"(v.raw), "m"(*w));
  return VF{a};
#else
  return hn::MulAdd(hn::Set(DF(), *w), v, acc);
#endif
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
// Quantized plain V, dims [blk0 * 32, blk0 * 32 + kSpan): each row's codes are converted and
// multiplied by their block's scale once (shared by the heads), then FMAed into every head's
// accumulators with p[g][j] broadcast inside the FMA, kC chunks per pass: acc += p * (d * code),
// V's values formed as the reference forms them. Until session 15 the weights p * d were formed
// per block from scales gathered beforehand (GatherScales: a 2-byte copy from every row, then a
// vector conversion), which cost ~1.5 ns per cell and KV head at head_dim 64 (3.5 at 128) on the
// Zen 4 against the one multiply per 16 codes here: q8_0 decode 3-4% faster per call in cache, 2%
// (head_dim 64) and 7% (128) from DRAM at 32768 cells (1 thread, old and new alternating).
// Walks over the cells (calls of next_k.Issue per cell) of one AccumQuantGroup<T, kG, kC, ..>.
constexpr int64_t QuantGroupWalks(int64_t kC) {
  const int64_t pass = kC * static_cast<int64_t>(kN);
  return pass >= 32 ? 1 : 32 / pass;
}

// Where AccumQuantGroup's kScaleWeights form is compiled: AVX-512, whose passes cover whole blocks.
#if HWY_TARGET <= HWY_AVX3
constexpr bool kHasScaledWeights = true;
#else
constexpr bool kHasScaledWeights = false;
#endif

// kScaleWeights (QuantVScaling::kWeights, AVX-512 only; kernels/attention.h): the same sums with
// the block scale moved from the codes to the weights, w[lb][g][j] = p[g][j] * d_j (vd:
// GatherScales' output), formed once per group of blocks, 16 cells per multiply, so that the
// walk over the cells issues per 16 codes only the widen and convert beside the heads' FMAs
// (kCodes: also a multiply, and per cell and block a scale load, conversion and broadcast).
// Intel's cores run 512-bit arithmetic on two ports, and there that is what bounds the pass: q8_0
// decode 1.13-1.14x faster per call in cache (with GatherScales' gather), 0.94-1.09x from memory,
// where it runs near the memory's pace too (Xeon, session 23). Zen 4 issues the conversions beside
// its FMAs, and the scale gather cost more than the multiplies it saves (session 15: 2-7% slower).
// Rounding: the reference forms p * (d * code), d * code exact (|code| <= 127 has 7 bits, an f16
// scale 11); here p * d is rounded once more, a relative 2^-24 per term, within the f32 pass's
// own rounding. Non-finite scales propagate as there: inf * code and 0 * inf as the reference's.
template <DType T, int kG, int64_t kC, bool kScaleWeights>
HWY_INLINE void AccumQuantGroup(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t blk0,
                                const float* p, int64_t p_stride, const float* vd, float* acc,
                                int64_t acc_stride, LineCursor& next_k) {
  constexpr int64_t kPass = kC * static_cast<int64_t>(kN);
  constexpr int64_t kBlocks = kPass >= 32 ? kPass / 32 : 1;
  constexpr int64_t kSpan = kBlocks * 32;
  static_assert(!kScaleWeights || kPass % 32 == 0, "scaled weights: whole blocks per pass");
  // kScaleWeights: w[lb][g][j] = p[g][j] * d_j for the group's blocks (vd: GatherScales' output).
  HWY_ALIGN float w[kScaleWeights ? kBlocks : 1][kScaleWeights ? kG : 1]
                   [kScaleWeights ? kScaleStride : 1];
  if constexpr (kScaleWeights) {
    const int64_t padded = static_cast<int64_t>(attn::Pad(n));
    for (int64_t lb = 0; lb < kBlocks; ++lb) {
      const float* d = vd + (blk0 + lb) * kScaleStride;
      for (int g = 0; g < kG; ++g) {
        for (int64_t j = 0; j < padded; j += kN) {
          hn::Store(hn::Mul(hn::Load(df, p + g * p_stride + j), hn::Load(df, d + j)), df,
                    &w[lb][g][j]);
        }
      }
    }
  }
  for (int64_t i = blk0 * 32; i < blk0 * 32 + kSpan; i += kPass) {
    VF a[kC][kG];
    for (int64_t c = 0; c < kC; ++c)
      for (int g = 0; g < kG; ++g) a[c][g] = hn::Load(df, acc + g * acc_stride + i + c * kN);
    for (int64_t j = 0; j < n; ++j) {
      const char* vr = vrow0 + static_cast<size_t>(j) * vstride;
      next_k.Issue();
      VF d[kBlocks];
      if constexpr (!kScaleWeights) {
        for (int64_t lb = 0; lb < kBlocks; ++lb)
          d[lb] = hn::Set(df, BlockScale<T>(vr, i / 32 + lb));
      }
      for (int64_t c = 0; c < kC; ++c) {
        const int64_t lb = c * static_cast<int64_t>(kN) / 32;
        VF vv = LoadCodes<T>(df, vr, i + c * kN);
        if constexpr (!kScaleWeights) vv = hn::Mul(vv, d[lb]);
        for (int g = 0; g < kG; ++g) {
          if constexpr (kScaleWeights) {
            a[c][g] = MulAddBroadcast(&w[lb][g][j], vv, a[c][g]);
          } else {
            a[c][g] = MulAddBroadcast(&p[g * p_stride + j], vv, a[c][g]);
          }
        }
      }
    }
    for (int64_t c = 0; c < kC; ++c)
      for (int g = 0; g < kG; ++g) hn::Store(a[c][g], df, acc + g * acc_stride + i + c * kN);
  }
}

template <DType T, int kG>
HWY_INLINE void AccumQuant(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t Dv,
                           const float* p, int64_t p_stride, float* acc, int64_t acc_stride,
                           QuantVScaling scaling, LineCursor& next_k) {
  constexpr int64_t kC = kG <= 4 ? kVChunks : std::max<int64_t>(1, kVChunks * 4 / kG);
  constexpr int64_t kPass = kC * static_cast<int64_t>(kN);
  constexpr int64_t kBlocks = kPass >= 32 ? kPass / 32 : 1;
  constexpr int64_t kC1 = 32 / static_cast<int64_t>(kN) < kC ? 32 / static_cast<int64_t>(kN) : kC;
  next_k.Spread(
      n * ((Dv / 32 / kBlocks) * QuantGroupWalks(kC) + (Dv / 32 % kBlocks) * QuantGroupWalks(kC1)));
  const auto groups = [&]<bool kScaleWeights>(const float* vd) KV_INLINE_LAMBDA {
    int64_t blk = 0;
    for (; blk + kBlocks <= Dv / 32; blk += kBlocks) {
      AccumQuantGroup<T, kG, kC, kScaleWeights>(df, vrow0, vstride, n, blk, p, p_stride, vd, acc,
                                                acc_stride, next_k);
    }
    for (; blk < Dv / 32; ++blk) {  // a block left over (Dv / 32 odd with two-block passes)
      AccumQuantGroup<T, kG, kC1, kScaleWeights>(df, vrow0, vstride, n, blk, p, p_stride, vd, acc,
                                                 acc_stride, next_k);
    }
  };
  if constexpr (kHasScaledWeights) {
    if (scaling == QuantVScaling::kWeights) {
      // The V rows were asked for during the K pass: the scales gather from cache.
      HWY_ALIGN float vd[kAttentionMaxHeadDim / 32][kScaleStride];
      GatherScales<T>(df, vrow0, vstride, n, Dv / 32, &vd[0][0]);
      groups.template operator()<true>(&vd[0][0]);
      return;
    }
  }
  // kWeights is AVX-512 only (not implemented or measured on narrower targets).
  groups.template operator()<false>(nullptr);
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
                              int64_t acc_stride, LineCursor& next_k) {
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
  constexpr int kP = kG < 4 ? kG : 4;  // heads per pass: 2 x kP int32 and f32 accumulators
  // Issue is called per two cells, per pass of kP heads and per block (a block with a non-finite
  // scale walks the cells once instead: the requests then run a little ahead or behind).
  next_k.Spread((Dv / 32) * ((kG + kP - 1) / kP) * ((n + 1) / 2));
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
      AccumQuantGroup<T, kG, 2, false>(df, vrow0, vstride, n, blk, p, p_stride, nullptr, acc,
                                       acc_stride, next_k);
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
    for (int g0 = 0; g0 < kG; g0 += kP) {
      VF pa[kP][2];
      for (int g = 0; g < kP; ++g) pa[g][0] = pa[g][1] = hn::Zero(df);
      for (int64_t j0 = 0, grp = 0; j0 < n; j0 += kN, ++grp) {
        VI32 ia[kP][2];
        for (int g = 0; g < kP; ++g) ia[g][0] = ia[g][1] = hn::Zero(di);
        const int64_t j1 = std::min<int64_t>(n, j0 + kN);
        for (int64_t j = j0; j < j1; j += 2) {
          next_k.Issue();  // the cursor steps two cells at a time here
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

// v, held in a register. DotHeads2 loads each query vector once for both rows, but GCC folds the
// load into both FMAs as a memory operand and so loads it twice: 10 loads per 8 FMAs in the f16 K
// loop instead of 6. Forcing it into a register made f16 decode 2-5% faster per call on the Zen 3
// (AVX2, head_dim 64 / 128, 4096 and 32768 cells, 1 thread, calls alternating; session 22). The
// empty asm of KeepRounded (kernels/fp_barrier-inl.h) does it: a value the optimizer cannot see
// through must be in a register. Only below AVX-512 (a no-op where there is no FMA), and only for
// float K: q8_0's loop there already spills (forced, it ran 0.98-0.99x); on AVX-512 DotHeads2
// serves only the rows DotHeads4 leaves.
HWY_INLINE VF InRegister(VF v) {
#if HWY_TARGET <= HWY_AVX3
  return v;
#else
  return KeepRounded(v);
#endif
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
        const VF qv = InRegister(hn::LoadU(df, qs + g * Dp + i));
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

// DotHeadsPairs8 (below) serves head_dim 16 .. 64 (multiples of 16); above, DotHeads4 measured
// faster.
constexpr int64_t kPairsMaxHeadDim = 64;

// Whether this target dots f16 K with DotHeadsPairs8 for this call's shape: groups of 4 or 8
// heads (DecodeCells<.., 4 or 8>) and head_dim <= kPairsMaxHeadDim, on AVX-512.
template <DType T>
bool UsesPairPatterns(const Ctx& c) {
  constexpr bool kAvx512 = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
  return kAvx512 && T == DType::kF16 && c.D % 16 == 0 && c.D <= kPairsMaxHeadDim && c.G >= 4;
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Four K rows x four heads, AVX-512 only (25 of its 32 registers; AVX2 would spill). Each q vector
// is loaded once for four rows, and the 16 dot products are summed in one transposing reduction:
// 45 shuffles and adds and four 128-bit stores instead of two DotHeads2 reductions (52) and 16
// scalar stores, which took 17% of a q8_0 decode (perf). Every dtype: on the Zen 5 of session 4
// (history in cache, 1 thread) f16 decode got 6% (head_dim 128) to 17% (64) faster; an earlier
// machine had measured f16 5% slower. Session 10, f16 head_dim 128 at 32768 cells: DotHeads2
// instead ran 2-7% faster (its loads walk two rows, not four, at a time) but 10-14% slower in
// cache; taking four rows a quarter of the block apart (four sequential streams) was no faster.
// Float K rows need D % kN == 0 (no tail handling here). s[g * s_stride + r] receives row r,
// head g.
//
// BlockPairSums: blocks [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of 128 bits.
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

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ---- f16 K, 8 rows x 4 heads with the rows' dimension pairs transposed ------------------------
// DotHeads4 spends, per 4 rows and 4 heads, a transposing reduction of 16 vectors (30 shuffles
// and 15 adds): on Zen 4 the shuffles share a pipe with the FMAs. Here the rows are transposed
// instead, in 32-bit words (pairs of f16 dims), two in-lane stages per 4 rows and 8 words (16
// ymm shuffles, no cross-lane ones): word w of rows r0..r3 in the low 128 bits and word w + 4 in
// the high, which vcvtph2ps widens to a vector whose lane 8h + 2r + p holds row r, dim
// 2 * (w + 4h) + p of the 16-dim block. One FMA per head multiplies it by the query pattern
// (PairPattern: the query's dims in the same lane order, built once per call) for 4 rows at once;
// what is left is to add each row's 4 lanes (half h, parity p): 12 shuffles and 6 adds per 8
// rows and 4 heads. The FMA count and the conversions are DotHeads4's; each logit is summed in
// another order (4 lanes of D / 16 products each), with the same f32 error bound.
// Session 17, Zen 4, f16, 32 / 8 heads, 1 thread, old and new binaries alternating: head_dim 64
// 13.5 -> 12.9 ns per cell and KV head in cache and at 32768 cells (4-5%; 0.57-0.59 -> ~0.6 of
// the read bandwidth), head_dim 32 ~10%, 48 ~2%. At 80 and above the whole call ran slower (128:
// ~12%; its K pass alone ~20%, also with K in L1): not the pattern's loads (one load per two FMAs
// measured no better), not the FMA chains (two per sum: no change), partly the prefetch requests
// (all 8 rows' at once: see below). So it serves head_dim <= kPairsMaxHeadDim. Groups of 8
// heads run it twice over the same rows (64 / 8 heads, head_dim 64: 26.1 -> 24.4 ns in cache,
// 26.2 -> 24.8 at 32768 cells, against DotHeads2).
// Precondition: D % 16 == 0. pattern: [D / 16][4 words][4 heads][16] floats (PairPattern).
// s[g * s_stride + r] receives row r, head g.

// The query pattern of 4 heads' pre-scaled rows qs[g * Dp ..] for DotHeadsPairs8.
HWY_INLINE void PairPattern(const float* qs, int64_t Dp, int64_t D, float* pattern) {
  HWY_ALIGN static constexpr int32_t kIdx[4][16] = {
      {0, 1, 0, 1, 0, 1, 0, 1, 8, 9, 8, 9, 8, 9, 8, 9},
      {2, 3, 2, 3, 2, 3, 2, 3, 10, 11, 10, 11, 10, 11, 10, 11},
      {4, 5, 4, 5, 4, 5, 4, 5, 12, 13, 12, 13, 12, 13, 12, 13},
      {6, 7, 6, 7, 6, 7, 6, 7, 14, 15, 14, 15, 14, 15, 14, 15}};
  for (int64_t blk = 0; blk < D / 16; ++blk) {
    for (int w = 0; w < 4; ++w) {
      const __m512i idx = _mm512_load_si512(kIdx[w]);
      for (int g = 0; g < 4; ++g) {
        const __m512 q = _mm512_loadu_ps(qs + g * Dp + 16 * blk);
        _mm512_store_ps(pattern + ((blk * 4 + w) * 4 + g) * 16, _mm512_permutexvar_ps(idx, q));
      }
    }
  }
}

template <class Prefetch>
HWY_INLINE void DotHeadsPairs8(const char* krow0, size_t kstride, const float* pattern, int64_t D,
                               float* s, int64_t s_stride, const Prefetch& prefetch_row) {
  __m512 acc[4][2];  // [head][rows 0-3, rows 4-7]
  for (int g = 0; g < 4; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  // Half of the 8 rows' prefetch requests before the loop, half after it: all 8 at once queued
  // more requests ahead of the loads (the K pass alone at head_dim 128: ~20% -> ~9% slower).
  for (int r = 0; r < 4; ++r) prefetch_row();
  for (int64_t blk = 0; blk < D / 16; ++blk) {
    for (int half = 0; half < 2; ++half) {
      const char* k = krow0 + 4 * half * kstride + 32 * blk;
      __m256 r[4];
      for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(k + i * kstride));
      }
      // u[w]: word w of the 4 rows in the low 128 bits, word w + 4 in the high.
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                           _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
      for (int w = 0; w < 4; ++w) {
        const __m512 kv = _mm512_cvtph_ps(_mm256_castps_si256(u[w]));
        const float* pw = pattern + (blk * 4 + w) * 64;
        for (int g = 0; g < 4; ++g) {
          acc[g][half] = _mm512_fmadd_ps(_mm512_load_ps(pw + 16 * g), kv, acc[g][half]);
        }
      }
    }
  }
  for (int r = 0; r < 4; ++r) prefetch_row();
  // Halves: lanes 0-7 of T[g] rows 0-3 (lane 2r + p), lanes 8-15 rows 4-7.
  __m512 t[4];
  for (int g = 0; g < 4; ++g) {
    t[g] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, acc[g][0], acc[g][1]),
                         _mm512_shuffle_f32x4(acc[g][0], acc[g][1], 0x4E));
  }
  // Parities, two heads a and b at once: block k holds [a r2k, a r2k+1, b r2k, b r2k+1].
  HWY_ALIGN static constexpr int32_t kOrder[16] = {0, 1, 4, 5, 8,  9,  12, 13,
                                                   2, 3, 6, 7, 10, 11, 14, 15};
  const __m512i order = _mm512_load_si512(kOrder);
  for (int g = 0; g < 4; g += 2) {
    const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(t[g], t[g + 1], 0x88),
                                   _mm512_shuffle_ps(t[g], t[g + 1], 0xDD));
    const __m512 o = _mm512_permutexvar_ps(order, v);  // head g rows 0-7, head g + 1 rows 0-7
    _mm256_storeu_ps(s + g * s_stride, _mm512_castps512_ps256(o));
    _mm256_storeu_ps(s + (g + 1) * s_stride, _mm512_extractf32x8_ps(o, 1));
  }
}
#endif  // AVX3 (pairs)

#if HWY_TARGET == HWY_AVX3_DL
// ---- q8_0 K with integer products (AttentionKernelParams::integer_k) ---------------------------
// The f32 K pass spends, per 16 codes of a row, a widen, a convert and a scale multiply before
// the heads' FMAs, and one FMA per head per 16 dims: on the EPYC VMs q8_0 decode is bound by that
// arithmetic (in cache ~15% slower per cell than f16). Here each query row is rounded once per
// call to integers against its largest |element| (q ~ step * qi, |qi| <= kQueryIntMax = 32639).
// IntDotHeads16 (16 rows, the bulk of a piece) transposes the rows' codes so that the lanes hold
// cells and needs no reduction; IntDotHeads4 (the rest of a piece, 4 rows) puts two cells' blocks
// of 32 codes in a vector (cell r0 in the low 256 bits, r1 in the high), sign-extended to int16 in
// place; one vpdpwssd per 32 codes and head sums 32 products exactly (int32: 4 products of <=
// 127 * 32639 per lane and block), and one convert and one FMA per block, two cells and head apply
// the two cells' block scales. The lanes of a vector stay with their cell, so one transposing
// reduction per 4 cells (not per cell and head) gives the 16 logits. Error: qi is off by <= 1/2, so
// a logit moves by <= step / 2 * sum_i |k_i| (step = max|q| * scale / 32639), against the f32
// pass's ~D * 2^-24 * sum |q k|: max|q| * sum|k| / 65278 (~2^-16), about 1.5e-5 of the logit's
// condition.
// Blocks with a non-finite scale take the f32 pass.

// sum + the pairwise products of adjacent int16 lanes of a and the 64 bytes at b (vpdpwssd; see
// PairDot for why it is written out).
HWY_INLINE __m512i PairDotMem(__m512i sum, __m512i a, const int16_t* b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "m"(*reinterpret_cast<const __m512i*>(b)));
  return sum;
}

// The integer query's largest |element|: 32639, not 32767, so that every element splits into a
// signed high byte and a signed low byte (IntDotHeads16: qi = 256 * hi + lo, hi in [-128, 127]).
constexpr float kQueryIntMax = 32639.0f;

// Query row q[0..D) (pre-scaled f32) rounded to integers qi (|qi| <= kQueryIntMax), written twice:
// as int16 in IntDotHeads4's order (per block of 32 dims, the low vector [q0-7, q16-23, q0-7,
// q16-23] and the high [q8-15, q24-31, ...], the order in which unpacklo / unpackhi widen a 128-bit
// lane's codes) to `out`, and split into bytes in IntDotHeads16's order (kQBytesPerBlock per
// block) to `bytes`. Returns the step, NaN for a non-finite row.
// max|q[0..D)| of a query row (D a multiple of 32), NaN when an element is not finite: max|q|
// cannot flag the row by itself (x86's max drops a NaN operand, and -inf must be caught too: it is
// not a bad logit for the softmax, but it is not a representable query here).
HWY_INLINE float QueryRowAbsMax(const float* q, int64_t D) {
  const DF df;
  VF vmax = hn::Zero(df);
  bool finite = true;
  for (int64_t i = 0; i < D; i += kN) {
    const VF x = hn::LoadU(df, q + i);
    vmax = hn::Max(vmax, hn::Abs(x));
    finite &= hn::AllTrue(df, hn::IsFinite(x));
  }
  return finite ? hn::GetLane(hn::MaxOfLanes(df, vmax)) : std::numeric_limits<float>::quiet_NaN();
}

HWY_INLINE float QuantizeQueryRow(const float* q, int64_t D, int16_t* out, int8_t* bytes) {
  const DF df;
  const float m = QueryRowAbsMax(q, D);
  if (std::isnan(m)) return m;
  const VF inv = hn::Set(df, m > 0.0f ? kQueryIntMax / m : 0.0f);
  const hn::Rebind<int16_t, DF> d16;
  HWY_ALIGN int16_t r[32];  // one block's elements, rounded to nearest (even on ties, as lrint)
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    for (int64_t i = 0; i < 32; i += kN) {
      const VF x = hn::Mul(hn::LoadU(df, q + blk * 32 + i), inv);
      hn::Store(hn::DemoteTo(d16, hn::NearestInt(x)), d16, r + i);
    }
    // 128-bit lanes of the low vector: dims 0-7, 16-23, 0-7, 16-23; of the high: 8-15, 24-31, ...
    int16_t* o = out + blk * 64;
    for (int lane = 0; lane < 4; ++lane) {
      std::memcpy(o + lane * 8, r + (lane % 2) * 16, 16);
      std::memcpy(o + 32 + lane * 8, r + (lane % 2) * 16 + 8, 16);
    }
    // qi = 256 * hi + lo with both bytes signed; the correction undoes IntDotHeads16's code offset.
    int8_t* ob = bytes + blk * kQBytesPerBlock;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int lo = static_cast<int8_t>(static_cast<uint8_t>(r[i] & 0xFF));
      ob[i] = static_cast<int8_t>((r[i] - lo) / 256);
      ob[32 + i] = static_cast<int8_t>(lo);
      sum += r[i];
    }
    const int32_t correction = -128 * sum;
    std::memcpy(ob + 64, &correction, sizeof(correction));
  }
  return m * (1.0f / kQueryIntMax);
}

// The default q8_0 K pass (no integer_k, not float_k) rounds the query to 24 bits instead:
// |qi| <= kQueryIntMax24 = 127 * (65536 + 256 + 1), so that qi = 65536 * hi + 256 * mid + lo with
// three signed bytes. A logit then moves by at most step / 2 * sum|k| = max|q| * scale * sum|k| /
// 16711422 (~2^-24, the f32 pass's own rounding scale) plus the f32 rounding of each block's sum
// (below), which is why it needs no flag: on the Zen 4 EPYC of session 14 it ran 1.13-1.22x
// faster per call than the f32 pass at 32768 cells (a third vpdpbusd per vector and head costs
// 10-13% against the 16-bit query).
constexpr float kQueryIntMax24 = 8355711.0f;

// Query row q[0..D) (pre-scaled f32) rounded to integers |qi| <= kQueryIntMax24 and split into
// bytes in IntDotHeads16<kH, true>'s order (kQBytesPerBlock24 per block). Returns the step, NaN
// for a non-finite row.
HWY_INLINE float QuantizeQueryRow24(const float* q, int64_t D, int8_t* bytes) {
  const float m = QueryRowAbsMax(q, D);
  if (std::isnan(m)) return m;
  // In double: an f32 product near 2^23 would round by up to half a unit on its own (and could
  // reach 8355712, whose top byte does not fit), doubling the error bound. Once per row and call.
  const double step = static_cast<double>(m) / kQueryIntMax24;
  const double inv = m > 0.0f ? kQueryIntMax24 / static_cast<double>(m) : 0.0;
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    // qi = 65536 * hi + 256 * mid + lo, every byte signed; per plane the correction -128 * sum
    // undoes IntDotHeads16's code offset.
    int8_t* ob = bytes + blk * kQBytesPerBlock24;
    int32_t sums[3] = {0, 0, 0};
    for (int i = 0; i < 32; ++i) {
      const int32_t qi = static_cast<int32_t>(std::clamp(std::nearbyint(q[blk * 32 + i] * inv),
                                                         -static_cast<double>(kQueryIntMax24),
                                                         static_cast<double>(kQueryIntMax24)));
      const int32_t lo = static_cast<int8_t>(static_cast<uint8_t>(qi & 0xFF));
      const int32_t upper = (qi - lo) / 256;
      const int32_t mid = static_cast<int8_t>(static_cast<uint8_t>(upper & 0xFF));
      const int32_t hi = (upper - mid) / 256;
      ob[i] = static_cast<int8_t>(hi);
      ob[32 + i] = static_cast<int8_t>(mid);
      ob[64 + i] = static_cast<int8_t>(lo);
      sums[0] += hi;
      sums[1] += mid;
      sums[2] += lo;
    }
    for (int p = 0; p < 3; ++p) {
      const int32_t correction = -128 * sums[p];
      std::memcpy(ob + 96 + 4 * p, &correction, sizeof(correction));
    }
  }
  return static_cast<float>(step);
}

// Logits of 4 q8_0 K rows (krow0, kstride apart) for kH query heads: s[g * s_stride + r] =
// step[g] * sum_blk d[r][blk] * (codes . qi[g]) over the blocks. qi: the heads' rows from
// QuantizeQueryRow, qi_stride int16 apart. Returns false, with s unspecified, when a block scale
// of the rows is inf or NaN (the caller then runs the f32 pass for them). Up to 8 heads share one
// load and widening of the codes (2 x 8 accumulators fit AVX-512's 32 registers): a group of 8
// heads per KV head no longer converts each K block twice.
template <int kH>  // 1..8 heads
HWY_INLINE bool IntDotHeads4(const char* krow0, size_t kstride, const int16_t* qi,
                             int64_t qi_stride, const float* step, int64_t D, float* s,
                             int64_t s_stride) {
  static_assert(kH >= 1 && kH <= 8);
  constexpr int kQuads = (kH + 3) / 4;  // heads are reduced four at a time
  constexpr int kG = 4 * kQuads;
  __m512 acc[2][kG];  // heads from kH on stay 0
  for (int p = 0; p < 2; ++p)
    for (int g = 0; g < kG; ++g) acc[p][g] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    const char* block = krow0 + static_cast<size_t>(blk) * BlockBytes(DType::kQ8_0);
    for (int p = 0; p < 2; ++p) {
      const char* b0 = block + static_cast<size_t>(2 * p) * kstride;
      const char* b1 = b0 + kstride;
      // The two cells' scales: lanes 0-7 the first cell's, 8-15 the second's (exact).
      const __m512 ds = _mm512_cvtph_ps(_mm256_mask_broadcastw_epi16(
          _mm256_broadcastw_epi16(_mm_loadu_si16(b0)), 0xFF00, _mm_loadu_si16(b1)));
      const __m512i bytes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
      const __m512i sign = _mm512_movm_epi8(_mm512_movepi8_mask(bytes));
      const __m512i lo = _mm512_unpacklo_epi8(bytes, sign);
      const __m512i hi = _mm512_unpackhi_epi8(bytes, sign);
      for (int g = 0; g < kH; ++g) {
        const int16_t* qg = qi + g * qi_stride + blk * 64;
        const __m512i dot = PairDotMem(_mm512_madd_epi16(lo, _mm512_load_si512(qg)), hi, qg + 32);
        acc[p][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, acc[p][g]);
      }
    }
  }
  const DF df;
  for (int qd = 0; qd < kQuads; ++qd) {
    const int h0 = 4 * qd;
    const int nh = kH - h0 < 4 ? kH - h0 : 4;
    // Block r of `all`: cell r's four heads (QuadSums per pair of cells, then each cell's halves).
    const VF u0 =
        QuadSums(df, VF{acc[0][h0]}, VF{acc[0][h0 + 1]}, VF{acc[0][h0 + 2]}, VF{acc[0][h0 + 3]});
    const VF u1 =
        QuadSums(df, VF{acc[1][h0]}, VF{acc[1][h0 + 1]}, VF{acc[1][h0 + 2]}, VF{acc[1][h0 + 3]});
    __m512 all = _mm512_mul_ps(BlockPairSums(u0, u1).raw,
                               _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(
                                   static_cast<__mmask8>((1 << nh) - 1), step + h0)));
    // A non-finite block scale makes its cell's logits non-finite (inf times an integer sum is
    // inf or NaN), and finite scales cannot: the integer sums and the step are bounded.
    if (_mm512_fpclass_ps_mask(all, 0x99) != 0) return false;  // QNaN, SNaN, +inf, -inf
    // Block g: head h0 + g's four cells.
    all = _mm512_permutexvar_ps(
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), all);
    for (int g = 0; g < nh; ++g) {
      _mm_storeu_ps(s + (h0 + g) * s_stride, _mm512_extractf32x4_ps(all, 0));
      all = _mm512_shuffle_f32x4(all, all, _MM_SHUFFLE(0, 3, 2, 1));
    }
  }
  return true;
}

// acc + the sums of four products of the unsigned bytes of `k` with the four signed bytes at q,
// broadcast to every lane (vpdpbusd with an embedded broadcast; see PairDot for why it is asm).
HWY_INLINE __m512i QuadDotBroadcast(__m512i acc, __m512i k, const int8_t* q) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(k), "m"(*reinterpret_cast<const int32_t*>(q)));
  return acc;
}

// Logits of 16 q8_0 K rows (krow0, kstride apart) for kH query heads, the cells along the lanes:
// s[g * s_stride + r] = step[g] * sum_blk d[r][blk] * (codes[r] . qi[g]) for rows r < 16. qb: the
// heads' rows from QuantizeQueryRow's `bytes`, qb_stride bytes apart. Returns false, with s
// unspecified, when a block scale of the rows is inf or NaN (the caller then runs the f32 pass).
// Per block, the 16 rows' codes are transposed in registers so that lane r of vector t holds dims
// 4t .. 4t + 3 of row r, offset by 128 to unsigned bytes; then two vpdpbusd per vector and head
// (the query's high and low bytes, broadcast from memory) sum 64 products each, exactly, and
// sum_i (k_i + 128) * qi_i = 256 * sum (k_i + 128) hi_i + sum (k_i + 128) lo_i, less the head's
// per-block correction 128 * sum qi. Unlike IntDotHeads4 no transposing reduction follows: the
// lanes already hold the 16 logits of a head. The int32 sums cannot overflow: 256 * |sum
// (k + 128) hi| <= 256 * 32 * 255 * 128 < 2^28 and |sum k qi| <= 32 * 128 * 32639 < 2^28. Same
// rounding of the query as IntDotHeads4 (the same qi), and one int32 -> f32 conversion per block
// and logit instead of one per 8 lanes: the error bound of the integer K pass holds as stated
// there. The 16 rows' prefetch requests (DecodeCells'
// prefetch_row) are spread over the blocks and heads: issued all before the rows (as the 4-row
// loop does) they left this kernel no faster than IntDotHeads4.
// Session 13, 16-row against 4-row kernel alternating in one process (best of 30-200 calls,
// EPYC Zen 5, 32 / 8 heads): in cache (2048 cells, 1 thread) head_dim 64 6-15% faster (8 query
// heads per KV head 15%, 1 head 9%), 128 4%, 256 (2 heads) equal; at 32768 cells with integer_v
// head_dim 64 8-27% on 1 thread and 8-11% on 2; head_dim 128 -7% to +14% (noise, the host was
// busy). The gain is the reduction that IntDotHeads4 pays per cell and head, which matters less as
// head_dim grows. The same transpose for the f32 pass (each code byte sign-extended in its lane
// and converted, one FMA per 16 codes and head with the query element broadcast from memory, one
// per block and head for the scales) was measured and not kept: equal at head_dim 64, 5-10%
// slower at 128 (the FMAs and conversions, not the reduction, bound that pass).
template <int kH, bool kWide, class Prefetch>  // 1..8 heads; kWide: the 24-bit query
HWY_INLINE bool IntDotHeads16(const char* krow0, size_t kstride, const int8_t* qb,
                              int64_t qb_stride, const float* step, int64_t D, float* s,
                              int64_t s_stride, const Prefetch& prefetch_row) {
  static_assert(kH >= 1 && kH <= 8);
  __m512 acc[kH];
  for (int g = 0; g < kH; ++g) acc[g] = _mm512_setzero_ps();
  // Byte offsets of rows 0..15 for the scales' gather (the caller keeps 15 * kstride < 2^31).
  const __m512i row_offsets = RowOffsets16(kstride);
  const __m512i offset_codes = _mm512_set1_epi8(static_cast<char>(0x80));
  const auto codes = [&](int64_t r, int64_t blk) KV_INLINE_LAMBDA {
    return reinterpret_cast<const __m256i*>(krow0 + static_cast<size_t>(r) * kstride +
                                            static_cast<size_t>(blk) * BlockBytes(DType::kQ8_0) +
                                            2);
  };
  for (int64_t blk = 0; blk < D / 32; ++blk) {
    // z[i]: rows i and i + 4 (i < 4), rows 4 + i and 8 + i (i >= 4), so that the last shuffle
    // below leaves the rows in order along the lanes.
    __m512i z[8];
    for (int i = 0; i < 8; ++i) {
      const int64_t r0 = i < 4 ? i : 4 + i;
      z[i] = _mm512_xor_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(codes(r0, blk))),
                             _mm256_loadu_si256(codes(r0 + 4, blk)), 1),
          offset_codes);
    }
    // 8 x 8 dword transposes inside each 256-bit half, then the halves' 128-bit lanes regrouped.
    __m512i t[8], u[8], kt[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // u[i] (i < 4) holds dword i of rows 0-3 | dword i + 4 of rows 0-3 | the same of rows 4-7;
    // u[4 + i] the same for rows 8-15.
    for (int i = 0; i < 4; ++i) {
      kt[i] = _mm512_shuffle_i64x2(u[i], u[4 + i], _MM_SHUFFLE(2, 0, 2, 0));
      kt[i + 4] = _mm512_shuffle_i64x2(u[i], u[4 + i], _MM_SHUFFLE(3, 1, 3, 1));
    }
    const __m512 scale = GatherBlockScales16(
        krow0 + static_cast<size_t>(blk) * BlockBytes(DType::kQ8_0), row_offsets);
    const int64_t per_block = (16 + D / 32 - 1) / (D / 32);
    // Heads kH0 .. kH0 + kQ (a quad at most), the dims outside and the heads inside: each
    // transposed vector kt[i] feeds the quad's 12 accumulators (8 with the 16-bit query), all
    // independent of each other. Head after head, each plane's 8 vpdpbusd formed one chain of
    // dependent instructions (~5 cycles of latency each), three chains per head. Session 27
    // (Xeon, 4 heads per KV head, in L2, processes alternating): q8_0 decode 1.04x faster per
    // call at head_dim 64, 1.02-1.03x at 128; 8 heads the same; from DRAM no change measured.
    // Everything is unrolled, or GCC keeps the accumulators on the stack (a load, a vpdpbusd and
    // a store each; perf: ~9% of a q8_0 call in cache, before).
    const auto quad = [&]<int kQ, int kH0>() KV_INLINE_LAMBDA {
      constexpr int kPlanes = kWide ? 3 : 2;  // the query's bytes: high (middle) low
      constexpr int64_t kQBytes = kWide ? kQBytesPerBlock24 : kQBytesPerBlock;
      const int8_t* qblk = qb + kH0 * qb_stride + blk * kQBytes;
      __m512i sums[kPlanes][kQ];
#pragma GCC unroll 4
      for (int g = 0; g < kQ; ++g) {
        // The planes start at their corrections (128 * sum qi, undoing the codes' offset).
        int32_t corrections[kPlanes] = {};
        std::memcpy(corrections + (kWide ? 0 : 1), qblk + g * qb_stride + 32 * kPlanes,
                    (kWide ? 3 : 1) * sizeof(int32_t));
#pragma GCC unroll 3
        for (int k = 0; k < kPlanes; ++k) sums[k][g] = _mm512_set1_epi32(corrections[k]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        if (i % 4 == 0) {  // this quad's share of the rows' prefetch requests, in two halves
          constexpr int64_t kSteps = 2 * ((kH + 3) / 4);
          const int64_t step = 2 * (kH0 / 4) + i / 4;
          for (int64_t r = step * per_block / kSteps; r < (step + 1) * per_block / kSteps; ++r) {
            prefetch_row();
          }
        }
#pragma GCC unroll 4
        for (int g = 0; g < kQ; ++g) {
#pragma GCC unroll 3
          for (int k = 0; k < kPlanes; ++k) {
            sums[k][g] = QuadDotBroadcast(sums[k][g], kt[i], qblk + g * qb_stride + 32 * k + 4 * i);
          }
        }
      }
#pragma GCC unroll 4
      for (int g = 0; g < kQ; ++g) {
        const __m512i hi_mid = _mm512_add_epi32(_mm512_slli_epi32(sums[0][g], 8), sums[1][g]);
        if constexpr (kWide) {
          // Each plane's sum with its correction is sum k * plane, |.| <= 32 * 128 * 128 = 2^19,
          // so 256 * hi + mid is exact in int32 (< 2^28); its conversion and the final
          // multiply-add round like the f32 pass's own sums.
          const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_mid), _mm512_set1_ps(256.0f),
                                             _mm512_cvtepi32_ps(sums[2][g]));
          acc[kH0 + g] = _mm512_fmadd_ps(dot, scale, acc[kH0 + g]);
        } else {
          acc[kH0 + g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_mid), scale, acc[kH0 + g]);
        }
      }
    };
    quad.template operator()<(kH < 4 ? kH : 4), 0>();
    if constexpr (kH > 4) quad.template operator()<kH - 4, 4>();
  }
  __mmask16 bad = 0;
  for (int g = 0; g < kH; ++g) {
    const __m512 logits = _mm512_mul_ps(acc[g], _mm512_set1_ps(step[g]));
    // A non-finite block scale makes its row's logits non-finite (see IntDotHeads4).
    bad |= _mm512_fpclass_ps_mask(logits, 0x99);  // QNaN, SNaN, +inf, -inf
    _mm512_storeu_ps(s + g * s_stride, logits);
  }
  return bad == 0;
}
#endif  // AVX3_DL

// Float dtypes. Dimension chunks outside, cells inside: each head's accumulator chunk stays in a
// register.
template <DType T, int kG>
HWY_INLINE void AccumPlain(DF df, const char* vrow0, size_t vstride, int64_t n, int64_t Dv,
                           const float* p, int64_t p_stride, float* acc, int64_t acc_stride,
                           LineCursor& next_k) {
  // The walks over the cells below, one Issue per cell each: the requests for the next piece's K
  // rows spread over all of them. Spread over the first walk only (head_dim 128 walks twice),
  // they ran ahead of what the memory delivers and the next K pass waited on its rows: f16 decode,
  // head_dim 128, 32768 cells, 1 thread, 31.5 -> 23.9 ns per cell and KV head (session 16, Zen 4).
  // kC chunks per pass: kVChunks for up to 4 heads, fewer for 8 (the same 4 x 4 accumulators).
  constexpr int64_t kC = kG <= 4 ? kVChunks : std::max<int64_t>(1, kVChunks * 4 / kG);
  const int64_t per_pass = kC > 1 ? kC * static_cast<int64_t>(kN) : 0;
  const int64_t full = per_pass > 0 ? Dv / per_pass : 0;
  const int64_t rest = Dv - full * per_pass;
  next_k.Spread(n * (full + (rest + static_cast<int64_t>(kN) - 1) / static_cast<int64_t>(kN)));
  int64_t i = 0;
  if constexpr (kC > 1) {
    for (; i + kC * static_cast<int64_t>(kN) <= Dv; i += kC * kN) {
      VF a[kC][kG];
      for (int64_t c = 0; c < kC; ++c)
        for (int g = 0; g < kG; ++g) a[c][g] = hn::Load(df, acc + g * acc_stride + i + c * kN);
      for (int64_t j = 0; j < n; ++j) {
        const char* vr = vrow0 + static_cast<size_t>(j) * vstride;
        next_k.Issue();
        VF vv[kC];
        for (int64_t c = 0; c < kC; ++c) vv[c] = LoadFloat<T>(df, vr, i + c * kN);
        for (int g = 0; g < kG; ++g) {
          for (int64_t c = 0; c < kC; ++c)
            a[c][g] = MulAddBroadcast(&p[g * p_stride + j], vv[c], a[c][g]);
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
      next_k.Issue();
      const VF vv = tail ? LoadFloatTail<T>(df, vr, i, Dv - i) : LoadFloat<T>(df, vr, i);
      for (int g = 0; g < kG; ++g) a[g] = MulAddBroadcast(&p[g * p_stride + j], vv, a[g]);
    }
    for (int g = 0; g < kG; ++g) hn::Store(a[g], df, acc + g * acc_stride + i);
  }
}

// Permuted V (cells fastest): acc[g][d] += dot(p[g][0..n), V[d][c0..c0+n)).
template <DType T, int kG>
HWY_INLINE void AccumPermuted(DF df, const char* vhead, size_t dim_stride, int64_t c0, int64_t n,
                              int64_t Dv, const float* p, int64_t p_stride, float* acc,
                              int64_t acc_stride, LineCursor& next_k) {
  constexpr size_t kElem = BlockBytes(T);
  for (int64_t d = 0; d < Dv; ++d) {
    next_k.Issue();
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

// One online-softmax step for the kG heads of one batch row over the same n cells: softcap
// (optional) and mask on the scores s[g * s_stride + j], then each head's scores become weights p
// and its state is rescaled. state + g * rs: head g's acc[0..Dvp), then m at [Dvp], l at [Dvp + 1].
// Precondition: n >= 1, s padded with zeros to attn::Pad(n), no score is -inf.
// The mask row is loaded once for all heads and added in the pass that finds the heads' maxima,
// and the heads' exponentials are computed side by side (independent chains): 2% off an f16 decode
// call in cache against one head at a time (session 15, Zen 4, same results bit for bit).
// A NaN or +inf score (inf or NaN in Q or K) poisons its head's state: m becomes NaN, which
// rescales acc and l to NaN here and in every later step, and the merge writes a NaN row (as the
// reference). The max alone cannot tell (x86's max drops a NaN operand): a compare per vector.
// Heads g0 .. g0 + kG of batch row b, where g0 + g >= G names head (g0 + g) % G of row
// b + (g0 + g) / G (rows that see the same cells run together: DecodeHeadChunk); each head adds its
// own row's mask values.
template <int kG>
HWY_INLINE void SoftmaxHeads(DF df, const Ctx& c, int64_t b, int64_t g0, int64_t c0, int64_t n,
                             float* s, int64_t s_stride, float* state, int64_t rs) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t Dvp = c.Dvp;
  if (c.p.softcap != 0) {
    const VF cap = hn::Set(df, c.p.softcap);
    const VF inv = hn::Set(df, 1.0f / c.p.softcap);
    for (int g = 0; g < kG; ++g) {
      for (int64_t j = 0; j < n; j += kN) {
        const VF x = hn::Load(df, s + g * s_stride + j);
        hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(x, inv))), df, s + g * s_stride + j);
      }
    }
  }
  // Visible cells carry 0 in the caches' masks; other finite values are honoured. The caches
  // always pass a mask: vector loads (f32 / f16, elements packed) instead of a scalar per cell.
  int64_t mask_row[kG];  // the batch row of each head
  const char* mrow[kG] = {};
  bool new_row[kG];  // head g's row differs from head g - 1's: load its mask values
  for (int g = 0; g < kG; ++g) {
    mask_row[g] = b + (g0 + g) / c.G;
    new_row[g] = g == 0 || mask_row[g] != mask_row[g - 1];
    if (c.mask.data != nullptr) {
      mrow[g] = static_cast<const char*>(c.mask.data) +
                static_cast<size_t>(mask_row[g]) * c.mask.nb[1] +
                static_cast<size_t>(c0) * c.mask.nb[0];
    }
  }
  const bool masked = c.mask.data != nullptr;
  const VF vinf = hn::Set(df, kInf);
  VF vmax[kG], bad[kG];  // bad: all bits set in lanes that saw a NaN or +inf
  for (int g = 0; g < kG; ++g) {
    vmax[g] = hn::Set(df, -kInf);
    bad[g] = hn::Zero(df);
  }
  int64_t j = 0;
  for (; j + static_cast<int64_t>(kN) <= n; j += kN) {
    VF mv = hn::Zero(df);
    for (int g = 0; g < kG; ++g) {
      if (masked && new_row[g]) {
        mv = LoadMaskValues(df, c.mask.dtype, mrow[g], j);
      }
      const VF x = hn::Add(hn::Load(df, s + g * s_stride + j), mv);
      hn::Store(x, df, s + g * s_stride + j);
      vmax[g] = hn::Max(vmax[g], x);
      bad[g] = hn::Or(bad[g], hn::VecFromMask(df, hn::Not(hn::Lt(x, vinf))));
    }
  }
  const int64_t tail = j;
  VF vm[kG], vsum[kG];
  for (int g = 0; g < kG; ++g) {
    float mx = hn::GetLane(hn::MaxOfLanes(df, vmax[g]));
    bool poisoned = !hn::AllFalse(df, hn::MaskFromVec(bad[g]));
    for (int64_t t = tail; t < n; ++t) {
      float& x = s[g * s_stride + t];
      if (masked) x += attn::MaskValue(c.mask, mask_row[g], c0 + t);
      mx = std::max(mx, x);
      poisoned = poisoned || !(x < kInf);
    }
    const float m_old = state[g * rs + Dvp];
    vm[g] = hn::Set(df, poisoned ? std::numeric_limits<float>::quiet_NaN() : std::max(m_old, mx));
    vsum[g] = hn::Zero(df);
  }
  // A difference of extreme logits may reach -inf: SoftmaxExp clamps it.
  for (j = 0; j < tail; j += kN) {
    for (int g = 0; g < kG; ++g) {
      const VF e = SoftmaxExp(df, hn::Sub(hn::Load(df, s + g * s_stride + j), vm[g]));
      vsum[g] = hn::Add(vsum[g], e);
      hn::Store(e, df, s + g * s_stride + j);
    }
  }
  if (tail < n) {
    const auto first = hn::FirstN(df, static_cast<size_t>(n - tail));
    for (int g = 0; g < kG; ++g) {
      const VF x = hn::Load(df, s + g * s_stride + tail);
      const VF e = hn::IfThenElseZero(first, SoftmaxExp(df, hn::Sub(x, vm[g])));
      vsum[g] = hn::Add(vsum[g], e);
      hn::Store(e, df, s + g * s_stride + tail);
    }
  }
  for (int g = 0; g < kG; ++g) {
    float* st = state + g * rs;
    const float m_old = st[Dvp];
    const float m_new = hn::GetLane(vm[g]);
    if (m_new != m_old) {                           // also when m_new is NaN: poisons acc and l
      const float alpha = std::exp(m_old - m_new);  // 0 on the first visible cell (m_old = -inf)
      const VF va = hn::Set(df, alpha);
      for (int64_t i = 0; i < Dvp; i += kN) {
        hn::Store(hn::Mul(hn::Load(df, st + i), va), df, st + i);
      }
      st[Dvp + 1] *= alpha;
    }
    st[Dvp] = m_new;
    st[Dvp + 1] += hn::GetLane(hn::SumOfLanes(df, vsum[g]));
  }
}

// Cells [c0, c0 + n) for heads g0 .. g0 + kG of KV head h, counted from head 0 of batch row b
// (past G they are the next rows' heads, SoftmaxHeads); every row they belong to sees every cell.
//
// Software prefetch keeps the memory busy through both passes: the K pass asks for this piece's V
// rows, the V pass for the K rows that follow the piece (kp.next_from .. next_to), so the next
// piece's K pass finds its rows on the way (kp.ready) and only a cold piece asks for its own K
// rows, kPrefetchBytes ahead. (A single thread keeps too few misses in flight on its own to reach
// the read bandwidth.) Session 12, f16, 32 / 8 heads, 32768 cells, old / new alternating in one
// process: the K pass asking for its own K rows ahead and nothing asked during the V pass left
// the memory idle while V was summed: head_dim 64 3150 -> 2697 and 2649 -> 2250 us on 1 thread,
// 1704 -> 1596 on 2; head_dim 128 5226 -> 4592 and 3465 -> 3039. q8_0, compute-bound: 0-4%.
template <DType T, bool kPermV, int kG>
HWY_NOINLINE void DecodeCells(const Ctx& c, int64_t h, int64_t b, int64_t g0, int64_t c0, int64_t n,
                              const QRows& q, float* rows, KPrefetch kp) {
  const DF df;
  const float* qs = q.f;
  HWY_ALIGN float s[kG][kBlockCells + kRowPad];
  const char* kbase = static_cast<const char*>(c.k.data) + static_cast<size_t>(h) * c.k.nb[1];
  // V rows of cells exist only in a plain V. A permuted V ([L, Dv, Hkv], cells fastest) has none,
  // and this address would lie c0 head strides past its head: undefined even unread, and on a
  // 32-bit machine it wrapped around the address space (UBSan, armhf). There vrow0 stays null
  // and vrow(r) is null for every r: nothing to prefetch.
  const char* vrow0 = kPermV ? nullptr
                             : static_cast<const char*>(c.v.data) +
                                   static_cast<size_t>(h) * c.v.nb[1] +
                                   static_cast<size_t>(c0) * c.v.nb[2];

  const size_t kst = c.k.nb[2], vst = c.v.nb[2];
  const char* krow0 = kbase + static_cast<size_t>(c0) * kst;
  const auto krow = [&](int64_t r) { return krow0 + static_cast<size_t>(r) * kst; };
  const auto vrow = [&](int64_t r) {
    return kPermV ? vrow0 : vrow0 + static_cast<size_t>(r) * vst;
  };
  // A cold piece asks for its first `ahead` K rows at once, then during the K pass for the rest,
  // one row's lines per row (so about `ahead` rows ahead); the K pass asks for the piece's V rows
  // not asked for yet (a permuted V is read by dimension lines: not prefetched).
  const int64_t ahead =
      std::clamp<int64_t>(kPrefetchBytes / static_cast<int64_t>(RowBytes(T, c.D)), 8, 48);
  const int64_t k_from = std::max(kp.ready, std::min(ahead, n));
  const bool l2 = c.p.prefetch == PrefetchLevel::kL2;
  // A strided view (DecodeStrided, kp.rows_only): the piece's own rows, not the range they span.
  LineCursor k_rows, v_rows;
  RowCursor k_own, v_own;
  if (kp.rows_only) {
    k_own = RowCursor{krow(kp.ready), n - kp.ready, kst, RowBytes(T, c.D), l2};
    for (int64_t r = kp.ready; r < k_from; ++r) k_own.Issue();
    v_own = RowCursor{vrow(kp.v_ready), n - kp.v_ready, vst, RowBytes(T, c.Dv), l2};
  } else {
    LineCursor::Over(krow(kp.ready), krow(k_from), 1, l2).Issue();
    k_rows = LineCursor::Over(krow(k_from), krow(n), n - k_from, l2);
    v_rows = LineCursor::Over(vrow(kp.v_ready), kPermV ? vrow(0) : vrow(n), n, l2);
  }
  const bool rows_only = kp.rows_only;
  const auto prefetch_row = [&]() KV_INLINE_LAMBDA {
    if (rows_only) {
      v_own.Issue();
      k_own.Issue();
    } else {
      v_rows.Issue();
      k_rows.Issue();
    }
  };
  // V pass: the K rows after the piece, a few lines per cell (or per dimension line of a permuted
  // V) so that the requests spread over the pass.
  LineCursor next_k = LineCursor::Over(krow(kp.next_from), krow(kp.next_to), kPermV ? c.Dv : n, l2);
  int64_t j = 0;
#if HWY_TARGET == HWY_AVX3_DL
  if constexpr (T == DType::kQ8_0) {
    const bool wide = q.bytes24 != nullptr;
    bool use_int = q.i != nullptr || wide;
    for (int g = 0; g < kG && use_int; ++g) use_int = !std::isnan(q.step[g0 + g]);
    static_assert(kG <= 8, "IntDotHeads4 serves up to 8 heads");
    // Rows [j, j + rows) with a non-finite block scale: their f32 logits, as the reference has.
    const auto f32_logits = [&](int64_t j, int64_t rows) {
      for (int64_t r = j; r < j + rows; ++r) {
        DotHeads<T, kG>(df, kbase + static_cast<size_t>(c0 + r) * kst, qs + g0 * c.Dp, c.Dp, c.D,
                        &s[0][r], kBlockCells + kRowPad);
      }
    };
    // (The scales' gather takes 32-bit row offsets.)
    const bool rows16 = kst <= (size_t{1} << 26);
    for (; use_int && rows16 && j + 16 <= n; j += 16) {
      const char* k16 = kbase + static_cast<size_t>(c0 + j) * kst;
      const int64_t qb24 = kQBytesPerBlock24 * (c.D / 32);
      const int64_t qb16 = kQBytesPerBlock * (c.D / 32);
      bool ok;
      if constexpr (kG > 4) {
        // The 24-bit pass keeps three sums per head: for 8 heads at once GCC spills (24.8 against
        // 32.1 ns per cell and KV head with two passes of 4 heads over the same 16 rows, head_dim
        // 64, 8 query heads per KV head, in cache, session 16 Zen 4; 45 against 57.6 at 128). The
        // 16-bit pass keeps 8 heads in one (split, it ran 7% slower).
        constexpr int kHalf = kG / 2;
        if (wide) {
          const bool first =
              IntDotHeads16<kHalf, true>(k16, kst, q.bytes24 + g0 * qb24, qb24, q.step + g0, c.D,
                                         &s[0][j], kBlockCells + kRowPad, prefetch_row);
          const bool second = IntDotHeads16<kG - kHalf, true>(
              k16, kst, q.bytes24 + (g0 + kHalf) * qb24, qb24, q.step + g0 + kHalf, c.D,
              &s[kHalf][j], kBlockCells + kRowPad, [] {});
          ok = first && second;
        } else {
          ok = IntDotHeads16<kG, false>(k16, kst, q.bytes + g0 * qb16, qb16, q.step + g0, c.D,
                                        &s[0][j], kBlockCells + kRowPad, prefetch_row);
        }
      } else {
        ok = wide ? IntDotHeads16<kG, true>(k16, kst, q.bytes24 + g0 * qb24, qb24, q.step + g0, c.D,
                                            &s[0][j], kBlockCells + kRowPad, prefetch_row)
                  : IntDotHeads16<kG, false>(k16, kst, q.bytes + g0 * qb16, qb16, q.step + g0, c.D,
                                             &s[0][j], kBlockCells + kRowPad, prefetch_row);
      }
      if (!ok) f32_logits(j, 16);
    }
    // The rest of the piece: the 16-bit pass 4 rows at a time; the 24-bit pass leaves them to
    // the f32 pass below (the same accuracy, and fewer than 16 rows).
    for (; use_int && !wide && j + 4 <= n; j += 4) {
      for (int64_t r = 0; r < 4; ++r) prefetch_row();
      const char* k4 = kbase + static_cast<size_t>(c0 + j) * kst;
      if (!IntDotHeads4<kG>(k4, kst, q.i + g0 * 2 * c.D, 2 * c.D, q.step + g0, c.D, &s[0][j],
                            kBlockCells + kRowPad)) {
        f32_logits(j, 4);
      }
    }
  }
#endif
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr ((kG == 4 || kG == 8) && T == DType::kF16) {
    if (q.pairs != nullptr) {
      // 8 heads: two passes of 4 over the same rows (the second finds them in L1).
      const int64_t pattern_floats = c.D * kPairPatternFloatsPerDim;
      const float* pattern = q.pairs + (g0 / 4) * pattern_floats;
      for (; j + 8 <= n; j += 8) {
        const char* k8 = kbase + static_cast<size_t>(c0 + j) * kst;
        DotHeadsPairs8(k8, kst, pattern, c.D, &s[0][j], kBlockCells + kRowPad, prefetch_row);
        if constexpr (kG == 8) {
          DotHeadsPairs8(k8, kst, pattern + pattern_floats, c.D, &s[4][j], kBlockCells + kRowPad,
                         [] {});
        }
      }
    }
  }
  if constexpr (kG == 4) {
    const int64_t n4 = IsQuantized(T) || c.D % static_cast<int64_t>(kN) == 0 ? n : 0;
    for (; j + 4 <= n4; j += 4) {
      for (int64_t r = 0; r < 4; ++r) prefetch_row();
      DotHeads4<T>(df, kbase + static_cast<size_t>(c0 + j) * c.k.nb[2], c.k.nb[2], qs + g0 * c.Dp,
                   c.Dp, c.D, &s[0][j], kBlockCells + kRowPad);
    }
  }
#endif
  for (; j + 2 <= n; j += 2) {
    for (int64_t r = 0; r < 2; ++r) prefetch_row();
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
  }
  SoftmaxHeads<kG>(df, c, b, g0, c0, n, &s[0][0], kBlockCells + kRowPad, state, rs);
  if constexpr (kPermV) {
    const char* vhead = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[2];
    AccumPermuted<T, kG>(df, vhead, c.v.nb[1], c0, n, c.Dv, &s[0][0], kBlockCells + kRowPad, state,
                         rs, next_k);
  } else if constexpr (IsQuantized(T)) {
#if HWY_TARGET == HWY_AVX3_DL
    if (c.p.integer_v) {
      // The V rows were prefetched during the K pass: the scales gather from cache.
      constexpr int64_t kMaxQBlocks = kAttentionMaxHeadDim / 32;
      HWY_ALIGN float vd[kMaxQBlocks][kScaleStride];
      GatherScales<T>(df, vrow0, c.v.nb[2], n, c.Dv / 32, &vd[0][0]);
      AccumQuantInt<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad,
                           &vd[0][0], state, rs, next_k);
      return;
    }
#endif
    AccumQuant<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad, state, rs,
                      c.p.quant_v_scaling, next_k);
  } else {
    AccumPlain<T, kG>(df, vrow0, c.v.nb[2], n, c.Dv, &s[0][0], kBlockCells + kRowPad, state, rs,
                      next_k);
  }
}

// Every query head of KV head h in `n_rows` batch rows b, b + 1, .. that all see cells
// [c0, c0 + n): their heads are consecutive in qs and rows ([row][G]), so groups of heads may span
// rows. The first group of heads prefetches as kp says; the later groups find the rows in cache.
template <DType T, bool kPermV>
HWY_INLINE void DecodeCellsAllHeads(const Ctx& c, int64_t h, int64_t b, int64_t c0, int64_t n,
                                    const QRows& qs, float* rows, KPrefetch kp,
                                    int64_t n_rows = 1) {
  const int64_t heads = n_rows * c.G;
  int64_t g = 0;
  const auto next_kp = [&] {
    const KPrefetch first = kp;
    kp = KPrefetch{n, n, 0, 0};
    return first;
  };
#if HWY_TARGET <= HWY_AVX3
  for (; g + 8 <= heads; g += 8) DecodeCells<T, kPermV, 8>(c, h, b, g, c0, n, qs, rows, next_kp());
#endif
  // Below AVX-512, 8 heads at once need more than the 16 vector registers (16 K-pass and 16 V-walk
  // accumulators): two passes of 4 heads over the same cells, the second finding them in cache,
  // ran 13-18% faster per call (f16) and 5-11% (q8_0) with 8 query heads per KV head (Zen 3, AVX2,
  // head_dim 64 / 128, 4096 and 32768 cells, 1 thread, session 22).
  for (; g + 4 <= heads; g += 4) DecodeCells<T, kPermV, 4>(c, h, b, g, c0, n, qs, rows, next_kp());
  if (heads - g >= 2) {
    DecodeCells<T, kPermV, 2>(c, h, b, g, c0, n, qs, rows, next_kp());
    g += 2;
  }
  if (heads - g >= 1) DecodeCells<T, kPermV, 1>(c, h, b, g, c0, n, qs, rows, next_kp());
}

// Copies `bytes` from src to dst (not overlapping) in whole vectors, the last one overlapping its
// predecessor; rows shorter than a vector go to memcpy. Gathered rows are 34 to a few hundred
// bytes, and a libc call per row cost more than the copy: kvperf's batched decode (f16, 1 thread,
// 256 steps) spent ~13% of its decode time in memmove, ~8% in this loop now (mostly waiting for
// the scattered rows; prefetching them 4 cells ahead measured no faster).
HWY_INLINE void CopyRow(char* HWY_RESTRICT dst, const char* HWY_RESTRICT src, size_t bytes) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t N = hn::Lanes(d8);
  if (bytes < N) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const auto* s8 = reinterpret_cast<const uint8_t*>(src);
  auto* d = reinterpret_cast<uint8_t*>(dst);
  for (size_t o = 0; o + N < bytes; o += N) hn::StoreU(hn::LoadU(d8, s8 + o), d8, d + o);
  hn::StoreU(hn::LoadU(d8, s8 + bytes - N), d8, d + bytes - N);
}

// The mask of a copy's or a strided view's cells: `values` (row b's, one f32 per cell, packed)
// read as row 0 of an f32 mask whatever row asks, so DecodeCells needs no other index.
inline void UseRowMask(const float* values, TensorView* mask) {
  mask->data = const_cast<float*>(values);
  mask->dtype = DType::kF32;
  mask->nb[0] = sizeof(float);
  mask->nb[1] = 0;
}

// Cells `cells[0..n)` (ascending, all visible to row b) for every query head of KV head h, from a
// contiguous copy: head h's K and V rows and row b's mask values are copied to per-thread scratch,
// and DecodeCellsAllHeads runs on a Ctx whose views describe the copy as cells [0, n). Batched
// decode puts each sequence's new tokens in interleaved cells, so without this every row sees
// runs of one-cell spans, each paying a softmax step and a pass over the accumulators. Plain V
// only (a permuted V row is one element per dimension line).
template <DType T>
[[nodiscard]] HWY_NOINLINE bool DecodeGathered(const Ctx& c, int64_t h, int64_t b,
                                               const int32_t* cells, int64_t n, const QRows& qs,
                                               float* rows) {
  const size_t krb = RowBytes(T, c.D), vrb = RowBytes(T, c.Dv);
  const size_t kbytes = (static_cast<size_t>(n) * krb + 63) / 64 * 64;
  const size_t vbytes = (static_cast<size_t>(n) * vrb + 63) / 64 * 64;
  char* kbuf = reinterpret_cast<char*>(
      attn::ThreadScratch((kbytes + vbytes) / 4 + static_cast<size_t>(attn::Pad(n)), 2));
  if (kbuf == nullptr) return false;
  char* vbuf = kbuf + kbytes;
  float* mbuf = reinterpret_cast<float*>(vbuf + vbytes);
  const char* ksrc = static_cast<const char*>(c.k.data) + static_cast<size_t>(h) * c.k.nb[1];
  const char* vsrc = static_cast<const char*>(c.v.data) + static_cast<size_t>(h) * c.v.nb[1];
  for (int64_t i = 0; i < n; ++i) {
    CopyRow(kbuf + static_cast<size_t>(i) * krb, ksrc + static_cast<size_t>(cells[i]) * c.k.nb[2],
            krb);
    CopyRow(vbuf + static_cast<size_t>(i) * vrb, vsrc + static_cast<size_t>(cells[i]) * c.v.nb[2],
            vrb);
    mbuf[i] = attn::MaskValue(c.mask, b, cells[i]);
  }
  Ctx g = c;
  g.k.data = kbuf;
  g.k.nb[1] = 0;  // the copy holds head h only
  g.k.nb[2] = krb;
  g.v.data = vbuf;
  g.v.nb[1] = 0;
  g.v.nb[2] = vrb;
  UseRowMask(mbuf, &g.mask);
  DecodeCellsAllHeads<T, false>(g, 0, b, 0, n, qs, rows,
                                KPrefetch{n, n, 0, 0});  // the copy is in cache
  return true;
}

// Cells c_first, c_first + step, ..., n of them (all visible to row b), for every query head of KV
// head h, read in place through views whose cell stride is `step` rows: the pattern of batched
// decode, where the sequences' new tokens take turns in consecutive cells, so each row sees every
// step-th cell. Only row b's n mask values are copied. The same cells in the same order as
// DecodeGathered, so the same results, without copying the rows.
// Prefetch: the piece asks for its own K and V rows only (KPrefetch::rows_only, RowCursor), K
// rows a few ahead, V rows at the K pass's pace, as a contiguous piece does. Until session 25 the
// first row to reach a block asked for the whole range its rows span (step <= B), the other rows'
// cells between them included, so that those rows found them in cache: 4x the requests of its
// own pass, which stalled it on the fill buffers. Each row asking for its own rows measured
// (Xeon, 1 thread unless said, old and new alternating): the interleaved cells of kvperf's
// default after 256 steps 1.30-1.32x faster per call in cache and from DRAM (f16), 1.05-1.08x
// (q8_0); that whole mask from DRAM 1.06x (1 thread), 1.04-1.10x (2 threads); BM_DecodeBatched-
// Interleaved 1.10x (f16) and 1.03-1.04x (q8_0) with 4 rows, and with sequence 0 alone (step 4 > B
// 1, where nothing had been asked for) 1.03x and 1.07x.
template <DType T>
HWY_NOINLINE void DecodeStrided(const Ctx& c, int64_t h, int64_t b, int64_t c_first, int64_t step,
                                int64_t n, const QRows& qs, float* rows) {
  HWY_ALIGN float mvals[kBlockCells + kRowPad];
  for (int64_t i = 0; i < n; ++i) mvals[i] = attn::MaskValue(c.mask, b, c_first + i * step);
  Ctx g = c;
  const size_t kst = c.k.nb[2], vst = c.v.nb[2];
  g.k.data = static_cast<char*>(c.k.data) + static_cast<size_t>(c_first) * kst;
  g.k.nb[2] = kst * static_cast<size_t>(step);
  g.v.data = static_cast<char*>(c.v.data) + static_cast<size_t>(c_first) * vst;
  g.v.nb[2] = vst * static_cast<size_t>(step);
  UseRowMask(mvals, &g.mask);
  KPrefetch kp;  // nothing asked for yet
  kp.rows_only = true;
  DecodeCellsAllHeads<T, false>(g, h, b, 0, n, qs, rows, kp);
}

// One KV head's query rows, prepared for the K passes (PrepareHeadQueries): for DotHeadsPairs8
// first the query patterns, [B][G / 4][D * 16]; then the group's query rows, pre-scaled and
// zero-padded: [B][G][Dp]; for the 16-bit integer K pass also as int16, [B][G][2 * D], and as
// bytes, [B][G][qb_row]; for the 24-bit one as bytes, [B][G][qb24_row]; then the integer rows'
// steps [B][G]. Offsets in floats from the block's start, which is 64-byte aligned.
struct HeadQueryLayout {
  bool integer_k = false, integer_k24 = false, pairs = false;
  int64_t qb_row = 0, qb24_row = 0;  // bytes per head of the integer passes' rows
  int64_t pattern_floats = 0;        // per group of 4 heads
  size_t qs = 0, qi = 0, steps = 0;  // offsets of the f32 rows, the integer rows, the steps
  size_t floats = 0;                 // the whole block, a multiple of 16
};

template <DType T>
HeadQueryLayout HeadQueries(const Ctx& c) {
  HeadQueryLayout q;
#if HWY_TARGET == HWY_AVX3_DL
  q.integer_k = T == DType::kQ8_0 && c.p.integer_k;
  q.integer_k24 = T == DType::kQ8_0 && !c.p.integer_k && !c.p.float_k;
#endif
  q.pairs = UsesPairPatterns<T>(c);
  q.qb_row = kQBytesPerBlock * (c.D / 32);
  q.qb24_row = kQBytesPerBlock24 * (c.D / 32);
  // Each pattern is a multiple of 16 floats: the patterns and the rows after them stay 64-byte
  // aligned.
  q.pattern_floats = c.D * kPairPatternFloatsPerDim;
  const size_t rows = static_cast<size_t>(c.B * c.G);
  q.qs = q.pairs ? static_cast<size_t>(c.B * (c.G / 4) * q.pattern_floats) : 0;
  q.qi = q.qs + rows * static_cast<size_t>(c.Dp);
  const size_t qi_floats = q.integer_k
                               ? rows * static_cast<size_t>(c.D + q.qb_row / 4)
                               : (q.integer_k24 ? rows * static_cast<size_t>(q.qb24_row / 4) : 0);
  q.steps = q.qi + qi_floats;
  const size_t step_floats = q.integer_k || q.integer_k24 ? rows : 0;
  q.floats = (q.steps + step_floats + 15) / 16 * 16;
  return q;
}

// KV head h's query rows of every batch row, as HeadQueries(c) lays them out in `block`.
template <DType T>
void PrepareHeadQueries(const Ctx& c, int64_t h, float* block) {
  const DF df;
  const HeadQueryLayout lay = HeadQueries<T>(c);
  float* qs = block + lay.qs;
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
#if HWY_TARGET == HWY_AVX3_DL
      const int64_t r = b * c.G + g;
      float* steps = block + lay.steps;
      if (lay.integer_k) {
        int16_t* qi = reinterpret_cast<int16_t*>(block + lay.qi);
        int8_t* bytes = reinterpret_cast<int8_t*>(qi + c.B * c.G * 2 * c.D);
        steps[r] = QuantizeQueryRow(dst, c.D, qi + r * 2 * c.D, bytes + r * lay.qb_row);
      } else if (lay.integer_k24) {
        int8_t* bytes24 = reinterpret_cast<int8_t*>(block + lay.qi);
        steps[r] = QuantizeQueryRow24(dst, c.D, bytes24 + r * lay.qb24_row);
      }
#endif
    }
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    for (int64_t g4 = 0; lay.pairs && g4 < c.G / 4; ++g4) {
      PairPattern(qs + (b * c.G + 4 * g4) * c.Dp, c.Dp, c.D,
                  block + (b * (c.G / 4) + g4) * lay.pattern_floats);
    }
#endif
  }
}

// Batch row b's query rows in a block that PrepareHeadQueries filled.
inline QRows HeadQueryRows(const Ctx& c, const HeadQueryLayout& lay, const float* block,
                           int64_t b) {
  QRows r;
  r.f = block + lay.qs + b * c.G * c.Dp;
  if (lay.integer_k) {
    const int16_t* qi = reinterpret_cast<const int16_t*>(block + lay.qi);
    r.i = qi + b * c.G * 2 * c.D;
    r.bytes = reinterpret_cast<const int8_t*>(qi + c.B * c.G * 2 * c.D) + b * c.G * lay.qb_row;
  } else if (lay.integer_k24) {
    r.bytes24 = reinterpret_cast<const int8_t*>(block + lay.qi) + b * c.G * lay.qb24_row;
  }
  if (lay.integer_k || lay.integer_k24) r.step = block + lay.steps + b * c.G;
  if (lay.pairs) r.pairs = block + b * (c.G / 4) * lay.pattern_floats;
  return r;
}

template <DType T, bool kPermV>
void DecodeHeadChunk(const Ctx& c, int64_t h, int64_t chunk) {
  const DF df;
  const int64_t lo = c.chunk_bounds[chunk];
  const int64_t hi = c.chunk_bounds[chunk + 1];
  const int64_t rs = attn::PartialStride(c);
  float* part = c.partials + (h * c.n_chunks + chunk) * c.B * c.G * rs;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Every row's state starts as m = -inf, l = 0: the merge skips a chunk where the row saw
  // nothing. Its acc must be 0 only once a step runs it (the first step rescales it by 0), so a
  // row's acc is zeroed before its first step here; a row without steps in this chunk keeps what
  // the buffer held, which the merge never reads. In batched decode each row has cells in a few of
  // the chunks (the shared prompt's, its own): zeroing every row in every chunk wrote B * G * Dv
  // floats per chunk and head (~2.6 MB per 2-thread call of 64 rows over 33856 cells, into L2;
  // the time it saves measured within the noise, session 32).
  static_assert(kDecodeMaxRows <= 64, "a row's bit in `zeroed` below");
  for (int64_t r = 0; r < c.B * c.G; ++r) {
    part[r * rs + c.Dvp] = neg_inf;
    part[r * rs + c.Dvp + 1] = 0.0f;
  }
  uint64_t zeroed = 0;  // bit b: row b's acc (all G heads) is zero or holds this chunk's sums
  const auto zero_rows = [&](int64_t b, int64_t n_rows) {
    const uint64_t want = (n_rows >= 64 ? ~uint64_t{0} : (uint64_t{1} << n_rows) - 1) << b;
    for (uint64_t fresh = want & ~zeroed; fresh != 0; fresh &= fresh - 1) {
      float* rows = part + std::countr_zero(fresh) * c.G * rs;
      for (int64_t g = 0; g < c.G; ++g) {
        for (int64_t i = 0; i < c.Dvp; i += kN) hn::Store(hn::Zero(df), df, rows + g * rs + i);
      }
    }
    zeroed |= want;
  };
  // The head's query rows: prepared once per call by RunDecodeTyped when several chunks share the
  // head, else here.
  const HeadQueryLayout lay = HeadQueries<T>(c);
  const float* queries = c.head_queries != nullptr ? c.head_queries + h * lay.floats : nullptr;
  if (queries == nullptr) {
    float* block = attn::ThreadScratch(lay.floats, 1);
    if (block == nullptr) return attn::ScratchFailed(c);
    PrepareHeadQueries<T>(c, h, block);
    queries = block;
  }
  const auto q_row = [&](int64_t b) { return HeadQueryRows(c, lay, queries, b); };
  // The chunk's steps, found once per call (BuildDecodePlan in RunDecodeTyped). Replayed per head
  // they are what walking the rows' spans here found until session 25, step for step (the same
  // results bit for bit); walking them 8 times over cost ~4% of kvperf's batched decode.
  RequestedRows asked{lo, lo};
  for (int64_t i = c.step_off[chunk]; i < c.step_off[chunk + 1]; ++i) {
    const DecodeStep& st = c.steps[i];
    const int64_t b = st.row;
    float* rows = part + b * c.G * rs;
    zero_rows(b, st.kind == DecodeStepKind::kCells ? st.n_rows : 1);
    if (st.kind == DecodeStepKind::kCells) {
      const KPrefetch kp = attn::PlanKPrefetch(st.first, st.count, hi, asked);
      DecodeCellsAllHeads<T, kPermV>(c, h, b, st.first, st.count, q_row(b), rows, kp, st.n_rows);
      continue;
    }
    if constexpr (!kPermV) {  // a permuted V row cannot be read by cells: its plan has no others
      if (st.kind == DecodeStepKind::kStrided) {
        DecodeStrided<T>(c, h, b, st.first, st.step, st.count, q_row(b), rows);
      } else {
        int32_t cells[kBlockCells];
        GatheredCells(c.spans, c.span_off, st, cells);
        if (!DecodeGathered<T>(c, h, b, cells, st.count, q_row(b), rows)) {
          return attn::ScratchFailed(c);
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
  for (int64_t h = h0; h < h1; ++h) {
    if (c.scratch_failed->load(std::memory_order_relaxed)) return;  // the call fails anyway
    DecodeHeadChunk<T, kPermV>(c, h, task % c.n_chunks);
  }
}

// Combines the chunks' partials of every (b, query head) of query heads [hq0, hq1), adds the sink,
// divides, writes out.
void DecodeMerge(const Ctx& c, int64_t hq0, int64_t hq1) {
  const DF df;
  const int64_t rs = attn::PartialStride(c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t hq = hq0; hq < hq1; ++hq) {
    const int64_t h = hq / c.G;
    const int64_t g = hq % c.G;
    for (int64_t b = 0; b < c.B; ++b) {
      auto row_of = [&](int64_t chunk) {
        return c.partials + ((h * c.n_chunks + chunk) * c.B * c.G + b * c.G + g) * rs;
      };
      float m = neg_inf;
      bool poisoned = false;  // a chunk saw a NaN or +inf logit (SoftmaxHeads); max drops NaN
      for (int64_t ch = 0; ch < c.n_chunks; ++ch) {
        m = std::max(m, row_of(ch)[c.Dvp]);
        poisoned = poisoned || std::isnan(row_of(ch)[c.Dvp]);
      }
      // Every chunk's (acc, l) rescaled to the common max, summed into chunk 0's row (this merge
      // owns the partials now). A chunk that saw no visible cell (m = -inf, l = 0) is skipped: its
      // acc was never written (DecodeHeadChunk), so the first chunk that saw a cell stores
      // r * w + 0 into chunk 0's row (bit for bit what adding to zeros gave, -0 included), the
      // others add to it.
      float* acc = row_of(0);
      float l = 0.0f;
      if (!poisoned && m != neg_inf) {
        bool acc_written = false;
        for (int64_t ch = 0; ch < c.n_chunks; ++ch) {
          const float* r = row_of(ch);
          if (r[c.Dvp] == neg_inf) continue;
          const float w = std::exp(r[c.Dvp] - m);
          l += w * r[c.Dvp + 1];
          if (ch == 0) {
            if (w != 1.0f) {  // x * 1 == x for every x: skipping is exact
              for (int64_t i = 0; i < c.Dvp; i += kN)
                hn::Store(hn::Mul(hn::Load(df, acc + i), hn::Set(df, w)), df, acc + i);
            }
          } else if (!acc_written) {
            for (int64_t i = 0; i < c.Dvp; i += kN) {
              hn::Store(hn::MulAdd(hn::Load(df, r + i), hn::Set(df, w), hn::Zero(df)), df, acc + i);
            }
          } else {
            for (int64_t i = 0; i < c.Dvp; i += kN) {
              hn::Store(hn::MulAdd(hn::Load(df, r + i), hn::Set(df, w), hn::Load(df, acc + i)), df,
                        acc + i);
            }
          }
          acc_written = true;
        }
      }
      attn::FinishRow(acc, poisoned ? std::numeric_limits<float>::quiet_NaN() : m, l,
                      c.p.sinks != nullptr ? &c.p.sinks[hq] : nullptr, c.Dv,
                      static_cast<float*>(RowPtr(c.out, b, hq)));
    }
  }
}

template <DType T, bool kPermV>
void RunDecodeTyped(const Ctx& c, const ParallelForFn& pf) {
  // Consecutive rows that see the same piece of a block run it together (DecodeCellsAllHeads with
  // n_rows > 1): a system prompt shared by the batch's sequences, or the older cells of a sequence
  // with several tokens in the batch, then takes one pass over its K/V rows per group of up to 8
  // heads instead of one per row and group (a small gain: the FMAs are per head; perf/HISTORY.md,
  // session 24). DotHeadsPairs8's query patterns cover 4 heads of one row, so with them G % 4 == 0
  // is needed.
  DecodePlanInput plan;
  plan.spans = c.spans;
  plan.span_off = c.span_off;
  plan.B = c.B;
  plan.L = c.L;
  plan.n_chunks = c.n_chunks;
  plan.chunk_bounds = c.chunk_bounds;
  plan.v_permuted = kPermV;
  plan.combine_rows = c.B > 1 && !c.p.rows_alone && (!UsesPairPatterns<T>(c) || c.G % 4 == 0);
  plan.copy_strided = c.p.copy_strided_spans;
  BuildDecodePlan(plan, c.steps, c.step_off);
  // Several chunks per head (long histories, or few KV heads, on more than one thread): each head's
  // query rows are prepared once here, not once per chunk. Prepared per chunk, they took ~17% of
  // the kernel's time in q8_0 decode of 64-row groups over 33920 cells on 2 threads (8 chunks of
  // every head; the 24-bit rounding of each row), and the second thread sped that decode up 1.3x
  // where f16 gained 1.5x; prepared once, 1.4-1.6x (bench_attention's BM_DecodeManyRowsThreads,
  // perf/HISTORY.md, session 31). The rows are prepared on the threads, a head per task, when there
  // are enough of them to pay for the extra fork and join (2048 rows: ~0.5 ms on one thread).
  Ctx dc = c;
  if (c.n_chunks > 1) {
    const size_t head_floats = HeadQueries<T>(c).floats;
    dc.head_queries = attn::ThreadScratch(static_cast<size_t>(c.Hkv) * head_floats, 1);
    if (dc.head_queries == nullptr) return attn::ScratchFailed(c);
    constexpr int64_t kMinRowsToSplit = 256;
    if (c.B * c.Hq >= kMinRowsToSplit) {
      attn::RunTasks(dc, c.Hkv, pf, [](void* ctx, int64_t h) {
        const Ctx& x = *static_cast<const Ctx*>(ctx);
        PrepareHeadQueries<T>(x, h, x.head_queries + h * HeadQueries<T>(x).floats);
      });
    } else {
      for (int64_t h = 0; h < c.Hkv; ++h) {
        PrepareHeadQueries<T>(dc, h, dc.head_queries + h * head_floats);
      }
    }
  }
  attn::RunTasks(
      dc, (c.Hkv + c.task_heads - 1) / c.task_heads * c.n_chunks, pf,
      [](void* ctx, int64_t i) { DecodeTask<T, kPermV>(*static_cast<const Ctx*>(ctx), i); });
  if (c.scratch_failed->load(std::memory_order_relaxed)) return;
  // The merge reads every chunk's partial row of every (row, query head). With many rows and
  // chunks it runs on the threads, a query head per task (each output row is merged by one task,
  // in the same order: the same bits): on the calling thread alone it took ~4% of the samples of
  // 2-thread decode calls of 128 rows over 33792 cells (session 30's profile).
  constexpr int64_t kMinPartialRowsToSplit = 4096;
  if (c.n_chunks > 1 && c.B * c.Hq * c.n_chunks >= kMinPartialRowsToSplit) {
    attn::RunTasks(c, c.Hq, pf, [](void* ctx, int64_t hq) {
      DecodeMerge(*static_cast<const Ctx*>(ctx), hq, hq + 1);
    });
  } else {
    DecodeMerge(c, 0, c.Hq);
  }
}

void DecodeImpl(const Ctx& c, const ParallelForFn& pf) {
  attn::WithStorageTypes(c, [&]<DType T, bool kPermV>() { RunDecodeTyped<T, kPermV>(c, pf); });
}

// The conditions that compile the variants' code above.
DecodeVariants DecodeVariantsImpl() {
  DecodeVariants v;
#if HWY_TARGET == HWY_AVX3_DL
  v.integer_k = true;
  v.integer_v = true;
#endif
  v.scaled_weights = kHasScaledWeights;
  return v;
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {
HWY_EXPORT(DecodeImpl);
HWY_EXPORT(DecodeVariantsImpl);

void attn::RunDecode(const Ctx& c, const ParallelForFn& pf) {
  HWY_DYNAMIC_DISPATCH(DecodeImpl)(c, pf);
}

DecodeVariants DispatchedDecodeVariants() { return HWY_DYNAMIC_DISPATCH(DecodeVariantsImpl)(); }
}  // namespace kv::kernels
#endif  // HWY_ONCE
