// BuildMask throughput: cells x tokens per ns, scalar reference vs the Highway-dispatched kernel,
// plus memset of the same output bytes (the store-bandwidth ceiling) measured in the same run.
//
// Scenario: one sequence of L cells at positions 0..L-1, B causal tokens at the last B positions,
// so every row differs (no copied rows). Args: L, B, dtype (0: f32, 1: f16).
#include <cstdint>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/mask.h"

namespace {

using kv::DType;
using kv::kernels::MaskCells;
using kv::kernels::MaskRules;
using kv::kernels::MaskTokens;

struct Setup {
  std::vector<int32_t> pos;
  std::vector<uint64_t> bits;
  std::vector<int32_t> tok_pos, tok_seq;
  std::vector<uint8_t> causal;
  std::vector<uint8_t> out;
  DType dtype;

  Setup(int32_t L, int32_t B, int dt) : dtype(dt ? DType::kF16 : DType::kF32) {
    pos.resize(static_cast<size_t>(L));
    bits.assign(static_cast<size_t>(L), 1);  // every cell holds sequence 0
    for (int32_t j = 0; j < L; ++j) pos[static_cast<size_t>(j)] = j;
    for (int32_t i = 0; i < B; ++i) {
      tok_pos.push_back(L - B + i);
      tok_seq.push_back(0);
      causal.push_back(1);
    }
    out.resize(static_cast<size_t>(L) * static_cast<size_t>(B) * (dt ? 2 : 4));
  }
  MaskCells Cells() const {
    return MaskCells{pos.data(), bits.data(), pos.size(), static_cast<int32_t>(pos.size())};
  }
  MaskTokens Tokens() const { return MaskTokens{tok_pos, tok_seq, causal}; }
};

void Report(benchmark::State& state) {
  const double cells_tokens =
      static_cast<double>(state.range(0)) * static_cast<double>(state.range(1));
  state.counters["cells_x_tokens_per_ns"] = benchmark::Counter(
      cells_tokens * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

void BM_MaskRef(benchmark::State& state) {
  Setup s(static_cast<int32_t>(state.range(0)), static_cast<int32_t>(state.range(1)),
          static_cast<int>(state.range(2)));
  for (auto _ : state) {
    kv::kernels::BuildMaskRef(s.Cells(), s.Tokens(), MaskRules{}, s.dtype, s.out.data());
    benchmark::DoNotOptimize(s.out.data());
    benchmark::ClobberMemory();
  }
  Report(state);
}

void BM_Mask(benchmark::State& state) {
  Setup s(static_cast<int32_t>(state.range(0)), static_cast<int32_t>(state.range(1)),
          static_cast<int>(state.range(2)));
  for (auto _ : state) {
    kv::kernels::BuildMask(s.Cells(), s.Tokens(), MaskRules{}, s.dtype, s.out.data());
    benchmark::DoNotOptimize(s.out.data());
    benchmark::ClobberMemory();
  }
  Report(state);
}

// The same output bytes written by memset: what a store-bound kernel can at best reach.
void BM_MemsetSameBytes(benchmark::State& state) {
  Setup s(static_cast<int32_t>(state.range(0)), static_cast<int32_t>(state.range(1)),
          static_cast<int>(state.range(2)));
  for (auto _ : state) {
    std::memset(s.out.data(), 0, s.out.size());
    benchmark::DoNotOptimize(s.out.data());
    benchmark::ClobberMemory();
  }
  Report(state);
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t L : {4096, 32768}) {
    for (int64_t B : {1, 512}) b->Args({L, B, 0});
  }
  b->Args({32768, 512, 1});
  b->Args({4096, 512, 1});
}

BENCHMARK(BM_MaskRef)->Apply(Args)->ArgNames({"L", "B", "f16"});
BENCHMARK(BM_Mask)->Apply(Args)->ArgNames({"L", "B", "f16"});
BENCHMARK(BM_MemsetSameBytes)->Apply(Args)->ArgNames({"L", "B", "f16"});

}  // namespace

BENCHMARK_MAIN();
