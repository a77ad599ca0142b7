// Tests for kernels/rope.h and core/rope_shift.h: the dispatched RopeShift against RopeShiftRef on
// every compiled target, every storage dtype, both styles; the rotation's algebra (inverse, unit
// magnitude, composition); untouched tails and delta-0 rows; hand-computed values; RopeShiftFn.
#include "kernels/rope.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/rope_shift.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/highway_targets.h"
#include "layouts/quant.h"

namespace kv::kernels {
namespace {

constexpr DType kAllTypes[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0};

// Runs fn once per compiled target (with that target forced), then restores the default.
void ForEachTarget(const std::function<void(const char*)>& fn) {
  static bool printed = false;
  if (!printed) {
    printed = true;
    std::printf("targets:");
    for (int64_t target : DispatchableTargets()) std::printf(" %s", hwy::TargetName(target));
    std::printf("\n");
  }
  for (int64_t target : DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    fn(hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(0);
}

// A [head_dim, heads, n] key tensor with padding between rows and between cells (bytes that no
// kernel may touch), filled with random values in storage dtype t.
struct Keys {
  DType t;
  int64_t head_dim, heads, n;
  size_t row_stride, cell_stride;
  std::vector<uint8_t> bytes;

  Keys(DType dt, int64_t hd, int64_t h, int64_t cells, uint32_t seed)
      : t(dt), head_dim(hd), heads(h), n(cells) {
    row_stride = RowBytes(t, head_dim) + 16;
    cell_stride = row_stride * static_cast<size_t>(heads) + 8;
    bytes.resize(cell_stride * static_cast<size_t>(n) + 8);
    std::mt19937 rng(seed);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());  // padding: random garbage
    std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
    std::vector<float> row(static_cast<size_t>(head_dim));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t hh = 0; hh < heads; ++hh) {
        for (auto& x : row) x = dist(rng);
        StoreRowFromF32(row.data(), head_dim, t, RowPtr(View(), hh, i));
      }
    }
  }
  TensorView View() const {
    TensorView v;
    v.data = const_cast<uint8_t*>(bytes.data());
    v.dtype = t;
    v.ne[0] = head_dim;
    v.ne[1] = heads;
    v.ne[2] = n;
    v.nb[0] = BlockBytes(t);
    v.nb[1] = row_stride;
    v.nb[2] = cell_stride;
    v.nb[3] = cell_stride * static_cast<size_t>(n);
    return v;
  }
  std::vector<float> Row(int64_t h, int64_t i) const {
    std::vector<float> r(static_cast<size_t>(head_dim));
    LoadRowAsF32(RowPtr(View(), h, i), head_dim, t, r.data());
    return r;
  }
};

// Partner index of element e in the rotated pair (for the error bound), or -1 beyond dims.
int64_t Partner(int64_t e, int64_t dims, bool neox) {
  if (e >= dims) return -1;
  if (neox) return e < dims / 2 ? e + dims / 2 : e - dims / 2;
  return e ^ 1;
}

TEST(RopeTest, AllTargetsMatchReference) {
  const int32_t deltas[] = {1, -1, 0, 7, -300, 4096, 100000, -(1 << 30), 5, 5};
  int checked = 0, exact = 0;
  for (DType t : kAllTypes) {
    for (int64_t head_dim : {32, 64, 96, 128}) {
      for (int64_t dims :
           {int64_t{0}, int64_t{2}, int64_t{6}, int64_t{22}, int64_t{34}, head_dim}) {
        if (dims > head_dim) continue;
        for (bool neox : {false, true}) {
          RopeParams p;
          p.dims = static_cast<int32_t>(dims);
          p.neox = neox;
          p.base = head_dim == 96 ? 500000.0f : 10000.0f;
          p.freq_scale = head_dim == 64 ? 0.25f : 1.0f;
          const int64_t rot = dims > 0 ? dims : head_dim;
          const uint32_t seed =
              static_cast<uint32_t>(head_dim * 131 + dims * 7 + neox + static_cast<int>(t) * 1000);
          Keys ref(t, head_dim, 3, 10, seed);
          const Keys orig = ref;
          RopeShiftRef(ref.View(), deltas, p);
          ForEachTarget([&](const char* target) {
            Keys got = orig;
            RopeShift(got.View(), deltas, p);
            SCOPED_TRACE(std::string(target) + " " + DTypeName(t) +
                         " head_dim=" + std::to_string(head_dim) + " dims=" + std::to_string(dims) +
                         (neox ? " neox" : " normal"));
            ++checked;
            if (got.bytes == ref.bytes) {
              ++exact;
              return;
            }
            // Not bit-identical (the kernel promises it is): say how far off, against the bound
            // an FMA contraction would give, 2^-23 (|x0| + |x1|) in f32 plus one storage rounding.
            Keys in = orig;
            for (int64_t i = 0; i < 10; ++i) {
              for (int64_t h = 0; h < 3; ++h) {
                const std::vector<float> x = in.Row(h, i), a = ref.Row(h, i), b = got.Row(h, i);
                for (int64_t e = 0; e < head_dim; ++e) {
                  const int64_t q = Partner(e, rot, neox);
                  if (q < 0 || deltas[i] == 0) {
                    if (!IsQuantized(t)) {
                      ASSERT_EQ(a[e], b[e]) << "untouched element " << e;
                    }
                    continue;
                  }
                  float tol = std::ldexp(std::fabs(x[e]) + std::fabs(x[q]), -23);
                  if (t == DType::kF16) tol += std::ldexp(std::fabs(a[e]), -10);
                  if (t == DType::kBF16) tol += std::ldexp(std::fabs(a[e]), -7);
                  if (IsQuantized(t)) tol = 1e30f;  // block scales may move; checked in f32 below
                  ASSERT_LE(std::fabs(a[e] - b[e]), tol)
                      << "row " << i << " head " << h << " elem " << e;
                }
              }
            }
            ADD_FAILURE() << "not bit-identical to the reference (though within the f32 bound)";
          });
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  }
  RecordProperty("bit_exact_cases", exact);
  std::printf(
      "RopeShift: %d of %d (target, dtype, shape, style) cases bit-identical to the reference\n",
      exact, checked);
  EXPECT_GT(checked, 0);
}

// f32 rotations: the inverse, unit magnitude and composition, on every target and both styles.
TEST(RopeTest, AlgebraF32) {
  ForEachTarget([](const char* target) {
    SCOPED_TRACE(target);
    for (bool neox : {false, true}) {
      for (int64_t head_dim : {2, 18, 64, 128, 256}) {
        RopeParams p;
        p.neox = neox;
        const int64_t n = 4;
        Keys k(DType::kF32, head_dim, 2, n, 99);
        const Keys orig = k;
        const std::vector<int32_t> plus = {3, 1000, 123456, -77}, minus = {-3, -1000, -123456, 77};
        RopeShift(k.View(), plus, p);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t h = 0; h < 2; ++h) {
            const std::vector<float> x = orig.Row(h, i), y = k.Row(h, i);
            for (int64_t e = 0; e < head_dim; ++e) {
              const int64_t q = Partner(e, head_dim, neox);
              if (e > q) continue;
              const double n0 = std::hypot(static_cast<double>(x[e]), static_cast<double>(x[q]));
              const double n1 = std::hypot(static_cast<double>(y[e]), static_cast<double>(y[q]));
              ASSERT_NEAR(n1, n0, 1e-6 * n0 + 1e-30) << "pair norm, elem " << e;
            }
          }
        }
        RopeShift(k.View(), minus, p);  // back to the start
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t h = 0; h < 2; ++h) {
            const std::vector<float> x = orig.Row(h, i), y = k.Row(h, i);
            for (int64_t e = 0; e < head_dim; ++e) {
              const int64_t q = Partner(e, head_dim, neox);
              const double scale = std::hypot(static_cast<double>(x[e]), static_cast<double>(x[q]));
              ASSERT_NEAR(y[e], x[e], 1e-5 * scale) << "inverse, elem " << e;
            }
          }
        }
        // R(a) R(b) = R(a + b).
        Keys two = orig, one = orig;
        const std::vector<int32_t> a = {5, -9, 300, 17}, b = {11, 2, -40000, 0},
                                   ab = {16, -7, -39700, 17};
        RopeShift(two.View(), a, p);
        RopeShift(two.View(), b, p);
        RopeShift(one.View(), ab, p);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t h = 0; h < 2; ++h) {
            const std::vector<float> x = orig.Row(h, i), y = two.Row(h, i), z = one.Row(h, i);
            for (int64_t e = 0; e < head_dim; ++e) {
              const int64_t q = Partner(e, head_dim, neox);
              const double scale = std::hypot(static_cast<double>(x[e]), static_cast<double>(x[q]));
              ASSERT_NEAR(y[e], z[e], 1e-5 * scale) << "composition, elem " << e;
            }
          }
        }
      }
    }
  });
}

