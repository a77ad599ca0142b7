// Attention kernel and Attend: every compiled Highway target against the scalar double reference.
//
// Tolerances. The reference (kernels/attention_ref.cc) reads the same stored K/V and dequantizes
// them exactly as the kernel does (f16/bf16 -> f32 is exact; q8_0/q4_0 are d * code in f32, the
// same single rounding in both), then computes in double. So the error under test is the kernel's
// f32 arithmetic alone, and the bound is the same formula for every dtype:
//   f32, f16, bf16: inputs exact in f32;       q8_0, q4_0: d * code computed identically.
//   logit error ~ sqrt(D) * 2^-24 * S, S = scale * sum_d |q_d k_d| (f32 dot products with random
//   rounding; the worst case D * 2^-24 * S never shows), exp adds 1 ULP, the running-max rescales
//   ~2^-23 each, the V sum ~sqrt(L_vis) * 2^-24 relative.
// The output is a convex combination of V rows (|V| <= 1), so |out - ref| <= 2 * dlogit + 2e-6
// with dlogit = 4 * sqrt(D) * 2^-24 * S_max (S_max measured per case: it grows with the extreme-
// logit cases' q). The quantized dtypes get the same bound because their stored values are what
// both sides read; only S_max differs. Measured: worst error / tol below 0.1 on every target.
// Every target the kernels compile, AVX3_DL included (kernels/highway_targets.h).
#include "kernels/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/thread_pool.h"
#include "gtest/gtest.h"
#include "hwy/aligned_allocator.h"
#include "hwy/tests/hwy_gtest.h"
#include "kernels/attention_internal.h"
#include "kernels/decode_plan.h"
#include "kernels/highway_targets.h"
#include "kernels/mask.h"
#include "layouts/kv_layout.h"
#include "layouts/quant.h"
#include "malloc_hooks.h"

namespace kv {
namespace {

// Heap allocations made (by any thread) while fn runs, counted by tests/malloc_hooks.h: every
// malloc, operator new and aligned allocation, Highway's included. Callers check
// heap_hooks::MallocHooked() first: without the hooks nothing is counted.
template <class Fn>
int64_t AllocationsDuring(Fn&& fn) {
  heap_hooks::g_allocations = 0;
  heap_hooks::g_counting = true;
  fn();
  heap_hooks::g_counting = false;
  return heap_hooks::g_allocations.load();
}

using kernels::AttentionMode;

constexpr float kInf = std::numeric_limits<float>::infinity();

// A history laid out like the caches lay it out: head-major K and V blocks, plain or permuted V.
struct TestHistory {
  CellBlockLayout kl, vl;
  hwy::AlignedFreeUniquePtr<uint8_t[]> kbuf, vbuf;
  std::vector<float> kf, vf;  // the f32 sources (before storage rounding), [h][j][d]
  TensorView k, v;
};

// Uniform floats in [-1, 1) from a SplitMix64 stream seeded by two draws of rng: the bulk of the
// test data (K, V, Q). std::uniform_real_distribution over mt19937 took ~16% of attention_test's
// time (release; these tests run on every target, under the sanitizers too).
void FillUniform(std::mt19937& rng, std::vector<float>& out) {
  uint64_t state = (uint64_t{rng()} << 32) | rng();
  for (float& x : out) {
    uint64_t z = (state += 0x9E3779B97F4A7C15u);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    z ^= z >> 31;
    x = -1.0f + static_cast<float>(z >> 40) * 0x1p-23f;  // exact: 24 random bits
  }
}

TestHistory MakeHistory(DType dt, int D, int Dv, int Hkv, int L, bool perm, std::mt19937& rng,
                        float kscale = 1.0f) {
  TestHistory h;
  h.kl = MakeCellBlockLayout(dt, D, Hkv, std::max(L, 1), false);
  h.vl = MakeCellBlockLayout(dt, Dv, Hkv, std::max(L, 1), perm);
  h.kbuf = hwy::AllocateAligned<uint8_t>(h.kl.bytes);
  h.vbuf = hwy::AllocateAligned<uint8_t>(h.vl.bytes);
  std::memset(h.kbuf.get(), 0, h.kl.bytes);
  std::memset(h.vbuf.get(), 0, h.vl.bytes);
  h.kf.resize(static_cast<size_t>(Hkv) * L * D);
  h.vf.resize(static_cast<size_t>(Hkv) * L * Dv);
  FillUniform(rng, h.kf);
  for (float& x : h.kf) x *= kscale;
  FillUniform(rng, h.vf);
  for (int hh = 0; hh < Hkv; ++hh) {
    for (int j = 0; j < L; ++j) {
      StoreRowFromF32(&h.kf[(static_cast<size_t>(hh) * L + j) * D], D, dt,
                      h.kbuf.get() + CellRowOffset(h.kl, j, hh));
      const float* vs = &h.vf[(static_cast<size_t>(hh) * L + j) * Dv];
      if (perm) {
        for (int d = 0; d < Dv; ++d)
          StoreFromF32(h.vbuf.get() + CellsFastestOffset(h.vl, j, hh, d), dt, 0, vs[d]);
      } else {
        StoreRowFromF32(vs, Dv, dt, h.vbuf.get() + CellRowOffset(h.vl, j, hh));
      }
    }
  }
  h.k = CellBlockView(h.kl, h.kbuf.get(), 0, L);
  h.v = CellBlockView(h.vl, h.vbuf.get(), 0, L);
  return h;
}

// The scalar reference of attn::ForEachClearRun: emit(s0, s1) for each maximal run [s0, s1) of
// cells j in [0, L) where masked(j) is false, one cell at a time.
template <class Masked, class Emit>
void ForEachVisibleSpan(int64_t L, const Masked& masked, const Emit& emit) {
  int64_t j = 0;
  while (j < L) {
    while (j < L && masked(j)) ++j;
    if (j == L) break;
    const int64_t s0 = j;
    while (j < L && !masked(j)) ++j;
    emit(s0, j);
  }
}

// Mask scenarios built by the mask kernel's reference from a cell table, as the caches do.
enum class MaskKind {
  kNone,
  kCausal,
  kMultiSeq,
  kWindow,
  kChunk,
  kEmptyRow,
  kInterleavedBias,
  kSequenceRuns,
  kSparseBias
};

const char* MaskName(MaskKind m) {
  switch (m) {
    case MaskKind::kNone:
      return "none";
    case MaskKind::kCausal:
      return "causal";
    case MaskKind::kMultiSeq:
      return "multiseq";
    case MaskKind::kWindow:
      return "window";
    case MaskKind::kChunk:
      return "chunk";
    case MaskKind::kEmptyRow:
      return "emptyrow";
    case MaskKind::kInterleavedBias:
      return "interleavedbias";
    case MaskKind::kSequenceRuns:
      return "sequenceruns";
    case MaskKind::kSparseBias:
      return "sparsebias";
  }
  return "?";
}

// Returns mask storage ([L, B], f32 or f16); empty for kNone.
// kInterleavedBias: four sequences as a batched decode leaves them: a shared prompt in the first
// third, each sequence's own run of cells, then their decode tokens in interleaved cells (row b
// sees those of sequence b % 4); visible cells carry finite biases instead of 0, distinct from
// cell to cell and from row to row, so that a kernel which pairs a cell with another cell's or
// another row's mask value is caught (decode runs rows that see the same cells together).
std::vector<uint8_t> BuildInterleavedBiasMask(int L, int B, DType mdt) {
  std::vector<uint8_t> out(static_cast<size_t>(L) * B * BlockBytes(mdt));
  const int prompt = L / 3, own = L / 3;
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < L; ++j) {
      const int s = b % 4;
      bool visible = j < prompt;
      if (j >= prompt && j < prompt + own) visible = (j - prompt) * 4 / own == s;
      if (j >= prompt + own) visible = (j - prompt - own) % 4 == s;
      const float m = visible ? -0.05f * static_cast<float>((j + 5 * b) % 11) : -kInf;
      StoreFromF32(out.data(), mdt, static_cast<size_t>(b) * L + j, m);
    }
  }
  return out;
}

// kSequenceRuns: three sequences in runs of 37 cells (not aligned to any tile or granule), the
// batch's rows in three equal blocks, one per sequence, each row seeing its sequence's cells up to
// its position (causal); visible cells carry finite biases, distinct per cell and row. A prefill
// task whose query tile holds one block sees only every third run: it must skip the others and no
// more.
std::vector<uint8_t> BuildSequenceRunsMask(int L, int B, DType mdt) {
  constexpr int kSeqs = 3, kRun = 37;
  std::vector<int32_t> pos(L), total(kSeqs, 0);
  for (int j = 0; j < L; ++j) pos[j] = total[(j / kRun) % kSeqs]++;
  std::vector<uint8_t> out(static_cast<size_t>(L) * B * BlockBytes(mdt));
  const int per_block = (B + kSeqs - 1) / kSeqs;
  for (int b = 0; b < B; ++b) {
    const int s = b / per_block;
    const int after = std::min(B, (s + 1) * per_block) - 1 - b;  // later rows of the block
    const int32_t p = total[s] - 1 - after;
    for (int j = 0; j < L; ++j) {
      const bool visible = (j / kRun) % kSeqs == s && pos[j] <= p;
      const float m = visible ? -0.05f * static_cast<float>((j + 5 * b) % 11) : -kInf;
      StoreFromF32(out.data(), mdt, static_cast<size_t>(b) * L + j, m);
    }
  }
  return out;
}

// kSparseBias: one sequence, each row causal up to its position (the batch the newest B cells) and
// blind to the first 3 + b % 5 cells (so tiles start off the 16-cell granules); visible cells carry
// 0 except a few: a finite bias every 53rd cell (row-dependent), -0 every 29th. Prefill reads the
// mask only in tiles that are not wholly of +-0 values (plain granules): a tile with one biased
// cell, anywhere in it, must still add it.
std::vector<uint8_t> BuildSparseBiasMask(int L, int B, DType mdt) {
  std::vector<uint8_t> out(static_cast<size_t>(L) * B * BlockBytes(mdt));
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < L; ++j) {
      const bool visible = j >= 3 + b % 5 && j <= L - B + b;
      float m = -kInf;
      if (visible) {
        m = 0.0f;
        if (j % 29 == 0) m = -0.0f;
        if (j % 53 == b % 7) m = -0.7f - 0.1f * static_cast<float>(b % 3);
      }
      StoreFromF32(out.data(), mdt, static_cast<size_t>(b) * L + j, m);
    }
  }
  return out;
}

std::vector<uint8_t> BuildTestMask(MaskKind kind, int L, int B, DType mdt, std::mt19937& rng) {
  if (kind == MaskKind::kNone) return {};
  if (kind == MaskKind::kInterleavedBias) return BuildInterleavedBiasMask(L, B, mdt);
  if (kind == MaskKind::kSequenceRuns) return BuildSequenceRunsMask(L, B, mdt);
  if (kind == MaskKind::kSparseBias) return BuildSparseBiasMask(L, B, mdt);
  std::vector<int32_t> pos(L);
  std::vector<uint64_t> bits(L);
  kernels::MaskRules rules;
  const int nseq = kind == MaskKind::kMultiSeq || kind == MaskKind::kEmptyRow ? 3 : 1;
  std::vector<int32_t> next(nseq, 0);
  for (int j = 0; j < L; ++j) {
    // Multi-sequence: runs of cells per sequence, some free (padding) cells in between.
    int s = 0;
    if (nseq > 1) s = static_cast<int>((j / 5 + (j % 7 == 0 ? 1 : 0)) % (nseq + 1));
    if (s == nseq) {  // a free / padding cell: no sequence
      bits[j] = 0;
      pos[j] = -1;
      continue;
    }
    bits[j] = uint64_t{1} << s;
    pos[j] = next[s]++;
  }
  if (kind == MaskKind::kWindow) rules.window = std::max(3, L / 5);
  if (kind == MaskKind::kChunk) rules.chunk = std::max(4, L / 3);
  std::vector<int32_t> tpos(B), tseq(B);
  std::vector<uint8_t> causal(B, 1);
  for (int i = 0; i < B; ++i) {
    const int s = nseq > 1 ? i % nseq : 0;
    tseq[i] = s;
    // The batch's tokens are the newest positions of their sequence (plus one beyond, as a
    // decode token sees its own freshly stored cell).
    const int32_t have = next[s];
    tpos[i] = std::max<int32_t>(0, have - 1 - static_cast<int32_t>(rng() % 3) - (B - 1 - i) / nseq);
  }
  if (kind == MaskKind::kEmptyRow) tseq[0] = 5;  // a sequence with no cells: fully masked row
  kernels::MaskCells cells;
  cells.pos = pos.data();
  cells.seq_bits = bits.data();
  cells.seq_word_stride = static_cast<size_t>(L);
  cells.n = L;
  kernels::MaskTokens toks{tpos, tseq, causal};
  std::vector<uint8_t> out(static_cast<size_t>(L) * B * BlockBytes(mdt));
  kernels::BuildMaskRef(cells, toks, rules, mdt, out.data());
  return out;
}

struct Case {
  DType dt = DType::kF32;
  bool perm = false;
  int D = 64, Dv = 64, Hkv = 2, G = 1, B = 1, L = 40;
  MaskKind mask = MaskKind::kCausal;
  DType mask_dt = DType::kF32;
  float softcap = 0;
  bool sinks = false;
  float qscale = 1.0f;  // large values give extreme logits
};

std::string Describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "%s %s D=%d Dv=%d Hkv=%d G=%d B=%d L=%d mask=%s/%s cap=%g sinks=%d qs=%g",
                DTypeName(c.dt), c.perm ? "permV" : "plainV", c.D, c.Dv, c.Hkv, c.G, c.B, c.L,
                MaskName(c.mask), DTypeName(c.mask_dt), c.softcap, c.sinks, c.qscale);
  return buf;
}

// The best target of this CPU, read before any test narrows SupportedTargets (static
// initialization runs before main).
const int64_t g_best_target = kernels::DispatchedTarget();

// The target the dispatcher picks now.
int64_t TargetBitNow() { return kernels::DispatchedTarget(); }

// Whether the dispatcher picks g_best_target now.
bool OnBestTarget() { return TargetBitNow() == g_best_target; }

std::string TargetNow() { return hwy::TargetName(TargetBitNow()); }

// The kernel's parallel-for over `pool`'s threads; nullptr: run inline (one thread).
kernels::ParallelForFn KernelParallelFor(ThreadPool* pool) {
  kernels::ParallelForFn pf;
  if (pool != nullptr) {
    const ParallelFor p = pool->AsParallelFor();
    pf = {p.run, p.user, p.num_threads};
  }
  return pf;
}

// Runs the kernel in the given mode and thread count and compares with the reference.
struct Run {
  AttentionMode mode;
  ThreadPool* pool;
  bool integer_v = false;
  bool integer_k = false;
  bool float_k = false;
  kernels::QuantVScaling quant_v_scaling = kernels::QuantVScaling::kAuto;
};

// Integer V pass (AttentionKernelParams::integer_v, AVX3_DL only; other targets run the f32 pass):
// each weight is rounded to 16 bits against a bound on its group of 16 cells, which moves the
// output by at most 16 * 2^-16 * max|V| (kernels/attention_decode.cc); CheckCase adds this to the
// f32 bound for those runs.
constexpr double kIntegerVTol = 16.0 / 65536.0;

// Integer K pass (AttentionKernelParams::integer_k, q8_0, AVX3_DL only): each pre-scaled query
// element is off by at most max|q| * scale / 65278 (rounded to integers of at most 32639 in
// magnitude, see kQueryIntMax), so a logit moves by at most
// delta = max|q| * scale / 65278 * max_j sum_i |k_ji|, and every softmax weight by a
// factor within e^(+-2 delta): the output by at most (e^(2 delta) - 1) * max|V|. CheckCase adds
// that (computed from the case's stored K) for those runs. Without integer_k, q8_0 decode on
// AVX3_DL rounds the query to 24 bits instead (same form, 16711422 for 65278); CheckCase adds that
// bound to every q8_0 decode run without integer_k, and repeats each with float_k (the f32 pass).

