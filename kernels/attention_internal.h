// Shared by the attention kernel's two translation units (kernels/attention.cc: setup and
// prefill; kernels/attention_decode.cc: decode): the call context and target-independent helpers.
// Internal to the kernels layer; kernels/attention.h is the contract.
#ifndef KVCACHE_KERNELS_ATTENTION_INTERNAL_H_
#define KVCACHE_KERNELS_ATTENTION_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "hwy/aligned_allocator.h"
#include "hwy/cache_control.h"
#include "kernels/attention.h"
#include "kernels/decode_plan.h"
#include "kernels/grow_buffer.h"
#include "layouts/quant.h"

// Marks a lambda inside a kernel's loops as always inlined: `[&](int64_t r) KV_INLINE_LAMBDA {`.
// Left to themselves, g++ 12 compiled decode's quantized V pass lambda as a call and clang 14 also
// its integer K pass lambda; their accumulators then made a round trip through memory per call
// (q8_0 decode 3-4% slower with g++, up to 25% with clang; perf/HISTORY.md, session 38).
#if defined(__GNUC__) || defined(__clang__)
#define KV_INLINE_LAMBDA __attribute__((always_inline))
#else
#define KV_INLINE_LAMBDA
#endif

namespace kv::kernels {
namespace attn {

inline constexpr int64_t kBlockCells = kDecodeBlockCells;  // decode: cells per softmax update
inline constexpr int64_t kMaxPass = 8;  // decode: query heads served by one K row load
inline constexpr int64_t kRowPad = 16;  // row padding (floats) valid for every target

constexpr int64_t Pad(int64_t n) { return (n + kRowPad - 1) / kRowPad * kRowPad; }

// Prefill skips the cell tiles that no row of its query tile can see (other sequences' cells
// inside the rows' visible box) by a bitmap of visible granules per row (Ctx::visible_granules).
inline constexpr int64_t kGranuleCells = 16;

// The bits of word w that lie in [first, last] (bit i of word w is bit 64 * w + i).
inline uint64_t BitsOfWordInRange(int64_t w, int64_t first, int64_t last) {
  const int64_t lo = w == first / 64 ? first % 64 : 0;
  const int64_t hi = w == last / 64 ? last % 64 : 63;
  const uint64_t upto = hi == 63 ? ~uint64_t{0} : (uint64_t{1} << (hi + 1)) - 1;
  return upto & ~((uint64_t{1} << lo) - 1);
}

// Sets bits [first, last] of words.
inline void SetBits(uint64_t* words, int64_t first, int64_t last) {
  for (int64_t w = first / 64; w <= last / 64; ++w) words[w] |= BitsOfWordInRange(w, first, last);
}

// Whether any of bits [first, last] of words is set.
inline bool AnyBit(const uint64_t* words, int64_t first, int64_t last) {
  for (int64_t w = first / 64; w <= last / 64; ++w) {
    if ((words[w] & BitsOfWordInRange(w, first, last)) != 0) return true;
  }
  return false;
}

// Whether all of bits [first, last] of words are set.
inline bool AllBits(const uint64_t* words, int64_t first, int64_t last) {
  for (int64_t w = first / 64; w <= last / 64; ++w) {
    const uint64_t want = BitsOfWordInRange(w, first, last);
    if ((words[w] & want) != want) return false;
  }
  return true;
}

struct Ctx {
  TensorView q, k, v, mask, out;
  AttentionKernelParams p;
  int64_t D, Dv, Hkv, L, B, Hq, G;
  int64_t Dp, Dvp;  // padded to kRowPad
  // decode
  const int32_t* spans = nullptr;  // pairs [start, end) of visible cells, per row
  const int64_t* span_off =
      nullptr;  // row b's pairs: spans[2 * span_off[b] .. 2 * span_off[b + 1])
  int64_t n_chunks = 1;
  const int64_t* chunk_bounds = nullptr;  // chunk k: cells [chunk_bounds[k], chunk_bounds[k + 1])
  int64_t task_heads = 1;     // KV heads per task: task t = (heads [t / n_chunks * task_heads, ..),
                              // chunk t % n_chunks)
  float* partials = nullptr;  // [Hkv * n_chunks][B][G][Dvp + kRowPad]: acc, then m, l
  // The walk every KV head replays (kernels/decode_plan.h): chunk k's steps are
  // steps[step_off[k] .. step_off[k + 1]). Attention sizes them; RunDecode writes them.
  DecodeStep* steps = nullptr;  // [MaxDecodeSteps(B, L, v_permuted)]
  int64_t* step_off = nullptr;  // [n_chunks + 1]
  // Every KV head's query rows as the K passes read them, [Hkv][one head's block]
  // (attention_decode.cc, HeadQueryLayout), when several chunks walk each head: prepared once per
  // call before the tasks run. Null: each task prepares its head's rows itself.
  float* head_queries = nullptr;
  // prefill
  const int32_t* row_lo = nullptr;  // first visible cell of row b (L when none)
  const int32_t* row_hi = nullptr;  // last visible cell + 1 (0 when none)
  // Bit g of row b's granule_words words: a cell of [kGranuleCells * g, + kGranuleCells) is
  // visible to row b. Null without a mask (every cell visible).
  const uint64_t* visible_granules = nullptr;
  // The same for granules whose every cell is visible to row b with a mask value of +-0: a tile
  // inside them adds nothing and hides nothing, so it is not read from the mask at all.
  const uint64_t* plain_granules = nullptr;
  int64_t granule_words = 0;
  int64_t q_tile = 1, n_qtiles = 1;
  // Set by a task whose ThreadScratch failed (it returns at once, its results unwritten); Attention
  // reads it after every task has returned.
  std::atomic<bool>* scratch_failed = nullptr;
};

// Records that a task could not get its scratch: Attention will return false.
inline void ScratchFailed(const Ctx& c) {
  c.scratch_failed->store(true, std::memory_order_relaxed);
}

inline int64_t PartialStride(const Ctx& c) { return c.Dvp + kRowPad; }

// Which K and V rows around a piece of cells [c0, c0 + n) have been or will be requested (see
// DecodeCells in attention_decode.cc), counted from c0: K rows [0, ready) and V rows [0, v_ready)
// were asked for already (by earlier pieces); the V pass of this piece asks for K rows [next_from,
// next_to) (none when next_to <= next_from).
struct KPrefetch {
  int64_t ready = 0;
  int64_t v_ready = 0;
  int64_t next_from = 0;
  int64_t next_to = 0;
  // The view's rows are not adjacent (DecodeStrided: every k-th cell): ask for each row's own
  // lines (RowCursor), not for the byte range the rows span, which holds other batch rows' cells.
  bool rows_only = false;
};

// Rows of one KV head asked for so far by a task that walks its cells forward: every row below
// the mark was asked for (recently), none above.
struct RequestedRows {
  int64_t k = 0, v = 0;
};

// The plan for the task's next piece [s0, s0 + n), its end being `hi`: rows below the marks are
// ready, and the V pass asks for up to n K rows after the piece, within the task. Batch rows that
// revisit a block find it requested and ask for nothing again. Advances the marks.
inline KPrefetch PlanKPrefetch(int64_t s0, int64_t n, int64_t hi, RequestedRows& asked) {
  KPrefetch kp;
  kp.ready = std::clamp<int64_t>(asked.k - s0, 0, n);
  kp.v_ready = std::clamp<int64_t>(asked.v - s0, 0, n);
  kp.next_from = std::max(n, asked.k - s0);
  kp.next_to = std::min(2 * n, hi - s0);
  asked.k = std::max(asked.k, s0 + std::max(n, kp.next_to));
  asked.v = std::max(asked.v, s0 + n);
  return kp;
}

// Asks for the cache line holding p: prefetcht0 on x86, or with kToL2 prefetcht2 (into L2 only;
// PrefetchLevel in kernels/attention.h). An asm statement rather than hwy::Prefetch
// (__builtin_prefetch): GCC 12 at -O3 dropped the builtin from decode's K pass once its K-row
// request became conditional (session 12: no prefetch instruction left in the AVX-512 f16 code,
// not even the V rows' unconditional one, and the V pass stalled on every row); an asm volatile
// statement stays where it is written.
template <bool kToL2 = false>
inline void PrefetchLine(const void* p) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (kToL2) {
    asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  hwy::Prefetch(p);
#endif
}

// Requests the cache lines of [next, end) a few at a time, from inside a loop that does other work,
// so that the requests are spread over it instead of stalling on the miss buffers all at once.
// The rate is fractional (16.16 fixed point): a loop of more steps than lines asks for one line
// every few steps. Once every line is asked for, Issue is a compare. to_l2: prefetcht2 instead of
// prefetcht0 (PrefetchLevel, kernels/attention.h).
struct LineCursor {
  const char* next = nullptr;
  const char* end = nullptr;
  uint64_t rate = 0;    // lines per Issue, << 16
  uint64_t credit = 0;  // lines owed, << 16
  bool to_l2 = false;
  // The lines of bytes [from, to), spread over `steps` calls of Issue (none when the range is
  // empty).
  static LineCursor Over(const char* from, const char* to, int64_t steps, bool to_l2) {
    LineCursor lc;
    lc.to_l2 = to_l2;
    if (to <= from || steps <= 0) return lc;
    lc.next = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(from) & ~uintptr_t{63});
    lc.end = to;
    lc.Spread(steps);
    return lc;
  }
  // Spreads the lines not asked for yet evenly over the next `steps` (>= 1) calls of Issue, the
  // last line no later than the last call. A loop calls it with the number of Issue calls it
  // makes, where that is not the count given to Over.
  void Spread(int64_t steps) {
    if (next >= end) return;
    const uint64_t lines = static_cast<uint64_t>(end - next + 63) / 64;
    const uint64_t n = static_cast<uint64_t>(std::max<int64_t>(steps, 1));
    rate = ((lines << 16) + n - 1) / n;
    credit = 0;
  }
  HWY_INLINE void Issue() {
    if (next >= end) return;
    credit += rate;
    for (; credit >= (uint64_t{1} << 16) && next < end; credit -= uint64_t{1} << 16, next += 64) {
      if (to_l2) {
        PrefetchLine</*kToL2=*/true>(next);
      } else {
        PrefetchLine(next);
      }
    }
  }
};

// Requests the lines of `rows` rows of `bytes` bytes each, `stride` apart (a strided view's rows),
// one row per Issue: a loop that calls it once per row it reads asks for rows as far ahead as the
// cursor starts ahead. Unlike LineCursor over the rows' whole range it skips the bytes between the
// rows: those are other batch rows' cells, which those rows ask for when they read them. Asking
// for the whole range at the first row's turn put 4x as many requests into that row's pass as it
// reads (batched decode's interleaved tokens, 4 sequences) and stalled it on the fill buffers:
// perf/HISTORY.md, session 25.
struct RowCursor {
  const char* next = nullptr;
  int64_t rows = 0;  // rows not asked for yet
  size_t stride = 0, bytes = 0;
  bool to_l2 = false;
  // Calls fn(line) for each 64-byte line that holds a byte of [row, row + bytes), in order.
  template <class Fn>
  static void ForEachLine(const char* row, size_t bytes, const Fn& fn) {
    const char* line =
        reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63});
    for (; line < row + bytes; line += 64) fn(line);
  }
  HWY_INLINE void Issue() {
    if (rows <= 0) return;
    ForEachLine(next, bytes, [&](const char* line) {
      if (to_l2) {
        PrefetchLine</*kToL2=*/true>(line);
      } else {
        PrefetchLine(line);
      }
    });
    next += stride;
    --rows;
  }
};

