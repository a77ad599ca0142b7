// Regression tests for bugs the fuzzers (fuzz/) found. Each test names the fuzzer and the input
// saved under fuzz/corpus/<fuzzer>/ that first showed it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/convert.h"
#include "layouts/quant.h"

namespace kv {
namespace {

// fuzz_kernels (RopeShift on q8_0 rows, input fuzz/corpus/fuzz_kernels/regress_q8_tiny_scale):
// a block whose largest magnitude is tiny but not zero (amax < ~3.7e-37) gets d = amax / 127 in
// the f32 subnormal range, so id = 1 / d overflows to inf; x * id is then inf (or NaN for the zero
// elements, 0 * inf), and static_cast<int8_t> of a value outside int8 is undefined behaviour
// (UBSan: "-nan is outside the range of representable values of type 'signed char'"). Without
// sanitizers the codes come out 0 instead of round(x / d) = 127, so the element is lost.
TEST(FuzzRegressions, Q8_0BlockWithTinyMaximumKeepsItsCodes) {
  float x[32] = {};
  x[0] = 1e-38f;
  x[5] = -1e-38f;
  BlockQ8_0 b;
  QuantizeBlockQ8_0(x, &b);
  EXPECT_EQ(b.qs[0], 127);  // q = roundf(x / d), quant.h's contract
  EXPECT_EQ(b.qs[5], -127);
  for (int j : {1, 2, 31}) EXPECT_EQ(b.qs[j], 0);
}

// Same cause in q4_0 (fuzz_kernels, RopeShiftRef re-quantizing a q4_0 row): d = m / -8 is
// subnormal, id = 1 / d overflows, and the codes of the zero elements come from 0 * inf = NaN.
// q = min(15, trunc(x / d + 8.5)) gives 8 for a zero element and 0 for the maximum itself.
TEST(FuzzRegressions, Q4_0BlockWithTinyMaximumKeepsItsCodes) {
  float x[32] = {};
  x[0] = 1e-38f;
  BlockQ4_0 b;
  QuantizeBlockQ4_0(x, &b);
  EXPECT_EQ(b.qs[0] & 0xF, 0);  // element 0: trunc(-8 + 8.5)
  EXPECT_EQ(b.qs[1] & 0xF, 8);  // element 1: trunc(0 + 8.5)
  EXPECT_EQ(b.qs[0] >> 4, 8);   // element 16
}

// The same block through the dispatched conversion: bit-exact with the reference is the contract.
TEST(FuzzRegressions, Q8_0TinyBlockConvertMatchesReference) {
  std::vector<float> x(64, 0.0f);
  x[0] = 1e-38f;
  x[33] = 3e-39f;
  std::vector<uint8_t> a(2 * sizeof(BlockQ8_0)), r(a.size());
  kernels::ConvertRow(x.data(), DType::kF32, a.data(), DType::kQ8_0, 64);
  kernels::ConvertRowRef(x.data(), DType::kF32, r.data(), DType::kQ8_0, 64);
  EXPECT_EQ(0, std::memcmp(a.data(), r.data(), a.size()));
  BlockQ8_0 blocks[2];
  std::memcpy(blocks, r.data(), sizeof(blocks));
  EXPECT_EQ(blocks[0].qs[0], 127);
  EXPECT_EQ(blocks[1].qs[1], 127);
}

}  // namespace
}  // namespace kv
