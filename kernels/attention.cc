// Highway translation unit of the attention kernel's entry point and its prefill (kernels/
// attention.h has the contract, the shapes and the memory-traffic derivation of each mode).
//
// Attention() finds each batch row's visible spans (decode) or visible box (prefill) from the mask
// once, picks the task partition and hands over to decode (kernels/attention_decode.cc) or
// prefill (below).
// Prefill: task = (KV head, tile of batch rows). K tiles of 64 cells are converted (and
// transposed) into f32 once, V tiles likewise, and every query row of the tile (rows x heads of
// the group) runs register-blocked FMA kernels over them with no horizontal sums: 4 rows x 4
// vectors on AVX-512, 6 rows x 2 vectors on the 16-register targets.
// A task walks the cells between its rows' first and last visible cell and skips the tiles none
// of its rows sees (other sequences' cells), found from a bitmap of visible 16-cell granules per
// row that Attention() records while it scans the mask; a second bitmap marks the granules whose
// cells are all visible with a mask value of +-0, where a tile's scores need no mask at all. The
// online softmax runs four query rows at a time, their maxes and sums reduced together.
#include "kernels/attention.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#endif

#include "kernels/attention_internal.h"
#include "kernels/highway_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention.cc"
// clang-format off
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "kernels/attention_load-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {
using attn::Ctx;
using attn::kBlockCells;
using attn::kMaxPass;
using attn::kRowPad;

// ---- prefill
// -------------------------------------------------------------------------------------

// Cells per tile: 4 vectors on AVX-512. The narrower targets take 128 cells (16 AVX2 vectors):
// each row pays a fixed softmax bookkeeping per tile (the max's and the sum's reductions, the
// rescale of its accumulators, a scalar exp), which 4 of their vectors (32 cells) spread over too
// few FMAs. Zen 3, f16, 512 x 4096, 1 thread, session 22: 64 cells 3% faster than 32 at head_dim
// 128; 128 cells faster again than 64 in 11 of 14 alternating runs at head_dim 64 (best 259 against
// 276 ms) and 12 of 14 at 128 (458 against 474 ms). A task's scratch (query and state rows, K and
// V tiles, scores) is then ~204 KiB at head_dim 64 and ~336 KiB at 128 for its 128 query rows:
// inside the Zen 3's 512 KiB L2.
#if HWY_TARGET <= HWY_AVX3
constexpr int64_t kTC = 64;
#else
constexpr int64_t kTC = 128;
#endif

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

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The 16 x 16 register transpose of TransposeRowsBy16 (below).
HWY_INLINE void TransposeRegisters16x16(const float* src, int64_t src_stride, float* dst,
                                        int64_t dst_stride) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(src + i * src_stride);
  // t[2i], t[2i + 1]: rows 2i, 2i + 1 interleaved (columns 4k, 4k + 1 / 4k + 2, 4k + 3 of block k).
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4g + c], block k: rows 4g .. 4g + 3 of column 4k + c.
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c2 = _mm512_castps_pd(t[4 * g + 2]), d2 = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d2));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d2));
  }
  // Column 4k + c: block k of r[c], r[4 + c], r[8 + c], r[12 + c] (a 4 x 4 transpose of blocks).
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_store_ps(dst + (0 + c) * dst_stride, _mm512_shuffle_f32x4(v0, v2, 0x88));
    _mm512_store_ps(dst + (4 + c) * dst_stride, _mm512_shuffle_f32x4(v0, v2, 0xDD));
    _mm512_store_ps(dst + (8 + c) * dst_stride, _mm512_shuffle_f32x4(v1, v3, 0x88));
    _mm512_store_ps(dst + (12 + c) * dst_stride, _mm512_shuffle_f32x4(v1, v3, 0xDD));
  }
}
#endif

#if HWY_TARGET == HWY_AVX2
// dst[c * dst_stride + r] = src[r * src_stride + c] for r, c < 8: an 8 x 8 float transpose in
// registers (24 shuffles: 32-bit interleaves and 64-bit selects inside 128-bit lanes, then a
// round of 128-bit lane swaps).
HWY_INLINE void TransposeRegisters8x8(const float* src, int64_t src_stride, float* dst,
                                      int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  // t[2i], t[2i + 1]: rows 2i, 2i + 1 interleaved (columns 0, 1 / 2, 3 of each 128-bit lane).
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4g + c]: rows 4g .. 4g + 3 of column c (low lane) and column c + 4 (high lane).
  for (int g = 0; g < 2; ++g) {
    r[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
  }
}
#endif

// dst[d * dst_stride + r] = src[r * src_stride + d] for r < kRows, d < 16. On AVX-512 with
// kRows == 16: a 16 x 16 float transpose in registers (64 shuffles: 32- and 64-bit interleaves
// inside 128-bit blocks, then two rounds of 128-bit block shuffles; src and dst 64-byte aligned)
// instead of 256 scalar stores strided by a tile row, which took ~6% of a prefill call (perf, f16,
// head_dim 128, 1 thread). AVX2 transposes 8 x 8 blocks in registers likewise (the scalar stores
// took ~4% of a prefill call there: perf, Zen 3, session 22). Other targets use scalar stores.
template <int64_t kRows>
HWY_INLINE void TransposeRowsBy16(const float* src, int64_t src_stride, float* dst,
                                  int64_t dst_stride) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kRows == 16) {
    TransposeRegisters16x16(src, src_stride, dst, dst_stride);
    return;
  }
