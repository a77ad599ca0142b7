// Regression tests for bugs the fuzzers (fuzz/) found. Each test names the fuzzer and the input
// saved under fuzz/corpus/<fuzzer>/ that first showed it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cache.h"
#include "core/persistence.h"
#include "gtest/gtest.h"
#include "kernels/convert.h"
#include "layouts/kv_layout.h"
#include "layouts/quant.h"
#include "stream_edit.h"

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

// fuzz_session (LoadCache of a resealed stream, input
// fuzz/corpus/fuzz_session/regress_huge_layer_shape): a stream may declare an allocated layer of
// any shape the per-field limits allow (head_dim < 2^25, kv_heads <= 65536) while saving no cells,
// so loading it reserves that layer over every cell of the target. The byte count of such a layer
// is computed in size_t; with 2^21 f32 cells, [2^25 - 1, 65536] rows of 2^27 padded bytes make
// 2^27 * 2^21 * 65536 = 2^64 bytes per block, which wrapped to 0: ReserveLayers and LoadCache
// "succeeded" with no storage behind the layer, and the next Put wrote past the arena. A count
// that does not fit in size_t is now kOutOfMemory, and the cache is unchanged.
constexpr int32_t kWrapCells = 1 << 21;
constexpr int32_t kWrapHeadDim = INT32_MAX / 64;  // the largest head_dim a layer may have
constexpr int32_t kWrapHeads = 65536;             // the most kv heads a layer may have

std::unique_ptr<CausalCache> WrapSizedCache() {
  auto cache = NewCausalCache(ShiftFn());
  if (!cache->Init(DType::kF32, 1, kWrapCells, 1).ok()) return nullptr;
  return cache;
}

// The checked count agrees with the layout wherever it fits, in both V layouts. On a 64-bit machine
// every shape below fits; on a 32-bit one (the armhf preset) the largest do not.
TEST(FuzzRegressions, CheckedBlockBytesAgreeWithTheLayout) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0}) {
    for (int32_t head_dim : {32, 64, 96, 128, 4096}) {
      for (int32_t heads : {1, 3, 8}) {
        for (int32_t cells : {1, 7, 256, 1000, 65536}) {
          for (bool fastest : {false, true}) {
            if (fastest && IsQuantized(dt)) continue;
            SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " " << head_dim << " " << heads
                                              << " " << cells << " " << fastest);
            size_t bytes = 0;
            const bool fits = CellBlockBytesFit(dt, head_dim, heads, cells, fastest, &bytes);
            // One head's stride is below 2^31 for these shapes: only the product over the heads
            // can exceed a 32-bit size_t, and the layout computes it wrapped there.
            const CellBlockLayout l = MakeCellBlockLayout(dt, head_dim, heads, cells, fastest);
            ASSERT_LT(l.head_stride, size_t{1} << 31);
            const uint64_t want = uint64_t{l.head_stride} * static_cast<uint64_t>(heads);
            ASSERT_EQ(fits, want <= SIZE_MAX);
            if (sizeof(size_t) == 8) {
              ASSERT_TRUE(fits);
            }
            if (fits) {
              EXPECT_EQ(bytes, l.bytes);
            }
          }
        }
      }
    }
  }
  size_t bytes = 0;
  EXPECT_FALSE(CellBlockBytesFit(DType::kF32, kWrapHeadDim, kWrapHeads, kWrapCells, false, &bytes));
  EXPECT_FALSE(CellBlockBytesFit(DType::kF16, kWrapHeadDim, kWrapHeads, 1 << 24, true, &bytes));
  // Just below: 2^63 bytes fit in a 64-bit size_t (not in a 32-bit one).
  EXPECT_EQ(CellBlockBytesFit(DType::kF32, kWrapHeadDim, kWrapHeads, kWrapCells / 2, false, &bytes),
            sizeof(size_t) == 8);
  if (sizeof(size_t) == 8) {
    EXPECT_EQ(bytes, uint64_t{1} << 63);
  }
}

TEST(FuzzRegressions, LayerWhoseByteCountWrapsIsOutOfMemory) {
  // The premise: the block's byte count is a multiple of 2^64 (2^48 bytes per head), so it wraps
  // to 0 in a 64-bit size_t. In a 32-bit one the head stride wraps too: every product does.
  const CellBlockLayout l =
      MakeCellBlockLayout(DType::kF32, kWrapHeadDim, kWrapHeads, kWrapCells, false);
  ASSERT_EQ(uint64_t{l.head_stride}, (uint64_t{1} << 48) & SIZE_MAX);
  ASSERT_EQ(l.bytes, 0u);

  auto cache = WrapSizedCache();
  ASSERT_NE(cache, nullptr);
  ASSERT_EQ(cache->NumCells(), kWrapCells);
  const size_t memory = cache->MemoryBytes();
  const Status s = cache->ReserveLayers(1, kWrapHeadDim, kWrapHeadDim, kWrapHeads);
  EXPECT_EQ(s.code(), Code::kOutOfMemory) << s.message();
  EXPECT_EQ(cache->MemoryBytes(), memory);
  cache->SetLayer(0);
  EXPECT_EQ(cache->Get().k.data, nullptr);
  // Layers whose sum (not each one) overflows: 4096 layers of 2^59 bytes (K and V of 2^58).
  const Status many = cache->ReserveLayers(4096, kWrapHeadDim / 64, kWrapHeadDim / 64, 65536);
  EXPECT_EQ(many.code(), Code::kOutOfMemory) << many.message();
  EXPECT_EQ(cache->MemoryBytes(), memory);
}

TEST(FuzzRegressions, StreamWithAWrappingLayerShapeLeavesTheTargetUnchanged) {
  auto src = WrapSizedCache();
  ASSERT_NE(src, nullptr);
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*src, &bytes).ok());
  // Causal body (core/persistence.h): layer count at 64, then 16-byte layer records, then the
  // cell count. Declare one allocated layer of the wrapping shape, keep zero cells, reseal.
  constexpr size_t kLayers = 64, kLayer0 = 68;
  ASSERT_EQ(bytes[kLayers], 0);
  bytes[kLayers] = 1;
  const uint8_t allocated[16] = {1};
  bytes.insert(bytes.begin() + kLayer0, allocated, allocated + 16);
  kvfuzz::StoreLittleEndian(&bytes, kLayer0 + 4, kWrapHeadDim, 4);  // k_head_dim
  kvfuzz::StoreLittleEndian(&bytes, kLayer0 + 8, kWrapHeadDim, 4);  // v_head_dim
  kvfuzz::StoreLittleEndian(&bytes, kLayer0 + 12, kWrapHeads, 4);
  kvfuzz::ResealStream(&bytes);

  auto target = WrapSizedCache();
  ASSERT_NE(target, nullptr);
  const size_t memory = target->MemoryBytes();
  const Status s = LoadCache(bytes, target.get());
  EXPECT_EQ(s.code(), Code::kOutOfMemory) << s.message();
  EXPECT_EQ(target->MemoryBytes(), memory);
  target->SetLayer(0);
  EXPECT_EQ(target->Get().k.data, nullptr);
}

}  // namespace
}  // namespace kv
