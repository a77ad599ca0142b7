// MaskIndex (core/mask_index.h): the memo of a mask's row bitmaps that lets the layers of a forward
// pass read the mask once. Its own contract (computed once, reused, rows of the mask, refused
// otherwise, recomputed after Invalidate, the owner's whole mask computed for any of its rows, one
// filler among threads), then the causal cache's use of it through History and Attend: the same
// output as without it, the bits computed once per pass (also when a runtime splits the rows over
// several calls), and never stale when the next pass writes a mask of the same shape at the same
// address; and a History built by hand with an index of its own.
#include "core/mask_index.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/thread_pool.h"
#include "gtest/gtest.h"
#include "kernels/attention.h"

namespace kv {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// An f32 mask [L, B]: row b hides cells j with (j + b) % 3 == 0 and adds a bias at every 7th.
std::vector<float> PatternMask(int L, int B, int salt) {
  std::vector<float> m(static_cast<size_t>(L) * B);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < L; ++j) {
      float x = (j + b + salt) % 3 == 0 ? -kInf : 0.0f;
      if (x == 0.0f && j % 7 == salt % 7) x = -0.5f;
      m[static_cast<size_t>(b) * L + j] = x;
    }
  }
  return m;
}

std::vector<uint64_t> ExpectedBits(const TensorView& mask) {
  std::vector<uint64_t> bits(MaskIndex::WordsFor(mask.ne[0], mask.ne[1]));
  kernels::MaskBits(mask, kernels::ParallelForFn{}, bits.data());
  return bits;
}

std::vector<uint64_t> Copy(const uint64_t* p, size_t n) { return std::vector<uint64_t>(p, p + n); }

// Rows [r0, r0 + n) of `mask`, as a runtime hands them to Attend.
TensorView MaskRows(const TensorView& mask, int r0, int n) { return RowsView(mask, r0, r0 + n); }

// A PatternMask [L, B], its view, and memory for its bits.
struct MaskAndWords {
  MaskAndWords(int L, int B, int salt)
      : m(PatternMask(L, B, salt)),
        mv(MakeView(m.data(), DType::kF32, {L, B})),
        words(MaskIndex::WordsFor(L, B)) {}
  std::vector<float> m;
  TensorView mv;
  std::vector<uint64_t> words;
};

TEST(MaskIndex, ComputesOnceAndReuses) {
  MaskAndWords t(200, 9, 1);
  std::vector<float>& m = t.m;
  const TensorView& mv = t.mv;
  std::vector<uint64_t>& words = t.words;
  MaskIndex index;
  EXPECT_EQ(index.BitsFor(mv, {}), nullptr) << "no memory attached";
  index.Attach(words.data(), words.size());
  const uint64_t* first = index.BitsFor(mv, {});
  ASSERT_EQ(first, words.data());
  EXPECT_EQ(Copy(first, words.size()), ExpectedBits(mv));
  EXPECT_EQ(index.fills(), 1u);
  // Every later call with this mask gets the same bits without computing them again: even when
  // the mask's memory changes behind the index (only Invalidate says so).
  m[5] = -kInf;
  EXPECT_EQ(index.BitsFor(mv, {}), words.data());
  EXPECT_EQ(index.fills(), 1u);
  // After Invalidate they describe the mask as it is now.
  index.Invalidate();
  ASSERT_EQ(index.BitsFor(mv, {}), words.data());
  EXPECT_EQ(index.fills(), 2u);
  EXPECT_EQ(Copy(words.data(), words.size()), ExpectedBits(mv));
}