// One case, one reference, several kernel runs (modes x thread counts).
void CheckCase(const Case& c, std::initializer_list<Run> given) {
  // Every decode run over quantized plain V is repeated with the integer V pass and with each
  // way of applying the block scales in the f32 V pass (kAuto is one of them), and over q8_0
  // with the integer K pass, alone and with integer V, and with the f32 K pass: each where the
  // target implements it (elsewhere the flag runs the default code, bit for bit:
  // DecodeVariantsFollowTheTarget and the tests of each variant check that).
  const kernels::DecodeVariants variants = kernels::DispatchedDecodeVariants();
  std::vector<Run> runs(given);
  // kAuto may run decode at any B (from 8 rows on it picks per call or per group of rows: see
  // AutoModeDecodesSequencesAndPrefillsSharedRows and AutoModeGroupsRowsBeyondTheDecodeLimit); its
  // runs get decode's extra runs and bounds.
  const auto may_decode = [&](AttentionMode mode) {
    return mode == AttentionMode::kDecode || mode == AttentionMode::kAuto;
  };
  for (const Run& r : given) {
    const bool decode = may_decode(r.mode);
    if (decode && IsQuantized(c.dt) && !c.perm) {
      if (variants.integer_v) runs.push_back({r.mode, r.pool, true});
      if (variants.scaled_weights) {
        for (auto scaling : {kernels::QuantVScaling::kCodes, kernels::QuantVScaling::kWeights})
          runs.push_back({r.mode, r.pool, false, false, false, scaling});
      }
    }
    if (decode && c.dt == DType::kQ8_0 && variants.integer_k) {
      runs.push_back({r.mode, r.pool, false, true});
      runs.push_back({r.mode, r.pool, true, true});
      runs.push_back({r.mode, r.pool, false, false, true});
    }
  }
  SCOPED_TRACE(Describe(c) + " target=" + TargetNow());
  std::mt19937 rng(1234u + static_cast<uint32_t>(c.D * 7 + c.L * 13 + c.B * 31 + c.G));
  TestHistory h = MakeHistory(c.dt, c.D, c.Dv, c.Hkv, c.L, c.perm, rng);
  const int Hq = c.Hkv * c.G;
  std::vector<float> q(static_cast<size_t>(c.D) * c.B * Hq);
  FillUniform(rng, q);
  for (float& x : q) x *= c.qscale;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> sinks(Hq);
  for (float& s : sinks) s = u(rng) * 2.0f;
  std::vector<uint8_t> mask = BuildTestMask(c.mask, c.L, c.B, c.mask_dt, rng);
  TensorView qv = MakeView(q.data(), DType::kF32, {c.D, c.B, Hq});
  TensorView mv;
  if (!mask.empty()) mv = MakeView(mask.data(), c.mask_dt, {c.L, c.B});
  std::vector<float> out(static_cast<size_t>(c.Dv) * c.B * Hq, 12345.0f), ref(out.size(), -1.0f);
  TensorView ov = MakeView(out.data(), DType::kF32, {c.Dv, c.B, Hq});
  TensorView rv = MakeView(ref.data(), DType::kF32, {c.Dv, c.B, Hq});
  kernels::AttentionKernelParams kp;
  kp.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  kp.softcap = c.softcap;
  kp.sinks = c.sinks ? sinks.data() : nullptr;
  kp.v_permuted = c.perm;
  kernels::AttentionRef(qv, h.k, h.v, mv, kp, &rv);

  // S_max: the logits' condition (scale * sum |q k|) over the stored K.
  std::vector<float> krow(c.D);
  double smax = 0;
  for (int hq = 0; hq < Hq; ++hq) {
    const int hh = hq / c.G;
    for (int j = 0; j < c.L; j += std::max(1, c.L / 64)) {
      LoadRowAsF32(RowPtr(h.k, hh, j), c.D, c.dt, krow.data());
      for (int b = 0; b < c.B; b += std::max(1, c.B / 8)) {
        double s = 0;
        for (int d = 0; d < c.D; ++d)
          s += std::fabs(q[(static_cast<size_t>(hq) * c.B + b) * c.D + d] * krow[d]);
        smax = std::max(smax, s * kp.scale);
      }
    }
  }
  const double dlogit = 4.0 * std::sqrt(static_cast<double>(c.D)) * std::ldexp(1.0, -24) * smax;
  // The integer K pass's bound (above), over every row of every head.
  double qmax = 0, ksum_max = 0;
  for (float x : q) qmax = std::max(qmax, std::fabs(static_cast<double>(x)) * kp.scale);
  for (int hh = 0; hh < c.Hkv; ++hh) {
    for (int j = 0; j < c.L; ++j) {
      LoadRowAsF32(RowPtr(h.k, hh, j), c.D, c.dt, krow.data());
      double ks = 0;
      for (int d = 0; d < c.D; ++d) ks += std::fabs(krow[d]);
      ksum_max = std::max(ksum_max, ks);
    }
  }
  const double int_k_tol = std::expm1(2.0 * qmax / 65278.0 * ksum_max);
  const double int_k24_tol = std::expm1(2.0 * qmax / 16711422.0 * ksum_max);
  const double tol = 1.0 * (2.0 * dlogit + 2e-6);  // max|V| <= 1
  // The mask's row bitmaps, as a cache's MaskIndex hands them to every layer: each run the case
  // names (mode, threads) is repeated with them and must give the same bits. Only where the scan
  // reads the rows changes, so the runs added above (integer passes, scalings) are not repeated,
  // and only on the best target: the scan is plain C++ outside the per-target code (the bitmaps
  // themselves are checked on every target by MaskBitsAreEachRowsMaskRowBits). Repeating them
  // everywhere made the sanitizer suite ~6 minutes slower.
  std::vector<uint64_t> mask_bits;
  if (!mask.empty() && OnBestTarget()) {
    mask_bits.assign(static_cast<size_t>(c.B * kernels::MaskBitsRowWords(c.L)), ~uint64_t{0});
    kernels::MaskBits(mv, kernels::ParallelForFn{}, mask_bits.data());
  }
  for (size_t run_index = 0; run_index < runs.size(); ++run_index) {
    const Run& run = runs[run_index];
    SCOPED_TRACE("mode=" + std::to_string(static_cast<int>(run.mode)) +
                 " threads=" + std::to_string(run.pool ? run.pool->NumThreads() : 1) +
                 " integer_v=" + std::to_string(run.integer_v) + " integer_k=" +
                 std::to_string(run.integer_k) + " float_k=" + std::to_string(run.float_k) +
                 " quant_v_scaling=" + std::to_string(static_cast<int>(run.quant_v_scaling)));
    const bool decode = may_decode(run.mode);
    const bool k24 = decode && c.dt == DType::kQ8_0 && !run.integer_k && !run.float_k;
    const double run_tol = tol + (run.integer_v ? kIntegerVTol : 0.0) +
                           (run.integer_k ? int_k_tol : 0.0) + (k24 ? int_k24_tol : 0.0);
    const kernels::ParallelForFn pf = KernelParallelFor(run.pool);
    kp.mode = run.mode;
    kp.integer_v = run.integer_v;
    kp.integer_k = run.integer_k;
    kp.float_k = run.float_k;
    kp.quant_v_scaling = run.quant_v_scaling;
    std::fill(out.begin(), out.end(), 12345.0f);
    EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, pf, &ov));
    double maxerr = 0;
    for (size_t i = 0; i < out.size(); ++i)
      maxerr = std::max(maxerr, static_cast<double>(std::fabs(out[i] - ref[i])));
    if (std::getenv("ATTN_TEST_VERBOSE"))
      std::printf("%s int_v=%d int_k=%d err=%.3g tol=%.3g ratio=%.3f\n", Describe(c).c_str(),
                  run.integer_v, run.integer_k, maxerr, run_tol, maxerr / run_tol);
    int bad = 0;
    for (size_t i = 0; i < out.size() && bad < 5; ++i) {
      if (!(std::fabs(out[i] - ref[i]) <= run_tol)) {
        ++bad;
        ADD_FAILURE() << "i=" << i << " (d=" << i % c.Dv << " b=" << (i / c.Dv) % c.B
                      << " hq=" << i / (static_cast<size_t>(c.Dv) * c.B) << ") out=" << out[i]
                      << " ref=" << ref[i] << " tol=" << run_tol;
      }
    }
    if (!mask_bits.empty() && run_index < given.size()) {
      std::vector<float> first = out;
      std::fill(out.begin(), out.end(), 12345.0f);
      kp.mask_bits = mask_bits.data();
      EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, pf, &ov));
      kp.mask_bits = nullptr;
      EXPECT_EQ(std::memcmp(out.data(), first.data(), out.size() * sizeof(float)), 0)
          << "with the mask's bits given, the output differs";
    }
  }
}

class AttentionTest : public hwy::TestWithParamTarget {};
INSTANTIATE_TEST_SUITE_P(AttentionTestGroup, AttentionTest,
                         testing::ValuesIn(kernels::DispatchableTargets()),
                         hwy::TestParamTargetName);

std::vector<std::pair<DType, bool>> DTypeLayouts() {
  return {{DType::kF32, false},  {DType::kF32, true},   {DType::kF16, false},
          {DType::kF16, true},   {DType::kBF16, false}, {DType::kBF16, true},
          {DType::kQ8_0, false}, {DType::kQ4_0, false}};
}

// The full matrix at small L: dtype x V layout x GQA x head_dim x B (1 and 7), decode and prefill.
TEST_P(AttentionTest, MatrixSmall) {
  const MaskKind masks[] = {MaskKind::kCausal, MaskKind::kMultiSeq, MaskKind::kWindow,
                            MaskKind::kChunk,  MaskKind::kNone,     MaskKind::kEmptyRow};
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    for (int G : {1, 4, 8}) {
      for (int D : {64, 80, 128, 256}) {
        if (IsQuantized(dt) && D % 32 != 0) continue;
        for (int B : {1, 7}) {
          Case c;
          c.dt = dt;
          c.perm = perm;
          c.D = c.Dv = D;
          c.G = G;
          c.B = B;
          c.L = 17 + 23 * (mi % 3);  // 17, 40, 63: tails, one and several vectors
          c.mask = masks[mi % 6];
          c.mask_dt = (mi % 4 == 1) ? DType::kF16 : DType::kF32;
          c.softcap = (mi % 5 == 2) ? 20.0f : 0.0f;
          c.sinks = (mi % 3 == 1);
          ++mi;
          CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kPrefill, nullptr}});
        }
      }
    }
  }
}

// Query-head groups that leave 4 heads after the groups of 8 (G 5, 12: the 4-head K pass reads
// its heads at an offset) and small head dims (32, 48: f16 K on AVX-512 takes DotHeadsPairs8 up to
// 64), with histories whose length leaves tails after the 8-row groups.
TEST_P(AttentionTest, HeadGroupsAndSmallHeadDims) {
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    if (dt != DType::kF16 && dt != DType::kF32) continue;
    for (int G : {5, 12}) {
      for (int D : {32, 48, 64}) {
        Case c;
        c.dt = dt;
        c.perm = perm;
        c.D = c.Dv = D;
        c.G = G;
        c.B = 1 + 2 * (mi % 2);
        c.L = 61 + 70 * (mi % 3);  // 61, 131, 201: 8-row groups, then 5, 3 or 1 rows
        c.mask = mi % 2 == 0 ? MaskKind::kCausal : MaskKind::kMultiSeq;
        ++mi;
        CheckCase(c, {{AttentionMode::kDecode, nullptr}});
      }
    }
  }
}

// B = 512 (the prefill shape) with a short history, every dtype and layout.
TEST_P(AttentionTest, Batch512) {
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    Case c;
    c.dt = dt;
    c.perm = perm;
    c.D = c.Dv = (mi % 2) ? 128 : 64;
    c.G = (mi % 3 == 0) ? 4 : 1;
    c.Hkv = 2;
    c.B = 512;
    c.L = 48;
    c.mask = (mi % 2) ? MaskKind::kMultiSeq : MaskKind::kCausal;
    c.sinks = mi % 3 == 2;
    ++mi;
    CheckCase(c, {{AttentionMode::kAuto, nullptr}});
  }
}

// Long histories: the decode split into chunks and its merge, threads 1 and 2. L 2100 on 2 threads
// gives one task per KV head and chunk (Hkv 2: 4 chunks of 640 cells; Hkv 5: 2 of 1152); on one
// thread a single task walks every head. A case of 32 rows runs the call's scan, query
// preparation and merge on the threads. The last cases are long enough for 2 threads to split the
// cells into 8 chunks whose tasks walk every head.
TEST_P(AttentionTest, LongHistoryThreads) {
  ThreadPool pool2(2);
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    Case c;
    c.dt = dt;
    c.perm = perm;
    c.D = c.Dv = 128;
    c.G = 4;
    c.Hkv = (mi % 2) ? 2 : 5;
    c.B = (mi % 2) ? 1 : 3;
    c.L = 2100;
    c.mask =
        (mi % 3 == 0) ? MaskKind::kWindow : (mi % 3 == 1 ? MaskKind::kMultiSeq : MaskKind::kNone);
    c.sinks = mi % 2 == 0;
    ++mi;
    CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kDecode, &pool2}});
  }
  // Several chunks per head (4) and enough rows that the call splits all its serial parts over
  // the threads: the mask scan (32 rows), the preparation of each head's query rows (B * Hq =
  // 1024 >= 256) and the merge (B * Hq * chunks = 4096): every dtype and V layout (q8_0 with each
  // K pass: CheckCase repeats its runs), f16's pair patterns.
  for (auto [dt, perm] : DTypeLayouts()) {
    const Case c{
        .dt = dt, .perm = perm, .Hkv = 2, .G = 16, .B = 32, .L = 2100, .mask = MaskKind::kMultiSeq};
    CheckCase(c, {{AttentionMode::kDecode, &pool2}});
  }
  {
    Case c;
    c.dt = DType::kF16;
    c.D = c.Dv = 64;
    c.G = 4;
    c.Hkv = 3;
    c.B = 2;
    c.L = 8 * 4096 + 300;
    c.mask = MaskKind::kMultiSeq;
    c.sinks = true;
    CheckCase(c, {{AttentionMode::kDecode, &pool2}});
  }
  // Chunks of cells placed by the rows' work (BalanceDecodeChunks): 16 rows all see the first
  // third of 33000 cells and 4 rows each cell after it, so on 2 threads the 8 chunks are shorter
  // over the first third; every chunk's partials must still merge to the reference.
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    Case c;
    c.dt = dt;
    c.Hkv = 1;
    c.G = 4;
    c.B = 16;
    c.L = 33000;
    c.mask = MaskKind::kInterleavedBias;
    CheckCase(c, {{AttentionMode::kDecode, &pool2}});
  }
  Case c;
  c.dt = DType::kF16;
  c.B = 40;
  c.L = 300;
  c.G = 4;
  c.mask = MaskKind::kMultiSeq;
  CheckCase(c, {{AttentionMode::kPrefill, &pool2}, {AttentionMode::kPrefill, nullptr}});
}

// The prefetch level (kernels/attention.h) moves no result: decode with prefetcht0 and with
// prefetcht2 gives the same bits (and kAuto is one of them), over every storage type and V layout,
// masks with many spans, 1 and 2 threads, a history long enough for chunks of cells, and q8_0's
// integer passes.
TEST_P(AttentionTest, PrefetchLevelChangesNoBit) {
  EXPECT_EQ(kernels::ResolvePrefetchLevel(kernels::PrefetchLevel::kL1),
            kernels::PrefetchLevel::kL1);
  EXPECT_EQ(kernels::ResolvePrefetchLevel(kernels::PrefetchLevel::kL2),
            kernels::PrefetchLevel::kL2);
  EXPECT_NE(kernels::ResolvePrefetchLevel(kernels::PrefetchLevel::kAuto),
            kernels::PrefetchLevel::kAuto);
  ThreadPool pool2(2);
  struct Shape {
    DType dt;
    bool perm;
    int L, B;
  };
  std::vector<Shape> shapes;
  for (auto [dt, perm] : DTypeLayouts()) shapes.push_back({dt, perm, 2100, 3});
  shapes.push_back({DType::kF16, false, 4 * 4096 + 300, 1});
  shapes.push_back({DType::kQ8_0, false, 4 * 4096 + 300, 2});
  std::mt19937 rng(77);
  for (const Shape& s : shapes) {
    const int D = 64, G = 4, Hkv = 2, Hq = Hkv * G;
    SCOPED_TRACE(std::string(DTypeName(s.dt)) + (s.perm ? " permV" : " plainV") +
                 " L=" + std::to_string(s.L) + " target=" + TargetNow());
    TestHistory h = MakeHistory(s.dt, D, D, Hkv, s.L, s.perm, rng);
    std::vector<float> q(static_cast<size_t>(D) * s.B * Hq);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : q) x = u(rng);
    std::vector<uint8_t> mask = BuildTestMask(MaskKind::kMultiSeq, s.L, s.B, DType::kF32, rng);
    const TensorView qv = MakeView(q.data(), DType::kF32, {D, s.B, Hq});
    const TensorView mv = MakeView(mask.data(), DType::kF32, {s.L, s.B});
    for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
      for (int integer = 0; integer < (s.dt == DType::kQ8_0 ? 2 : 1); ++integer) {
        SCOPED_TRACE("threads=" + std::to_string(pool ? 2 : 1) +
                     " integer=" + std::to_string(integer));
        std::vector<float> out[3];
        const kernels::PrefetchLevel levels[3] = {kernels::PrefetchLevel::kL1,
                                                  kernels::PrefetchLevel::kL2,
                                                  kernels::PrefetchLevel::kAuto};
        for (int i = 0; i < 3; ++i) {
          kernels::AttentionKernelParams kp;
          kp.scale = 0.125f;
          kp.v_permuted = s.perm;
          kp.mode = AttentionMode::kDecode;
          kp.integer_k = kp.integer_v = integer != 0;
          kp.prefetch = levels[i];
          out[i].assign(static_cast<size_t>(D) * s.B * Hq, 12345.0f);
          TensorView ov = MakeView(out[i].data(), DType::kF32, {D, s.B, Hq});
          EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, KernelParallelFor(pool), &ov));
        }
        ASSERT_NE(out[0][0], 12345.0f);
        EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(out[0].data(), out[2].data(), out[0].size() * sizeof(float)));
      }
    }
  }
}

// Extreme logits (|logit| in the thousands), softcap on them, and GQA ratios off the power of two.
TEST_P(AttentionTest, ExtremeLogitsAndOddShapes) {
  for (auto [dt, perm] : DTypeLayouts()) {
    for (float qs : {300.0f, 3000.0f}) {
      Case c;
      c.dt = dt;
      c.perm = perm;
      c.qscale = qs;
      c.L = 70;
      c.B = 2;
      c.G = 3;
      c.mask = MaskKind::kMultiSeq;
      CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kPrefill, nullptr}});
      c.softcap = 30.0f;
      c.sinks = true;
      CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kPrefill, nullptr}});
    }
  }
  // Head dims that are not a multiple of the vector length, Dv != D, G = 5 and 12.
  for (auto [dt, perm] : DTypeLayouts()) {
    if (IsQuantized(dt)) continue;
    Case c;
    c.dt = dt;
    c.perm = perm;
    c.D = 37;
    c.Dv = 23;
    c.G = 5;
    c.Hkv = 1;
    c.B = 3;
    c.L = 29;
    CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kPrefill, nullptr}});
    c.G = 12;
    CheckCase(c, {{AttentionMode::kDecode, nullptr}});
  }
}