// dims < head_dim leaves the tail, the padding and delta-0 rows byte for byte, every float dtype
// (quantized rows are re-quantized whole, like the reference, so only delta-0 rows are checked).
TEST(RopeTest, TailPaddingAndZeroDeltaUntouched) {
  ForEachTarget([](const char* target) {
    for (DType t : kAllTypes) {
      for (bool neox : {false, true}) {
        SCOPED_TRACE(std::string(target) + " " + DTypeName(t));
        RopeParams p;
        p.dims = 20;
        p.neox = neox;
        Keys k(t, 64, 2, 3, 7);
        const Keys orig = k;
        const std::vector<int32_t> d = {0, 9, 0};
        RopeShift(k.View(), d, p);
        const size_t row_bytes = RowBytes(t, 64);
        for (int64_t i = 0; i < 3; ++i) {
          for (int64_t h = 0; h < 2; ++h) {
            const size_t off =
                static_cast<size_t>(i) * k.cell_stride + static_cast<size_t>(h) * k.row_stride;
            const uint8_t* a = orig.bytes.data() + off;
            const uint8_t* b = k.bytes.data() + off;
            if (d[i] == 0) {
              EXPECT_EQ(0, std::memcmp(a, b, row_bytes)) << "delta-0 row changed";
            } else if (!IsQuantized(t)) {
              const size_t e = BlockBytes(t);
              EXPECT_NE(0, std::memcmp(a, b, 20 * e)) << "rotated dims unchanged";
              EXPECT_EQ(0, std::memcmp(a + 20 * e, b + 20 * e, row_bytes - 20 * e))
                  << "tail changed";
            }
            EXPECT_EQ(0, std::memcmp(a + row_bytes, b + row_bytes, k.row_stride - row_bytes))
                << "padding";
          }
        }
      }
    }
  });
}

