// Persistence (core/persistence.h): CRC32C vectors; save / load round trips for every causal kind
// and dtype that continue decoding bit-identically; one-sequence streams; every failure (other
// shape, dtype, kind, truncation, any flipped byte, hostile fields behind a valid checksum) leaves
// the target unchanged; files are replaced atomically; the encoder cache (shared and per sequence,
// every input dtype, both V layouts); wrappers, an encoder child included; the growing and rotating
// caches; and the same stream bytes on every machine and Highway target.
#include "core/persistence.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_fingerprint.h"
#include "core/crc32c.h"
#include "decode_driver.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/convert.h"
#include "kernels/highway_targets.h"
#include "stream_edit.h"

namespace kv {
namespace {

using kvfuzz::ResealStream;
using kvfuzz::StoreLittleEndian;
using testing::AllCacheKinds;
using testing::CacheKind;
using testing::Driver;
using testing::Fingerprint;
using testing::kAllDTypes;

// ---- CRC32C
// ---------------------------------------------------------------------------------------

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i);
  // RFC 3720 (iSCSI) appendix B.4.
  EXPECT_EQ(Crc32c(0, zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(0, ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(0, inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(0, nullptr, 0), 0u);
}

TEST(Crc32c, IncrementalAndUnalignedMatchOneShot) {
  std::vector<uint8_t> data(1000);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  EXPECT_EQ(Crc32cPortable(0, "123456789", 9), 0xE3069283u);
  for (size_t n : {0, 1, 7, 8, 9, 63, 1000}) {
    EXPECT_EQ(Crc32c(0, data.data(), n), Crc32cPortable(0, data.data(), n)) << n;
    EXPECT_EQ(Crc32c(0x12345678u, data.data() + 1, n - (n > 0)),
              Crc32cPortable(0x12345678u, data.data() + 1, n - (n > 0)))
        << n;
  }
  for (size_t off : {0, 1, 3, 7}) {
    const uint32_t whole = Crc32c(0, data.data() + off, data.size() - off);
    for (size_t cut : {0, 1, 5, 8, 13, 500}) {
      const uint32_t a = Crc32c(0, data.data() + off, cut);
      EXPECT_EQ(Crc32c(a, data.data() + off + cut, data.size() - off - cut), whole);
    }
  }
}

// ---- helpers
// --------------------------------------------------------------------------------------

std::unique_ptr<CausalCache> MakeInit(const CacheKind& kind, DType dtype, int seqs = 2,
                                      int capacity = 48, int batch = 8, bool permuted = false) {
  auto c = kind.make();
  CacheConfig cfg;
  cfg.permuted_v = permuted;
  EXPECT_TRUE(c->SetConfig(cfg).ok());
  EXPECT_TRUE(c->Init(dtype, seqs, capacity, batch).ok());
  return c;
}

// Fills two sequences and decodes a little (window trimming happens for the SWA-with-memory kind).
void Fill(Driver& d, CausalCache* c) {
  ASSERT_TRUE(d.Prefill(c, 0, 0, 8).ok());
  ASSERT_TRUE(d.Prefill(c, 1, 0, 5).ok());
  for (int t = 0; t < 4; ++t) ASSERT_TRUE(d.Tokens(c, {{0, 8 + t}, {1, 5 + t}}).ok());
  ASSERT_TRUE(d.Tokens(c, {{0, 12}}).ok());
}

// Everything observable about a cache's contents: its own stream (cells, positions, sequence
// sets, rows) and its memory.
std::vector<float> ViewFloats(const TensorView& v) {
  std::vector<float> f(static_cast<size_t>(v.ne[0] * v.ne[1] * v.ne[2] * v.ne[3]));
  if (v.data != nullptr) kernels::ViewToF32(v, f.data());
  return f;
}

// Decodes the same steps on a and b and requires identical histories and attention outputs.
void ExpectSameFuture(Driver& d, CausalCache* a, CausalCache* b, int steps, bool exact = true,
                      int seq_a = 0, int seq_b = 0, int32_t from = 13) {
  std::vector<float> oa(d.layers * d.out.size()), ob(oa.size());
  d.value_seq = seq_a;  // the same values whatever the sequence id
  for (int t = 0; t < steps; ++t) {
    d.seq[0] = seq_a;
    d.pos[0] = from + t;
    ASSERT_TRUE(d.Step(a, 1, oa.data()).ok());
    d.seq[0] = seq_b;
    d.pos[0] = from + t;
    ASSERT_TRUE(d.Step(b, 1, ob.data()).ok());
    for (int l = 0; l < d.layers; ++l) {
      const size_t n = static_cast<size_t>(d.dv) * d.q_heads;
      const float* pa = oa.data() + l * d.out.size();
      const float* pb = ob.data() + l * d.out.size();
      if (exact) {
        ASSERT_EQ(std::memcmp(pa, pb, n * sizeof(float)), 0) << "step " << t << " layer " << l;
      } else {
        for (size_t i = 0; i < n; ++i) ASSERT_NEAR(pa[i], pb[i], 1e-5f) << "step " << t;
      }
    }
    if (exact) {
      a->SetLayer(1);
      b->SetLayer(1);
      const History ha = a->Get(), hb = b->Get();
      ASSERT_EQ(ha.mask.ne[0], hb.mask.ne[0]);
      ASSERT_EQ(std::memcmp(ha.mask.data, hb.mask.data, ha.mask.nb[1] * ha.mask.ne[1]), 0);
      // Rows of visible cells are identical; hidden cells (freed by trimming) may hold stale rows
      // in a and zeros in b, which attention never reads.
      const std::vector<float> ka = ViewFloats(ha.k), kb = ViewFloats(hb.k);
      const std::vector<float> va = ViewFloats(ha.v), vb = ViewFloats(hb.v);
      ASSERT_EQ(ka.size(), kb.size());
      ASSERT_EQ(va.size(), vb.size());
      const int64_t L = ha.mask.ne[0];
      const size_t krow = ka.size() / L, vrow = va.size() / L;
      const bool permuted = ha.v.ne[0] == L && ha.v.ne[2] != L;
      for (int64_t j = 0; j < L; ++j) {
        const float m =
            ha.mask.dtype == DType::kF32 ? static_cast<const float*>(ha.mask.data)[j] : 0.0f;
        if (m != 0.0f) continue;
        for (size_t e = 0; e < krow; ++e) ASSERT_EQ(ka[j * krow + e], kb[j * krow + e]) << j;
        if (!permuted) {
          for (size_t e = 0; e < vrow; ++e) ASSERT_EQ(va[j * vrow + e], vb[j * vrow + e]) << j;
        } else {
          for (size_t e = 0; e < vrow; ++e) ASSERT_EQ(va[e * L + j], vb[e * L + j]) << j;
        }
      }
    }
  }
  EXPECT_TRUE(a->CheckConsistency().ok());
  EXPECT_TRUE(b->CheckConsistency().ok());
  d.value_seq = -1;
}

// ---- whole-cache round trips
// ----------------------------------------------------------------------

TEST(PersistenceRoundTrip, EveryKindAndDTypeContinuesIdentically) {
  for (const CacheKind& kind : AllCacheKinds()) {
    for (DType dtype : kAllDTypes) {
      for (bool permuted : {false, true}) {
        if (permuted && IsQuantized(dtype)) continue;
        SCOPED_TRACE(std::string(kind.name) + " " + DTypeName(dtype) +
                     (permuted ? " permuted" : ""));
        Driver d;
        auto a = MakeInit(kind, dtype, 2, 48, 8, permuted);
        Fill(d, a.get());
        std::vector<uint8_t> bytes;
        ASSERT_TRUE(SaveCache(*a, &bytes).ok());
        auto b = MakeInit(kind, dtype, 2, 48, 8, permuted);
        const Status s = LoadCache(bytes, b.get());
        ASSERT_TRUE(s.ok()) << s.message();
        ASSERT_TRUE(b->CheckConsistency().ok());
        EXPECT_EQ(Fingerprint(*a, false), Fingerprint(*b, false));
        // Get before a StartForward: no current pass after a load.
        EXPECT_EQ(b->Get().mask.data, nullptr);
        ExpectSameFuture(d, a.get(), b.get(), 12);
      }
    }
  }
}

TEST(PersistenceRoundTrip, LoadOverAUsedCacheAndAcrossVLayouts) {
  // The target already holds other tokens and another layer: the load replaces everything; its
  // permuted V layout differs from the saved one (rows are stored canonically).
  Driver d;
  const CacheKind kind = AllCacheKinds()[0];
  auto a = MakeInit(kind, DType::kF16);
  Fill(d, a.get());
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  auto b = MakeInit(kind, DType::kF16, 2, 48, 8, /*permuted=*/true);
  Driver d3;
  d3.layers = 3;
  ASSERT_TRUE(d3.Prefill(b.get(), 1, 0, 7).ok());
  ASSERT_TRUE(LoadCache(bytes, b.get()).ok());
  ASSERT_TRUE(b->CheckConsistency().ok());
  b->SetLayer(2);  // not in the stream: zeroed
  ASSERT_TRUE(d.Tokens(b.get(), {{0, 13}}).ok());
  b->SetLayer(2);
  for (float f : ViewFloats(b->Get().k)) ASSERT_EQ(f, 0.0f);
  // The saved layers hold the same rows: compare the histories of layer 0 after one more token.
  ASSERT_TRUE(d.Tokens(a.get(), {{0, 13}}).ok());
  a->SetLayer(0);
  b->SetLayer(0);
  EXPECT_EQ(ViewFloats(a->Get().k), ViewFloats(b->Get().k));
  EXPECT_EQ(ViewFloats(a->Get().v).size(), ViewFloats(b->Get().v).size());
}

TEST(PersistenceRoundTrip, EmptyAndSharedCells) {
  Driver d;
  auto a = MakeInit(AllCacheKinds()[0], DType::kF32, 3);
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());  // nothing held, no layer
  auto b = MakeInit(AllCacheKinds()[0], DType::kF32, 3);
  ASSERT_TRUE(d.Prefill(b.get(), 0, 0, 4).ok());
  ASSERT_TRUE(LoadCache(bytes, b.get()).ok());
  ASSERT_TRUE(b->CheckConsistency().ok());
  ASSERT_TRUE(d.Tokens(b.get(), {{0, 0}}).ok());
  EXPECT_EQ(b->Get().mask.ne[0], 1);  // only the new token: every old cell is free
  // Shared cells (CopyPrefix) keep their sequence sets.
  ASSERT_TRUE(d.Prefill(a.get(), 0, 0, 6).ok());
  ASSERT_TRUE(a->CopyPrefix(0, 2, 4).ok());
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  auto c = MakeInit(AllCacheKinds()[0], DType::kF32, 3);
  ASSERT_TRUE(LoadCache(bytes, c.get()).ok());
  ASSERT_TRUE(c->CheckConsistency().ok());
  std::vector<uint8_t> again;
  ASSERT_TRUE(SaveCache(*c, &again).ok());
  EXPECT_EQ(bytes, again);
  ExpectSameFuture(d, a.get(), c.get(), 3, true, 2, 2, 4);
}

// ---- the same bytes on every machine
// ----------------------------------------------------------------------

// A stream saved on one machine loads on any other: every field and every K/V value has a fixed
// width and is little-endian (core/persistence.h), and the rows are converted bit for bit as the
// scalar reference does on every Highway target. These tests pin the streams of small caches by
// length and CRC32C. The constants were computed on x86-64; every compiled target there, aarch64,
// armv7, i386 and the big-endian s390x (.ci/cross) must give the same. A quantizer that rounds
// differently on some target (armv7 NEON did, session 42), a value written in the machine's byte
// order (on s390x every stream kind did, session 43) or a field whose width follows size_t changes
// them. A deliberate format change updates them, and the stream version with them.
//
// The values are k / 4096 for 16-bit integers k from a multiplicative hash (exact in f32). One
// token's values are scaled by 2^-124: its q8_0 and q4_0 scales are subnormal and so are some of
// its values, which a target that flushes subnormals (armv7 NEON) must quantize as the reference
// does.
float PinnedValue(uint32_t key, int32_t token) {
  const float scale = token == 3 ? std::ldexp(1.0f, -124) : 1.0f;
  const int32_t code = static_cast<int32_t>((key * 2654435761u) >> 16) - 32768;
  return static_cast<float>(code) / 4096.0f * scale;
}

uint32_t StreamCrc(const std::vector<uint8_t>& stream) {  // the stream's own trailer excluded
  return Crc32c(0, stream.data(), stream.size() - 4);
}

void PutHashedRows(Cache* cache, const std::vector<int32_t>& tokens, uint32_t salt) {
  constexpr int kDim = 32, kHeads = 2;
  const size_t n = tokens.size();
  std::vector<float> k(kDim * kHeads * n), v(k.size());
  for (size_t t = 0; t < n; ++t) {
    for (size_t e = 0; e < kDim * kHeads; ++e) {
      const uint32_t key = static_cast<uint32_t>(tokens[t] * 1000 + e) * 2 + salt;
      k[t * kDim * kHeads + e] = PinnedValue(key, tokens[t]);
      v[t * kDim * kHeads + e] = PinnedValue(key + 7919, tokens[t]);
    }
  }
  const int64_t ni = static_cast<int64_t>(n);
  ASSERT_TRUE(cache
                  ->Put(MakeView(k.data(), DType::kF32, {kDim, kHeads, ni}),
                        MakeView(v.data(), DType::kF32, {kDim, kHeads, ni}))
                  .ok());
}

TEST(PersistenceFormat, TheSameBytesOnEveryMachineAndTarget) {
  struct Want {
    DType dtype;
    size_t whole_bytes;
    uint32_t whole_crc;
    size_t seq_bytes;
    uint32_t seq_crc;
  };
  const Want wants[] = {
      {DType::kF32, 7388, 0x2B805377, 3204, 0xDC6FCEB7},
      {DType::kF16, 3804, 0xEFC9613D, 1668, 0x5EBD2032},
      {DType::kBF16, 3804, 0x26FBCF0D, 1668, 0x15EE7F8D},
      {DType::kQ8_0, 2124, 0x48809A9C, 948, 0x0FB3A7A8},
      {DType::kQ4_0, 1228, 0x9B24F3A1, 564, 0x20B97241},
  };
  for (const int64_t target : kernels::DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (const Want& want : wants) {
      SCOPED_TRACE(std::string(DTypeName(want.dtype)) + " " + hwy::TargetName(target));
      auto cache = NewCausalCache();
      ASSERT_TRUE(cache->Init(want.dtype, 2, 16, 4).ok());
      // Two sequences, interleaved: tokens are numbered across both (token 3 is the tiny one).
      const std::vector<std::vector<int32_t>> pos = {{0, 1, 2, 0}, {3, 1, 2}};
      const std::vector<std::vector<int32_t>> seq = {{0, 0, 0, 1}, {0, 1, 1}};
      const std::vector<std::vector<int32_t>> tokens = {{0, 1, 2, 4}, {3, 5, 6}};
      for (size_t b = 0; b < pos.size(); ++b) {
        Batch batch;
        batch.positions = pos[b];
        batch.sequences = seq[b];
        ASSERT_TRUE(cache->StartForward(batch, false).ok());
        for (int layer = 0; layer < 2; ++layer) {
          cache->SetLayer(layer);
          PutHashedRows(cache.get(), tokens[b], static_cast<uint32_t>(layer));
        }
      }
      std::vector<uint8_t> whole, one;
      ASSERT_TRUE(SaveCache(*cache, &whole).ok());
      ASSERT_TRUE(SaveCache(*cache, &one, 1).ok());
      EXPECT_EQ(whole.size(), want.whole_bytes);
      EXPECT_EQ(StreamCrc(whole), want.whole_crc);
      EXPECT_EQ(one.size(), want.seq_bytes);
      EXPECT_EQ(StreamCrc(one), want.seq_crc);
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// The same for the growing cache (SaveSequenceCache), per dtype: 6 tokens of 2 heads x 32, in one
// Update, token 3 the tiny one. Its rows reach the stream by other code than the causal family's.
TEST(PersistenceFormat, SequenceCacheStreamsAreTheSameBytesEverywhere) {
  const std::pair<DType, uint32_t> wants[] = {
      {DType::kF32, 0xD4B60364},  {DType::kF16, 0x649663F7},  {DType::kBF16, 0xDAD8D3E8},
      {DType::kQ8_0, 0xF0E50A16}, {DType::kQ4_0, 0x072AA39E},
  };
  constexpr int kDim = 32, kTokens = 6, kHeads = 2;
  std::vector<float> k(kDim * kTokens * kHeads), v(k.size());
  for (int h = 0; h < kHeads; ++h) {
    for (int t = 0; t < kTokens; ++t) {
      for (int d = 0; d < kDim; ++d) {
        const size_t i = (static_cast<size_t>(h) * kTokens + t) * kDim + d;  // [dim, token, head]
        const uint32_t key = static_cast<uint32_t>((t * 1000 + h * kDim + d) * 2);
        k[i] = PinnedValue(key, t);
        v[i] = PinnedValue(key + 7919, t);
      }
    }
  }
  for (const int64_t target : kernels::DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (const auto& [dtype, want_crc] : wants) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " " + hwy::TargetName(target));
      auto cache = NewKVCache(dtype);
      TensorView ko, vo;
      ASSERT_TRUE(cache
                      ->Update(MakeView(k.data(), DType::kF32, {kDim, kTokens, kHeads, 1}),
                               MakeView(v.data(), DType::kF32, {kDim, kTokens, kHeads, 1}), kTokens,
                               &ko, &vo)
                      .ok());
      std::vector<uint8_t> stream;
      ASSERT_TRUE(SaveSequenceCache(*cache, &stream).ok());
      EXPECT_EQ(StreamCrc(stream), want_crc);
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// And for the encoder, which stores K/V in the float dtype each Put gave: three layers of f32,
// f16 and bf16 K and V in three pairings, 2 heads x 32 x 3 image tokens each.
TEST(PersistenceFormat, EncoderStreamsAreTheSameBytesEverywhere) {
  constexpr int kDim = 32, kHeads = 2, kImage = 3, kN = kDim * kHeads * kImage;
  const DType pairs[3][2] = {
      {DType::kF32, DType::kF16}, {DType::kF16, DType::kBF16}, {DType::kBF16, DType::kF32}};
  auto cache = NewEncoderCache();
  ASSERT_TRUE(cache->Init(DType::kF16, 1, 16, 4).ok());
  const int32_t pos[1] = {0}, seq[1] = {0}, multimodal[1] = {0};
  ASSERT_TRUE(cache->StartForward(Batch{pos, seq, multimodal}, false).ok());
  std::vector<uint8_t> k(kN * 4), v(kN * 4);  // room for f32
  for (int layer = 0; layer < 3; ++layer) {
    for (int side = 0; side < 2; ++side) {
      const DType dtype = pairs[layer][side];
      std::vector<uint8_t>& bytes = side == 0 ? k : v;
      for (int i = 0; i < kN; ++i) {
        const int32_t token = i / (kDim * kHeads);
        const float x = PinnedValue(static_cast<uint32_t>((layer * 1000 + i) * 2 + side), token);
        StoreFromF32(bytes.data(), dtype, i, x);
      }
    }
    cache->SetLayer(layer);
    ASSERT_TRUE(cache
                    ->Put(MakeView(k.data(), pairs[layer][0], {kDim, kHeads, kImage}),
                          MakeView(v.data(), pairs[layer][1], {kDim, kHeads, kImage}))
                    .ok());
  }
  std::vector<uint8_t> stream;
  ASSERT_TRUE(SaveCache(*cache, &stream).ok());
  EXPECT_EQ(stream.size(), 3336u);
  EXPECT_EQ(StreamCrc(stream), 0xBA1D3B39u);
}

// ---- one sequence
// -----------------------------------------------------------------------------------

TEST(PersistenceSequence, IntoAFreshCacheUnderAnotherId) {
  for (const CacheKind& kind : AllCacheKinds()) {
    for (DType dtype : kAllDTypes) {
      SCOPED_TRACE(std::string(kind.name) + " " + DTypeName(dtype));
      Driver d;
      auto a = MakeInit(kind, dtype);
      Fill(d, a.get());
      std::vector<uint8_t> bytes;
      ASSERT_TRUE(SaveCache(*a, &bytes, 1).ok());
      auto b = MakeInit(kind, dtype, 3, 48, 8);  // another sequence count is fine
      const Status s = LoadCache(bytes, b.get(), 2);
      ASSERT_TRUE(s.ok()) << s.message();
      ASSERT_TRUE(b->CheckConsistency().ok());
      EXPECT_TRUE(b->CanResume(2, 9));
      // Sequence 1 of a continues as sequence 2 of b. The visible cells are the same, in the
      // same order; their physical offsets differ, so sums may round differently.
      ExpectSameFuture(d, a.get(), b.get(), 8, /*exact=*/false, 1, 2, 9);
    }
  }
}

TEST(PersistenceSequence, IntoACacheHoldingOthersLeavesThemAlone) {
  Driver d;
  const CacheKind kind = AllCacheKinds()[0];
  auto a = MakeInit(kind, DType::kF32);
  Fill(d, a.get());
  std::vector<uint8_t> seq0;
  ASSERT_TRUE(SaveCache(*a, &seq0, 0).ok());
  auto b = MakeInit(kind, DType::kF32);
  ASSERT_TRUE(d.Prefill(b.get(), 1, 0, 6).ok());
  ASSERT_TRUE(d.Prefill(b.get(), 0, 0, 3).ok());  // replaced by the load
  std::vector<uint8_t> b1_before;
  ASSERT_TRUE(SaveCache(*b, &b1_before, 1).ok());
  ASSERT_TRUE(LoadCache(seq0, b.get()).ok());  // -1: the saved id, 0
  ASSERT_TRUE(b->CheckConsistency().ok());
  std::vector<uint8_t> b1_after, b0_after;
  ASSERT_TRUE(SaveCache(*b, &b1_after, 1).ok());
  EXPECT_EQ(b1_before, b1_after);
  ASSERT_TRUE(SaveCache(*b, &b0_after, 0).ok());
  // Same positions and rows as saved; the informative source cell indices differ.
  auto b0 = MakeInit(kind, DType::kF32);
  ASSERT_TRUE(LoadCache(b0_after, b0.get()).ok());
  ExpectSameFuture(d, a.get(), b.get(), 5, false, 0, 0, 13);
}

TEST(PersistenceSequence, CacheFullChangesNothing) {
  Driver d;
  const CacheKind kind = AllCacheKinds()[0];
  auto a = MakeInit(kind, DType::kF32, 1, 20, 8);
  ASSERT_TRUE(d.Prefill(a.get(), 0, 0, 8).ok());
  ASSERT_TRUE(d.Prefill(a.get(), 0, 8, 8).ok());
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes, 0).ok());
  auto b = MakeInit(kind, DType::kF32, 2, 10, 8);  // 20 cells
  ASSERT_TRUE(d.Prefill(b.get(), 1, 0, 8).ok());
  const auto before = Fingerprint(*b);
  EXPECT_EQ(LoadCache(bytes, b.get(), 0).code(), Code::kCacheFull);  // 16 needed, 12 free
  EXPECT_EQ(Fingerprint(*b), before);
  // Into sequence 1 itself: its own 8 cells count as free.
  EXPECT_TRUE(LoadCache(bytes, b.get(), 1).ok());
  EXPECT_TRUE(b->CheckConsistency().ok());
}

// ---- failures leave the target unchanged
// -----------------------------------------------------------

class PersistenceFailure : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = MakeInit(AllCacheKinds()[0], DType::kQ8_0);
    Fill(d_, src_.get());
    ASSERT_TRUE(SaveCache(*src_, &bytes_).ok());
    target_ = MakeInit(AllCacheKinds()[0], DType::kQ8_0);
    ASSERT_TRUE(d_.Prefill(target_.get(), 1, 0, 3).ok());
    before_ = Fingerprint(*target_);
  }
  void ExpectUnchanged() { EXPECT_EQ(Fingerprint(*target_), before_); }
  Driver d_;
  std::unique_ptr<CausalCache> src_, target_;
  std::vector<uint8_t> bytes_, before_;
};

// Offsets of the causal body (persistence.h).
constexpr size_t kDType = 24, kWindow = 28, kCapacity = 48, kCells = 56, kSavedSeq = 60,
                 kLayers = 64, kLayer0 = 68, kCellCount = 68 + 2 * 16, kCell0 = kCellCount + 4;

TEST_F(PersistenceFailure, OtherShapeDTypeOrKind) {
  auto other_dtype = MakeInit(AllCacheKinds()[0], DType::kF16);
  EXPECT_EQ(LoadCache(bytes_, other_dtype.get()).code(), Code::kInvalidArgument);
  auto other_cap = MakeInit(AllCacheKinds()[0], DType::kQ8_0, 2, 40);
  EXPECT_EQ(LoadCache(bytes_, other_cap.get()).code(), Code::kInvalidArgument);
  auto other_kind = MakeInit(AllCacheKinds()[1], DType::kQ8_0);
  EXPECT_EQ(LoadCache(bytes_, other_kind.get()).code(), Code::kInvalidArgument);
  // The checksum comes before the kind: a damaged stream reads as damaged whatever its target.
  auto encoder = NewEncoderCache();
  ASSERT_TRUE(encoder->Init(DType::kQ8_0, 1, 16, 4).ok());
  std::vector<uint8_t> damaged = bytes_;
  damaged[12] ^= 0x02;  // kind 1 (causal) reads 3 (wrapper)
  EXPECT_EQ(LoadCache(damaged, encoder.get()).code(), Code::kCorrupt);
  EXPECT_EQ(LoadCache(damaged, target_.get()).code(), Code::kCorrupt);
  damaged = bytes_;
  damaged[bytes_.size() / 2] ^= 0x40;
  EXPECT_EQ(LoadCache(damaged, encoder.get()).code(), Code::kCorrupt);
  EXPECT_EQ(LoadCache(bytes_, target_.get(), 0).code(), Code::kInvalidArgument);  // whole + seq
  // Layer shapes: the target's layer 0 already holds another head_dim.
  auto other_heads = MakeInit(AllCacheKinds()[0], DType::kQ8_0);
  Driver wide;
  wide.dk = 64;
  wide.Resize();
  ASSERT_TRUE(wide.Prefill(other_heads.get(), 0, 0, 2).ok());
  const auto fp = Fingerprint(*other_heads);
  const Status s = LoadCache(bytes_, other_heads.get());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_STRNE(s.message(), "");
  EXPECT_EQ(Fingerprint(*other_heads), fp);
  auto uninit = AllCacheKinds()[0].make();
  EXPECT_EQ(LoadCache(bytes_, uninit.get()).code(), Code::kInvalidArgument);
  EXPECT_EQ(SaveCache(*uninit, &bytes_).code(), Code::kInvalidArgument);
  EXPECT_EQ(SaveCache(*src_, &bytes_, 2).code(), Code::kInvalidArgument);
  ExpectUnchanged();
}

TEST_F(PersistenceFailure, EveryTruncationIsCorrupt) {
  for (size_t n = 0; n < bytes_.size(); n += (n < 512 ? 1 : 97)) {
    const Status s = LoadCache(std::span<const uint8_t>(bytes_.data(), n), target_.get());
    ASSERT_EQ(s.code(), Code::kCorrupt) << n;
  }
  std::vector<uint8_t> longer = bytes_;
  longer.push_back(0);
  EXPECT_EQ(LoadCache(longer, target_.get()).code(), Code::kCorrupt);
  ExpectUnchanged();
}

TEST_F(PersistenceFailure, EveryFlippedByteIsRejected) {
  std::vector<uint8_t> b = bytes_;
  for (size_t i = 0; i < b.size(); i += (i < 1024 ? 1 : 13)) {
    b[i] ^= 0x10;
    const Status s = LoadCache(b, target_.get());
    ASSERT_FALSE(s.ok()) << i;
    b[i] ^= 0x10;
  }
  ExpectUnchanged();
  EXPECT_TRUE(LoadCache(b, target_.get()).ok());
}

TEST_F(PersistenceFailure, HostileFieldsBehindAValidChecksum) {
  struct Edit {
    size_t off;
    uint32_t value;
    Code code;
  };
  const Edit edits[] = {
      {kDType, 9, Code::kCorrupt},               // no such dtype
      {kWindow, 0, Code::kCorrupt},              // window 0
      {kCapacity, 40, Code::kInvalidArgument},   // a consistent other shape
      {kCells, 0x7FFFFFFF, Code::kCorrupt},      // cells beyond the limit
      {kSavedSeq, 5, Code::kCorrupt},            // sequence beyond max_sequences
      {kLayers, 100000, Code::kCorrupt},         // too many layers
      {kLayers, 3, Code::kCorrupt},              // records then misparse
      {kLayer0 + 4, 0x7FFFFFF, Code::kCorrupt},  // huge head_dim: rows past the end
      {kLayer0 + 12, 65536, Code::kCorrupt},     // many heads: byte count overflows the span
      {kLayer0 + 4, 33, Code::kCorrupt},         // not a multiple of 32 for q8_0
      {kCellCount, 0xFFFFFFFF, Code::kCorrupt},  // more cells than the cache
      {kCellCount, 3, Code::kCorrupt},           // fewer cells: rows misparse
      {kCell0, 0xFFFFFFFF, Code::kCorrupt},      // negative cell
      {kCell0, 1000, Code::kCorrupt},            // cell out of range
      {kCell0 + 8, 0, Code::kCorrupt},           // duplicate cell 0
      {12, 2, Code::kInvalidArgument},           // a sequence-cache stream
      {8, 2, Code::kNotSupported},               // a newer version
  };
  for (const Edit& e : edits) {
    std::vector<uint8_t> b = bytes_;
    StoreLittleEndian(&b, e.off, e.value, 4);
    ResealStream(&b);
    const Status s = LoadCache(b, target_.get());
    EXPECT_EQ(s.code(), e.code) << "offset " << e.off << " value " << e.value << ": "
                                << s.message();
  }
  // Sequence bits: none, or a sequence beyond max_sequences.
  const uint32_t n = bytes_[kCellCount];
  const size_t bits0 = kCell0 + 8 * n;
  for (uint32_t v : {0u, 4u}) {
    std::vector<uint8_t> b = bytes_;
    StoreLittleEndian(&b, bits0, v, 4);
    ResealStream(&b);
    EXPECT_EQ(LoadCache(b, target_.get()).code(), Code::kCorrupt) << v;
  }
  ExpectUnchanged();
}

TEST_F(PersistenceFailure, RandomMutationsNeverBreakTheTarget) {
  // Resealed random edits: the load either fails (target unchanged) or succeeds with a table that
  // satisfies every invariant. Under ASan this also shows the reader stays in bounds.
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> b = bytes_;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = 24 + rng() % (std::min<size_t>(b.size() - 28, 400));
      b[at] = static_cast<uint8_t>(rng());
    }
    if (rng() % 8 == 0) b.resize(24 + rng() % (b.size() - 24));
    if (b.size() >= 28) ResealStream(&b);
    auto t = MakeInit(AllCacheKinds()[0], DType::kQ8_0);
    ASSERT_TRUE(d_.Prefill(t.get(), 1, 0, 3).ok());
    const Status s = LoadCache(b, t.get());
    if (s.ok()) {
      ASSERT_TRUE(t->CheckConsistency().ok()) << iter;
    } else {
      ASSERT_EQ(Fingerprint(*t), before_) << iter;
    }
  }
}

