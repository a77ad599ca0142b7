// Encoder cache (SEMANTICS.md section 9): stored once as given, read many times, no mask.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/arena.h"
#include "core/attend.h"
#include "core/cache.h"
#include "gtest/gtest.h"
#include "test_allocator.h"

namespace kv {
namespace {

// A batch that owns its arrays.
struct TestBatch {
  std::vector<int32_t> pos, seq, mm;
  Batch Get() const { return Batch{pos, seq, mm}; }
};

TestBatch Tokens(int32_t first, int n, int32_t seq = 0, std::vector<int32_t> mm = {}) {
  TestBatch b;
  for (int i = 0; i < n; ++i) {
    b.pos.push_back(first + i);
    b.seq.push_back(seq);
  }
  b.mm = std::move(mm);
  return b;
}

// [d0, d1, d2] f32 tensor with values base + index.
struct F32Tensor {
  std::vector<float> data;
  TensorView view;
  F32Tensor(int64_t d0, int64_t d1, int64_t d2, float base) : data(d0 * d1 * d2) {
    for (size_t i = 0; i < data.size(); ++i) data[i] = base + static_cast<float>(i);
    view = MakeView(data.data(), DType::kF32, {d0, d1, d2});
  }
};

std::vector<float> ReadF32(const TensorView& v) {
  std::vector<float> out;
  for (int64_t i3 = 0; i3 < v.ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < v.ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < v.ne[1]; ++i1)
        for (int64_t i0 = 0; i0 < v.ne[0]; ++i0) {
          const char* p = static_cast<const char*>(RowPtr(v, i1, i2, i3)) + i0 * v.nb[0];
          out.push_back(LoadAsF32(p, v.dtype, 0));
        }
  return out;
}

std::unique_ptr<EncoderCache> Ready(int sequences = 1, int max_batch = 8,
                                    EncoderOptions opt = EncoderOptions{}) {
  auto c = NewEncoderCache(opt);
  EXPECT_TRUE(c->Init(DType::kF16, sequences, 64, max_batch).ok());
  return c;
}

TEST(EncoderCache, GetIsEmptyBeforeAnyPut) {
  auto c = Ready();
  TestBatch b = Tokens(0, 2);
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  c->SetLayer(0);
  History h = c->Get();
  EXPECT_EQ(h.k.data, nullptr);
  EXPECT_EQ(h.v.data, nullptr);
  EXPECT_EQ(h.mask.data, nullptr);
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_EQ(c->MemoryBytes(), 0u);
}

TEST(EncoderCache, StoresInputShapeAndDtypeNotStorageDtype) {
  auto c = Ready();  // storage dtype f16 is not applied
  TestBatch b = Tokens(0, 4, 0, {2});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  c->SetLayer(0);
  F32Tensor k(4, 2, 3, 1.0f), v(6, 2, 3, 100.0f);
  ASSERT_TRUE(c->Put(k.view, v.view).ok());
  std::vector<float> k_expect = k.data, v_expect = v.data;
  // The cache owns a copy: later changes to the input do not show.
  k.data.assign(k.data.size(), -1.0f);
  History h = c->Get();
  EXPECT_EQ(h.mask.data, nullptr);
  EXPECT_EQ(h.k.dtype, DType::kF32);
  EXPECT_EQ(h.k.ne[0], 4);
  EXPECT_EQ(h.k.ne[1], 2);
  EXPECT_EQ(h.k.ne[2], 3);
  EXPECT_EQ(h.v.ne[0], 6);
  EXPECT_EQ(h.k.nb[1], 16u);  // contiguous
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h.k.data) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h.v.data) % 64, 0u);
  EXPECT_EQ(ReadF32(h.k), k_expect);
  EXPECT_EQ(ReadF32(h.v), v_expect);
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_GE(c->MemoryBytes(), (4 + 6) * 2 * 3 * 4u);

  // Read many times: a later batch without multimodal tokens still sees it.
  TestBatch d = Tokens(4, 1);
  ASSERT_TRUE(c->StartForward(d.Get(), false).ok());
  c->SetLayer(0);
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_EQ(ReadF32(c->Get().k), k_expect);
}