// Heads wider than the kernel's stack buffers (512) take its thread_local path; same results.
TEST(RopeTest, WideHeadsMatchReference) {
  const int32_t deltas[] = {3, -8};
  for (DType t : {DType::kF32, DType::kBF16, DType::kQ8_0}) {
    for (bool neox : {false, true}) {
      RopeParams p;
      p.neox = neox;
      Keys ref(t, 1024, 1, 2, 11);
      const Keys orig = ref;
      RopeShiftRef(ref.View(), deltas, p);
      ForEachTarget([&](const char* target) {
        Keys got = orig;
        RopeShift(got.View(), deltas, p);
        EXPECT_EQ(got.bytes, ref.bytes)
            << target << " " << DTypeName(t) << (neox ? " neox" : " normal");
      });
    }
  }
}

// head_dim 4, base 10000: theta = 1 and 0.01 (normal: pairs (0,1), (2,3); NeoX: (0,2), (1,3)).
TEST(RopeTest, HandComputed) {
  ForEachTarget([](const char* target) {
    SCOPED_TRACE(target);
    for (bool neox : {false, true}) {
      float row[4] = {1.0f, 2.0f, 3.0f, 4.0f};
      TensorView v = MakeView(row, DType::kF32, {4, 1, 1});
      RopeParams p;
      p.neox = neox;
      const int32_t delta[] = {2};
      RopeShift(v, delta, p);
      const double a0 = 2.0, a1 = 0.02;  // delta * theta
      const int i0 = 0, j0 = neox ? 2 : 1, i1 = neox ? 1 : 2, j1 = 3;
      const double x[4] = {1, 2, 3, 4};
      double want[4];
      want[i0] = x[i0] * std::cos(a0) - x[j0] * std::sin(a0);
      want[j0] = x[i0] * std::sin(a0) + x[j0] * std::cos(a0);
      want[i1] = x[i1] * std::cos(a1) - x[j1] * std::sin(a1);
      want[j1] = x[i1] * std::sin(a1) + x[j1] * std::cos(a1);
      for (int e = 0; e < 4; ++e)
        EXPECT_NEAR(row[e], want[e], 1e-6) << (neox ? "neox " : "normal ") << e;
    }
  });
}