// Rows whose visible cells are a long shared span plus many one-cell spans (a batched decode of
// several sequences), with non-zero mask values on visible cells: the decode kernel gathers the
// short spans into cell lists, and each cell must keep its own mask value.
// The edge-case tests' small decode: D 64, 2 KV heads x 4 query heads, 2 rows, 300 cells; q uniform
// in [-qscale, qscale].
struct SmallDecode {
  static constexpr int D = 64, Hkv = 2, B = 2, L = 300;
  int G, Hq;  // query heads per KV head, query heads
  std::vector<float> q;
  TensorView qv;
  SmallDecode(std::mt19937& rng, float qscale, int g = 4)
      : G(g), Hq(Hkv * g), q(static_cast<size_t>(D) * B * Hq) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : q) x = u(rng) * qscale;
    qv = MakeView(q.data(), DType::kF32, {D, B, Hq});
  }
  TensorView Out(std::vector<float>* o) const {
    o->assign(static_cast<size_t>(D) * B * Hq, 0.0f);
    return MakeView(o->data(), DType::kF32, {D, B, Hq});
  }
};

// The integer V pass where its rounding is most exposed: V far below 1 (q8_0 block scales of ~8e-6,
// f16 subnormals) keeps the bound relative to max|V|, against the f32 pass.
TEST_P(AttentionTest, IntegerVTinyValues) {
  for (DType dt : {DType::kQ8_0, DType::kQ4_0}) {
    SCOPED_TRACE(std::string(DTypeName(dt)) + " target=" + TargetNow());
    constexpr int D = SmallDecode::D, Hkv = SmallDecode::Hkv, L = SmallDecode::L;
    std::mt19937 rng(77u);
    TestHistory h = MakeHistory(dt, D, D, Hkv, L, false, rng);
    const float vmax = 0x1p-10f;
    for (int hh = 0; hh < Hkv; ++hh) {
      for (int j = 0; j < L; ++j) {
        // Pointers, not &vf[end]: the last row's end is one past the vector (_GLIBCXX_ASSERTIONS
        // aborted on its operator[]).
        const float* first = h.vf.data() + (static_cast<size_t>(hh) * L + j) * D;
        std::vector<float> row(first, first + D);
        for (float& x : row) x *= vmax;
        StoreRowFromF32(row.data(), D, dt, RowPtr(h.v, hh, j));
      }
    }
    const SmallDecode sd(rng, 4.0f);  // peaked and flat rows both
    std::vector<float> out_f, out_i;
    TensorView of = sd.Out(&out_f), oi = sd.Out(&out_i);
    kernels::AttentionKernelParams kp;
    kp.scale = 0.125f;
    kp.mode = AttentionMode::kDecode;
    EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &of));
    kp.integer_v = true;
    EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &oi));
    double maxerr = 0;
    for (size_t i = 0; i < out_f.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out_i[i])) << i;
      maxerr = std::max(maxerr, std::fabs(static_cast<double>(out_f[i]) - out_i[i]));
    }
    EXPECT_LE(maxerr, (kIntegerVTol + 1e-5) * vmax);
    // The integer pass ran where it exists (it does not match the f32 pass exactly).
    const int64_t best = TargetBitNow();
    if (best == HWY_AVX3_DL) {
      EXPECT_GT(maxerr, 0.0);
    } else {
      EXPECT_EQ(maxerr, 0.0);
    }
  }
}

// The integer K passes (integer_k's 16-bit query and the default 24-bit one) against the f32 pass
// (float_k) on the same q8_0 history: within their bounds (see CheckCase), different where they
// run (AVX3_DL) and identical elsewhere; and with a K block scale
// of inf or NaN (outside the kernel's contract: the logits must be finite) the outputs are
// non-finite exactly where the f32 pass's are (the 16 or 4 cells around it take the f32 pass:
// cell 123 is read 16 rows at a time, cell 290 in the block's 4-row tail). With 4 and 8 query
// heads per KV head (8 heads share one pass over the codes and fall back together).
TEST_P(AttentionTest, IntegerKAgainstTheF32Pass) {
  SCOPED_TRACE("target=" + TargetNow());
  constexpr int D = SmallDecode::D, Hkv = SmallDecode::Hkv, L = SmallDecode::L;
  std::mt19937 rng(79u);
  TestHistory h = MakeHistory(DType::kQ8_0, D, D, Hkv, L, false, rng);
  double ksum_max = 0;
  std::vector<float> krow(D);
  for (int hh = 0; hh < Hkv; ++hh) {
    for (int j = 0; j < L; ++j) {
      LoadRowAsF32(RowPtr(h.k, hh, j), D, DType::kQ8_0, krow.data());
      double ks = 0;
      for (float x : krow) ks += std::fabs(x);
      ksum_max = std::max(ksum_max, ks);
    }
  }
  const int64_t best = TargetBitNow();
  for (const char* stored : {"finite", "inf", "nan"}) {
    if (stored[0] != 'f') {  // cells 123 and 290 of head 1, block 1's scale
      const uint16_t bits = stored[0] == 'i' ? 0x7C00 : 0x7E00;
      for (int cell : {123, 290}) {
        std::memcpy(static_cast<char*>(RowPtr(h.k, 1, cell)) + BlockBytes(DType::kQ8_0), &bits, 2);
      }
    }
    for (int G : {4, 8}) {
      SCOPED_TRACE(std::string(stored) + " G=" + std::to_string(G));
      const SmallDecode sd(rng, 4.0f, G);
      kernels::AttentionKernelParams kp;
      kp.scale = 0.125f;
      kp.mode = AttentionMode::kDecode;
      double qmax = 0;
      for (float x : sd.q) qmax = std::max(qmax, std::fabs(static_cast<double>(x)) * kp.scale);
      std::vector<float> out_f;
      TensorView of = sd.Out(&out_f);
      kp.float_k = true;
      EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &of));
      kp.float_k = false;
      for (const bool bits16 : {true, false}) {  // integer_k, then the default 24-bit pass
        SCOPED_TRACE(bits16 ? "integer_k" : "24-bit default");
        // max|V| <= 1; the 24-bit pass also rounds its per-block sums as f32 does.
        const double bound =
            std::expm1(2.0 * qmax / (bits16 ? 65278.0 : 16711422.0) * ksum_max) + 1e-5;
        std::vector<float> out_i;
        TensorView oi = sd.Out(&out_i);
        kp.integer_k = bits16;
        EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &oi));
        double maxerr = 0;
        int non_finite = 0;
        for (size_t i = 0; i < out_f.size(); ++i) {
          ASSERT_EQ(std::isnan(out_i[i]), std::isnan(out_f[i])) << i << " out=" << out_i[i];
          ASSERT_EQ(std::isinf(out_i[i]), std::isinf(out_f[i])) << i << " out=" << out_i[i];
          if (!std::isfinite(out_f[i])) {
            ++non_finite;
            continue;
          }
          maxerr = std::max(maxerr, std::fabs(static_cast<double>(out_f[i]) - out_i[i]));
        }
        if (stored[0] == 'f') {
          EXPECT_EQ(non_finite, 0);
        } else {  // every head of KV head 1, both rows, dims 32..63 at least
          EXPECT_GE(non_finite, SmallDecode::B * G * 32);
        }
        EXPECT_LE(maxerr, bound);
        if (best == HWY_AVX3_DL) {
          EXPECT_GT(maxerr, 0.0);
        } else {
          EXPECT_EQ(maxerr, 0.0);
        }
      }
    }
  }
}

// A NaN or inf in a query row: the integer K passes (16- and 24-bit) must hand that row to the f32
// pass (its step is NaN), so that head's outputs are the f32 pass's (a NaN row,
// NonFiniteLogitPoisonsItsRow). A NaN element once slipped through the row's max|q| (std::max
// ignores it) and gave finite outputs.
TEST_P(AttentionTest, IntegerKNonFiniteQuery) {
  SCOPED_TRACE("target=" + TargetNow());
  constexpr int D = SmallDecode::D, Hkv = SmallDecode::Hkv, L = SmallDecode::L;
  constexpr int kBadRow = 1, kBadHead = 5;
  std::mt19937 rng(80u);
  TestHistory h = MakeHistory(DType::kQ8_0, D, D, Hkv, L, false, rng);
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (int at : {0, 37, D - 1}) {  // first, middle and last element of the row
      SCOPED_TRACE(std::to_string(bad) + " at " + std::to_string(at));
      SmallDecode sd(rng, 1.0f);
      sd.q[static_cast<size_t>(D) * (kBadRow * sd.Hq + kBadHead) + at] = bad;
      kernels::AttentionKernelParams kp;
      kp.scale = 0.125f;
      kp.mode = AttentionMode::kDecode;
      std::vector<float> out_f;
      TensorView of = sd.Out(&out_f);
      kp.float_k = true;
      EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &of));
      kp.float_k = false;
      for (const bool bits16 : {true, false}) {  // integer_k, then the default 24-bit pass
        SCOPED_TRACE(bits16 ? "integer_k" : "24-bit default");
        std::vector<float> out_i;
        TensorView oi = sd.Out(&out_i);
        kp.integer_k = bits16;
        EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &oi));
        const size_t bad0 = static_cast<size_t>(D) * (kBadRow * sd.Hq + kBadHead);
        for (size_t i = bad0; i < bad0 + D; ++i) {
          ASSERT_TRUE(std::memcmp(&out_i[i], &out_f[i], 4) == 0 ||
                      (std::isnan(out_i[i]) && std::isnan(out_f[i])))
              << i - bad0 << ": " << out_i[i] << " vs the f32 pass's " << out_f[i];
        }
        for (size_t i = 0; i < out_f.size(); ++i) {
          if (i >= bad0 && i < bad0 + D) continue;
          ASSERT_TRUE(std::isfinite(out_i[i])) << i;
        }
      }
    }
  }
}

// A NaN or +inf in a visible cell's K (an f16 element, a q8_0 block scale) gives NaN or +inf
// logits for that KV head's query heads, and their output rows are NaN, as in the double
// reference, in every mode: decode on 1 thread and split into chunks on 2 (the merge), prefill,
// the integer passes. A NaN in a hidden cell (mask -inf) changes nothing. Before: the reference
// zeroed such rows, decode gave finite rows for NaN (the softmax's max dropped NaN lanes by
// position) and NaN for +inf, prefill zeros for +inf.
// The double reference's output [Dv, B, Hq] for q [D, B, Hq] over (k, v, mask), scale 0.125.
std::vector<float> ScaledReference(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const TensorView& mask) {
  std::vector<float> ref(static_cast<size_t>(v.ne[0] * q.ne[1] * q.ne[2]));
  TensorView rv = MakeView(ref.data(), DType::kF32, {v.ne[0], q.ne[1], q.ne[2]});
  kernels::AttentionKernelParams kp;
  kp.scale = 0.125f;
  kernels::AttentionRef(q, k, v, mask, kp, &rv);
  return ref;
}

TEST_P(AttentionTest, NonFiniteLogitPoisonsItsRow) {
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    for (const char* stored : {"nan", "inf"}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " " + stored + " target=" + TargetNow());
      constexpr int D = 64, Hkv = 2, G = 4, B = 2, L = 2048, Hq = Hkv * G;
      constexpr int kBadCell = 1500, kHiddenCell = 700, kElem = 37;
      std::mt19937 rng(81u);
      TestHistory h = MakeHistory(dt, D, D, Hkv, L, false, rng);
      const uint16_t bits = stored[0] == 'n' ? 0x7E00 : 0x7C00;
      for (int head = 0; head < Hkv; ++head) {  // head 1: a visible cell; both: a hidden one
        const int cell = head == 1 ? kBadCell : kHiddenCell;
        char* row = static_cast<char*>(RowPtr(h.k, head, cell));
        std::memcpy(dt == DType::kF16 ? row + 2 * kElem : row + BlockBytes(dt), &bits, 2);
      }
      std::vector<float> mask(static_cast<size_t>(L) * B, 0.0f);
      for (int b = 0; b < B; ++b) {
        mask[static_cast<size_t>(b) * L + kHiddenCell] = -std::numeric_limits<float>::infinity();
      }
      const TensorView mv = MakeView(mask.data(), DType::kF32, {L, B});
      // Q [D, B, Hq], element kElem > 0: an f16 +inf gives +inf logits (q8_0's inf scale times
      // its codes gives +inf and -inf, whose sum is NaN, whatever q is).
      std::vector<float> q(static_cast<size_t>(D) * B * Hq);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (size_t i = 0; i < q.size(); ++i)
        q[i] = i % D == kElem ? 0.1f + std::fabs(u(rng)) : u(rng);
      const TensorView qv = MakeView(q.data(), DType::kF32, {D, B, Hq});
      const std::vector<float> ref = ScaledReference(qv, h.k, h.v, mv);
      std::vector<float> out(q.size());
      TensorView ov = MakeView(out.data(), DType::kF32, {D, B, Hq});
      kernels::AttentionKernelParams kp;
      kp.scale = 0.125f;
      // Output [D, B, Hq]: query heads G .. 2G - 1 belong to KV head 1.
      const auto poisoned = [&](size_t i) { return static_cast<int>(i / D / B) >= G; };
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_EQ(std::isnan(ref[i]), poisoned(i)) << i << " ref=" << ref[i];
      }
      ThreadPool pool(2);
      for (int run = 0; run < 5; ++run) {
        if (run == 4 && dt == DType::kF16) continue;
        SCOPED_TRACE("run " + std::to_string(run));
        const kernels::ParallelForFn pf = KernelParallelFor(run == 1 ? &pool : nullptr);
        kp.mode = run == 2 ? AttentionMode::kPrefill : AttentionMode::kDecode;
        kp.integer_k = kp.integer_v = run >= 3;
        std::fill(out.begin(), out.end(), 12345.0f);
        EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, pf, &ov));
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(std::isnan(out[i]), poisoned(i)) << i << " out=" << out[i];
          if (!poisoned(i)) {
            ASSERT_NEAR(out[i], ref[i], 2e-3) << i;
          }
        }
      }
    }
  }
}

// Stored inf in V (an f16 element, a q8_0 / q4_0 block scale) gives non-finite outputs in exactly
// the places the double reference does, on every target, in both modes and in the integer V pass.
// Targets without F16C convert f16 in software; Highway 1.0.3's conversion there reads exponent 31
// as 2^16 instead of inf / NaN.
TEST_P(AttentionTest, NonFiniteStoredVPropagates) {
  for (DType dt : {DType::kF16, DType::kQ8_0, DType::kQ4_0}) {
    SCOPED_TRACE(std::string(DTypeName(dt)) + " target=" + TargetNow());
    constexpr int D = SmallDecode::D, Hkv = SmallDecode::Hkv, L = SmallDecode::L;
    constexpr int B = SmallDecode::B;
    std::mt19937 rng(78u);
    TestHistory h = MakeHistory(dt, D, D, Hkv, L, false, rng);
    // Cell 123 of head 1: element 37 (f16) or block 1's scale (dims 32..63) becomes +inf.
    const uint16_t inf_bits = 0x7C00;
    char* row = static_cast<char*>(RowPtr(h.v, 1, 123));
    std::memcpy(dt == DType::kF16 ? row + 2 * 37 : row + BlockBytes(dt), &inf_bits, 2);
    const SmallDecode sd(rng, 1.0f);
    std::vector<float> out, ref;
    TensorView ov = sd.Out(&out), rv = sd.Out(&ref);
    kernels::AttentionKernelParams kp;
    kp.scale = 0.125f;
    kernels::AttentionRef(sd.qv, h.k, h.v, TensorView{}, kp, &rv);
    int ref_nonfinite = 0;
    for (float x : ref) ref_nonfinite += !std::isfinite(x);
    EXPECT_EQ(ref_nonfinite, B * sd.G * (dt == DType::kF16 ? 1 : 32));
    // Runs: decode, prefill, decode with integer V, decode with each scaling of the f32 V pass.
    for (int run = 0; run < 5; ++run) {
      if (run >= 2 && dt == DType::kF16) continue;
      SCOPED_TRACE("run " + std::to_string(run));
      kp.mode = run == 1 ? AttentionMode::kPrefill : AttentionMode::kDecode;
      kp.integer_v = run == 2;
      kp.quant_v_scaling = run == 3   ? kernels::QuantVScaling::kCodes
                           : run == 4 ? kernels::QuantVScaling::kWeights
                                      : kernels::QuantVScaling::kAuto;
      EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &ov));
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(std::isnan(out[i]), std::isnan(ref[i])) << i << " out=" << out[i];
        ASSERT_EQ(std::isinf(out[i]), std::isinf(ref[i])) << i << " out=" << out[i];
        if (std::isfinite(ref[i])) {
          ASSERT_NEAR(out[i], ref[i], kIntegerVTol + 1e-5) << i;
        } else if (std::isinf(ref[i])) {
          ASSERT_EQ(out[i], ref[i]) << i;
        }
      }
    }
  }
}