// ---- files
// -----------------------------------------------------------------------------------------

std::string TempPath(const char* name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/kvcache_persist_" + std::to_string(::getpid()) + "_" +
         name;
}

bool Exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

TEST(PersistenceFile, RoundTripAndAtomicReplace) {
  Driver d;
  const CacheKind kind = AllCacheKinds()[2];
  auto a = MakeInit(kind, DType::kBF16);
  Fill(d, a.get());
  const std::string path = TempPath("cache.kv");
  ASSERT_TRUE(SaveCacheFile(*a, path.c_str()).ok());
  EXPECT_FALSE(Exists(path + ".tmp"));
  std::vector<uint8_t> first;
  ASSERT_TRUE(SaveCache(*a, &first).ok());

  // A crash mid-save leaves a partial .tmp behind: the previous file is intact and loads.
  FILE* f = std::fopen((path + ".tmp").c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(first.data(), 1, first.size() / 2, f);
  std::fclose(f);
  auto b = MakeInit(kind, DType::kBF16);
  ASSERT_TRUE(LoadCacheFile(path.c_str(), b.get()).ok());
  EXPECT_EQ(Fingerprint(*a, false), Fingerprint(*b, false));
  // A failed save (uninitialized cache) writes nothing.
  auto uninit = kind.make();
  EXPECT_FALSE(SaveCacheFile(*uninit, path.c_str()).ok());
  // The next save replaces the file and the stale .tmp.
  ASSERT_TRUE(d.Tokens(a.get(), {{0, 13}}).ok());
  ASSERT_TRUE(SaveCacheFile(*a, path.c_str(), 0).ok());
  EXPECT_FALSE(Exists(path + ".tmp"));
  auto c = MakeInit(kind, DType::kBF16);
  ASSERT_TRUE(LoadCacheFile(path.c_str(), c.get()).ok());
  ExpectSameFuture(d, a.get(), c.get(), 4, false, 0, 0, 14);

  // A truncated file is kCorrupt and changes nothing.
  f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(::ftruncate(fileno(f), 100), 0);
  std::fclose(f);
  const auto fp = Fingerprint(*c);
  EXPECT_EQ(LoadCacheFile(path.c_str(), c.get()).code(), Code::kCorrupt);
  EXPECT_EQ(Fingerprint(*c), fp);
  EXPECT_EQ(LoadCacheFile((path + ".missing").c_str(), c.get()).code(), Code::kInvalidArgument);
  std::remove(path.c_str());
}

// ---- encoder caches
// --------------------------------------------------------------------------------

constexpr int kEncLayers = 2, kEncD = 8, kEncH = 2, kEncQ = 4;

std::unique_ptr<EncoderCache> MakeEncoder(bool per_seq, bool permuted, int seqs = 3,
                                          DType dtype = DType::kF32) {
  EncoderOptions o;
  o.per_sequence = per_seq;
  auto c = NewEncoderCache(o);
  CacheConfig cfg;
  cfg.permuted_v = permuted;
  EXPECT_TRUE(c->SetConfig(cfg).ok());
  EXPECT_TRUE(c->Init(dtype, seqs, 64, 8).ok());
  return c;
}

// K/V [kEncD, kEncH, tokens] in `dtype`, from hash values of (seed, layer).
std::vector<uint8_t> EncRows(DType dtype, int tokens, int seed, int layer) {
  const int64_t n = int64_t{kEncD} * kEncH * tokens;
  std::vector<float> f(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) f[i] = testing::HashValue(seed, layer, static_cast<uint64_t>(i));
  std::vector<uint8_t> out(static_cast<size_t>(n) * BlockBytes(dtype));
  kernels::ConvertRow(f.data(), DType::kF32, out.data(), dtype, n);
  return out;
}

Status EncStart(Cache* c, int seq, int32_t pos, bool image, bool reserve = false) {
  const int32_t positions[1] = {pos}, sequences[1] = {seq}, mm[1] = {0};
  Batch b;
  b.positions = positions;
  b.sequences = sequences;
  if (image) b.multimodal = mm;
  return c->StartForward(b, reserve);
}

// Puts an image of `tokens` tokens into every layer of the slot the last StartForward selected.
Status EncPut(Cache* c, DType dtype, int tokens, int seed) {
  for (int l = 0; l < kEncLayers; ++l) {
    std::vector<uint8_t> k = EncRows(dtype, tokens, seed, l),
                         v = EncRows(dtype, tokens, seed + 50, l);
    c->SetLayer(l);
    KV_RETURN_IF_ERROR(c->Put(MakeView(k.data(), dtype, {kEncD, kEncH, tokens}),
                              MakeView(v.data(), dtype, {kEncD, kEncH, tokens})));
  }
  return Status::Ok();
}

// Cross-attention of a fixed query over every layer of the current slot; a layer without
// contents adds a marker.
Status EncAttend(Cache* c, std::vector<float>* out) {
  out->clear();
  std::vector<float> q(kEncD * kEncQ), o(kEncD * kEncQ);
  for (size_t i = 0; i < q.size(); ++i) q[i] = testing::HashValue(7, 7, i);
  for (int l = 0; l < kEncLayers; ++l) {
    c->SetLayer(l);
    const History h = c->Get();
    if (h.k.data == nullptr) {
      out->push_back(-12345.0f);
      continue;
    }
    TensorView qv = MakeView(q.data(), DType::kF32, {kEncD, 1, kEncQ});
    TensorView ov = MakeView(o.data(), DType::kF32, {kEncD, 1, kEncQ});
    KV_RETURN_IF_ERROR(Attend(qv, h, AttentionParams(), &ov));
    out->insert(out->end(), o.begin(), o.end());
  }
  return Status::Ok();
}

// Sequence 0: an image at position 5. Per sequence: sequence 1 another (larger) image at 7,
// sequence 2 only a reserve pass (storage sized, not cached). Shared: a later image from
// sequence 1 at 9 replaces it, then a multimodal token at 12 is recorded without a Put.
void FillEncoder(EncoderCache* c, bool per_seq, DType dtype) {
  ASSERT_TRUE(EncStart(c, 0, 5, true).ok());
  ASSERT_TRUE(EncPut(c, dtype, 3, 1).ok());
  ASSERT_TRUE(EncStart(c, 1, per_seq ? 7 : 9, true).ok());
  ASSERT_TRUE(EncPut(c, dtype, 5, 2).ok());
  if (per_seq) {
    ASSERT_TRUE(EncStart(c, 2, 0, false, /*reserve=*/true).ok());
    ASSERT_TRUE(EncPut(c, dtype, 4, 3).ok());
  } else {
    ASSERT_TRUE(EncStart(c, 0, 12, true).ok());
  }
}

// Both caches: the same cached flags and bit-identical cross-attention for every sequence.
void ExpectSameEncoders(EncoderCache* a, EncoderCache* b, int seqs) {
  for (int s = 0; s < seqs; ++s) {
    ASSERT_TRUE(EncStart(a, s, 30, false).ok());
    ASSERT_TRUE(EncStart(b, s, 30, false).ok());
    EXPECT_EQ(a->EncoderCached(), b->EncoderCached()) << s;
    std::vector<float> oa, ob;
    ASSERT_TRUE(EncAttend(a, &oa).ok());
    ASSERT_TRUE(EncAttend(b, &ob).ok());
    ASSERT_EQ(oa.size(), ob.size()) << s;
    EXPECT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)), 0) << s;
  }
}

