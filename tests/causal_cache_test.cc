// The causal family against SEMANTICS.md sections 1-8: hand-computed cases (the worked examples
// among them), error paths that must leave the cache unchanged, and a randomized comparison with
// the plain reference model in fuzz/reference_model.h.
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cache_fingerprint.h"
#include "core/arena.h"
#include "core/cache.h"
#include "gtest/gtest.h"
#include "kernels/convert.h"
#include "reference_model.h"
#include "test_allocator.h"

namespace kv {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs StartForward on plain vectors.
Status Start(Cache* cache, const std::vector<int32_t>& pos, const std::vector<int32_t>& seq,
             bool reserve = false) {
  Batch b;
  b.positions = pos;
  b.sequences = seq;
  return cache->StartForward(b, reserve);
}

// Puts K = V = `values[i]` in every element of token i (head_dim d, kv_heads h), f32.
Status PutValues(Cache* cache, const std::vector<float>& values, int d = 4, int h = 1) {
  const int n = static_cast<int>(values.size());
  std::vector<float> k(static_cast<size_t>(d) * h * n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < d * h; ++j) k[static_cast<size_t>(i) * d * h + j] = values[i];
  }
  return cache->Put(MakeView(k.data(), DType::kF32, {d, h, n}),
                    MakeView(k.data(), DType::kF32, {d, h, n}));
}

// Element 0 of head 0 of every history cell of K, as f32.
std::vector<float> HistoryKeys(const History& h) {
  std::vector<float> all(static_cast<size_t>(h.k.ne[0] * h.k.ne[1] * h.k.ne[2]));
  kernels::ViewToF32(h.k, all.data());
  std::vector<float> out;
  for (int64_t c = 0; c < h.k.ne[2]; ++c)
    out.push_back(all[static_cast<size_t>(c * h.k.ne[0] * h.k.ne[1])]);
  return out;
}

// The mask as rows of '0' (visible) and 'x' (hidden), rows separated by " / ".
std::string MaskString(const History& h) {
  std::string s;
  for (int64_t i = 0; i < h.mask.ne[1]; ++i) {
    if (i) s += " / ";
    for (int64_t j = 0; j < h.mask.ne[0]; ++j) {
      float v;
      if (h.mask.dtype == DType::kF16) {
        v = F16ToF32(static_cast<const uint16_t*>(h.mask.data)[i * h.mask.ne[0] + j]);
      } else {
        v = static_cast<const float*>(h.mask.data)[i * h.mask.ne[0] + j];
      }
      if (j) s += ' ';
      s += v == 0.0f ? '0' : (v == -kInf ? 'x' : '?');
    }
  }
  return s;
}

// ---- §1 sizes ---------------------------------------------------------------------------------

TEST(CausalInit, SizesFollowTheRules) {
  auto swamem = NewSWAMemCache(2, 2);
  ASSERT_TRUE(swamem->Init(DType::kF16, 2, 16, 4).ok());
  EXPECT_EQ(swamem->NumCells(), 10);  // memory raised to 3: 2 * 3 + 4
  auto swa = NewSWACache(2);
  ASSERT_TRUE(swa->Init(DType::kF16, 1, 16, 4).ok());
  EXPECT_EQ(swa->NumCells(), 6);
  auto wide = NewSWACache(20);
  ASSERT_TRUE(wide->Init(DType::kF16, 1, 16, 4).ok());
  EXPECT_EQ(wide->NumCells(), 16);  // memory >= capacity: unlimited
  auto causal = NewCausalCache();
  ASSERT_TRUE(causal->Init(DType::kF32, 3, 100, 8).ok());
  EXPECT_EQ(causal->NumCells(), 300);
  auto padded = NewCausalCache();
  CacheConfig cfg;
  cfg.padding = 256;
  ASSERT_TRUE(padded->SetConfig(cfg).ok());
  ASSERT_TRUE(padded->Init(DType::kF32, 1, 1000, 8).ok());
  EXPECT_EQ(padded->NumCells(), 1024);
}

