// Attention benchmarks. Every figure is a ratio to a baseline measured in the same run:
//   decode:  effective bandwidth (bytes of K+V read / time) as a fraction of the read bandwidth of
//            a plain sum over a 256 MiB buffer with the same thread count; flops (4 * L * Hq * D)
//            against the measured FMA peak (frac_fma, see DecodeFlops); q8_0 vs f16 per call.
//   prefill: GFLOP/s (4 * B * L * Hq * D flops, all cells visible) against the measured FMA peak
//            (independent FMA chains on the best Highway target) with the same thread count.
//   side by side (decode, f16, D 128, 4096 cells, 1 thread): the scalar double reference, the
//            dispatched kernel on its best target and pinned to AVX2, and an xsimd AVX2 version.
//   batched decode (4 sequences, interleaved new tokens): in place against copied, per call.
// Timing on a shared machine: each figure takes the best call of its run (decode: hundreds of
// calls; prefill: 3), and the baselines are interleaved with the calls (decode: 32 MiB slices of
// the 256 MiB buffer, best slice; prefill: short FMA runs between its calls, best run), so the
// kernel and its baseline see the same machine.
// Run: build-*/perf/bench_attention --benchmark_counters_tabular=true
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/attend.h"
#include "core/cache.h"
#include "core/thread_pool.h"
#include "fma_peak.h"
#include "hwy/aligned_allocator.h"
#include "hwy/targets.h"
#include "kernels/attention.h"
#include "layouts/kv_layout.h"
#include "layouts/quant.h"
#include "read_bandwidth.h"

namespace kvbench {

#if KVCACHE_BENCH_XSIMD
void XsimdDecodeF16(const float* q, const uint8_t* k, const uint8_t* v, size_t head_stride,
                    size_t row_stride, int D, int Hkv, int G, int L, float scale, float* out);
#endif

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// ---- baselines ----------------------------------------------------------------------------------

// Best of 20 short runs, so that one quiet moment of a shared machine is enough. A benchmark that
// runs long also samples the peak between its calls (BM_Prefill): one session 26 run found the
// second vCPU taken for the whole of these 20 runs, and its 2-thread "peak" came out as one
// core's (prefill at 1.29 of it).
double FmaPeak(int threads) {
  static std::map<int, double> cache;
  if (cache.count(threads)) return cache[threads];
  kv::ThreadPool pool(threads);
  cache[threads] = MeasureFmaPeak(pool, 20);
  return cache[threads];
}

// FmaPeak, sampled again after a benchmark's calls: the best of both, on the same machine.
double SampledFmaPeak(kv::ThreadPool& pool) {
  double peak = FmaPeak(pool.NumThreads());
  for (int rep = 0; rep < 5; ++rep) peak = std::max(peak, FmaPeakRun(pool));
  return peak;
}

// The arithmetic of one decode row over L cells: per cell and query head, q.k and p.v take 2 * D
// multiply-adds (4 * D flops), whatever the dtype. Against the FMA peak (frac_fma), a call shows
// how close it runs to its arithmetic limit: where f16's frac_fma is high and its frac_rd is not,
// decode is bound by arithmetic, not memory, and q8_0's halved bytes buy little.
// A bound for q8_0's default passes: its V pass does f16's FMAs; its K pass takes 3 vpdpbusd per
// 64 products (the query in 24 bits) where f32 takes 4 FMAs, and vpdpbusd issues on the FMA pipes
// (bench_pipes: a Zen 4 runs one 512-bit FMA or vpdpbusd per cycle between them). So q8_0 reaches
// at most 1 / (0.5 + 0.5 * 3 / 4) = 1.14 of the peak's flops before any conversion, softmax or
// scale, and is 1.5x faster than f16 only where f16's frac_fma is below 1.14 / 1.5 = 0.76.
double DecodeFlops(int D, int Hkv, int G, int L) {
  return 4.0 * static_cast<double>(D) * Hkv * G * L;
}

// The decode shape, with the flops counted from it: 32 query heads over 8 KV heads.
constexpr int kDecodeHkv = 8, kDecodeG = 4;

// The read-bandwidth baseline, interleaved with the kernel's calls so that both see the same
// machine: a plain sum over a 256 MiB buffer, 32 MiB slice by slice (each slice split over the
// pool's threads); Next() times one slice and returns its bytes per second. The best slice of a
// run is the baseline (best calls against best slices).
class ReadSlicer {
 public:
  explicit ReadSlicer(kv::ThreadPool* pool) : pool_(pool) {
    static kvbench::ArenaLikePtr<uint64_t> buf;
    if (!buf) {
      buf = kvbench::AllocateArenaLike<uint64_t>(kBytes / 8);
      for (size_t i = 0; i < kBytes / 8; ++i) buf[i] = i;
    }
    data_ = buf.get();
  }
  double Next() {
    const uint64_t* slice = data_ + (slice_++ % (kBytes / kSlice)) * (kSlice / 8);
    return kvbench::ReadPassBytesPerSecond(pool_, slice, kSlice / 8, pool_->NumThreads() * 4);
  }