#elif HWY_TARGET == HWY_AVX2
  if constexpr (kRows % 8 == 0) {
    for (int64_t r0 = 0; r0 < kRows; r0 += 8) {
      for (int64_t d0 = 0; d0 < 16; d0 += 8) {
        TransposeRegisters8x8(src + r0 * src_stride + d0, src_stride, dst + d0 * dst_stride + r0,
                              dst_stride);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t d = 0; d < 16; ++d) dst[d * dst_stride + r] = src[r * src_stride + d];
}

// K tile (cells [t0, t0 + n) of one KV head) as f32, transposed: kt[d][j] for d < Dp, j < kTC
// (cells from n on and dimensions from D on are zero). Converted kRows cells at a time into
// `rows` ([kRows][Dp] scratch), then transposed in blocks of 16 dimensions.
template <DType T, int64_t kRows>
HWY_INLINE void TransposedKTile(DF df, const Ctx& c, const char* kbase, int64_t t0, int64_t n,
                                float* rows, float* kt, int64_t kTileCells) {
  static_assert(kRowPad % 16 == 0, "Dp is a multiple of 16");
  for (int64_t j0 = 0; j0 < kTileCells; j0 += kRows) {
    for (int64_t j = j0; j < j0 + kRows; ++j) {
      float* dst = rows + (j - j0) * c.Dp;
      if (j < n) {
        RowToF32Padded<T>(df, kbase + static_cast<size_t>(t0 + j) * c.k.nb[2], c.D, c.Dp, dst);
      } else {
        for (int64_t d = 0; d < c.Dp; d += kN) hn::Store(hn::Zero(df), df, dst + d);
      }
    }
    for (int64_t d0 = 0; d0 < c.Dp; d0 += 16) {
      TransposeRowsBy16<kRows>(rows + d0, c.Dp, kt + d0 * kTileCells + j0, kTileCells);
    }
  }
}

// Register blocking of the tile kernels: kR rows x kV vectors of accumulators, plus kV operand
// vectors and one broadcast, must fit the register file or the compiler spills accumulators in
// the innermost loop. AVX-512 has 32 registers: 4 x 4 (21 live). The 16-register targets take
// 6 x 2 (15 live): 4 x 4 there spilled.
#if HWY_TARGET <= HWY_AVX3
constexpr int kTileRows = 4;
constexpr int kTileVecs = 4;
#else
constexpr int kTileRows = 6;
constexpr int kTileVecs = 2;
#endif
static_assert(kTC % (kTileVecs * kN) == 0, "a K tile is whole column blocks wide");

// S[r][c0..c0 + kV*kN) = sum_d Q[r][d] * KT[d][c0..] for kR rows: kR x kV accumulators, no
// reductions.
template <int kR, int kV>
HWY_INLINE void TileScores(DF df, const float* qrows, int64_t Dp, int64_t D, const float* kt,
                           int64_t c0, float* s) {
  VF a[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) a[r][v] = hn::Zero(df);
  for (int64_t d = 0; d < D; ++d) {
    const float* ktd = kt + d * kTC + c0;
    VF k[kV];
    for (int v = 0; v < kV; ++v) k[v] = hn::Load(df, ktd + v * kN);
    for (int r = 0; r < kR; ++r) {
      const VF qv = hn::Set(df, qrows[r * Dp + d]);
      for (int v = 0; v < kV; ++v) a[r][v] = hn::MulAdd(qv, k[v], a[r][v]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) hn::Store(a[r][v], df, s + r * kTC + c0 + v * kN);
}

// S[r][0..kTC) for kR rows, kTileVecs vectors of cells at a time.
template <int kR>
HWY_INLINE void TileScoresRows(DF df, const float* qrows, int64_t Dp, int64_t D, const float* kt,
                               float* s) {
  for (int64_t c0 = 0; c0 < kTC; c0 += kTileVecs * static_cast<int64_t>(kN)) {
    TileScores<kR, kTileVecs>(df, qrows, Dp, D, kt, c0, s);
  }
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
  for (; i + kTileVecs * static_cast<int64_t>(kN) <= Dvp; i += kTileVecs * kN) {
    TileAccum<kR, kTileVecs>(df, p, vt, Dvp, i, acc, acc_stride);
  }
  for (; i < Dvp; i += kN) TileAccum<kR, 1>(df, p, vt, Dvp, i, acc, acc_stride);
}

// True when any of the first n cells' values of the V tile vt ([kTC][Dvp]) is inf or NaN.
// One FMA per vector: x * 0 is +-0 for finite x and NaN for inf or NaN, so the sum stays zero
// unless a value is not finite.
HWY_INLINE bool TileHasNonFinite(DF df, const float* vt, int64_t n, int64_t Dvp) {
  const VF zero = hn::Zero(df);
  VF sum = zero;
  for (int64_t i = 0; i < n * Dvp; i += kN) sum = hn::MulAdd(hn::Load(df, vt + i), zero, sum);
  return !hn::AllTrue(df, hn::Eq(sum, zero));
}

// TileAccumRows for a V tile that holds inf or NaN: cells a row does not see (weight exactly 0;
// a visible cell's weight is at least e^-87, SoftmaxExp's floor) are skipped, because 0 * inf is
// NaN and a hidden cell must contribute nothing. Visible ones are added as in TileAccum. Only
// for such tiles: without register blocking it runs several times slower.
HWY_NOINLINE void TileAccumSkippingHidden(DF df, const float* p, const float* vt, int64_t Dvp,
                                          int64_t R, float* st, int64_t rs) {
  for (int64_t r = 0; r < R; ++r) {
    float* acc = st + r * rs;
    for (int64_t j = 0; j < kTC; ++j) {
      const float w = p[r * kTC + j];
      if (w == 0.0f) continue;
      const VF vw = hn::Set(df, w);
      for (int64_t i = 0; i < Dvp; i += kN) {
        hn::Store(hn::MulAdd(vw, hn::Load(df, vt + j * Dvp + i), hn::Load(df, acc + i)), df,
                  acc + i);
      }
    }
  }
}

// Calls f.template operator()<kR>(r) for blocks of kR rows covering rows [0, R): kTileRows at a
// time, then (below AVX-512, whose 6-row blocks leave up to 5) two, then one.
template <class F>
HWY_INLINE void ForEachRowBlock(int64_t R, const F& f) {
  int64_t r = 0;
  for (; r + kTileRows <= R; r += kTileRows) f.template operator()<kTileRows>(r);
  if constexpr (kTileRows > 4) {
    for (; r + 2 <= R; r += 2) f.template operator()<2>(r);
  }
  for (; r < R; ++r) f.template operator()<1>(r);
}

// Calls f.template operator()<4>(r) for blocks of four rows covering rows [0, R), then once for the
// 1-3 rows left (kR their count): TileSoftmaxRows' blocks, which reduce four rows at a time.
template <class F>
HWY_INLINE void ForEachRowQuad(int64_t R, const F& f) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) f.template operator()<4>(r);
  if (R - r == 3) f.template operator()<3>(r);
  if (R - r == 2) f.template operator()<2>(r);
  if (R - r == 1) f.template operator()<1>(r);
}

// Row b's scores s[0..kTC) of the tile at cell t0 (n cells of history) made ready for the
// softmax, in place: softcapped, the mask value added, and -inf outside the row's visible box or
// past the history. Returns the largest score in `vmax` (lane-wise, with what it held) and sets
// the lanes of `bad` that saw a NaN or +inf (x86's max drops a NaN operand, so the max cannot
// tell). A tile inside the box with no mask is only scanned: no store.
HWY_INLINE void MaskRowScores(DF df, const Ctx& c, int64_t b, int64_t t0, int64_t n, float* s,
                              VF& vmax, VF& bad) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const VF vinf = hn::Set(df, -neg_inf);
  const auto scan = [&](VF x) {
    vmax = hn::Max(vmax, x);
    bad = hn::Or(bad, hn::VecFromMask(df, hn::Not(hn::Lt(x, vinf))));
  };
  if (c.p.softcap != 0) {
    const VF cap = hn::Set(df, c.p.softcap);
    const VF inv = hn::Set(df, 1.0f / c.p.softcap);
    for (int64_t j = 0; j < kTC; j += kN) {
      hn::Store(hn::Mul(cap, hn::Tanh(df, hn::Mul(hn::Load(df, s + j), inv))), df, s + j);
    }
  }
  const int64_t lo = std::max<int64_t>(c.row_lo[b] - t0, 0);
  const int64_t hi = std::min<int64_t>(c.row_hi[b] - t0, n);
  const bool whole_box = lo == 0 && hi == kTC;
  // Inside plain granules (visible, mask values +-0) the mask adds nothing: not read.
  const bool plain = c.plain_granules != nullptr && n == kTC &&
                     attn::AllBits(c.plain_granules + b * c.granule_words, t0 / attn::kGranuleCells,
                                   (t0 + kTC - 1) / attn::kGranuleCells);
  if ((c.mask.data == nullptr || plain) && whole_box) {
    for (int64_t j = 0; j < kTC; j += kN) scan(hn::Load(df, s + j));
    return;
  }
  const char* mrow = c.mask.data == nullptr ? nullptr
                                            : static_cast<const char*>(c.mask.data) +
                                                  static_cast<size_t>(b) * c.mask.nb[1] +
                                                  static_cast<size_t>(t0) * c.mask.nb[0];
  const VF vlo = hn::Set(df, static_cast<float>(lo)), vhi = hn::Set(df, static_cast<float>(hi));
  const VF ninf = hn::Set(df, neg_inf);
  for (int64_t j = 0; j < kTC; j += kN) {
    VF x = hn::Load(df, s + j);
    if (mrow != nullptr) {
      VF mv;
      if (j + static_cast<int64_t>(kN) <= n) {
        mv = LoadMaskValues(df, c.mask.dtype, mrow, j);
      } else {
        HWY_ALIGN float tmp[kN] = {};
        for (int64_t t = j; t < n; ++t) tmp[t - j] = attn::MaskValue(c.mask, b, t0 + t);
        mv = hn::Load(df, tmp);
      }
      // -inf hides the cell whatever its logit (a NaN from a hidden cell's K must not poison the
      // row: the reference never looks at hidden cells).
      x = hn::IfThenElse(hn::Eq(mv, ninf), ninf, hn::Add(x, mv));
    }
    if (!whole_box) {
      const VF idx = hn::Iota(df, static_cast<float>(j));
      x = hn::IfThenElse(hn::And(hn::Ge(idx, vlo), hn::Lt(idx, vhi)), x, ninf);
    }
    scan(x);
    hn::Store(x, df, s + j);
  }
}

