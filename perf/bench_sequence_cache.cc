// Update cost of the growing and rotating caches (core/sequence_cache.h).
//
// Shapes: B 1, H 8 KV heads, D 128, f32 input (what a model's projection produces), storage f16 or
// q8_0. Rotating caches are first filled past max_size (wrapped), so every timed update evicts.
// Counters per token appended (K and V together):
//   moved_B/tok    held bytes copied (sink shifts, compaction, growth): the design's overhead
//   written_B/tok  bytes of new rows stored
//   full_copy_B/tok what returning temporal order by copying the whole window per token would move
//   x_memcpy       time per token / time to memcpy the token's f32 input once (same run)
//
//   cmake --build build-<you> --target bench_sequence_cache
//   build-<you>/perf/bench_sequence_cache --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "core/sequence_cache.h"
#include "layouts/kv_layout.h"

namespace kv {
namespace {

constexpr int kHeads = 8, kDim = 128, kBatch = 1;

std::vector<float> Input(int n) {
  std::vector<float> v(static_cast<size_t>(kDim) * n * kHeads * kBatch);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  return v;
}

// Nanoseconds to memcpy one token's K and V f32 input (the floor of any Update), measured now.
double MemcpyNsPerToken() {
  static double ns = [] {
    const size_t bytes = 2 * sizeof(float) * kDim * kHeads * kBatch;
    std::vector<char> src(bytes * 512, 1), dst(bytes * 512);
    const int reps = 200;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) {
      std::memcpy(dst.data(), src.data(), src.size());
      benchmark::DoNotOptimize(dst.data());
      benchmark::ClobberMemory();
    }
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / (reps * 512.0);
  }();
  return ns;
}

// args: dtype, max_size (0: growing cache), tokens per update, slack (0: default)
void BM_Update(benchmark::State& state) {
  const DType dtype = static_cast<DType>(state.range(0));
  const int max_size = static_cast<int>(state.range(1));
  const int n = static_cast<int>(state.range(2));
  const int slack = static_cast<int>(state.range(3));  // 0: the default (max(256, max_size / 2))
  const int keep = 4;
  std::unique_ptr<SequenceCache> cache = max_size == 0 ? NewKVCache(dtype)
                                         : slack > 0
                                             ? NewRotatingKVCache(max_size, keep, dtype, slack)
                                             : NewRotatingKVCache(max_size, keep, dtype);
  std::vector<float> k = Input(n), v = Input(n);
  const TensorView kin = MakeView(k.data(), DType::kF32, {kDim, n, kHeads, kBatch});
  const TensorView vin = MakeView(v.data(), DType::kF32, {kDim, n, kHeads, kBatch});
  TensorView ko, vo;
  if (max_size > 0) {
    // Wrap the ring: fill max_size + 1000 tokens in 512-token prefills.
    std::vector<float> big = Input(512);
    const TensorView bk = MakeView(big.data(), DType::kF32, {kDim, 512, kHeads, kBatch});
    for (int t = 0; t < max_size + 1000; t += 512) {
      if (!cache->Update(bk, bk, 512, &ko, &vo).ok()) state.SkipWithError("fill failed");
    }
    for (int t = 0; t < 8; ++t) (void)cache->Update(kin, vin, n, &ko, &vo);  // settle
  }
  SequenceCacheStats s0 = cache->Stats();
  uint64_t moved = 0, written = 0;  // summed over the growing cache's restarts
  int64_t tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (max_size == 0 && cache->Offset() > 32768 - n) {  // growing cache: restart, growth included
      state.PauseTiming();
      moved += cache->Stats().bytes_moved - s0.bytes_moved;
      written += cache->Stats().bytes_written - s0.bytes_written;
      cache = NewKVCache(dtype);
      s0 = cache->Stats();
      state.ResumeTiming();
    }
    const Status st = cache->Update(kin, vin, n, &ko, &vo);
    if (!st.ok()) state.SkipWithError(st.message());
    benchmark::DoNotOptimize(ko.data);
    tokens += n;
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  const SequenceCacheStats s1 = cache->Stats();
  moved += s1.bytes_moved - s0.bytes_moved;
  written += s1.bytes_written - s0.bytes_written;
  state.SetItemsProcessed(tokens);
  const double per_tok = 1.0 / static_cast<double>(tokens);
  state.counters["moved_B/tok"] = static_cast<double>(moved) * per_tok;
  state.counters["written_B/tok"] = static_cast<double>(written) * per_tok;
  if (max_size > 0) {
    const SequenceBlockLayout l = MakeSequenceBlockLayout(dtype, kDim, kHeads, kBatch, 1);
    state.counters["full_copy_B/tok"] = 2.0 * l.row_stride * kHeads * kBatch * (max_size - 1);
  }
  state.counters["capacity"] = static_cast<double>(s1.capacity);
  state.counters["ns/tok"] = ns * per_tok;
  state.counters["x_memcpy"] = ns * per_tok / MemcpyNsPerToken();
  state.SetLabel(std::string(DTypeName(dtype)) + (max_size ? " rotating" : " growing"));
}

void Args(benchmark::internal::Benchmark* b) {
  for (DType t : {DType::kF16, DType::kQ8_0}) {
    for (int max_size : {4096, 32768}) {
      for (int n : {1, 512}) b->Args({static_cast<int>(t), max_size, n, 0});
    }
    // Growing cache, decode from 0 to 32768 (growth included).
    b->Args({static_cast<int>(t), 0, 1, 0});
  }
  // The memory / traffic trade-off: slack = max_size (2x memory) halves the compaction traffic.
  b->Args({static_cast<int>(DType::kF16), 4096, 1, 4096});
  b->Args({static_cast<int>(DType::kF16), 32768, 1, 32768});
  b->ArgNames({"dtype", "max_size", "n", "slack"});
}

BENCHMARK(BM_Update)->Apply(Args)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kv

BENCHMARK_MAIN();