TEST(EncoderCache, HalfPrecisionInputKeepsItsDtype) {
  auto c = Ready();
  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  std::vector<uint16_t> kh(8), vb(8);
  for (int i = 0; i < 8; ++i) {
    kh[i] = F32ToF16(0.5f * i);
    vb[i] = F32ToBF16(-0.25f * i);
  }
  c->SetLayer(3);
  ASSERT_TRUE(c->Put(MakeView(kh.data(), DType::kF16, {4, 2, 1}),
                     MakeView(vb.data(), DType::kBF16, {4, 2, 1}))
                  .ok());
  History h = c->Get();
  EXPECT_EQ(h.k.dtype, DType::kF16);
  EXPECT_EQ(h.v.dtype, DType::kBF16);
  EXPECT_EQ(std::memcmp(h.k.data, kh.data(), 16), 0);
  EXPECT_EQ(std::memcmp(h.v.data, vb.data(), 16), 0);
  c->SetLayer(0);  // other layers hold nothing
  EXPECT_EQ(c->Get().k.data, nullptr);
}

// What the encoder stores as given may be K and V of different dtypes: Attend reads them (it
// widens to f32 first) and gives the plain softmax over the stored values.
TEST(EncoderCache, MixedDTypeHistoryIsAttended) {
  constexpr int D = 4, Hkv = 2, N = 5, Hq = 4;
  auto c = Ready();
  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  std::vector<uint16_t> kh(D * Hkv * N), vb(D * Hkv * N);
  for (size_t i = 0; i < kh.size(); ++i) {
    kh[i] = F32ToF16(0.125f * static_cast<float>(i % 7) - 0.3f);
    vb[i] = F32ToBF16(0.25f * static_cast<float>(i % 5) - 0.5f);
  }
  c->SetLayer(1);
  ASSERT_TRUE(c->Put(MakeView(kh.data(), DType::kF16, {D, Hkv, N}),
                     MakeView(vb.data(), DType::kBF16, {D, Hkv, N}))
                  .ok());
  const History h = c->Get();
  ASSERT_EQ(h.k.dtype, DType::kF16);
  ASSERT_EQ(h.v.dtype, DType::kBF16);
  std::vector<float> q(D * Hq), out(D * Hq, -1.0f);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.3f * static_cast<float>(i % 3) - 0.2f;
  TensorView ov = MakeView(out.data(), DType::kF32, {D, 1, Hq});
  ASSERT_TRUE(Attend(MakeView(q.data(), DType::kF32, {D, 1, Hq}), h, AttentionParams{}, &ov).ok());
  const std::vector<float> k = ReadF32(h.k), v = ReadF32(h.v);  // [cell][head][d]
  for (int hq = 0; hq < Hq; ++hq) {
    const int kvh = hq / (Hq / Hkv);
    double logit[N], mx = -1e300, sum = 0;
    for (int j = 0; j < N; ++j) {
      logit[j] = 0;
      for (int d = 0; d < D; ++d)
        logit[j] += 0.5 * q[hq * D + d] * k[(static_cast<size_t>(j) * Hkv + kvh) * D + d];
      mx = std::max(mx, logit[j]);
    }
    for (int j = 0; j < N; ++j) sum += std::exp(logit[j] - mx);
    for (int d = 0; d < D; ++d) {
      double want = 0;
      for (int j = 0; j < N; ++j)
        want += std::exp(logit[j] - mx) / sum * v[(static_cast<size_t>(j) * Hkv + kvh) * D + d];
      EXPECT_NEAR(out[hq * D + d], want, 1e-6) << "head " << hq << " dim " << d;
    }
  }
}

TEST(EncoderCache, StridedInputIsCompacted) {
  auto c = Ready();
  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  // K: [3, 2, 2] taken from a buffer with every other float (nb[0] = 8) and padded rows.
  std::vector<float> buf(64);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i);
  TensorView k;
  k.data = buf.data();
  k.dtype = DType::kF32;
  k.ne[0] = 3;
  k.ne[1] = 2;
  k.ne[2] = 2;
  k.nb[0] = 8;
  k.nb[1] = 32;
  k.nb[2] = 80;
  k.nb[3] = 160;
  ASSERT_TRUE(c->Put(k, k).ok());
  std::vector<float> expect;
  for (int i2 = 0; i2 < 2; ++i2)
    for (int i1 = 0; i1 < 2; ++i1)
      for (int i0 = 0; i0 < 3; ++i0)
        expect.push_back(static_cast<float>(i2 * 20 + i1 * 8 + i0 * 2));
  History h = c->Get();
  EXPECT_EQ(h.k.nb[0], 4u);
  EXPECT_EQ(h.k.nb[1], 12u);
  EXPECT_EQ(ReadF32(h.k), expect);
}