// The online-softmax step of query rows [r0, r0 + kR) (kR <= 4) over one tile: scores sc[r][..]
// become weights (0 where hidden), each row's state (acc, m, l in st, rs floats apart) is rescaled
// to its new max and its weights' sum added. The rows' maxes and sums are reduced four at a time
// (ReduceEach): one row at a time, the reductions and their scalar tails took ~10% of a prefill
// call at head_dim 64 (perf, f16, 1 thread, session 26).
template <int kR>
HWY_INLINE void TileSoftmaxRows(DF df, const Ctx& c, int64_t b0, int64_t r0, int64_t t0, int64_t n,
                                float* sc, float* st, int64_t rs) {
  static_assert(kR >= 1 && kR <= 4);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const VF vninf = hn::Set(df, neg_inf);
  VF vmax[4], vsum[4];
  bool poisoned[kR];
  for (int i = 0; i < 4; ++i) {
    vmax[i] = vninf;
    vsum[i] = hn::Zero(df);
  }
  for (int i = 0; i < kR; ++i) {
    VF bad = hn::Zero(df);
    MaskRowScores(df, c, b0 + (r0 + i) / c.G, t0, n, sc + (r0 + i) * kTC, vmax[i], bad);
    poisoned[i] = !hn::AllFalse(df, hn::MaskFromVec(bad));
  }
  float maxes[4];
  ReduceEach<4>(df, vmax, MaxOp(), maxes);
  bool seen[kR];  // the row sees a cell of the tile (or a poisoning one)
  for (int i = 0; i < kR; ++i) {
    float* s = sc + (r0 + i) * kTC;
    float* row = st + (r0 + i) * rs;
    seen[i] = maxes[i] != neg_inf || poisoned[i];
    if (!seen[i]) {  // nothing visible to this row here
      for (int64_t j = 0; j < kTC; j += kN) hn::Store(hn::Zero(df), df, s + j);
      continue;
    }
    // A NaN or +inf logit poisons the row (as in decode's SoftmaxHeads): m, acc, l become NaN.
    const float m_old = row[c.Dvp];
    const float m_new =
        poisoned[i] ? std::numeric_limits<float>::quiet_NaN() : std::max(m_old, maxes[i]);
    const VF vm = hn::Set(df, m_new);
    for (int64_t j = 0; j < kTC; j += kN) {
      const VF x = hn::Load(df, s + j);
      const VF e = hn::IfThenZeroElse(hn::Eq(x, vninf), SoftmaxExp(df, hn::Sub(x, vm)));
      vsum[i] = hn::Add(vsum[i], e);
      hn::Store(e, df, s + j);
    }
    if (m_new != m_old) {
      const float alpha = std::exp(m_old - m_new);
      const VF va = hn::Set(df, alpha);
      for (int64_t d = 0; d < c.Dvp; d += kN)
        hn::Store(hn::Mul(hn::Load(df, row + d), va), df, row + d);
      row[c.Dvp + 1] *= alpha;
    }
    row[c.Dvp] = m_new;
  }
  float sums[4];
  ReduceEach<4>(df, vsum, AddOp(), sums);
  for (int i = 0; i < kR; ++i) {
    if (seen[i]) st[(r0 + i) * rs + c.Dvp + 1] += sums[i];
  }
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
  // Scratch: q rows [R][Dp], state rows [R][rs], KT [Dp][kTC], V tile [kTC][Dvp], S [R][kTC],
  // K rows on their way into KT [kKRows][Dp], the granules visible to any of the rows
  // [granule_words] uint64. Every part is a multiple of 16 floats: each starts 64-byte aligned
  // (TransposeRowsBy16's register path needs it).
  constexpr int64_t kKRows = kTC < 16 ? kTC : 16;
  const size_t need = static_cast<size_t>(R * c.Dp + R * rs + c.Dp * kTC + kTC * c.Dvp + R * kTC +
                                          kKRows * c.Dp + attn::Pad(2 * c.granule_words));
  float* qs = attn::ThreadScratch(need, 1);
  if (qs == nullptr) return attn::ScratchFailed(c);
  float* st = qs + R * c.Dp;
  float* kt = st + R * rs;
  float* vt = kt + c.Dp * kTC;
  float* sc = vt + kTC * c.Dvp;
  float* krows = sc + R * kTC;
  uint64_t* live = reinterpret_cast<uint64_t*>(krows + kKRows * c.Dp);
  if (c.visible_granules != nullptr) {
    for (int64_t w = 0; w < c.granule_words; ++w) live[w] = 0;
    for (int64_t b = b0; b < b0 + nb; ++b) {
      const uint64_t* bits = c.visible_granules + b * c.granule_words;
      for (int64_t w = 0; w < c.granule_words; ++w) live[w] |= bits[w];
    }
  }
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
    // A tile no row sees would leave every row's state as it is: not even converted.
    if (c.visible_granules != nullptr &&
        !attn::AnyBit(live, t0 / attn::kGranuleCells, (t0 + n - 1) / attn::kGranuleCells)) {
      continue;
    }
    TransposedKTile<T, kKRows>(df, c, kbase, t0, n, krows, kt, kTC);
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
    // Scores for every row, kTileRows rows at a time.
    ForEachRowBlock(R, [&]<int kR>(int64_t r) {
      TileScoresRows<kR>(df, qs + r * c.Dp, c.Dp, c.D, kt, sc + r * kTC);
    });
    // Softcap, mask, online softmax, four rows at a time; p overwrites s (0 where hidden).
    ForEachRowQuad(
        R, [&]<int kR>(int64_t r) { TileSoftmaxRows<kR>(df, c, b0, r, t0, n, sc, st, rs); });
    if (HWY_UNLIKELY(TileHasNonFinite(df, vt, n, c.Dvp))) {
      TileAccumSkippingHidden(df, sc, vt, c.Dvp, R, st, rs);
      continue;
    }
    ForEachRowBlock(R, [&]<int kR>(int64_t r) {
      TileAccumRows<kR>(df, sc + r * kTC, vt, c.Dvp, st + r * rs, rs);
    });
  }
  // Finish: sink, divide, write.
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = b0 + r / c.G;
    const int64_t hq = h * c.G + r % c.G;
    const float* row = st + r * rs;
    float* o = static_cast<float*>(RowPtr(c.out, b, hq));
    attn::FinishRow(row, row[c.Dvp], row[c.Dvp + 1],
                    c.p.sinks != nullptr ? &c.p.sinks[hq] : nullptr, c.Dv, o);
  }
}

