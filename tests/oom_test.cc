// Allocation failure (issue 8): storage comes through the cache's ArenaAllocator
// (Cache::SetAllocator), so a test can make any allocation fail. A failed first Put of a layer, a
// failed ReserveLayers and a load that needs storage return kOutOfMemory and leave the cache
// exactly as it was and usable: once memory is back, the same calls succeed and decoding goes on.
// Attend's per-thread scratch comes from the heap: tests/malloc_hooks.cc (linked into this
// executable) makes a chosen heap allocation fail.
#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cache_fingerprint.h"
#include "core/attend.h"
#include "core/persistence.h"
#include "decode_driver.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/convert.h"
#include "kernels/highway_targets.h"
#include "layouts/kv_layout.h"
#include "malloc_hooks.h"
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

// A history for Attend: Hkv 2, G 4, head_dim 64, L 4096 cells stored in `dtype`, and a mask whose
// rows see a long run of cells and then two cells of every three (two-cell spans: decode gathers
// those into a copy, its third scratch buffer).
struct AttendHistory {
  static constexpr int64_t kD = 64, kHkv = 2, kHq = 8, kL = 4096;
  DType dtype;
  int64_t B;
  std::vector<uint8_t> k, v;
  std::vector<float> mask, q;
  AttendHistory(DType t, int64_t batch) : dtype(t), B(batch) {
    k = Store([](int64_t i) { return std::sin(0.37f * static_cast<float>(i)); });
    v = Store([](int64_t i) { return std::cos(0.11f * static_cast<float>(i)); });
    q.resize(kD * B * kHq);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.53f * static_cast<float>(i));
    mask.assign(kL * B, -INFINITY);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < kL; ++j) {
        if (j < 1000 + b || (j >= 2000 && j % 3 != 0)) mask[b * kL + j] = 0.0f;
      }
    }
  }
  // [kD, kHkv, kL] in dtype: element i (in that order) is value(i).
  template <class Value>
  std::vector<uint8_t> Store(const Value& value) const {
    std::vector<float> f32(kD * kHkv * kL);
    for (size_t i = 0; i < f32.size(); ++i) f32[i] = value(static_cast<int64_t>(i));
    std::vector<uint8_t> rows(RowBytes(dtype, kD) * kHkv * kL);
    kernels::ConvertRow(f32.data(), DType::kF32, rows.data(), dtype, kD * kHkv * kL);
    return rows;
  }
  History Get() {
    History h;
    h.k = MakeView(k.data(), dtype, {kD, kHkv, kL});
    h.v = MakeView(v.data(), dtype, {kD, kHkv, kL});
    h.mask = MakeView(mask.data(), DType::kF32, {kL, B});
    return h;
  }
  Status Attend(std::vector<float>* out, const ParallelFor& pf) {
    out->assign(kD * B * kHq, -1.0f);
    TensorView o = MakeView(out->data(), DType::kF32, {kD, B, kHq});
    return kv::Attend(MakeView(q.data(), DType::kF32, {kD, B, kHq}), Get(), AttentionParams(), &o,
                      pf);
  }
};

// A parallel-for that runs every task on a thread of its own, started for the call: no task finds
// a per-thread scratch buffer grown by an earlier call. With fail_large set, each such thread's
// first large allocation fails.
struct FreshThreads {
  bool fail_large = false;
  static void Run(void* user, int64_t n, void (*task)(void*, int64_t), void* ctx) {
    const bool fail = static_cast<FreshThreads*>(user)->fail_large;
    std::vector<std::thread> threads;
    for (int64_t i = 0; i < n; ++i) {
      threads.emplace_back([=] {
        heap_hooks::FailLargeAllocationOnThisThread(fail ? 0 : -1);
        task(ctx, i);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  ParallelFor Get() { return ParallelFor{&Run, this, 2}; }
};

// Every large allocation a call makes on the calling thread fails in turn (each on a new thread,
// whose scratch is empty): the call returns kOutOfMemory instead of writing through a null buffer,
// and the same call on that thread afterwards succeeds with the output of an undisturbed run, so a
// failed growth left the scratch consistent. Decode (B 1, 3: the call's spans and partials, the
// task's query rows, the gathered copy) and prefill (B 16: the call's granule bits, the task's
// tiles), on the calling thread; then with each task on a fresh thread whose allocation fails.
// Every compiled target (their tasks size their scratch differently: f16's query patterns on
// AVX-512, q8_0's integer query rows with VNNI) and dtype f32, f16, q8_0.
void ExpectAttendReportsScratchFailures(DType dtype, int64_t batch) {
  AttendHistory h(dtype, batch);
  std::vector<float> expected;
  ASSERT_TRUE(h.Attend(&expected, ParallelFor{}).ok());
  int failures = 0;
  for (int64_t n = 0;; ++n) {
    bool failed = false, retried = false;
    Status first;
    std::vector<float> out;
    std::thread([&] {
      heap_hooks::FailLargeAllocationOnThisThread(n);
      first = h.Attend(&out, ParallelFor{});
      failed = heap_hooks::LargeAllocationFailedOnThisThread();
      heap_hooks::FailLargeAllocationOnThisThread(-1);
      if (failed) retried = h.Attend(&out, ParallelFor{}).ok();
    }).join();
    if (!failed) {
      EXPECT_TRUE(first.ok()) << first.message();
      EXPECT_EQ(out, expected);
      break;
    }
    ++failures;
    EXPECT_EQ(first.code(), Code::kOutOfMemory) << "allocation " << n << ": " << first.message();
    EXPECT_TRUE(retried) << "allocation " << n;
    EXPECT_EQ(out, expected) << "allocation " << n;
    ASSERT_LT(n, 10);
  }
  EXPECT_EQ(failures, batch < 8 ? 3 : 2);

  FreshThreads workers;
  workers.fail_large = true;
  std::vector<float> out;
  EXPECT_EQ(h.Attend(&out, workers.Get()).code(), Code::kOutOfMemory);
  workers.fail_large = false;
  std::vector<float> split;  // a 2-thread split: its own chunking, so its own reference
  ASSERT_TRUE(h.Attend(&split, workers.Get()).ok());
  ThreadPool pool(2);
  ASSERT_TRUE(h.Attend(&out, pool.AsParallelFor()).ok());
  EXPECT_EQ(out, split);
}

TEST(OutOfMemory, AttendScratchEveryAllocationSite) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  for (const int64_t target : kernels::DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (const DType dtype : {DType::kF32, DType::kF16, DType::kQ8_0}) {
      for (const int64_t batch : {int64_t{1}, int64_t{3}, int64_t{16}}) {
        SCOPED_TRACE(std::string(hwy::TargetName(target)) + " " + DTypeName(dtype) + " B " +
                     std::to_string(batch));
        ExpectAttendReportsScratchFailures(dtype, batch);
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace kv
