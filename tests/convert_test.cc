// Convert, scatter and gather kernels (kernels/convert.h): every dispatched function against its
// scalar reference, bit for bit, on every compiled Highway target; the references against values
// worked out by hand.
#include "kernels/convert.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "hwy/aligned_allocator.h"
#include "hwy/targets.h"
#include "hwy/tests/hwy_gtest.h"
#include "kernels/highway_targets.h"
#include "layouts/quant.h"

namespace kv::kernels {
namespace {

constexpr DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

float Bits(uint32_t u) { return F32FromBits(u); }

// ---- the references against hand-computed values ---------------------------------------------

TEST(ConvertRefTest, F16HandValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3C00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xC000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7BFF);               // largest f16
  EXPECT_EQ(F32ToF16(65519.996f), 0x7BFF);             // just below the rounding boundary
  EXPECT_EQ(F32ToF16(65520.0f), 0x7C00);               // ties to even: 65536 is inf
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 1 unit: even (0)
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even (2)
  EXPECT_EQ(F32ToF16(Bits(0x3F801000u)), 0x3C00);      // 1 + 2^-11: tie, even stays 1.0
  EXPECT_EQ(F32ToF16(Bits(0x3F803000u)), 0x3C02);      // 1 + 3 * 2^-11: tie, rounds up to even
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(Bits(0x7F800000u)), 0x7C00);
  EXPECT_EQ(F32ToF16(Bits(0xFFC00001u)), 0xFE00);  // NaN: quiet, payload dropped
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F32Bits(F16ToF32(0x7C01)), 0x7F802000u);  // signaling NaN stays signaling
}