TEST(MaskIndex, RowsOfTheMaskGetTheirRowsAndOtherMasksNothing) {
  constexpr int L = 130, B = 12;
  MaskAndWords t(L, B, 2);
  std::vector<float>& m = t.m;
  const TensorView& mv = t.mv;
  std::vector<uint64_t>& words = t.words;
  MaskIndex index;
  index.Attach(words.data(), words.size());
  ASSERT_NE(index.BitsFor(mv, {}), nullptr);
  const size_t row_words = static_cast<size_t>(kernels::MaskBitsRowWords(L));
  // Rows [4, 9): the bits of those rows.
  EXPECT_EQ(index.BitsFor(MaskRows(mv, 4, 5), {}), words.data() + 4 * row_words);
  // The last row, and rows reaching past the end.
  EXPECT_EQ(index.BitsFor(MaskRows(mv, B - 1, 1), {}), words.data() + (B - 1) * row_words);
  EXPECT_EQ(index.BitsFor(MaskRows(mv, B - 1, 2), {}), nullptr);
  // Not a row boundary, another length, another dtype, another buffer: nothing.
  TensorView off = mv;
  off.data = m.data() + 1;
  off.ne[1] = 1;
  EXPECT_EQ(index.BitsFor(off, {}), nullptr);
  TensorView shorter = MakeView(m.data(), DType::kF32, {L - 1, B});
  EXPECT_EQ(index.BitsFor(shorter, {}), nullptr);
  TensorView as_f16 = mv;
  as_f16.dtype = DType::kF16;
  as_f16.nb[0] = 2;
  EXPECT_EQ(index.BitsFor(as_f16, {}), nullptr);
  std::vector<float> other = m;
  EXPECT_EQ(index.BitsFor(MakeView(other.data(), DType::kF32, {L, B}), {}), nullptr);
  EXPECT_EQ(index.fills(), 1u);
  // Too little memory for the mask: nothing, nothing computed.
  MaskIndex small;
  small.Attach(words.data(), words.size() - 1);
  EXPECT_EQ(small.BitsFor(mv, {}), nullptr);
  EXPECT_EQ(small.fills(), 0u);
  // Attach forgets the bits: rows [4, 9) alone are then computed anew, at the start of the words.
  const TensorView rows = MaskRows(mv, 4, 5);
  index.Attach(words.data(), words.size());
  EXPECT_EQ(index.BitsFor(rows, {}), words.data());
  EXPECT_EQ(index.fills(), 2u);
  EXPECT_EQ(Copy(words.data(), 5 * row_words), ExpectedBits(rows));
}

// Invalidate(whole): the first call for some rows of the owner's mask computes every row, so calls
// for the other rows find theirs; a whole mask that does not fit, a mask that is not part of it,
// and Invalidate() without it fall back to the asked mask alone.
TEST(MaskIndex, InvalidateWithTheWholeMaskComputesAllItsRows) {
  constexpr int L = 130, B = 12;
  MaskAndWords t(L, B, 2);
  const size_t row_words = static_cast<size_t>(kernels::MaskBitsRowWords(L));
  const auto rows = [&](int r0, int n) { return MaskRows(t.mv, r0, n); };
  MaskIndex index;
  index.Attach(t.words.data(), t.words.size());
  index.Invalidate(t.mv);
  EXPECT_EQ(index.BitsFor(rows(4, 5), {}), t.words.data() + 4 * row_words);
  EXPECT_EQ(Copy(t.words.data(), t.words.size()), ExpectedBits(t.mv));
  EXPECT_EQ(index.BitsFor(rows(0, 2), {}), t.words.data());
  EXPECT_EQ(index.BitsFor(rows(9, 3), {}), t.words.data() + 9 * row_words);
  EXPECT_EQ(index.fills(), 1u);
  // Without the whole mask named, the asked rows alone, at the start of the words.
  index.Invalidate();
  EXPECT_EQ(index.BitsFor(rows(4, 5), {}), t.words.data());
  EXPECT_EQ(index.BitsFor(rows(0, 2), {}), nullptr);
  EXPECT_EQ(index.fills(), 2u);
  // Room for 5 rows only: the asked rows, not the whole mask.
  MaskIndex small;
  small.Attach(t.words.data(), 5 * row_words);
  small.Invalidate(t.mv);
  EXPECT_EQ(small.BitsFor(rows(4, 5), {}), t.words.data());
  EXPECT_EQ(Copy(t.words.data(), 5 * row_words), ExpectedBits(rows(4, 5)));
  // A mask that is not rows of the whole one: that mask.
  std::vector<float> other = t.m;
  const TensorView ov = MakeView(other.data(), DType::kF32, {L, B});
  index.Invalidate(t.mv);
  EXPECT_EQ(index.BitsFor(ov, {}), t.words.data());
  EXPECT_EQ(index.BitsFor(rows(0, 1), {}), nullptr);
}