TEST(CausalInit, RejectsBadArguments) {
  auto bad_memory = NewSWAMemCache(20, 10);
  EXPECT_EQ(bad_memory->Init(DType::kF16, 1, 100, 4).code(), Code::kInvalidArgument);
  auto c = NewCausalCache();
  EXPECT_EQ(c->Init(DType::kF16, 0, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(c->Init(DType::kF16, 1, 0, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(c->Init(DType::kF16, 1, 16, 0).code(), Code::kInvalidArgument);
  CacheConfig cfg;
  cfg.permuted_v = true;
  ASSERT_TRUE(c->SetConfig(cfg).ok());
  EXPECT_EQ(c->Init(DType::kQ8_0, 1, 16, 4).code(), Code::kInvalidArgument);
  cfg.padding = 0;
  EXPECT_EQ(c->SetConfig(cfg).code(), Code::kInvalidArgument);
  cfg.padding = 1;
  cfg.mask_dtype = DType::kBF16;
  EXPECT_EQ(c->SetConfig(cfg).code(), Code::kInvalidArgument);
  auto ok = NewCausalCache();
  ASSERT_TRUE(ok->Init(DType::kF16, 1, 16, 4).ok());
  EXPECT_EQ(ok->SetConfig(CacheConfig()).code(), Code::kInvalidArgument);  // after Init
}

TEST(CausalInit, ChecksAnswerAsTheCallsWouldAndChangeNothing) {
  // CheckConfig / CheckInit (what a wrapper asks every child first) agree with SetConfig / Init.
  auto bad_memory = NewSWAMemCache(20, 10);
  EXPECT_EQ(bad_memory->CheckInit(DType::kF16, 1, 100, 4).code(), Code::kInvalidArgument);
  EXPECT_TRUE(bad_memory->CheckInit(DType::kF16, 2, 100, 4).ok());  // memory becomes 21
  auto c = NewCausalCache();
  EXPECT_EQ(c->CheckInit(DType::kF16, 1, 16, 0).code(), Code::kInvalidArgument);
  CacheConfig cfg;
  cfg.permuted_v = true;
  ASSERT_TRUE(c->SetConfig(cfg).ok());
  EXPECT_EQ(c->CheckInit(DType::kQ8_0, 1, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_TRUE(c->CheckInit(DType::kF16, 1, 16, 4).ok());
  EXPECT_EQ(c->NumCells(), 0);  // asking initialized nothing
  cfg.padding = 0;
  EXPECT_EQ(c->CheckConfig(cfg).code(), Code::kInvalidArgument);
  cfg.padding = 8;
  EXPECT_TRUE(c->CheckConfig(cfg).ok());
  ASSERT_TRUE(c->Init(DType::kF16, 1, 20, 4).ok());
  EXPECT_EQ(c->NumCells(), 20) << "CheckConfig applied its padding";
  EXPECT_EQ(c->CheckConfig(CacheConfig()).code(), Code::kInvalidArgument);  // after Init
}

// ---- §3/§4 worked examples ------------------------------------------------------------------

TEST(CausalWorkedExample, SlidingWindowOne) {
  auto cache = NewSWACache(1);
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 16).ok());
  EXPECT_EQ(cache->NumCells(), 17);
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  cache->SetLayer(0);
  ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3, 4}).ok());
  History h = cache->Get();
  EXPECT_EQ(HistoryKeys(h), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(MaskString(h), "0 x x x / 0 0 x x / x 0 0 x / x x 0 0");

  ASSERT_TRUE(Start(cache.get(), {4, 5}, {0, 0}).ok());
  ASSERT_TRUE(PutValues(cache.get(), {5, 6}).ok());
  h = cache->Get();
  EXPECT_EQ(HistoryKeys(h), (std::vector<float>{5, 6, 3, 4}));  // physical order
  EXPECT_EQ(MaskString(h), "0 x x 0 / 0 0 x x");
  EXPECT_TRUE(cache->CheckConsistency().ok());
}

TEST(CausalWorkedExample, ChunkTwo) {
  auto cache = NewChunkedAttentionCache(2);
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 16).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  cache->SetLayer(0);
  ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3, 4}).ok());
  EXPECT_EQ(MaskString(cache->Get()), "0 x x x / 0 0 x x / x x 0 x / x x 0 0");
}

TEST(CausalMask, InclusiveWindowConventionShowsWKeys) {
  auto cache = NewSWACache(2);
  CacheConfig cfg;
  cfg.window_convention = WindowConvention::kInclusive;
  ASSERT_TRUE(cache->SetConfig(cfg).ok());
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 16).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  EXPECT_EQ(MaskString(cache->Get()), "0 x x x / 0 0 x x / x 0 0 x / x x 0 0");
  auto ollama = NewSWACache(2);
  ASSERT_TRUE(ollama->Init(DType::kF32, 1, 16, 16).ok());
  ASSERT_TRUE(Start(ollama.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  EXPECT_EQ(MaskString(ollama->Get()), "0 x x x / 0 0 x x / 0 0 0 x / x 0 0 0");
}

TEST(CausalMask, SetCausalLiftsOnlyTheCausalRule) {
  auto cache = NewSWACache(1);
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 16, 8).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 0}, {0, 0, 0, 1}).ok());
  cache->SetCausal(std::vector<int32_t>{0, 3, 99});
  // Token 0 sees positions 0 and 1 (not 2: outside the window of 1 after lifting causality? no:
  // window hides p < P - 1 only, so p = 1, 2 > P stay visible once causality is lifted).
  EXPECT_EQ(MaskString(cache->Get()), "0 0 0 x / 0 0 x x / x 0 0 x / x x x 0");
  // Lasts until the next StartForward. Memory is 2 (window + 1 with two sequences): position 0 is
  // trimmed, the new token takes its cell 0; the history is cells 0..2 = positions 3, 1, 2.
  ASSERT_TRUE(Start(cache.get(), {3}, {0}).ok());
  EXPECT_EQ(MaskString(cache->Get()), "0 x 0");
}

TEST(CausalMask, F16MaskAndPadding) {
  auto cache = NewCausalCache();
  CacheConfig cfg;
  cfg.padding = 4;
  cfg.mask_dtype = DType::kF16;
  ASSERT_TRUE(cache->SetConfig(cfg).ok());
  ASSERT_TRUE(cache->Init(DType::kF16, 2, 8, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 0}, {0, 0, 1}).ok());
  History h = cache->Get();
  EXPECT_EQ(h.mask.dtype, DType::kF16);
  EXPECT_EQ(h.mask.ne[0], 4);  // 3 cells padded to 4
  EXPECT_EQ(MaskString(h), "0 x x x / 0 0 x x / x x 0 x");
}

