// The decode walk, found once per call (kernels/decode_plan.h).
#include "kernels/decode_plan.h"

#include <algorithm>
#include <cstdint>

namespace kv::kernels {

int64_t MaxDecodeSteps(int64_t B, int64_t L, bool v_permuted) {
  const int64_t blocks = (L + kDecodeBlockCells - 1) / kDecodeBlockCells;
  const int64_t per_row = v_permuted ? L / 2 + 1 + blocks : L / kDecodeShortSpan + blocks;
  return B * per_row;
}

void BalanceDecodeChunks(const int32_t* spans, const int64_t* span_off, int64_t B, int64_t L,
                         int64_t n_chunks, double* block_work, int64_t* bounds) {
  const int64_t blocks = (L + kDecodeBlockCells - 1) / kDecodeBlockCells;
  bounds[0] = 0;
  bounds[n_chunks] = L;
  if (n_chunks == 1) return;
  // Row cells per block, then each block's cost.
  std::fill(block_work, block_work + blocks, 0.0);
  for (int64_t i = span_off[0]; i < span_off[B]; ++i) {
    const int64_t s0 = spans[2 * i], s1 = spans[2 * i + 1];
    for (int64_t blk = s0 / kDecodeBlockCells; blk * kDecodeBlockCells < s1; ++blk) {
      const int64_t b0 = blk * kDecodeBlockCells;
      block_work[blk] +=
          static_cast<double>(std::min(s1, b0 + kDecodeBlockCells) - std::max(s0, b0));
    }
  }
  double total = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const double cells =
        static_cast<double>(std::min(L - blk * kDecodeBlockCells, kDecodeBlockCells));
    const double row_cells = block_work[blk];
    block_work[blk] = std::max(row_cells, kDecodeCellBytesCost * std::min(row_cells, cells));
    total += block_work[blk];
  }
  // Chunk k ends after the first block where the running work reaches k / n_chunks of the total,
  // leaving at least a block for each chunk after it. Nothing visible: equal chunks of blocks.
  double done = 0;
  int64_t blk = 0;
  for (int64_t k = 1; k < n_chunks; ++k) {
    const int64_t first_allowed = bounds[k - 1] / kDecodeBlockCells + 1;
    const int64_t last_allowed = blocks - (n_chunks - k);
    int64_t end = k * blocks / n_chunks;  // in blocks
    if (total > 0) {
      const double target = total * static_cast<double>(k) / static_cast<double>(n_chunks);
      while (blk < blocks && done + block_work[blk] < target) done += block_work[blk++];
      end = blk + 1;  // the block that reaches the target ends the chunk
    }
    end = std::clamp(end, first_allowed, last_allowed);
    bounds[k] = end * kDecodeBlockCells;
  }
}

namespace {

// Whether a visible piece of a block is run with the row's other short pieces of that block
// (kStrided, kGathered, or a lone short kCells step) rather than on its own.
bool IsShortPiece(int64_t s0, int64_t s1, bool v_permuted) {
  return !v_permuted && s1 - s0 < kDecodeShortSpan;
}

// A step of `kind` for row b over `count` cells from `first`, one row, no step or span yet.
DecodeStep MakeStep(DecodeStepKind kind, int64_t b, int64_t first, int64_t count) {
  DecodeStep st{};
  st.kind = kind;
  st.row = static_cast<int16_t>(b);
  st.first = static_cast<int32_t>(first);
  st.count = static_cast<int16_t>(count);
  st.n_rows = 1;
  return st;
}

}  // namespace

