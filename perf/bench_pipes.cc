// Issue rates of the 512-bit instructions that decode attention is made of, alone and mixed:
// vfmadd231ps (f16's and q8_0's f32 passes), vpdpbusd (q8_0's integer K pass), vcvtph2ps (f16's
// conversion). Each loop runs 12 independent chains (enough to cover a 4-5 cycle latency on two
// pipes), written in inline assembly so that the compiler can neither merge nor reorder them.
// Counter: ops_per_ns (instructions of the loop per nanosecond; with the clock it gives the rate
// per cycle). What it is for: where "FMA + vpdpbusd" runs at the rate of FMA alone, the two share
// their pipes, so an integer pass competes with the f32 pass for the same slots, and decode's
// arithmetic ceiling for q8_0 follows (see DecodeFlops in bench_attention.cc and the README's
// Known gaps). x86-64 with AVX-512 VNNI only; elsewhere every benchmark skips.
// Run: build-*/perf/bench_pipes
#include <chrono>
#include <cstdint>

#include "benchmark/benchmark.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVCACHE_BENCH_PIPES 1
#endif

namespace {

#if KVCACHE_BENCH_PIPES
// What one iteration of the loop issues (BM_Pipes' argument, in this order).
enum class Mix { kFma, kDpbusd, kCvtph2ps, kFmaAndDpbusd, kTwoFmasPerCvt };

// 12 chains of 512-bit operations for `iters` iterations; returns instructions issued.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t RunMix(Mix mix, int64_t iters) {
  __m512 f0 = _mm512_set1_ps(1.0f), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0,
         f8 = f0, f9 = f0, f10 = f0, f11 = f0;
  __m512i i0 = _mm512_set1_epi32(1), i1 = i0, i2 = i0, i3 = i0, i4 = i0, i5 = i0, i6 = i0, i7 = i0,
          i8 = i0, i9 = i0, i10 = i0, i11 = i0;
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  const __m512i u8 = _mm512_set1_epi8(3), s8 = _mm512_set1_epi8(-2);
  const __m256i h = _mm256_set1_epi16(0x3C00);  // f16 1.0
#define KV_FMA(x) asm volatile("vfmadd231ps %1, %2, %0" : "+v"(x) : "v"(m), "v"(c))
#define KV_DOT(x) asm volatile("vpdpbusd %1, %2, %0" : "+v"(x) : "v"(u8), "v"(s8))
#define KV_CVT(x) asm volatile("vcvtph2ps %1, %0" : "=v"(x) : "v"(h))
#define KV_SIX(op, a, b, c, d, e, f) \
  op(a);                             \
  op(b);                             \
  op(c);                             \
  op(d);                             \
  op(e);                             \
  op(f)
  constexpr int64_t kPerIter = 12;
  switch (mix) {
    case Mix::kFma:
      for (int64_t k = 0; k < iters; ++k) {
        KV_SIX(KV_FMA, f0, f1, f2, f3, f4, f5);
        KV_SIX(KV_FMA, f6, f7, f8, f9, f10, f11);
      }
      break;
    case Mix::kDpbusd:
      for (int64_t k = 0; k < iters; ++k) {
        KV_SIX(KV_DOT, i0, i1, i2, i3, i4, i5);
        KV_SIX(KV_DOT, i6, i7, i8, i9, i10, i11);
      }
      break;
    case Mix::kCvtph2ps:
      for (int64_t k = 0; k < iters; ++k) {
        KV_SIX(KV_CVT, f0, f1, f2, f3, f4, f5);
        KV_SIX(KV_CVT, f6, f7, f8, f9, f10, f11);
      }
      break;
    case Mix::kFmaAndDpbusd:  // 6 of each
      for (int64_t k = 0; k < iters; ++k) {
        KV_SIX(KV_FMA, f0, f1, f2, f3, f4, f5);
        KV_SIX(KV_DOT, i6, i7, i8, i9, i10, i11);
      }
      break;
    case Mix::kTwoFmasPerCvt:  // f16's passes: 8 FMAs per 4 conversions (4 query heads)
      for (int64_t k = 0; k < iters; ++k) {
        KV_SIX(KV_FMA, f0, f1, f2, f3, f4, f5);
        KV_FMA(f6);
        KV_FMA(f7);
        KV_CVT(f8);
        KV_CVT(f9);
        KV_CVT(f10);
        KV_CVT(f11);
      }
      break;
  }
#undef KV_SIX
#undef KV_FMA
#undef KV_DOT
#undef KV_CVT
  // Keep every chain's result alive.
  f0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f1), _mm512_add_ps(f2, f3)),
                     _mm512_add_ps(_mm512_add_ps(f4, f5), _mm512_add_ps(f6, f7)));
  f0 = _mm512_add_ps(f0, _mm512_add_ps(_mm512_add_ps(f8, f9), _mm512_add_ps(f10, f11)));
  i0 = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(i0, i1), _mm512_add_epi32(i2, i3)),
                        _mm512_add_epi32(_mm512_add_epi32(i4, i5), _mm512_add_epi32(i6, i7)));
  i0 = _mm512_add_epi32(i0, _mm512_add_epi32(_mm512_add_epi32(i8, i9), _mm512_add_epi32(i10, i11)));
  float fs = _mm512_reduce_add_ps(f0);
  int32_t is = _mm512_reduce_add_epi32(i0);
  benchmark::DoNotOptimize(fs);
  benchmark::DoNotOptimize(is);
  return iters * kPerIter;
}

// Arg: the Mix. Best of the iterations (a shared host's neighbours only slow a loop down).
void BM_Pipes(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vnni")) {
    return state.SkipWithError("needs AVX-512 VNNI");
  }
  const Mix mix = static_cast<Mix>(state.range(0));
  constexpr int64_t kIters = int64_t{1} << 20;
  double best = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t ops = RunMix(mix, kIters);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    if (ns > 0 && static_cast<double>(ops) / ns > best) best = static_cast<double>(ops) / ns;
  }
  state.counters["ops_per_ns"] = best;
  static const char* const kNames[] = {"12 vfmadd231ps", "12 vpdpbusd", "12 vcvtph2ps",
                                       "6 vfmadd231ps + 6 vpdpbusd", "8 vfmadd231ps + 4 vcvtph2ps"};
  state.SetLabel(kNames[state.range(0)]);
}
BENCHMARK(BM_Pipes)->DenseRange(0, 4)->MinTime(0.3)->UseRealTime();

#else
void BM_Pipes(benchmark::State& state) { state.SkipWithError("x86-64 only"); }
BENCHMARK(BM_Pipes);
#endif

}  // namespace

BENCHMARK_MAIN();
