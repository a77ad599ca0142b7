// Attention kernel: softmax(scale * Q K^T [softcap] + mask) V over a cache history, online softmax
// (flash attention) with f32 accumulators, Highway-dispatched, with a scalar double reference.
//
// Shapes (ggml order, dim 0 fastest):
//   q    [D, B, Hq]   f32, dim 0 packed (nb[0] == 4); nb[1], nb[2] any.
//   k    [D, Hkv, L]  any storage dtype, rows packed along dim 0 (nb[0] == BlockBytes); nb[1] (head
//                     stride) and nb[2] (cell stride) any. The caches' head-major blocks give a
//                     large nb[1] and a small nb[2]; a [D, T, H, B] sequence view is passed per
//                     batch entry with its dims 1 and 2 swapped (ne = {D, H, T}, nb = {.., head,
//                     token}).
//   v    plain    [Dv, Hkv, L], same rules as k;
//        permuted [L, Dv, Hkv] (cells fastest; float dtypes only): nb[0] == element size.
//   mask [L, B]       f32 or f16, element (i, j) at data + i * nb[1] + j * nb[0], nb[0] == element
//                     size; data == nullptr: every cell visible. 0 / -inf in the caches; any finite
//                     value is added to the logit, -inf hides the cell.
//   out  [Dv, B, Hq]  f32, nb[0] == 4.
// K and V share one dtype (Attend, core/attend.cc, widens a mixed pair to f32 before calling
// here). Query head h reads KV head h / (Hq / Hkv).
// Non-finite values: a visible cell with a NaN or +inf logit makes its (row, head) output NaN in
// every path (decode, its merge, prefill, the integer passes, the reference); hidden cells
// contribute nothing whatever they hold (inf / NaN included).
//
// Memory traffic (bytes of K+V read per call; R = bytes of one K plus one V row in the storage
// dtype, visible(b) = cells visible to batch row b):
//   decode (B small): every KV head walks its own K and V streams front to back once per block of
//     128 cells, and inside the block serves every batch row and all Hq/Hkv query heads of its
//     group from L1. Traffic = Hkv * R * |union over b of visible(b)|: one pass, independent of the
//     GQA ratio and of B. Masked runs are skipped by range (spans found once per batch row), so
//     hidden cells cost no traffic. Consecutive rows that see the same piece of a block run it
//     together, their query heads in groups of up to 8 (a shared prompt, or several tokens of
//     one sequence: one pass over the piece's rows per group instead of per row and group). The
//     history is split into chunks across threads (flash decoding; KV heads are split too only when
//     the chunks are too few), their boundaries placed by the rows' work (BalanceDecodeChunks,
//     kernels/decode_plan.h: cells many rows see make shorter chunks); each task writes (m, l,
//     acc) partials that one merge pass combines:
//     Hkv * chunks * B * G * (Dv + 2) floats, small next to the history.
//   prefill (B large): tasks are (KV head, tile of Bt = clamp(128 / G, 1, 64) batch rows); each
//     tile of 64 cells (128 below AVX-512) is converted to f32 once (K transposed, V as rows)
//     and reused by the Bt * G (~128) query rows of the task from L1/L2.
//     Traffic = Hkv * R * L_box * ceil(B / Bt) from the cache hierarchy (L_box: the cells inside
//     the tile's visible box; tiles outside it are skipped), plus Q and out once. FLOPs =
//     4 * B * Hq * D * L_box, so per byte of K/V streamed the kernel does ~Bt * G * 4 * D / R
//     flops: ~128 for f16 at D 128 (R = 512), compute-bound by a wide margin.
//   Mode (kAuto): decode for B < 8; from 8 rows on with a mask, whichever computes fewer (row,
//     cell) pairs, decided from the mask's scan: prefill computes every row of a task over every
//     tile any of them sees, so rows of different sequences (batched decode) run as decode (3-5x
//     faster than prefill for 8-16 sequences, session 29) and rows of one sequence (a prompt
//     chunk, draft tokens) as prefill; with no mask, prefill. Above kDecodeMaxRows (64) rows, the
//     decode plan's limit, the choice is made per group of at most 64 consecutive rows (as equal
//     as can be), and consecutive groups that chose prefill run as one prefill call; kDecode
//     above 64 rows runs its groups as decode.
// Quantized K/V are dequantized in registers (decode) or into the f32 tile (prefill); no f32 copy
// of the history is ever made.
//
// Error bound: logits are f32 dot products of the (exactly dequantized) K elements with Q
// pre-scaled by `scale` (relative error ~ D * 2^-24 * sum|q k| / |q.k|; q8_0 decode on AVX3_DL:
// integer products with the query rounded to 24 bits, at most max|q| * scale * sum|k| / 16711422
// more, the same scale), exp is within 1 ULP
// (SoftmaxExp, kernels/attention_load-inl.h; weights below e^-87 are clamped there), the running
// max rescaling adds ~2^-23 relative per rescale, and V accumulates in f32. Against a double
// reference over the same stored (rounded) K/V the output error is a few times 1e-6 * max|V| for
// moderate L; the dtype only matters through the stored values, which the reference sees too.
//
// Measured (perf/bench_attention on the 2-vCPU Zen 4 EPYC VM, one 512-bit FMA per cycle, shared
// with other jobs; compared variants alternate in one run): f16 decode at 32768 cells reaches
// 0.59-0.65 of the 1-thread read bandwidth (bound by arithmetic there) and 0.9-1.0 of the 2-thread
// one; q8_0 is 0.95-1.22x as fast per call as f16 (its f32 V pass does f16's FMAs plus its code
// conversions), 1.06-1.42x with integer_k. Prefill, 512 x 4096 at head_dim 128, runs at ~0.77 of
// the FMA peak measured in the same run (0.75 on the AVX2 target of a Zen 3, session 22). The
// dispatched AVX-512 decode is ~1.4x the same code pinned to AVX2. On the Emerald Rapids Xeon of
// sessions 23-30 (two 512-bit FMA ports, ~11 GB/s read per core) f16 decode from memory reads
// 0.94-1.11 of the read bandwidth on 1 and 2 threads, q8_0 is 1.33-1.86x as fast per call as f16
// (with QuantVScaling::kWeights; head_dim 64 on 2 threads is the low end), and prefill runs at
// 0.54-0.72 of the FMA peak. The README's Known gaps has the targets by machine, its Performance
// section the current tables, perf/HISTORY.md every run.
//
// Masked cells are never read in decode. Prefill reads whole tiles: a hidden cell's logit is
// replaced by -inf whatever its K gives, and a V tile that holds inf or NaN is accumulated
// skipping each row's hidden cells (their weight 0 times inf would be NaN); other tiles take the
// register-blocked path. The scan for non-finite values is one FMA per V vector of the tile
// (Dv / 16 per cell on AVX-512), against (D + Dv) / 16 per cell and query row for the tile's
// products: ~0.4% of them with a task's 128 query rows (128 / G batch rows of G heads each).
//
// Scratch: each thread that runs tasks keeps one thread_local buffer, grown to the largest shape it
// has seen; the calling thread also keeps the span lists, the decode partials and, when several
// chunks of cells walk each KV head, every head's prepared query rows. After the first call
// with a given shape and thread count no call allocates. The span list and the decode plan are
// sized for the worst mask, about 5 bytes per row and cell of history (at most 64 rows: larger
// calls reuse them group by group); a kAuto call of 8 rows or more with a mask reserves them even
// when it then runs prefill, since it chooses after the scan (64 rows over 131072 cells: ~41 MiB
// on the calling thread).
#ifndef KVCACHE_KERNELS_ATTENTION_H_
#define KVCACHE_KERNELS_ATTENTION_H_