TEST(MaskIndex, ThreadsAskingAtOnceComputeOnce) {
  constexpr int L = 4096, B = 64, kThreads = 4;
  std::vector<float> m = PatternMask(L, B, 3);
  const TensorView mv = MakeView(m.data(), DType::kF32, {L, B});
  const std::vector<uint64_t> want = ExpectedBits(mv);
  std::vector<uint64_t> words(want.size());
  for (int round = 0; round < 20; ++round) {
    MaskIndex index;
    index.Attach(words.data(), words.size());
    std::atomic<int> go{0}, got_bits{0}, bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        go.fetch_add(1);
        while (go.load() < kThreads) {
        }
        // A caller that gets bits may read them at once: they are complete.
        if (const uint64_t* bits = index.BitsFor(mv, {})) {
          got_bits.fetch_add(1);
          if (std::memcmp(bits, want.data(), want.size() * 8) != 0) bad.fetch_add(1);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(index.fills(), 1u);
    EXPECT_GE(got_bits.load(), 1);
    EXPECT_EQ(bad.load(), 0);
  }
}

// A causal cache's History over one layer of random K/V.
struct OneLayerCache {
  static constexpr int kD = 64, kHkv = 2, kHq = 4;
  std::unique_ptr<CausalCache> cache;
  std::mt19937 rng{5};

  explicit OneLayerCache(int padding, int capacity, int max_batch) {
    cache = NewCausalCache();
    CacheConfig cc;
    cc.padding = padding;
    EXPECT_TRUE(cache->SetConfig(cc).ok());
    EXPECT_TRUE(cache->Init(DType::kF16, 4, capacity, max_batch).ok());
  }
  // StartForward with these tokens and Put random K/V in `layers` layers.
  void Forward(const std::vector<int32_t>& pos, const std::vector<int32_t>& seq, int layers) {
    Batch batch;
    batch.positions = pos;
    batch.sequences = seq;
    ASSERT_TRUE(cache->StartForward(batch, false).ok());
    const int n = static_cast<int>(pos.size());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> k(static_cast<size_t>(kD) * kHkv * n), v(k.size());
    for (int layer = 0; layer < layers; ++layer) {
      for (float& x : k) x = u(rng);
      for (float& x : v) x = u(rng);
      cache->SetLayer(layer);
      ASSERT_TRUE(cache
                      ->Put(MakeView(k.data(), DType::kF32, {kD, kHkv, n}),
                            MakeView(v.data(), DType::kF32, {kD, kHkv, n}))
                      .ok());
    }
  }
  std::vector<float> Queries(int n) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(kD) * n * kHq);
    for (float& x : q) x = u(rng);
    return q;
  }
  // Attend over `h` (its mask index as given), on `pool` (null: the calling thread).
  static std::vector<float> Out(const std::vector<float>& q, const History& h, ThreadPool* pool) {
    const int n = static_cast<int>(q.size() / (kD * kHq));
    std::vector<float> out(q.size(), 777.0f);
    TensorView ov = MakeView(out.data(), DType::kF32, {kD, n, kHq});
    const Status s = Attend(MakeView(const_cast<float*>(q.data()), DType::kF32, {kD, n, kHq}), h,
                            AttentionParams{}, &ov, pool);
    EXPECT_TRUE(s.ok()) << s.message();
    return out;
  }
};

// Every layer of a pass gets the same output with the cache's index as without it, and the bits
// are computed once per pass, by the first layer.
TEST(MaskIndex, CacheLayersComputeOncePerPassAndMatch) {
  ThreadPool pool(2);
  constexpr int kLayers = 4;
  OneLayerCache c(/*padding=*/1, /*capacity=*/512, /*max_batch=*/64);
  // A prompt of 40 tokens in two sequences, then three decode steps of both.
  std::vector<int32_t> pos, seq;
  for (int i = 0; i < 40; ++i) {
    pos.push_back(i / 2);
    seq.push_back(i % 2);
  }
  for (int pass = 0; pass < 4; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    c.Forward(pos, seq, kLayers);
    const uint64_t fills_before = c.cache->Get().mask_index->fills();
    for (int layer = 0; layer < kLayers; ++layer) {
      c.cache->SetLayer(layer);
      const History h = c.cache->Get();
      ASSERT_NE(h.mask_index, nullptr);
      History plain = h;
      plain.mask_index = nullptr;
      const std::vector<float> q = c.Queries(static_cast<int>(pos.size()));
      for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
        EXPECT_EQ(OneLayerCache::Out(q, h, p), OneLayerCache::Out(q, plain, p))
            << "layer " << layer;
      }
    }
    EXPECT_EQ(c.cache->Get().mask_index->fills(), fills_before + 1);
    const int32_t next0 = pos.back() + 1;
    pos = {next0, next0};
    seq = {0, 1};
  }
}

// The next pass writes its mask where the last one was, often with the same shape: a decode step
// inside the padding (padding 64: the history stays 64 cells), and SetCausal, which rewrites the
// mask of the pass in place. The index must not hand out the old bits: a token would not see its
// own cell, or the causal exemption would not show.
TEST(MaskIndex, CacheNeverHandsOutTheLastMasksBits) {
  OneLayerCache c(/*padding=*/64, /*capacity=*/256, /*max_batch=*/8);
  c.Forward({0, 1, 2}, {0, 0, 0}, 1);
  const History first = c.cache->Get();
  ASSERT_EQ(first.mask.ne[0], 64);
  (void)OneLayerCache::Out(c.Queries(3), first, nullptr);  // computes the bits of pass 1
  for (int32_t p = 3; p < 6; ++p) {
    SCOPED_TRACE("decode position " + std::to_string(p));
    c.Forward({p}, {0}, 1);
    const History h = c.cache->Get();
    ASSERT_EQ(h.mask.ne[0], 64);
    ASSERT_EQ(h.mask_index, first.mask_index);
    History plain = h;
    plain.mask_index = nullptr;
    const std::vector<float> q = c.Queries(1);
    EXPECT_EQ(OneLayerCache::Out(q, h, nullptr), OneLayerCache::Out(q, plain, nullptr));
  }
  // SetCausal: the first two tokens of a new pass see each other both ways.
  c.Forward({6, 7, 8}, {0, 0, 0}, 1);
  const std::vector<float> q = c.Queries(3);
  History h = c.cache->Get();
  (void)OneLayerCache::Out(q, h, nullptr);
  const int32_t except[] = {0, 1};
  c.cache->SetCausal(except);
  h = c.cache->Get();
  History plain = h;
  plain.mask_index = nullptr;
  const std::vector<float> with_index = OneLayerCache::Out(q, h, nullptr);
  EXPECT_EQ(with_index, OneLayerCache::Out(q, plain, nullptr));
}