TEST(CausalMask, Padding256RoundsTheHistoryOutward) {
  auto cache = NewSWACache(3);
  CacheConfig cfg;
  cfg.padding = 256;
  ASSERT_TRUE(cache->SetConfig(cfg).ok());
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 600, 8).ok());
  EXPECT_EQ(cache->NumCells(), 256);  // memory max(3, 3 + 1) = 4: 2 * 4 + 8 = 16, padded to 256
  cache->SetLayer(0);
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3, 4, 5, 6, 7}, {0, 0, 0, 0, 0, 0, 0, 0}).ok());
  ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3, 4, 5, 6, 7, 8}).ok());
  History h = cache->Get();
  EXPECT_EQ(h.k.ne[2], 256);  // cells 0..7 padded to [0, 255]
  EXPECT_EQ(h.mask.ne[0], 256);
  // Sequence 1's first token: sequence 0 (not in the batch) keeps positions >= 8 - 4, so cells
  // 0..3 are freed and the token takes cell 0. Only that cell is visible to it.
  ASSERT_TRUE(Start(cache.get(), {0}, {1}).ok());
  ASSERT_TRUE(PutValues(cache.get(), {9}).ok());
  h = cache->Get();
  EXPECT_EQ(h.k.ne[2], 256);
  const float* m = static_cast<const float*>(h.mask.data);
  for (int j = 0; j < 256; ++j) EXPECT_EQ(m[j] == 0.0f, j == 0) << j;
  const std::vector<float> keys = HistoryKeys(h);
  EXPECT_EQ(keys[0], 9);
  EXPECT_EQ(keys[4], 5);
  EXPECT_TRUE(cache->CanResume(0, 8));
  EXPECT_FALSE(cache->CanResume(0, 6));  // 6 - 3 = 3 < 4, the first position kept
}

// ---- §3 slots, full cache, reserve ------------------------------------------------------------

TEST(CausalStart, CacheFullLeavesEverythingAsItWas) {
  auto cache = NewSWACache(2);  // memory 2, cells 1 * 2 + 4 = 6
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 4).ok());
  ASSERT_EQ(cache->NumCells(), 6);
  cache->SetLayer(0);
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());  // cells 0..3
  ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3, 4}).ok());
  const std::string mask_before = MaskString(cache->Get());
  // Positions 3..6 would trim position 0 (< 3 - 2), giving 3 free cells for 4 tokens. Ollama trims
  // before failing; we must not.
  ASSERT_EQ(Start(cache.get(), {3, 4, 5, 6}, {0, 0, 0, 0}).code(), Code::kCacheFull);
  History h = cache->Get();  // the previous pass is intact
  EXPECT_EQ(HistoryKeys(h), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(MaskString(h), mask_before);
  EXPECT_TRUE(cache->CanResume(0, 2));  // needs position 0 still stored
  EXPECT_TRUE(cache->CheckConsistency().ok());
  ASSERT_TRUE(Start(cache.get(), {4, 5}, {0, 0}).ok());  // fits: trims positions 0, 1
  ASSERT_TRUE(PutValues(cache.get(), {5, 6}).ok());
  EXPECT_EQ(HistoryKeys(cache->Get()), (std::vector<float>{5, 6, 3, 4}));
  EXPECT_FALSE(cache->CanResume(0, 2));
}

TEST(CausalStart, ValidatesBatchesAndChangesNothing) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 8, 4).ok());
  EXPECT_EQ(Start(cache.get(), {0, 1}, {0}).code(), Code::kInvalidArgument);
  EXPECT_EQ(Start(cache.get(), {}, {}).code(), Code::kInvalidArgument);
  EXPECT_EQ(Start(cache.get(), {0, 1, 2, 3, 4}, {0, 0, 0, 0, 0}).code(), Code::kInvalidArgument);
  EXPECT_EQ(Start(cache.get(), {0}, {2}).code(), Code::kInvalidArgument);
  EXPECT_EQ(Start(cache.get(), {0}, {-1}).code(), Code::kInvalidArgument);
  cache->SetLayer(0);
  EXPECT_EQ(PutValues(cache.get(), {1}).code(), Code::kInvalidArgument);  // no StartForward yet
  EXPECT_TRUE(cache->CanResume(0, 0));
  EXPECT_TRUE(cache->CheckConsistency().ok());
  ASSERT_TRUE(Start(cache.get(), {0}, {0}).ok());
  EXPECT_EQ(cache->Get().k.data, nullptr);  // Get before Put: no storage yet, but a mask
  EXPECT_EQ(MaskString(cache->Get()), "0");
}

TEST(CausalStart, ReserveChangesNoMetadata) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 8, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1}, {0, 0}).ok());
  cache->SetLayer(0);
  ASSERT_TRUE(PutValues(cache.get(), {7, 8}).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}, /*reserve=*/true).ok());
  ASSERT_TRUE(PutValues(cache.get(), {1, 1, 1, 1}).ok());  // sizes storage, writes nothing
  History h = cache->Get();
  EXPECT_EQ(h.k.ne[2], 8);  // the whole table
  EXPECT_EQ(h.mask.ne[0], 8);
  EXPECT_EQ(HistoryKeys(h)[0], 7);
  EXPECT_EQ(HistoryKeys(h)[1], 8);
  // Token 0 (pos 0) sees cell 0 (pos 0, seq 0); cells 2..7 are free.
  EXPECT_EQ(MaskString(h).substr(0, 15), "0 x x x x x x x");
  ASSERT_TRUE(Start(cache.get(), {2}, {0}).ok());
  EXPECT_EQ(MaskString(cache->Get()), "0 0 0");  // cells 0, 1 kept, new token in cell 2
}

TEST(CausalStart, EmptyCacheReserveMaskIsAllHidden) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 4, 2).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1}, {0, 0}, true).ok());
  EXPECT_EQ(MaskString(cache->Get()), "x x x x / x x x x");
}

// ---- §5 Put/Get ----------------------------------------------------------------------------