TEST(PersistenceEncoder, RoundTripEveryModeDTypeAndVLayoutContinuesIdentically) {
  for (bool per_seq : {false, true}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (bool permuted : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "per_seq " << per_seq << " " << DTypeName(dtype)
                                          << " permuted " << permuted);
        auto a = MakeEncoder(per_seq, permuted);
        FillEncoder(a.get(), per_seq, dtype);
        std::vector<uint8_t> bytes;
        ASSERT_TRUE(SaveCache(*a, &bytes).ok());
        auto b = MakeEncoder(per_seq, permuted);
        const Status s = LoadCache(bytes, b.get());
        ASSERT_TRUE(s.ok()) << s.message();
        std::vector<uint8_t> again;
        ASSERT_TRUE(SaveCache(*b, &again).ok());
        EXPECT_EQ(again, bytes);  // flags, positions, shapes, dtypes and rows all survived
        ExpectSameEncoders(a.get(), b.get(), 3);
        if (per_seq) {
          ASSERT_TRUE(EncStart(b.get(), 2, 1, false).ok());
          EXPECT_FALSE(b->EncoderCached());  // the reserve pass cached nothing
          b->SetLayer(0);
          EXPECT_EQ(b->Get().k.data, nullptr);  // data null until cached (SEMANTICS.md §9)
          EXPECT_GT(b->Get().k.ne[2], 1);       // but its storage and view's shape came back
          ASSERT_TRUE(EncStart(a.get(), 2, 1, false).ok());
        } else {
          // The recorded-but-unused position 12 survived: a Put without a multimodal token
          // caches at 12 in both.
          ASSERT_TRUE(EncStart(a.get(), 0, 13, false).ok());
          ASSERT_TRUE(EncStart(b.get(), 0, 13, false).ok());
          ASSERT_TRUE(EncPut(a.get(), dtype, 2, 4).ok());
          ASSERT_TRUE(EncPut(b.get(), dtype, 2, 4).ok());
          ASSERT_TRUE(a->Remove(0, 12, 13).ok());
          ASSERT_TRUE(b->Remove(0, 12, 13).ok());
          EXPECT_FALSE(b->EncoderCached());
        }
        // The position of sequence 0's image (5, per sequence) survived: Remove covers it.
        ASSERT_TRUE(a->Remove(0, 5, 6).ok());
        ASSERT_TRUE(b->Remove(0, 5, 6).ok());
        ASSERT_TRUE(EncStart(b.get(), 0, 40, false).ok());
        EXPECT_FALSE(b->EncoderCached());
        // Continue: a larger image arrives in both.
        ASSERT_TRUE(EncStart(a.get(), 0, 41, true).ok());
        ASSERT_TRUE(EncStart(b.get(), 0, 41, true).ok());
        ASSERT_TRUE(EncPut(a.get(), dtype, 7, 9).ok());
        ASSERT_TRUE(EncPut(b.get(), dtype, 7, 9).ok());
        ExpectSameEncoders(a.get(), b.get(), 3);
        // Loading over a used cache (b now differs from the stream) restores the saved state.
        ASSERT_TRUE(LoadCache(bytes, b.get()).ok());
        ASSERT_TRUE(SaveCache(*b, &again).ok());
        EXPECT_EQ(again, bytes);
      }
    }
  }
}