TEST(EncoderCache, PermutedVStoresTokensFastest) {
  auto c = NewEncoderCache();
  CacheConfig cfg;
  cfg.permuted_v = true;
  ASSERT_TRUE(c->SetConfig(cfg).ok());
  ASSERT_TRUE(c->Init(DType::kF32, 1, 64, 8).ok());
  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  F32Tensor k(4, 2, 3, 0.0f), v(5, 2, 3, 0.0f);  // v: [v_head_dim 5, kv_heads 2, tokens 3]
  ASSERT_TRUE(c->Put(k.view, v.view).ok());
  History h = c->Get();
  ASSERT_EQ(h.v.ne[0], 3);  // [tokens, v_head_dim, kv_heads]
  ASSERT_EQ(h.v.ne[1], 5);
  ASSERT_EQ(h.v.ne[2], 2);
  const float* pv = static_cast<const float*>(h.v.data);
  for (int t = 0; t < 3; ++t)
    for (int d = 0; d < 5; ++d)
      for (int hh = 0; hh < 2; ++hh)
        EXPECT_EQ(pv[t + 3 * (d + 5 * hh)], v.data[d + 5 * (hh + 2 * t)]);
  EXPECT_EQ(ReadF32(h.k), k.data);  // K is never permuted
}

TEST(EncoderCache, RecordsLastMultimodalPositionAndRemoveInvalidates) {
  auto c = Ready();
  TestBatch b = Tokens(10, 6, 0, {1, 3});  // multimodal tokens at positions 11 and 13: 13 counts
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  F32Tensor k(4, 1, 2, 0.0f);
  for (int layer = 0; layer < 3; ++layer) {
    c->SetLayer(layer);
    ASSERT_TRUE(c->Put(k.view, k.view).ok());
  }
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_TRUE(c->Remove(0, 14, kPosMax).ok());  // after the image: kept
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_TRUE(c->Remove(0, 11, 13).ok());  // before it (and 11 is not the recorded one): kept
  EXPECT_TRUE(c->EncoderCached());
  // As Ollama (SEMANTICS.md §9), the recorded position does not move when a Remove shifts later
  // tokens: it is still 13, so a Remove from 12 on covers it.
  EXPECT_TRUE(c->Remove(0, 12, kPosMax).ok());
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_TRUE(c->CanResume(0, 0));
  EXPECT_TRUE(c->CanResume(0, 1000));
}

TEST(EncoderCache, RemoveToTheEndCoversThePosition) {
  auto c = Ready();
  TestBatch b = Tokens(0, 4, 0, {2});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  F32Tensor k(4, 1, 2, 0.0f);
  ASSERT_TRUE(c->Put(k.view, k.view).ok());
  EXPECT_TRUE(c->Remove(0, 0, 2).ok() && c->EncoderCached());  // [0, 2) does not hold 2
  EXPECT_TRUE(c->Remove(0, 0, kPosMax).ok());
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_EQ(c->Get().k.data, nullptr);  // the removed image is not served (data null)
  // A new Put (a new image) caches it again at the newly recorded position.
  TestBatch d = Tokens(0, 3, 0, {0});
  ASSERT_TRUE(c->StartForward(d.Get(), false).ok());
  ASSERT_TRUE(c->Put(k.view, k.view).ok());
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_NE(c->Get().k.data, nullptr);
  EXPECT_TRUE(c->Remove(0, 0, 1).ok());
  EXPECT_FALSE(c->EncoderCached());
}