TEST(ConvertRefTest, BF16HandValues) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3F80);
  EXPECT_EQ(F32ToBF16(Bits(0x3F808000u)), 0x3F80);  // tie, even
  EXPECT_EQ(F32ToBF16(Bits(0x3F818000u)), 0x3F82);  // tie, odd -> up
  EXPECT_EQ(F32ToBF16(Bits(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(F32ToBF16(Bits(0x7F7FFFFFu)), 0x7F80);  // max float rounds to inf
  EXPECT_EQ(F32ToBF16(Bits(0x7F800001u)), 0x7FC0);  // NaN gets the quiet bit
}

TEST(ConvertRefTest, Q8_0HandBlock) {
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j);
  BlockQ8_0 b;
  QuantizeBlockQ8_0(x, &b);
  // d = 31/127 = 0.2440945: in [2^-3, 2^-2), mantissa 0.2440945 * 8 - 1 = 0.952756 -> 975.6 / 1024
  // rounds to 976 = 0x3D0; exponent field 15 - 3 = 12.
  EXPECT_EQ(b.d, (12 << 10) | 0x3D0);
  // q_j = round(j * 127 / 31); never a tie (31 does not divide 2 * 127 * j for 0 < j < 31).
  const int expected[32] = {0,  4,  8,  12, 16, 20, 25, 29, 33, 37,  41,  45,  49,  53,  57,  61,
                            66, 70, 74, 78, 82, 86, 90, 94, 98, 102, 107, 111, 115, 119, 123, 127};
  for (int j = 0; j < 32; ++j) EXPECT_EQ(b.qs[j], expected[j]) << j;
  // Half away from zero: amax 127 gives d = 1, id = 1 exactly.
  float y[32] = {};
  y[0] = 127.0f;
  y[1] = 2.5f;
  y[2] = -2.5f;
  y[3] = 0.49999997f;
  y[4] = 0.5f;
  QuantizeBlockQ8_0(y, &b);
  EXPECT_EQ(b.d, 0x3C00);
  EXPECT_EQ(b.qs[1], 3);
  EXPECT_EQ(b.qs[2], -3);
  EXPECT_EQ(b.qs[3], 0);
  EXPECT_EQ(b.qs[4], 1);
}

TEST(ConvertRefTest, Q4_0HandBlock) {
  float x[32];
  for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(j - 8);  // -8 .. 7
  for (int j = 16; j < 32; ++j) x[j] = 0.0f;
  BlockQ4_0 b;
  QuantizeBlockQ4_0(x, &b);
  // max = -8 (j = 0), d = -8 / -8 = 1, id = 1: q = trunc(x + 8.5) = j, zeros give 8.
  EXPECT_EQ(b.d, 0x3C00);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(b.qs[j], j | (8 << 4)) << j;
  // First of equal magnitudes wins: max = +4, d = -0.5, id = -2; x = -4 -> trunc(8 + 8.5) = 16
  // -> 15.
  float y[32] = {};
  y[0] = 4.0f;
  y[1] = -4.0f;
  QuantizeBlockQ4_0(y, &b);
  EXPECT_EQ(b.d, 0xB800);  // -0.5
  EXPECT_EQ(b.qs[0], 0 | (8 << 4));
  EXPECT_EQ(b.qs[1], 15 | (8 << 4));
  // All zero (even -0.0): max stays +0, d = 0 / -8 = -0.
  float z[32] = {};
  z[5] = -0.0f;
  QuantizeBlockQ4_0(z, &b);
  EXPECT_EQ(b.d, 0x8000);
  EXPECT_EQ(b.qs[0], 0x88);
}

// ---- test data ----------------------------------------------------------------------------------

// f32 values that stress every float conversion path.
std::vector<float> SpecialFloats() {
  const uint32_t bits[] = {
      0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x00400000u,  // zeros, f32 subnormals
      0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u, 0x7F800001u,
      0x7FFFFFFFu, 0xFFA00001u, 0x7FBFFFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu,  // NaNs, max float
      0x3F801000u, 0x3F803000u, 0x3F800FFFu, 0x3F801001u,               // f16 ties around 1
      0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u, 0xBF818000u,  // bf16 ties
      0x477FEFFFu, 0x477FF000u, 0x477FF001u, 0x47800000u, 0xC77FF000u,  // f16 overflow boundary
      0x387FFFFFu, 0x38800000u, 0x387FE000u, 0x38000000u, 0x33800000u,  // f16 subnormal boundary
      0x33000000u, 0x33000001u, 0x33400000u, 0x32FFFFFFu, 0x33C00000u,  // 2^-25 ties
      0x3A001000u, 0x3A003000u, 0xB9801000u,                            // subnormal ties
  };
  std::vector<float> v;
  for (uint32_t b : bits) v.push_back(Bits(b));
  return v;
}

// n f32 values: random of several magnitudes, with the special values mixed in when `special`.
std::vector<float> MakeFloats(std::mt19937& rng, size_t n, bool special) {
  const float scales[] = {1e-7f, 1e-3f, 1.0f, 300.0f, 6e4f, 1e30f};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 5);
  std::vector<float> v(n);
  const std::vector<float> sp = SpecialFloats();
  for (size_t i = 0; i < n; ++i) {
    const int r = pick(rng);
    if (special && r == 0) {
      v[i] = sp[rng() % sp.size()];
    } else if (special && r == 1) {
      v[i] = Bits(static_cast<uint32_t>(rng()));  // any bit pattern
    } else {
      v[i] = u(rng) * scales[(i / 32 + r) % 6];
    }
  }
  return v;
}

// Finite values for quantization: each 32-block has its own magnitude, plus blocks that hit the
// rounding ties (amax 127 -> id 1; q4 max -8 -> id 1), zero blocks and equal-magnitude maxima.
// With `nonfinite`, every fifth block also holds a NaN or an infinity (the kernels send it, or its
// whole scale group, through the reference path).
std::vector<float> MakeQuantFloats(std::mt19937& rng, size_t n, bool nonfinite = false) {
  const float scales[] = {1e-6f, 1e-2f, 1.0f, 50.0f, 3e4f, 7e3f};  // finite in f16 too
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t b = 0; b < n / 32; ++b) {
    float* x = v.data() + 32 * b;
    const int kind = static_cast<int>(b % 8);
    for (int j = 0; j < 32; ++j) x[j] = u(rng) * scales[(b + j / 16) % 6];
    if (kind == 1) {  // q8 ties: d = 1, id = 1
      for (int j = 0; j < 32; ++j)
        x[j] = static_cast<float>(static_cast<int>(rng() % 200) - 100) + 0.5f;
      x[7] = 127.0f;
      x[8] = 0.49999997f;
      x[9] = -0.49999997f;
    } else if (kind == 2) {  // q4 ties: max -8 -> d 1
      for (int j = 0; j < 32; ++j)
        x[j] = static_cast<float>(static_cast<int>(rng() % 16) - 8) + 0.5f * (rng() % 2);
      x[3] = -8.0f;
      x[20] = 8.0f;
    } else if (kind == 3) {
      for (int j = 0; j < 32; ++j) x[j] = (j % 3 == 0) ? -0.0f : 0.0f;
    } else if (kind == 4) {  // equal magnitudes, opposite signs: the first one wins in q4
      x[rng() % 32] = -2.0f * scales[b % 6];
      x[rng() % 32] = 2.0f * scales[b % 6];
    } else if (kind == 5) {  // tiny values: the scale is an f16 subnormal or zero
      for (int j = 0; j < 32; ++j) x[j] = u(rng) * 1e-9f;
    } else if (kind == 6 && b % 16 == 6) {  // d an f32 subnormal: 1/d finite, or inf
      const float tiny = b % 32 == 6 ? 1e-36f : 1e-41f;
      for (int j = 0; j < 32; ++j) x[j] = u(rng) * tiny;
    }
    if (nonfinite && b % 5 == 2) {
      const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity()};
      x[rng() % 32] = specials[rng() % 3];
    }
  }
  return v;
}