TEST(PersistenceEncoder, OneSequence) {
  // Per sequence: sequence 1's block goes into sequence 2 of another cache; the others stay.
  auto a = MakeEncoder(true, false);
  FillEncoder(a.get(), true, DType::kF16);
  std::vector<uint8_t> one;
  ASSERT_TRUE(SaveCache(*a, &one, 1).ok());
  auto b = MakeEncoder(true, false, 4);
  ASSERT_TRUE(EncStart(b.get(), 0, 2, true).ok());
  ASSERT_TRUE(EncPut(b.get(), DType::kF16, 6, 8).ok());
  std::vector<float> b0_before, b0_after, a1, b2;
  ASSERT_TRUE(EncAttend(b.get(), &b0_before).ok());
  ASSERT_TRUE(LoadCache(one, b.get(), 2).ok());
  ASSERT_TRUE(EncStart(b.get(), 0, 3, false).ok());
  EXPECT_TRUE(b->EncoderCached());
  ASSERT_TRUE(EncAttend(b.get(), &b0_after).ok());
  EXPECT_EQ(b0_before, b0_after);
  ASSERT_TRUE(EncStart(b.get(), 2, 8, false).ok());
  EXPECT_TRUE(b->EncoderCached());
  ASSERT_TRUE(EncAttend(b.get(), &b2).ok());
  ASSERT_TRUE(EncStart(a.get(), 1, 8, false).ok());
  ASSERT_TRUE(EncAttend(a.get(), &a1).ok());
  EXPECT_EQ(std::memcmp(a1.data(), b2.data(), a1.size() * sizeof(float)), 0);
  ASSERT_TRUE(b->Remove(2, 7, 8).ok());  // position 7 came along
  EXPECT_FALSE(b->EncoderCached());
  // seq -1: back into the id it was saved from.
  ASSERT_TRUE(LoadCache(one, b.get()).ok());
  ASSERT_TRUE(EncStart(b.get(), 1, 8, false).ok());
  EXPECT_TRUE(b->EncoderCached());
  EXPECT_EQ(LoadCache(one, b.get(), 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(SaveCache(*a, &one, 3).code(), Code::kInvalidArgument);

  // Shared: any sequence names the one block; loading it replaces the block every sequence reads.
  auto s = MakeEncoder(false, true);
  FillEncoder(s.get(), false, DType::kBF16);
  std::vector<uint8_t> shared, whole;
  ASSERT_TRUE(SaveCache(*s, &shared, 2).ok());
  ASSERT_TRUE(SaveCache(*s, &whole).ok());
  auto t = MakeEncoder(false, true, 5);  // another sequence count is fine for one sequence
  ASSERT_TRUE(LoadCache(shared, t.get(), 4).ok());
  ExpectSameEncoders(s.get(), t.get(), 3);
  EXPECT_EQ(LoadCache(whole, t.get()).code(), Code::kInvalidArgument);     // 3 vs 5 sequences
  EXPECT_EQ(LoadCache(whole, s.get(), 1).code(), Code::kInvalidArgument);  // whole + seq
}

// A test allocator that fails once its budget of allocations is spent.
struct Budget {
  int left = 1 << 30;
};
ArenaAllocator BudgetAllocator(Budget* b) {
  ArenaAllocator a;
  a.ctx = b;
  a.allocate = [](size_t bytes, void* ctx) -> void* {
    Budget* bb = static_cast<Budget*>(ctx);
    if (bb->left <= 0) return nullptr;
    --bb->left;
    return std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  };
  a.release = [](void* p, void*) { std::free(p); };
  return a;
}

TEST(PersistenceEncoder, FailuresLeaveTheTargetUnchanged) {
  auto src = MakeEncoder(true, false);
  FillEncoder(src.get(), true, DType::kF32);
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*src, &bytes).ok());
  // The target holds a smaller image in sequence 0 only: loading would have to allocate.
  Budget budget;
  auto make_target = [&] {
    EncoderOptions o;
    o.per_sequence = true;
    auto t = NewEncoderCache(o);
    EXPECT_TRUE(t->SetAllocator(BudgetAllocator(&budget)).ok());
    EXPECT_TRUE(t->Init(DType::kF32, 3, 64, 8).ok());
    EXPECT_TRUE(EncStart(t.get(), 0, 1, true).ok());
    EXPECT_TRUE(EncPut(t.get(), DType::kF32, 2, 5).ok());
    return t;
  };
  auto target = make_target();
  const std::vector<uint8_t> before = Fingerprint(*target);
  auto unchanged = [&] { EXPECT_EQ(Fingerprint(*target), before); };

  // Other configurations.
  EXPECT_EQ(LoadCache(bytes, MakeEncoder(true, false, 3, DType::kF16).get()).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(LoadCache(bytes, MakeEncoder(true, true).get()).code(), Code::kInvalidArgument);
  EXPECT_EQ(LoadCache(bytes, MakeEncoder(false, false).get()).code(), Code::kInvalidArgument);
  EXPECT_EQ(LoadCache(bytes, MakeEncoder(true, false, 4).get()).code(), Code::kInvalidArgument);
  EXPECT_EQ(LoadCache(bytes, MakeInit(AllCacheKinds()[0], DType::kF32).get()).code(),
            Code::kInvalidArgument);  // an encoder stream into a causal cache
  auto uninit = NewEncoderCache();
  EXPECT_EQ(LoadCache(bytes, uninit.get()).code(), Code::kInvalidArgument);
  std::vector<uint8_t> none;
  EXPECT_EQ(SaveCache(*uninit, &none).code(), Code::kInvalidArgument);
  EXPECT_EQ(LoadCache(bytes, target.get(), 0).code(), Code::kInvalidArgument);

  // Out of memory, at the first and at a later allocation.
  for (int left : {0, 1}) {
    budget.left = left;
    EXPECT_EQ(LoadCache(bytes, target.get()).code(), Code::kOutOfMemory) << left;
    unchanged();
  }
  budget.left = 1 << 30;

  for (size_t n = 0; n < bytes.size(); ++n) {
    ASSERT_EQ(LoadCache(std::span<const uint8_t>(bytes.data(), n), target.get()).code(),
              Code::kCorrupt)
        << n;
  }
  std::vector<uint8_t> b = bytes;
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] ^= 0x04;
    ASSERT_FALSE(LoadCache(b, target.get()).ok()) << i;
    b[i] ^= 0x04;
  }
  unchanged();

  // Hostile fields behind a valid checksum. Offsets: dtype 24, per_sequence 25, permuted_v 26,
  // zero 27, max_sequences 28, saved sequence 32, slots 36; slot 0 at 40: cached 40, pos 44,
  // cur_pos 48, layers 52; layer 0 at 56: present, k dtype, v dtype, zero, then k ne[4] at 60 and
  // v ne[4] at 92 (i64 each), K rows at 124.
  struct Edit {
    size_t off;
    int bytes;
    uint64_t value;
    Code code;
  };
  const Edit edits[] = {
      {24, 1, 9, Code::kCorrupt},                            // no such dtype
      {25, 1, 2, Code::kCorrupt},                            // per_sequence flag 2
      {27, 1, 1, Code::kCorrupt},                            // reserved byte
      {28, 4, 0, Code::kCorrupt},                            // no sequences
      {28, 4, 0x7FFFFFFF, Code::kCorrupt},                   // slot count disagrees
      {28, 4, 4, Code::kCorrupt},                            // slot count disagrees
      {32, 4, 3, Code::kCorrupt},                            // saved sequence beyond max_sequences
      {32, 4, 0xFFFFFFFE, Code::kCorrupt},                   // saved sequence -2
      {36, 4, 0x7FFFFFFF, Code::kCorrupt},                   // slots beyond the bytes
      {40, 1, 2, Code::kCorrupt},                            // cached flag 2
      {52, 4, 100000, Code::kCorrupt},                       // too many layers
      {52, 4, 0xFFFFFFFF, Code::kCorrupt},                   // negative layer count
      {52, 4, 5, Code::kCorrupt},                            // records then misparse
      {56, 1, 0, Code::kCorrupt},                            // absent layer with dtypes: misparse
      {56, 1, 2, Code::kCorrupt},                            // present flag 2
      {57, 1, 3, Code::kCorrupt},                            // q8_0 is not an input dtype
      {58, 1, 200, Code::kCorrupt},                          // no such dtype
      {60, 8, 0, Code::kCorrupt},                            // empty dimension
      {60, 8, ~uint64_t{0}, Code::kCorrupt},                 // negative dimension
      {60, 8, uint64_t{1} << 62, Code::kCorrupt},            // byte count overflows
      {60, 8, (uint64_t{1} << 32) + kEncD, Code::kCorrupt},  // kEncD in a 32-bit size_t
      {68, 8, uint64_t{1} << 40, Code::kCorrupt},            // rows past the end
      {60, 8, kEncD + 1, Code::kCorrupt},                    // rows misparse
      {92, 8, kEncD - 1, Code::kCorrupt},                    // rows misparse
      {26, 1, 1, Code::kInvalidArgument},                    // a permuted-V cache's stream
      {12, 4, 1, Code::kInvalidArgument},                    // a causal stream
      {8, 4, 2, Code::kNotSupported},                        // a newer version
  };
  for (const Edit& e : edits) {
    std::vector<uint8_t> h = bytes;
    for (int i = 0; i < e.bytes; ++i) h[e.off + i] = static_cast<uint8_t>(e.value >> (8 * i));
    ResealStream(&h);
    const Status s = LoadCache(h, target.get());
    EXPECT_EQ(s.code(), e.code) << "offset " << e.off << ": " << s.message();
    EXPECT_STRNE(s.message(), "");
  }
  unchanged();

  // Random resealed mutations: either a failure with the target unchanged, or a load whose state
  // re-saves and loads again (under ASan: never out of bounds).
  std::mt19937 rng(99);
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<uint8_t> m = bytes;
    const int n_edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < n_edits; ++e)
      m[24 + rng() % (std::min<size_t>(m.size() - 28, 200))] = rng();
    if (rng() % 8 == 0) m.resize(24 + rng() % (m.size() - 24));
    if (m.size() >= 28) ResealStream(&m);
    const Status s = LoadCache(m, target.get());
    if (!s.ok()) {
      ASSERT_EQ(Fingerprint(*target), before) << iter;
      continue;
    }
    // A loaded state is a state Put could have made: it saves, loads and attends in bounds.
    std::vector<uint8_t> re;
    ASSERT_TRUE(SaveCache(*target, &re).ok());
    ASSERT_TRUE(LoadCache(re, target.get()).ok());
    for (int sq = 0; sq < 3; ++sq) {
      ASSERT_TRUE(EncStart(target.get(), sq, 0, false).ok());
      std::vector<float> out;
      (void)EncAttend(target.get(), &out);
    }
    target = make_target();
  }
}

