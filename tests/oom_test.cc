// Allocation failure (issue 8): storage comes through the cache's ArenaAllocator
// (Cache::SetAllocator), so a test can make any allocation fail. A failed first Put of a layer, a
// failed ReserveLayers and a load that needs storage return kOutOfMemory and leave the cache
// exactly as it was and usable: once memory is back, the same calls succeed and decoding goes on.
#include <cstdlib>
#include <vector>

#include "cache_fingerprint.h"
#include "core/persistence.h"
#include "decode_driver.h"
#include "gtest/gtest.h"
#include "layouts/kv_layout.h"
#include "test_allocator.h"

namespace kv {
namespace {

using testing::AllCacheKinds;
using testing::CacheKind;
using testing::Driver;
using testing::Fingerprint;
using testing::TestAllocator;

TEST(OutOfMemory, FirstPutOfEachLayerEveryKind) {
  for (const CacheKind& kind : AllCacheKinds()) {
    SCOPED_TRACE(kind.name);
    TestAllocator alloc;
    Driver d;
    auto cache = kind.make();
    ASSERT_TRUE(cache->SetAllocator(alloc.Get()).ok());
    ASSERT_TRUE(cache->Init(DType::kQ8_0, 2, 64, d.max_batch).ok());

    // Layer 0's first Put fails: kOutOfMemory, nothing allocated, and the cache works afterwards.
    alloc.fail = true;
    const auto empty = Fingerprint(*cache);
    Status s = d.Prefill(cache.get(), 0, 0, 4);
    EXPECT_EQ(s.code(), Code::kOutOfMemory) << s.message();
    EXPECT_EQ(cache->MemoryBytes(), 0u + cache->MemoryBytes());  // no crash reading it
    EXPECT_TRUE(cache->CheckConsistency().ok());
    cache->SetLayer(0);
    EXPECT_EQ(cache->Get().k.data, nullptr);

    // Memory is back: the same layer's Put succeeds; layer 1 then fails on its own first Put.
    alloc.fail = false;
    Driver one = d;
    one.layers = 1;
    ASSERT_TRUE(one.Prefill(cache.get(), 0, 0, 4).ok());
    const auto after_layer0 = Fingerprint(*cache);
    EXPECT_NE(after_layer0, empty);
    alloc.fail = true;
    d.seq[0] = 0;
    d.pos[0] = 4;
    Batch b;
    b.positions = std::span<const int32_t>(d.pos.data(), 1);
    b.sequences = std::span<const int32_t>(d.seq.data(), 1);
    ASSERT_TRUE(cache->StartForward(b, false).ok());
    const auto before_put = Fingerprint(*cache);
    cache->SetLayer(1);
    s = cache->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, 1}),
                   MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, 1}));
    EXPECT_EQ(s.code(), Code::kOutOfMemory);
    EXPECT_EQ(Fingerprint(*cache), before_put);
    alloc.fail = false;
    EXPECT_TRUE(cache
                    ->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, 1}),
                          MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, 1}))
                    .ok());
    // Decoding continues on both layers, attention included.
    std::vector<float> out(d.layers * d.out.size());
    for (int t = 5; t < 10; ++t) ASSERT_TRUE(d.Tokens(cache.get(), {{0, t}}, out.data()).ok());
    EXPECT_TRUE(cache->CheckConsistency().ok());
    EXPECT_GT(alloc.failures, 0);
    cache->Close();
    EXPECT_EQ(alloc.releases, alloc.allocations);  // every region went back to its allocator
  }
}

TEST(OutOfMemory, ReserveLayersAndInitStayUsable) {
  TestAllocator alloc;
  Driver d;
  auto cache = NewSWAMemCache(4, 8);
  ASSERT_TRUE(cache->SetAllocator(alloc.Get()).ok());
  alloc.fail = true;
  // Init takes its metadata (cell table, per-pass scratch, mask row) from the same allocator.
  EXPECT_EQ(cache->Init(DType::kF16, 2, 64, d.max_batch).code(), Code::kOutOfMemory);
  EXPECT_EQ(cache->NumCells(), 0);
  alloc.fail = false;
  ASSERT_TRUE(cache->Init(DType::kF16, 2, 64, d.max_batch).ok());
  const int after_init = alloc.allocations;
  alloc.fail = true;
  const auto before = Fingerprint(*cache);
  EXPECT_EQ(cache->ReserveLayers(d.layers, d.dk, d.dv, d.kv_heads).code(), Code::kOutOfMemory);
  EXPECT_EQ(Fingerprint(*cache), before);
  alloc.fail = false;
  ASSERT_TRUE(cache->ReserveLayers(d.layers, d.dk, d.dv, d.kv_heads).ok());
  const int regions = alloc.allocations;
  EXPECT_EQ(regions - after_init, 1);  // one region for every layer
  ASSERT_TRUE(d.Prefill(cache.get(), 0, 0, 8).ok());
  // The first multi-token batch may grow the mask (Init sizes one row); nothing else allocates.
  const int after_first = alloc.allocations;
  EXPECT_LE(after_first - regions, 1);
  ASSERT_TRUE(d.Prefill(cache.get(), 1, 0, 8).ok());
  EXPECT_EQ(alloc.allocations, after_first);  // Puts used the reserved storage
  // A new allocator is refused while storage is held, accepted after Close.
  EXPECT_EQ(cache->SetAllocator(alloc.Get()).code(), Code::kInvalidArgument);
  EXPECT_EQ(cache->SetAllocator(ArenaAllocator{}).code(), Code::kInvalidArgument);
  cache->Close();
  EXPECT_TRUE(cache->SetAllocator(alloc.Get()).ok());
  ASSERT_TRUE(cache->Init(DType::kF16, 2, 64, d.max_batch).ok());
  ASSERT_TRUE(d.Prefill(cache.get(), 0, 0, 8).ok());
}

TEST(OutOfMemory, LoadNeedingStorageChangesNothing) {
  Driver d;
  auto src = NewCausalCache();
  ASSERT_TRUE(src->Init(DType::kBF16, 2, 32, d.max_batch).ok());
  ASSERT_TRUE(d.Prefill(src.get(), 0, 0, 6).ok());
  std::vector<uint8_t> whole, one;
  ASSERT_TRUE(SaveCache(*src, &whole).ok());
  ASSERT_TRUE(SaveCache(*src, &one, 0).ok());

  TestAllocator alloc;
  auto dst = NewCausalCache();
  ASSERT_TRUE(dst->SetAllocator(alloc.Get()).ok());
  ASSERT_TRUE(dst->Init(DType::kBF16, 2, 32, d.max_batch).ok());
  Driver l0 = d;
  l0.layers = 1;
  ASSERT_TRUE(l0.Prefill(dst.get(), 1, 0, 3).ok());  // layer 0 exists; layer 1 must be allocated
  const auto before = Fingerprint(*dst);
  alloc.fail = true;
  EXPECT_EQ(LoadCache(whole, dst.get()).code(), Code::kOutOfMemory);
  EXPECT_EQ(Fingerprint(*dst), before);
  EXPECT_EQ(LoadCache(one, dst.get(), 0).code(), Code::kOutOfMemory);
  EXPECT_EQ(Fingerprint(*dst), before);
  alloc.fail = false;
  ASSERT_TRUE(LoadCache(one, dst.get(), 0).ok());
  EXPECT_TRUE(dst->CheckConsistency().ok());
  EXPECT_TRUE(d.Tokens(dst.get(), {{0, 6}, {1, 3}}).ok());
}

}  // namespace
}  // namespace kv