 private:
  static constexpr size_t kBytes = size_t{256} << 20;
  static constexpr size_t kSlice = size_t{32} << 20;
  kv::ThreadPool* pool_;
  const uint64_t* data_ = nullptr;
  size_t slice_ = 0;
};

// ---- a history in the caches' layout -----------------------------------------------------------

// A history of L >= kFromMemoryCells cells is meant to be read from memory: MakeSetup adds copies
// of it, kFromMemoryBytes of K/V in all, and Next() hands them out in turn, so that no call finds
// its history in the last-level cache. The Xeon of session 23 has 260 MiB of L3: one 32768-cell
// history (34-128 MiB) stayed there between calls, and f16 decode "read" it at 1.0-1.5x the DRAM
// read bandwidth. (The smaller histories are meant to be in cache: one copy.)
constexpr int kFromMemoryCells = 32768;
constexpr size_t kFromMemoryBytes = size_t{1} << 30;

struct Setup {
  kv::CellBlockLayout kl, vl;
  kvbench::ArenaLikePtr<uint8_t> kbuf, vbuf;  // as a cache's arena allocates them
  std::vector<float> q, out, mask;
  kv::History hist;
  kv::TensorView qv, ov;
  size_t kv_bytes = 0;  // bytes of K+V one call reads
  // hist and its copies (above), in the order Next() returns them.
  std::vector<kvbench::ArenaLikePtr<uint8_t>> copy_bufs;
  std::vector<kv::History> hists;
  size_t next = 0;
  const kv::History& Next() {
    const kv::History& h = hists[next];
    next = (next + 1) % hists.size();
    return h;
  }
};

Setup MakeSetup(kv::DType dt, int D, int Hkv, int G, int L, int B, bool with_mask) {
  Setup s;
  s.kl = kv::MakeCellBlockLayout(dt, D, Hkv, L, false);
  s.vl = s.kl;
  s.kbuf = kvbench::AllocateArenaLike<uint8_t>(s.kl.bytes);
  s.vbuf = kvbench::AllocateArenaLike<uint8_t>(s.vl.bytes);
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> row(D);
  for (int h = 0; h < Hkv; ++h) {
    for (int j = 0; j < L; ++j) {
      for (float& x : row) x = u(rng);
      kv::StoreRowFromF32(row.data(), D, dt, s.kbuf.get() + kv::CellRowOffset(s.kl, j, h));
      for (float& x : row) x = u(rng);
      kv::StoreRowFromF32(row.data(), D, dt, s.vbuf.get() + kv::CellRowOffset(s.vl, j, h));
    }
  }
  const int Hq = Hkv * G;
  s.q.resize(static_cast<size_t>(D) * B * Hq);
  for (float& x : s.q) x = u(rng);
  s.out.resize(static_cast<size_t>(D) * B * Hq);
  s.hist.k = kv::CellBlockView(s.kl, s.kbuf.get(), 0, L);
  s.hist.v = kv::CellBlockView(s.vl, s.vbuf.get(), 0, L);
  if (with_mask) {  // a decode token at the end of one sequence sees every cell: mask of zeros
    s.mask.assign(static_cast<size_t>(L) * B, 0.0f);
    s.hist.mask = kv::MakeView(s.mask.data(), kv::DType::kF32, {L, B});
  }
  s.qv = kv::MakeView(s.q.data(), kv::DType::kF32, {D, B, Hq});
  s.ov = kv::MakeView(s.out.data(), kv::DType::kF32, {D, B, Hq});
  // Storage bytes actually streamed: rows as stored (f16 rows padded to 64 bytes are read whole).
  s.kv_bytes = 2 * static_cast<size_t>(Hkv) * L * s.kl.row_stride;
  s.hists.push_back(s.hist);
  const size_t copies =
      L >= kFromMemoryCells ? (kFromMemoryBytes + s.kv_bytes - 1) / s.kv_bytes : 1;
  for (size_t i = 1; i < copies; ++i) {
    kv::History h = s.hist;
    for (auto [view, from, bytes] :
         {std::tuple{&h.k, s.kbuf.get(), s.kl.bytes}, std::tuple{&h.v, s.vbuf.get(), s.vl.bytes}}) {
      s.copy_bufs.push_back(kvbench::AllocateArenaLike<uint8_t>(bytes));
      std::memcpy(s.copy_bufs.back().get(), from, bytes);
      view->data = s.copy_bufs.back().get() + (static_cast<uint8_t*>(view->data) - from);
    }
    s.hists.push_back(h);
  }
  return s;
}

std::map<std::tuple<int, int, int>, double>& F16Times() {
  static std::map<std::tuple<int, int, int>, double> m;
  return m;
}

// Args: D, L, dtype (0 f16, 1 q8_0), threads.
void BM_Decode(benchmark::State& state) {
  const int D = static_cast<int>(state.range(0));
  const int L = static_cast<int>(state.range(1));
  const bool q8 = state.range(2) != 0;
  const int threads = static_cast<int>(state.range(3));
  Setup s = MakeSetup(q8 ? kv::DType::kQ8_0 : kv::DType::kF16, D, kDecodeHkv, kDecodeG, L, 1, true);
  kv::ThreadPool pool(threads);
  ReadSlicer slicer(&pool);
  kv::AttentionParams p;
  // Warm up (first call sizes the scratch).
  if (!kv::Attend(s.qv, s.hist, p, &s.ov, &pool).ok()) state.SkipWithError("Attend failed");
  double total = 0, best = 1e30, best_read = 0;
  int64_t calls = 0;
  for (auto _ : state) {
    const kv::History& h = s.Next();
    const auto t0 = Clock::now();
    (void)kv::Attend(s.qv, h, p, &s.ov, &pool);
    const double sec = Seconds(t0, Clock::now());
    total += sec;
    best = std::min(best, sec);
    ++calls;
    best_read = std::max(best_read, slicer.Next());  // the baseline, interleaved
  }
  for (int i = 0; i < 4; ++i) best_read = std::max(best_read, slicer.Next());
  const double bw = static_cast<double>(s.kv_bytes) / best;
  state.counters["us_call"] = best * 1e6;
  state.counters["mean_us_call"] = total / calls * 1e6;
  state.counters["KV_MiB"] = static_cast<double>(s.kv_bytes) / (1 << 20);
  state.counters["GBps"] = bw * 1e-9;
  state.counters["read_GBps"] = best_read * 1e-9;
  state.counters["frac_rd"] = bw / best_read;
  state.counters["frac_fma"] =
      DecodeFlops(D, kDecodeHkv, kDecodeG, L) / best / SampledFmaPeak(pool);
  auto key = std::make_tuple(D, L, threads);
  if (!q8) {
    F16Times()[key] = best;
  } else if (F16Times().count(key)) {
    state.counters["q8_vs_f16"] = F16Times()[key] / best;
  }
  state.SetLabel(q8 ? "q8_0" : "f16");
}

// q8_0 against f16 with the calls alternating, so that both see the same machine: the ratio of
// the best calls is the per-call speedup. q8intv / q8intk / q8intkv: q8_0 with
// AttentionParams::integer_v (the V pass in int16 arithmetic), integer_k (the K pass), both.
// *_vs_f16_med: the median over iterations of each iteration's f16 time / q8_0 time (the five
// calls of an iteration run back to back). A shared host's neighbours move the best calls of a
// run by 10% and more; the paired ratio only by what changes within an iteration (10-40 ms).
// Args: D, L, threads.
void BM_DecodeQ8VsF16Interleaved(benchmark::State& state) {
  const int D = static_cast<int>(state.range(0));
  const int L = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  Setup f16 = MakeSetup(kv::DType::kF16, D, kDecodeHkv, kDecodeG, L, 1, true);
  Setup q8 = MakeSetup(kv::DType::kQ8_0, D, kDecodeHkv, kDecodeG, L, 1, true);
  kv::ThreadPool pool(threads);
  kv::AttentionParams p;
  (void)kv::Attend(f16.qv, f16.hist, p, &f16.ov, &pool);
  (void)kv::Attend(q8.qv, q8.hist, p, &q8.ov, &pool);
  // Variants of q8_0 decode: f32 arithmetic, then integer V, integer K, both.
  kv::AttentionParams pq[4];
  pq[1].integer_v = pq[3].integer_v = true;
  pq[2].integer_k = pq[3].integer_k = true;
  for (const kv::AttentionParams& v : pq) (void)kv::Attend(q8.qv, q8.hist, v, &q8.ov, &pool);
  double best_f16 = 1e30, best_q8[4] = {1e30, 1e30, 1e30, 1e30};
  std::vector<double> paired[4];  // per iteration: f16 time / q8_0 time
  for (auto _ : state) {
    const kv::History& hf = f16.Next();
    auto t0 = Clock::now();
    (void)kv::Attend(f16.qv, hf, p, &f16.ov, &pool);
    const double t_f16 = Seconds(t0, Clock::now());
    best_f16 = std::min(best_f16, t_f16);
    for (int i = 0; i < 4; ++i) {
      const kv::History& hq = q8.Next();
      t0 = Clock::now();
      (void)kv::Attend(q8.qv, hq, pq[i], &q8.ov, &pool);
      const double t_q8 = Seconds(t0, Clock::now());
      best_q8[i] = std::min(best_q8[i], t_q8);
      paired[i].push_back(t_f16 / t_q8);
    }
  }
  const char* names[4] = {"q8", "q8intv", "q8intk", "q8intkv"};
  state.counters["f16_us"] = best_f16 * 1e6;
  const double peak = SampledFmaPeak(pool), flops = DecodeFlops(D, kDecodeHkv, kDecodeG, L);
  state.counters["f16_frac_fma"] = flops / best_f16 / peak;
  state.counters["q8_frac_fma"] = flops / best_q8[0] / peak;
  for (int i = 0; i < 4; ++i) {
    state.counters[std::string(names[i]) + "_us"] = best_q8[i] * 1e6;
    state.counters[std::string(names[i]) + "_vs_f16"] = best_f16 / best_q8[i];
    std::vector<double>& r = paired[i];
    if (!r.empty()) {
      std::nth_element(r.begin(), r.begin() + r.size() / 2, r.end());
      state.counters[std::string(names[i]) + "_vs_f16_med"] = r[r.size() / 2];
    }
  }
}

// Decode with 8 query heads per KV head against 4 (32 / 8 heads), calls alternating: time per
// query head, so g8_vs_g4_per_head < 1 where a group of 8 costs less than two groups of 4 (below
// AVX-512 it runs as two passes of 4 heads: see DecodeCellsAllHeads). Args: D, L, threads, q8.
void BM_DecodeGroupOf8(benchmark::State& state) {
  const int D = static_cast<int>(state.range(0));
  const int L = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  const kv::DType dt = state.range(3) != 0 ? kv::DType::kQ8_0 : kv::DType::kF16;
  Setup s[2] = {MakeSetup(dt, D, 8, 4, L, 1, true), MakeSetup(dt, D, 8, 8, L, 1, true)};
  kv::ThreadPool pool(threads);
  kv::AttentionParams p;
  for (Setup& x : s) {
    if (!kv::Attend(x.qv, x.hist, p, &x.ov, &pool).ok())
      return state.SkipWithError("Attend failed");
  }
  double best[2] = {1e30, 1e30};
  for (auto _ : state) {
    for (int i = 0; i < 2; ++i) {
      const kv::History& h = s[i].Next();
      const auto t0 = Clock::now();
      (void)kv::Attend(s[i].qv, h, p, &s[i].ov, &pool);
      best[i] = std::min(best[i], Seconds(t0, Clock::now()));
    }
  }
  state.counters["g4_us"] = best[0] * 1e6;
  state.counters["g8_us"] = best[1] * 1e6;
  state.counters["g8_vs_g4_per_head"] = (best[1] / 8) / (best[0] / 4);
  state.SetLabel(std::string(dt == kv::DType::kF16 ? "f16" : "q8_0") + " D" + std::to_string(D) +
                 " L" + std::to_string(L));
}

// The kernel entry's parallel-for over `pool` (what Attend passes it).
kv::kernels::ParallelForFn KernelParallelFor(kv::ThreadPool& pool) {
  const kv::ParallelFor par = pool.AsParallelFor();
  return {par.run, par.user, par.num_threads};
}

// One call of the kernel entry (kernels::Attention: its params have knobs that the public Attend
// keeps at kAuto), in seconds. Aborts if the scratch could not grow.
double TimedKernelCall(Setup& s, const kv::kernels::AttentionKernelParams& kp,
                       const kv::kernels::ParallelForFn& pf) {
  const kv::History& h = s.Next();
  const auto t0 = Clock::now();
  if (!kv::kernels::Attention(s.qv, h.k, h.v, h.mask, kp, pf, &s.ov)) {
    std::fprintf(stderr, "bench_attention: out of memory in Attention's scratch\n");
    std::abort();
  }
  return Seconds(t0, Clock::now());
}

// Times two ways of calling the kernel (kp[t][0], kp[t][1]) on each of two histories s[t], all
// four calls alternating in each benchmark iteration after a warm-up call each, and reports each
// history's best calls: <dtypes[t]>_<ways[0]>_us, <dtypes[t]>_<ways[1]>_us and
// <dtypes[t]>_<ways[1]>_vs_<ways[0]> (> 1 where way 1 is faster).
void CompareWaysPerHistory(benchmark::State& state, Setup (&s)[2], const char* const (&dtypes)[2],
                           const char* const (&ways)[2],
                           const kv::kernels::AttentionKernelParams (&kp)[2][2], int threads) {
  kv::ThreadPool pool(threads);
  const kv::kernels::ParallelForFn pf = KernelParallelFor(pool);
  for (int t = 0; t < 2; ++t)
    for (int w = 0; w < 2; ++w) (void)TimedKernelCall(s[t], kp[t][w], pf);  // warm up
  double best[2][2] = {{1e30, 1e30}, {1e30, 1e30}};
  for (auto _ : state) {
    for (int t = 0; t < 2; ++t)
      for (int w = 0; w < 2; ++w)
        best[t][w] = std::min(best[t][w], TimedKernelCall(s[t], kp[t][w], pf));
  }
  for (int t = 0; t < 2; ++t) {
    const std::string dt = dtypes[t], w0 = ways[0], w1 = ways[1];
    state.counters[dt + "_" + w0 + "_us"] = best[t][0] * 1e6;
    state.counters[dt + "_" + w1 + "_us"] = best[t][1] * 1e6;
    state.counters[dt + "_" + w1 + "_vs_" + w0] = best[t][0] / best[t][1];
  }
}

// Decode parameters for head_dim D: the scale, decode forced.
kv::kernels::AttentionKernelParams DecodeParams(int D) {
  kv::kernels::AttentionKernelParams kp;
  kp.scale = 1.0f / std::sqrt(static_cast<float>(D));
  kp.mode = kv::kernels::AttentionMode::kDecode;
  return kp;
}

// Decode with its prefetches into L1 (prefetcht0) against L2 only (prefetcht2), f16 and q8_0
// (integer_k and integer_v), calls alternating: l2_vs_l1 > 1 where L2 is faster. auto_l2 says
// which level this CPU gets by default (kernels::ResolvePrefetchLevel). Args: D, L, threads.
void BM_DecodePrefetchLevels(benchmark::State& state) {
  const int D = static_cast<int>(state.range(0));
  const int L = static_cast<int>(state.range(1));
  Setup s[2] = {MakeSetup(kv::DType::kF16, D, 8, 4, L, 1, true),
                MakeSetup(kv::DType::kQ8_0, D, 8, 4, L, 1, true)};
  kv::kernels::AttentionKernelParams kp[2][2];  // [dtype][level]
  for (int t = 0; t < 2; ++t) {
    for (int l = 0; l < 2; ++l) {
      kp[t][l] = DecodeParams(D);
      kp[t][l].integer_k = kp[t][l].integer_v = t == 1;
      kp[t][l].prefetch =
          l == 0 ? kv::kernels::PrefetchLevel::kL1 : kv::kernels::PrefetchLevel::kL2;
    }
  }
  CompareWaysPerHistory(state, s, {"f16", "q8kv"}, {"l1", "l2"}, kp,
                        static_cast<int>(state.range(2)));
  state.counters["auto_l2"] =
      kv::kernels::ResolvePrefetchLevel(kv::kernels::PrefetchLevel::kAuto) ==
      kv::kernels::PrefetchLevel::kL2;
}

// Decode over quantized V with the block scales applied to the codes (kCodes) against the
// softmax weights (kWeights), q8_0 and q4_0 (default K pass), calls alternating:
// weights_vs_codes > 1 where kWeights is faster. auto_weights says which this CPU gets by default
// (kernels::ResolveQuantVScaling). kWeights is AVX-512 only: elsewhere both columns run kCodes.
// Args: D, L, threads.
void BM_DecodeQuantVScaling(benchmark::State& state) {
  const int D = static_cast<int>(state.range(0));
  const int L = static_cast<int>(state.range(1));
  Setup s[2] = {MakeSetup(kv::DType::kQ8_0, D, 8, 4, L, 1, true),
                MakeSetup(kv::DType::kQ4_0, D, 8, 4, L, 1, true)};
  kv::kernels::AttentionKernelParams kp[2][2];  // [dtype][scaling]
  for (int t = 0; t < 2; ++t) {
    for (int w = 0; w < 2; ++w) {
      kp[t][w] = DecodeParams(D);
      kp[t][w].quant_v_scaling =
          w == 0 ? kv::kernels::QuantVScaling::kCodes : kv::kernels::QuantVScaling::kWeights;
    }
  }
  CompareWaysPerHistory(state, s, {"q8", "q4"}, {"codes", "weights"}, kp,
                        static_cast<int>(state.range(2)));
  state.counters["auto_weights"] =
      kv::kernels::ResolveQuantVScaling(kv::kernels::QuantVScaling::kAuto) ==
      kv::kernels::QuantVScaling::kWeights;
}

// A causal cache of 8 KV heads x 64 filled as a runtime fills it: batches of random K/V rows
// (layer 0) at the positions and sequences the caller writes into pos / seq.
struct CacheFiller {
  static constexpr int kD = 64, kHkv = 8;
  std::unique_ptr<kv::Cache> cache = kv::NewCausalCache();
  std::vector<float> k = std::vector<float>(static_cast<size_t>(kD) * kHkv * 512), v = k;
  std::vector<int32_t> pos = std::vector<int32_t>(512), seq = pos;
  std::mt19937 rng;
  std::uniform_real_distribution<float> u{-1.0f, 1.0f};
  explicit CacheFiller(uint32_t seed) : rng(seed) {}
  // Stores the first n (<= 512) tokens of pos / seq.
  bool Put(int n) {
    for (float& x : k) x = u(rng);
    for (float& x : v) x = u(rng);
    kv::Batch b;
    b.positions = std::span<const int32_t>(pos.data(), static_cast<size_t>(n));
    b.sequences = std::span<const int32_t>(seq.data(), static_cast<size_t>(n));
    if (!cache->StartForward(b, false).ok()) return false;
    cache->SetLayer(0);
    return cache
        ->Put(kv::MakeView(k.data(), kv::DType::kF32, {kD, kHkv, n}),
              kv::MakeView(v.data(), kv::DType::kF32, {kD, kHkv, n}))
        .ok();
  }
  // A prompt of `len` tokens for sequence s from position p0, in batches of up to 512.
  bool Prompt(int s, int p0, int len) {
    bool ok = true;
    for (int t0 = 0; ok && t0 < len; t0 += 512) {
      const int n = std::min(512, len - t0);
      for (int i = 0; i < n; ++i) {
        pos[i] = p0 + t0 + i;
        seq[i] = s;
      }
      ok = Put(n);
    }
    return ok;
  }
};

// Times decode over f's cache for a batch of `rows` random query rows (32 query heads), the
// kernel's parameters set two ways (set(kp, 0), set(kp, 1)) and calls alternating, one pair per
// benchmark iteration after a warm-up call each. Way 0 runs on `threads` threads, way 1 on
// `threads1` (0: the same). Reports each way's best call and how much faster way 0 is, from the
// best calls and from the means: <names[0]>_us, <names[1]>_us, <names[0]>_vs_<names[1]>,
// mean_<names[0]>_vs_<names[1]>. Returns the history's cells.
template <class SetParams>
int64_t CompareTwoWays(benchmark::State& state, CacheFiller& f, int rows, int threads,
                       const char* const (&names)[2], const SetParams& set, int threads1 = 0) {
  constexpr int kD = CacheFiller::kD, kHq = 32;
  const kv::History h = f.cache->Get();
  std::vector<float> q(static_cast<size_t>(kD) * rows * kHq), out(q.size());
  for (float& x : q) x = f.u(f.rng);
  const kv::TensorView qv = kv::MakeView(q.data(), kv::DType::kF32, {kD, rows, kHq});
  kv::TensorView ov = kv::MakeView(out.data(), kv::DType::kF32, {kD, rows, kHq});
  kv::ThreadPool pool0(threads), pool1(threads1 > 0 ? threads1 : threads);
  const kv::kernels::ParallelForFn pf[2] = {KernelParallelFor(pool0), KernelParallelFor(pool1)};
  kv::kernels::AttentionKernelParams kp[2];
  for (int c = 0; c < 2; ++c) {
    kp[c].scale = 1.0f / std::sqrt(static_cast<float>(kD));
    set(kp[c], c);
  }
  const auto call = [&](int c) {
    const auto t0 = Clock::now();
    if (!kv::kernels::Attention(qv, h.k, h.v, h.mask, kp[c], pf[c], &ov)) {
      std::fprintf(stderr, "bench_attention: out of memory in Attention's scratch\n");
      std::abort();
    }
    return Seconds(t0, Clock::now());
  };
  (void)call(0);  // warm up
  (void)call(1);
  double best[2] = {1e30, 1e30}, sum[2] = {0, 0};
  for (auto _ : state) {
    for (int c = 0; c < 2; ++c) {
      const double t = call(c);
      best[c] = std::min(best[c], t);
      sum[c] += t;
    }
  }
  const std::string n0 = names[0], n1 = names[1];
  state.counters[n0 + "_us"] = best[0] * 1e6;
  state.counters[n1 + "_us"] = best[1] * 1e6;
  state.counters[n0 + "_vs_" + n1] = best[1] / best[0];
  state.counters["mean_" + n0 + "_vs_" + n1] = sum[1] / sum[0];
  return h.k.ne[2];
}

// Batched decode as kvperf's default leaves the cache: 4 sequences with 2048-token prompts of
// their own, then 512 decode steps in one batch (the new tokens take turns in consecutive cells,
// so each row sees every 4th cell of the last 2048), 8 KV heads x 64, 32 query heads; the calls
// alternate between reading the interleaved cells in place (strided views, the default) and
// copying them together first (copy_strided_spans, the only way before session 20).
// in_place_vs_copy > 1 where in place is faster, from the best calls and from the means.
// rows 4: the batch of all four sequences; rows 1: sequence 0 alone (the others idle).
// Args: q8 (0: f16, 1: q8_0), threads, rows.
void BM_DecodeBatchedInterleaved(benchmark::State& state) {
  const kv::DType dtype = state.range(0) != 0 ? kv::DType::kQ8_0 : kv::DType::kF16;
  const int threads = static_cast<int>(state.range(1));
  const int rows = static_cast<int>(state.range(2));
  constexpr int kSeqs = 4, kPrompt = 2048, kSteps = 512;
  CacheFiller f(7);
  bool ok = f.cache->Init(dtype, kSeqs, kPrompt + kSteps + 1, 512).ok();
  for (int s = 0; ok && s < kSeqs; ++s) ok = f.Prompt(s, 0, kPrompt);
  for (int t = 0; ok && t < kSteps; ++t) {
    for (int s = 0; s < kSeqs; ++s) {
      f.pos[s] = kPrompt + t;
      f.seq[s] = s;
    }
    ok = f.Put(kSeqs);
  }
  for (int s = 0; s < rows; ++s) {  // the batch the calls serve
    f.pos[s] = kPrompt + kSteps;
    f.seq[s] = s;
  }
  ok = ok && f.Put(rows);
  if (!ok) {
    state.SkipWithError("building the cache failed");
    return;
  }
  const char* const names[2] = {"in_place", "copy"};
  const int64_t L = CompareTwoWays(
      state, f, rows, threads, names,
      [](kv::kernels::AttentionKernelParams& kp, int c) { kp.copy_strided_spans = c == 1; });
  state.SetLabel(std::string(dtype == kv::DType::kF16 ? "f16" : "q8_0") + " L " +
                 std::to_string(L) + " B " + std::to_string(rows));
}

// Batch rows that see the same cells, run together (the default) against each row alone
// (AttentionKernelParams::rows_alone, as before session 24), calls alternating:
// - shape 0, kvperf's default after 256 decode steps: 4 sequences share a 1024-token system prompt
//   (CopyPrefix), each with a 1024-token prompt of its own and 256 interleaved decode tokens;
// - shape 1, several tokens of one sequence (speculative decoding's check of 4 drafted tokens):
//   4 rows at successive positions over a 4096-token history.
// 8 KV heads x 64, 32 query heads. together_vs_alone > 1 where together is faster, from the best
// calls and from the means. Args: q8 (0: f16, 1: q8_0), threads, shape.
void BM_DecodeSharedCells(benchmark::State& state) {
  const kv::DType dtype = state.range(0) != 0 ? kv::DType::kQ8_0 : kv::DType::kF16;
  const int threads = static_cast<int>(state.range(1));
  const bool one_sequence = state.range(2) != 0;
  constexpr int kRows = 4;
  const int seqs = one_sequence ? 1 : 4, system = one_sequence ? 0 : 1024;
  const int own = one_sequence ? 4096 : 1024, steps = one_sequence ? 0 : 256;
  CacheFiller f(11);
  bool ok = f.cache->Init(dtype, seqs, system + own + steps + kRows, 512).ok();
  ok = ok && f.Prompt(0, 0, system);
  for (int s = 1; ok && s < seqs; ++s) ok = f.cache->CopyPrefix(0, s, system).ok();
  for (int s = 0; ok && s < seqs; ++s) ok = f.Prompt(s, system, own);
  for (int t = 0; ok && t < steps; ++t) {
    for (int s = 0; s < seqs; ++s) {
      f.pos[s] = system + own + t;
      f.seq[s] = s;
    }
    ok = f.Put(seqs);
  }
  for (int r = 0; r < kRows; ++r) {  // the batch the calls serve
    f.pos[r] = system + own + steps + (one_sequence ? r : 0);
    f.seq[r] = one_sequence ? 0 : r;
  }
  ok = ok && f.Put(kRows);
  if (!ok) {
    state.SkipWithError("building the cache failed");
    return;
  }
  const char* const names[2] = {"together", "alone"};
  const int64_t L =
      CompareTwoWays(state, f, kRows, threads, names,
                     [](kv::kernels::AttentionKernelParams& kp, int c) { kp.rows_alone = c == 1; });
  state.SetLabel(std::string(dtype == kv::DType::kF16 ? "f16" : "q8_0") +
                 (one_sequence ? " one sequence, 4 tokens" : " shared prompt, 4 sequences") +
                 " L " + std::to_string(L));
}

// Fills f's cache with shape `shape` of BM_DecodeAutoManyRows (below) and puts the batch its calls
// serve; *rows: the batch's rows, *label: the shape in words.
bool FillManyRowsShape(CacheFiller& f, kv::DType dtype, int shape, int* rows, std::string* label) {
  const bool one_sequence = shape == 2 || shape == 4;
  const int seqs = shape == 0 ? 8 : (shape == 1 ? 16 : (shape == 3 ? 128 : 1));
  *rows = shape == 2 ? 16 : (shape == 4 ? 512 : seqs);
  const int system = one_sequence ? 0 : 1024;
  const int own = one_sequence ? 4096 : (shape == 3 ? 256 : 1024);
  bool ok = f.cache->Init(dtype, seqs, system + own + *rows, 512).ok();
  ok = ok && (system == 0 || f.Prompt(0, 0, system));
  for (int s = 1; ok && s < seqs; ++s) ok = f.cache->CopyPrefix(0, s, system).ok();
  for (int s = 0; ok && s < seqs; ++s) ok = f.Prompt(s, system, own);
  for (int r = 0; r < *rows; ++r) {  // the batch the calls serve
    f.pos[r] = system + own + (one_sequence ? r : 0);
    f.seq[r] = one_sequence ? 0 : r;
  }
  *label = std::string(dtype == kv::DType::kF16 ? "f16 " : "q8_0 ") +
           (one_sequence ? "one sequence, " + std::to_string(*rows) + " tokens"
                         : std::to_string(seqs) + " sequences");
  return ok && f.Put(*rows);
}

// CompareTwoWays over shape `shape` of BM_DecodeAutoManyRows, stored as f16 (q8 == 0) or q8_0.
template <class SetParams>
void CompareOnManyRowsShape(benchmark::State& state, int64_t q8, int64_t shape, int threads,
                            const char* const (&names)[2], const SetParams& set, int threads1 = 0) {
  const kv::DType dtype = q8 != 0 ? kv::DType::kQ8_0 : kv::DType::kF16;
  CacheFiller f(13);
  int rows = 0;
  std::string label;
  if (!FillManyRowsShape(f, dtype, static_cast<int>(shape), &rows, &label)) {
    state.SkipWithError("building the cache failed");
    return;
  }
  const int64_t L = CompareTwoWays(state, f, rows, threads, names, set, threads1);
  state.SetLabel(label + " L " + std::to_string(L));
}

// 8 rows and more under AttentionMode::kAuto: decode or prefill, whichever computes fewer (row,
// cell) pairs (since session 29; above 64 rows per group of rows since session 30), against
// prefill, which kAuto ran from 8 rows on before (above 64 rows, until session 30). Shapes (arg
// 2): 0 and 1, batched decode of 8 and 16 sequences (a shared 1024-token system prompt, a
// 1024-token prompt of each sequence's own, one new token per sequence), where kAuto picks decode;
// 2, 16 new tokens of one sequence after 4096 (a prompt chunk, or speculative decoding's draft
// tokens), where it picks prefill; 3, batched decode of 128 sequences (the shared 1024 tokens, 256
// of each sequence's own), where it decodes in two groups of 64 rows; 4, a 512-token prompt chunk
// of one sequence after 4096, where every group of 64 rows picks prefill and they run as one call
// (what kAuto pays there is the groups' scans of the mask). auto_vs_prefill > 1 where kAuto is
// faster (best calls, and means). Args: q8 (0: f16, 1: q8_0), threads, shape.
void BM_DecodeAutoManyRows(benchmark::State& state) {
  const char* const names[2] = {"auto", "prefill"};
  CompareOnManyRowsShape(state, state.range(0), state.range(2), static_cast<int>(state.range(1)),
                         names, [](kv::kernels::AttentionKernelParams& kp, int c) {
                           kp.mode = c == 0 ? kv::kernels::AttentionMode::kAuto
                                            : kv::kernels::AttentionMode::kPrefill;
                         });
}

// The same kAuto calls on 2 threads and on 1, alternating, over BM_DecodeAutoManyRows' shapes
// (arg 1). two_vs_one is the speedup of the second thread (best calls, and means). Until session
// 31 decode on 2 threads over 32768+ cells (shape 3, batched decode of 128 sequences: 33920 cells,
// cut into 8 chunks of every KV head) prepared each head's query rows once per chunk, and q8_0's
// two_vs_one was 1.30-1.32 where f16's was 1.45-1.55 (two runs); prepared once per call,
// 1.39-1.62 and 1.42-1.61 (seven runs; Xeon, a noisy host). Args: q8 (0: f16, 1: q8_0), shape.
void BM_DecodeManyRowsThreads(benchmark::State& state) {
  const char* const names[2] = {"two", "one"};
  CompareOnManyRowsShape(
      state, state.range(0), state.range(1), 2, names,
      [](kv::kernels::AttentionKernelParams&, int) {}, 1);
}

// A call given the mask's row bitmaps (AttentionKernelParams::mask_bits, what a cache's MaskIndex
// hands every layer after the first of a pass) against the same call reading its mask, alternating,
// on kvperf's shapes. With `--sequences 64 --system 1024 --context 512`, 64 sequences share a
// 1024-token system prompt (CopyPrefix), 63 of them hold a 512-token prompt of their own, and the
// batch is
// - shape 0: the last sequence's 512-token prompt (33792 cells: each row sees ~1500 of them,
//   prefill's tiles skip the rest, and the mask, 66 MiB in f32, is what a call reads most), or
// - shape 1: one decode token of every sequence, after all 64 prompts (64 rows over 33856 cells,
//   the mask 8.3 MiB);
// - shape 2, kvperf's default: 4 sequences share the 1024 tokens, 3 hold a 1024-token prompt of
//   their own, and the batch is the second half of the last one's (512 rows over 5120 cells, the
//   mask 10 MiB).
// given_vs_read > 1 where the bits are faster (best calls, and means). Args: q8 (0: f16, 1: q8_0),
// threads, shape.
void BM_MaskBitsGiven(benchmark::State& state) {
  const kv::DType dtype = state.range(0) != 0 ? kv::DType::kQ8_0 : kv::DType::kF16;
  const int threads = static_cast<int>(state.range(1));
  const int shape = static_cast<int>(state.range(2));
  const bool decode = shape == 1;
  const int seqs = shape == 2 ? 4 : 64, own = shape == 2 ? 1024 : 512;
  constexpr int kSystem = 1024, kBatch = 512;
  CacheFiller f(17);
  bool ok = f.cache->Init(dtype, seqs, kSystem + seqs * own + seqs, 512).ok();
  ok = ok && f.Prompt(0, 0, kSystem);
  for (int s = 1; ok && s < seqs; ++s) ok = f.cache->CopyPrefix(0, s, kSystem).ok();
  for (int s = 0; ok && s < seqs - 1; ++s) ok = f.Prompt(s, kSystem, own);
  int rows = kBatch;
  if (decode) {
    ok = ok && f.Prompt(seqs - 1, kSystem, own);
    rows = seqs;
    for (int s = 0; s < seqs; ++s) {
      f.pos[s] = kSystem + own;
      f.seq[s] = s;
    }
  } else {
    // The last sequence's prompt up to its final batch, then that batch.
    ok = ok && (own == kBatch || f.Prompt(seqs - 1, kSystem, own - kBatch));
    for (int i = 0; i < kBatch; ++i) {
      f.pos[i] = kSystem + own - kBatch + i;
      f.seq[i] = seqs - 1;
    }
  }
  ok = ok && f.Put(rows);
  if (!ok) {
    state.SkipWithError("building the cache failed");
    return;
  }
  const kv::History h = f.cache->Get();
  std::vector<uint64_t> bits(static_cast<size_t>(h.mask.ne[1]) *
                             static_cast<size_t>(kv::kernels::MaskBitsRowWords(h.mask.ne[0])));
  kv::kernels::MaskBits(h.mask, kv::kernels::ParallelForFn{}, bits.data());
  const char* const names[2] = {"given", "read"};
  const int64_t L = CompareTwoWays(state, f, rows, threads, names,
                                   [&](kv::kernels::AttentionKernelParams& kp, int c) {
                                     kp.mask_bits = c == 0 ? bits.data() : nullptr;
                                   });
  state.SetLabel(std::string(dtype == kv::DType::kF16 ? "f16 " : "q8_0 ") +
                 (decode ? "decode, " : "a 512-token prompt batch, ") + std::to_string(seqs) +
                 " sequences, L " + std::to_string(L));
}

// Args: threads, head_dim (128: the shape; 64: kvperf's default model).
void BM_Prefill(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int D = static_cast<int>(state.range(1));
  const int L = 4096, B = 512, Hkv = 8, G = 4;
  Setup s = MakeSetup(kv::DType::kF16, D, Hkv, G, L, B, false);
  kv::ThreadPool pool(threads);
  kv::AttentionParams p;
  if (!kv::Attend(s.qv, s.hist, p, &s.ov, &pool).ok()) state.SkipWithError("Attend failed");
  double best = 1e30;
  double peak = FmaPeak(threads);
  for (auto _ : state) {
    const auto t0 = Clock::now();
    (void)kv::Attend(s.qv, s.hist, p, &s.ov, &pool);
    best = std::min(best, Seconds(t0, Clock::now()));
    state.PauseTiming();
    peak = std::max(peak, SampledFmaPeak(pool));  // same machine
    state.ResumeTiming();
  }
  const double flops = 4.0 * B * L * Hkv * G * D;
  const double gflops = flops / best * 1e-9;
  state.counters["ms_call"] = best * 1e3;
  state.counters["GFLOPs"] = gflops;
  state.counters["peak_GFLOPs"] = peak * 1e-9;
  state.counters["frac_peak"] = gflops / (peak * 1e-9);
  state.SetLabel("f16 D" + std::to_string(D) + " Hq32 Hkv8 B512 L4096");
}

// Side by side, decode f16 D 128 L 4096, 1 thread. Arg: 0 reference, 1 dispatched (best target),
// 2 dispatched pinned to AVX2, 3 xsimd AVX2, 4 dispatched pinned to SCALAR.
void BM_DecodeSideBySide(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  const int D = 128, L = 4096, Hkv = 8, G = 4;
  Setup s = MakeSetup(kv::DType::kF16, D, Hkv, G, L, 1, false);
  kv::AttentionParams p;
  kv::kernels::AttentionKernelParams kp;
  kp.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const char* label = "";
  if (which == 2) {
    if (!(hwy::SupportedTargets() & HWY_AVX2)) return state.SkipWithError("no AVX2");
    hwy::SetSupportedTargetsForTest(HWY_AVX2);
  }
  if (which == 4) hwy::SetSupportedTargetsForTest(HWY_SCALAR);
  double total = 0, best = 1e30;
  int64_t calls = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    switch (which) {
      case 0:
        kv::kernels::AttentionRef(s.qv, s.hist.k, s.hist.v, s.hist.mask, kp, &s.ov);
        label = "scalar double reference";
        break;
      case 1:
      case 2:
      case 4:
        (void)kv::Attend(s.qv, s.hist, p, &s.ov);
        label = which == 1 ? "Highway dispatched (best target)"
                           : (which == 2 ? "Highway pinned to AVX2" : "Highway SCALAR target");
        break;
      case 3:
#if KVCACHE_BENCH_XSIMD
        XsimdDecodeF16(s.q.data(), s.kbuf.get(), s.vbuf.get(), s.kl.head_stride, s.kl.row_stride, D,
                       Hkv, G, L, kp.scale, s.out.data());
        label = "xsimd fixed AVX2";
#else
        label = "xsimd not built";
#endif
        break;
    }
    const double sec = Seconds(t0, Clock::now());
    total += sec;
    best = std::min(best, sec);
    ++calls;
  }
  hwy::SetSupportedTargetsForTest(0);
  // Every variant computes the same thing: its output against the dispatched kernel's.
  std::vector<float> mine = s.out;
  (void)kv::Attend(s.qv, s.hist, p, &s.ov);
  double diff = 0;
  for (size_t i = 0; i < mine.size(); ++i)
    diff = std::max(diff, std::fabs(double{mine[i]} - s.out[i]));
  state.counters["max_diff_vs_kernel"] = diff;
  const double per_call = total / calls;
  state.counters["mean_us_call"] = per_call * 1e6;
  kv::ThreadPool pool1(1);
  ReadSlicer slicer(&pool1);
  double best_read = 0;
  for (int i = 0; i < 16; ++i) best_read = std::max(best_read, slicer.Next());
  state.counters["best_us_call"] = best * 1e6;
  state.counters["frac_rd"] = static_cast<double>(s.kv_bytes) / best / best_read;
  state.SetLabel(label);
}

