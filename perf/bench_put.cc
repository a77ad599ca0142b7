// Put's write path: ScatterToCells of f32 rows into a cache-shaped block (kv_heads 8, head_dim 128,
// 4096 cells, plain head-major layout) at n scattered cells, for every storage dtype (and at 512
// contiguous cells, as a prompt's Put writes them: ScatterContiguous), next to
//   - a memcpy of the same number of bytes (between a source-sized and a block-sized buffer), and
//   - the scalar reference scatter,
// all in the same run. Every benchmark reports `written` (bytes written to the block per second);
// a table of memcpy/dispatched and scalar/dispatched time ratios is printed at the end. MemcpySrc
// copies the f32 source bytes instead (the bytes the scatter reads).
// and a memcpy between two 256 MiB buffers (memcpy bandwidth in the usual sense; column /bw).
// Targets: f16/bf16 >= 0.8 of memcpy, q8_0 >= 0.5.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "kernels/convert.h"
#include "machine.h"

namespace {

using kv::DType;

constexpr int32_t kHeads = 8;
constexpr int32_t kHeadDim = 128;
constexpr int32_t kCells = 4096;

struct Fixture {
  kv::CellBlockLayout layout;
  hwy::AlignedFreeUniquePtr<uint8_t[]> block;
  hwy::AlignedFreeUniquePtr<float[]> src;
  std::vector<int32_t> cells;
  kv::TensorView view;
  size_t written = 0;  // bytes written to the block per call
};

// contiguous: cells [kCells / 2 - n / 2, + n) in order; else n distinct random cells.
Fixture MakeFixture(DType dtype, int32_t n, bool contiguous = false) {
  Fixture f;
  f.layout = kv::MakeCellBlockLayout(dtype, kHeadDim, kHeads, kCells, false);
  f.block = hwy::AllocateAligned<uint8_t>(f.layout.bytes);
  std::memset(f.block.get(), 0, f.layout.bytes);
  const size_t elems = static_cast<size_t>(kHeadDim) * kHeads * static_cast<size_t>(n);
  f.src = hwy::AllocateAligned<float>(elems);
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (size_t i = 0; i < elems; ++i) f.src[i] = nd(rng);
  if (contiguous) {
    f.cells.resize(n);
    std::iota(f.cells.begin(), f.cells.end(), kCells / 2 - n / 2);
  } else {
    std::vector<int32_t> perm(kCells);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    f.cells.assign(perm.begin(), perm.begin() + n);
  }
  f.view = kv::MakeView(f.src.get(), DType::kF32, {kHeadDim, kHeads, n});
  f.written = static_cast<size_t>(n) * kHeads * kv::RowBytes(dtype, kHeadDim);
  return f;
}

void SetWritten(benchmark::State& state, size_t bytes) {
  state.counters["written"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

void BM_Scatter(benchmark::State& state, DType dtype, bool reference, bool contiguous) {
  Fixture f = MakeFixture(dtype, static_cast<int32_t>(state.range(0)), contiguous);
  for (auto _ : state) {
    if (reference) {
      kv::kernels::ScatterToCellsRef(f.view, f.cells, f.layout, f.block.get());
    } else {
      kv::kernels::ScatterToCells(f.view, f.cells, f.layout, f.block.get());
    }
    benchmark::DoNotOptimize(f.block.get());
    benchmark::ClobberMemory();
  }
  SetWritten(state, f.written);
}

// memcpy of the bytes the scatter of `dtype` writes, source and destination the sizes of the
// scatter's source and block.
// With `source`, copies the f32 source instead (what the scatter reads: 2x the f16 bytes, 4x q8).
void BM_Memcpy(benchmark::State& state, DType dtype, bool source) {
  Fixture f = MakeFixture(dtype, static_cast<int32_t>(state.range(0)));
  const size_t bytes =
      source ? static_cast<size_t>(kv::NumElements(f.view)) * sizeof(float) : f.written;
  for (auto _ : state) {
    std::memcpy(f.block.get(), f.src.get(), bytes);
    benchmark::DoNotOptimize(f.block.get());
    benchmark::ClobberMemory();
  }
  SetWritten(state, bytes);
}

// memcpy bandwidth in the usual sense: one copy between two 256 MiB buffers (far beyond the
// caches), bytes copied per second. The scatter's bytes written per second are quoted against it
// too: the cache block a runtime writes into is that large, while the same-bytes memcpy above runs
// in L2.
constexpr size_t kBandwidthBytes = size_t{256} << 20;
void BM_MemcpyBandwidth(benchmark::State& state) {
  auto a = hwy::AllocateAligned<uint8_t>(kBandwidthBytes);
  auto b = hwy::AllocateAligned<uint8_t>(kBandwidthBytes);
  std::memset(a.get(), 1, kBandwidthBytes);
  std::memset(b.get(), 2, kBandwidthBytes);
  for (auto _ : state) {
    std::memcpy(b.get(), a.get(), kBandwidthBytes);
    benchmark::DoNotOptimize(b.get());
    benchmark::ClobberMemory();
  }
  SetWritten(state, kBandwidthBytes);
}

// Collects `written` per benchmark name and prints the ratios after the console output.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration && r.aggregate_name != "median") continue;
      const auto it = r.counters.find("written");
      if (it != r.counters.end())
        times_[r.run_name.function_name + "/" + r.run_name.args] = r.GetAdjustedCPUTime();
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // Ratios of CPU time per call: memcpy time / scatter time (for the same bytes this is the ratio
  // of bytes written per second; >= 1 means the scatter is as fast as the memcpy).
  void PrintRatios() const {
    std::printf("\nratios, target %s (CPU ns per call)\n", kvbench::DispatchedTargetName());
    const double bw_ns = Get("MemcpyBandwidth/");
    const double bw = bw_ns > 0 ? static_cast<double>(kBandwidthBytes) / bw_ns : 0;  // bytes / ns
    std::printf("memcpy bandwidth (256 MiB -> 256 MiB): %.2f GB/s\n", bw);
    // contig: the scatter into contiguous cells (n = 512 only); its time over the random cells'
    // and its /bw. A quantized row that is not whole cache lines (q8_0: 136 bytes) has its lines
    // read before they are written, which random cells make the slowest (README, Known gaps).
    std::printf("%-6s %5s %11s %11s %11s %11s %9s %12s %9s %8s %11s %8s %9s\n", "dtype", "n",
                "scatter", "memcpy", "memcpy_src", "scalar", "/memcpy", "/memcpy_src", "/scalar",
                "/bw", "contig", "/random", "/bw_cont");
    for (const char* name : {"f16", "bf16", "q8_0", "q4_0", "f32"}) {
      for (const char* n : {"1", "512"}) {
        const double d = Get(std::string("Scatter/") + name + "/" + n);
        const double m = Get(std::string("Memcpy/") + name + "/" + n);
        const double ms = Get(std::string("MemcpySrc/f32/") + n);
        const double s = Get(std::string("ScatterRef/") + name + "/" + n);
        if (d <= 0 || m <= 0) continue;
        const DType t = std::string(name) == "f16"    ? DType::kF16
                        : std::string(name) == "bf16" ? DType::kBF16
                        : std::string(name) == "q8_0" ? DType::kQ8_0
                        : std::string(name) == "q4_0" ? DType::kQ4_0
                                                      : DType::kF32;
        const double written =
            std::stod(n) * kHeads * static_cast<double>(kv::RowBytes(t, kHeadDim));
        std::printf("%-6s %5s %11.1f %11.1f %11.1f %11.1f %9.2f %12.2f %9.1f %8.2f", name, n, d, m,
                    ms, s, m / d, ms / d, s / d, bw > 0 ? written / d / bw : 0.0);
        const double c = Get(std::string("ScatterContiguous/") + name + "/" + n);
        if (c > 0) {
          std::printf(" %11.1f %8.2f %9.2f\n", c, c / d, bw > 0 ? written / c / bw : 0.0);
        } else {
          std::printf(" %11s %8s %9s\n", "-", "-", "-");
        }
      }
    }
  }

 private:
  double Get(const std::string& key) const {
    const auto it = times_.find(key);
    return it == times_.end() ? 0.0 : it->second;
  }
  std::map<std::string, double> times_;  // CPU time per call
};

void Register() {
  const DType types[] = {DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kF32};
  benchmark::RegisterBenchmark("MemcpySrc/f32", BM_Memcpy, DType::kF32, true)->Arg(1)->Arg(512);
  benchmark::RegisterBenchmark("MemcpyBandwidth", BM_MemcpyBandwidth)->Iterations(8);
  for (DType t : types) {
    const std::string name = kv::DTypeName(t);
    benchmark::RegisterBenchmark(("Scatter/" + name).c_str(), BM_Scatter, t, false, false)
        ->Arg(1)
        ->Arg(512);
    benchmark::RegisterBenchmark(("ScatterContiguous/" + name).c_str(), BM_Scatter, t, false, true)
        ->Arg(512);
    benchmark::RegisterBenchmark(("Memcpy/" + name).c_str(), BM_Memcpy, t, false)->Arg(1)->Arg(512);
    benchmark::RegisterBenchmark(("ScatterRef/" + name).c_str(), BM_Scatter, t, true, false)
        ->Arg(1)
        ->Arg(512);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Register();
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