// Source bytes of dtype t (f32/f16/bf16) from f32 values, through the reference conversions;
// raw f16/bf16 bit patterns (all NaN payloads etc.) are mixed in when `raw`.
std::vector<uint8_t> Encode(const std::vector<float>& v, DType t, std::mt19937& rng, bool raw) {
  std::vector<uint8_t> out(v.size() * BlockBytes(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (raw && t != DType::kF32 && rng() % 8 == 0) {
      const uint16_t h = static_cast<uint16_t>(rng());
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      StoreFromF32(out.data(), t, static_cast<int64_t>(i), v[i]);
    }
  }
  return out;
}

std::string Hex(const uint8_t* p, size_t n) {
  static const char* k = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += k[p[i] >> 4];
    s += k[p[i] & 15];
  }
  return s;
}

// First differing byte, for readable failures.
::testing::AssertionResult SameBytes(const void* a, const void* b, size_t n) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) {
      const size_t lo = i >= 8 ? i - 8 : 0;
      const size_t len = std::min<size_t>(16, n - lo);
      return ::testing::AssertionFailure()
             << "byte " << i << " of " << n << ": got " << Hex(x + lo, len) << " want "
             << Hex(y + lo, len) << " (from byte " << lo << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- dispatched vs reference, per target
// ---------------------------------------------------------

class ConvertTest : public hwy::TestWithParamTarget {
 protected:
  void SetUp() override {
    hwy::TestWithParamTarget::SetUp();
    // The dispatch must really land on the target under test.
    ASSERT_NE(hwy::SupportedTargets() & GetParam(), 0);
  }
};

TEST_P(ConvertTest, F16AllValues) {
  std::vector<uint16_t> h(65536);
  std::iota(h.begin(), h.end(), 0);
  std::vector<float> got(65536), want(65536);
  RowToF32(h.data(), DType::kF16, got.data(), 65536);
  RowToF32Ref(h.data(), DType::kF16, want.data(), 65536);
  ASSERT_TRUE(SameBytes(got.data(), want.data(), got.size() * 4));
  for (DType dst : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> g(65536), w(65536);
    ConvertRow(h.data(), DType::kF16, g.data(), dst, 65536);
    ConvertRowRef(h.data(), DType::kF16, w.data(), dst, 65536);
    ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size() * 2)) << DTypeName(dst);
  }
  // Every bf16 pattern, too.
  RowToF32(h.data(), DType::kBF16, got.data(), 65536);
  RowToF32Ref(h.data(), DType::kBF16, want.data(), 65536);
  ASSERT_TRUE(SameBytes(got.data(), want.data(), got.size() * 4));
  for (DType dst : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> g(65536), w(65536);
    ConvertRow(h.data(), DType::kBF16, g.data(), dst, 65536);
    ConvertRowRef(h.data(), DType::kBF16, w.data(), dst, 65536);
    ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size() * 2)) << DTypeName(dst);
  }
}