void DecodeArgs(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2})
    for (int D : {64, 128})
      for (int L : {512, 4096, 32768})
        for (int q8 : {0, 1}) b->Args({D, L, q8, threads});
}

BENCHMARK(BM_Decode)->Apply(DecodeArgs)->Unit(benchmark::kMicrosecond)->MinTime(1.0)->UseRealTime();
// Head_dim 64 and 128 at 32768 cells, 1 and 2 threads: {D, L, threads}.
void LongHistoryArgs(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2})
    for (int D : {64, 128}) b->Args({D, 32768, threads});
}

BENCHMARK(BM_DecodeQ8VsF16Interleaved)
    ->Apply(LongHistoryArgs)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeGroupOf8)
    ->ArgsProduct({{64, 128}, {32768}, {1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK(BM_DecodePrefetchLevels)
    ->Apply(LongHistoryArgs)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeQuantVScaling)
    ->ArgsProduct({{64, 128}, {4096, 32768}, {1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeBatchedInterleaved)
    ->ArgsProduct({{0, 1}, {1, 2}, {4, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(2.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeSharedCells)
    ->ArgsProduct({{0, 1}, {1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeAutoManyRows)
    ->ArgsProduct({{0, 1}, {1, 2}, {0, 1, 2, 3, 4}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK(BM_DecodeManyRowsThreads)
    ->ArgsProduct({{0, 1}, {3}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK(BM_MaskBitsGiven)
    ->ArgsProduct({{0, 1}, {1, 2}, {0, 1, 2}})
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0)
    ->UseRealTime();
BENCHMARK(BM_Prefill)
    ->ArgsProduct({{1, 2}, {128, 64}})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3)
    ->UseRealTime();
BENCHMARK(BM_DecodeSideBySide)
    ->DenseRange(0, 4)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.3)
    ->UseRealTime();

}  // namespace kvbench

BENCHMARK_MAIN();
