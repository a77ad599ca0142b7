// Tests for the growing and rotating caches (core/sequence_cache.h, SEMANTICS.md section 11).
//
// Every token appended gets a serial number; its K and V rows are a fixed function of (serial, b,
// h, d). A returned view is checked row by row against the storage-dtype bytes of the expected
// tokens (converted with the scalar reference kernels::ConvertRowRef), so a check says exactly
// which tokens the view must hold and in which order. Hand-written position lists cover each path;
// a plain deque model (kvref::SequenceModel, fuzz/reference_model.h) covers random sequences of
// updates, trims, saves/restores and resets.
#include "core/sequence_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/convert.h"
#include "layouts/kv_layout.h"
#include "reference_model.h"

namespace kv {
namespace {

// Exactly representable in f16 and bf16 (|x| <= 125 / 16), so the input dtype never rounds.
float Val(int serial, int b, int h, int d, bool is_value) {
  const int x = (serial * 37 + b * 11 + h * 5 + d * 3 + (is_value ? 13 : 0)) % 251;
  return static_cast<float>(x - 125) / 16.0f;
}

std::vector<int> Range(int first, int last_exclusive) {
  std::vector<int> r(std::max(0, last_exclusive - first));
  std::iota(r.begin(), r.end(), first);
  return r;
}
std::vector<int> Cat(std::vector<int> a, const std::vector<int>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Shape {
  int dk = 32, dv = 32, heads = 2, batch = 2;
};

class Driver {
 public:
  Driver(std::unique_ptr<SequenceCache> cache, DType storage, DType input = DType::kF32,
         Shape s = {})
      : cache_(std::move(cache)), storage_(storage), input_(input), s_(s) {}

  SequenceCache* cache() { return cache_.get(); }
  int next_serial() const { return serial_; }

  // Builds the input tensors {D, n, H, B} of the next n tokens (serials serial_..serial_+n-1).
  void MakeInput(int n, std::vector<uint8_t>* k, std::vector<uint8_t>* v, int first_serial) const {
    for (int pass = 0; pass < 2; ++pass) {
      const int d = pass == 0 ? s_.dk : s_.dv;
      std::vector<uint8_t>& out = pass == 0 ? *k : *v;
      const size_t es = BlockBytes(input_);
      out.assign(static_cast<size_t>(d) * n * s_.heads * s_.batch * es, 0);
      size_t i = 0;
      for (int b = 0; b < s_.batch; ++b)
        for (int h = 0; h < s_.heads; ++h)
          for (int t = 0; t < n; ++t)
            for (int j = 0; j < d; ++j)
              StoreFromF32(out.data(), input_, static_cast<int64_t>(i++),
                           Val(first_serial + t, b, h, j, pass == 1));
    }
  }

  // Appends n tokens; returns the status and fills the views.
  Status Append(int n) {
    std::vector<uint8_t> k, v;
    MakeInput(n, &k, &v, serial_);
    const TensorView kv_k = MakeView(k.data(), input_, {s_.dk, n, s_.heads, s_.batch});
    const TensorView kv_v = MakeView(v.data(), input_, {s_.dv, n, s_.heads, s_.batch});
    Status st = cache_->Update(kv_k, kv_v, n, &keys_, &values_);
    if (st.ok()) serial_ += n;
    return st;
  }

  // The storage bytes of one row of token `serial`.
  std::vector<uint8_t> ExpectedRow(int serial, int b, int h, bool is_value) const {
    const int d = is_value ? s_.dv : s_.dk;
    std::vector<uint8_t> in(static_cast<size_t>(d) * BlockBytes(input_));
    for (int j = 0; j < d; ++j) StoreFromF32(in.data(), input_, j, Val(serial, b, h, j, is_value));
    std::vector<uint8_t> out(RowBytes(storage_, d));
    kernels::ConvertRowRef(in.data(), input_, out.data(), storage_, d);
    return out;
  }

  // Checks both views hold exactly the tokens `serials`, in order.
  void Expect(const std::vector<int>& serials, const std::string& where) const {
    SCOPED_TRACE(where);
    for (int pass = 0; pass < 2; ++pass) {
      const TensorView& view = pass == 0 ? keys_ : values_;
      const int d = pass == 0 ? s_.dk : s_.dv;
      ASSERT_EQ(view.dtype, storage_);
      ASSERT_EQ(view.ne[0], d);
      ASSERT_EQ(view.ne[1], static_cast<int64_t>(serials.size())) << (pass ? "values" : "keys");
      ASSERT_EQ(view.ne[2], s_.heads);
      ASSERT_EQ(view.ne[3], s_.batch);
      ASSERT_EQ(view.nb[0], BlockBytes(storage_));
      const size_t rb = RowBytes(storage_, d);
      for (int b = 0; b < s_.batch; ++b)
        for (int h = 0; h < s_.heads; ++h)
          for (size_t i = 0; i < serials.size(); ++i) {
            const std::vector<uint8_t> want = ExpectedRow(serials[i], b, h, pass == 1);
            ASSERT_EQ(0, std::memcmp(want.data(), RowPtr(view, static_cast<int64_t>(i), h, b), rb))
                << (pass ? "values" : "keys") << " row " << i << " (want token " << serials[i]
                << ") b " << b << " h " << h;
          }
    }
  }

  const TensorView& keys() const { return keys_; }
  const TensorView& values() const { return values_; }

 private:
  std::unique_ptr<SequenceCache> cache_;
  DType storage_, input_;
  Shape s_;
  int serial_ = 0;
  TensorView keys_, values_;
};

// ---- the growing cache ------------------------------------------------------------------------

class KVCacheTest : public ::testing::TestWithParam<DType> {};

TEST_P(KVCacheTest, GrowthBoundaries255_256_257) {
  Driver d(NewKVCache(GetParam()), GetParam());
  ASSERT_TRUE(d.Append(255).ok());
  d.Expect(Range(0, 255), "prefill 255");
  EXPECT_EQ(d.cache()->Stats().capacity, 256);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect(Range(0, 256), "256");
  EXPECT_EQ(d.cache()->Stats().capacity, 256);
  EXPECT_EQ(d.cache()->Stats().allocations, 1u);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect(Range(0, 257), "257");
  // 256 * 1.5 = 384, rounded up to the next 256-token step.
  EXPECT_EQ(d.cache()->Stats().capacity, 512);
  EXPECT_EQ(d.cache()->Stats().allocations, 2u);
  EXPECT_EQ(d.cache()->Offset(), 257);
  EXPECT_EQ(d.cache()->Len(), 257);
}

TEST_P(KVCacheTest, DecodeOneByOneGrowsGeometrically) {
  Driver d(NewKVCache(GetParam()), GetParam(), DType::kF16, Shape{32, 64, 1, 1});
  std::vector<int64_t> caps;
  for (int t = 0; t < 1300; ++t) {
    ASSERT_TRUE(d.Append(1).ok());
    if (t == 0 || t == 255 || t == 256 || t == 511 || t == 512 || t == 1299) {
      d.Expect(Range(0, t + 1), "decode " + std::to_string(t));
    }
    const int64_t c = d.cache()->Stats().capacity;
    if (caps.empty() || caps.back() != c) caps.push_back(c);
  }
  // 256 -> 384 -> 512; 512 -> 768; 768 -> 1152 -> 1280; 1280 -> 1920 -> 2048.
  EXPECT_EQ(caps, (std::vector<int64_t>{256, 512, 768, 1280, 2048}));
  const SequenceCacheStats s = d.cache()->Stats();
  // Every copied row was held, and 1.5x growth copies each row at most 3 times amortized
  // (256 + 512 + 768 + 1280 = 2816 rows for 1300 tokens).
  const size_t row_pair = MakeSequenceBlockLayout(GetParam(), 32, 1, 1, 1).row_stride +
                          MakeSequenceBlockLayout(GetParam(), 64, 1, 1, 1).row_stride;
  EXPECT_EQ(s.bytes_moved, 2816u * row_pair);
  EXPECT_LE(s.bytes_moved, 3 * 1300u * row_pair);
}

TEST_P(KVCacheTest, PrefillsAppend) {
  Driver d(NewKVCache(GetParam()), GetParam());
  ASSERT_TRUE(d.Append(3).ok());
  ASSERT_TRUE(d.Append(1).ok());
  ASSERT_TRUE(d.Append(600).ok());
  d.Expect(Range(0, 604), "3 + 1 + 600");
  ASSERT_TRUE(d.cache()->Trim(0).ok());
  ASSERT_TRUE(d.cache()->Trim(4).ok());
  EXPECT_EQ(d.cache()->Offset(), 600);
  ASSERT_TRUE(d.Append(2).ok());
  std::vector<int> want = Range(0, 600);
  want.push_back(604);
  want.push_back(605);
  d.Expect(want, "after trim 4");
  EXPECT_EQ(d.cache()->Trim(603).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.cache()->Offset(), 602);
  ASSERT_TRUE(d.cache()->Trim(602).ok());
  EXPECT_EQ(d.cache()->Len(), 0);
}

INSTANTIATE_TEST_SUITE_P(DTypes, KVCacheTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                           DType::kQ4_0),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// ---- the rotating cache: hand-computed paths ----------------------------------------------------

// Decoding one token at a time into max_size 8: views hold the sinks, then the newest tokens.
std::vector<int> DecodeView(int p, int max_size, int keep) {  // after appending position p
  if (p < max_size) return Range(0, p + 1);
  return Cat(Range(0, keep), Range(p + 1 - (max_size - keep), p + 1));
}

class RotatingTest : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  int keep() const { return std::get<1>(GetParam()); }
};

TEST_P(RotatingTest, DecodeWrapsAround) {
  const int k = keep();
  Driver d(NewRotatingKVCache(8, k, dtype()), dtype());
  for (int p = 0; p < 30; ++p) {
    ASSERT_TRUE(d.Append(1).ok());
    d.Expect(DecodeView(p, 8, k), "decode " + std::to_string(p));
    EXPECT_EQ(d.cache()->Offset(), p + 1);
    EXPECT_EQ(d.cache()->Len(), std::min(p + 1, 8));
  }
}

// Regression 1: the seed returned its 256-step buffer with zero padding rows here.
TEST_P(RotatingTest, PrefillAfterDecodingHasNoPadding) {
  Driver d(NewRotatingKVCache(8, keep(), dtype()), dtype());
  for (int p = 0; p < 3; ++p) ASSERT_TRUE(d.Append(1).ok());
  ASSERT_TRUE(d.Append(2).ok());
  d.Expect({0, 1, 2, 3, 4}, "prefill 2 after 3 decoded");
  EXPECT_EQ(d.cache()->Len(), 5);
}

// Regression 2: after wrap-around a prefill keeps the sinks and the newest tokens in order.
TEST_P(RotatingTest, PrefillAfterWrapKeepsNewest) {
  const int k = keep();
  Driver d(NewRotatingKVCache(8, k, dtype()), dtype());
  for (int p = 0; p < 12; ++p) ASSERT_TRUE(d.Append(1).ok());
  // Held: sinks, then the newest 8 - keep of 0..11. The prefill drops the oldest non-sink.
  ASSERT_TRUE(d.Append(3).ok());
  if (k == 0) {
    d.Expect({5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, "prefill 3 after wrap, keep 0");
  } else {
    d.Expect({0, 1, 2, 3, 9, 10, 11, 12, 13, 14}, "prefill 3 after wrap, keep 4");
  }
  EXPECT_EQ(d.cache()->Len(), 8);
  EXPECT_EQ(d.cache()->Offset(), 15);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect(DecodeView(15, 8, k), "decode after the prefill");
}

// Regression 3: a prefill longer than max_size returns max_size - 1 + n rows.
TEST_P(RotatingTest, PrefillLongerThanMaxSize) {
  const int k = keep();
  Driver d(NewRotatingKVCache(8, k, dtype()), dtype());
  for (int p = 0; p < 10; ++p) ASSERT_TRUE(d.Append(1).ok());
  ASSERT_TRUE(d.Append(24).ok());
  if (k == 0) {
    d.Expect(Range(3, 34), "prefill 24 after 10, keep 0");  // 7 held + 24 new
  } else {
    d.Expect(Cat({0, 1, 2, 3}, Range(7, 34)), "prefill 24 after 10, keep 4");
  }
  EXPECT_EQ(d.cache()->Len(), 8);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect(DecodeView(34, 8, k), "decode after the long prefill");
  // And a second long prefill straight after the first.
  ASSERT_TRUE(d.Append(24).ok());
  d.Expect(Cat(Range(0, k), Cat(Range(35 - (7 - k), 35), Range(35, 59))), "second long prefill");
}

// Prefill lengths 1, max_size - 1, max_size and 3 x max_size on an empty cache, after partial
// decoding and after wrap-around.
TEST_P(RotatingTest, PrefillLengths) {
  const int k = keep(), m = 8;
  for (int n : {1, m - 1, m, 3 * m}) {
    for (int before : {0, 3, 13}) {
      SCOPED_TRACE("n " + std::to_string(n) + " after " + std::to_string(before));
      Driver d(NewRotatingKVCache(m, k, dtype()), dtype());
      for (int p = 0; p < before; ++p) ASSERT_TRUE(d.Append(1).ok());
      ASSERT_TRUE(d.Append(n).ok());
      std::vector<int> held = before == 0 ? std::vector<int>{} : DecodeView(before - 1, m, k);
      // min(held, m - 1) kept: drop the oldest non-sink when m are held.
      if (static_cast<int>(held.size()) == m) held.erase(held.begin() + k);
      d.Expect(Cat(held, Range(before, before + n)), "prefill");
      const int total = static_cast<int>(held.size()) + n;
      EXPECT_EQ(d.cache()->Len(), std::min(total, m));
      // The next decode sees the sinks and the newest tokens.
      ASSERT_TRUE(d.Append(1).ok());
      d.Expect(DecodeView(before + n, m, k), "decode after");
    }
  }
}

TEST_P(RotatingTest, TrimRollsBackHeldTokensOnly) {
  const int k = keep();
  Driver d(NewRotatingKVCache(8, k, dtype()), dtype());
  for (int p = 0; p < 6; ++p) ASSERT_TRUE(d.Append(1).ok());
  // Nothing evicted yet: everything may be trimmed, sinks included.
  ASSERT_TRUE(d.cache()->Trim(5).ok());
  EXPECT_EQ(d.cache()->Offset(), 1);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect({0, 6}, "re-append after trim 5");  // serial 6 took position 1
  for (int p = 0; p < 10; ++p) ASSERT_TRUE(d.Append(1).ok());
  // Positions 0..11 appended (serials 0, 6..16): held sinks + newest 8 - keep.
  const std::vector<int> serials = Cat({0}, Range(6, 17));  // serial of each position
  std::vector<int> held;
  for (int p : DecodeView(11, 8, k)) held.push_back(serials[p]);
  d.Expect(held, "after refill");
  // Only the 8 - keep recent tokens may go now.
  const int recent = 8 - k;
  EXPECT_EQ(d.cache()->Trim(recent + 1).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.cache()->Offset(), 12);
  EXPECT_EQ(d.cache()->Len(), 8);
  EXPECT_EQ(d.cache()->Trim(-1).code(), Code::kInvalidArgument);
  ASSERT_TRUE(d.cache()->Trim(2).ok());
  EXPECT_EQ(d.cache()->Offset(), 10);
  EXPECT_EQ(d.cache()->Len(), 6);
  ASSERT_TRUE(d.Append(1).ok());
  held.resize(6);
  held.push_back(17);
  d.Expect(held, "decode after trim 2");
}

TEST_P(RotatingTest, TrimAfterLongPrefillThenDecode) {
  const int k = keep();
  Driver d(NewRotatingKVCache(8, k, dtype()), dtype());
  ASSERT_TRUE(d.Append(20).ok());
  d.Expect(Range(0, 20), "first prefill returns all");
  EXPECT_EQ(d.cache()->Len(), 8);
  ASSERT_TRUE(d.cache()->Trim(3).ok());  // held: sinks + 17 - (8 - keep - 3) .. 16
  EXPECT_EQ(d.cache()->Len(), 5);
  ASSERT_TRUE(d.Append(1).ok());
  // Serial 20 takes position 17, after the sinks and the 5 - keep recent tokens left.
  d.Expect(Cat(Cat(Range(0, k), Range(20 - (8 - k), 17)), {20}), "decode after trim");
  EXPECT_EQ(d.cache()->Len(), 6);
}

INSTANTIATE_TEST_SUITE_P(DTypesKeeps, RotatingTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kF16,
                                                              DType::kQ8_0),
                                            ::testing::Values(0, 4)),
                         [](const auto& info) {
                           return std::string(DTypeName(std::get<0>(info.param))) + "_keep" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- decode after wrap-around moves O(1) rows per token -----------------------------------------

TEST(RotatingCost, DecodeAfterWrapMovesFewRowsPerToken) {
  const int m = 1024, keep = 4;
  Driver d(NewRotatingKVCache(m, keep, DType::kF16), DType::kF16, DType::kF32, Shape{64, 64, 1, 1});
  for (int p = 0; p < m; ++p) ASSERT_TRUE(d.Append(1).ok());
  const SequenceCacheStats before = d.cache()->Stats();
  const int tokens = 4096;
  for (int p = 0; p < tokens; ++p) ASSERT_TRUE(d.Append(1).ok());
  d.Expect(DecodeView(m + tokens - 1, m, keep), "after 4096 wrapped decodes");
  const SequenceCacheStats after = d.cache()->Stats();
  const double row = 128;  // f16, D 64: one K row (padded to 64 bytes is still 128)
  const double moved_rows_per_token = (after.bytes_moved - before.bytes_moved) / (2 * row) / tokens;
  // Sinks shift: keep rows; compaction: (m - 1) rows every slack (= 512) tokens; one growth to the
  // target block: m rows once.
  EXPECT_LE(moved_rows_per_token, keep + 2.0 * (m - 1) / 512 + 0.5);
  EXPECT_GE(moved_rows_per_token, keep);
  EXPECT_EQ(after.bytes_written - before.bytes_written, static_cast<uint64_t>(tokens) * 2 * 128);
  EXPECT_LE(after.allocations, before.allocations + 1);  // at most the one growth to max + slack
  // Steady state: no more allocations.
  const uint64_t allocs = after.allocations;
  for (int p = 0; p < 2000; ++p) ASSERT_TRUE(d.Append(1).ok());
  EXPECT_EQ(d.cache()->Stats().allocations, allocs);
  EXPECT_EQ(d.cache()->Stats().capacity, 1536);  // max_size + slack (512)
}

// ---- bad input changes nothing ----------------------------------------------------------------

TEST(SequenceCacheBadInput, RejectedWithoutChange) {
  for (bool rotating : {false, true}) {
    SCOPED_TRACE(rotating ? "rotating" : "growing");
    Driver d(rotating ? NewRotatingKVCache(8, 2, DType::kQ8_0) : NewKVCache(DType::kQ8_0),
             DType::kQ8_0);
    for (int p = 0; p < 10; ++p) ASSERT_TRUE(d.Append(1).ok());
    SequenceCacheState before;
    ASSERT_TRUE(d.cache()->SaveState(&before).ok());
    SequenceCache* c = d.cache();
    std::vector<float> k(32 * 2 * 2 * 4, 1.0f), v(32 * 2 * 2 * 4, 1.0f), odd(48 * 2 * 2 * 2, 1.0f);
    TensorView ko, vo;
    const TensorView k1 = MakeView(k.data(), DType::kF32, {32, 1, 2, 2});
    const TensorView v1 = MakeView(v.data(), DType::kF32, {32, 1, 2, 2});
    EXPECT_EQ(c->Update(k1, v1, 0, &ko, &vo).code(), Code::kInvalidArgument);
    EXPECT_EQ(c->Update(k1, v1, -1, &ko, &vo).code(), Code::kInvalidArgument);
    EXPECT_EQ(c->Update(k1, v1, 2, &ko, &vo).code(), Code::kInvalidArgument);  // n != ne[1]
    EXPECT_EQ(c->Update(k1, v1, 1, nullptr, &vo).code(), Code::kInvalidArgument);
    EXPECT_EQ(c->Update(MakeView(k.data(), DType::kF32, {32, 1, 1, 2}), v1, 1, &ko, &vo).code(),
              Code::kInvalidArgument);  // H differs between K and V
    EXPECT_EQ(c->Update(MakeView(k.data(), DType::kF32, {32, 1, 4, 1}),
                        MakeView(v.data(), DType::kF32, {32, 1, 4, 1}), 1, &ko, &vo)
                  .code(),
              Code::kInvalidArgument);  // H and B changed since the first update
    EXPECT_EQ(c->Update(MakeView(k.data(), DType::kF32, {64, 1, 2, 2}),
                        MakeView(v.data(), DType::kF32, {64, 1, 2, 2}), 1, &ko, &vo)
                  .code(),
              Code::kInvalidArgument);  // D changed
    EXPECT_EQ(c->Update(MakeView(odd.data(), DType::kF32, {48, 1, 2, 2}),
                        MakeView(odd.data(), DType::kF32, {48, 1, 2, 2}), 1, &ko, &vo)
                  .code(),
              Code::kInvalidArgument);  // not a multiple of 32 for q8_0
    EXPECT_EQ(c->Update(MakeView(k.data(), DType::kQ8_0, {32, 1, 2, 2}), v1, 1, &ko, &vo).code(),
              Code::kInvalidArgument);  // quantized input
    TensorView null_k = k1;
    null_k.data = nullptr;
    EXPECT_EQ(c->Update(null_k, v1, 1, &ko, &vo).code(), Code::kInvalidArgument);
    EXPECT_EQ(c->Trim(-1).code(), Code::kInvalidArgument);
    SequenceCacheState after;
    ASSERT_TRUE(c->SaveState(&after).ok());
    EXPECT_EQ(after.offset, before.offset);
    EXPECT_EQ(after.len, before.len);
    EXPECT_EQ(after.keys, before.keys);
    EXPECT_EQ(after.values, before.values);
    ASSERT_TRUE(d.Append(1).ok());
    d.Expect(rotating ? DecodeView(10, 8, 2) : Range(0, 11), "next update as if nothing happened");
  }
}

// Sizes that cannot be allocated or counted fail before anything changes (the input is never read).
TEST(SequenceCacheBadInput, ImpossibleSizesChangeNothing) {
  Driver d(NewRotatingKVCache(8, 2, DType::kF16), DType::kF16);
  std::vector<float> dummy(64, 0.0f);
  TensorView ko, vo;
  TensorView huge =
      MakeView(dummy.data(), DType::kF32, {32, 1, int64_t{1} << 30, int64_t{1} << 30});
  EXPECT_EQ(d.cache()->Update(huge, huge, 1, &ko, &vo).code(), Code::kOutOfMemory);
  EXPECT_EQ(d.cache()->Offset(), 0);
  for (int p = 0; p < 5; ++p) ASSERT_TRUE(d.Append(1).ok());
  const int n = INT32_MAX - 2;  // the offset would overflow
  TensorView many = MakeView(dummy.data(), DType::kF32, {32, n, 2, 2});
  EXPECT_EQ(d.cache()->Update(many, many, n, &ko, &vo).code(), Code::kInvalidArgument);
  EXPECT_EQ(d.cache()->Offset(), 5);
  ASSERT_TRUE(d.Append(1).ok());
  d.Expect(Range(0, 6), "unchanged");
}

TEST(SequenceCacheBadInput, QuantizedFirstUpdateNeedsDimMultipleOf32) {
  auto c = NewKVCache(DType::kQ4_0);
  std::vector<float> k(16, 1.0f);
  TensorView ko, vo;
  const TensorView v = MakeView(k.data(), DType::kF32, {16, 1, 1, 1});
  EXPECT_EQ(c->Update(v, v, 1, &ko, &vo).code(), Code::kInvalidArgument);
  EXPECT_EQ(c->Offset(), 0);
  // f16 storage takes any D.
  auto f = NewKVCache(DType::kF16);
  EXPECT_TRUE(f->Update(v, v, 1, &ko, &vo).ok());
  EXPECT_EQ(ko.ne[0], 16);
}

TEST(SequenceCacheBadInput, InvalidConfigurations) {
  TensorView ko, vo;
  std::vector<float> k(32, 1.0f);
  const TensorView v = MakeView(k.data(), DType::kF32, {32, 1, 1, 1});
  std::vector<std::unique_ptr<SequenceCache>> caches;
  caches.push_back(NewRotatingKVCache(0));
  caches.push_back(NewRotatingKVCache(4, 4));
  caches.push_back(NewRotatingKVCache(4, -1));
  caches.push_back(NewRotatingKVCache(4, 0, DType::kF16, 0));
  for (const auto& c : caches) {
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->Update(v, v, 1, &ko, &vo).code(), Code::kInvalidArgument);
    EXPECT_EQ(c->Offset(), 0);
  }
}

// Key and value may have different head dims; the input may be strided (a token-major source).
TEST(SequenceCacheInput, StridedInputAndDifferentHeadDims) {
  const int dk = 32, dv = 64, n = 3, heads = 2;
  // Source laid out [t][h][d] (token-major) with every element doubled in stride for K.
  std::vector<float> kbuf(dk * 2 * heads * n), vbuf(dv * heads * n);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h) {
      for (int j = 0; j < dk; ++j) kbuf[((t * heads + h) * dk + j) * 2] = Val(t, 0, h, j, false);
      for (int j = 0; j < dv; ++j) vbuf[(t * heads + h) * dv + j] = Val(t, 0, h, j, true);
    }
  TensorView k;
  k.data = kbuf.data();
  k.ne[0] = dk, k.ne[1] = n, k.ne[2] = heads, k.ne[3] = 1;
  k.nb[0] = 8, k.nb[2] = dk * 8, k.nb[1] = heads * dk * 8, k.nb[3] = n * heads * dk * 8;
  TensorView v;
  v.data = vbuf.data();
  v.ne[0] = dv, v.ne[1] = n, v.ne[2] = heads, v.ne[3] = 1;
  v.nb[0] = 4, v.nb[2] = dv * 4, v.nb[1] = heads * dv * 4, v.nb[3] = n * heads * dv * 4;
  Driver d(NewRotatingKVCache(4, 1, DType::kBF16), DType::kBF16, DType::kF32,
           Shape{dk, dv, heads, 1});
  TensorView ko, vo;
  ASSERT_TRUE(d.cache()->Update(k, v, n, &ko, &vo).ok());
  std::vector<float> got(dk * n * heads);
  kernels::ViewToF32Ref(ko, got.data());
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < dk; ++j) EXPECT_EQ(got[(h * n + t) * dk + j], Val(t, 0, h, j, false));
  std::vector<float> gotv(dv * n * heads);
  kernels::ViewToF32Ref(vo, gotv.data());
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < dv; ++j) EXPECT_EQ(gotv[(h * n + t) * dv + j], Val(t, 0, h, j, true));
}

