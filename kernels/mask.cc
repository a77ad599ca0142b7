// Highway mask kernel (kernels/mask.h): cells in tiles of kTileCells, every token's row segment per
// tile, each segment one vectorized pass.
//
// Per token i the sequence word row, the bit s % 64 and the bounds [lo, hi] are fixed, so a vector
// of N cells costs two u64 loads (sequence words), one i32 load (positions), a 64-bit shift that
// moves bit s % 64 to the top of each u64 lane, a ConcatOdd that packs those top halves into N i32
// lanes (membership = sign bit), one unsigned compare (p - lo > hi - lo: outside the bounds) and
// one store of 0 / -inf (f32) or 0 / 0xFC00 (f16, demoted from i32). The result is bit-exact with
// BuildMaskRef: every output is one of two constants, decided by the same integer predicates.
// Tails shorter than a vector run the scalar predicate. Tokens whose (sequence, lo, hi) equal the
// previous token's copy that segment instead (causal rule lifted, or window/chunk rules
// coinciding).
//
// Memory traffic per token and cell: 12 bytes read (from L1: a tile's inputs are reused by every
// token) and 4 (f32) or 2 (f16) bytes written, so large masks are bound by the store bandwidth
// (perf/bench_mask.cc compares with memset of the same bytes).

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/mask.cc"
#include "kernels/mask.h"

#include <algorithm>
#include <cstring>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/highway_targets.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Scalar predicate for cells [j0, n) of one token: shared by the tails and the SCALAR target.
template <typename T>
HWY_INLINE void MaskRowScalar(const int32_t* pos, const uint64_t* words, int32_t bit, TokenBounds b,
                              int32_t j0, int32_t n, T visible, T hidden, T* out) {
  for (int32_t j = j0; j < n; ++j) {
    const bool holds = ((words[j] >> bit) & 1u) != 0;
    out[j] = (holds && pos[j] >= b.lo && pos[j] <= b.hi) ? visible : hidden;
  }
}

#if HWY_TARGET != HWY_SCALAR
// One row: N cells a step. kF16 selects the 16-bit output. Precondition: b.lo <= b.hi, so that
// lo <= p <= hi  <=>  (u32)(p - lo) <= (u32)(hi - lo) in wrapping arithmetic (one compare).
template <bool kF16>
HWY_INLINE void MaskRowVec(const int32_t* HWY_RESTRICT pos, const uint64_t* HWY_RESTRICT words,
                           int32_t bit, TokenBounds b, int32_t n, void* HWY_RESTRICT row_out) {
  const hn::ScalableTag<int32_t> di;
  const hn::RebindToUnsigned<decltype(di)> du32;
  const hn::Repartition<uint64_t, decltype(di)> du64;  // N/2 lanes
  const hn::Rebind<uint16_t, decltype(di)> du16;       // N lanes, half width
  const int32_t N = static_cast<int32_t>(hn::Lanes(di));
  const int32_t half = N / 2;
  const int shift = 63 - bit;  // moves bit s % 64 to bit 63, the sign bit of the odd u32 half
  const auto vlo = hn::Set(du32, static_cast<uint32_t>(b.lo));
  const auto span = hn::Set(du32, static_cast<uint32_t>(b.hi) - static_cast<uint32_t>(b.lo));
  const auto hidden = hn::Set(du32, kF16 ? 0xFC00u : 0xFF800000u);
  int32_t j = 0;
  for (; j + N <= n; j += N) {
    const auto w0 = hn::ShiftLeftSame(hn::LoadU(du64, words + j), shift);
    const auto w1 = hn::ShiftLeftSame(hn::LoadU(du64, words + j + half), shift);
    const auto top = hn::ConcatOdd(du32, hn::BitCast(du32, w1), hn::BitCast(du32, w0));
    // All ones where the cell holds the sequence (arithmetic shift of the sign bit).
    const auto member = hn::BitCast(du32, hn::ShiftRight<31>(hn::BitCast(di, top)));
    const auto p = hn::LoadU(du32, reinterpret_cast<const uint32_t*>(pos) + j);
    const auto outside = hn::Gt(hn::Sub(p, vlo), span);
    const auto bits = hn::IfThenElse(outside, hidden, hn::AndNot(member, hidden));
    if constexpr (kF16) {
      hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, bits)), du16,
                 static_cast<uint16_t*>(row_out) + j);
    } else {
      hn::StoreU(bits, du32, static_cast<uint32_t*>(row_out) + j);
    }
  }
  if (kF16) {
    MaskRowScalar<uint16_t>(pos, words, bit, b, j, n, 0x0000, 0xFC00,
                            static_cast<uint16_t*>(row_out));
  } else {
    MaskRowScalar<uint32_t>(pos, words, bit, b, j, n, 0u, 0xFF800000u,
                            static_cast<uint32_t*>(row_out));
  }
}
#endif