TEST(EncoderCache, ReservePassSizesButDoesNotCacheOrClobber) {
  auto c = Ready();
  TestBatch b = Tokens(0, 2, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), true).ok());
  F32Tensor big(8, 2, 16, 5.0f);
  ASSERT_TRUE(c->Put(big.view, big.view).ok());
  EXPECT_FALSE(c->EncoderCached());
  // The reserve pass learns the worst-case shape for sizing; the data stay null until cached
  // (SEMANTICS.md §9).
  History r = c->Get();
  EXPECT_EQ(r.k.data, nullptr);
  EXPECT_EQ(r.v.data, nullptr);
  EXPECT_EQ(r.k.ne[2], 16);
  EXPECT_EQ(r.v.ne[2], 16);
  const size_t reserved = c->MemoryBytes();
  EXPECT_GE(reserved, 2 * 8 * 2 * 16 * 4u);

  // A real image smaller than the reserve fits without reallocating.
  TestBatch real = Tokens(0, 2, 0, {1});
  ASSERT_TRUE(c->StartForward(real.Get(), false).ok());
  F32Tensor k(8, 2, 4, 1.0f);
  ASSERT_TRUE(c->Put(k.view, k.view).ok());
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_EQ(c->MemoryBytes(), reserved);
  EXPECT_EQ(c->Get().k.ne[2], 4);

  // A later reserve pass neither uncaches nor overwrites the image.
  ASSERT_TRUE(c->StartForward(b.Get(), true).ok());
  ASSERT_TRUE(c->Put(big.view, big.view).ok());
  EXPECT_TRUE(c->EncoderCached());
  ASSERT_TRUE(c->StartForward(Tokens(2, 1).Get(), false).ok());
  EXPECT_EQ(ReadF32(c->Get().k), k.data);
  // Even when the reserve is larger than anything so far: storage grows, contents are kept.
  F32Tensor bigger(8, 2, 64, 0.0f);
  ASSERT_TRUE(c->StartForward(b.Get(), true).ok());
  ASSERT_TRUE(c->Put(bigger.view, bigger.view).ok());
  EXPECT_GT(c->MemoryBytes(), reserved);
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_EQ(ReadF32(c->Get().k), k.data);
}

TEST(EncoderCache, LaterPutOfAnotherSizeReallocates) {
  auto c = Ready();
  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  F32Tensor small(4, 2, 2, 1.0f), large(4, 2, 50, 7.0f);
  ASSERT_TRUE(c->Put(small.view, small.view).ok());
  const size_t m0 = c->MemoryBytes();
  ASSERT_TRUE(c->Put(large.view, large.view).ok());
  EXPECT_GT(c->MemoryBytes(), m0);
  EXPECT_EQ(ReadF32(c->Get().k), large.data);
  ASSERT_TRUE(c->Put(small.view, small.view).ok());
  EXPECT_EQ(ReadF32(c->Get().v), small.data);
  EXPECT_EQ(c->Get().v.ne[2], 2);
}

TEST(EncoderCache, InvalidBatchChangesNothing) {
  auto c = Ready(/*sequences=*/1, /*max_batch=*/4);
  TestBatch ok = Tokens(5, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(ok.Get(), false).ok());
  TestBatch bad_sizes = Tokens(0, 3, 0, {2});
  bad_sizes.seq.pop_back();
  TestBatch too_big = Tokens(0, 5, 0, {4});
  TestBatch bad_seq = Tokens(0, 2, 1, {1});
  TestBatch bad_mm = Tokens(0, 2, 0, {2});
  TestBatch empty;
  for (const TestBatch* b : {&bad_sizes, &too_big, &bad_seq, &bad_mm, &empty}) {
    EXPECT_EQ(c->StartForward(b->Get(), false).code(), Code::kInvalidArgument);
  }
  // The recorded position is still 5 from the good batch.
  F32Tensor k(4, 1, 1, 0.0f);
  ASSERT_TRUE(c->Put(k.view, k.view).ok());
  EXPECT_TRUE(c->Remove(0, 6, kPosMax).ok() && c->EncoderCached());
  EXPECT_TRUE(c->Remove(0, 5, 6).ok());
  EXPECT_FALSE(c->EncoderCached());
}

