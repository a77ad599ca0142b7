// RopeShift throughput: rows per microsecond for a context shift of 512 cells x 8 KV heads x
// head_dim 128 (all rows shifted by the same delta), scalar reference vs the Highway-dispatched
// kernel, plus a read+write pass over the same bytes (memcpy) as the bandwidth yardstick. Args:
// dtype, neox.
#include <cstdint>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/rope.h"
#include "layouts/quant.h"

namespace {

using kv::DType;

constexpr int64_t kHeadDim = 128, kHeads = 8, kCells = 512;

struct Setup {
  std::vector<uint8_t> bytes, copy;
  std::vector<int32_t> delta;
  kv::TensorView view;
  kv::kernels::RopeParams params;

  explicit Setup(benchmark::State& state) {
    const DType t = static_cast<DType>(state.range(0));
    const size_t n = kv::RowBytes(t, kHeadDim) * kHeads * kCells;
    bytes.resize(n);
    copy.resize(n);
    view = kv::MakeView(bytes.data(), t, {kHeadDim, kHeads, kCells});
    std::vector<float> row(kHeadDim);
    for (int64_t i = 0; i < kCells; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t e = 0; e < kHeadDim; ++e)
          row[e] = static_cast<float>((e * 7 + h * 3 + i) % 17) - 8.0f;
        kv::StoreRowFromF32(row.data(), kHeadDim, t, kv::RowPtr(view, h, i));
      }
    }
    delta.assign(kCells, -37);
    params.neox = state.range(1) != 0;
  }
};

void Report(benchmark::State& state) {
  state.counters["rows_per_us"] = benchmark::Counter(
      static_cast<double>(kCells * kHeads) * static_cast<double>(state.iterations()) * 1e-6,
      benchmark::Counter::kIsRate);
  state.SetLabel(kv::DTypeName(static_cast<DType>(state.range(0))));
}

void BM_RopeRef(benchmark::State& state) {
  Setup s(state);
  for (auto _ : state) {
    kv::kernels::RopeShiftRef(s.view, s.delta, s.params);
    benchmark::ClobberMemory();
  }
  Report(state);
}

void BM_Rope(benchmark::State& state) {
  Setup s(state);
  for (auto _ : state) {
    kv::kernels::RopeShift(s.view, s.delta, s.params);
    benchmark::ClobberMemory();
  }
  Report(state);
}

void BM_MemcpySameBytes(benchmark::State& state) {
  Setup s(state);
  for (auto _ : state) {
    std::memcpy(s.copy.data(), s.bytes.data(), s.bytes.size());
    benchmark::ClobberMemory();
  }
  Report(state);
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t t : {0, 1, 2, 3}) b->Args({t, 0});
  b->Args({0, 1});
  b->Args({1, 1});
}

BENCHMARK(BM_RopeRef)->Apply(Args)->ArgNames({"dtype", "neox"});
BENCHMARK(BM_Rope)->Apply(Args)->ArgNames({"dtype", "neox"});
BENCHMARK(BM_MemcpySameBytes)->Apply(Args)->ArgNames({"dtype", "neox"});

}  // namespace

BENCHMARK_MAIN();