// ---- state save / restore -------------------------------------------------------------------

TEST(SequenceCacheState, RoundTripIsBitExact) {
  struct Case {
    int max_size, keep;
    DType dtype;
    std::vector<int> updates;
  };
  const std::vector<Case> cases = {
      {0, 0, DType::kF16, {300, 1, 1}},
      {8, 0, DType::kF32, {1, 1, 1, 12}},  // after a long prefill: dead rows in the block
      {8, 4, DType::kQ8_0, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},  // wrapped
      {8, 4, DType::kQ4_0, {3}},
      {16, 2, DType::kBF16, {40, 1, 5}},
  };
  for (const Case& cs : cases) {
    SCOPED_TRACE("max_size " + std::to_string(cs.max_size) + " keep " + std::to_string(cs.keep) +
                 " " + DTypeName(cs.dtype));
    auto make = [&] {
      return cs.max_size ? NewRotatingKVCache(cs.max_size, cs.keep, cs.dtype)
                         : NewKVCache(cs.dtype);
    };
    Driver a(make(), cs.dtype, DType::kBF16);
    for (int n : cs.updates) ASSERT_TRUE(a.Append(n).ok());
    SequenceCacheState st;
    ASSERT_TRUE(a.cache()->SaveState(&st).ok());
    EXPECT_EQ(st.offset, a.cache()->Offset());
    EXPECT_EQ(st.len, a.cache()->Len());
    auto restored = make();
    ASSERT_TRUE(restored->RestoreState(st).ok());
    EXPECT_EQ(restored->Offset(), a.cache()->Offset());
    EXPECT_EQ(restored->Len(), a.cache()->Len());
    SequenceCacheState st2;
    ASSERT_TRUE(restored->SaveState(&st2).ok());
    EXPECT_EQ(st2.keys, st.keys);
    EXPECT_EQ(st2.values, st.values);
    // Both caches answer the next updates with identical bytes.
    Driver b(std::move(restored), cs.dtype, DType::kBF16);
    for (int step = 0; step < 3; ++step) {
      const int n = step == 1 ? 5 : 1;
      // b's serials start at 0, a's continue: feed both the same rows via the same serials.
      std::vector<uint8_t> k, v;
      a.MakeInput(n, &k, &v, 1000 + step * 10);
      const TensorView kin = MakeView(k.data(), DType::kBF16, {32, n, 2, 2});
      const TensorView vin = MakeView(v.data(), DType::kBF16, {32, n, 2, 2});
      TensorView ka, va, kb, vb;
      ASSERT_TRUE(a.cache()->Update(kin, vin, n, &ka, &va).ok());
      ASSERT_TRUE(b.cache()->Update(kin, vin, n, &kb, &vb).ok());
      ASSERT_EQ(ka.ne[1], kb.ne[1]);
      const size_t rb = RowBytes(cs.dtype, 32);
      for (int h = 0; h < 2; ++h)
        for (int bb = 0; bb < 2; ++bb)
          for (int64_t t = 0; t < ka.ne[1]; ++t) {
            ASSERT_EQ(0, std::memcmp(RowPtr(ka, t, h, bb), RowPtr(kb, t, h, bb), rb));
            ASSERT_EQ(0, std::memcmp(RowPtr(va, t, h, bb), RowPtr(vb, t, h, bb), rb));
          }
    }
  }
}