// Stored inf / NaN in the V of a cell that a row does not see contributes nothing to that row,
// in both modes: prefill reads whole 64-cell tiles, where a hidden cell's weight 0 times inf
// would give NaN (found by an audit: one overflowing f16 token of one sequence turned another
// sequence's prefill outputs to NaN). Cell 130 is hidden from every row, cell 140 from the even
// rows only: the odd rows' outputs are non-finite exactly where the reference's are.
TEST_P(AttentionTest, HiddenNonFiniteVContributesNothing) {
  for (DType dt : {DType::kF16, DType::kQ8_0, DType::kQ4_0}) {
    for (const uint16_t bits : {uint16_t{0x7C00}, uint16_t{0x7E00}}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + (bits == 0x7C00 ? " inf" : " nan") +
                   " target=" + TargetNow());
      constexpr int D = 64, Hkv = 2, G = 4, B = 16, L = 300, Hq = Hkv * G;
      constexpr int kHiddenAll = 130, kHiddenEven = 140;
      std::mt19937 rng(79u);
      TestHistory h = MakeHistory(dt, D, D, Hkv, L, false, rng);
      for (int head = 0; head < Hkv; ++head) {
        for (int cell : {kHiddenAll, kHiddenEven}) {
          char* row = static_cast<char*>(RowPtr(h.v, head, cell));
          std::memcpy(dt == DType::kF16 ? row + 2 * 37 : row + BlockBytes(dt), &bits, 2);
        }
      }
      std::vector<float> mask(static_cast<size_t>(L) * B, 0.0f);
      for (int b = 0; b < B; ++b) {
        mask[static_cast<size_t>(b) * L + kHiddenAll] = -std::numeric_limits<float>::infinity();
        if (b % 2 == 0) {
          mask[static_cast<size_t>(b) * L + kHiddenEven] = -std::numeric_limits<float>::infinity();
        }
      }
      const TensorView mv = MakeView(mask.data(), DType::kF32, {L, B});
      std::vector<float> q(static_cast<size_t>(D) * B * Hq);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (float& x : q) x = u(rng);
      const TensorView qv = MakeView(q.data(), DType::kF32, {D, B, Hq});
      const std::vector<float> ref = ScaledReference(qv, h.k, h.v, mv);
      std::vector<float> out(q.size());
      TensorView ov = MakeView(out.data(), DType::kF32, {D, B, Hq});
      int ref_nonfinite = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const bool odd_row = (i / D) % B % 2 == 1;
        ref_nonfinite += !std::isfinite(ref[i]);
        if (!odd_row) {
          ASSERT_TRUE(std::isfinite(ref[i])) << i;
        }
      }
      EXPECT_EQ(ref_nonfinite, (B / 2) * Hq * (dt == DType::kF16 ? 1 : 32));
      ThreadPool pool(2);
      for (int run = 0; run < 3; ++run) {
        SCOPED_TRACE("run " + std::to_string(run));
        kernels::AttentionKernelParams kp;
        kp.scale = 0.125f;
        kp.mode = run == 0 ? AttentionMode::kDecode : AttentionMode::kPrefill;
        std::fill(out.begin(), out.end(), 12345.0f);
        EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp,
                                       KernelParallelFor(run == 2 ? &pool : nullptr), &ov));
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(std::isnan(out[i]), std::isnan(ref[i])) << i << " out=" << out[i];
          ASSERT_EQ(std::isinf(out[i]), std::isinf(ref[i])) << i << " out=" << out[i];
          if (std::isfinite(ref[i])) {
            ASSERT_NEAR(out[i], ref[i], 1e-5) << i;
          } else if (std::isinf(ref[i])) {
            ASSERT_EQ(out[i], ref[i]) << i;
          }
        }
      }
    }
  }
}

// CheckCase repeats a decode run with a variant's flag only where DispatchedDecodeVariants says the
// target implements it: it must name exactly the targets that compile each one (the tests of each
// variant check that its flag changes the output there and nowhere else).
TEST_P(AttentionTest, DecodeVariantsFollowTheTarget) {
  const int64_t best = TargetBitNow();
  const kernels::DecodeVariants v = kernels::DispatchedDecodeVariants();
  SCOPED_TRACE("target=" + TargetNow());
  EXPECT_EQ(v.integer_k, best == HWY_AVX3_DL);
  EXPECT_EQ(v.integer_v, best == HWY_AVX3_DL);
  EXPECT_EQ(v.scaled_weights, best == HWY_AVX3 || best == HWY_AVX3_DL);
}

// QuantVScaling (kernels/attention.h): kAuto resolves to one of the two ways; kWeights runs on
// AVX-512 targets (its outputs differ from kCodes' in rounding only) and elsewhere gives kCodes'
// bits. Then both against the reference (CheckCase runs each) with head dims of an odd number of
// blocks (96, 160: a block left over after the two-block passes), 4 and 8 query heads per KV head,
// q8_0 and q4_0, a history long enough for several 128-cell pieces and 2 threads.
TEST_P(AttentionTest, QuantVScalingRunsWhereImplemented) {
  using kernels::QuantVScaling;
  EXPECT_NE(kernels::ResolveQuantVScaling(QuantVScaling::kAuto), QuantVScaling::kAuto);
  EXPECT_EQ(kernels::ResolveQuantVScaling(QuantVScaling::kCodes), QuantVScaling::kCodes);
  EXPECT_EQ(kernels::ResolveQuantVScaling(QuantVScaling::kWeights), QuantVScaling::kWeights);
  const int64_t best = TargetBitNow();
  const bool avx512 = best <= HWY_AVX3;  // AVX3 or better (AVX3_DL)
  for (DType dt : {DType::kQ8_0, DType::kQ4_0}) {
    for (int G : {4, 8}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " G=" + std::to_string(G) +
                   " target=" + TargetNow());
      std::mt19937 rng(80u);
      TestHistory h = MakeHistory(dt, SmallDecode::D, SmallDecode::D, SmallDecode::Hkv,
                                  SmallDecode::L, false, rng);
      const SmallDecode sd(rng, 1.0f, G);
      std::vector<float> out[2];
      for (int i = 0; i < 2; ++i) {
        kernels::AttentionKernelParams kp;
        kp.scale = 0.125f;
        kp.mode = AttentionMode::kDecode;
        kp.quant_v_scaling = i == 0 ? QuantVScaling::kCodes : QuantVScaling::kWeights;
        TensorView ov = sd.Out(&out[i]);
        EXPECT_TRUE(kernels::Attention(sd.qv, h.k, h.v, TensorView{}, kp, {}, &ov));
      }
      double maxdiff = 0;
      for (size_t i = 0; i < out[0].size(); ++i)
        maxdiff = std::max(maxdiff, std::fabs(static_cast<double>(out[0][i]) - out[1][i]));
      EXPECT_LE(maxdiff, 1e-6);  // max|V| <= 1: both within the f32 pass's rounding
      if (avx512) {
        EXPECT_GT(maxdiff, 0.0);
      } else {
        EXPECT_EQ(maxdiff, 0.0);
      }
    }
  }
  ThreadPool pool2(2);
  for (DType dt : {DType::kQ8_0, DType::kQ4_0}) {
    for (int D : {96, 160}) {
      for (int G : {4, 8}) {
        Case c;
        c.dt = dt;
        c.D = c.Dv = D;
        c.G = G;
        c.B = 2;
        c.L = 700;
        c.mask = MaskKind::kMultiSeq;
        CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kDecode, &pool2}});
      }
    }
  }
}

TEST_P(AttentionTest, InterleavedSequencesWithBiases) {
  for (auto [dt, perm] : DTypeLayouts()) {
    for (int G : {1, 4}) {
      for (DType mdt : {DType::kF32, DType::kF16}) {
        Case c;
        c.dt = dt;
        c.perm = perm;
        c.G = G;
        c.B = 7;
        c.L = 390;
        c.mask = MaskKind::kInterleavedBias;
        c.mask_dt = mdt;
        CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kPrefill, nullptr}});
      }
    }
  }
}

// Decode runs consecutive batch rows that see the same piece of a block together, their heads
// forming groups that span rows (DecodeHeadChunk): a shared prompt (kInterleavedBias: all rows,
// then each row's own cells), rows of one sequence at successive positions (kCausal: the pieces
// agree up to the newest cells), blocks of rows per sequence (kSequenceRuns), no mask (all rows,
// every cell). Every group size 1 to 8 heads per row, so that groups straddle rows (3, 6) or not,
// DotHeadsPairs8's case (f16, G 4 / 8, which combines) and its G 6 (which must not), masks with
// per-row biases, 1 and 2 threads.
TEST_P(AttentionTest, RowsSeeingTheSameCellsRunTogether) {
  ThreadPool pool2(2);
  const std::pair<DType, bool> layouts[] = {{DType::kF32, false},
                                            {DType::kF16, false},
                                            {DType::kF16, true},
                                            {DType::kQ8_0, false},
                                            {DType::kQ4_0, false}};
  const MaskKind masks[] = {MaskKind::kInterleavedBias, MaskKind::kCausal, MaskKind::kSequenceRuns,
                            MaskKind::kNone};
  int i = 0;
  for (auto [dt, perm] : layouts) {
    for (int G : {1, 2, 3, 4, 6, 8}) {
      for (MaskKind mask : masks) {
        Case c;
        c.dt = dt;
        c.perm = perm;
        c.G = G;
        c.B = (i++ % 2 == 0) ? 7 : 3;
        c.L = 300;
        c.mask = mask;
        c.mask_dt = i % 3 == 0 ? DType::kF16 : DType::kF32;
        c.sinks = i % 4 == 0;
        CheckCase(c, {{AttentionMode::kDecode, nullptr}, {AttentionMode::kDecode, &pool2}});
      }
    }
  }
}

// An f32 mask [L, B] in which row b sees the cells [range(b).first, range(b).second) (value 0).
template <class Range>
std::vector<float> RowRangeMask(int L, int B, const Range& range) {
  std::vector<float> mask(static_cast<size_t>(L) * B, -kInf);
  for (int b = 0; b < B; ++b) {
    const auto [lo, hi] = range(b);
    for (int j = lo; j < hi; ++j) mask[static_cast<size_t>(b) * L + j] = 0.0f;
  }
  return mask;
}

// Queries [D, B, Hq], uniform in [-1, 1).
std::vector<float> RandomQueries(int D, int B, int Hq, std::mt19937& rng) {
  std::vector<float> q(static_cast<size_t>(D) * B * Hq);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : q) x = u(rng);
  return q;
}

// The kernel's output ([Dv = D, B, Hq], scale 1 / sqrt(D)) in kDecode, kPrefill and kAuto, in
// that order: the tests of kAuto's choice compare its bits with the mode it should have picked.
std::vector<std::vector<float>> OutputOfEachMode(const TensorView& qv, const TestHistory& h,
                                                 const TensorView& mv,
                                                 const kernels::ParallelForFn& pf, int D) {
  std::vector<std::vector<float>> outs;
  for (AttentionMode mode :
       {AttentionMode::kDecode, AttentionMode::kPrefill, AttentionMode::kAuto}) {
    std::vector<float>& out =
        outs.emplace_back(static_cast<size_t>(D * qv.ne[1] * qv.ne[2]), 12345.0f);
    TensorView ov = MakeView(out.data(), DType::kF32, {D, qv.ne[1], qv.ne[2]});
    kernels::AttentionKernelParams kp;
    kp.scale = 1.0f / std::sqrt(static_cast<float>(D));
    kp.mode = mode;
    EXPECT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, pf, &ov));
  }
  return outs;
}

// AttentionMode::kAuto from 8 rows up to the decode plan's limit (kDecodeMaxRows) runs decode when
// prefill would compute far more (row, cell) pairs than the rows see, as in batched decode of
// several sequences, and prefill when the rows see nearly the same cells (a prompt chunk or
// speculative decoding's draft tokens over one sequence). Until session 29 kAuto ran prefill from 8
// rows on, which computes every row of a task over every cell any of them sees: batched decode of
// 8-16 sequences ran 3-8x slower. The choice shows in the bits: the two modes round differently
// (checked first, so that the comparison can tell them apart), and kAuto must give the chosen
// mode's output exactly. 1 and 2 threads.
TEST_P(AttentionTest, AutoModeDecodesSequencesAndPrefillsSharedRows) {
  ThreadPool pool2(2);
  constexpr int kD = 64, kHkv = 2, kG = 4, kHq = kHkv * kG;
  constexpr int kRun = 40;  // each sequence's cells, when the rows are of different sequences
  int i = 0, told_apart = 0;
  for (DType dt : {DType::kF32, DType::kF16, DType::kQ8_0}) {
    for (int B : {8, 16, static_cast<int>(kernels::kDecodeMaxRows)}) {
      for (bool shared : {false, true}) {
        // shared: row b sees cells [0, L - B + 1 + b), the newest B cells causally; else row b
        // sees its own run [kRun * b, kRun * (b + 1)).
        const int L = shared ? 600 : kRun * B;
        SCOPED_TRACE(std::string(DTypeName(dt)) + " B=" + std::to_string(B) +
                     (shared ? " one sequence" : " a sequence per row"));
        std::mt19937 rng(77u + static_cast<uint32_t>(i++));
        TestHistory h = MakeHistory(dt, kD, kD, kHkv, L, false, rng);
        std::vector<float> q = RandomQueries(kD, B, kHq, rng);
        std::vector<float> mask = RowRangeMask(L, B, [&](int b) {
          return shared ? std::pair{0, L - B + 1 + b} : std::pair{kRun * b, kRun * (b + 1)};
        });
        const TensorView qv = MakeView(q.data(), DType::kF32, {kD, B, kHq});
        const TensorView mv = MakeView(mask.data(), DType::kF32, {L, B});
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
          const kernels::ParallelForFn pf = KernelParallelFor(pool);
          const std::vector<std::vector<float>> outs = OutputOfEachMode(qv, h, mv, pf, kD);
          const size_t bytes = outs[0].size() * sizeof(float);
          // Where the two modes give the same bits (SCALAR's loops can) the case tells nothing.
          if (std::memcmp(outs[0].data(), outs[1].data(), bytes) == 0) continue;
          ++told_apart;
          const std::vector<float>& expected = shared ? outs[1] : outs[0];
          EXPECT_EQ(std::memcmp(outs[2].data(), expected.data(), bytes), 0)
              << "kAuto did not run " << (shared ? "prefill" : "decode")
              << (pool != nullptr ? " (2 threads)" : " (1 thread)");
        }
      }
    }
  }
  // Every case on every thread count; SCALAR told 12 of the 36 apart when this was written.
  if (TargetNow() != "SCALAR") {
    EXPECT_EQ(told_apart, 36);
  }
}

// kAuto from 8 rows on against the reference, over batched decode's masks (four sequences with
// biases and interleaved decode cells; three sequences in runs of 37 cells), where it mostly picks
// decode, and a causal prompt: every storage type and V layout, 8, 13, 64, 65 and 130 rows (above
// 64 in groups, AutoModeGroupsRowsBeyondTheDecodeLimit; kDecode's groups too), 1 and 4 query heads
// per KV head, 1 and 2 threads.
TEST_P(AttentionTest, AutoModeManyRowsMatchesTheReference) {
  ThreadPool pool2(2);
  const int rows[] = {8, 13, static_cast<int>(kernels::kDecodeMaxRows), 65, 130};
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    for (MaskKind mask : {MaskKind::kInterleavedBias, MaskKind::kSequenceRuns, MaskKind::kCausal}) {
      Case c;
      c.dt = dt;
      c.perm = perm;
      c.G = mi % 2 == 0 ? 4 : 1;
      c.B = rows[mi % 5];
      c.L = c.B > kernels::kDecodeMaxRows ? 300 : 420;
      c.mask = mask;
      c.mask_dt = mi % 4 < 2 ? DType::kF32 : DType::kF16;
      c.sinks = mi % 7 == 1;
      ++mi;
      if (c.B > kernels::kDecodeMaxRows) {
        CheckCase(c, {{AttentionMode::kAuto, nullptr},
                      {AttentionMode::kAuto, &pool2},
                      {AttentionMode::kDecode, nullptr},
                      {AttentionMode::kDecode, &pool2}});
      } else {
        CheckCase(c, {{AttentionMode::kAuto, nullptr}, {AttentionMode::kAuto, &pool2}});
      }
    }
  }
}