// ---- wrapper caches
// --------------------------------------------------------------------------------

// A wrapper of `first` (even layers) and a causal cache, or a chunked one with causal_chunk > 0
// (odd layers), initialized for f16, 2 sequences, 48 cells, batches of 8.
std::unique_ptr<WrapperCache> WrapWithCausal(std::unique_ptr<Cache> first, int32_t causal_chunk) {
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(std::move(first));
  if (causal_chunk > 0) {
    children.push_back(NewChunkedAttentionCache(causal_chunk));
  } else {
    children.push_back(NewCausalCache());
  }
  auto w = NewWrapperCache(std::move(children));
  EXPECT_TRUE(w->Init(DType::kF16, 2, 48, 8).ok());
  return w;
}

std::unique_ptr<WrapperCache> MakeWrapper(int32_t causal_chunk = 0) {
  return WrapWithCausal(NewSWACache(4), causal_chunk);
}

// One step through a wrapper of SWA (even layers) + causal (odd layers); attention outputs out.
Status WrapperStep(Driver& d, WrapperCache* w, int n, std::vector<float>* out) {
  Batch b;
  b.positions = std::span<const int32_t>(d.pos.data(), n);
  b.sequences = std::span<const int32_t>(d.seq.data(), n);
  KV_RETURN_IF_ERROR(w->StartForward(b, false));
  out->assign(static_cast<size_t>(d.layers) * d.dv * n * d.q_heads, 0);
  for (int l = 0; l < d.layers; ++l) {
    for (size_t i = 0; i < d.k.size(); ++i) d.k[i] = testing::HashValue(d.pos[0], l, i);
    for (size_t i = 0; i < d.v.size(); ++i) d.v[i] = testing::HashValue(d.pos[0], l + 9, i);
    for (size_t i = 0; i < d.q.size(); ++i) d.q[i] = testing::HashValue(d.pos[0], l + 19, i);
    w->SetLayer(l);
    w->SetLayerType(l % 2);
    KV_RETURN_IF_ERROR(w->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, n}),
                              MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, n})));
    TensorView q = MakeView(d.q.data(), DType::kF32, {d.dk, n, d.q_heads});
    TensorView o = MakeView(out->data() + static_cast<size_t>(l) * d.dv * n * d.q_heads,
                            DType::kF32, {d.dv, n, d.q_heads});
    KV_RETURN_IF_ERROR(Attend(q, w->Get(), AttentionParams(), &o));
  }
  return Status::Ok();
}