TEST(SequenceCacheState, MismatchesAreRejectedWithoutChange) {
  Driver a(NewRotatingKVCache(8, 2, DType::kF16), DType::kF16);
  for (int p = 0; p < 12; ++p) ASSERT_TRUE(a.Append(1).ok());
  SequenceCacheState st;
  ASSERT_TRUE(a.cache()->SaveState(&st).ok());
  Driver b(NewRotatingKVCache(8, 2, DType::kF16), DType::kF16);
  ASSERT_TRUE(b.Append(3).ok());
  SequenceCacheState bad = st;
  bad.keep = 3;
  EXPECT_EQ(b.cache()->RestoreState(bad).code(), Code::kInvalidArgument);
  bad = st;
  bad.dtype = DType::kF32;
  EXPECT_EQ(b.cache()->RestoreState(bad).code(), Code::kInvalidArgument);
  bad = st;
  bad.keys.pop_back();
  EXPECT_EQ(b.cache()->RestoreState(bad).code(), Code::kCorrupt);
  bad = st;
  bad.len = 9;  // more than max_size
  EXPECT_EQ(b.cache()->RestoreState(bad).code(), Code::kInvalidArgument);
  bad = st;
  bad.len = 1;  // fewer than the sinks that must be held
  EXPECT_EQ(b.cache()->RestoreState(bad).code(), Code::kInvalidArgument);
  EXPECT_EQ(NewKVCache(DType::kF16)->RestoreState(st).code(), Code::kInvalidArgument);
  EXPECT_EQ(b.cache()->Offset(), 3);
  ASSERT_TRUE(b.Append(1).ok());
  b.Expect({0, 1, 2, 3}, "unchanged");
  // An empty state restores an empty cache.
  SequenceCacheState empty;
  empty.dtype = DType::kF16;
  empty.max_size = 8;
  empty.keep = 2;
  ASSERT_TRUE(b.cache()->RestoreState(empty).ok());
  EXPECT_EQ(b.cache()->Offset(), 0);
  EXPECT_EQ(b.cache()->Len(), 0);
}

