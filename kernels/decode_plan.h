// The walk that decode attention repeats for every KV head (kernels/attention_decode.cc): chunk by
// chunk, block by block and batch row by batch row, which cells each row runs and how. It depends
// only on the rows' visible spans, so Attention finds it once per call and every KV head replays
// it. Walked once per KV head instead (until session 25), it cost ~4% of kvperf's batched decode
// and a quarter of the in-cache time of batched decode's interleaved one-cell spans, the same 8
// times over (perf/HISTORY.md, session 24).
//
// Plain scalar code: no Highway, no tensor data.
#ifndef KVCACHE_KERNELS_DECODE_PLAN_H_
#define KVCACHE_KERNELS_DECODE_PLAN_H_

#include <algorithm>
#include <cstdint>

namespace kv::kernels {

// Cells per online-softmax update; chunks of cells are multiples of it, so blocks start at
// multiples of it.
inline constexpr int64_t kDecodeBlockCells = 128;
// A visible piece of a block shorter than this is not run alone (each would pay a softmax step):
// the row's short pieces of a block are run together, in place when they fall every k-th cell,
// else from a copy.
inline constexpr int64_t kDecodeShortSpan = 16;

// Batch rows a plan serves (its per-row cursors live on the stack); Attention splits larger
// batches that may decode into groups of at most this many rows.
inline constexpr int64_t kDecodeMaxRows = 64;

enum class DecodeStepKind : int8_t {
  kCells,     // cells [first, first + count), for rows row .. row + n_rows - 1 alike
  kStrided,   // cells first, first + step, .., count of them (step > 1), for row only
  kGathered,  // row's short pieces of the block that holds `first` (count cells in all), copied
              // together: the row's spans from index `span` on, clipped to the block
};

// One step of a chunk's walk (16 bytes: a plan may hold one per visible span).
struct DecodeStep {
  int32_t first;  // first cell (absolute)
  int32_t span;   // kGathered: index among the row's spans of the first that meets the block
  int16_t count;  // cells, 1 .. kDecodeBlockCells
  int16_t row;    // batch row (kCells: the first of n_rows consecutive rows)
  int16_t step;   // kStrided: cells apart (> 1); 0 otherwise
  int8_t n_rows;  // kCells: rows that run these cells together, >= 1; 1 otherwise
  DecodeStepKind kind;
};
static_assert(sizeof(DecodeStep) == 16);

// The rows' visible spans and how the call runs them.
struct DecodePlanInput {
  const int32_t* spans = nullptr;     // pairs [start, end) of visible cells, ascending, per row
  const int64_t* span_off = nullptr;  // row b's pairs: spans[2 * span_off[b] .. 2 * span_off[b+1])
  int64_t B = 0, L = 0;
  int64_t n_chunks = 0;
  const int64_t* chunk_bounds = nullptr;  // chunk k: cells [chunk_bounds[k], chunk_bounds[k + 1])
  bool v_permuted = false;    // every piece runs in place (a permuted V row cannot be copied)
  bool combine_rows = false;  // consecutive rows that see the same piece run it together
  bool copy_strided = false;  // AttentionKernelParams::copy_strided_spans: no kStrided steps
};

// Cost of a cell's K and V bytes, in units of one row's arithmetic over one cell (the work model
// of BalanceDecodeChunks). Measured on the Xeon (session 30, head_dim 64, 4 query heads per KV
// head, 8 KV heads, 1 thread): 128 rows over 256 cells each of their own, ~300 ns per (row, cell)
// in f16 and ~226 in q8_0; 128 rows over 1024 cells they all see, ~110 and ~107 ns (the rows run
// together: the bytes are read once). Ratios ~2.7 and ~2.1. Only cells seen by one row or a few
// depend on it: uniform visibility splits by cells whatever it is.
inline constexpr double kDecodeCellBytesCost = 2.0;

// Boundaries of decode's n_chunks chunks of [0, L): bounds[0] = 0 < bounds[1] < .. <
// bounds[n_chunks] = L, every one but the last a multiple of kDecodeBlockCells, chosen so that the
// chunks hold about equal work, where a block of cells costs max(row_cells, kDecodeCellBytesCost *
// min(row_cells, cells)): row_cells the (row, cell) pairs the rows see in it (their arithmetic;
// rows that see the same cells run them together, so those cells' bytes are read once), cells its
// length (its bytes, at most once, when the rows see distinct cells or one row sees them all).
// Equal chunks of cells leave one thread with a shared prompt that many rows see: batched decode
// of 128 sequences over a shared 1024-token prompt (256 tokens each of their own) put 84% of a
// 64-row group's (row, cell) pairs in the first of 8 chunks; on 2 threads these boundaries made
// such a call 1.09-1.14x faster in f16 and 1.03x in q8_0 (median of paired calls, session 30).
// block_work: scratch of ceil(L / kDecodeBlockCells) doubles. spans / span_off as in
// DecodePlanInput. Preconditions: 1 <= n_chunks <= max(1, ceil(L / kDecodeBlockCells)).
void BalanceDecodeChunks(const int32_t* spans, const int64_t* span_off, int64_t B, int64_t L,
                         int64_t n_chunks, double* block_work, int64_t* bounds);

// Upper bound on the steps of any plan of this shape, from the shape alone, so that scratch sized
// by one call of the largest shape serves every later call (no allocation in steady state). Chunks
// are multiples of the block, so the blocks are those of [0, L) in steps of kDecodeBlockCells, and
// per row: long pieces have >= kDecodeShortSpan cells each, plus one short step per block; with
// v_permuted every piece is a step: <= L / 2 + 1 spans, plus one more per block boundary.
int64_t MaxDecodeSteps(int64_t B, int64_t L, bool v_permuted);

// Writes chunk k's steps to steps[step_off[k] .. step_off[k + 1]) for k < n_chunks (step_off has
// n_chunks + 1 entries), in the order the kernel runs them: per block, rows in order, each row's
// long pieces in cell order, then its short pieces as one step. With combine_rows, when row b
// runs a long piece, the rows after it whose next piece in the block is the same (up to 8 pieces
// per row and block) join it (n_rows) and skip it at their turn. Preconditions: spans as above,
// chunk_bounds as BalanceDecodeChunks gives them, B <= kDecodeMaxRows, steps sized by
// MaxDecodeSteps.
void BuildDecodePlan(const DecodePlanInput& in, DecodeStep* steps, int64_t* step_off);

// The cells of a kGathered step `st`, found again from its span index as the plan found them (the
// row's pieces shorter than kDecodeShortSpan in the block that holds st.first), to cells[0 ..
// st.count). spans / span_off as in DecodePlanInput.
void GatheredCells(const int32_t* spans, const int64_t* span_off, const DecodeStep& st,
                   int32_t* cells);

// Calls fn(s0, s1) for each nonempty piece of row spans sp[2 * i], sp[2 * i + 1] (i from *cursor,
// ns spans in all) inside [blk0, blk1), in order. *cursor stops at a span that goes on past blk1
// (so the next block starts there). The one walk over a row's spans, for the plan and for
// kGathered's copy.
template <class Fn>
inline void ForEachPieceInBlock(const int32_t* sp, int64_t ns, int64_t* cursor, int64_t blk0,
                                int64_t blk1, const Fn& fn) {
  int64_t i = *cursor;
  while (i < ns && sp[2 * i] < blk1) {
    const int64_t s0 = std::max<int64_t>(sp[2 * i], blk0);
    const int64_t s1 = std::min<int64_t>(sp[2 * i + 1], blk1);
    if (s1 > s0) fn(s0, s1);
    if (sp[2 * i + 1] > blk1) break;  // the span goes on into the next block
    ++i;
  }
  *cursor = i;
}

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_DECODE_PLAN_H_
