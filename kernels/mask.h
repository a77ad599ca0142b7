// Mask kernel: for B batch tokens against n history cells, the 0 / -inf rows of SEMANTICS.md §4.
//
// A cell j is visible to token i iff
//   cell j holds token i's sequence, and lo_i <= pos[j] <= hi_i,
// where hi_i = P_i when the causal rule applies to token i (else unbounded), and lo_i is the larger
// of the window bound (P_i - W, or P_i - W + 1 with the inclusive convention) and the chunk start
// (P_i - (P_i mod C)). All bounds are computed once per token in 64-bit, so no window or position
// overflows. Out: out[i * n + j], f32 or f16 (0 or -inf).
#ifndef KVCACHE_KERNELS_MASK_H_
#define KVCACHE_KERNELS_MASK_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "layouts/dtype.h"

namespace kv::kernels {

inline constexpr int32_t kNoWindow = INT32_MAX;

// The history cells [first, first + n) of a cell table, as spans into its arrays.
struct MaskCells {
  const int32_t* pos = nullptr;  // pos[j], j < n (free cells hold any value)
  // Cell j holds sequence s iff bit s % 64 of seq_bits[(s / 64) * seq_word_stride + j] is set.
  const uint64_t* seq_bits = nullptr;
  size_t seq_word_stride = 0;
  int32_t n = 0;
};

struct MaskTokens {
  std::span<const int32_t> pos;
  std::span<const int32_t> seq;
  std::span<const uint8_t> causal;  // causal[i] != 0: the causal rule applies to token i
};

struct MaskRules {
  int32_t window = kNoWindow;     // kNoWindow: none
  bool window_inclusive = false;  // llama.cpp / HF convention: W keys, the token included
  int32_t chunk = 0;              // 0: none
};

// Preconditions: tokens' spans have equal size B; seq in range of the bit table; out holds B * n.
void BuildMask(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules,
               DType mask_dtype, void* out);
void BuildMaskRef(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules,
                  DType mask_dtype, void* out);

// The [lo, hi] position bounds of one token (shared by the kernel and its reference).
struct TokenBounds {
  int32_t lo;
  int32_t hi;
};
TokenBounds ComputeTokenBounds(int32_t pos, bool causal, const MaskRules& rules);

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_MASK_H_