#include <cstdint>

#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

namespace kv::kernels {

inline constexpr int64_t kAttentionMaxHeadDim = 512;

enum class AttentionMode : uint8_t { kAuto, kDecode, kPrefill };

// Where decode's software prefetches put the K/V lines they ask for ahead of use.
enum class PrefetchLevel : uint8_t {
  kAuto,  // by CPU (ResolvePrefetchLevel): kL2 on AMD family 19h (Zen 3 / Zen 4), else kL1
  kL1,    // prefetcht0: into L1 (and L2)
  kL2,    // prefetcht2: into L2 only; the loads bring the lines into L1
};

// How decode's f32 V pass over quantized plain V (q8_0, q4_0) applies the block scales. Both give
// the reference's sums within the f32 pass's rounding (attention_decode.cc derives the difference).
enum class QuantVScaling : uint8_t {
  kAuto,     // by CPU (ResolveQuantVScaling): kWeights on Intel, kCodes elsewhere
  kCodes,    // each row's codes times their block's scale, once per row (shared by the heads)
  kWeights,  // each softmax weight times its cell's block scale; the codes FMAed unscaled. AVX-512
             // only (narrower targets run kCodes)
};

struct AttentionKernelParams {
  float scale = 0;               // already resolved by the caller (never 0 here unless intended)
  float softcap = 0;             // 0: none
  const float* sinks = nullptr;  // [Hq] or null
  bool v_permuted = false;
  AttentionMode mode = AttentionMode::kAuto;  // kAuto: see Mode above
  // Decode over q8_0 / q4_0 plain V: the V pass in int16 arithmetic (softmax weights rounded to
  // 16 bits per group of 16 cells; output error <= 2.4e-4 * max|V|, derivation in
  // attention_decode.cc) where the CPU has AVX512_VNNI (Highway's AVX3_DL target); elsewhere the
  // f32 pass runs.
  bool integer_v = false;
  // Decode over q8_0 K: the integer K pass with the query rounded to 16 bits per row instead of 24
  // (a logit moves by at most max|q| * scale * sum|k| / 65278, ~2^-16; derivation in
  // attention_decode.cc) where the CPU has AVX512_VNNI; elsewhere the f32 pass runs.
  bool integer_k = false;
  // Decode over q8_0 K without integer_k: the f32 K pass even where the CPU has AVX512_VNNI. By
  // default such CPUs run an integer K pass with the query rounded to 24 bits (a logit moves by at
  // most max|q| * scale * sum|k| / 16711422, ~2^-24, the f32 pass's own rounding scale;
  // attention_decode.cc); tests and benchmarks set this to compare the two.
  bool float_k = false;
  // Decode: one-cell spans that fall every k-th cell (k > 1: batched decode, each sequence's new
  // tokens taking turns in consecutive cells) are read in place through a strided view; with
  // this set they are copied together first like any other short spans (DecodeGathered), which was
  // the only way before session 20. Same cells, same order, same results; tests and benchmarks set
  // it to compare the two.
  bool copy_strided_spans = false;
  // Decode: batch rows that see the same cells of a block run them together (their query heads in
  // one group of up to 8); with this set each row walks its cells alone, as before session 24.
  // Same cells, other groupings, so results differ in rounding only; tests and benchmarks set it
  // to compare the two.
  bool rows_alone = false;
  // kAuto unless a benchmark compares the two (perf/bench_attention.cc).
  PrefetchLevel prefetch = PrefetchLevel::kAuto;
  // kAuto unless a test or benchmark compares the two.
  QuantVScaling quant_v_scaling = QuantVScaling::kAuto;
  // The mask's rows as MaskBits (below) wrote them, row b at mask_bits + b * MaskBitsRowWords(L);
  // null: the call finds the visible cells by reading every mask element. With them the call reads
  // the mask only where prefill computes a tile that is partly hidden or holds values other than
  // +-0. The layers of a forward pass share one mask: core/mask_index.h computes these once per
  // pass, so that each layer does not read the whole mask again (4 bytes per row and cell).
  const uint64_t* mask_bits = nullptr;
};

// kAuto resolved for this CPU (cpuid, read once); kL1 / kL2 as given. On the Zen 4 EPYC of
// session 14, decode at 32768 cells ran 7-25% faster with kL2 (f16 and q8_0, head_dim 64 / 128,
// 1 and 2 threads; in cache the same): prefetcht0 requests stalled on L1's miss buffers. The Zen 5
// EPYC of sessions 10-13 was measured with kL1 throughout (its L1 prefetches kept up).
PrefetchLevel ResolvePrefetchLevel(PrefetchLevel requested);

// kAuto resolved for this CPU (cpuid vendor, read once); kCodes / kWeights as given. On the Intel
// Xeon of session 23 (512-bit arithmetic on two ports), kWeights made q8_0 decode 1.13-1.14x
// faster per call in cache and 0.94-1.09x from memory (where q8_0 nears the memory's pace too); on
// the Zen 4 EPYC of session 15 it was 2-7% slower (perf/HISTORY.md). bench_attention's
// BM_DecodeQuantVScaling measures both.
QuantVScaling ResolveQuantVScaling(QuantVScaling requested);

// The opt-in decode variants that the target Highway dispatches to now implements. Where one is
// missing, the parameters that ask for it run the default code, bit for bit: the integer K passes
// (integer_k, and the 24-bit pass that float_k turns off) and integer_v need AVX512_VNNI (Highway's
// AVX3_DL target); QuantVScaling::kWeights needs AVX-512. Tests use it to skip repeats that would
// run the same code (the attention tests under the sanitizers ran q8_0 decode 7 times per case on
// every target, where only AVX3_DL has 7 different paths).
struct DecodeVariants {
  bool integer_k = false;       // integer_k, float_k and the 24-bit integer K pass
  bool integer_v = false;       // integer_v
  bool scaled_weights = false;  // QuantVScaling::kWeights
};
DecodeVariants DispatchedDecodeVariants();

// A parallel-for: run must call task(ctx, i) exactly once for every i in [0, n), from any threads,
// and return when all calls have returned. Tasks write disjoint memory. run == nullptr: run inline.
struct ParallelForFn {
  void (*run)(void* user, int64_t n, void (*task)(void* ctx, int64_t i), void* ctx) = nullptr;
  void* user = nullptr;
  int num_threads = 1;  // how many threads run may use at once: sizes the decode split
};

// Words per mask row of MaskBits' output for a history of L cells: the row's hidden cells (bit j
// of word j / 64 set where element j is -inf), then its nonzero values (set where element j is not
// +-0: NaN, inf and finite values other than zero). Bits from L on are clear.
inline constexpr int64_t MaskBitsRowWords(int64_t L) { return 2 * ((L + 63) / 64); }

// Every row of `mask` ([L, B], f32 or f16, elements packed: Attention's contract) as bitmaps, row b
// at bits + b * MaskBitsRowWords(L), for AttentionKernelParams::mask_bits. Reads the mask once
// (4 or 2 bytes per element) and writes 1/16 (f32) of it; the rows are split over pf's threads,
// at least 16 per task.
void MaskBits(const TensorView& mask, const ParallelForFn& pf, uint64_t* bits);

// Preconditions (checked by core/attend.cc): shapes as above, D <= kAttentionMaxHeadDim, quantized
// D and Dv multiples of 32, Hq % Hkv == 0, K and V of one dtype, permuted V not quantized.
// Returns false when a per-thread scratch buffer could not grow (the heap is exhausted): the call
// stops early and *out holds unspecified values. Scratch only grows, so a caller that has run the
// largest shape once on each thread (a reserve pass) never sees this.
[[nodiscard]] bool Attention(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& mask, const AttentionKernelParams& params,
                             const ParallelForFn& pf, TensorView* out);

// Scalar reference in double precision (single-threaded, no tiling). Same contract.
void AttentionRef(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& mask, const AttentionKernelParams& params, TensorView* out);

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_ATTENTION_H_