// ---- randomized against a plain deque model ---------------------------------------------------

// The model is kvref::SequenceModel (fuzz/reference_model.h): SEMANTICS.md 11 written the obvious
// way, a deque of (position, serial), the sinks being the tokens at positions < keep.

struct RandomCase {
  int max_size, keep;
  DType storage, input;
};

std::string CaseName(const RandomCase& rc) {
  return "max" + std::to_string(rc.max_size) + "_keep" + std::to_string(rc.keep) + "_" +
         DTypeName(rc.storage) + "_from_" + DTypeName(rc.input);
}

// GoogleTest prints a parameter without a PrintTo byte by byte, padding included (indeterminate
// bytes: valgrind reports them).
void PrintTo(const RandomCase& rc, std::ostream* os) { *os << CaseName(rc); }

class SequenceCacheRandomTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(SequenceCacheRandomTest, MatchesDequeModel) {
  const RandomCase rc = GetParam();
  auto make = [&] {
    return rc.max_size ? NewRotatingKVCache(rc.max_size, rc.keep, rc.storage)
                       : NewKVCache(rc.storage);
  };
  Driver d(make(), rc.storage, rc.input, Shape{32, 32, 2, 1});
  kvref::SequenceModel model;
  model.max_size = rc.max_size;
  model.keep = rc.keep;
  std::mt19937 rng(1234 + rc.max_size * 7 + rc.keep);
  const int m = rc.max_size ? rc.max_size : 300;
  for (int op = 0; op < 600; ++op) {
    const int r = static_cast<int>(rng() % 100);
    const std::string where = "op " + std::to_string(op);
    if (r < 60) {
      const int n = 1;
      const std::vector<int> want = model.Update(d.next_serial(), n);
      ASSERT_EQ(model.failed_evictions, 0) << where;
      ASSERT_TRUE(d.Append(n).ok()) << where;
      d.Expect(want, where + " decode");
    } else if (r < 75) {
      const int choices[] = {2, m - 1, m, m + 1, 3 * m, static_cast<int>(rng() % (2 * m)) + 2};
      const int n = std::max(2, choices[rng() % 6]);
      const std::vector<int> want = model.Update(d.next_serial(), n);
      ASSERT_EQ(model.failed_evictions, 0) << where;
      ASSERT_TRUE(d.Append(n).ok()) << where;
      d.Expect(want, where + " prefill " + std::to_string(n));
    } else if (r < 90) {
      const int n = static_cast<int>(rng() % (m / 2 + 2));
      const bool ok = model.Trim(n);
      const Status st = d.cache()->Trim(n);
      ASSERT_EQ(st.ok(), ok) << where << " trim " << n << ": " << st.message();
      if (!ok) {
        ASSERT_EQ(st.code(), Code::kInvalidArgument);
      }
    } else if (r < 98) {
      SequenceCacheState st;
      ASSERT_TRUE(d.cache()->SaveState(&st).ok());
      ASSERT_EQ(st.len, static_cast<int>(model.held.size()));
      ASSERT_TRUE(d.cache()->RestoreState(st).ok()) << where;
    } else {
      d.cache()->Reset();
      model.Reset();
    }
    ASSERT_EQ(d.cache()->Offset(), model.offset) << where;
    ASSERT_EQ(d.cache()->Len(), static_cast<int>(model.held.size())) << where;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, SequenceCacheRandomTest,
                         ::testing::Values(RandomCase{0, 0, DType::kF16, DType::kF32},
                                           RandomCase{1, 0, DType::kF32, DType::kF16},
                                           RandomCase{8, 0, DType::kF16, DType::kF32},
                                           RandomCase{8, 4, DType::kF16, DType::kBF16},
                                           RandomCase{37, 3, DType::kQ8_0, DType::kF32},
                                           RandomCase{64, 1, DType::kBF16, DType::kF16},
                                           RandomCase{300, 4, DType::kQ4_0, DType::kF32}),
                         [](const auto& info) { return CaseName(info.param); });

}  // namespace
}  // namespace kv