// One 64-byte-aligned float buffer per thread and `which` that only grows (GrowBuffer): 0, a call's
// own scratch on the calling thread (spans, decode plan, partials); 1, query rows (a prefill
// task's; a decode task's head, or on the calling thread every head's when the call prepares them
// once, Ctx::head_queries); 2, DecodeGathered's copies of short pieces. Each starts at
// 256 KiB: the visible-span table needs B * (L / 2 + 1) entries, so growing to the exact size
// reallocated on every other decode step as the history lengthened. With the floor a single
// decoding sequence never reallocates below ~128K cells, and beyond that it reallocates O(log L)
// times. Null when the buffer cannot grow: the caller gives up (ScratchFailed), so Attention
// reports it instead of writing through null.
[[nodiscard]] inline float* ThreadScratch(size_t floats, int which) {
  thread_local GrowBuffer buf[3] = {GrowBuffer(size_t{1} << 16), GrowBuffer(size_t{1} << 16),
                                    GrowBuffer(size_t{1} << 16)};
  return buf[which].Reserve(floats);
}

// mask[b * L + j]: row b (batch token), cell j.
inline float MaskValue(const TensorView& mask, int64_t b, int64_t j) {
  return ElementAsF32(mask, j, b);
}

// Writes one output row o[0..Dv) from the online softmax's final state over the visible cells:
// acc[0..Dv) (the weighted sum of V rows, weights relative to the running max m) and l (the sum
// of those weights), adding the head's sink logit (nullptr: none) to the denominator only.
// m NaN (a NaN or +inf logit poisoned the state): a NaN row. m == -inf (nothing visible) or no
// positive denominator: zeros. Shared by decode's merge and prefill's finish, so the two paths
// cannot disagree on these rules; kernels/attention_ref.cc keeps its own (it is the check).
inline void FinishRow(const float* acc, float m, float l, const float* sink, int64_t Dv, float* o) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (std::isnan(m)) {
    std::fill_n(o, Dv, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  float w = 1.0f;  // acc's weight relative to the max taken with the sink
  if (sink != nullptr) {
    const float mm = std::max(m, *sink);
    w = m == kNegInf ? 0.0f : std::exp(m - mm);
    l = l * w + std::exp(*sink - mm);
  }
  if (m == kNegInf || !(l > 0)) {
    std::fill_n(o, Dv, 0.0f);
    return;
  }
  const float f = w / l;
  for (int64_t i = 0; i < Dv; ++i) o[i] = acc[i] * f;
}

// Words of one of MaskRowBits' bitmaps for a mask row of L elements.
inline constexpr int64_t MaskRowBitWords(int64_t L) { return (L + 63) / 64; }

// Row b of an f32 or f16 mask [L, B] (elements packed) as two bitmaps of MaskRowBitWords(L) words,
// bit j of words[j / 64]: `hidden` where the element is -inf, `nonzero` where it is not +-0 (NaN,
// inf and finite values other than zero). Bits from L on are clear. Dispatched
// (kernels/attention.cc).
void MaskRowBits(const TensorView& mask, int64_t b, uint64_t* hidden, uint64_t* nonzero);

// The first j' in [j, L) whose bit in words is `set` (bit j of words[j / 64]), or L.
inline int64_t NextBit(const uint64_t* words, int64_t j, int64_t L, bool set) {
  while (j < L) {
    const uint64_t w = (set ? words[j / 64] : ~words[j / 64]) >> (j % 64);
    if (w != 0) return std::min<int64_t>(L, j + std::countr_zero(w));
    j = (j / 64 + 1) * 64;
  }
  return L;
}

// Calls emit(s0, s1) for each maximal run [s0, s1) of clear bits among bits [0, L) of words (the
// visible cells of a mask row's `hidden` bitmap), a word at a time.
template <class Emit>
void ForEachClearRun(const uint64_t* words, int64_t L, const Emit& emit) {
  int64_t j = NextBit(words, 0, L, false);
  while (j < L) {
    const int64_t s1 = NextBit(words, j, L, true);
    emit(j, s1);
    j = NextBit(words, s1, L, false);
  }
}

// Calls run.template operator()<T, kPermV>() with the call's K/V storage type and V layout, so
// each translation unit instantiates its tasks for every pair the kernel supports (quantized V is
// plain only).
template <class Run>
void WithStorageTypes(const Ctx& c, const Run& run) {
  const bool perm = c.p.v_permuted;
  switch (c.k.dtype) {
    case DType::kF32:
      return perm ? run.template operator()<DType::kF32, true>()
                  : run.template operator()<DType::kF32, false>();
    case DType::kF16:
      return perm ? run.template operator()<DType::kF16, true>()
                  : run.template operator()<DType::kF16, false>();
    case DType::kBF16:
      return perm ? run.template operator()<DType::kBF16, true>()
                  : run.template operator()<DType::kBF16, false>();
    case DType::kQ8_0:
      return run.template operator()<DType::kQ8_0, false>();
    case DType::kQ4_0:
      return run.template operator()<DType::kQ4_0, false>();
  }
}

// Runs task(ctx = &c, i) for i in [0, n) on pf's threads, or inline when there is no pool or one
// task.
inline void RunTasks(const Ctx& c, int64_t n, const ParallelForFn& pf,
                     void (*task)(void*, int64_t)) {
  void* ctx = const_cast<Ctx*>(&c);
  if (pf.run == nullptr || n == 1) {
    for (int64_t i = 0; i < n; ++i) task(ctx, i);
  } else {
    pf.run(pf.user, n, task, ctx);
  }
}

// Runs the decode tasks (kernels/attention_decode.cc) on the best target and merges their partials
// into c.out. Preconditions: Attention() has filled c's decode fields (spans, chunks, partials).
void RunDecode(const Ctx& c, const ParallelForFn& pf);

}  // namespace attn
}  // namespace kv::kernels
#endif  // KVCACHE_KERNELS_ATTENTION_INTERNAL_H_
