// Attention over a cache's History. The kernels live in kernels/attention*; this validates.
#ifndef KVCACHE_CORE_ATTEND_H_
#define KVCACHE_CORE_ATTEND_H_

#include "core/status.h"
#include "core/types.h"

namespace kv {

struct AttentionParams {
  float scale = 0;                // 0: 1/sqrt(head_dim)
  float softcap = 0;              // 0: none; else logits = softcap * tanh(logits / softcap)
  const float* sinks = nullptr;   // optional per-query-head sink logit, added to the softmax denominator
};

// q: [head_dim, B, n_heads] f32; out: [v_head_dim, B, n_heads] f32; n_heads a multiple of kv_heads
// (GQA): query head h reads KV head h / (n_heads / kv_heads). Reads any storage dtype and either V
// layout (plain when v.ne[2] == k.ne[2], permuted when v.ne[0] == k.ne[2]); logits = scale * q.k,
// then softcap, then + mask; cells masked -inf contribute nothing; a row with no visible cell (and
// no sink) outputs 0.
Status Attend(const TensorView& q, const History& history, const AttentionParams& params, TensorView* out);

}  // namespace kv

#endif  // KVCACHE_CORE_ATTEND_H_