TEST(EncoderCache, ConfigAndArgumentErrors) {
  auto c = NewEncoderCache();
  CacheConfig cfg;
  cfg.padding = 2;
  EXPECT_EQ(c->SetConfig(cfg).code(), Code::kInvalidArgument);
  cfg.padding = 0;
  EXPECT_EQ(c->SetConfig(cfg).code(), Code::kInvalidArgument);
  cfg.padding = 1;
  EXPECT_TRUE(c->SetConfig(cfg).ok());
  EXPECT_EQ(c->Init(DType::kF32, 0, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(c->Init(DType::kF32, 1, 16, 0).code(), Code::kInvalidArgument);
  ASSERT_TRUE(c->Init(DType::kF32, 1, 16, 4).ok());
  EXPECT_EQ(c->SetConfig(cfg).code(), Code::kInvalidArgument);  // after Init
  EXPECT_FALSE(c->SupportsCopyPrefix());
  EXPECT_EQ(c->CopyPrefix(0, 0, 4).code(), Code::kNotSupported);

  TestBatch b = Tokens(0, 1, 0, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  std::vector<uint8_t> q(34 * 2);
  F32Tensor k(32, 1, 1, 0.0f);
  EXPECT_EQ(c->Put(MakeView(q.data(), DType::kQ8_0, {64, 1, 1}), k.view).code(),
            Code::kInvalidArgument);
  TensorView null_view = k.view;
  null_view.data = nullptr;
  EXPECT_EQ(c->Put(k.view, null_view).code(), Code::kInvalidArgument);
  c->SetLayer(1 << 20);  // a layer index is an array index: bounded
  EXPECT_EQ(c->Put(k.view, k.view).code(), Code::kInvalidArgument);
  c->SetLayer(-1);
  EXPECT_EQ(c->Put(k.view, k.view).code(), Code::kInvalidArgument);
  c->SetLayer(0);
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_EQ(c->Remove(1, 0, kPosMax).code(), Code::kInvalidArgument);

  c->Close();
  EXPECT_EQ(c->MemoryBytes(), 0u);
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_EQ(c->StartForward(b.Get(), false).code(), Code::kInvalidArgument);
}

// Views may broadcast (stride 0), so a view of few bytes can have any shape. One whose contiguous
// copy would not fit in size_t is rejected before anything is sized or copied: before, the byte
// count wrapped, the cache sized its storage by the wrapped count and copied past it.
TEST(EncoderCache, PutOfAShapeBeyondTheAddressSpaceChangesNothing) {
  auto c = NewEncoderCache();
  ASSERT_TRUE(c->Init(DType::kF32, 1, 16, 4).ok());
  ASSERT_TRUE(c->StartForward(Tokens(0, 1, 0, {0}).Get(), false).ok());
  F32Tensor small(4, 2, 2, 1.0f);
  ASSERT_TRUE(c->Put(small.view, small.view).ok());
  const size_t bytes = c->MemoryBytes();
  float one = 1.0f;
  // 4 * 2^31 * 2^31 * 2^31 * 2^2 bytes = 2^97: a multiple of 2^64, so the count wrapped to 0.
  TensorView huge =
      MakeView(&one, DType::kF32, {int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31, 4});
  for (int d = 0; d < 4; ++d) huge.nb[d] = 0;
  // On a 32-bit machine 2^30 elements of 4 bytes already do not fit.
  TensorView big = MakeView(&one, DType::kF32, {int64_t{1} << 30, 1, 1, 1});
  big.nb[0] = big.nb[1] = big.nb[2] = big.nb[3] = 0;
  EXPECT_EQ(c->Put(huge, small.view).code(), Code::kInvalidArgument);
  EXPECT_EQ(c->Put(small.view, huge).code(), Code::kInvalidArgument);
  if (sizeof(size_t) == 4) {
    EXPECT_EQ(c->Put(big, big).code(), Code::kInvalidArgument);
  }
  EXPECT_EQ(c->MemoryBytes(), bytes);
  EXPECT_EQ(ReadF32(c->Get().k), small.data);
}

TEST(EncoderCache, FailedAllocationChangesNothing) {
  testing::TestAllocator alloc;
  auto c = NewEncoderCache();
  ASSERT_TRUE(c->SetAllocator(alloc.Get()).ok());
  ASSERT_TRUE(c->Init(DType::kF32, 1, 64, 8).ok());
  ASSERT_TRUE(c->StartForward(Tokens(0, 2, 0, {0}).Get(), false).ok());
  F32Tensor small(4, 2, 2, 1.0f), large(4, 2, 40, 9.0f);
  ASSERT_TRUE(c->Put(small.view, small.view).ok());
  EXPECT_EQ(alloc.allocations, 1);  // K and V share one region
  EXPECT_EQ(c->SetAllocator(alloc.Get()).code(), Code::kInvalidArgument);  // holds storage
  const size_t bytes = c->MemoryBytes();

  // A second image at position 1 that needs more room than the allocator gives.
  ASSERT_TRUE(c->StartForward(Tokens(1, 1, 0, {0}).Get(), false).ok());
  alloc.fail = true;
  EXPECT_EQ(c->Put(large.view, large.view).code(), Code::kOutOfMemory);
  EXPECT_EQ(c->MemoryBytes(), bytes);
  EXPECT_EQ(ReadF32(c->Get().k), small.data);
  EXPECT_TRUE(c->EncoderCached());
  // Still recorded at position 0: removing position 1 keeps it.
  EXPECT_TRUE(c->Remove(0, 1, kPosMax).ok() && c->EncoderCached());
  // Steady state: the same or a smaller size allocates nothing, even with the allocator failing.
  EXPECT_TRUE(c->Put(small.view, small.view).ok());
  alloc.fail = false;
  EXPECT_EQ(alloc.allocations, 1);
  c->Close();
  EXPECT_TRUE(c->SetAllocator(SystemAllocator()).ok());
}

TEST(EncoderCache, SharedModeServesEverySequenceFromOneBlock) {
  auto c = Ready(/*sequences=*/2);
  TestBatch b = Tokens(3, 1, 1, {0});
  ASSERT_TRUE(c->StartForward(b.Get(), false).ok());
  F32Tensor k(4, 1, 2, 0.0f);
  ASSERT_TRUE(c->Put(k.view, k.view).ok());
  ASSERT_TRUE(c->StartForward(Tokens(0, 1, 0).Get(), false).ok());
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_EQ(ReadF32(c->Get().k), k.data);
  // As Ollama, Remove does not look at the sequence.
  EXPECT_TRUE(c->Remove(0, 3, 4).ok());
  EXPECT_FALSE(c->EncoderCached());
}

TEST(EncoderCache, PerSequenceModeKeepsOneBlockPerSequence) {
  auto c = Ready(/*sequences=*/3, /*max_batch=*/8, EncoderOptions{.per_sequence = true});
  EXPECT_TRUE(c->SupportsCopyPrefix());
  F32Tensor img0(4, 1, 2, 0.0f), img1(4, 1, 3, 50.0f);
  ASSERT_TRUE(c->StartForward(Tokens(0, 4, 0, {1}).Get(), false).ok());
  ASSERT_TRUE(c->Put(img0.view, img0.view).ok());
  ASSERT_TRUE(c->StartForward(Tokens(0, 4, 1, {2}).Get(), false).ok());
  EXPECT_FALSE(c->EncoderCached());  // sequence 1 has nothing yet
  ASSERT_TRUE(c->Put(img1.view, img1.view).ok());
  EXPECT_TRUE(c->EncoderCached());

  ASSERT_TRUE(c->StartForward(Tokens(4, 1, 0).Get(), false).ok());
  EXPECT_EQ(ReadF32(c->Get().k), img0.data);
  ASSERT_TRUE(c->StartForward(Tokens(4, 1, 1).Get(), false).ok());
  EXPECT_EQ(ReadF32(c->Get().k), img1.data);

  // A batch mixing sequences cannot pick a block.
  TestBatch mixed = Tokens(5, 2, 0);
  mixed.seq[1] = 1;
  EXPECT_EQ(c->StartForward(mixed.Get(), false).code(), Code::kInvalidArgument);

  // Remove looks at the sequence: removing position 2 of sequence 0 keeps sequence 1's image.
  EXPECT_TRUE(c->Remove(0, 2, kPosMax).ok());
  ASSERT_TRUE(c->StartForward(Tokens(4, 1, 1).Get(), false).ok());
  EXPECT_TRUE(c->EncoderCached());

  // CopyPrefix: a prefix that holds the image (position 2 < 3) carries it over ...
  ASSERT_TRUE(c->CopyPrefix(1, 2, 3).ok());
  ASSERT_TRUE(c->StartForward(Tokens(3, 1, 2).Get(), false).ok());
  EXPECT_TRUE(c->EncoderCached());
  EXPECT_EQ(ReadF32(c->Get().k), img1.data);
  // ... a shorter one does not.
  ASSERT_TRUE(c->CopyPrefix(1, 2, 2).ok());
  ASSERT_TRUE(c->StartForward(Tokens(2, 1, 2).Get(), false).ok());
  EXPECT_FALSE(c->EncoderCached());
  EXPECT_EQ(c->CopyPrefix(1, 3, 2).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace kv