void BuildDecodePlan(const DecodePlanInput& in, DecodeStep* steps, int64_t* step_off) {
  constexpr int64_t kMaxB = kDecodeMaxRows;
  // Pieces per row and block run with an earlier row: a row past it runs its further pieces alone.
  constexpr int kMaxJoined = 8;
  const auto row_spans = [&](int64_t b) { return in.spans + 2 * in.span_off[b]; };
  const auto row_count = [&](int64_t b) { return in.span_off[b + 1] - in.span_off[b]; };
  // Per row, the first span not walked yet: chunks and blocks are walked in cell order.
  int64_t cursor[kMaxB] = {};
  int32_t joined[kMaxB][kMaxJoined];  // starts of the pieces row b runs with an earlier row
  int n_joined[kMaxB] = {};
  // Whether row r's spans, from its cursor on, give exactly the piece [s0, s1) in [blk0, blk1).
  const auto same_piece = [&](int64_t r, int64_t s0, int64_t s1, int64_t blk0, int64_t blk1) {
    const int32_t* sp = row_spans(r);
    const int64_t ns = row_count(r);
    for (int64_t i = cursor[r]; i < ns && sp[2 * i] < s1; ++i) {
      if (sp[2 * i + 1] <= s0) continue;  // ends before the piece
      return std::max<int64_t>(sp[2 * i], blk0) == s0 &&
             std::min<int64_t>(sp[2 * i + 1], blk1) == s1;
    }
    return false;
  };
  int64_t n = 0;
  for (int64_t k = 0; k < in.n_chunks; ++k) {
    step_off[k] = n;
    const int64_t lo = in.chunk_bounds[k];
    const int64_t hi = in.chunk_bounds[k + 1];
    for (int64_t blk0 = lo; blk0 < hi; blk0 += kDecodeBlockCells) {
      const int64_t blk1 = std::min(hi, blk0 + kDecodeBlockCells);
      if (in.combine_rows) std::fill(n_joined, n_joined + in.B, 0);
      for (int64_t b = 0; b < in.B; ++b) {
        const int64_t span0 = cursor[b];
        // The row's short pieces of this block: their first and last cell, how many cells and
        // pieces, and the distance between consecutive cells while it is the same (else 0).
        int64_t first = 0, last = 0, n_short = 0, short_spans = 0, stride = 0;
        ForEachPieceInBlock(
            row_spans(b), row_count(b), &cursor[b], blk0, blk1, [&](int64_t s0, int64_t s1) {
              if (IsShortPiece(s0, s1, in.v_permuted)) {
                for (int64_t j = s0; j < s1; ++j) {
                  if (n_short == 0) {
                    first = j;
                  } else if (n_short == 1) {
                    stride = j - first;
                  } else if (j - last != stride) {
                    stride = 0;
                  }
                  last = j;
                  ++n_short;
                }
                ++short_spans;
                return;
              }
              int64_t n_rows = 1;
              if (in.combine_rows) {
                if (std::find(joined[b], joined[b] + n_joined[b], s0) != joined[b] + n_joined[b]) {
                  return;  // run with an earlier row
                }
                while (b + n_rows < in.B && n_joined[b + n_rows] < kMaxJoined &&
                       same_piece(b + n_rows, s0, s1, blk0, blk1)) {
                  joined[b + n_rows][n_joined[b + n_rows]++] = static_cast<int32_t>(s0);
                  ++n_rows;
                }
              }
              DecodeStep& st = steps[n++];
              st = MakeStep(DecodeStepKind::kCells, b, s0, s1 - s0);
              st.n_rows = static_cast<int8_t>(n_rows);
            });
        if (short_spans == 0) continue;
        DecodeStep& st = steps[n++];
        st = MakeStep(DecodeStepKind::kCells, b, first, n_short);
        if (short_spans == 1) {
          // One contiguous piece: nothing to gain from a copy.
        } else if (stride > 1 && !in.copy_strided) {
          st.kind = DecodeStepKind::kStrided;
          st.step = static_cast<int16_t>(stride);
        } else {
          st.kind = DecodeStepKind::kGathered;
          st.span = static_cast<int32_t>(span0);
        }
      }
    }
  }
  step_off[in.n_chunks] = n;
}

void GatheredCells(const int32_t* spans, const int64_t* span_off, const DecodeStep& st,
                   int32_t* cells) {
  const int64_t blk0 = st.first / kDecodeBlockCells * kDecodeBlockCells;
  int64_t cursor = st.span, n = 0;
  // The block's end need not be clipped to the chunk's: chunks end on block boundaries or at L,
  // which no span passes.
  ForEachPieceInBlock(spans + 2 * span_off[st.row], span_off[st.row + 1] - span_off[st.row],
                      &cursor, blk0, blk0 + kDecodeBlockCells, [&](int64_t s0, int64_t s1) {
                        if (!IsShortPiece(s0, s1, false) || n >= st.count) return;
                        for (int64_t j = s0; j < s1; ++j) cells[n++] = static_cast<int32_t>(j);
                      });
}

}  // namespace kv::kernels