template <DType T, bool kPermV>
void RunPrefillTyped(const Ctx& c, const ParallelForFn& pf) {
  attn::RunTasks(c, c.Hkv * c.n_qtiles, pf, [](void* ctx, int64_t i) {
    PrefillTask<T, kPermV>(*static_cast<const Ctx*>(ctx), i);
  });
}

void PrefillImpl(const Ctx& c, const ParallelForFn& pf) {
  attn::WithStorageTypes(c, [&]<DType T, bool kPermV>() { RunPrefillTyped<T, kPermV>(c, pf); });
}

// ---- the mask, scanned once per call
// ---------------------------------------------------------------------------------------------

// The 8 bytes StoreMaskBits wrote (lane i in bit i % 8 of byte i / 8) as one word with lane i in
// bit i. A copy on a little-endian machine; on a big-endian one (s390x) a copy puts byte 0 in the
// word's top bits, and attention read the mask of other cells, so there it is assembled byte by
// byte. (Assembled everywhere, GCC split x86's mask registers into bytes and joined them again.)
HWY_INLINE uint64_t LittleEndianWord(const uint8_t b[8]) {
  uint64_t word;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&word, b, 8);
  } else {
    word = 0;
    for (int i = 0; i < 8; ++i) word |= static_cast<uint64_t>(b[i]) << (8 * i);
  }
  return word;
}

// One mask row of L f32 or f16 elements (packed) as two bitmaps, bit j of words[j / 64]:
// `hidden` where the element is -inf (compared as bits with its one encoding, the only one that
// converts to -inf), `nonzero` where its bits less the sign are not zero (a value other than +-0).
// Both hold ceil(L / 64) words, bits from L on clear. Attention() finds the spans, the visible and
// the plain granules from them: compared element by element, with a scalar loop, this scan took
// ~1% of a masked prefill call on 1 thread and ran while the other threads waited.
template <class D, typename TU = hn::TFromD<D>>
HWY_INLINE void RowBits(D d, const TU* row, int64_t L, TU neg_inf, TU magnitude, uint64_t* hidden,
                        uint64_t* nonzero) {
  const size_t N = hn::Lanes(d);  // divides 64: a vector's bits never straddle a word
  const auto vneg_inf = hn::Set(d, neg_inf);
  const auto vmagnitude = hn::Set(d, magnitude);
  int64_t j = 0;
  for (; j + static_cast<int64_t>(N) <= L; j += static_cast<int64_t>(N)) {
    const auto v = hn::LoadU(d, row + j);
    uint8_t hb[8] = {}, zb[8] = {};
    hn::StoreMaskBits(d, hn::Eq(v, vneg_inf), hb);
    hn::StoreMaskBits(d, hn::Ne(hn::And(v, vmagnitude), hn::Zero(d)), zb);
    hidden[j / 64] |= LittleEndianWord(hb) << (j % 64);
    nonzero[j / 64] |= LittleEndianWord(zb) << (j % 64);
  }
  for (; j < L; ++j) {
    TU bits;
    std::memcpy(&bits, row + j, sizeof(bits));
    hidden[j / 64] |= static_cast<uint64_t>(bits == neg_inf) << (j % 64);
    nonzero[j / 64] |= static_cast<uint64_t>((bits & magnitude) != 0) << (j % 64);
  }
}