// Special stored values rotate as the reference rotates them, on every target: inf stays inf
// (or becomes NaN where the pair product is inf - inf), NaN stays NaN, subnormals and the largest
// finite values keep their exact magnitude. Targets without F16C read f16 in software; a software
// expansion that treats exponent 31 as a finite exponent would turn a stored inf into 2^16.
// NaN payloads may differ (F16C), so values are compared as floats with NaN equal to NaN.
TEST(RopeTest, SpecialValuesMatchReference) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {inf,       -inf,    nan,      0.0f,    -0.0f,    65504.0f,
                            -65504.0f, 6.0e-8f, -6.0e-8f, 3.0e-5f, 1.0e-40f, 3.0e38f,
                            -3.0e38f,  1.0f,    -2.5f,    inf,     0.5f,     nan};
  constexpr int64_t kHeadDim = 64, kHeads = 2, kCells = 4;
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (bool neox : {false, true}) {
      Keys orig(t, kHeadDim, kHeads, kCells, 3);
      int next = 0;
      std::vector<float> row(kHeadDim);
      for (int64_t i = 0; i < kCells; ++i) {
        for (int64_t h = 0; h < kHeads; ++h) {
          row = orig.Row(h, i);
          for (int64_t e = 0; e < kHeadDim; e += 3) row[e] = specials[next++ % std::size(specials)];
          StoreRowFromF32(row.data(), kHeadDim, t, RowPtr(orig.View(), h, i));
        }
      }
      RopeParams p;
      p.neox = neox;
      const int32_t deltas[] = {1, -7, 0, 300};
      Keys ref = orig;
      RopeShiftRef(ref.View(), deltas, p);
      int non_finite = 0;
      for (int64_t i = 0; i < kCells; ++i)
        for (int64_t h = 0; h < kHeads; ++h)
          for (float x : ref.Row(h, i)) non_finite += !std::isfinite(x);
      ASSERT_GT(non_finite, 8) << "the reference result must hold inf and NaN for this to test";
      ForEachTarget([&](const char* target) {
        SCOPED_TRACE(std::string(target) + " " + DTypeName(t) + (neox ? " neox" : " normal"));
        Keys got = orig;
        RopeShift(got.View(), deltas, p);
        for (int64_t i = 0; i < kCells; ++i) {
          for (int64_t h = 0; h < kHeads; ++h) {
            const std::vector<float> want = ref.Row(h, i), have = got.Row(h, i);
            for (int64_t e = 0; e < kHeadDim; ++e) {
              if (std::isnan(want[e])) {
                ASSERT_TRUE(std::isnan(have[e])) << "cell " << i << " head " << h << " elem " << e;
              } else {
                ASSERT_EQ(want[e], have[e]) << "cell " << i << " head " << h << " elem " << e;
              }
            }
          }
        }
      });
    }
  }
}