// Cells per tile: a tile's positions and sequence words (12 KB, up to 4 word rows of 8 KB) stay in
// L1 while every token's row segment is written, instead of streaming them from L2 once per token.
constexpr int32_t kTileCells = 1024;

void BuildMaskImpl(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules,
                   DType mask_dtype, void* out) {
  const bool f16 = mask_dtype == DType::kF16;
  const size_t elem = f16 ? 2 : 4;
  const size_t row_bytes = static_cast<size_t>(cells.n) * elem;
  for (int32_t j0 = 0; j0 < cells.n; j0 += kTileCells) {
    const int32_t m = std::min(kTileCells, cells.n - j0);
    const int32_t* pos = cells.pos + j0;
    char* seg = static_cast<char*>(out) + static_cast<size_t>(j0) * elem;  // token 0's segment
    int32_t prev_seq = -1;
    TokenBounds prev{0, 0};
    for (size_t i = 0; i < tokens.pos.size(); ++i, seg += row_bytes) {
      const int32_t s = tokens.seq[i];
      const TokenBounds b = ComputeTokenBounds(tokens.pos[i], tokens.causal[i] != 0, rules);
      if (s == prev_seq && b.lo == prev.lo && b.hi == prev.hi) {
        std::memcpy(seg, seg - row_bytes, static_cast<size_t>(m) * elem);  // same predicate
        continue;
      }
      prev_seq = s;
      prev = b;
      const uint64_t* words =
          cells.seq_bits + static_cast<size_t>(s / 64) * cells.seq_word_stride + j0;
      const int32_t bit = s % 64;
#if HWY_TARGET == HWY_SCALAR
      if (f16) {
        MaskRowScalar<uint16_t>(pos, words, bit, b, 0, m, 0x0000, 0xFC00,
                                reinterpret_cast<uint16_t*>(seg));
      } else {
        MaskRowScalar<uint32_t>(pos, words, bit, b, 0, m, 0u, 0xFF800000u,
                                reinterpret_cast<uint32_t*>(seg));
      }
#else
      if (b.lo > b.hi) {  // an empty range (window 0 with the inclusive convention): all hidden
        if (f16) {
          std::fill_n(reinterpret_cast<uint16_t*>(seg), m, uint16_t{0xFC00});
        } else {
          std::fill_n(reinterpret_cast<uint32_t*>(seg), m, 0xFF800000u);
        }
      } else if (f16) {
        MaskRowVec<true>(pos, words, bit, b, m, seg);
      } else {
        MaskRowVec<false>(pos, words, bit, b, m, seg);
      }
#endif
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {
HWY_EXPORT(BuildMaskImpl);

void BuildMask(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules,
               DType mask_dtype, void* out) {
  if (cells.n <= 0 || tokens.pos.empty()) return;
  HWY_DYNAMIC_DISPATCH(BuildMaskImpl)(cells, tokens, rules, mask_dtype, out);
}
}  // namespace kv::kernels
#endif  // HWY_ONCE