// f32 -> f16 / bf16 over a sweep of the whole f32 bit space plus every pattern near the f16
// boundaries (overflow, smallest normal, subnormal ties).
TEST_P(ConvertTest, F32ToHalfSweep) {
  std::vector<uint32_t> bits;
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 4093) bits.push_back(static_cast<uint32_t>(b));
  const uint32_t centers[] = {0x477FF000u, 0x38800000u, 0x38000000u, 0x33000000u, 0x7F800000u,
                              0x3F801000u, 0x00000000u, 0x3F808000u, 0x7F7F8000u};
  for (uint32_t c : centers) {
    for (uint32_t s : {0u, 0x80000000u}) {
      for (int64_t k = -2048; k <= 2048; ++k) bits.push_back((c + static_cast<uint32_t>(k)) ^ s);
    }
  }
  const size_t n = bits.size();
  for (DType dst : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> g(n), w(n);
    ConvertRow(bits.data(), DType::kF32, g.data(), dst, static_cast<int64_t>(n));
    ConvertRowRef(bits.data(), DType::kF32, w.data(), dst, static_cast<int64_t>(n));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(g[i], w[i]) << DTypeName(dst) << " from f32 bits 0x" << std::hex << bits[i];
    }
  }
}

// Every (src, dst) pair, odd lengths and unaligned pointers, special and random values.
TEST_P(ConvertTest, ConvertRowAllPairs) {
  std::mt19937 rng(1234);
  for (DType src : kFloatTypes) {
    for (DType dst : kAllTypes) {
      const bool quant = IsQuantized(dst);
      const std::vector<int64_t> lens = quant ? std::vector<int64_t>{32, 64, 96, 4096}
                                              : std::vector<int64_t>{1, 3, 31, 33, 63, 127, 4096};
      for (int64_t n : lens) {
        for (int rep = 0; rep < 3; ++rep) {
          const size_t soff = static_cast<size_t>(rep) * BlockBytes(src);  // 0, 1, 2 elements
          const size_t doff =
              quant ? static_cast<size_t>(rep) : static_cast<size_t>(rep) * BlockBytes(dst);
          const std::vector<float> x =
              quant ? MakeQuantFloats(rng, static_cast<size_t>(n), /*nonfinite=*/rep == 2)
                    : MakeFloats(rng, static_cast<size_t>(n), true);
          const std::vector<uint8_t> enc = Encode(x, src, rng, !quant);
          std::vector<uint8_t> sbuf(enc.size() + 64);
          std::memcpy(sbuf.data() + soff, enc.data(), enc.size());
          const size_t db = RowBytes(dst, n);
          std::vector<uint8_t> g(db + 64, 0xAB), w(db + 64, 0xAB);
          ConvertRow(sbuf.data() + soff, src, g.data() + doff, dst, n);
          ConvertRowRef(sbuf.data() + soff, src, w.data() + doff, dst, n);
          ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size()))
              << DTypeName(src) << " -> " << DTypeName(dst) << " n=" << n << " rep=" << rep;
        }
      }
    }
  }
}

// Storage rows of every dtype back to f32, including arbitrary bytes (random q codes and scales).
TEST_P(ConvertTest, RowToF32AllTypes) {
  std::mt19937 rng(99);
  for (DType t : kAllTypes) {
    const bool quant = IsQuantized(t);
    const std::vector<int64_t> lens = quant ? std::vector<int64_t>{32, 64, 96, 4096}
                                            : std::vector<int64_t>{1, 3, 31, 33, 63, 127, 4096};
    for (int64_t n : lens) {
      for (int rep = 0; rep < 2; ++rep) {
        const size_t bytes = RowBytes(t, n);
        std::vector<uint8_t> row(bytes + 8);
        if (rep == 0 || !quant) {
          for (auto& b : row) b = static_cast<uint8_t>(rng());
        } else {
          StoreRowFromF32(MakeQuantFloats(rng, static_cast<size_t>(n)).data(), n, t,
                          row.data() + 1);
        }
        const uint8_t* p = row.data() + (quant ? 1 : BlockBytes(t) * static_cast<size_t>(rep));
        std::vector<float> g(static_cast<size_t>(n) + 1, 7.0f), w(static_cast<size_t>(n) + 1, 7.0f);
        RowToF32(p, t, g.data() + 1, n);
        RowToF32Ref(p, t, w.data() + 1, n);
        ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size() * 4)) << DTypeName(t) << " n=" << n;
      }
    }
  }
}