// More rows than one decode plan serves (kDecodeMaxRows): kDecode, and kAuto with a mask, run
// them in groups of at most 64 consecutive rows, as equal as can be; under kAuto each group
// chooses decode or prefill after its scan and consecutive groups that chose prefill run as one
// prefill call. Until session 30 such calls always ran as prefill, which computed every row of a
// task over the cells any of them sees: batched decode of 65+ sequences paid that, and kDecode
// was silently ignored. The choice shows in the bits (as in the test above): rows of one sequence
// must give kPrefill's bits (the merged groups tile the rows as one call does), rows of a
// sequence each kDecode's (whose groups are the same), and a mixed batch of 128 rows (64 of a
// prompt chunk, then 64 sequences' new tokens) each half its own mode's. 1 and 2 threads.
TEST_P(AttentionTest, AutoModeGroupsRowsBeyondTheDecodeLimit) {
  ThreadPool pool2(2);
  constexpr int kD = 64, kHkv = 2, kG = 4, kHq = kHkv * kG;
  constexpr int kRun = 12;      // each sequence's own cells
  constexpr int kPrompt = 300;  // the one sequence's cells (shape 1) or the prompt (shape 2)
  enum Shape { kSequencePerRow, kOneSequence, kPromptThenSequences };
  int i = 0, told_apart = 0;
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    for (const auto& shape_rows : {std::pair{kSequencePerRow, 65},
                                   {kSequencePerRow, 100},
                                   {kOneSequence, 65},
                                   {kOneSequence, 160},
                                   {kPromptThenSequences, 128}}) {
      // Plain variables, not structured bindings: clang 14 cannot capture those in a lambda.
      const Shape shape = shape_rows.first;
      const int B = shape_rows.second;
      const int prompt_rows = shape == kOneSequence ? B : (shape == kSequencePerRow ? 0 : 64);
      const int L = shape == kSequencePerRow ? kRun * B : kPrompt + kRun * (B - prompt_rows);
      const char* names[3] = {"a sequence per row", "one sequence", "a prompt, then sequences"};
      SCOPED_TRACE(std::string(DTypeName(dt)) + " B=" + std::to_string(B) + " " + names[shape]);
      std::mt19937 rng(91u + static_cast<uint32_t>(i++));
      TestHistory h = MakeHistory(dt, kD, kD, kHkv, L, false, rng);
      std::vector<float> q = RandomQueries(kD, B, kHq, rng);
      // Rows [0, prompt_rows) see the one sequence causally, the others a run of cells of their
      // own.
      std::vector<float> mask = RowRangeMask(L, B, [&](int b) {
        const int own = shape == kSequencePerRow ? kRun * b : kPrompt + kRun * (b - prompt_rows);
        return b < prompt_rows ? std::pair{0, kPrompt - prompt_rows + 1 + b}
                               : std::pair{own, own + kRun};
      });
      const TensorView qv = MakeView(q.data(), DType::kF32, {kD, B, kHq});
      const TensorView mv = MakeView(mask.data(), DType::kF32, {L, B});
      for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
        const kernels::ParallelForFn pf = KernelParallelFor(pool);
        const std::vector<std::vector<float>> outs = OutputOfEachMode(qv, h, mv, pf, kD);
        // Row b of head hq is out[(hq * B + b) * kD ..]: compare row by row, each row against the
        // mode its part should run, where the two modes differ at all for that part.
        const auto same_rows = [&](const std::vector<float>& a, const std::vector<float>& e, int b0,
                                   int b1) {
          for (int hq = 0; hq < kHq; ++hq) {
            const size_t at = (static_cast<size_t>(hq) * B + b0) * kD;
            if (std::memcmp(a.data() + at, e.data() + at, sizeof(float) * kD * (b1 - b0)) != 0)
              return false;
          }
          return true;
        };
        for (auto [b0, b1, prefill] :
             {std::tuple{0, prompt_rows, true}, std::tuple{prompt_rows, B, false}}) {
          if (b0 == b1 || same_rows(outs[0], outs[1], b0, b1)) continue;
          ++told_apart;
          EXPECT_TRUE(same_rows(outs[2], prefill ? outs[1] : outs[0], b0, b1))
              << "kAuto did not run rows " << b0 << "-" << b1 - 1 << " as "
              << (prefill ? "prefill" : "decode")
              << (pool != nullptr ? " (2 threads)" : " (1 thread)");
        }
      }
    }
  }
  // Every part of every case on every thread count: 6 parts per dtype, 2 dtypes, 2 thread counts.
  if (TargetNow() != "SCALAR") {
    EXPECT_EQ(told_apart, 24);
  }
}

// Batched decode leaves each sequence's new tokens every k-th cell: decode reads those one-cell
// spans in place through a strided view (DecodeStrided) instead of copying them together first
// (DecodeGathered, AttentionKernelParams::copy_strided_spans). Both walk the same cells in the same
// order, so the outputs must agree bit for bit: steps 2 to 5 (row b sees the cells of sequence
// b % step after a shared run), blocks the steps do not divide, 1 to 8 query heads per KV head,
// B above the step (the batch's rows read the cells in between) and B 1 (they do not: no
// software prefetch), every dtype, 1 and 2 threads (chunks cut the runs). The reference check of
// the strided path itself is InterleavedSequencesWithBiases.
TEST_P(AttentionTest, StridedDecodeMatchesTheCopy) {
  ThreadPool pool2(2);
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int D = 64, Hkv = 2, L = 1500, shared = 203;
  for (auto [dt, perm] : DTypeLayouts()) {
    if (perm) continue;  // a permuted V row is one element per dimension line: no short spans
    TestHistory h = MakeHistory(dt, D, D, Hkv, L, false, rng);
    for (int step : {2, 3, 4, 5}) {
      for (auto [G, B] : {std::pair{1, step + 1}, {4, step + 1}, {8, step + 1}, {4, 1}}) {
        const int Hq = Hkv * G;
        std::vector<float> mask(static_cast<size_t>(L) * B, -kInf);
        for (int b = 0; b < B; ++b) {
          for (int j = 0; j < L; ++j) {
            if (j < shared || (j - shared) % step == b % step) mask[b * L + j] = -0.01f * (j % 7);
          }
        }
        std::vector<float> q(static_cast<size_t>(D) * B * Hq);
        for (float& x : q) x = u(rng);
        TensorView qv = MakeView(q.data(), DType::kF32, {D, B, Hq});
        TensorView mv = MakeView(mask.data(), DType::kF32, {L, B});
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
          SCOPED_TRACE(std::string(DTypeName(dt)) + " step " + std::to_string(step) + " G " +
                       std::to_string(G) + " B " + std::to_string(B) + " threads " +
                       (pool ? "2" : "1") + " target=" + TargetNow());
          std::vector<float> in_place(static_cast<size_t>(D) * B * Hq, 1.0f);
          std::vector<float> copied(in_place.size(), 2.0f);
          kernels::AttentionKernelParams kp;
          kp.scale = 0.125f;
          kp.mode = AttentionMode::kDecode;
          TensorView ov = MakeView(in_place.data(), DType::kF32, {D, B, Hq});
          ASSERT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, KernelParallelFor(pool), &ov));
          kp.copy_strided_spans = true;
          ov = MakeView(copied.data(), DType::kF32, {D, B, Hq});
          ASSERT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, KernelParallelFor(pool), &ov));
          EXPECT_EQ(in_place, copied);
          EXPECT_TRUE(std::all_of(in_place.begin(), in_place.end(),
                                  [](float x) { return std::isfinite(x) && x != 1.0f; }));
        }
      }
    }
  }
}

// Prefill over several sequences' cells: each task skips the cell tiles that none of its query
// rows can see (kernels/attention.cc, visible granules). Query tiles are 128 / G rows (at most 64),
// so B = 3 tiles puts one sequence in each; 1 and 2 threads.
TEST_P(AttentionTest, PrefillSkipsOnlyTilesNoRowSees) {
  ThreadPool pool2(2);
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    for (int G : {1, 4}) {
      Case c;
      c.dt = dt;
      c.perm = perm;
      c.G = G;
      c.B = 3 * std::min(64, 128 / G);
      c.L = 37 * 12 + 5 * (mi % 3);
      c.mask = MaskKind::kSequenceRuns;
      c.mask_dt = mi % 2 == 0 ? DType::kF32 : DType::kF16;
      ++mi;
      CheckCase(c, {{AttentionMode::kPrefill, nullptr}, {AttentionMode::kPrefill, &pool2}});
    }
  }
}

// Prefill does not read the mask in tiles of plain granules (every cell visible with a mask value
// of +-0) and reads it everywhere else: a causal mask with a few biased cells (kSparseBias), rows
// whose tiles start off the granules, query rows in blocks of 4 and the 1 to 3 left over (G 1, 3,
// 4 with B not a multiple of 4), f32 and f16 masks, 1 and 2 threads.
TEST_P(AttentionTest, PrefillAddsSparseBiasesInsidePlainMasks) {
  ThreadPool pool2(2);
  int mi = 0;
  for (auto [dt, perm] : DTypeLayouts()) {
    for (int G : {1, 3, 4}) {
      Case c;
      c.dt = dt;
      c.perm = perm;
      c.G = G;
      c.B = 41 + 2 * (mi % 3);
      c.L = 300 + 7 * (mi % 4);
      c.mask = MaskKind::kSparseBias;
      c.mask_dt = mi % 2 == 0 ? DType::kF32 : DType::kF16;
      ++mi;
      CheckCase(c, {{AttentionMode::kPrefill, nullptr}, {AttentionMode::kPrefill, &pool2}});
    }
  }
}

// The mask scan (attn::MaskRowBits, vectors of 1 to 32 elements by target) against a scalar look
// at every element: hidden (-inf) and nonzero (anything but +-0: biases, NaN, +inf, -inf) bits,
// for f32 and f16 masks, lengths around the vector and word sizes, rows b > 0; and the visible
// spans found from the bitmap (attn::ForEachClearRun) against a scalar walk (ForEachVisibleSpan).
TEST_P(AttentionTest, MaskRowBitsMatchEveryElement) {
  std::mt19937 rng(77);
  const float values[] = {0.0f, -0.0f, -kInf, -kInf, -1.5f, 2.0f, kInf, std::nanf(""), 1e-30f};
  for (DType mdt : {DType::kF32, DType::kF16}) {
    for (int L : {1, 3, 15, 16, 17, 31, 63, 64, 65, 100, 128, 129, 257, 1000}) {
      for (int trial = 0; trial < 4; ++trial) {
        const int B = 3;
        std::vector<uint8_t> mask(static_cast<size_t>(L) * B * BlockBytes(mdt));
        for (int b = 0; b < B; ++b) {
          // Runs of one value (as a cache's rows have), or every element drawn anew.
          float v = values[rng() % std::size(values)];
          for (int j = 0; j < L; ++j) {
            if (trial % 2 == 1 || rng() % 9 == 0) v = values[rng() % std::size(values)];
            StoreFromF32(mask.data(), mdt, static_cast<size_t>(b) * L + j, v);
          }
        }
        const TensorView mv = MakeView(mask.data(), mdt, {L, B});
        const int words = (L + 63) / 64;
        for (int b = 0; b < B; ++b) {
          std::vector<uint64_t> hidden(words, ~uint64_t{0}), nonzero(words, ~uint64_t{0});
          kernels::attn::MaskRowBits(mv, b, hidden.data(), nonzero.data());
          for (int j = 0; j < words * 64; ++j) {
            const float x = j < L ? kernels::attn::MaskValue(mv, b, j) : 0.0f;
            const bool want_hidden = j < L && x == -kInf;
            const bool want_nonzero = j < L && !(x == 0.0f);
            ASSERT_EQ((hidden[j / 64] >> (j % 64)) & 1, want_hidden ? 1u : 0u)
                << "L=" << L << " b=" << b << " j=" << j;
            ASSERT_EQ((nonzero[j / 64] >> (j % 64)) & 1, want_nonzero ? 1u : 0u)
                << "L=" << L << " b=" << b << " j=" << j << " x=" << x;
          }
          std::vector<std::pair<int64_t, int64_t>> got, want;
          kernels::attn::ForEachClearRun(hidden.data(), L,
                                         [&](int64_t s0, int64_t s1) { got.emplace_back(s0, s1); });
          ForEachVisibleSpan(
              L, [&](int64_t j) { return kernels::attn::MaskValue(mv, b, j) == -kInf; },
              [&](int64_t s0, int64_t s1) { want.emplace_back(s0, s1); });
          ASSERT_EQ(got, want) << "L=" << L << " b=" << b;
        }
      }
    }
  }
}

// MaskBits writes every row's MaskRowBits, on one thread or split over two.
TEST_P(AttentionTest, MaskBitsAreEachRowsMaskRowBits) {
  ThreadPool pool2(2);
  std::mt19937 rng(78);
  for (DType mdt : {DType::kF32, DType::kF16}) {
    for (int L : {1, 63, 64, 65, 1000}) {
      for (int B : {1, 15, 40}) {
        SCOPED_TRACE(std::string(DTypeName(mdt)) + " L=" + std::to_string(L) +
                     " B=" + std::to_string(B));
        std::vector<uint8_t> mask = BuildTestMask(MaskKind::kSparseBias, L, B, mdt, rng);
        // Some NaN and +inf among them: nonzero, not hidden.
        for (int i = 0; i < 5; ++i) {
          StoreFromF32(mask.data(), mdt, rng() % (static_cast<size_t>(L) * B),
                       i % 2 ? kInf : std::nanf(""));
        }
        const TensorView mv = MakeView(mask.data(), mdt, {L, B});
        const int64_t row_words = kernels::MaskBitsRowWords(L);
        std::vector<uint64_t> want(static_cast<size_t>(row_words) * B);
        for (int b = 0; b < B; ++b) {
          kernels::attn::MaskRowBits(mv, b, &want[b * row_words],
                                     &want[b * row_words] + row_words / 2);
        }
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
          std::vector<uint64_t> got(want.size(), 0x5555555555555555u);
          kernels::MaskBits(mv, KernelParallelFor(pool), got.data());
          EXPECT_EQ(got, want) << (pool != nullptr ? "2 threads" : "1 thread");
        }
      }
    }
  }
}

// Given the mask's bits (AttentionKernelParams::mask_bits), the call finds the visible cells from
// them and not from the mask: over a mask of zeros, the bits of a mask that hides the first half of
// every row give that mask's output, bit for bit, in every mode, on 1 and 2 threads, for one row,
// for 32 (kAuto chooses after the scan) and for 130 (rows in groups: each group gets its rows'
// bits). Half is whole tiles, so prefill reads no mask value there either (a tile is either wholly
// hidden or in plain granules). A kernel that ignored the bits would see every cell.
TEST_P(AttentionTest, MaskBitsDecideWhatIsVisible) {
  ThreadPool pool2(2);
  constexpr int kD = 64, kHkv = 2, kG = 2, kHq = kHkv * kG, kL = 512;
  std::mt19937 rng(79);
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    TestHistory h = MakeHistory(dt, kD, kD, kHkv, kL, false, rng);
    for (int B : {1, 32, 130}) {
      std::vector<float> q = RandomQueries(kD, B, kHq, rng);
      // Row b sees [kL / 2, kL / 2 + 1 + b % (kL / 2)): causal-like, each row its own length.
      std::vector<float> half = RowRangeMask(kL, B, [&](int b) {
        return std::pair{kL / 2, kL / 2 + 1 + b % (kL / 2)};
      });
      std::vector<float> zeros(half.size(), 0.0f);
      for (size_t i = 0; i < zeros.size(); ++i) {
        if (i % kL >= kL / 2 && half[i] == -kInf) zeros[i] = -kInf;  // the second half as `half`
      }
      const TensorView qv = MakeView(q.data(), DType::kF32, {kD, B, kHq});
      const TensorView half_v = MakeView(half.data(), DType::kF32, {kL, B});
      const TensorView zeros_v = MakeView(zeros.data(), DType::kF32, {kL, B});
      std::vector<uint64_t> bits(static_cast<size_t>(B * kernels::MaskBitsRowWords(kL)));
      kernels::MaskBits(half_v, kernels::ParallelForFn{}, bits.data());
      for (AttentionMode mode :
           {AttentionMode::kAuto, AttentionMode::kDecode, AttentionMode::kPrefill}) {
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool2}) {
          SCOPED_TRACE(std::string(DTypeName(dt)) + " B=" + std::to_string(B) +
                       " mode=" + std::to_string(static_cast<int>(mode)) +
                       (pool != nullptr ? " 2 threads" : " 1 thread"));
          kernels::AttentionKernelParams kp;
          kp.scale = 0.125f;
          kp.mode = mode;
          const kernels::ParallelForFn pf = KernelParallelFor(pool);
          std::vector<float> want(static_cast<size_t>(kD) * B * kHq), got(want.size(), 7.0f);
          TensorView want_v = MakeView(want.data(), DType::kF32, {kD, B, kHq});
          TensorView got_v = MakeView(got.data(), DType::kF32, {kD, B, kHq});
          ASSERT_TRUE(kernels::Attention(qv, h.k, h.v, half_v, kp, pf, &want_v));
          kp.mask_bits = bits.data();
          ASSERT_TRUE(kernels::Attention(qv, h.k, h.v, zeros_v, kp, pf, &got_v));
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
        }
      }
    }
  }
}

// Decode zeroes a row's partial sums in a chunk only when the row has cells there, and the merge
// never reads the sums of a chunk where the row saw nothing: a call that leaves NaN in every
// partial (a NaN query) followed by one whose rows see cells in some chunks only (three groups of
// rows, each seeing 300 cells of its own quarter of 4096 cells, none in the first; 2 threads cut
// each head into 4 chunks) must give the reference's output, with no NaN from the first call.
TEST_P(AttentionTest, DecodeReadsNoPartialsOfChunksARowDoesNotSee) {
  ThreadPool pool2(2);
  constexpr int kD = 64, kHkv = 2, kG = 4, kHq = kHkv * kG, kL = 4096, kB = 8;
  std::mt19937 rng(80);
  for (DType dt : {DType::kF16, DType::kQ8_0}) {
    SCOPED_TRACE(DTypeName(dt));
    TestHistory h = MakeHistory(dt, kD, kD, kHkv, kL, false, rng);
    const kernels::ParallelForFn pf = KernelParallelFor(&pool2);
    kernels::AttentionKernelParams kp;
    kp.scale = 0.125f;
    kp.mode = AttentionMode::kDecode;
    std::vector<float> out(static_cast<size_t>(kD) * kB * kHq);
    TensorView ov = MakeView(out.data(), DType::kF32, {kD, kB, kHq});
    std::vector<float> nan_q(out.size(), std::nanf(""));
    std::vector<float> zeros(static_cast<size_t>(kL) * kB, 0.0f);
    ASSERT_TRUE(kernels::Attention(MakeView(nan_q.data(), DType::kF32, {kD, kB, kHq}), h.k, h.v,
                                   MakeView(zeros.data(), DType::kF32, {kL, kB}), kp, pf, &ov));
    ASSERT_TRUE(std::isnan(out[0]));
    std::vector<float> q = RandomQueries(kD, kB, kHq, rng);
    std::vector<float> mask = RowRangeMask(kL, kB, [&](int b) {
      const int from = (1 + b % 3) * kL / 4 + 7 * b;
      return std::pair{from, from + 300};
    });
    const TensorView qv = MakeView(q.data(), DType::kF32, {kD, kB, kHq});
    const TensorView mv = MakeView(mask.data(), DType::kF32, {kL, kB});
    ASSERT_TRUE(kernels::Attention(qv, h.k, h.v, mv, kp, pf, &ov));
    std::vector<float> ref(out.size());
    TensorView rv = MakeView(ref.data(), DType::kF32, {kD, kB, kHq});
    kernels::AttentionRef(qv, h.k, h.v, mv, kp, &rv);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], ref[i], 2e-5) << "i=" << i;  // q8_0: 24-bit query, ~1e-6 here
    }
  }
}