TEST(PersistenceWrapper, InterleavedSlidingWindowAndCausalContinueIdentically) {
  Driver d;
  d.layers = 4;
  auto a = MakeWrapper();
  std::vector<float> oa, ob;
  for (int t = 0; t < 10; ++t) {
    d.seq[0] = 0;
    d.pos[0] = t;
    d.seq[1] = 1;
    d.pos[1] = t;
    ASSERT_TRUE(WrapperStep(d, a.get(), 2, &oa).ok());
  }
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  auto b = MakeWrapper();
  const Status s = LoadCache(bytes, b.get());
  ASSERT_TRUE(s.ok()) << s.message();
  for (int t = 10; t < 20; ++t) {
    d.seq[0] = t % 2;
    d.pos[0] = t;
    ASSERT_TRUE(WrapperStep(d, a.get(), 1, &oa).ok());
    ASSERT_TRUE(WrapperStep(d, b.get(), 1, &ob).ok());
    ASSERT_EQ(oa, ob) << t;
  }
  // File round trip through the overloads.
  const std::string path = TempPath("wrapper.kv");
  ASSERT_TRUE(SaveCacheFile(*a, path.c_str()).ok());
  auto c = MakeWrapper();
  ASSERT_TRUE(LoadCacheFile(path.c_str(), c.get()).ok());
  std::vector<uint8_t> again, from_file;
  ASSERT_TRUE(SaveCache(*a, &again).ok());
  ASSERT_TRUE(SaveCache(*c, &from_file).ok());
  EXPECT_EQ(again, from_file);
  std::remove(path.c_str());
}