// RowBits for row b of an f32 or f16 mask (nb[0] == element size); the words are cleared first.
void MaskRowBitsImpl(const TensorView& mask, int64_t b, uint64_t* hidden, uint64_t* nonzero) {
  const int64_t L = mask.ne[0];
  const int64_t words = attn::MaskRowBitWords(L);
  for (int64_t w = 0; w < words; ++w) hidden[w] = nonzero[w] = 0;
  const char* row = static_cast<const char*>(mask.data) + static_cast<size_t>(b) * mask.nb[1];
  if (mask.dtype == DType::kF32) {
    const hn::ScalableTag<uint32_t> du;
    RowBits(du, reinterpret_cast<const uint32_t*>(row), L, uint32_t{0xFF800000u},
            uint32_t{0x7FFFFFFFu}, hidden, nonzero);
  } else {
    const hn::ScalableTag<uint16_t> du;
    RowBits(du, reinterpret_cast<const uint16_t*>(row), L, uint16_t{0xFC00u}, uint16_t{0x7FFFu},
            hidden, nonzero);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kv::kernels {

HWY_EXPORT(PrefillImpl);
HWY_EXPORT(MaskRowBitsImpl);

void attn::MaskRowBits(const TensorView& mask, int64_t b, uint64_t* hidden, uint64_t* nonzero) {
  HWY_DYNAMIC_DISPATCH(MaskRowBitsImpl)(mask, b, hidden, nonzero);
}

namespace {
// cpuid leaf 0's vendor string ("AuthenticAMD", "GenuineIntel") in ebx, edx, ecx order, or 12
// zero bytes where there is no cpuid.
std::array<uint32_t, 3> CpuVendor() {
  std::array<uint32_t, 3> vendor{};
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0) vendor = {ebx, edx, ecx};
#endif
  return vendor;
}

bool IsIntel() {
  return CpuVendor() == std::array<uint32_t, 3>{0x756e6547u, 0x49656e69u, 0x6c65746eu};
}

// AMD family 19h: Zen 3 and Zen 4 (Zen 5 is 1Ah).
bool IsAmdFamily19h() {
  if (CpuVendor() != std::array<uint32_t, 3>{0x68747541u, 0x69746e65u, 0x444d4163u}) return false;
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const unsigned base = (eax >> 8) & 0xFu;
  const unsigned family = base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
  return family == 0x19u;
#else
  return false;
#endif
}

// The fewest mask rows a scanning task takes: a masked 512 x 4096 prefill call reads 8 MiB of mask
// before its tasks start, a decode call of 64 rows over 33792 cells 8.6 MiB (~6% of a 2-thread
// call of 128 rows when it ran on the calling thread alone, session 30's profile); split over the
// threads, 16 rows or more per task.
constexpr int64_t kMinScanRows = 16;

// Where one mask row's scan writes (ScanRow). Null outputs are not written.
struct RowScanOut {
  int32_t* spans = nullptr;      // [s0, s1) pairs of visible cells, ascending (decode)
  uint64_t* granules = nullptr;  // the granules with a visible cell (prefill), zeroed by the caller
  uint64_t* plain = nullptr;  // the granules all visible with mask values of +-0 (prefill), zeroed
};

// Row b of the mask (f32 or f16, the contract, checked by Attend) as its two bitmaps (MaskBits'
// layout, MaskBitsRowWords(L) words: the hidden cells, then the nonzero values), then one walk over
// the visible runs writing what `out` asks for. The bitmaps are `given` (the row's, from
// AttentionKernelParams::mask_bits), or else MaskRowBits writes them into row_bits (as many words
// of scratch). lo / hi: the row's box (L and 0 when nothing is visible). Returns the number of
// spans (visible runs).
int64_t ScanRow(const TensorView& mask, int64_t b, int64_t L, const uint64_t* given,
                uint64_t* row_bits, const RowScanOut& out, int32_t& lo, int32_t& hi) {
  const int64_t words = attn::MaskRowBitWords(L);
  if (given == nullptr) {
    attn::MaskRowBits(mask, b, row_bits, row_bits + words);
    given = row_bits;
  }
  const uint64_t* hidden = given;
  const uint64_t* nonzero = given + words;
  // Whether every mask value of granule g is +-0 (the caches' visible cells). A granule's bits
  // lie in one word.
  static_assert(64 % attn::kGranuleCells == 0);
  const auto plain_granule = [&](int64_t g) {
    const int64_t j0 = g * attn::kGranuleCells;
    const uint64_t granule_mask = (uint64_t{1} << attn::kGranuleCells) - 1;
    return ((nonzero[j0 / 64] >> (j0 % 64)) & granule_mask) == 0;
  };
  int64_t n = 0;
  lo = static_cast<int32_t>(L);
  hi = 0;
  attn::ForEachClearRun(hidden, L, [&](int64_t s0, int64_t s1) {
    if (out.spans != nullptr) {
      out.spans[2 * n] = static_cast<int32_t>(s0);
      out.spans[2 * n + 1] = static_cast<int32_t>(s1);
    }
    ++n;
    if (out.granules != nullptr) {
      attn::SetBits(out.granules, s0 / attn::kGranuleCells, (s1 - 1) / attn::kGranuleCells);
    }
    if (out.plain != nullptr) {
      for (int64_t g = (s0 + attn::kGranuleCells - 1) / attn::kGranuleCells;
           (g + 1) * attn::kGranuleCells <= s1; ++g) {
        if (plain_granule(g)) attn::SetBits(out.plain, g, g);
      }
    }
    lo = std::min<int32_t>(lo, static_cast<int32_t>(s0));
    hi = static_cast<int32_t>(s1);
  });
  return n;
}

// A call's scan of its mask rows, split over tasks: each row's box [row_lo, row_hi) and, for
// prefill (granule_words > 0), its two granule bitmaps (kGranuleCells cells per bit, granule_words
// words per row, zeroed by the caller): the granules with a visible cell (rows [0, B) of
// `granules`), and the granules whose cells are all visible with a mask value of +-0 (rows [B, 2B):
// a tile inside them is only scanned, the mask not read). Task t scans rows [t * rows_per_task, ..)
// from mask_bits when the call has them, else with its own MaskBitsRowWords(L) words of row_bits,
// reading the mask. With `spans` (decode, or kAuto's choice)
// it records each row's visible spans: row b's at spans + 2 * b * span_row_cap and their count in
// span_count[b]; PackSpans then packs them in row order (decode's layout).
struct MaskScan {
  const TensorView* mask;
  int64_t L, rows_per_task, B;
  uint64_t* granules;
  int64_t granule_words;
  const uint64_t* mask_bits;  // AttentionKernelParams::mask_bits, or null
  uint64_t* row_bits;         // null with mask_bits
  int32_t* row_lo;
  int32_t* row_hi;
  int32_t* spans = nullptr;
  int64_t span_row_cap = 0;  // pairs: a row has at most L / 2 + 1 spans
  int64_t* span_count = nullptr;
};

void ScanMaskTask(void* ctx, int64_t task) {
  const MaskScan& s = *static_cast<const MaskScan*>(ctx);
  const int64_t row_words = MaskBitsRowWords(s.L);
  uint64_t* row_bits = s.mask_bits != nullptr ? nullptr : s.row_bits + task * row_words;
  const int64_t b1 = std::min(s.B, (task + 1) * s.rows_per_task);
  for (int64_t b = task * s.rows_per_task; b < b1; ++b) {
    RowScanOut out;
    if (s.granule_words > 0) {  // not for a decode call
      out.granules = s.granules + b * s.granule_words;
      out.plain = s.granules + (s.B + b) * s.granule_words;
    }
    if (s.spans != nullptr) out.spans = s.spans + 2 * b * s.span_row_cap;
    const uint64_t* given = s.mask_bits != nullptr ? s.mask_bits + b * row_words : nullptr;
    const int64_t n = ScanRow(*s.mask, b, s.L, given, row_bits, out, s.row_lo[b], s.row_hi[b]);
    if (s.spans != nullptr) s.span_count[b] = n;
  }
}

// Moves the rows' spans, recorded span_row_cap pairs apart with their counts in counts[b], down to
// decode's packed layout: row b's at spans[2 * span_off[b] ..), span_off[0] = 0. counts may alias
// span_off + 1 (each count is read before its slot is written).
void PackSpans(int32_t* spans, int64_t span_row_cap, const int64_t* counts, int64_t B,
               int64_t* span_off) {
  int64_t at = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = counts[b];
    if (at != b * span_row_cap) {  // at <= b * span_row_cap: a move down, in row order
      std::memmove(spans + 2 * at, spans + 2 * b * span_row_cap, static_cast<size_t>(n) * 8);
    }
    span_off[b] = at;
    at += n;
  }
  span_off[B] = at;
}

// Prefill is chosen while it computes at most this many times decode's (row, cell) pairs.
// Measured on the Emerald Rapids Xeon (session 29, f16, calls alternating): rows of one sequence
// (ratio ~1) ran 1.1-1.3x faster as prefill at head_dim 64 from 8 rows on, 0.95-1.12x at 128; a
// fresh causal prompt (ratio ~2) 1.2-3.3x faster as decode at 8-32 rows, 1.15x slower at 64; rows
// of different sequences (ratio 4-8) 3-8x faster as decode.
constexpr double kPrefillPairsOverDecode = 1.5;

// Decode or prefill for a call of 8 to kDecodeMaxRows rows (AttentionMode::kAuto), from its scan:
// the (row, cell) pairs each would compute. Decode computes each row's visible cells; prefill
// computes every row of a task (q_tile consecutive rows) over every 64-cell tile that any of them
// sees (kTC on AVX-512; 128 on the narrower targets, where this undercounts a little). Rows of one
// sequence (a chunk of a prompt, speculative decoding's draft tokens) see nearly the same cells and
// prefill's register-blocked tiles are faster there; rows of different sequences (batched decode)
// see mostly their own cells, which prefill would compute for every row of the task. spans /
// span_off: the rows' spans, packed (decode's layout); granules: the rows' visible granules.
bool PreferDecode(const int32_t* spans, const int64_t* span_off, const uint64_t* granules,
                  int64_t granule_words, int64_t B, int64_t q_tile) {
  double decode_pairs = 0;
  for (int64_t i = 0; i < span_off[B]; ++i) decode_pairs += spans[2 * i + 1] - spans[2 * i];
  double prefill_pairs = 0;
  for (int64_t b0 = 0; b0 < B; b0 += q_tile) {
    const int64_t b1 = std::min(B, b0 + q_tile);
    int64_t tiles = 0;
    for (int64_t w = 0; w < granule_words; ++w) {
      uint64_t any = 0;
      for (int64_t b = b0; b < b1; ++b) any |= granules[b * granule_words + w];
      // A 64-cell tile is 4 granules of 16: one bit per nibble that has any bit set.
      static_assert(attn::kGranuleCells == 16);
      const uint64_t nibbles = (any | any >> 1 | any >> 2 | any >> 3) & 0x1111111111111111u;
      tiles += std::popcount(nibbles);
    }
    prefill_pairs += static_cast<double>(b1 - b0) * static_cast<double>(tiles) * 64.0;
  }
  return prefill_pairs > kPrefillPairsOverDecode * decode_pairs;
}
}  // namespace

PrefetchLevel ResolvePrefetchLevel(PrefetchLevel requested) {
  if (requested != PrefetchLevel::kAuto) return requested;
  static const PrefetchLevel resolved = IsAmdFamily19h() ? PrefetchLevel::kL2 : PrefetchLevel::kL1;
  return resolved;
}

QuantVScaling ResolveQuantVScaling(QuantVScaling requested) {
  if (requested != QuantVScaling::kAuto) return requested;
  static const QuantVScaling resolved = IsIntel() ? QuantVScaling::kWeights : QuantVScaling::kCodes;
  return resolved;
}

namespace {

// Attention over at most kDecodeMaxRows rows for decode, any number for prefill (Attention below
// splits larger calls that may decode). prefill_deferred (kAuto only, may be null): when the
// kAuto choice made after the scan is prefill, set it and return without computing, so that the
// caller can run consecutive such groups as one prefill call.
bool AttentionRows(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& mask, const AttentionKernelParams& params,
                   const ParallelForFn& pf, TensorView* out, bool* prefill_deferred) {
  std::atomic<bool> scratch_failed{false};
  attn::Ctx c;
  c.scratch_failed = &scratch_failed;
  c.q = q;
  c.k = k;
  c.v = v;
  c.mask = mask;
  c.out = *out;
  c.p = params;
  c.p.prefetch = ResolvePrefetchLevel(params.prefetch);
  c.p.quant_v_scaling = ResolveQuantVScaling(params.quant_v_scaling);
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
  bool use_decode = decode && c.B <= kDecodeMaxRows;  // the decode plan's row limit
  // kAuto from 8 rows to the plan's limit, with a mask: decode or prefill, whichever computes fewer
  // (row, cell) pairs (PreferDecode), decided after the scan, which then records both the decode
  // spans and the prefill granules. Batched decode of 8 or more sequences ran 3-8x slower as
  // prefill (session 29), which computes every row of a task over the cells any of them sees.
  const bool choose_after_scan = params.mode == AttentionMode::kAuto && !use_decode &&
                                 c.B <= kDecodeMaxRows && mask.data != nullptr;
  const bool may_decode = use_decode || choose_after_scan;

  // Visible spans (decode) or the visible box (prefill) of each row, found once from the mask.
  // Call-level scratch layout: [span_off: B + 1 int64][row_lo, row_hi: B int32
  // each][spans][partials].
  const int64_t span_row_cap = c.L / 2 + 1;  // a row's spans at most: every other cell visible
  const size_t span_cap =
      may_decode ? static_cast<size_t>(c.B) * static_cast<size_t>(span_row_cap) : 0;
  if (may_decode) {
    // One thread runs a single task over every head: nothing to merge. With more threads a long
    // history is split into chunks of cells, each task walking every KV head of its chunk one
    // after the other: on 2 threads at 32768 cells that was 7-13% faster than one task per KV head
    // over the whole history (calls alternating, session 5). Shorter histories keep tasks per KV
    // head (split into chunks only when there are fewer heads than tasks wanted): at 4096 cells
    // they were up to 10% faster than 8 chunks of 512 cells (head_dim 64). Walking every head of
    // a 128-cell block before the next block was 5-25% slower than head after head (the blocks
    // are head-major: it reads one stream per head at once), and 1.7-2.4x slower with the next
    // block of every head prefetched as it went (session 8).
    const int64_t target_tasks = 4 * static_cast<int64_t>(threads);
    constexpr int64_t kMinChunk = 512;  // below this, the merge costs more than the split saves
    // Chunks of all heads from this many cells per chunk on (their boundaries then follow the
    // work: where many rows see the cells, chunks are shorter).
    constexpr int64_t kMinCellChunk = 4096;
    int64_t chunks = 1;
    c.task_heads = c.Hkv;
    if (threads > 1 && c.L >= target_tasks * kMinCellChunk) {
      chunks = target_tasks;
    } else if (threads > 1) {
      chunks = c.Hkv >= target_tasks ? 1 : (target_tasks + c.Hkv - 1) / c.Hkv;
      chunks = std::max<int64_t>(1, std::min(chunks, (c.L + kMinChunk - 1) / kMinChunk));
      c.task_heads = 1;
    }
    // As many chunks as equal ones of whole blocks give; BalanceDecodeChunks then places their
    // boundaries by the rows' work, once the spans are known.
    int64_t chunk = (c.L + chunks - 1) / chunks;
    chunk = (chunk + attn::kBlockCells - 1) / attn::kBlockCells * attn::kBlockCells;
    if (chunk == 0) chunk = 1;
    c.n_chunks = std::max<int64_t>(1, (c.L + chunk - 1) / chunk);
  }
  const size_t partial_floats =
      may_decode ? static_cast<size_t>(c.Hkv * c.n_chunks * c.B * c.G * attn::PartialStride(c)) : 0;
  // The decode walk (kernels/decode_plan.h): step offsets per chunk, the chunks' boundaries, the
  // blocks' work that places them, then the steps.
  const int64_t blocks = (c.L + attn::kBlockCells - 1) / attn::kBlockCells;
  const size_t plan_bytes =
      may_decode ? static_cast<size_t>(2 * (c.n_chunks + 1) + blocks) * 8 +
                       static_cast<size_t>(MaxDecodeSteps(c.B, c.L, params.v_permuted)) *
                           sizeof(DecodeStep)
                 : 0;
  const size_t header_bytes = (static_cast<size_t>(c.B) + 1) * 8 + static_cast<size_t>(c.B) * 8;
  // Prefill with a mask: each row's visible granules, so that a task skips the tiles none of its
  // rows can see (kvperf's default, 4 sequences: the other sequences' cells inside the rows' box).
  c.granule_words = use_decode || mask.data == nullptr
                        ? 0
                        : (c.L + 64 * attn::kGranuleCells - 1) / (64 * attn::kGranuleCells);
  const size_t granule_bytes = 2 * static_cast<size_t>(c.B * c.granule_words) * 8;  // both maps
  // One mask row's bitmaps at a time per scanning task (MaskRowBitsImpl): hidden cells, then
  // nonzero values (none with mask_bits: the rows' bitmaps are given). The rows are scanned on
  // every thread, at least kMinScanRows rows per task.
  const int64_t scan_tasks =
      mask.data != nullptr && threads > 1 ? std::clamp<int64_t>(c.B / kMinScanRows, 1, threads) : 1;
  const size_t row_bits_bytes = mask.data == nullptr || params.mask_bits != nullptr
                                    ? 0
                                    : static_cast<size_t>(scan_tasks * MaskBitsRowWords(c.L)) * 8;
  const size_t total_bytes = header_bytes + span_cap * 8 + plan_bytes + granule_bytes +
                             row_bits_bytes + partial_floats * 4 + 192;
  float* base = attn::ThreadScratch((total_bytes + 3) / 4, 0);
  if (base == nullptr) return false;
  char* p8 = reinterpret_cast<char*>(base);
  int64_t* span_off = reinterpret_cast<int64_t*>(p8);
  int32_t* row_lo = reinterpret_cast<int32_t*>(p8 + (c.B + 1) * 8);
  int32_t* row_hi = row_lo + c.B;
  int32_t* spans = row_hi + c.B;
  char* plan = p8 + header_bytes + span_cap * 8;                        // 8-aligned
  uint64_t* granules = reinterpret_cast<uint64_t*>(plan + plan_bytes);  // 8-aligned
  uint64_t* row_bits = granules + 2 * c.B * c.granule_words;            // 8-aligned
  float* partials = reinterpret_cast<float*>(
      p8 +
      attn::Pad(static_cast<int64_t>(
          (header_bytes + span_cap * 8 + plan_bytes + granule_bytes + row_bits_bytes + 63) / 4)) *
          4);
  if (c.granule_words > 0) std::memset(granules, 0, granule_bytes);

  // Prefill's rows per task: about 128 query rows, so that the K/V tile conversion (and K's
  // transposition) is amortized over that many rows; 256 measured no faster (f16, head_dim 128,
  // 512 x 4096).
  const int64_t q_tile = std::clamp<int64_t>(128 / c.G, 1, 64);
  span_off[0] = 0;
  if (mask.data == nullptr) {
    for (int64_t b = 0; b < c.B; ++b) {
      const bool any = c.L > 0;
      if (use_decode && any) {
        spans[2 * b] = 0;
        spans[2 * b + 1] = static_cast<int32_t>(c.L);
      }
      span_off[b + 1] = use_decode && any ? b + 1 : 0;
      row_lo[b] = any ? 0 : static_cast<int32_t>(c.L);
      row_hi[b] = any ? static_cast<int32_t>(c.L) : 0;
    }
  } else {
    MaskScan scan{.mask = &mask,
                  .L = c.L,
                  .rows_per_task = (c.B + scan_tasks - 1) / scan_tasks,
                  .B = c.B,
                  .granules = granules,
                  .granule_words = c.granule_words,
                  .mask_bits = params.mask_bits,
                  .row_bits = row_bits,
                  .row_lo = row_lo,
                  .row_hi = row_hi};
    if (may_decode) {
      scan.spans = spans;
      scan.span_row_cap = span_row_cap;
      scan.span_count = span_off + 1;
    }
    if (scan_tasks == 1) {
      ScanMaskTask(&scan, 0);
    } else {
      pf.run(pf.user, scan_tasks, ScanMaskTask, &scan);
    }
    if (may_decode) PackSpans(spans, scan.span_row_cap, span_off + 1, c.B, span_off);
    if (choose_after_scan) {
      use_decode = PreferDecode(spans, span_off, granules, c.granule_words, c.B, q_tile);
      if (use_decode) c.granule_words = 0;  // decode reads no granules
      if (!use_decode && prefill_deferred != nullptr) {
        *prefill_deferred = true;
        return true;
      }
    }
    if (!use_decode) {
      for (int64_t b = 0; b < c.B; ++b) span_off[b + 1] = 0;
    }
  }
  c.spans = spans;
  c.span_off = span_off;
  c.row_lo = row_lo;
  c.row_hi = row_hi;
  c.visible_granules = c.granule_words > 0 ? granules : nullptr;
  c.plain_granules = c.granule_words > 0 ? granules + c.B * c.granule_words : nullptr;
  c.partials = partials;
  if (use_decode) {
    c.step_off = reinterpret_cast<int64_t*>(plan);
    int64_t* chunk_bounds = c.step_off + c.n_chunks + 1;
    double* block_work = reinterpret_cast<double*>(chunk_bounds + c.n_chunks + 1);
    c.steps = reinterpret_cast<DecodeStep*>(block_work + blocks);
    BalanceDecodeChunks(spans, span_off, c.B, c.L, c.n_chunks, block_work, chunk_bounds);
    c.chunk_bounds = chunk_bounds;
  }
  if (!use_decode) {
    c.q_tile = q_tile;
    c.n_qtiles = (c.B + c.q_tile - 1) / c.q_tile;
  }
  if (use_decode) {
    attn::RunDecode(c, pf);
  } else {
    HWY_DYNAMIC_DISPATCH(PrefillImpl)(c, pf);
  }
  return !scratch_failed.load(std::memory_order_relaxed);  // the tasks have all returned
}

}  // namespace

// A call of more than kDecodeMaxRows rows that may decode (kDecode, or kAuto with a mask) runs in
// groups of consecutive rows, as equal as can be and none over the plan's limit (65 rows: 33 and
// 32, so every group has the 8 rows from which kAuto chooses). Under kAuto each group chooses
// after its scan, as a call of that many rows would: batched decode of 65+ sequences decodes, and
// in a mixed batch (a prompt chunk of one sequence, then one new token of each of many) each group
// runs the one way its (row, cell) pairs favour: groups are equal slices of rows, not cut where
// the rows' kind changes (one such batch measured 1.02-1.04x the time of its parts run apart).
// Groups that choose prefill are not run at once: each run of consecutive ones becomes one prefill
// call, tiled as a call of those rows alone would be, so that a prompt of 512 rows loses none of
// prefill's tasks and runs bit for bit as before; what it pays is the groups' scans of its mask
// (read twice: 4 bytes per row and cell, next to prefill's ~4 * Hq * D flops; with mask_bits, a
// cache's History after the first layer of a pass, 2 bits per row and cell).
bool Attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& mask, const AttentionKernelParams& params, const ParallelForFn& pf,
               TensorView* out) {
  const int64_t B = q.ne[1];
  const bool auto_mode = params.mode == AttentionMode::kAuto;
  const bool in_groups = B > kDecodeMaxRows && (params.mode == AttentionMode::kDecode ||
                                                (auto_mode && mask.data != nullptr));
  if (!in_groups) return AttentionRows(q, k, v, mask, params, pf, out, nullptr);
  const int64_t groups = (B + kDecodeMaxRows - 1) / kDecodeMaxRows;
  AttentionKernelParams prefill_params = params;
  prefill_params.mode = AttentionMode::kPrefill;
  const auto run = [&](int64_t r0, int64_t r1, const AttentionKernelParams& p, bool* deferred) {
    TensorView rows_out = RowsView(*out, r0, r1);
    AttentionKernelParams rows_params = p;
    if (p.mask_bits != nullptr) rows_params.mask_bits += r0 * MaskBitsRowWords(k.ne[2]);
    return AttentionRows(RowsView(q, r0, r1), k, v, RowsView(mask, r0, r1), rows_params, pf,
                         &rows_out, deferred);
  };
  int64_t prefill_from = -1;  // the first row of the groups that chose prefill, not yet run
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * B / groups, r1 = (g + 1) * B / groups;
    bool deferred = false;
    if (!run(r0, r1, params, auto_mode ? &deferred : nullptr)) return false;
    if (deferred) {
      if (prefill_from < 0) prefill_from = r0;
    } else if (prefill_from >= 0) {
      if (!run(prefill_from, r0, prefill_params, nullptr)) return false;
      prefill_from = -1;
    }
  }
  return prefill_from < 0 || run(prefill_from, B, prefill_params, nullptr);
}