TEST(CausalPut, ShapeAndDtypeMismatchesAreRejected) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kQ8_0, 1, 16, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1}, {0, 0}).ok());
  cache->SetLayer(0);
  std::vector<float> buf(64 * 2 * 2, 0.5f);
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kF32, {16, 2, 2}),
                      MakeView(buf.data(), DType::kF32, {16, 2, 2}))
                .code(),
            Code::kInvalidArgument);  // q8_0 needs head_dim % 32 == 0
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kF32, {32, 2, 1}),
                      MakeView(buf.data(), DType::kF32, {32, 2, 1}))
                .code(),
            Code::kInvalidArgument);  // batch of 2
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kF32, {32, 2, 2}),
                      MakeView(buf.data(), DType::kF32, {32, 1, 2}))
                .code(),
            Code::kInvalidArgument);  // kv heads disagree
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kQ8_0, {32, 2, 2}),
                      MakeView(buf.data(), DType::kF32, {32, 2, 2}))
                .code(),
            Code::kInvalidArgument);  // quantized input
  ASSERT_TRUE(cache
                  ->Put(MakeView(buf.data(), DType::kF32, {32, 2, 2}),
                        MakeView(buf.data(), DType::kF32, {64, 2, 2}))
                  .ok());
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kF32, {64, 2, 2}),
                      MakeView(buf.data(), DType::kF32, {64, 2, 2}))
                .code(),
            Code::kInvalidArgument);  // head size changed for layer 0
  cache->SetLayer(-1);
  EXPECT_EQ(cache
                ->Put(MakeView(buf.data(), DType::kF32, {32, 2, 2}),
                      MakeView(buf.data(), DType::kF32, {64, 2, 2}))
                .code(),
            Code::kInvalidArgument);
  cache->SetLayer(1);  // a new layer may have other shapes
  EXPECT_TRUE(cache
                  ->Put(MakeView(buf.data(), DType::kF32, {64, 1, 2}),
                        MakeView(buf.data(), DType::kF32, {32, 1, 2}))
                  .ok());
}

// SEMANTICS.md section 5: a Put whose input dtype differs from the layer's earlier Puts is
// kInvalidArgument and writes nothing (K and V may differ from each other; another layer, or the
// same layer after Init, may take another dtype). Before, any float input was converted.
TEST(CausalPut, InputDtypeChangeWithinALayerIsRejected) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kF16, 1, 16, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0}, {0}).ok());
  cache->SetLayer(0);
  std::vector<float> f32(8, 0.5f);
  std::vector<uint16_t> f16(8, 0x4200);  // 3.0
  const auto f32v = [&] { return MakeView(f32.data(), DType::kF32, {8, 1, 1}); };
  const auto f16v = [&] { return MakeView(f16.data(), DType::kF16, {8, 1, 1}); };
  ASSERT_TRUE(cache->Put(f32v(), f16v()).ok());  // K f32, V f16
  ASSERT_TRUE(Start(cache.get(), {1}, {0}).ok());
  const History before = cache->Get();
  const std::vector<uint8_t> k_before(static_cast<const uint8_t*>(before.k.data),
                                      static_cast<const uint8_t*>(before.k.data) + 4 * 16);
  EXPECT_EQ(cache->Put(f16v(), f16v()).code(), Code::kInvalidArgument);  // K now f16
  EXPECT_EQ(cache->Put(f32v(), f32v()).code(), Code::kInvalidArgument);  // V now f32
  const History after = cache->Get();
  EXPECT_EQ(std::memcmp(after.k.data, k_before.data(), k_before.size()), 0);  // cell 1 unwritten
  EXPECT_TRUE(cache->Put(f32v(), f16v()).ok());
  cache->SetLayer(1);
  EXPECT_TRUE(cache->Put(f16v(), f32v()).ok());
  ASSERT_TRUE(cache->Init(DType::kF16, 1, 16, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0}, {0}).ok());
  cache->SetLayer(0);
  EXPECT_TRUE(cache->Put(f16v(), f16v()).ok());
}

TEST(CausalPut, EveryStorageTypeRoundTripsThroughGet) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0}) {
    for (DType in : {DType::kF32, DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " from " + DTypeName(in));
      auto cache = NewCausalCache();
      ASSERT_TRUE(cache->Init(dt, 1, 8, 4).ok());
      ASSERT_TRUE(Start(cache.get(), {0, 1, 2}, {0, 0, 0}).ok());
      cache->SetLayer(3);
      const int d = 32, h = 2, n = 3;
      std::vector<float> src(d * h * n);
      for (size_t i = 0; i < src.size(); ++i) src[i] = std::sin(0.37f * i) * 4.0f;
      std::vector<uint16_t> half(src.size());
      for (size_t i = 0; i < src.size(); ++i)
        half[i] = in == DType::kF16 ? F32ToF16(src[i]) : F32ToBF16(src[i]);
      void* data =
          in == DType::kF32 ? static_cast<void*>(src.data()) : static_cast<void*>(half.data());
      ASSERT_TRUE(cache->Put(MakeView(data, in, {d, h, n}), MakeView(data, in, {d, h, n})).ok());
      const History hist = cache->Get();
      ASSERT_EQ(hist.k.ne[0], d);
      ASSERT_EQ(hist.k.ne[1], h);
      ASSERT_EQ(hist.k.ne[2], n);
      std::vector<float> k(d * h * n), v(d * h * n);
      kernels::ViewToF32(hist.k, k.data());
      kernels::ViewToF32(hist.v, v.data());
      const float tol = dt == DType::kQ4_0                           ? 0.6f
                        : dt == DType::kQ8_0                         ? 0.04f
                        : (dt == DType::kBF16 || in == DType::kBF16) ? 0.03f
                                                                     : 0.004f;
      for (size_t i = 0; i < src.size(); ++i) {
        ASSERT_NEAR(k[i], src[i], tol) << i;
        ASSERT_EQ(k[i], v[i]) << i;
      }
    }
  }
}