// A fully masked row outputs exact zeros (no NaN) with and without sinks; L == 0 likewise.
TEST_P(AttentionTest, FullyMaskedRowsAreZero) {
  std::mt19937 rng(7);
  for (auto [dt, perm] : DTypeLayouts()) {
    TestHistory h = MakeHistory(dt, 64, 64, 2, 50, perm, rng);
    std::vector<float> q(64 * 2 * 4, 0.5f), out(64 * 2 * 4, 99.0f);
    std::vector<float> mask(50 * 2, -kInf);
    mask[50 + 10] = 0.0f;  // row 1 sees one cell
    float sinks[4] = {1.0f, -1.0f, 0.0f, 3.0f};
    for (const float* sk : {static_cast<const float*>(nullptr), static_cast<const float*>(sinks)}) {
      for (AttentionMode mode : {AttentionMode::kDecode, AttentionMode::kPrefill}) {
        kernels::AttentionKernelParams kp;
        kp.scale = 0.125f;
        kp.sinks = sk;
        kp.v_permuted = perm;
        kp.mode = mode;
        TensorView ov = MakeView(out.data(), DType::kF32, {64, 2, 4});
        EXPECT_TRUE(kernels::Attention(MakeView(q.data(), DType::kF32, {64, 2, 4}), h.k, h.v,
                                       MakeView(mask.data(), DType::kF32, {50, 2}), kp, {}, &ov));
        for (int hq = 0; hq < 4; ++hq) {
          for (int d = 0; d < 64; ++d) {
            EXPECT_EQ(out[(hq * 2 + 0) * 64 + d], 0.0f);
            const float v1 = out[(hq * 2 + 1) * 64 + d];
            ASSERT_TRUE(std::isfinite(v1));
            // Row 1: one visible cell, so out = V[10] * (1 / (1 + exp(sink - logit))) or V[10].
            if (sk == nullptr) {
              std::vector<float> vr(64);
              if (perm) {
                vr[d] = LoadAsF32(static_cast<char*>(h.v.data) + (hq / 2) * h.v.nb[2] +
                                      d * h.v.nb[1] + 10 * h.v.nb[0],
                                  dt, 0);
              } else {
                LoadRowAsF32(RowPtr(h.v, hq / 2, 10), 64, dt, vr.data());
              }
              EXPECT_NEAR(v1, vr[d], 1e-6);
            }
          }
        }
      }
    }
  }
}

// The Attend overloads: validation messages and the thread counts.
TEST(AttendTest, ValidatesAndRuns) {
  std::mt19937 rng(3);
  TestHistory h = MakeHistory(DType::kF16, 64, 64, 2, 100, false, rng);
  std::vector<float> q(64 * 1 * 8, 0.1f), out(64 * 1 * 8), out2(64 * 1 * 8);
  std::vector<float> mask(100, 0.0f);
  History hist{h.k, h.v, MakeView(mask.data(), DType::kF32, {100, 1})};
  TensorView qv = MakeView(q.data(), DType::kF32, {64, 1, 8});
  TensorView ov = MakeView(out.data(), DType::kF32, {64, 1, 8});
  AttentionParams p;
  ASSERT_TRUE(Attend(qv, hist, p, &ov).ok());
  ThreadPool pool(2);
  TensorView ov2 = MakeView(out2.data(), DType::kF32, {64, 1, 8});
  ASSERT_TRUE(Attend(qv, hist, p, &ov2, &pool).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], out2[i], 1e-6);

  TensorView bad_q = MakeView(q.data(), DType::kF32, {32, 1, 16});
  Status s = Attend(bad_q, hist, p, &ov);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("head_dim"), std::string::npos) << s.message();
  TensorView q7 = MakeView(q.data(), DType::kF32, {64, 1, 7});
  TensorView o7 = MakeView(out.data(), DType::kF32, {64, 1, 7});
  s = Attend(q7, hist, p, &o7);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("multiple"), std::string::npos) << s.message();
  History wrong_mask = hist;
  wrong_mask.mask.ne[0] = 99;
  EXPECT_EQ(Attend(qv, wrong_mask, p, &ov).code(), Code::kInvalidArgument);
  TensorView bad_out = MakeView(out.data(), DType::kF32, {64, 2, 8});
  EXPECT_EQ(Attend(qv, hist, p, &bad_out).code(), Code::kInvalidArgument);
  EXPECT_EQ(Attend(qv, hist, p, nullptr).code(), Code::kInvalidArgument);
  // Empty history: zeros.
  History empty = hist;
  empty.k.ne[2] = 0;
  empty.v.ne[2] = 0;
  empty.mask.ne[0] = 0;
  ASSERT_TRUE(Attend(qv, empty, p, &ov).ok());
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

// The double reference that every kernel test trusts, against the definition written out one
// query head at a time (the reference forms several heads' sums side by side, for speed): f32 K/V,
// random masks with hidden cells and whole hidden rows, softcap, sinks, groups of 1-9 heads, and a
// NaN / inf in K (a poisoned row). Equal within 1e-12 of the output's scale.
TEST(AttentionRefTest, MatchesTheDefinitionWrittenOut) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int it = 0; it < 60; ++it) {
    const int D = it % 2 ? 40 : 64, Hkv = 1 + it % 3, G = 1 + it % 9, L = 1 + (it * 37) % 200;
    const int B = 1 + it % 4, Hq = Hkv * G;
    std::vector<float> k(static_cast<size_t>(D) * Hkv * L), v(k.size()), sinks(Hq);
    std::vector<float> q(static_cast<size_t>(D) * B * Hq), mask(static_cast<size_t>(L) * B);
    for (float& x : k) x = u(rng);
    for (float& x : v) x = u(rng);
    for (float& x : q) x = u(rng);
    for (float& x : sinks) x = u(rng);
    for (float& x : mask) x = u(rng) < -0.6f ? -kInf : (u(rng) < 0.0f ? u(rng) : 0.0f);
    if (B > 1) std::fill_n(mask.begin(), L, -kInf);  // row 0 sees nothing
    if (it % 7 == 3)
      k[static_cast<size_t>(it) % k.size()] =
          it % 2 ? std::numeric_limits<float>::quiet_NaN() : kInf;
    kernels::AttentionKernelParams kp;
    kp.scale = 0.2f;
    kp.softcap = it % 4 == 0 ? 5.0f : 0.0f;
    kp.sinks = it % 3 == 0 ? sinks.data() : nullptr;
    std::vector<float> out(static_cast<size_t>(D) * B * Hq);
    TensorView ov = MakeView(out.data(), DType::kF32, {D, B, Hq});
    kernels::AttentionRef(MakeView(q.data(), DType::kF32, {D, B, Hq}),
                          MakeView(k.data(), DType::kF32, {D, Hkv, L}),
                          MakeView(v.data(), DType::kF32, {D, Hkv, L}),
                          MakeView(mask.data(), DType::kF32, {L, B}), kp, &ov);
    for (int hq = 0; hq < Hq; ++hq) {
      const int h = hq / G;
      for (int b = 0; b < B; ++b) {
        std::vector<double> s(L, -std::numeric_limits<double>::infinity());
        double m = kp.sinks ? kp.sinks[hq] : -std::numeric_limits<double>::infinity();
        bool nan_row = false;
        for (int j = 0; j < L; ++j) {
          const float mv = mask[static_cast<size_t>(b) * L + j];
          if (mv == -kInf) continue;
          double dot = 0;
          for (int d = 0; d < D; ++d) {
            dot += double{q[(static_cast<size_t>(hq) * B + b) * D + d]} *
                   k[(static_cast<size_t>(j) * Hkv + h) * D + d];
          }
          double logit = kp.scale * dot;
          if (kp.softcap != 0) logit = kp.softcap * std::tanh(logit / kp.softcap);
          s[j] = logit + mv;
          nan_row = nan_row || !(s[j] < std::numeric_limits<double>::infinity());
          m = std::max(m, s[j]);
        }
        const float* o = &out[(static_cast<size_t>(hq) * B + b) * D];
        for (int d = 0; d < D; ++d) {
          double num = 0, den = kp.sinks ? std::exp(kp.sinks[hq] - m) : 0.0;
          for (int j = 0; j < L; ++j) {
            if (s[j] == -std::numeric_limits<double>::infinity()) continue;
            const double p = std::exp(s[j] - m);
            den += p;
            num += p * v[(static_cast<size_t>(j) * Hkv + h) * D + d];
          }
          const double want = nan_row ? std::nan("") : (den > 0 ? num / den : 0.0);
          if (nan_row) {
            ASSERT_TRUE(std::isnan(o[d])) << "it " << it << " hq " << hq << " b " << b;
          } else {
            ASSERT_NEAR(o[d], want, 1e-12 * 2.0 + 1e-7 * std::fabs(want))
                << "it " << it << " hq " << hq << " b " << b << " d " << d;
          }
        }
      }
    }
  }
}

// K and V of different dtypes (an encoder stores what it is given): Attend widens the one(s) that
// are not f32 to f32 and runs the f32 kernel, so the result is the reference's over the stored
// values, within the bound at the top of this file: |V| <= 1, |q|, |k| <= 1, D = 64, scale 1/8
// give S_max <= 8, dlogit = 4 * 8 * 2^-24 * 8 < 1.6e-5, tol = 2 * dlogit + 2e-6 < 3.5e-5. Every
// ordered pair of distinct dtypes, plain and (float V) permuted V, decode (B 1) and prefill (B 9),
// 1 and 2 threads; then no allocation once the buffer has grown.
TEST(AttendTest, MixedKVDTypesMatchTheReference) {
  const DType kAll[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};
  constexpr int D = 64, Hkv = 2, Hq = 8, L = 150;
  constexpr double kTol = 3.5e-5;
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  ThreadPool pool(2);
  int cases = 0;
  for (DType kd : kAll) {
    for (DType vd : kAll) {
      if (kd == vd) continue;
      for (bool perm : {false, true}) {
        if (perm && IsQuantized(vd)) continue;
        TestHistory hk = MakeHistory(kd, D, D, Hkv, L, false, rng);
        TestHistory hv = MakeHistory(vd, D, D, Hkv, L, perm, rng);
        for (int B : {1, 9}) {
          std::vector<float> q(static_cast<size_t>(D) * B * Hq), mask(static_cast<size_t>(L) * B);
          for (float& x : q) x = u(rng);
          for (float& x : mask) x = u(rng) < -0.4f ? -kInf : 0.0f;
          if (B > 1) {  // the last row sees nothing
            for (int j = 0; j < L; ++j) mask[static_cast<size_t>(B - 1) * L + j] = -kInf;
          }
          History hist{hk.k, hv.v, MakeView(mask.data(), DType::kF32, {L, B})};
          TensorView qv = MakeView(q.data(), DType::kF32, {D, B, Hq});
          std::vector<float> out(q.size()), out2(q.size()), ref(q.size());
          TensorView ov = MakeView(out.data(), DType::kF32, {D, B, Hq});
          TensorView ov2 = MakeView(out2.data(), DType::kF32, {D, B, Hq});
          TensorView rv = MakeView(ref.data(), DType::kF32, {D, B, Hq});
          ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov).ok());
          ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov2, &pool).ok());
          kernels::AttentionKernelParams kp;
          kp.scale = 0.125f;
          kp.v_permuted = perm;
          kernels::AttentionRef(qv, hist.k, hist.v, hist.mask, kp, &rv);
          for (size_t i = 0; i < ref.size(); ++i) {
            ASSERT_NEAR(out[i], ref[i], kTol)
                << DTypeName(kd) << " / " << DTypeName(vd) << (perm ? " permuted" : "")
                << " B=" << B << " i=" << i;
            ASSERT_NEAR(out2[i], ref[i], kTol) << "2 threads";
          }
          // The fully masked last row is zeros, as for one dtype.
          for (int hq = 0; hq < Hq && B > 1; ++hq)
            for (int d = 0; d < D; ++d)
              ASSERT_EQ(out[(static_cast<size_t>(hq) * B + (B - 1)) * D + d], 0.0f);
          ++cases;
          if (kd == DType::kQ4_0 && vd == DType::kF16 && B == 9 && heap_hooks::MallocHooked()) {
            EXPECT_EQ(AllocationsDuring([&] {
                        for (int i = 0; i < 3; ++i)
                          ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov).ok());
                      }),
                      0)
                << "the f32 copy is reused";
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 2 * (20 + 4 * 3));  // 20 ordered pairs plain, 12 with a float V permuted
  // A quantized V needs its own head_dim to be a multiple of 32, whatever K is.
  TestHistory k48 = MakeHistory(DType::kF32, 48, 48, Hkv, L, false, rng);
  TestHistory v48 = MakeHistory(DType::kF16, 48, 48, Hkv, L, false, rng);
  std::vector<float> q(48 * Hq), out(48 * Hq);
  TensorView qv = MakeView(q.data(), DType::kF32, {48, 1, Hq});
  TensorView ov = MakeView(out.data(), DType::kF32, {48, 1, Hq});
  History ok48{k48.k, v48.v, TensorView{}};
  EXPECT_TRUE(Attend(qv, ok48, AttentionParams{}, &ov).ok());
  History bad48 = ok48;
  bad48.v.dtype = DType::kQ8_0;
  bad48.v.nb[0] = BlockBytes(DType::kQ8_0);
  const Status s = Attend(qv, bad48, AttentionParams{}, &ov);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("multiples of 32"), std::string::npos) << s.message();
}

// Views may broadcast (stride 0), so a history of one K and one V row can declare any length. The
// f32 copy that a mixed-dtype history needs is kOutOfMemory where it cannot fit in memory, before
// anything is allocated. Before, its size was an unchecked product that wrapped (2^64 + 128
// floats to 128 here), and the copy wrote far past a buffer of that size.
TEST(AttendTest, MixedKVDTypesBeyondTheAddressSpaceAreOutOfMemory) {
  constexpr int D = 64, Hkv = 2, Hq = 2;
  std::vector<uint16_t> k_row(D, 0x3C00);  // f16 1.0: the f16 row, as K or as V
  std::vector<float> v_row(D, 1.0f), q(D * Hq, 0.5f), out(q.size(), 7.0f);
  const TensorView qv = MakeView(q.data(), DType::kF32, {D, 1, Hq});
  TensorView ov = MakeView(out.data(), DType::kF32, {D, 1, Hq});
  // 2^57 + 1 cells: 2^64 + 128 floats per copy, which wrapped to 128. 2^54: 2^61 floats, beyond
  // SIZE_MAX / 16 on 64 bits.
  for (const int64_t L : {(int64_t{1} << 57) + 1, int64_t{1} << 54, int64_t{1} << 30}) {
    if (L == int64_t{1} << 30 && sizeof(size_t) == 8) continue;  // 2^37 floats fit on 64 bits
    for (const bool k_is_f16 : {true, false}) {  // the K copy's count, then the V copy's
      const TensorView f16 = MakeView(k_row.data(), DType::kF16, {D, Hkv, L});
      const TensorView f32 = MakeView(v_row.data(), DType::kF32, {D, Hkv, L});
      History h{k_is_f16 ? f16 : f32, k_is_f16 ? f32 : f16, TensorView{}};
      for (TensorView* t : {&h.k, &h.v}) t->nb[1] = t->nb[2] = t->nb[3] = 0;
      EXPECT_EQ(Attend(qv, h, AttentionParams{}, &ov).code(), Code::kOutOfMemory)
          << L << (k_is_f16 ? " f16 K" : " f16 V");
    }
  }
  for (float x : out) EXPECT_EQ(x, 7.0f);
}

// After a first call of a given shape has sized the scratch, Attend allocates nothing (decode and
// prefill, on the calling thread; pool workers keep one thread_local buffer each the same way).
TEST(AttendTest, NoAllocationInSteadyState) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  std::mt19937 rng(11);
  for (int B : {1, 3, 64}) {
    TestHistory h = MakeHistory(DType::kQ8_0, 128, 128, 2, 300, false, rng);
    std::vector<float> q(128 * B * 8, 0.1f), out(128 * B * 8);
    std::vector<uint16_t> mask(300 * B, 0);
    History hist{h.k, h.v, MakeView(mask.data(), DType::kF16, {300, B})};
    TensorView qv = MakeView(q.data(), DType::kF32, {128, B, 8});
    TensorView ov = MakeView(out.data(), DType::kF32, {128, B, 8});
    ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov).ok());
    EXPECT_EQ(AllocationsDuring([&] {
                for (int i = 0; i < 3; ++i)
                  ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov).ok());
              }),
              0)
        << "B=" << B;
  }
}