// Views: contiguous 4D, padded rows, strided elements, quantized rows with gaps.
TEST_P(ConvertTest, ViewToF32) {
  std::mt19937 rng(7);
  for (DType t : kAllTypes) {
    const bool quant = IsQuantized(t);
    for (int kind = 0; kind < 3; ++kind) {
      if (quant && kind == 2) continue;  // quantized rows are packed blocks
      TensorView v;
      v.dtype = t;
      v.ne[0] = quant ? 64 : 37;
      v.ne[1] = 3;
      v.ne[2] = 2;
      v.ne[3] = 2;
      const size_t esz = BlockBytes(t);
      v.nb[0] = kind == 2 ? esz * 3 : esz;
      const size_t row = kind == 2 ? v.nb[0] * static_cast<size_t>(v.ne[0]) : RowBytes(t, v.ne[0]);
      v.nb[1] = row + (kind == 0 ? 0 : 6 * esz);
      v.nb[2] = v.nb[1] * 3 + (kind == 0 ? 0 : 40);
      v.nb[3] = v.nb[2] * 2 + (kind == 0 ? 0 : 12);
      std::vector<uint8_t> buf(v.nb[3] * 2 + 64);
      if (quant) {
        for (auto& b : buf) b = static_cast<uint8_t>(rng() % 4 == 0 ? rng() : 0x3C);
      } else {
        const std::vector<float> x = MakeFloats(rng, buf.size() / esz, true);
        const std::vector<uint8_t> enc = Encode(x, t, rng, true);
        std::memcpy(buf.data(), enc.data(), std::min(buf.size(), enc.size()));
      }
      v.data = buf.data() + (quant ? 3 : esz);
      const size_t n = static_cast<size_t>(NumElements(v));
      std::vector<float> g(n), w(n);
      ViewToF32(v, g.data());
      ViewToF32Ref(v, w.data());
      ASSERT_TRUE(SameBytes(g.data(), w.data(), n * 4)) << DTypeName(t) << " kind=" << kind;
    }
  }
  // A cells-fastest block view.
  const CellBlockLayout l = MakeCellBlockLayout(DType::kF16, 24, 2, 70, true);
  std::vector<uint8_t> block(l.bytes);
  for (auto& b : block) b = static_cast<uint8_t>(rng());
  const TensorView v = CellBlockView(l, block.data(), 5, 41);
  std::vector<float> g(static_cast<size_t>(NumElements(v))), w(g.size());
  ViewToF32(v, g.data());
  ViewToF32Ref(v, w.data());
  ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size() * 4));
}

struct ScatterCase {
  DType dst;
  bool cells_fastest;
  int32_t head_dim;
};

// Scatter n tokens to random distinct cells (with a run of consecutive cells), every source
// layout, and compare the whole block byte for byte.
TEST_P(ConvertTest, ScatterToCells) {
  std::mt19937 rng(2024);
  const ScatterCase cases[] = {
      {DType::kF32, false, 20},   {DType::kF16, false, 37},   {DType::kBF16, false, 64},
      {DType::kF16, false, 300},  {DType::kQ8_0, false, 64},  {DType::kQ4_0, false, 96},
      {DType::kQ8_0, false, 288}, {DType::kQ4_0, false, 288}, {DType::kF32, true, 20},
      {DType::kF16, true, 200},   {DType::kBF16, true, 33},   {DType::kF32, true, 129},
  };
  const int32_t kv_heads = 3;
  const int32_t n_cells = 61;
  for (const ScatterCase& c : cases) {
    const CellBlockLayout layout =
        MakeCellBlockLayout(c.dst, c.head_dim, kv_heads, n_cells, c.cells_fastest);
    for (DType src_t : kFloatTypes) {
      for (int src_kind = 0; src_kind < 3; ++src_kind) {
        for (int32_t n : {1, 5, 40}) {
          // Cells: a shuffled permutation prefix, then a consecutive run in the middle.
          std::vector<int32_t> perm(n_cells);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng);
          std::vector<int32_t> cells(perm.begin(), perm.begin() + n);
          if (n == 40) {
            for (int i = 0; i < 20; ++i) cells[10 + i] = 30 + i;
            std::vector<int32_t> rest;
            for (int32_t x : perm) {
              if (x < 30 || x >= 50) rest.push_back(x);
            }
            for (int i = 0; i < 10; ++i) cells[i] = rest[i];
            for (int i = 30; i < 40; ++i) cells[i] = rest[i - 20];
          }
          // Source [head_dim, kv_heads, n]: 0 packed, 1 padded rows/tokens, 2 strided elements.
          TensorView src;
          src.dtype = src_t;
          src.ne[0] = c.head_dim;
          src.ne[1] = kv_heads;
          src.ne[2] = n;
          const size_t esz = BlockBytes(src_t);
          src.nb[0] = src_kind == 2 ? 2 * esz : esz;
          src.nb[1] = src.nb[0] * static_cast<size_t>(c.head_dim) + (src_kind == 0 ? 0 : 5 * esz);
          src.nb[2] = src.nb[1] * kv_heads + (src_kind == 0 ? 0 : 3 * esz);
          src.nb[3] = src.nb[2] * static_cast<size_t>(n);
          const size_t total = src.nb[3] / esz + 8;
          const bool quant = IsQuantized(c.dst);
          std::vector<float> x;
          if (quant) {
            x = MakeQuantFloats(rng, (total + 31) / 32 * 32);
            // Strided sources interleave elements of different blocks: keep them finite only.
          } else {
            x = MakeFloats(rng, total, true);
          }
          std::vector<uint8_t> sbuf = Encode(x, src_t, rng, !quant);
          src.data = sbuf.data() + esz;  // not vector-aligned
          std::vector<uint8_t> g(layout.bytes), w(layout.bytes);
          for (size_t i = 0; i < g.size(); ++i) g[i] = w[i] = static_cast<uint8_t>(i * 131 + 7);
          ScatterToCells(src, cells, layout, g.data());
          ScatterToCellsRef(src, cells, layout, w.data());
          ASSERT_TRUE(SameBytes(g.data(), w.data(), g.size()))
              << DTypeName(src_t) << " -> " << DTypeName(c.dst)
              << (c.cells_fastest ? " cells-fastest" : " plain") << " head_dim=" << c.head_dim
              << " src_kind=" << src_kind << " n=" << n;
        }
      }
    }
  }
}

