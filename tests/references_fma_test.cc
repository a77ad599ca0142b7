// The scalar references compiled where the compiler may use FMA instructions, against the
// dispatched kernels on every compiled target. kernels/rope.h and kernels/convert.h promise
// bit-exact results, which must not depend on the instructions the build allows: a user who builds
// the library with -march=native (or any FMA baseline) gets references and quantizers that can
// fuse a * b + c into one rounding unless contraction is off.
//
// tests/CMakeLists.txt compiles kernels/rope_ref.cc and kernels/convert_ref.cc into this executable
// with FMA enabled (x86: -mavx2 -mfma -mf16c; aarch64 always has FMA), so these copies are the
// ones linked here instead of the library's. The project's rounding policy (-ffp-contract=off,
// CMakeLists.txt) applies to them as to every other file. Until session 40 x86 builds kept GCC's
// default (-ffp-contract=fast), and with -march=native RopeShiftRef's x0 * c - x1 * s became one
// fused operation: RopeTest failed there, and this test failed here.
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/convert.h"
#include "kernels/highway_targets.h"
#include "kernels/rope.h"
#include "layouts/kv_layout.h"
#include "layouts/quant.h"

namespace kv::kernels {
namespace {

constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

// The reference objects linked into this test use FMA instructions (x86: AVX2, FMA and F16C).
// clang 14's __builtin_cpu_supports knows no "f16c": CPUID leaf 1 says (ECX bit 29).
bool CpuRunsTheFmaReferences() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return true;
#endif
}

#define KV_SKIP_WITHOUT_FMA()                                                      \
  if (!CpuRunsTheFmaReferences()) {                                                \
    GTEST_SKIP() << "this CPU lacks AVX2/FMA/F16C, which the references here use"; \
  }

// Index of the first byte where a and b differ, or -1 (same size and bytes).
int64_t FirstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

template <class Fn>
void ForEachTarget(const Fn& fn) {
  for (int64_t target : DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    fn(hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// [head_dim, heads, cells] rows of dtype t, packed, from values in [-range, range].
std::vector<uint8_t> RandomRows(DType t, int64_t head_dim, int64_t rows, float range,
                                std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-range, range);
  const size_t row_bytes = RowBytes(t, head_dim);
  std::vector<uint8_t> bytes(row_bytes * static_cast<size_t>(rows));
  std::vector<float> row(static_cast<size_t>(head_dim));
  for (int64_t i = 0; i < rows; ++i) {
    for (float& x : row) x = dist(rng);
    StoreRowFromF32(row.data(), head_dim, t, bytes.data() + row_bytes * static_cast<size_t>(i));
  }
  return bytes;
}

TEST(ReferencesWithFma, RopeShiftMatchesBitForBit) {
  KV_SKIP_WITHOUT_FMA();
  const int32_t deltas[] = {1, -1, 0, 7, -300, 4096, 100000, -(1 << 30)};
  constexpr int64_t kHeads = 2, kCells = 8;
  std::mt19937 rng(40);
  int cases = 0;
  for (DType t : kAllTypes) {
    for (int64_t head_dim : {64, 128}) {
      for (bool neox : {false, true}) {
        RopeParams p;
        p.neox = neox;
        p.base = head_dim == 64 ? 10000.0f : 500000.0f;
        const std::vector<uint8_t> orig = RandomRows(t, head_dim, kHeads * kCells, 4.0f, rng);
        TensorView v;
        v.dtype = t;
        v.ne[0] = head_dim;
        v.ne[1] = kHeads;
        v.ne[2] = kCells;
        v.nb[0] = BlockBytes(t);
        v.nb[1] = RowBytes(t, head_dim);
        v.nb[2] = v.nb[1] * kHeads;
        v.nb[3] = v.nb[2] * kCells;
        std::vector<uint8_t> want = orig;
        v.data = want.data();
        RopeShiftRef(v, deltas, p);
        ForEachTarget([&](const char* target) {
          std::vector<uint8_t> got = orig;
          v.data = got.data();
          RopeShift(v, deltas, p);
          ++cases;
          EXPECT_EQ(FirstDifference(got, want), -1)
              << target << " " << DTypeName(t) << " head_dim=" << head_dim
              << (neox ? " neox" : " normal");
        });
      }
    }
  }
  EXPECT_GT(cases, 0);
}

// f32 rows to every dtype (the quantizers of layouts/quant.h among them), and f16 / bf16 rows to
// the quantized ones: ConvertRow against ConvertRowRef, and ScatterToCells against its reference
// into a q8_0 and a q4_0 block.
TEST(ReferencesWithFma, ConversionsMatchBitForBit) {
  KV_SKIP_WITHOUT_FMA();
  std::mt19937 rng(41);
  constexpr int64_t kN = 256;
  int cases = 0;
  for (float range : {1e-3f, 3.0f, 6e4f}) {
    std::vector<float> x(kN);
    std::uniform_real_distribution<float> dist(-range, range);
    for (float& f : x) f = dist(rng);
    for (DType src_t : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> src(RowBytes(src_t, kN));
      StoreRowFromF32(x.data(), kN, src_t, src.data());
      for (DType dst_t : kAllTypes) {
        std::vector<uint8_t> want(RowBytes(dst_t, kN));
        ConvertRowRef(src.data(), src_t, want.data(), dst_t, kN);
        ForEachTarget([&](const char* target) {
          std::vector<uint8_t> got(want.size());
          ConvertRow(src.data(), src_t, got.data(), dst_t, kN);
          ++cases;
          EXPECT_EQ(FirstDifference(got, want), -1) << target << " " << DTypeName(src_t) << " -> "
                                                    << DTypeName(dst_t) << " range " << range;
        });
      }
    }
  }
  for (DType dst_t : {DType::kQ8_0, DType::kQ4_0}) {
    constexpr int32_t kHeadDim = 128, kKvHeads = 3, kBlockCells = 16;
    const std::vector<int32_t> cells = {5, 0, 9, 10, 11, 3};
    const CellBlockLayout layout =
        MakeCellBlockLayout(dst_t, kHeadDim, kKvHeads, kBlockCells, /*cells_fastest=*/false);
    const std::vector<uint8_t> src_bytes =
        RandomRows(DType::kF32, kHeadDim, kKvHeads * static_cast<int64_t>(cells.size()), 2.0f, rng);
    TensorView src;
    src.data = const_cast<uint8_t*>(src_bytes.data());
    src.dtype = DType::kF32;
    src.ne[0] = kHeadDim;
    src.ne[1] = kKvHeads;
    src.ne[2] = static_cast<int64_t>(cells.size());
    src.nb[0] = sizeof(float);
    src.nb[1] = sizeof(float) * kHeadDim;
    src.nb[2] = src.nb[1] * kKvHeads;
    src.nb[3] = src.nb[2] * cells.size();
    std::vector<uint8_t> want(layout.bytes, 0xA5);
    ScatterToCellsRef(src, cells, layout, want.data());
    ForEachTarget([&](const char* target) {
      std::vector<uint8_t> got(layout.bytes, 0xA5);
      ScatterToCells(src, cells, layout, got.data());
      ++cases;
      EXPECT_EQ(FirstDifference(got, want), -1) << target << " scatter to " << DTypeName(dst_t);
    });
  }
  EXPECT_GT(cases, 0);
}

}  // namespace
}  // namespace kv::kernels