// A [D, T, H, B] sequence-cache view, passed per batch entry as ne = {D, H, T}.
TEST(AttendTest, SequenceLayoutView) {
  const int D = 64, T = 33, H = 2, Bseq = 2;
  SequenceBlockLayout sl = MakeSequenceBlockLayout(DType::kBF16, D, H, Bseq, 40);
  std::vector<uint8_t> kb(sl.bytes), vb(sl.bytes);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> row(D);
  for (int b = 0; b < Bseq; ++b)
    for (int hh = 0; hh < H; ++hh)
      for (int t = 0; t < T; ++t) {
        for (float& x : row) x = u(rng);
        StoreRowFromF32(row.data(), D, DType::kBF16, kb.data() + SequenceRowOffset(sl, b, hh, t));
        for (float& x : row) x = u(rng);
        StoreRowFromF32(row.data(), D, DType::kBF16, vb.data() + SequenceRowOffset(sl, b, hh, t));
      }
  for (int b = 0; b < Bseq; ++b) {
    TensorView k4 = SequenceBlockView(sl, kb.data(), 0, T);
    TensorView v4 = SequenceBlockView(sl, vb.data(), 0, T);
    auto per_entry = [&](TensorView v4v) {
      TensorView t = v4v;
      t.data = static_cast<char*>(v4v.data) + b * v4v.nb[3];
      t.ne[1] = H;
      t.ne[2] = T;
      t.nb[1] = v4v.nb[2];
      t.nb[2] = v4v.nb[1];
      t.ne[3] = 1;
      return t;
    };
    History hist{per_entry(k4), per_entry(v4), TensorView{}};
    std::vector<float> q(D * 1 * 4), out(D * 4), ref(D * 4);
    for (float& x : q) x = u(rng);
    TensorView qv = MakeView(q.data(), DType::kF32, {D, 1, 4});
    TensorView ov = MakeView(out.data(), DType::kF32, {D, 1, 4});
    TensorView rv = MakeView(ref.data(), DType::kF32, {D, 1, 4});
    ASSERT_TRUE(Attend(qv, hist, AttentionParams{}, &ov).ok());
    kernels::AttentionKernelParams kp;
    kp.scale = 0.125f;
    kernels::AttentionRef(qv, hist.k, hist.v, hist.mask, kp, &rv);
    for (int i = 0; i < D * 4; ++i) EXPECT_NEAR(out[i], ref[i], 2e-5);
  }
}

// Decode's prefetch plan (kernels/attention_internal.h) over a task's pieces, as DecodeCells
// carries it out: the K pass asks for the piece's K rows [ready, n) and V rows [v_ready, n), the V
// pass for K rows [next_from, next_to). Every row a piece reads must have been asked for by the
// time it runs, none twice, and none outside the task (an asm prefetch names its address as a
// memory operand: it must stay inside the history).
// The prefill's granule bitmap: ranges across word boundaries, single bits, whole words.
TEST(PrefillGranules, SetBitsAnyBitAndAllBitsAgreeWithABoolArray) {
  constexpr int kBits = 200;
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    uint64_t words[(kBits + 63) / 64] = {};
    bool ref[kBits] = {};
    for (int k = 0; k < 3; ++k) {
      const int a = static_cast<int>(rng() % kBits), b = static_cast<int>(rng() % kBits);
      // Odd trials: shorter ranges (half as long), so that more of the bits stay clear.
      const int first = std::min(a, b);
      const int last = first + (std::max(a, b) - first) / (1 + trial % 2);
      kernels::attn::SetBits(words, first, last);
      for (int i = first; i <= last; ++i) ref[i] = true;
    }
    for (int first : {0, 1, 62, 63, 64, 65, 127, 128, 150, 199}) {
      for (int len : {1, 2, 3, 17, 64, 65, 200}) {
        const int last = std::min(kBits - 1, first + len - 1);
        bool any = false;
        for (int i = first; i <= last; ++i) any = any || ref[i];
        ASSERT_EQ(kernels::attn::AnyBit(words, first, last), any) << first << ".." << last;
        bool all = true;
        for (int i = first; i <= last; ++i) all = all && ref[i];
        ASSERT_EQ(kernels::attn::AllBits(words, first, last), all) << first << ".." << last;
      }
    }
  }
}

TEST(DecodePrefetchPlan, AsksForEveryRowOnceWithinTheTask) {
  struct Piece {
    int64_t s0, n;
  };
  const auto walk = [](int64_t lo, int64_t hi, const std::vector<Piece>& pieces) {
    std::vector<int> k_asked(static_cast<size_t>(hi + 300), 0), v_asked(k_asked.size(), 0);
    kernels::attn::RequestedRows asked{lo, lo};
    for (const Piece& p : pieces) {
      SCOPED_TRACE(::testing::Message() << "piece " << p.s0 << " +" << p.n);
      const kernels::attn::KPrefetch kp = kernels::attn::PlanKPrefetch(p.s0, p.n, hi, asked);
      ASSERT_GE(kp.ready, 0);
      ASSERT_LE(kp.ready, p.n);
      for (int64_t r = kp.ready; r < p.n; ++r) ++k_asked[p.s0 + r];
      for (int64_t r = kp.v_ready; r < p.n; ++r) ++v_asked[p.s0 + r];
      for (int64_t r = 0; r < p.n; ++r) {
        EXPECT_GE(k_asked[p.s0 + r], 1) << "K row " << p.s0 + r << " read, never asked for";
        EXPECT_GE(v_asked[p.s0 + r], 1) << "V row " << p.s0 + r << " read, never asked for";
      }
      for (int64_t r = kp.next_from; r < kp.next_to; ++r) ++k_asked[p.s0 + r];
    }
    for (size_t row = 0; row < k_asked.size(); ++row) {
      const bool inside = static_cast<int64_t>(row) >= lo && static_cast<int64_t>(row) < hi;
      EXPECT_LE(k_asked[row], inside ? 1 : 0) << "K row " << row;
      EXPECT_LE(v_asked[row], inside ? 1 : 0) << "V row " << row;
    }
  };
  // One row, whole blocks, a task ending inside a block.
  walk(0, 300, {{0, 128}, {128, 128}, {256, 44}});
  // Two batch rows visiting each block (batched decode), a task that starts at 512.
  walk(512, 896, {{512, 128}, {512, 128}, {640, 128}, {640, 128}, {768, 128}, {768, 128}});
  // Masked gaps and short pieces: rows skipped by the mask may be asked for, none twice.
  walk(0, 400, {{0, 100}, {140, 116}, {256, 10}, {300, 90}, {300, 20}});
  // A piece that starts far beyond what was asked for (a long masked run).
  walk(0, 1024, {{0, 64}, {700, 128}, {828, 100}});
}

// Decode's prefetch cursor (kernels/attention_internal.h) spreads its lines evenly over the steps
// it is given: by the last step every line is asked for, exactly once, and no step runs ahead of
// its share (requests asked for all at once outran the memory: session 16, head_dim 128 V passes).
// Spread re-spreads what is left over a new count of steps.
TEST(DecodeLineCursor, SpreadsEveryLineOverTheSteps) {
  alignas(64) static char buf[64 * 600];
  const auto lines_asked = [](const kernels::attn::LineCursor& lc, const char* from) {
    return (std::min(lc.next, lc.end) - from + 63) / 64;
  };
  for (const int64_t lines : {1, 3, 64, 128, 512}) {
    for (const int64_t steps : {1, 5, 128, 256, 1000}) {
      SCOPED_TRACE(::testing::Message() << lines << " lines over " << steps << " steps");
      // The range starts mid-line: its first line counts.
      const char* from = buf + 64 + 8;
      const char* aligned = buf + 64;
      auto lc = kernels::attn::LineCursor::Over(from, aligned + 64 * lines, steps, true);
      for (int64_t k = 1; k <= steps; ++k) {
        lc.Issue();
        const int64_t share = (k * lines + steps - 1) / steps;
        ASSERT_LE(lines_asked(lc, aligned), share) << "step " << k;
        ASSERT_GE(lines_asked(lc, aligned), k * lines / steps) << "step " << k;
      }
      EXPECT_EQ(lines_asked(lc, aligned), lines);
      lc.Issue();  // nothing left: no line past the end
      EXPECT_EQ(lines_asked(lc, aligned), lines);
    }
  }
  // Half the steps done, the rest re-spread over 4x as many steps.
  auto lc = kernels::attn::LineCursor::Over(buf, buf + 64 * 512, 128, false);
  for (int k = 0; k < 64; ++k) lc.Issue();
  EXPECT_EQ(lc.next, buf + 64 * 256);
  lc.Spread(512);
  for (int k = 1; k <= 512; ++k) {
    lc.Issue();
    ASSERT_LE(lc.next - (buf + 64 * 256), 64 * ((k * 256 + 511) / 512)) << "step " << k;
  }
  EXPECT_EQ(lc.next, buf + 64 * 512);
  // Empty ranges ask for nothing.
  auto none = kernels::attn::LineCursor::Over(buf + 64, buf + 64, 10, true);
  none.Issue();
  EXPECT_EQ(none.next, nullptr);
}

// Decode's row cursor (strided views, kernels/attention_internal.h): one row per Issue, each row's
// lines exactly (rows that straddle lines included), the rows between them never; nothing past the
// last row.
TEST(DecodeRowCursor, AsksForItsOwnRowsOnly) {
  alignas(64) static char buf[64 * 200];
  for (const size_t bytes : {size_t{34}, size_t{68}, size_t{128}, size_t{160}}) {
    for (const size_t offset : {size_t{0}, size_t{2}, size_t{60}}) {
      SCOPED_TRACE(::testing::Message() << bytes << "-byte rows at +" << offset);
      const size_t stride = 4 * bytes;  // every 4th row of a packed block
      std::vector<int> asked(sizeof(buf) / 64, 0);
      std::vector<int> wanted(asked.size(), 0);
      constexpr int64_t kRows = 9;
      for (int64_t r = 0; r < kRows; ++r) {
        const size_t first = offset + r * stride, last = first + bytes - 1;
        for (size_t line = first / 64; line <= last / 64; ++line) wanted[line] = 1;
      }
      kernels::attn::RowCursor rc{buf + offset, kRows, stride, bytes, false};
      for (int64_t r = 0; r < kRows; ++r) {
        ASSERT_EQ(rc.next, buf + offset + r * stride);
        kernels::attn::RowCursor::ForEachLine(rc.next, rc.bytes, [&](const char* line) {
          ASSERT_EQ(reinterpret_cast<uintptr_t>(line) % 64, 0u);
          ++asked[static_cast<size_t>(line - buf) / 64];
        });
        rc.Issue();
      }
      EXPECT_EQ(rc.rows, 0);
      const char* end = rc.next;
      rc.Issue();  // nothing left
      EXPECT_EQ(rc.next, end);
      for (size_t line = 0; line < asked.size(); ++line) {
        // A line shared by two rows (rows closer than a line apart) is asked for by each.
        EXPECT_EQ(asked[line] > 0, wanted[line] == 1) << "line " << line;
      }
    }
  }
}

// The decode walk found once per call (kernels/decode_plan.h), built from span lists as Attention
// builds them from a mask.
struct PlanSpans {
  std::vector<int32_t> spans;     // pairs, row after row
  std::vector<int64_t> span_off;  // B + 1
};

// Row b sees cell j where visible(b, j); the rows' maximal visible runs.
template <class Visible>
PlanSpans SpansOf(int64_t B, int64_t L, const Visible& visible) {
  PlanSpans ps;
  ps.span_off.push_back(0);
  for (int64_t b = 0; b < B; ++b) {
    ForEachVisibleSpan(
        L, [&](int64_t j) { return !visible(b, j); },
        [&](int64_t s0, int64_t s1) {
          ps.spans.push_back(static_cast<int32_t>(s0));
          ps.spans.push_back(static_cast<int32_t>(s1));
        });
    ps.span_off.push_back(static_cast<int64_t>(ps.spans.size() / 2));
  }
  return ps;
}

struct Plan {
  std::vector<kernels::DecodeStep> steps;
  std::vector<int64_t> step_off;
  std::vector<int64_t> chunk_bounds;  // chunk k: cells [chunk_bounds[k], chunk_bounds[k + 1])
};

// Chunks of `chunk` cells (the last shorter), or with `balanced` as many placed by
// BalanceDecodeChunks, as Attention does.
Plan BuildPlan(const PlanSpans& ps, int64_t B, int64_t L, int64_t chunk, bool v_permuted,
               bool combine_rows, bool copy_strided, bool balanced = false) {
  kernels::DecodePlanInput in;
  in.spans = ps.spans.data();
  in.span_off = ps.span_off.data();
  in.B = B;
  in.L = L;
  in.n_chunks = std::max<int64_t>(1, (L + chunk - 1) / chunk);
  in.v_permuted = v_permuted;
  in.combine_rows = combine_rows;
  in.copy_strided = copy_strided;
  Plan plan;
  plan.chunk_bounds.resize(static_cast<size_t>(in.n_chunks + 1));
  if (balanced) {
    std::vector<double> work(static_cast<size_t>(L / kernels::kDecodeBlockCells + 1));
    kernels::BalanceDecodeChunks(in.spans, in.span_off, B, L, in.n_chunks, work.data(),
                                 plan.chunk_bounds.data());
  } else {
    for (int64_t k = 0; k <= in.n_chunks; ++k)
      plan.chunk_bounds[static_cast<size_t>(k)] = std::min(L, k * chunk);
  }
  in.chunk_bounds = plan.chunk_bounds.data();
  plan.steps.resize(static_cast<size_t>(kernels::MaxDecodeSteps(B, L, v_permuted)));
  plan.step_off.resize(static_cast<size_t>(in.n_chunks + 1));
  kernels::BuildDecodePlan(in, plan.steps.data(), plan.step_off.data());
  return plan;
}

// Every row's visible cells are run exactly once, block after block per row, inside their chunk
// and block, by steps whose kind fits the flags; the step count stays within MaxDecodeSteps; a
// kGathered step's cells, found again from its span index as the kernel finds them, are the
// row's short pieces of the block. Masks: random fragments, shared prompts with interleaved or
// run-length tokens, one-cell spans every k-th cell, and everything visible.
TEST(DecodePlan, RunsEveryVisibleCellOnceInOrder) {
  std::mt19937 rng(11);
  using kernels::DecodeStepKind;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t B = 1 + static_cast<int64_t>(rng() % 9);
    const int64_t L = 1 + static_cast<int64_t>(rng() % 1500);
    const int64_t chunk = kernels::kDecodeBlockCells * (1 + static_cast<int64_t>(rng() % 5));
    const bool v_permuted = rng() % 4 == 0, combine = rng() % 2 == 0, copy = rng() % 4 == 0;
    const bool balanced = rng() % 2 == 0;
    const int pattern = static_cast<int>(rng() % 5);
    const int64_t shared = static_cast<int64_t>(rng() % static_cast<uint32_t>(L + 1));
    const int64_t run = 1 + static_cast<int64_t>(rng() % 40);
    std::vector<uint8_t> vis(static_cast<size_t>(B * L));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < L; ++j) {
        bool v = true;
        if (pattern == 0) v = rng() % 3 != 0;
        if (pattern == 1) v = j < shared || (j - shared) % B == b;
        if (pattern == 2) v = j < shared || ((j - shared) / run) % B == b;
        if (pattern == 3) v = j % (run + 1) == b % (run + 1);
        vis[static_cast<size_t>(b * L + j)] = v;
      }
    }
    const auto visible = [&](int64_t b, int64_t j) { return vis[static_cast<size_t>(b * L + j)]; };
    const PlanSpans ps = SpansOf(B, L, visible);
    const Plan plan = BuildPlan(ps, B, L, chunk, v_permuted, combine, copy, balanced);
    SCOPED_TRACE(::testing::Message()
                 << "trial " << trial << ": B " << B << " L " << L << " chunk " << chunk
                 << " balanced " << balanced << " pattern " << pattern << " v_permuted "
                 << v_permuted << " combine " << combine << " copy " << copy);
    const int64_t n_chunks = static_cast<int64_t>(plan.step_off.size()) - 1;
    ASSERT_LE(plan.step_off[n_chunks], static_cast<int64_t>(plan.steps.size()));
    std::vector<int> runs(static_cast<size_t>(B * L), 0);
    // Per row, the block of its last step: a row's blocks come in order (inside a block its long
    // pieces come first, then its short ones).
    std::vector<int64_t> last_block(static_cast<size_t>(B), -1);
    const auto run_cell = [&](int64_t b, int64_t j, int64_t k, int64_t block) {
      ASSERT_GE(j, plan.chunk_bounds[static_cast<size_t>(k)]);
      ASSERT_LT(j, plan.chunk_bounds[static_cast<size_t>(k + 1)]);
      ASSERT_EQ(j / kernels::kDecodeBlockCells, block) << "cell " << j << " row " << b;
      ASSERT_TRUE(visible(b, j)) << "cell " << j << " row " << b;
      ASSERT_GE(block, last_block[static_cast<size_t>(b)]) << "row " << b << " out of order";
      last_block[static_cast<size_t>(b)] = block;
      ++runs[static_cast<size_t>(b * L + j)];
    };
    for (int64_t k = 0; k < n_chunks; ++k) {
      ASSERT_LE(plan.step_off[k], plan.step_off[k + 1]);
      for (int64_t i = plan.step_off[k]; i < plan.step_off[k + 1]; ++i) {
        const kernels::DecodeStep& st = plan.steps[static_cast<size_t>(i)];
        const int64_t block = st.first / kernels::kDecodeBlockCells;
        ASSERT_GE(st.count, 1);
        ASSERT_GE(st.row, 0);
        if (st.kind == DecodeStepKind::kCells) {
          ASSERT_GE(st.n_rows, 1);
          ASSERT_LE(st.row + st.n_rows, B);
          if (!combine) {
            ASSERT_EQ(st.n_rows, 1);
          }
          for (int64_t r = st.row; r < st.row + st.n_rows; ++r) {
            for (int64_t j = st.first; j < st.first + st.count; ++j) run_cell(r, j, k, block);
          }
          continue;
        }
        ASSERT_FALSE(v_permuted) << "a permuted V is read in place only";
        ASSERT_EQ(st.n_rows, 1);
        if (st.kind == DecodeStepKind::kStrided) {
          ASSERT_FALSE(copy);
          ASSERT_GT(st.step, 1);
          for (int64_t t = 0; t < st.count; ++t) {
            run_cell(st.row, st.first + t * st.step, k, block);
          }
          continue;
        }
        ASSERT_EQ(st.kind, DecodeStepKind::kGathered);
        std::vector<int64_t> cells;
        int64_t cursor = st.span;
        const int64_t blk0 = block * kernels::kDecodeBlockCells;
        kernels::ForEachPieceInBlock(ps.spans.data() + 2 * ps.span_off[st.row],
                                     ps.span_off[st.row + 1] - ps.span_off[st.row], &cursor, blk0,
                                     std::min(L, blk0 + kernels::kDecodeBlockCells),
                                     [&](int64_t s0, int64_t s1) {
                                       if (s1 - s0 >= kernels::kDecodeShortSpan) return;
                                       for (int64_t j = s0; j < s1; ++j) cells.push_back(j);
                                     });
        ASSERT_EQ(static_cast<int64_t>(cells.size()), st.count);
        ASSERT_EQ(cells.front(), st.first);
        int32_t found[kernels::kDecodeBlockCells];
        kernels::GatheredCells(ps.spans.data(), ps.span_off.data(), st, found);
        for (int64_t t = 0; t < st.count; ++t) ASSERT_EQ(found[t], cells[t]) << "cell " << t;
        for (const int64_t j : cells) run_cell(st.row, j, k, block);
      }
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < L; ++j) {
        ASSERT_EQ(runs[static_cast<size_t>(b * L + j)], visible(b, j) ? 1 : 0)
            << "row " << b << " cell " << j;
      }
    }
  }
}