// A prefill-sized batch (>= 256 KiB written) takes the streaming-store path for float rows; a
// block that is not 64-byte aligned takes plain stores row by row. Both must match the reference.
TEST_P(ConvertTest, ScatterToCellsLargeBatch) {
  std::mt19937 rng(77);
  const int32_t kv_heads = 8, head_dim = 128, n_cells = 1024, n = 160;  // f16: 320 KiB
  std::vector<int32_t> perm(n_cells);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<int32_t> cells(perm.begin(), perm.begin() + n);
  for (DType dst : kAllTypes) {
    const CellBlockLayout layout = MakeCellBlockLayout(dst, head_dim, kv_heads, n_cells, false);
    for (DType src_t : kFloatTypes) {
      const size_t elems = static_cast<size_t>(head_dim) * kv_heads * n;
      const std::vector<float> x =
          IsQuantized(dst) ? MakeQuantFloats(rng, elems) : MakeFloats(rng, elems, true);
      std::vector<uint8_t> sbuf = Encode(x, src_t, rng, !IsQuantized(dst));
      const TensorView src = MakeView(sbuf.data(), src_t, {head_dim, kv_heads, n});
      for (size_t misalign : {size_t{0}, size_t{32}}) {
        hwy::AlignedFreeUniquePtr<uint8_t[]> g = hwy::AllocateAligned<uint8_t>(layout.bytes + 64);
        std::vector<uint8_t> w(layout.bytes);
        for (size_t i = 0; i < layout.bytes; ++i) {
          g[misalign + i] = w[i] = static_cast<uint8_t>(i * 131 + 7);
        }
        ScatterToCells(src, cells, layout, g.get() + misalign);
        ScatterToCellsRef(src, cells, layout, w.data());
        ASSERT_TRUE(SameBytes(g.get() + misalign, w.data(), layout.bytes))
            << DTypeName(src_t) << " -> " << DTypeName(dst) << " misalign=" << misalign;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ConvertTestGroup, ConvertTest, testing::ValuesIn(DispatchableTargets()),
                         hwy::TestParamTargetName);

// A q4_0 block whose signed maximum is tiny: d = max / -8 is subnormal, 1 / d overflows, and the
// reference (layouts/quant.h) divides instead of multiplying by inf (whose int8 cast is undefined).
// Every target must agree with it. Element 0 is the maximum (-8 -> code 0); zeros get code 8.
TEST(ConvertDegenerateScale, Q4_0BlockWithTinyMaximum) {
  std::vector<float> x(64, 0.0f);
  x[0] = -1e-38f;
  x[40] = 2e-39f;
  std::vector<uint8_t> ref(2 * sizeof(BlockQ4_0));
  ConvertRowRef(x.data(), DType::kF32, ref.data(), DType::kQ4_0, 64);
  const uint8_t* codes = Q4Codes(ref.data());
  EXPECT_EQ(codes[0] & 0x0F, 0);
  for (int j = 1; j < 16; ++j) EXPECT_EQ(codes[j], 0x88) << j;
  for (int64_t target : DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<uint8_t> got(ref.size());
    ConvertRow(x.data(), DType::kF32, got.data(), DType::kQ4_0, 64);
    EXPECT_EQ(got, ref) << hwy::TargetName(target);
  }
  hwy::SetSupportedTargetsForTest(0);
}

// Non-finite input, and blocks whose f16 scale overflows (amax / 127 > 65504): llama.cpp's int8
// cast is undefined there. Ours is defined (layouts/quant.h SafeScaled) and every target agrees
// with the reference; dequantizing the result and quantizing again (what RopeShift does to such a
// row) stays defined too. UBSan (the asan preset) fails this test without SafeScaled.
TEST(ConvertDegenerateScale, NonFiniteAndHugeBlocksAreDefined) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(128, 1.0f);
  x[0] = std::numeric_limits<float>::quiet_NaN();  // block 0: NaN
  x[33] = inf;                                     // block 1: +inf
  x[40] = -inf;
  x[64] = 1e10f;  // block 2: scale overflows f16
  x[70] = -3e9f;
  x[96] = 3e38f;  // block 3: near the f32 maximum
  for (DType dt : {DType::kQ8_0, DType::kQ4_0}) {
    std::vector<uint8_t> ref(RowBytes(dt, 128));
    ConvertRowRef(x.data(), DType::kF32, ref.data(), dt, 128);
    std::vector<float> back(128);
    RowToF32Ref(ref.data(), dt, back.data(), 128);  // inf / NaN where the scale overflowed
    std::vector<uint8_t> again_ref(ref.size());
    ConvertRowRef(back.data(), DType::kF32, again_ref.data(), dt, 128);
    for (int64_t target : DispatchableTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      std::vector<uint8_t> got(ref.size()), again(ref.size());
      ConvertRow(x.data(), DType::kF32, got.data(), dt, 128);
      EXPECT_EQ(got, ref) << DTypeName(dt) << " " << hwy::TargetName(target);
      ConvertRow(back.data(), DType::kF32, again.data(), dt, 128);
      EXPECT_EQ(again, again_ref) << DTypeName(dt) << " " << hwy::TargetName(target);
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

TEST(ConvertTargetsTest, SeveralTargetsCompiled) {
  const std::vector<int64_t> targets = DispatchableTargets();
  std::string names;
  for (int64_t t : targets) names += std::string(hwy::TargetName(t)) + " ";
  std::printf("convert_test targets: %s\n", names.c_str());
#if HWY_ARCH_X86
  // Highway compiles the attainable targets from the build's baseline up. With the default
  // baseline (x86-64: SSE2) that is several, the fallback among them; a build whose baseline is
  // already AVX-512 (-march=native on this project's machines) has that target alone.
  if (HWY_STATIC_TARGET > HWY_AVX3) {  // a larger bit is a narrower target
    EXPECT_GE(targets.size(), 2u);
  } else {
    ASSERT_GE(targets.size(), 1u);
    EXPECT_LE(targets[0], HWY_AVX3);
  }
#elif HWY_ARCH_ARM_V7 && !defined(__ARM_NEON)
  // 32-bit Arm without NEON (Debian's default armhf flags): Highway's scalar code alone.
  ASSERT_EQ(targets.size(), 1u);
  EXPECT_TRUE(targets[0] == HWY_SCALAR || targets[0] == HWY_EMU128) << names;
#elif HWY_ARCH_ARM
  // On Arm (aarch64, and armv7 with -mfpu=neon) NEON is the baseline, so Highway compiles no
  // fallback below it (and the project leaves SVE out: CMakeLists.txt): NEON alone, which must be
  // a SIMD target.
  ASSERT_GE(targets.size(), 1u);
  EXPECT_NE(targets[0], HWY_SCALAR);
  EXPECT_NE(targets[0], HWY_EMU128);
#else
  // Elsewhere (s390x: Highway 1.0.3 has no vector target there) the scalar code may be all.
  ASSERT_GE(targets.size(), 1u);
#endif
}

}  // namespace
}  // namespace kv::kernels
