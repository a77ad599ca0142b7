// Tests for kernels/mask.h: the dispatched BuildMask equals BuildMaskRef bit for bit on every
// compiled Highway target, and both match the worked examples of SEMANTICS.md section 4.
#include "kernels/mask.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/highway_targets.h"

namespace kv::kernels {
namespace {

constexpr int32_t kMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kMax = std::numeric_limits<int32_t>::max();

// A cell table in the kernel's layout: seq_bits[w * stride + j] is word w of cell j.
struct Table {
  std::vector<int32_t> pos;
  std::vector<uint64_t> bits;
  size_t stride = 0;
  int32_t n = 0;

  Table(int32_t n_cells, int words, size_t extra_stride = 0)
      : pos(static_cast<size_t>(n_cells)),
        stride(static_cast<size_t>(n_cells) + extra_stride),
        n(n_cells) {
    bits.assign(static_cast<size_t>(words) * stride, 0);
  }
  void Add(int32_t cell, int32_t seq) {
    bits[static_cast<size_t>(seq / 64) * stride + static_cast<size_t>(cell)] |= uint64_t{1}
                                                                                << (seq % 64);
  }
  MaskCells Cells() const { return MaskCells{pos.data(), bits.data(), stride, n}; }
};

struct Tokens {
  std::vector<int32_t> pos, seq;
  std::vector<uint8_t> causal;
  MaskTokens View() const { return MaskTokens{pos, seq, causal}; }
};

// Runs BuildMask under every compiled target and checks it equals the reference byte for byte.
void ExpectAllTargetsMatchRef(const Table& t, const Tokens& tok, const MaskRules& rules, DType dt,
                              const std::string& what) {
  const size_t bytes = tok.pos.size() * static_cast<size_t>(t.n) * (dt == DType::kF16 ? 2 : 4);
  std::vector<uint8_t> want(bytes + 64, 0xAB), got(bytes + 64);
  BuildMaskRef(t.Cells(), tok.View(), rules, dt, want.data());
  for (int64_t target : DispatchableTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::fill(got.begin(), got.end(), 0xAB);  // the bytes past the end must stay untouched
    BuildMask(t.Cells(), tok.View(), rules, dt, got.data());
    if (std::memcmp(want.data(), got.data(), got.size()) != 0) {
      size_t k = 0;
      while (want[k] == got[k]) ++k;
      ADD_FAILURE() << "target " << hwy::TargetName(target)
                    << " differs from the reference at byte " << k << " (" << what << ", "
                    << DTypeName(dt) << ", n=" << t.n << ", B=" << tok.pos.size()
                    << ", window=" << rules.window << (rules.window_inclusive ? " incl" : "")
                    << ", chunk=" << rules.chunk << ")";
      break;
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

// The mask as rows of '0' / 'x' (visible / hidden), via the dispatched kernel in f32 and f16,
// after checking every target agrees with the reference.
std::string Render(const Table& t, const Tokens& tok, const MaskRules& rules) {
  std::string rows[2];
  for (DType dt : {DType::kF32, DType::kF16}) {
    ExpectAllTargetsMatchRef(t, tok, rules, dt, "render");
    const size_t count = tok.pos.size() * static_cast<size_t>(t.n);
    std::vector<float> f(count);
    std::vector<uint16_t> h(count);
    BuildMask(t.Cells(), tok.View(), rules, dt,
              dt == DType::kF16 ? static_cast<void*>(h.data()) : f.data());
    std::string& s = rows[dt == DType::kF16];
    for (size_t i = 0; i < tok.pos.size(); ++i) {
      if (i) s += " / ";
      for (int32_t j = 0; j < t.n; ++j) {
        const size_t o = i * static_cast<size_t>(t.n) + static_cast<size_t>(j);
        if (dt == DType::kF16) {
          EXPECT_TRUE(h[o] == 0x0000 || h[o] == 0xFC00) << h[o];
          s += h[o] == 0 ? '0' : 'x';
        } else {
          EXPECT_TRUE(f[o] == 0.0f || f[o] == -std::numeric_limits<float>::infinity()) << f[o];
          EXPECT_FALSE(std::signbit(f[o]) && f[o] == 0.0f);  // +0, not -0
          s += f[o] == 0.0f ? '0' : 'x';
        }
      }
    }
  }
  EXPECT_EQ(rows[0], rows[1]) << "f32 and f16 masks differ";
  return rows[0];
}

// One sequence (0), cells 0..n-1 at the given positions; every token causal.
Table OneSeq(const std::vector<int32_t>& positions) {
  Table t(static_cast<int32_t>(positions.size()), 1);
  t.pos = positions;
  for (int32_t j = 0; j < t.n; ++j) t.Add(j, 0);
  return t;
}
Tokens Causal(const std::vector<int32_t>& positions, int32_t seq = 0) {
  Tokens tok;
  tok.pos = positions;
  tok.seq.assign(positions.size(), seq);
  tok.causal.assign(positions.size(), 1);
  return tok;
}

TEST(MaskTest, SemanticsSwaWindow1) {
  MaskRules rules;
  rules.window = 1;
  EXPECT_EQ(Render(OneSeq({0, 1, 2, 3}), Causal({0, 1, 2, 3}), rules), "0xxx / 00xx / x00x / xx00");
  // Second step: positions < 3 freed, cells 0 and 1 reused; cell 2 is free (stale position 2).
  Table t(4, 1);
  t.pos = {4, 5, 2, 3};
  t.Add(0, 0);
  t.Add(1, 0);
  t.Add(3, 0);
  EXPECT_EQ(Render(t, Causal({4, 5}), rules), "0xx0 / 00xx");
}

TEST(MaskTest, SemanticsChunk2) {
  MaskRules rules;
  rules.chunk = 2;
  EXPECT_EQ(Render(OneSeq({0, 1, 2, 3}), Causal({0, 1, 2, 3}), rules), "0xxx / 00xx / xx0x / xx00");
}

TEST(MaskTest, WindowInclusiveConvention) {
  MaskRules rules;
  rules.window = 1;
  rules.window_inclusive = true;  // W = 1 key: the token itself
  EXPECT_EQ(Render(OneSeq({0, 1, 2, 3}), Causal({0, 1, 2, 3}), rules), "0xxx / x0xx / xx0x / xxx0");
  rules.window = 2;  // two keys: the token and the one before
  EXPECT_EQ(Render(OneSeq({0, 1, 2, 3}), Causal({0, 1, 2, 3}), rules), "0xxx / 00xx / x00x / xx00");
}

TEST(MaskTest, CausalExceptionAndSequences) {
  // Two sequences interleaved in cells; token 1 (seq 1) has the causal rule lifted.
  Table t(4, 1);
  t.pos = {0, 0, 1, 1};
  t.Add(0, 0);
  t.Add(1, 1);
  t.Add(2, 0);
  t.Add(3, 1);
  Tokens tok = Causal({0, 0}, 0);
  tok.seq = {0, 1};
  tok.causal = {1, 0};
  EXPECT_EQ(Render(t, tok, MaskRules{}), "0xxx / x0x0");
  // A shared cell (both sequences) is visible to both; a free cell to neither.
  Table u(3, 1);
  u.pos = {0, 1, 2};
  u.Add(0, 0);
  u.Add(0, 1);
  u.Add(1, 1);
  Tokens tok2 = Causal({5, 5});
  tok2.seq = {0, 1};
  EXPECT_EQ(Render(u, tok2, MaskRules{}), "0xx / 00x");
}

TEST(MaskTest, HighSequenceWordsAndExtremePositions) {
  // Sequence 199 lives in word 3, bit 7; sequence 63 in bit 63 (the sign bit) of word 0.
  Table t(5, 4, 3);
  t.pos = {kMin, -5, 0, kMax - 1, kMax};
  for (int32_t j = 0; j < 5; ++j) t.Add(j, j % 2 ? 199 : 63);
  Tokens tok = Causal({kMax, kMax, kMin, 0});
  tok.seq = {199, 63, 63, 199};
  tok.causal = {1, 1, 0, 0};
  EXPECT_EQ(Render(t, tok, MaskRules{}), "x0x0x / 0x0x0 / 0x0x0 / x0x0x");
  MaskRules w;
  w.window = kMax - 1;  // P - W stays exact in 64 bits: kMax - (kMax - 1) = 1
  EXPECT_EQ(Render(t, tok, w), "xxx0x / xxxx0 / 0x0x0 / x0x0x");
}

// Random cell tables against the reference on every target.
TEST(MaskTest, RandomAgainstReferenceAllTargets) {
  std::mt19937 rng(1234);
  const int32_t windows[] = {kNoWindow, 0, 1, 2, 5, 100, kMax - 1};
  const int32_t chunks[] = {0, 1, 2, 7, 8192};
  const int32_t edge[] = {kMin, kMin + 1, -7, -1, 0, 1, kMax - 1, kMax};
  std::vector<int32_t> sizes;
  for (int32_t n = 1; n <= 70; ++n) sizes.push_back(n);
  sizes.push_back(257);
  sizes.push_back(1031);
  int cases = 0;
  for (int32_t n : sizes) {
    const int num_seq = 1 + static_cast<int>(rng() % 200);
    const int words = (num_seq + 63) / 64;
    Table t(n, words, rng() % 3);
    const int32_t center = static_cast<int32_t>(rng() % 20000) - 10000;
    for (int32_t j = 0; j < n; ++j) {
      t.pos[static_cast<size_t>(j)] =
          rng() % 10 == 0 ? edge[rng() % 8] : center + static_cast<int32_t>(rng() % 64) - 32;
      const int holders = static_cast<int>(rng() % 3);  // 0: a free cell
      for (int h = 0; h < holders; ++h) t.Add(j, static_cast<int32_t>(rng() % num_seq));
      if (rng() % 4 == 0) t.Add(j, 0);
    }
    Tokens tok;
    const int B = 1 + static_cast<int>(rng() % 9);
    for (int i = 0; i < B; ++i) {
      const bool repeat = i > 0 && rng() % 3 == 0;  // exercises the copied-row path
      tok.pos.push_back(repeat ? tok.pos.back()
                               : (rng() % 8 == 0 ? edge[rng() % 8]
                                                 : center + static_cast<int32_t>(rng() % 64) - 32));
      tok.seq.push_back(repeat ? tok.seq.back()
                               : (rng() % 2 ? 0 : static_cast<int32_t>(rng() % num_seq)));
      tok.causal.push_back(repeat ? tok.causal.back() : static_cast<uint8_t>(rng() % 4 != 0));
    }
    for (int32_t w : windows) {
      for (int32_t c : chunks) {
        for (bool incl : {false, true}) {
          MaskRules rules;
          rules.window = w;
          rules.chunk = c;
          rules.window_inclusive = incl;
          for (DType dt : {DType::kF32, DType::kF16}) {
            ExpectAllTargetsMatchRef(t, tok, rules, dt, "random");
            ++cases;
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
  EXPECT_GT(cases, 0);
}

// A decode-like batch (one sequence, many tokens, positions in order) with an odd n: every row
// distinct under the causal rule, equal rows when the causal rule is lifted.
TEST(MaskTest, PromptBatchAllTargets) {
  const int32_t n = 301;
  Table t(n, 1);
  for (int32_t j = 0; j < n; ++j) {
    t.pos[static_cast<size_t>(j)] = j;
    t.Add(j, 0);
  }
  Tokens tok;
  for (int32_t i = 0; i < 40; ++i) {
    tok.pos.push_back(n - 40 + i);
    tok.seq.push_back(0);
    tok.causal.push_back(i % 5 != 0);
  }
  for (DType dt : {DType::kF32, DType::kF16}) {
    ExpectAllTargetsMatchRef(t, tok, MaskRules{}, dt, "prompt");
    MaskRules swa;
    swa.window = 17;
    ExpectAllTargetsMatchRef(t, tok, swa, dt, "prompt swa");
  }
}

TEST(MaskTest, TokenBounds) {
  MaskRules r;
  EXPECT_EQ(ComputeTokenBounds(5, true, r).lo, kMin);
  EXPECT_EQ(ComputeTokenBounds(5, true, r).hi, 5);
  EXPECT_EQ(ComputeTokenBounds(5, false, r).hi, kMax);
  r.window = 3;
  EXPECT_EQ(ComputeTokenBounds(5, true, r).lo, 2);
  r.window_inclusive = true;
  EXPECT_EQ(ComputeTokenBounds(5, true, r).lo, 3);
  r.window = kMax - 1;
  r.window_inclusive = false;
  EXPECT_EQ(ComputeTokenBounds(kMin, true, r).lo, kMin);  // clamped, no overflow
  r = MaskRules{};
  r.chunk = 4;
  EXPECT_EQ(ComputeTokenBounds(7, true, r).lo, 4);
  EXPECT_EQ(ComputeTokenBounds(-1, true, r).lo, -4);  // floor mod for negative positions
  EXPECT_EQ(ComputeTokenBounds(kMin, true, r).lo, kMin);
}

}  // namespace
}  // namespace kv::kernels