TEST(PersistenceWrapper, AFailingChildRestoresTheEarlierOnes) {
  Driver d;
  auto a = MakeWrapper();
  std::vector<float> o;
  for (int t = 0; t < 6; ++t) {
    d.seq[0] = 0;
    d.pos[0] = t;
    ASSERT_TRUE(WrapperStep(d, a.get(), 1, &o).ok());
  }
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  auto b = MakeWrapper(/*causal_chunk=*/4);  // child 1 is another kind: its load fails
  d.seq[0] = 1;
  d.pos[0] = 0;
  ASSERT_TRUE(WrapperStep(d, b.get(), 1, &o).ok());
  std::vector<uint8_t> before, after;
  ASSERT_TRUE(SaveCache(*b, &before).ok());
  const History child0_before = b->Child(0)->Get();
  ASSERT_NE(child0_before.mask.data, nullptr);
  EXPECT_EQ(LoadCache(bytes, b.get()).code(), Code::kInvalidArgument);
  ASSERT_TRUE(SaveCache(*b, &after).ok());
  EXPECT_EQ(before, after);
  // Child 1 refused its stream before child 0 loaded anything: child 0 keeps its forward pass
  // too (a restore from a backup would have dropped it), so the pass can go on.
  const History child0_after = b->Child(0)->Get();
  EXPECT_EQ(child0_after.mask.data, child0_before.mask.data);
  EXPECT_EQ(child0_after.mask.ne[0], child0_before.mask.ne[0]);
  b->SetLayer(0);
  b->SetLayerType(0);
  EXPECT_TRUE(b->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, 1}),
                     MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, 1}))
                  .ok());
  // Corruption of the outer stream.
  for (size_t n = 0; n < bytes.size(); n += 11)
    ASSERT_EQ(LoadCache(std::span<const uint8_t>(bytes.data(), n), b.get()).code(), Code::kCorrupt);
}

// A wrapper of an encoder (even layers: cross-attention over an image) and a causal cache (odd
// layers), as in mllama.
std::unique_ptr<WrapperCache> MakeEncoderWrapper(EncoderCache** enc, int32_t causal_chunk = 0) {
  auto e = NewEncoderCache();
  *enc = e.get();
  return WrapWithCausal(std::move(e), causal_chunk);
}

// One step of n tokens; with image > 0 the first token carries an image of that many tokens,
// which the encoder layers store. Attention outputs of every layer go to out.
Status EncoderWrapperStep(Driver& d, WrapperCache* w, int n, int image, std::vector<float>* out) {
  const int32_t mm[1] = {0};
  Batch b;
  b.positions = std::span<const int32_t>(d.pos.data(), n);
  b.sequences = std::span<const int32_t>(d.seq.data(), n);
  if (image > 0) b.multimodal = mm;
  KV_RETURN_IF_ERROR(w->StartForward(b, false));
  out->assign(static_cast<size_t>(d.layers) * d.dv * n * d.q_heads, 0);
  for (int l = 0; l < d.layers; ++l) {
    for (size_t i = 0; i < d.q.size(); ++i) d.q[i] = testing::HashValue(d.pos[0], l + 19, i);
    w->SetLayer(l);
    w->SetLayerType(l % 2);
    if (l % 2 == 1) {
      for (size_t i = 0; i < d.k.size(); ++i) d.k[i] = testing::HashValue(d.pos[0], l, i);
      for (size_t i = 0; i < d.v.size(); ++i) d.v[i] = testing::HashValue(d.pos[0], l + 9, i);
      KV_RETURN_IF_ERROR(w->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, n}),
                                MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, n})));
    } else if (image > 0) {
      std::vector<float> ik(static_cast<size_t>(d.dk) * d.kv_heads * image);
      std::vector<float> iv(static_cast<size_t>(d.dv) * d.kv_heads * image);
      for (size_t i = 0; i < ik.size(); ++i) ik[i] = testing::HashValue(d.pos[0] + 500, l, i);
      for (size_t i = 0; i < iv.size(); ++i) iv[i] = testing::HashValue(d.pos[0] + 600, l, i);
      KV_RETURN_IF_ERROR(w->Put(MakeView(ik.data(), DType::kF32, {d.dk, d.kv_heads, image}),
                                MakeView(iv.data(), DType::kF32, {d.dv, d.kv_heads, image})));
    }
    const History h = w->Get();
    if (h.k.data == nullptr) continue;  // no image yet: the layer contributes zeros
    TensorView q = MakeView(d.q.data(), DType::kF32, {d.dk, n, d.q_heads});
    TensorView o = MakeView(out->data() + static_cast<size_t>(l) * d.dv * n * d.q_heads,
                            DType::kF32, {d.dv, n, d.q_heads});
    KV_RETURN_IF_ERROR(Attend(q, h, AttentionParams(), &o));
  }
  return Status::Ok();
}