namespace {
// MaskBits' rows, split as a call's own scan is (kMinScanRows rows per task at least).
struct MaskBitsJob {
  const TensorView* mask;
  int64_t rows_per_task, B;
  uint64_t* bits;
};

void MaskBitsTask(void* ctx, int64_t task) {
  const MaskBitsJob& j = *static_cast<const MaskBitsJob*>(ctx);
  const int64_t words = attn::MaskRowBitWords(j.mask->ne[0]);
  const int64_t b1 = std::min(j.B, (task + 1) * j.rows_per_task);
  for (int64_t b = task * j.rows_per_task; b < b1; ++b) {
    uint64_t* row = j.bits + b * 2 * words;
    attn::MaskRowBits(*j.mask, b, row, row + words);
  }
}
}  // namespace

void MaskBits(const TensorView& mask, const ParallelForFn& pf, uint64_t* bits) {
  const int64_t B = mask.ne[1];
  if (B <= 0) return;
  const int threads = pf.run != nullptr ? std::max(1, pf.num_threads) : 1;
  const int64_t tasks = std::clamp<int64_t>(B / kMinScanRows, 1, threads);
  MaskBitsJob job{.mask = &mask, .rows_per_task = (B + tasks - 1) / tasks, .B = B, .bits = bits};
  if (tasks == 1) {
    MaskBitsTask(&job, 0);
  } else {
    pf.run(pf.user, tasks, MaskBitsTask, &job);
  }
}

}  // namespace kv::kernels
#endif  // HWY_ONCE
