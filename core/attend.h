// Attention over a cache's History. The kernels live in kernels/attention*; this validates.
//
// Threading: Attend is reentrant. Any number of threads may call it at once, each with its own q
// and out; the History is only read and may be shared (it stays valid only while its cache is not
// changed: see core/cache.h). The one write is to the cache's mask index (History::mask_index,
// core/mask_index.h), which the first call of a pass claims atomically and fills; a call that
// arrives while it is being filled reads the mask itself. Scratch memory is per thread. A
// ThreadPool may be passed from several threads at once: its Run calls are serialized (safe, but
// one job at a time; give each decoding thread its own pool to run them side by side). A caller's
// ParallelFor must be safe to call from every thread that passes it.
//
// Memory: the kernels' per-thread scratch grows to the largest shape a thread has served and is
// kept, so steady-state decode allocates nothing. When it cannot grow, Attend returns kOutOfMemory
// (out then holds unspecified values; nothing else changes) and the next call may try again.
#ifndef KVCACHE_CORE_ATTEND_H_
#define KVCACHE_CORE_ATTEND_H_

#include "core/status.h"
#include "core/thread_pool.h"
#include "core/types.h"

namespace kv {

struct AttentionParams {
  float scale = 0;    // 0: 1/sqrt(head_dim)
  float softcap = 0;  // 0: none; else logits = softcap * tanh(logits / softcap)
  const float* sinks =
      nullptr;  // optional per-query-head sink logit, added to the softmax denominator
  // q8_0 / q4_0 decode: allows the V pass in int16 arithmetic (each softmax weight rounded to 16
  // bits within its group of 16 cells), used where the CPU has AVX512_VNNI: ~1.15x faster q8_0
  // decode at head_dim 128 (1.1-1.45x f16 instead of 1.0-1.25x). It moves the output by at most
  // 2.4e-4 * max|V| (measured 1e-5 to 8e-5 * max|V|, against ~1e-7 for f32); a model can amplify
  // that: the tests' tiny transformer's logits moved by 3e-3 to 1e-2 (q8_0). Elsewhere, and when
  // false, f32 arithmetic throughout.
  bool integer_v = false;
  // q8_0 decode: allows the K pass with each query row rounded to 16 bits instead of 24 (integer
  // products with AVX512_VNNI's vpdpbusd / vpdpwssd either way; without it, f32 arithmetic). A
  // logit then moves by at most max|q| * scale * sum|k| / 65278, ~2^-16, instead of ~2^-24
  // (kernels/attention_decode.cc): 5-13% faster q8_0 decode at 32768 cells (session 14, Zen 4).
  bool integer_k = false;
};

// q: [head_dim, B, n_heads] f32; out: [v_head_dim, B, n_heads] f32; n_heads a multiple of kv_heads
// (GQA): query head h reads KV head h / (n_heads / kv_heads). Reads any storage dtype and either V
// layout (plain when v.ne[2] == k.ne[2], permuted when v.ne[0] == k.ne[2]); logits = scale * q.k,
// then softcap, then + mask; cells masked -inf contribute nothing; a row with no visible cell (and
// no sink) outputs 0. A visible cell whose logit is NaN or +inf (inf or NaN in q or in a stored
// K) makes its (row, head) output NaN: the softmax has no finite value there, and NaN shows it.
// Stored inf / NaN in V reaches the outputs that weigh that cell, as in plain arithmetic.
//
// Accepted views (kInvalidArgument otherwise, kNotSupported for the combinations noted):
//   q   [D, B, Hq] f32, dim 0 packed; out [Dv, B, Hq] f32, dim 0 packed; other strides free.
//   k   [D, Hkv, L], rows packed along dim 0, nb[1] (head stride) and nb[2] (cell stride) free. A
//       growing/rotating cache's [D, T, H, B] view is passed per batch entry as ne = {D, H, T},
//       nb = {nb[0], head stride, token stride}, its V the same way with v_layout = kPlain.
//   v   plain [Dv, Hkv, L] like k, or permuted [L, Dv, Hkv] with cells packed (float dtypes
//       only). history.v_layout says which (every cache's Get sets it; a v that does not fit the
//       layout named is kInvalidArgument). With VLayout::kAuto the shape decides, and when it
//       fits both (L == Hkv == Dv) v is plain iff its strides equal k's: a guess, which misreads
//       a plain V with another head_dim or dtype than K's (Dv == Hkv == L) as permuted.
//       Any dtype: the kernels read K and V of one dtype directly; when they differ (an encoder
//       stores what it is given), each that is not f32 is widened exactly to an f32 copy first
//       (one more pass over it per call, in a per-thread buffer that grows to the largest shape
//       seen; kOutOfMemory if it cannot).
//   mask [L, B] f32 or f16, dim 0 packed, or data == nullptr (all visible).
//   D, Dv <= 512; a quantized K needs D, a quantized V Dv, a multiple of 32. L == 0 gives zeros.
// This overload runs on the calling thread only.
Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out);

// Splits the work with a caller-supplied parallel-for (a runtime's own pool).
Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out, const ParallelFor& parallel);

// Splits the work over `pool` (nullptr: the calling thread only).
Status Attend(const TensorView& q, const History& history, const AttentionParams& params,
              TensorView* out, ThreadPool* pool);

}  // namespace kv

#endif  // KVCACHE_CORE_ATTEND_H_
