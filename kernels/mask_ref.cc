// Scalar reference for kernels/mask.h, and the per-token bounds shared with the SIMD kernel.
#include <algorithm>
#include <limits>

#include "kernels/mask.h"

namespace kv::kernels {

TokenBounds ComputeTokenBounds(int32_t pos, bool causal, const MaskRules& rules) {
  int64_t lo = std::numeric_limits<int32_t>::min();
  if (rules.window != kNoWindow) {
    // Ollama: hidden when p < P - W. Inclusive: hidden when p <= P - W, i.e. p < P - W + 1.
    lo = static_cast<int64_t>(pos) - rules.window + (rules.window_inclusive ? 1 : 0);
  }
  if (rules.chunk > 0) {
    const int64_t m =
        ((static_cast<int64_t>(pos) % rules.chunk) + rules.chunk) % rules.chunk;  // floor mod
    lo = std::max(lo, static_cast<int64_t>(pos) - m);
  }
  lo = std::max<int64_t>(lo, std::numeric_limits<int32_t>::min());
  const int32_t hi = causal ? pos : std::numeric_limits<int32_t>::max();
  return TokenBounds{static_cast<int32_t>(lo), hi};
}

void BuildMaskRef(const MaskCells& cells, const MaskTokens& tokens, const MaskRules& rules,
                  DType mask_dtype, void* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < tokens.pos.size(); ++i) {
    const int32_t s = tokens.seq[i];
    const TokenBounds b = ComputeTokenBounds(tokens.pos[i], tokens.causal[i] != 0, rules);
    const uint64_t* words = cells.seq_bits + static_cast<size_t>(s / 64) * cells.seq_word_stride;
    for (int32_t j = 0; j < cells.n; ++j) {
      const bool holds = ((words[j] >> (s % 64)) & 1u) != 0;
      const bool visible = holds && cells.pos[j] >= b.lo && cells.pos[j] <= b.hi;
      const size_t o = i * static_cast<size_t>(cells.n) + static_cast<size_t>(j);
      if (mask_dtype == DType::kF16) {
        static_cast<uint16_t*>(out)[o] = visible ? 0x0000 : 0xFC00;  // f16 -inf
      } else {
        static_cast<float*>(out)[o] = visible ? 0.0f : neg_inf;
      }
    }
  }
}

}  // namespace kv::kernels