// A runtime that splits a batch's rows over several Attend calls (each with a view of its rows of
// the mask, and their queries): the first call computes the bits of every row of the cache's mask,
// so the later calls' rows are in the memo too, and every call matches Attend without the index.
TEST(MaskIndex, CacheRowsSplitOverCallsShareOneComputation) {
  constexpr int kLayers = 3, kRows = 40, kFirst = 16;
  OneLayerCache c(/*padding=*/1, /*capacity=*/512, /*max_batch=*/64);
  std::vector<int32_t> pos, seq;
  for (int i = 0; i < kRows; ++i) {
    pos.push_back(i / 2);
    seq.push_back(i % 2);
  }
  c.Forward(pos, seq, kLayers);
  const uint64_t fills_before = c.cache->Get().mask_index->fills();
  for (int layer = 0; layer < kLayers; ++layer) {
    c.cache->SetLayer(layer);
    const History h = c.cache->Get();
    for (auto [r0, n] : {std::pair{0, kFirst}, std::pair{kFirst, kRows - kFirst}}) {
      History part = h;
      part.mask = MaskRows(h.mask, r0, n);
      History plain = part;
      plain.mask_index = nullptr;
      const std::vector<float> q = c.Queries(n);
      EXPECT_EQ(OneLayerCache::Out(q, part, nullptr), OneLayerCache::Out(q, plain, nullptr))
          << "layer " << layer << " rows from " << r0;
      if (layer == 0 && r0 == 0) {
        // The rows of the second call already have their bits.
        EXPECT_NE(h.mask_index->BitsFor(MaskRows(h.mask, kFirst, kRows - kFirst), {}), nullptr);
      }
    }
  }
  EXPECT_EQ(c.cache->Get().mask_index->fills(), fills_before + 1);
}

// A History built by hand (no cache) with a MaskIndex of its own, as core/mask_index.h shows: the
// layers of a pass compute the bits once and match Attend without the index; after the runtime
// rewrites its mask in place and calls Invalidate, the next call sees the new mask.
TEST(MaskIndex, HandBuiltHistoryWithItsOwnIndex) {
  constexpr int L = 300, B = 6, kD = OneLayerCache::kD, kHkv = OneLayerCache::kHkv;
  constexpr int kHq = OneLayerCache::kHq;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto random = [&](size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = u(rng);
    return x;
  };
  std::vector<float> k = random(static_cast<size_t>(kD) * kHkv * L), v = random(k.size());
  MaskAndWords t(L, B, 1);
  MaskIndex index;
  index.Attach(t.words.data(), t.words.size());
  History h{MakeView(k.data(), DType::kF32, {kD, kHkv, L}),
            MakeView(v.data(), DType::kF32, {kD, kHkv, L}), t.mv};
  h.mask_index = &index;
  History plain = h;
  plain.mask_index = nullptr;
  ThreadPool pool(2);
  for (int layer = 0; layer < 3; ++layer) {
    const std::vector<float> q = random(static_cast<size_t>(kD) * B * kHq);
    for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
      EXPECT_EQ(OneLayerCache::Out(q, h, p), OneLayerCache::Out(q, plain, p)) << "layer " << layer;
    }
  }
  EXPECT_EQ(index.fills(), 1u);
  // The same buffer, another mask.
  const std::vector<float> q = random(static_cast<size_t>(kD) * B * kHq);
  const std::vector<float> before = OneLayerCache::Out(q, plain, nullptr);
  const std::vector<float> other = PatternMask(L, B, 2);
  std::copy(other.begin(), other.end(), t.m.begin());
  index.Invalidate();
  const std::vector<float> after = OneLayerCache::Out(q, plain, nullptr);
  ASSERT_NE(after, before);
  EXPECT_EQ(OneLayerCache::Out(q, h, nullptr), after);
  EXPECT_EQ(index.fills(), 2u);
}

}  // namespace
}  // namespace kv
