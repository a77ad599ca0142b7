// The documented concurrent uses (core/cache.h, core/attend.h), exercised so that ThreadSanitizer
// (preset `tsan`) can check them, and checked for results identical to a serial run:
//   1. several threads, each with its own cache, decoding at once;
//   2. several threads calling Attend on the same History at once (the History is read-only);
//   3. readers of one cache between two mutations: Attend over its Histories, SaveCache and
//      CanResume from several threads;
//   4. one ThreadPool shared by several threads' Attend calls (Run serializes them), and a pool per
//      thread.
#include <thread>
#include <vector>

#include "core/persistence.h"
#include "core/thread_pool.h"
#include "decode_driver.h"
#include "gtest/gtest.h"

namespace kv {
namespace {

using testing::AllCacheKinds;
using testing::Driver;

constexpr int kThreads = 4;

// Decodes a fixed script on its own cache; returns every attention output.
std::vector<float> DecodeScript(int kind_index, ThreadPool* pool) {
  Driver d;
  auto cache = AllCacheKinds()[kind_index].make();
  EXPECT_TRUE(cache->Init(DType::kF16, 2, 64, d.max_batch).ok());
  std::vector<float> all, out(d.layers * d.out.size());
  EXPECT_TRUE(d.Prefill(cache.get(), 0, 0, 8, out.data()).ok());
  for (int t = 0; t < 12; ++t) {
    d.seq[0] = 0;
    d.pos[0] = 8 + t;
    d.seq[1] = 1;
    d.pos[1] = t;
    EXPECT_TRUE(d.Step(cache.get(), t % 3 == 0 ? 1 : 2, out.data(), pool).ok());
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

TEST(Concurrency, OneCachePerThread) {
  std::vector<std::vector<float>> serial(kThreads), parallel(kThreads);
  for (int i = 0; i < kThreads; ++i) serial[i] = DecodeScript(i % 4, nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] { parallel[i] = DecodeScript(i % 4, nullptr); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(serial[i], parallel[i]) << i;
}

TEST(Concurrency, OneCachePerThreadEachWithItsOwnPoolOrASharedOne) {
  const std::vector<float> expect = DecodeScript(0, nullptr);
  ThreadPool shared(2);
  std::vector<std::vector<float>> got(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      if (i % 2 == 0) {
        got[i] = DecodeScript(0, &shared);  // Run calls from several threads are serialized
      } else {
        ThreadPool own(2);
        got[i] = DecodeScript(0, &own);
      }
    });
  }
  for (auto& t : threads) t.join();
  // The split over 2 threads may sum in another order than the serial run: compare closely.
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(got[i].size(), expect.size());
    for (size_t j = 0; j < expect.size(); ++j) ASSERT_NEAR(got[i][j], expect[j], 1e-5f) << i;
  }
}

TEST(Concurrency, ReadersOfOneCacheBetweenMutations) {
  Driver d;
  auto cache = NewSWAMemCache(16, 32);
  ASSERT_TRUE(cache->Init(DType::kQ8_0, 2, 128, d.max_batch).ok());
  ASSERT_TRUE(d.Prefill(cache.get(), 0, 0, 8).ok());
  ASSERT_TRUE(d.Prefill(cache.get(), 1, 0, 8).ok());
  for (int round = 0; round < 3; ++round) {
    // Mutation (one thread): the next batch.
    ASSERT_TRUE(d.Tokens(cache.get(), {{0, 8 + round}, {1, 8 + round}}).ok());
    // Histories are taken on this thread (SetLayer and Get select and describe a layer).
    std::vector<History> hist(d.layers);
    for (int l = 0; l < d.layers; ++l) {
      cache->SetLayer(l);
      hist[l] = cache->Get();
    }
    const int B = 2;
    TensorView q = MakeView(d.q.data(), DType::kF32, {d.dk, B, d.q_heads});
    std::vector<float> expect(static_cast<size_t>(d.layers) * d.dv * B * d.q_heads);
    for (int l = 0; l < d.layers; ++l) {
      TensorView o = MakeView(expect.data() + static_cast<size_t>(l) * d.dv * B * d.q_heads,
                              DType::kF32, {d.dv, B, d.q_heads});
      ASSERT_TRUE(Attend(q, hist[l], AttentionParams(), &o).ok());
    }
    std::vector<uint8_t> saved_serial;
    ASSERT_TRUE(SaveCache(*cache, &saved_serial).ok());
    // Readers (many threads): Attend on the same Histories, SaveCache, CanResume.
    std::vector<std::vector<float>> got(kThreads, std::vector<float>(expect.size()));
    std::vector<std::vector<uint8_t>> saved(kThreads);
    std::vector<int> resumable(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        for (int l = 0; l < d.layers; ++l) {
          TensorView o = MakeView(got[i].data() + static_cast<size_t>(l) * d.dv * B * d.q_heads,
                                  DType::kF32, {d.dv, B, d.q_heads});
          EXPECT_TRUE(Attend(q, hist[l], AttentionParams(), &o).ok());
        }
        EXPECT_TRUE(SaveCache(*cache, &saved[i]).ok());
        resumable[i] = cache->CanResume(0, 9 + round) ? 1 : 0;
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kThreads; ++i) {
      EXPECT_EQ(got[i], expect) << i;
      EXPECT_EQ(saved[i], saved_serial) << i;
      EXPECT_EQ(resumable[i], 1);
    }
  }
}

TEST(Concurrency, AttendOnOneHistoryWithOnePoolFromManyThreads) {
  Driver d;
  auto cache = NewCausalCache();
  ASSERT_TRUE(cache->Init(DType::kBF16, 1, 2048, d.max_batch).ok());
  // A history long enough (> 512 cells) that decode splits it into chunks over the pool.
  for (int p = 0; p < 1200; p += d.max_batch) ASSERT_TRUE(d.Prefill(cache.get(), 0, p, 8).ok());
  d.seq[0] = 0;
  d.pos[0] = 1200;
  std::vector<float> out(d.layers * d.out.size());
  ASSERT_TRUE(d.Step(cache.get(), 1, out.data()).ok());
  cache->SetLayer(1);
  const History h = cache->Get();
  TensorView q = MakeView(d.q.data(), DType::kF32, {d.dk, 1, d.q_heads});
  std::vector<float> expect(static_cast<size_t>(d.dv) * d.q_heads);
  TensorView eo = MakeView(expect.data(), DType::kF32, {d.dv, 1, d.q_heads});
  ThreadPool pool(3);
  ASSERT_TRUE(Attend(q, h, AttentionParams(), &eo, &pool).ok());
  std::vector<std::vector<float>> got(kThreads, std::vector<float>(expect.size()));
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 5; ++rep) {
        TensorView o = MakeView(got[i].data(), DType::kF32, {d.dv, 1, d.q_heads});
        EXPECT_TRUE(Attend(q, h, AttentionParams(), &o, &pool).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  // Same pool, same split: the same sums in the same order.
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(got[i], expect) << i;
}

}  // namespace
}  // namespace kv