TEST(PersistenceWrapper, EncoderAndCausalContinueIdentically) {
  Driver d;
  d.layers = 4;
  EncoderCache* ea = nullptr;
  EncoderCache* eb = nullptr;
  auto a = MakeEncoderWrapper(&ea);
  std::vector<float> oa, ob;
  for (int t = 0; t < 6; ++t) {
    d.seq[0] = 0;
    d.pos[0] = t;
    d.seq[1] = 1;
    d.pos[1] = t;
    ASSERT_TRUE(EncoderWrapperStep(d, a.get(), 2, t == 2 ? 5 : 0, &oa).ok());
  }
  ASSERT_TRUE(ea->EncoderCached());
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  auto b = MakeEncoderWrapper(&eb);
  const Status s = LoadCache(bytes, b.get());
  ASSERT_TRUE(s.ok()) << s.message();
  for (int t = 6; t < 14; ++t) {
    d.seq[0] = t % 2;
    d.pos[0] = t;
    const int image = t == 10 ? 7 : 0;  // a new, larger image half way
    ASSERT_TRUE(EncoderWrapperStep(d, a.get(), 1, image, &oa).ok());
    ASSERT_TRUE(EncoderWrapperStep(d, b.get(), 1, image, &ob).ok());
    EXPECT_EQ(ea->EncoderCached(), eb->EncoderCached());
    ASSERT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)), 0) << t;
  }
  // The image position (2) survived in the loaded encoder: removing it uncaches both.
  auto c = MakeEncoderWrapper(&eb);
  ASSERT_TRUE(LoadCache(bytes, c.get()).ok());
  ASSERT_TRUE(c->Remove(0, 2, kPosMax).ok());
  EXPECT_FALSE(eb->EncoderCached());
  // File round trip, and one sequence (the encoder's shared block comes along).
  const std::string path = TempPath("encoder_wrapper.kv");
  ASSERT_TRUE(SaveCacheFile(*a, path.c_str()).ok());
  auto f = MakeEncoderWrapper(&eb);
  ASSERT_TRUE(LoadCacheFile(path.c_str(), f.get()).ok());
  std::vector<uint8_t> again, from_file;
  ASSERT_TRUE(SaveCache(*a, &again).ok());
  ASSERT_TRUE(SaveCache(*f, &from_file).ok());
  EXPECT_EQ(again, from_file);
  std::remove(path.c_str());
  std::vector<uint8_t> one;
  ASSERT_TRUE(SaveCache(*a, &one, 1).ok());
  auto g = MakeEncoderWrapper(&eb);
  ASSERT_TRUE(LoadCache(one, g.get(), 0).ok());
  EXPECT_TRUE(eb->EncoderCached());
  d.seq[0] = 0;
  d.pos[0] = 14;
  ASSERT_TRUE(EncoderWrapperStep(d, g.get(), 1, 0, &ob).ok());
  d.seq[0] = 1;
  ASSERT_TRUE(EncoderWrapperStep(d, a.get(), 1, 0, &oa).ok());
  // The sequence sits in other cells here (its history span differs), so the causal layers'
  // summation order may differ: near, not bit-identical; the encoder layers are exact.
  ASSERT_EQ(oa.size(), ob.size());
  for (size_t i = 0; i < oa.size(); ++i) {
    const size_t layer = i / (oa.size() / d.layers);
    if (layer % 2 == 0) {
      ASSERT_EQ(oa[i], ob[i]) << i;
    } else {
      ASSERT_NEAR(oa[i], ob[i], 1e-5f) << i;
    }
  }
}

TEST(PersistenceWrapper, AFailingChildRestoresTheEncoder) {
  Driver d;
  d.layers = 2;
  EncoderCache* ea = nullptr;
  EncoderCache* eb = nullptr;
  auto a = MakeEncoderWrapper(&ea);
  std::vector<float> o;
  d.seq[0] = 0;
  d.pos[0] = 0;
  ASSERT_TRUE(EncoderWrapperStep(d, a.get(), 1, 9, &o).ok());  // a large image
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveCache(*a, &bytes).ok());
  // Child 1 is another kind: its load fails after the encoder (child 0) took the larger image.
  auto b = MakeEncoderWrapper(&eb, /*causal_chunk=*/4);
  d.seq[0] = 1;
  d.pos[0] = 3;
  ASSERT_TRUE(EncoderWrapperStep(d, b.get(), 1, 2, &o).ok());
  std::vector<uint8_t> before, after;
  ASSERT_TRUE(SaveCache(*b, &before).ok());
  EXPECT_EQ(LoadCache(bytes, b.get()).code(), Code::kInvalidArgument);
  ASSERT_TRUE(SaveCache(*b, &after).ok());
  EXPECT_EQ(before, after);
  EXPECT_TRUE(eb->EncoderCached());
  ASSERT_TRUE(b->Remove(1, 3, 4).ok());  // its own position, 3, came back
  EXPECT_FALSE(eb->EncoderCached());
}

// ---- growing and rotating caches ---------------------------------------------------------------

void UpdateSeq(SequenceCache* c, int step, int n, TensorView* ko, TensorView* vo) {
  const int D = 32, H = 2, B = 1;
  std::vector<float> k(static_cast<size_t>(D) * n * H * B), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = testing::HashValue(step, i, 1);
    v[i] = testing::HashValue(step, i, 2);
  }
  ASSERT_TRUE(c->Update(MakeView(k.data(), DType::kF32, {D, n, H, B}),
                        MakeView(v.data(), DType::kF32, {D, n, H, B}), n, ko, vo)
                  .ok());
}

TEST(PersistenceSequenceCache, RoundTripEveryDTypeGrowingAndRotating) {
  for (DType dtype : kAllDTypes) {
    for (int rotating = 0; rotating < 2; ++rotating) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + (rotating ? " rotating" : " growing"));
      auto make = [&] { return rotating ? NewRotatingKVCache(24, 2, dtype) : NewKVCache(dtype); };
      auto a = make();
      TensorView ko, vo;
      UpdateSeq(a.get(), 0, 20, &ko, &vo);
      for (int t = 1; t < 10; ++t) UpdateSeq(a.get(), t, 1, &ko, &vo);
      std::vector<uint8_t> bytes;
      ASSERT_TRUE(SaveSequenceCache(*a, &bytes).ok());
      auto b = make();
      const Status s = LoadSequenceCache(bytes, b.get());
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_EQ(a->Offset(), b->Offset());
      EXPECT_EQ(a->Len(), b->Len());
      for (int t = 10; t < 20; ++t) {
        TensorView ka, va, kb, vb;
        UpdateSeq(a.get(), t, t == 15 ? 3 : 1, &ka, &va);
        UpdateSeq(b.get(), t, t == 15 ? 3 : 1, &kb, &vb);
        ASSERT_EQ(ViewFloats(ka), ViewFloats(kb)) << t;
        ASSERT_EQ(ViewFloats(va), ViewFloats(vb)) << t;
      }
    }
  }
}

TEST(PersistenceSequenceCache, FailuresChangeNothing) {
  auto a = NewRotatingKVCache(16, 1, DType::kF16);
  TensorView ko, vo;
  UpdateSeq(a.get(), 0, 10, &ko, &vo);
  std::vector<uint8_t> bytes;
  ASSERT_TRUE(SaveSequenceCache(*a, &bytes).ok());
  auto other = NewRotatingKVCache(16, 2, DType::kF16);
  EXPECT_EQ(LoadSequenceCache(bytes, other.get()).code(), Code::kInvalidArgument);
  auto b = NewRotatingKVCache(16, 1, DType::kF16);
  UpdateSeq(b.get(), 5, 3, &ko, &vo);
  for (size_t n = 0; n < bytes.size(); n += 7) {
    ASSERT_EQ(LoadSequenceCache(std::span<const uint8_t>(bytes.data(), n), b.get()).code(),
              Code::kCorrupt);
  }
  std::vector<uint8_t> flipped = bytes;
  flipped[40] ^= 1;
  EXPECT_EQ(LoadSequenceCache(flipped, b.get()).code(), Code::kCorrupt);
  EXPECT_EQ(b->Offset(), 3);
  // Causal and sequence streams are not interchangeable.
  auto causal = MakeInit(AllCacheKinds()[0], DType::kF16);
  EXPECT_EQ(LoadCache(bytes, causal.get()).code(), Code::kInvalidArgument);
  const std::string path = TempPath("seq.kv");
  ASSERT_TRUE(SaveSequenceCacheFile(*a, path.c_str()).ok());
  ASSERT_TRUE(LoadSequenceCacheFile(path.c_str(), b.get()).ok());
  EXPECT_EQ(b->Offset(), 10);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kv