TEST(CausalPut, PermutedVIsCellsFastest) {
  auto cache = NewCausalCache();
  CacheConfig cfg;
  cfg.permuted_v = true;
  ASSERT_TRUE(cache->SetConfig(cfg).ok());
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 8, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1}, {0, 0}).ok());
  cache->SetLayer(0);
  const int d = 3, h = 2, n = 2;
  std::vector<float> v(d * h * n);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);  // v[t][h][d] = t*6 + h*3 + d
  std::vector<float> k(4 * h * n, 0.0f);
  ASSERT_TRUE(cache
                  ->Put(MakeView(k.data(), DType::kF32, {4, h, n}),
                        MakeView(v.data(), DType::kF32, {d, h, n}))
                  .ok());
  const History hist = cache->Get();
  ASSERT_EQ(hist.v.ne[0], n);
  ASSERT_EQ(hist.v.ne[1], d);
  ASSERT_EQ(hist.v.ne[2], h);
  std::vector<float> got(d * h * n);
  kernels::ViewToF32(hist.v, got.data());  // [h][d][t]
  for (int hh = 0; hh < h; ++hh) {
    for (int dd = 0; dd < d; ++dd) {
      for (int t = 0; t < n; ++t) EXPECT_EQ(got[(hh * d + dd) * n + t], t * 6 + hh * 3 + dd);
    }
  }
}

// ---- §6 CopyPrefix, §7 CanResume
// -----------------------------------------------------------------

TEST(CausalCopyPrefix, SharesCellsWithoutCopying) {
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 8, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  cache->SetLayer(0);
  ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3, 4}).ok());
  ASSERT_TRUE(Start(cache.get(), {0}, {1}).ok());  // seq 1 holds cell 4
  ASSERT_TRUE(PutValues(cache.get(), {9}).ok());
  ASSERT_TRUE(cache->CopyPrefix(0, 1, 2).ok());  // seq 1 loses cell 4, shares cells 0, 1
  ASSERT_TRUE(Start(cache.get(), {2}, {1}).ok());
  ASSERT_TRUE(PutValues(cache.get(), {7}).ok());
  const History h = cache->Get();
  EXPECT_EQ(HistoryKeys(h), (std::vector<float>{1, 2, 3, 4, 7}));  // new token reuses freed cell 4
  EXPECT_EQ(MaskString(h), "0 0 x x 0");
  EXPECT_EQ(cache->CopyPrefix(0, 5, 1).code(), Code::kInvalidArgument);
  EXPECT_TRUE(cache->CheckConsistency().ok());
}

TEST(CausalCanResume, FollowsTheWindow) {
  auto cache = NewSWACache(4);
  ASSERT_TRUE(cache->Init(DType::kF32, 1, 64, 8).ok());
  EXPECT_FALSE(cache->CanResume(0, 0));  // empty
  std::vector<int32_t> pos, seq;
  for (int i = 0; i < 8; ++i) {
    pos.push_back(i);
    seq.push_back(0);
  }
  ASSERT_TRUE(Start(cache.get(), pos, seq).ok());
  ASSERT_TRUE(Start(cache.get(), {8}, {0}).ok());  // trims positions < 8 - 4 = 4
  // Stored positions 4..8: first 4, last 8.
  EXPECT_TRUE(cache->CanResume(0, 8));
  EXPECT_TRUE(cache->CanResume(0, 9));
  EXPECT_FALSE(cache->CanResume(0, 10));
  EXPECT_FALSE(cache->CanResume(0, 7));  // 7 - 4 = 3 < 4
  EXPECT_FALSE(cache->CanResume(1, 0));
  EXPECT_FALSE(cache->CanResume(-1, 0));
  auto unlimited = NewCausalCache();
  ASSERT_TRUE(unlimited->Init(DType::kF32, 1, 8, 8).ok());
  EXPECT_TRUE(unlimited->CanResume(0, 100));
}

// ---- §8 Remove
// ------------------------------------------------------------------------------------

struct ShiftRecord {
  int layer;
  int64_t cells;
  std::vector<int32_t> delta;
};

TEST(CausalRemove, ShiftsLaterTokensAndReportsDeltas) {
  std::vector<ShiftRecord> calls;
  ShiftFn fn = [&](int layer, TensorView key, std::span<const int32_t> shift) {
    calls.push_back({layer, key.ne[2], std::vector<int32_t>(shift.begin(), shift.end())});
    return Status::Ok();
  };
  auto cache = NewCausalCache(fn);
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 8, 3).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2}, {0, 0, 0}).ok());
  for (int l : {0, 2}) {
    cache->SetLayer(l);
    ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3}).ok());
  }
  ASSERT_TRUE(Start(cache.get(), {0, 3, 4}, {1, 0, 0}).ok());  // cell 3 is seq 1's
  for (int l : {0, 2}) {
    cache->SetLayer(l);
    ASSERT_TRUE(PutValues(cache.get(), {9, 4, 5}).ok());
  }
  // Remove positions [1, 3) of seq 0: cells 1, 2 freed; cells 4, 5 (pos 3, 4) move to 1, 2.
  ASSERT_TRUE(cache->Remove(0, 1, 3).ok());
  // seq 0 now spans cells 0..5 (0, 4, 5). Chunks of max_batch = 3 from cell 0: [0..2] has no moved
  // cell; [3..5] moves cells 4, 5 -> one call per layer with 2 cells, deltas -2, -2.
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].layer, 0);
  EXPECT_EQ(calls[1].layer, 2);
  EXPECT_EQ(calls[0].cells, 2);
  EXPECT_EQ(calls[0].delta, (std::vector<int32_t>{-2, -2}));
  ASSERT_TRUE(Start(cache.get(), {3}, {0}).ok());
  cache->SetLayer(0);
  ASSERT_TRUE(PutValues(cache.get(), {6}).ok());
  // seq 0 holds cells 0, 4, 5 (positions 0, 1, 2); the new token takes freed cell 1; cell 2 is free
  // and cell 3 is seq 1's.
  EXPECT_EQ(MaskString(cache->Get()), "0 0 x x 0 0");
  EXPECT_TRUE(cache->CheckConsistency().ok());
}

