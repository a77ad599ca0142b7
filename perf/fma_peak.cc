#include "fma_peak.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "perf/fma_peak.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kvbench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
// Independent FMA chains: enough to cover an FMA's latency on two pipes (4 cycles x 2 = 8 in
// flight) and few enough to stay in registers beside the two constants: 16 of AVX-512's 32
// registers, 12 of the 16 that AVX2 and SSE4 have. With 16 chains on AVX2 GCC spilled three
// accumulators through the stack in every iteration, and the "peak" read 57.5-58.6 GFLOP/s on a
// Zen 3 core whose two FMA pipes do 101 in a hand-written loop of 12 chains (session 21):
// prefill's fraction of it came out 0.71-0.82 instead of 0.46.
#if HWY_TARGET <= HWY_AVX3
constexpr size_t kFmaChains = 16;
#else
constexpr size_t kFmaChains = 12;
#endif

template <size_t... kI>
double FmaChains(int64_t iters, float* sink, std::index_sequence<kI...>) {
  const hn::ScalableTag<float> df;
  // Distinct starting values, or the compiler merges identical chains into one.
  hn::Vec<decltype(df)> a[] = {hn::Set(df, 1.0f + 0.01f * static_cast<float>(kI))...};
  const auto m = hn::Set(df, 0.999999f), c = hn::Set(df, 1e-7f);
  for (int64_t i = 0; i < iters; ++i) ((a[kI] = hn::MulAdd(a[kI], m, c)), ...);
  auto s = hn::Zero(df);
  ((s = hn::Add(s, a[kI])), ...);
  *sink += hn::GetLane(s);
  return static_cast<double>(iters) * static_cast<double>(sizeof...(kI)) *
         static_cast<double>(hn::Lanes(df)) * 2.0;
}

// kFmaChains chains of `iters` FMAs each; returns flops done.
double FmaPeakLoop(int64_t iters, float* sink) {
  return FmaChains(iters, sink, std::make_index_sequence<kFmaChains>());
}
}  // namespace HWY_NAMESPACE
}  // namespace kvbench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvbench {
HWY_EXPORT(FmaPeakLoop);

namespace {
volatile float g_sink;  // the chains' sums, so that no run is optimised away
}  // namespace

double FmaPeakRun(kv::ThreadPool& pool) {
  const int threads = std::min(pool.NumThreads(), 64);
  struct Ctx {
    double flops[64];
    float sink[64];
  } ctx{};
  const auto t0 = std::chrono::steady_clock::now();
  pool.Run(
      threads,
      [](void* c, int64_t i) {
        Ctx* x = static_cast<Ctx*>(c);
        x->flops[i] = HWY_DYNAMIC_DISPATCH(FmaPeakLoop)(int64_t{3} << 20, &x->sink[i]);
      },
      &ctx);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double f = 0;
  for (int i = 0; i < threads; ++i) {
    f += ctx.flops[i];
    g_sink = g_sink + ctx.sink[i];
  }
  return sec > 0 ? f / sec : 0;
}

double MeasureFmaPeak(kv::ThreadPool& pool, int runs) {
  double best = 0;
  for (int rep = 0; rep < runs; ++rep) best = std::max(best, FmaPeakRun(pool));
  return best;
}

}  // namespace kvbench
#endif  // HWY_ONCE