// BalanceDecodeChunks: boundaries from 0 to L, increasing, on block multiples but the last, and
// no chunk with more than its share of the work plus one block's, the work of a block being
// max(row_cells, kDecodeCellBytesCost * min(row_cells, cells)) counted here from the visibility
// itself. Shapes: random fragments, a shared prompt then a run of cells per row (the case it is
// for: batched decode of many sequences), everything visible (equal chunks), nothing visible.
TEST(DecodePlan, ChunksBalanceTheRowsWork) {
  std::mt19937 rng(23);
  constexpr int64_t kBlk = kernels::kDecodeBlockCells;
  for (int trial = 0; trial < 300; ++trial) {
    const int pattern = trial % 4;
    const int64_t B = pattern == 1 ? 64 : 1 + static_cast<int64_t>(rng() % 9);
    const int64_t L = pattern == 1 ? 1024 + 64 * 256 : 1 + static_cast<int64_t>(rng() % 5000);
    const int64_t blocks = (L + kBlk - 1) / kBlk;
    const int64_t n_chunks =
        pattern == 1 ? 8 : 1 + static_cast<int64_t>(rng() % std::min<int64_t>(blocks, 12));
    const auto visible = [&](int64_t b, int64_t j) {
      if (pattern == 0) return (j * 7 + b * 13 + trial) % 5 < 2;
      if (pattern == 1) return j < 1024 || (j - 1024) / 256 == b;
      return pattern == 2;
    };
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": B " << B << " L " << L
                                      << " chunks " << n_chunks << " pattern " << pattern);
    const PlanSpans ps = SpansOf(B, L, visible);
    std::vector<double> scratch(static_cast<size_t>(blocks));
    std::vector<int64_t> bounds(static_cast<size_t>(n_chunks + 1), -1);
    kernels::BalanceDecodeChunks(ps.spans.data(), ps.span_off.data(), B, L, n_chunks,
                                 scratch.data(), bounds.data());
    ASSERT_EQ(bounds.front(), 0);
    ASSERT_EQ(bounds.back(), L);
    std::vector<double> work(static_cast<size_t>(blocks), 0.0);
    double total = 0, max_block = 0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      double row_cells = 0;
      const int64_t cells = std::min(L, (blk + 1) * kBlk) - blk * kBlk;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = blk * kBlk; j < blk * kBlk + cells; ++j) row_cells += visible(b, j);
      }
      work[static_cast<size_t>(blk)] =
          std::max(row_cells,
                   kernels::kDecodeCellBytesCost * std::min(row_cells, static_cast<double>(cells)));
      total += work[static_cast<size_t>(blk)];
      max_block = std::max(max_block, work[static_cast<size_t>(blk)]);
    }
    for (int64_t k = 0; k < n_chunks; ++k) {
      const int64_t lo = bounds[static_cast<size_t>(k)], hi = bounds[static_cast<size_t>(k + 1)];
      ASSERT_LT(lo, hi) << "chunk " << k;
      ASSERT_EQ(lo % kBlk, 0) << "chunk " << k;
      if (total == 0) {  // nothing visible: equal chunks of blocks
        ASSERT_EQ(lo, k * blocks / n_chunks * kBlk) << "chunk " << k;
        continue;
      }
      double w = 0;
      for (int64_t blk = lo / kBlk; blk * kBlk < hi; ++blk) w += work[static_cast<size_t>(blk)];
      EXPECT_LE(w, total / static_cast<double>(n_chunks) + max_block + 1e-9) << "chunk " << k;
    }
    if (pattern == 2) {  // everything visible: equal chunks, to a block
      for (int64_t k = 1; k < n_chunks; ++k) {
        EXPECT_LE(std::abs(bounds[static_cast<size_t>(k)] - k * L / n_chunks), kBlk)
            << "chunk " << k;
      }
    }
    if (pattern == 1) {
      // The 1024 cells that all 64 rows see are two thirds of the work (equal chunks would give
      // them one chunk of 8): the first 5 chunks lie there.
      EXPECT_EQ(bounds[5], 1024);
    }
  }
}

// The plan's choices on kvperf's batched-decode shape: 4 rows share a 300-cell prompt, then (past
// a cell none sees) take turns one cell each. Combined, each block's prompt piece is one step of
// 4 rows; the turns run in place every 4th cell (or from a copy with copy_strided_spans); rows
// alone, 4 steps per piece.
TEST(DecodePlan, SharedPromptOnceAndTurnsInPlace) {
  constexpr int64_t B = 4, L = 556, chunk = 1024;
  const auto visible = [](int64_t b, int64_t j) {
    return j < 300 || (j > 300 && (j - 301) % B == b);
  };
  const PlanSpans ps = SpansOf(B, L, visible);
  using kernels::DecodeStepKind;
  const auto count = [](const Plan& plan, DecodeStepKind kind, int n_rows) {
    int n = 0;
    for (int64_t i = 0; i < plan.step_off.back(); ++i) {
      const kernels::DecodeStep& st = plan.steps[static_cast<size_t>(i)];
      n += st.kind == kind && st.n_rows == n_rows;
    }
    return n;
  };
  // Blocks [0, 128), [128, 256): the prompt; [256, 384): 44 prompt cells, then 83 turns (20 or
  // 21 per row); [384, 512): 32 per row; [512, 556): 11 per row.
  const Plan together = BuildPlan(ps, B, L, chunk, false, true, false);
  EXPECT_EQ(together.step_off.back(), 3 + 3 * B);
  EXPECT_EQ(count(together, DecodeStepKind::kCells, B), 3);
  EXPECT_EQ(count(together, DecodeStepKind::kStrided, 1), 3 * B);
  for (int64_t i = 0; i < together.step_off.back(); ++i) {
    const kernels::DecodeStep& st = together.steps[static_cast<size_t>(i)];
    if (st.kind == DecodeStepKind::kStrided) {
      EXPECT_EQ(st.step, B);
      EXPECT_EQ(st.first % B, (301 + st.row) % B);
    }
  }
  const Plan copied = BuildPlan(ps, B, L, chunk, false, true, true);
  EXPECT_EQ(count(copied, DecodeStepKind::kGathered, 1), 3 * B);
  EXPECT_EQ(count(copied, DecodeStepKind::kStrided, 1), 0);
  const Plan alone = BuildPlan(ps, B, L, chunk, false, false, false);
  EXPECT_EQ(count(alone, DecodeStepKind::kCells, 1), 3 * B);
  EXPECT_EQ(count(alone, DecodeStepKind::kCells, B), 0);
  // A permuted V runs every piece in place, one-cell turns included, each row alone.
  const Plan permuted = BuildPlan(ps, B, L, chunk, true, true, false);
  EXPECT_EQ(count(permuted, DecodeStepKind::kCells, B), 3);
  EXPECT_EQ(count(permuted, DecodeStepKind::kCells, 1), L - 301);
}

}  // namespace
}  // namespace kv

namespace kv {
namespace {

// Histories from the real caches: several sequences interleaved in one cell table (other
// sequences' cells and padding cells masked), sliding window, chunked attention, both V layouts,
// prefill then decode steps; Attend (1 thread, a pool, a caller's parallel-for) vs the reference.
// Puts K [D, Hkv, n] and V [Dv, Hkv, n], f32 drawn from [-1, 1), into the cache's current layer,
// and draws a query [D, n, Hq] into *q.
Status PutRandomKV(Cache* cache, int D, int Dv, int Hkv, int n, int Hq, std::mt19937& rng,
                   std::vector<float>* q) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> k(static_cast<size_t>(D) * Hkv * n), v(static_cast<size_t>(Dv) * Hkv * n);
  q->resize(static_cast<size_t>(D) * n * Hq);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  for (float& x : *q) x = u(rng);
  return cache->Put(MakeView(k.data(), DType::kF32, {D, Hkv, n}),
                    MakeView(v.data(), DType::kF32, {Dv, Hkv, n}));
}

// V's shape fits both layouts when v_head_dim == kv_heads == L. A cache's Get names its layout
// (History::v_layout), so Attend reads a plain V with another head_dim than K's as plain; by
// shape alone (VLayout::kAuto) it guessed permuted there, because the strides differ from K's
// (found by an audit). A layout that v does not fit is refused.
TEST(AttendTest, CacheHistoriesNameTheirVLayout) {
  constexpr int D = 64, Dv = 4, Hkv = 4, L = 4, G = 2, Hq = Hkv * G;
  std::mt19937 rng(123);
  for (bool permuted : {false, true}) {
    SCOPED_TRACE(permuted ? "permuted V" : "plain V");
    std::unique_ptr<CausalCache> cache = NewCausalCache();
    CacheConfig cc;
    cc.permuted_v = permuted;
    ASSERT_TRUE(cache->SetConfig(cc).ok());
    ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, L).ok());
    const int32_t pos[L] = {0, 1, 2, 3}, seq[L] = {0, 0, 0, 0};
    ASSERT_TRUE(cache->StartForward(Batch{pos, seq, {}}, false).ok());
    cache->SetLayer(0);
    std::vector<float> q;
    ASSERT_TRUE(PutRandomKV(cache.get(), D, Dv, Hkv, L, Hq, rng, &q).ok());
    History h = cache->Get();
    ASSERT_EQ(h.v_layout, permuted ? VLayout::kPermuted : VLayout::kPlain);
    ASSERT_EQ(h.v.ne[0], 4);
    ASSERT_EQ(h.v.ne[1], 4);
    ASSERT_EQ(h.v.ne[2], 4);  // fits both layouts
    std::vector<float> out(static_cast<size_t>(Dv) * L * Hq), ref(out.size());
    const TensorView qv = MakeView(q.data(), DType::kF32, {D, L, Hq});
    TensorView ov = MakeView(out.data(), DType::kF32, {Dv, L, Hq});
    TensorView rv = MakeView(ref.data(), DType::kF32, {Dv, L, Hq});
    kernels::AttentionKernelParams kp;
    kp.scale = 0.125f;
    kp.v_permuted = permuted;
    kernels::AttentionRef(qv, h.k, h.v, h.mask, kp, &rv);
    ASSERT_TRUE(Attend(qv, h, AttentionParams{}, &ov).ok());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-6) << i;
    // The value the reference reads differs from the other layout's (else the test shows nothing).
    std::vector<float> other(out.size());
    TensorView otv = MakeView(other.data(), DType::kF32, {Dv, L, Hq});
    kp.v_permuted = !permuted;
    kernels::AttentionRef(qv, h.k, h.v, h.mask, kp, &otv);
    float diff = 0;
    for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(other[i] - ref[i]));
    EXPECT_GT(diff, 1e-2f);
  }
  // A layout that v does not fit, or a value that is no layout: kInvalidArgument, out untouched.
  std::vector<float> k(64 * 2 * 3, 0.5f), v(32 * 2 * 3, 0.25f), q(64 * 1 * 2, 1.0f),
      out(32 * 1 * 2, 7.0f);
  History h;
  h.k = MakeView(k.data(), DType::kF32, {64, 2, 3});
  h.v = MakeView(v.data(), DType::kF32, {32, 2, 3});  // plain only
  TensorView ov = MakeView(out.data(), DType::kF32, {32, 1, 2});
  const TensorView qv = MakeView(q.data(), DType::kF32, {64, 1, 2});
  h.v_layout = VLayout::kPermuted;
  EXPECT_EQ(Attend(qv, h, AttentionParams{}, &ov).code(), Code::kInvalidArgument);
  h.v_layout = static_cast<VLayout>(9);
  EXPECT_EQ(Attend(qv, h, AttentionParams{}, &ov).code(), Code::kInvalidArgument);
  for (float x : out) ASSERT_EQ(x, 7.0f);
  h.v_layout = VLayout::kPlain;
  EXPECT_TRUE(Attend(qv, h, AttentionParams{}, &ov).ok());
  for (float x : out) ASSERT_NEAR(x, 0.25f, 1e-6f);
}

TEST(AttendTest, RealCacheHistories) {
  struct Config {
    const char* name;
    std::unique_ptr<CausalCache> (*make)();
    DType dt;
    bool permuted;
    int padding;
  };
  const Config configs[] = {
      {"causal f16 pad4", [] { return NewCausalCache(); }, DType::kF16, false, 4},
      {"causal bf16 permV", [] { return NewCausalCache(); }, DType::kBF16, true, 1},
      {"swa5 q8_0", [] { return NewSWACache(5); }, DType::kQ8_0, false, 1},
      {"chunk8 q4_0", [] { return NewChunkedAttentionCache(8); }, DType::kQ4_0, false, 1},
      {"chunk8 f32 permV", [] { return NewChunkedAttentionCache(8); }, DType::kF32, true, 2},
  };
  const int D = 64, Hkv = 2, Hq = 8;
  ThreadPool pool(2);
  // A caller's parallel-for: runs the tasks on the calling thread, last first.
  ParallelFor reverse;
  reverse.num_threads = 3;
  reverse.run = [](void*, int64_t n, void (*task)(void*, int64_t), void* ctx) {
    for (int64_t i = n - 1; i >= 0; --i) task(ctx, i);
  };
  std::mt19937 rng(99);
  for (const Config& cfg : configs) {
    SCOPED_TRACE(cfg.name);
    std::unique_ptr<CausalCache> cache = cfg.make();
    CacheConfig cc;
    cc.padding = cfg.padding;
    cc.permuted_v = cfg.permuted;
    ASSERT_TRUE(cache->SetConfig(cc).ok());
    ASSERT_TRUE(cache->Init(cfg.dt, 3, 128, 16).ok());
    std::vector<int32_t> next(3, 0);
    for (int step = 0; step < 6; ++step) {
      // Step 0: a prefill of 12 tokens spread over 3 sequences; then decode steps of 1-3 tokens.
      const int n = step == 0 ? 12 : 1 + step % 3;
      std::vector<int32_t> pos(n), seq(n);
      for (int i = 0; i < n; ++i) {
        seq[i] = (i + step) % 3;
        pos[i] = next[seq[i]]++;
      }
      Batch batch;
      batch.positions = pos;
      batch.sequences = seq;
      ASSERT_TRUE(cache->StartForward(batch, false).ok());
      cache->SetLayer(0);
      std::vector<float> q;
      ASSERT_TRUE(PutRandomKV(cache.get(), D, D, Hkv, n, Hq, rng, &q).ok());
      const History h = cache->Get();
      std::vector<float> out(static_cast<size_t>(D) * n * Hq), ref(out.size());
      TensorView qv = MakeView(q.data(), DType::kF32, {D, n, Hq});
      TensorView ov = MakeView(out.data(), DType::kF32, {D, n, Hq});
      TensorView rv = MakeView(ref.data(), DType::kF32, {D, n, Hq});
      kernels::AttentionKernelParams kp;
      kp.scale = 0.125f;
      kp.v_permuted = cfg.permuted;
      kernels::AttentionRef(qv, h.k, h.v, h.mask, kp, &rv);
      for (int run = 0; run < 3; ++run) {
        std::fill(out.begin(), out.end(), 777.0f);
        Status st = run == 0   ? Attend(qv, h, AttentionParams{}, &ov)
                    : run == 1 ? Attend(qv, h, AttentionParams{}, &ov, &pool)
                               : Attend(qv, h, AttentionParams{}, &ov, reverse);
        ASSERT_TRUE(st.ok()) << st.message();
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_NEAR(out[i], ref[i], 2e-5) << "step " << step << " run " << run << " i " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kv