TEST(CausalRemove, ErrorsComeBeforeAnyChange) {
  auto cache = NewCausalCache();  // no ShiftFn
  ASSERT_TRUE(cache->Init(DType::kF32, 2, 8, 4).ok());
  ASSERT_TRUE(Start(cache.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  EXPECT_EQ(cache->Remove(0, 1, 2).code(), Code::kNotSupported);  // would shift 2, 3
  EXPECT_TRUE(cache->Remove(0, 2, kPosMax).ok());                 // to the end: no shift
  EXPECT_TRUE(cache->Remove(0, 1, 2).ok());                       // nothing after 2 remains
  EXPECT_EQ(cache->Remove(0, 3, 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(cache->Remove(7, 0, 1).code(), Code::kInvalidArgument);

  std::vector<int> layers;
  auto shared = NewCausalCache([&](int l, TensorView, std::span<const int32_t>) {
    layers.push_back(l);
    return Status::Ok();
  });
  ASSERT_TRUE(shared->Init(DType::kF32, 2, 8, 4).ok());
  ASSERT_TRUE(Start(shared.get(), {0, 1, 2, 3}, {0, 0, 0, 0}).ok());
  shared->SetLayer(0);
  ASSERT_TRUE(PutValues(shared.get(), {1, 2, 3, 4}).ok());
  ASSERT_TRUE(shared->CopyPrefix(0, 1, 4).ok());
  EXPECT_EQ(shared->Remove(0, 0, 1).code(), Code::kNotSupported);  // cells 1..3 shared with seq 1
  EXPECT_TRUE(layers.empty());
  ASSERT_TRUE(Start(shared.get(), {4}, {0}).ok());
  EXPECT_EQ(MaskString(shared->Get()), "0 0 0 0 0");  // nothing was removed
}

// A ShiftFn that fails: Remove returns its error and the cache is as it was, whichever call
// failed. The keys are re-rotated before the cell table changes; a failure after some calls
// succeeded undoes them with the opposite deltas. The ShiftFn here adds the delta to element 0 of
// each row (exactly invertible in f32), so "as it was" is checked byte for byte.
TEST(CausalRemove, AFailingShiftFnChangesNothing) {
  for (int fail_at_call : {0, 1, 2, 3, -1}) {  // -1: never fails
    SCOPED_TRACE("fail_at_call " + std::to_string(fail_at_call));
    int calls = 0;
    std::vector<std::pair<int, std::vector<int32_t>>> seen;
    auto cache = NewCausalCache([&](int l, TensorView key, std::span<const int32_t> delta) {
      if (calls++ == fail_at_call) return Status::Error(Code::kInvalidArgument, "refused");
      seen.push_back({l, std::vector<int32_t>(delta.begin(), delta.end())});
      for (int64_t j = 0; j < key.ne[2]; ++j) {
        for (int64_t h = 0; h < key.ne[1]; ++h) {
          static_cast<float*>(RowPtr(key, h, j))[0] += static_cast<float>(delta[j]);
        }
      }
      return Status::Ok();
    });
    // max_batch 4: positions 4..9 move by -2 and span two chunks of cells, times two layers.
    ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 4).ok());
    for (int32_t p0 = 0; p0 < 12; p0 += 4) {
      ASSERT_TRUE(Start(cache.get(), {p0, p0 + 1, p0 + 2, p0 + 3}, {0, 0, 0, 0}).ok());
      for (int l = 0; l < 2; ++l) {
        cache->SetLayer(l);
        ASSERT_TRUE(
            PutValues(cache.get(), {100.0f + p0, 101.0f + p0, 102.0f + p0, 103.0f + p0}).ok());
      }
    }
    const std::vector<uint8_t> before = testing::Fingerprint(*cache);
    const Status s = cache->Remove(0, 2, 4);
    if (fail_at_call < 0) {
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(seen.size(), 4u);  // two chunks x two layers
      EXPECT_NE(testing::Fingerprint(*cache), before);
      cache->SetLayer(1);
      ASSERT_TRUE(Start(cache.get(), {10}, {0}).ok());
      // Cells 4..11 held positions 4..11; now 2..9 with element 0 moved by -2.
      const std::vector<float> keys = HistoryKeys(cache->Get());
      EXPECT_EQ(keys[4], 102.0f);
      EXPECT_EQ(keys[11], 109.0f);
    } else {
      EXPECT_EQ(s.code(), Code::kInvalidArgument);
      EXPECT_STREQ(s.message(), "refused");
      EXPECT_EQ(testing::Fingerprint(*cache), before);
      EXPECT_TRUE(cache->CheckConsistency().ok());
      EXPECT_TRUE(cache->CanResume(0, 12));
      // The calls made were undone in reverse order with the opposite deltas.
      ASSERT_EQ(seen.size(), 2u * static_cast<size_t>(fail_at_call));
      for (int i = 0; i < fail_at_call; ++i) {
        const auto& done = seen[static_cast<size_t>(i)];
        const auto& undo = seen[seen.size() - 1 - static_cast<size_t>(i)];
        EXPECT_EQ(done.first, undo.first);
        ASSERT_EQ(done.second.size(), undo.second.size());
        for (size_t j = 0; j < done.second.size(); ++j) EXPECT_EQ(done.second[j], -undo.second[j]);
      }
    }
  }
}

// ---- allocation failure at Init ----------------------------------------------------------------

TEST(CausalInit, AllocationFailureReturnsOutOfMemoryAndChangesNothing) {
  // Init takes three blocks (cell table, per-pass scratch, mask row); fail each in turn.
  for (int fail_at = 0; fail_at < 3; ++fail_at) {
    SCOPED_TRACE("fail_at " + std::to_string(fail_at));
    testing::TestAllocator alloc;
    alloc.fail_from = fail_at;  // this allocation and every later one fail
    auto fresh = NewCausalCache();
    ASSERT_TRUE(fresh->SetAllocator(alloc.Get()).ok());
    EXPECT_EQ(fresh->Init(DType::kF32, 2, 64, 8).code(), Code::kOutOfMemory);
    EXPECT_EQ(fresh->NumCells(), 0);
    EXPECT_EQ(Start(fresh.get(), {0}, {0}).code(), Code::kInvalidArgument);  // still uninitialized
    alloc.fail_from = -1;
    ASSERT_TRUE(fresh->Init(DType::kF32, 2, 64, 8).ok());  // usable once memory is back
    ASSERT_TRUE(Start(fresh.get(), {0, 1}, {0, 0}).ok());

    // Re-Init of a cache that holds tokens: on failure the tokens, history and mask stay.
    testing::TestAllocator again;
    auto cache = NewSWACache(2);
    ASSERT_TRUE(cache->SetAllocator(again.Get()).ok());
    ASSERT_TRUE(cache->Init(DType::kF32, 1, 16, 4).ok());
    cache->SetLayer(0);
    ASSERT_TRUE(Start(cache.get(), {0, 1, 2}, {0, 0, 0}).ok());
    ASSERT_TRUE(PutValues(cache.get(), {1, 2, 3}).ok());
    const std::string mask_before = MaskString(cache->Get());
    again.fail_from = again.calls + fail_at;
    EXPECT_EQ(cache->Init(DType::kF32, 4, 64, 8).code(), Code::kOutOfMemory);
    EXPECT_EQ(cache->NumCells(), 6);
    EXPECT_EQ(HistoryKeys(cache->Get()), (std::vector<float>{1, 2, 3}));
    EXPECT_EQ(MaskString(cache->Get()), mask_before);
    EXPECT_TRUE(cache->CanResume(0, 3));
    EXPECT_TRUE(cache->CheckConsistency().ok());
    again.fail_from = -1;
    ASSERT_TRUE(Start(cache.get(), {3}, {0}).ok());
    ASSERT_TRUE(PutValues(cache.get(), {4}).ok());
    // Position 0 falls out of memory (3 - 2); the new token reuses its cell 0.
    EXPECT_EQ(HistoryKeys(cache->Get()), (std::vector<float>{4, 2, 3}));
  }
}

// ---- randomized: the cache against the plain model
// ------------------------------------------------

struct Variant {
  const char* name;
  int32_t window, memory, chunk;
};

// GoogleTest prints a parameter without a PrintTo byte by byte, padding included (indeterminate
// bytes: valgrind reports them).
void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

class CausalRandomized : public ::testing::TestWithParam<Variant> {};

TEST_P(CausalRandomized, MatchesTheReferenceModel) {
  const Variant var = GetParam();
  for (int trial = 0; trial < 12; ++trial) {
    std::mt19937 rng(1234 + trial * 7919);
    auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int max_seq = pick(1, 4), capacity = pick(4, 24), max_batch = pick(1, 6);
    const int padding = pick(0, 3) == 0 ? 4 : 1;
    const bool inclusive = pick(0, 1) == 1;
    const bool with_shift = pick(0, 3) != 0;
    SCOPED_TRACE(std::string(var.name) + " trial " + std::to_string(trial));

    kvref::CausalModel model(var.window, var.memory, var.chunk, with_shift);
    model.padding = padding;
    model.inclusive_window = inclusive;
    const int d = 2;
    // Key element = cell value; the ShiftFn adds the delta so the model can mirror it exactly.
    ShiftFn fn = [&](int, TensorView key, std::span<const int32_t> delta) {
      for (int64_t c = 0; c < key.ne[2]; ++c)
        for (int64_t h = 0; h < key.ne[1]; ++h)
          for (int64_t e = 0; e < key.ne[0]; ++e) {
            float* p = reinterpret_cast<float*>(static_cast<char*>(key.data) + c * key.nb[2] +
                                                h * key.nb[1] + e * key.nb[0]);
            *p += static_cast<float>(delta[c]);
          }
      return Status::Ok();
    };
    std::unique_ptr<CausalCache> cache;
    if (var.memory) {
      cache = NewSWAMemCache(var.window, var.memory, with_shift ? fn : nullptr);
    } else if (var.window) {
      cache = NewSWACache(var.window, with_shift ? fn : nullptr);
    } else if (var.chunk) {
      cache = NewChunkedAttentionCache(var.chunk, with_shift ? fn : nullptr);
    } else {
      cache = NewCausalCache(with_shift ? fn : nullptr);
    }
    CacheConfig cfg;
    cfg.padding = padding;
    cfg.window_convention = inclusive ? WindowConvention::kInclusive : WindowConvention::kOllama;
    ASSERT_TRUE(cache->SetConfig(cfg).ok());
    const kvref::Result init = model.Init(max_seq, capacity, max_batch);
    const Status st = cache->Init(DType::kF32, max_seq, capacity, max_batch);
    ASSERT_EQ(init == kvref::Result::kOk, st.ok()) << st.message();
    if (!st.ok()) continue;
    ASSERT_EQ(cache->NumCells(), static_cast<int32_t>(model.cells.size()));
    std::vector<float> cell_value(model.cells.size(), 0.0f);
    std::vector<int32_t> next_pos(max_seq, 0);
    float next_value = 1;
    bool have_batch = false;

    for (int step = 0; step < 300; ++step) {
      const int op = pick(0, 9);
      if (op <= 5) {  // StartForward + Put + Get
        const int b = pick(1, max_batch);
        std::vector<int32_t> pos(b), seq(b);
        for (int i = 0; i < b; ++i) {
          seq[i] = pick(0, max_seq - 1);
          if (pick(0, 9) == 0)
            next_pos[seq[i]] = std::max(0, next_pos[seq[i]] - pick(1, 5));  // rewind
          pos[i] = next_pos[seq[i]]++;
        }
        // CheckStartForward (what a wrapper asks first) answers as StartForward will, and
        // changes nothing.
        const std::vector<uint8_t> before = testing::Fingerprint(*cache);
        const Status checked = cache->CheckStartForward(Batch{pos, seq, {}}, false);
        ASSERT_EQ(testing::Fingerprint(*cache), before);
        const kvref::Result r = model.StartForward(pos, seq);
        const Status s = Start(cache.get(), pos, seq);
        ASSERT_EQ(checked.code(), s.code()) << checked.message() << " / " << s.message();
        ASSERT_EQ(static_cast<int>(r), s.ok() ? 0 : (s.code() == Code::kCacheFull ? 1 : 3))
            << s.message();
        if (!s.ok()) {
          for (int i = 0; i < b; ++i) next_pos[seq[i]] = std::max(0, next_pos[seq[i]] - 1);
          continue;
        }
        have_batch = true;
        if (pick(0, 4) == 0) {
          std::vector<int32_t> except;
          for (int i = 0; i < b; ++i) {
            if (pick(0, 1)) except.push_back(i);
          }
          model.SetCausal(except);
          cache->SetCausal(except);
        }
        std::vector<float> vals(b);
        for (int i = 0; i < b; ++i) {
          vals[i] = next_value++;
          cell_value[model.batch_cells[i]] = vals[i];
        }
        cache->SetLayer(0);
        ASSERT_TRUE(PutValues(cache.get(), vals, d).ok());
      } else if (op == 6) {
        const int src = pick(0, max_seq - 1), dst = pick(0, max_seq - 1), len = pick(0, 30);
        ASSERT_EQ(model.CopyPrefix(src, dst, len) == kvref::Result::kOk,
                  cache->CopyPrefix(src, dst, len).ok());
        if (src != dst) next_pos[dst] = len;
        have_batch = false;
      } else if (op == 7) {
        const int s = pick(0, max_seq - 1);
        const int32_t begin = pick(0, 20);
        const int32_t end = pick(0, 2) == 0 ? kPosMax : begin + pick(0, 6);
        std::vector<kvref::ShiftCall> calls;
        const kvref::Result r = model.Remove(s, begin, end, &calls);
        const Status st2 = cache->Remove(s, begin, end);
        ASSERT_EQ(r == kvref::Result::kOk, st2.ok()) << st2.message();
        if (r == kvref::Result::kNotSupported) {
          ASSERT_EQ(st2.code(), Code::kNotSupported);
        }
        for (const kvref::ShiftCall& call : calls) {
          for (size_t i = 0; i < call.delta.size(); ++i)
            cell_value[call.first_cell + i] += call.delta[i];
        }
        have_batch = false;
      } else {
        const int s = pick(0, max_seq - 1);
        const int32_t p = pick(0, 30);
        ASSERT_EQ(model.CanResume(s, p), cache->CanResume(s, p)) << "seq " << s << " pos " << p;
      }
      ASSERT_TRUE(cache->CheckConsistency().ok()) << cache->CheckConsistency().message();
      if (!have_batch) continue;
      const History h = cache->Get();
      const int len = model.hist_max - model.hist_min + 1;
      ASSERT_EQ(h.mask.ne[0], len);
      ASSERT_EQ(h.k.ne[2], len);
      const std::vector<float> keys = HistoryKeys(h);
      for (int j = 0; j < len; ++j)
        ASSERT_EQ(keys[j], cell_value[model.hist_min + j]) << "history cell " << j;
      const float* mask = static_cast<const float*>(h.mask.data);
      for (size_t i = 0; i < model.batch_pos.size(); ++i) {
        for (int j = 0; j < len; ++j) {
          ASSERT_EQ(mask[i * len + j] == 0.0f, model.Visible(static_cast<int>(i), j))
              << "token " << i << " cell " << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CausalRandomized,
                         ::testing::Values(Variant{"causal", 0, 0, 0}, Variant{"swa3", 3, 0, 0},
                                           Variant{"swa1", 1, 0, 0}, Variant{"swamem2_6", 2, 6, 0},
                                           Variant{"swamem4_5", 4, 5, 0},
                                           Variant{"chunk3", 0, 0, 3}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kv