// A large delta keeps its accuracy (angles reduced in double): 2^30 positions on pair 0 (theta 1).
TEST(RopeTest, LargeDeltaAccurate) {
  float row[2] = {1.0f, 0.0f};
  TensorView v = MakeView(row, DType::kF32, {2, 1, 1});
  const int32_t delta[] = {1 << 30};
  RopeShift(v, delta, RopeParams{});
  EXPECT_NEAR(row[0], std::cos(1073741824.0), 1e-6);
  EXPECT_NEAR(row[1], std::sin(1073741824.0), 1e-6);
}

// ---- RopeShiftFn --------------------------------------------------------------------------------

TEST(RopeShiftFnTest, MatchesKernelForEveryDtype) {
  for (DType t : kAllTypes) {
    for (bool neox : {false, true}) {
      Keys a(t, 64, 2, 3, 5);
      Keys b = a;
      ShiftFn fn = RopeShiftFn(10000.0f, 0.5f, 32, neox);
      const std::vector<int32_t> d = {4, 0, -2};
      const Status st = fn(0, a.View(), d);
      ASSERT_TRUE(st.ok()) << st.message();
      RopeParams p;
      p.base = 10000.0f;
      p.freq_scale = 0.5f;
      p.dims = 32;
      p.neox = neox;
      RopeShift(b.View(), d, p);
      EXPECT_EQ(a.bytes, b.bytes) << DTypeName(t);
    }
  }
}

TEST(RopeShiftFnTest, RejectsBadViewsAndChangesNothing) {
  const std::vector<int32_t> d3 = {1, 2, 3};
  auto expect_invalid = [&](ShiftFn fn, TensorView v, std::span<const int32_t> d,
                            const char* what) {
    std::vector<uint8_t> before(static_cast<uint8_t*>(v.data), static_cast<uint8_t*>(v.data) + 64);
    const Status st = fn(0, v, d);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << what;
    EXPECT_NE(std::string(st.message()), "") << what;
    EXPECT_EQ(0, std::memcmp(before.data(), v.data, before.size())) << what;
  };
  Keys k(DType::kF32, 64, 2, 3, 1);
  const ShiftFn ok = RopeShiftFn(10000.0f);
  expect_invalid(ok, k.View(), std::span<const int32_t>(d3.data(), 2), "delta count");
  expect_invalid(RopeShiftFn(10000.0f, 1.0f, 7), k.View(), d3, "odd dims");
  expect_invalid(RopeShiftFn(10000.0f, 1.0f, 66), k.View(), d3, "dims above head_dim");
  expect_invalid(RopeShiftFn(10000.0f, 1.0f, -2), k.View(), d3, "negative dims");
  expect_invalid(RopeShiftFn(-1.0f), k.View(), d3, "negative base");
  expect_invalid(RopeShiftFn(10000.0f, NAN), k.View(), d3, "nan freq_scale");
  TensorView odd_head = k.View();
  odd_head.ne[0] = 63;  // odd head_dim with dims = 0
  expect_invalid(ok, odd_head, d3, "odd head_dim");
  TensorView bad_type = k.View();
  bad_type.dtype = static_cast<DType>(17);
  expect_invalid(ok, bad_type, d3, "dtype");
  TensorView strided = k.View();
  strided.nb[0] = 8;
  expect_invalid(ok, strided, d3, "unpacked rows");
  TensorView four_d = k.View();
  four_d.ne[3] = 2;
  expect_invalid(ok, four_d, d3, "4-d view");
  Keys q(DType::kQ8_0, 64, 2, 3, 1);
  TensorView q_bad = q.View();
  q_bad.ne[0] = 48;
  expect_invalid(ok, q_bad, d3, "quantized head_dim % 32");
  TensorView null_data = k.View();
  null_data.data = nullptr;
  EXPECT_EQ(ok(0, null_data, d3).code(), Code::kInvalidArgument);
  // n = 0 with no deltas is a no-op.
  TensorView empty = k.View();
  empty.ne[2] = 0;
  EXPECT_TRUE(ok(0, empty, {}).ok());
}

}  // namespace
}  // namespace kv::kernels
