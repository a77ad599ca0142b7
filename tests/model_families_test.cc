// Whole model families wired through the wrapper cache, run through a full prefill + decode with
// small but realistic shapes (head_dim 32, 2 KV heads, f32 storage so stored values read back
// exactly).
//
// Every token's K row encodes where it came from: K[0] = its position, K[1] = the layer, K[2] =
// a "generation" (bumped when a range is rewritten after a Remove), K[3] = the head; V[0] = the
// layer. A context shift re-rotates K through the ShiftFn, which here adds the delta to K[0].
// After each Get the test decodes every history cell and compares, for each checked batch token,
// the exact multiset of positions it can see (mask 0) with the set the model family's rule says
// it must see among the tokens the sequence holds. That checks retention (no needed token was
// trimmed), exclusion (window, chunk, causal, removed tail) and per-layer storage at once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/persistence.h"
#include "gtest/gtest.h"

namespace kv {
namespace {

constexpr int kHeadDim = 32;
constexpr int kKvHeads = 2;

// Which history positions batch token (P, exempt) may see: the family's mask rule.
using Rule = std::function<bool(int32_t P, int32_t p, bool exempt)>;

Rule CausalRule() {
  return [](int32_t P, int32_t p, bool exempt) { return exempt || p <= P; };
}
Rule SwaRule(int32_t window) {  // Ollama's convention: W + 1 keys
  return [window](int32_t P, int32_t p, bool exempt) {
    return (exempt || p <= P) && p >= int64_t{P} - window;
  };
}
Rule ChunkRule(int32_t chunk) {
  return [chunk](int32_t P, int32_t p, bool exempt) {
    return (exempt || p <= P) && p >= P - (P % chunk);
  };
}

struct Tokens {
  std::vector<int32_t> pos, seq, mm;
  Batch batch() const { return Batch{pos, seq, mm}; }
  int size() const { return static_cast<int>(pos.size()); }
};

Tokens Range(int32_t first, int n, std::vector<int32_t> mm = {}) {
  Tokens t;
  for (int i = 0; i < n; ++i) {
    t.pos.push_back(first + i);
    t.seq.push_back(0);
  }
  t.mm = std::move(mm);
  return t;
}

// The model: which child each layer uses and how to check it.
struct LayerSpec {
  int type;       // wrapper child
  bool encoder;   // cross-attention layer reading the encoder cache
  Rule rule;      // self-attention layers: the mask rule
  int32_t cells;  // self-attention layers: NumCells of the child (history bound)
};

class Model {
 public:
  Model(WrapperCache* cache, std::vector<LayerSpec> layers)
      : cache_(cache), layers_(std::move(layers)) {}

  // Runs one forward pass over tokens: StartForward, then per layer SetLayer/SetLayerType,
  // SetCausal(exempt) on causal children, Put (self-attention; cross-attention only when given an
  // image), Get and the checks. `held` is the number of positions the sequence holds after the
  // batch (the sequence is always positions [0, held)). `image`, when set, is the encoder output.
  void Forward(const Tokens& t, int32_t held, std::vector<int32_t> exempt = {},
               const std::vector<float>* image = nullptr, int64_t image_tokens = 0) {
    ASSERT_TRUE(cache_->StartForward(t.batch(), false).ok());
    const int b = t.size();
    const size_t elems = static_cast<size_t>(kHeadDim) * kKvHeads * static_cast<size_t>(b);
    std::vector<float>& k = k_buf_;
    std::vector<float>& v = v_buf_;
    k.assign(elems, 0.0f);
    v.assign(elems, 0.0f);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerSpec& spec = layers_[l];
      cache_->SetLayer(static_cast<int>(l));
      cache_->SetLayerType(spec.type);
      if (spec.encoder) {
        auto* enc = static_cast<EncoderCache*>(cache_->UnderlyingCache());
        if (image != nullptr) {
          TensorView iv = MakeView(const_cast<float*>(image->data()), DType::kF32,
                                   {kHeadDim, kKvHeads, image_tokens});
          ASSERT_TRUE(cache_->Put(iv, iv).ok());
        }
        ASSERT_TRUE(enc->EncoderCached()) << "layer " << l;
        History h = cache_->Get();
        EXPECT_EQ(h.mask.data, nullptr);
        ASSERT_NE(h.k.data, nullptr);
        EXPECT_EQ(h.k.ne[2], image_tokens_now_);
        EXPECT_EQ(static_cast<const float*>(h.k.data)[0], (*current_image_)[0]) << "layer " << l;
        continue;
      }
      if (!exempt.empty()) {
        static_cast<CausalCache*>(cache_->UnderlyingCache())->SetCausal(exempt);
      }
      for (int i = 0; i < b; ++i) {
        for (int h = 0; h < kKvHeads; ++h) {
          float* kr = &k[(static_cast<size_t>(i) * kKvHeads + h) * kHeadDim];
          float* vr = &v[(static_cast<size_t>(i) * kKvHeads + h) * kHeadDim];
          kr[0] = static_cast<float>(t.pos[i]);
          kr[1] = static_cast<float>(l);
          kr[2] = static_cast<float>(generation_);
          kr[3] = static_cast<float>(h);
          vr[0] = static_cast<float>(l);
          vr[1] = static_cast<float>(t.pos[i]);  // V is never re-rotated: the original position
        }
      }
      ASSERT_TRUE(cache_
                      ->Put(MakeView(k.data(), DType::kF32, {kHeadDim, kKvHeads, b}),
                            MakeView(v.data(), DType::kF32, {kHeadDim, kKvHeads, b}))
                      .ok());
      CheckSelfAttention(cache_->Get(), t, held, exempt, spec, static_cast<int>(l));
      if (testing::Test::HasFatalFailure()) return;
    }
  }

  void SetImage(const std::vector<float>* image, int64_t tokens) {
    current_image_ = image;
    image_tokens_now_ = tokens;
  }
  void NextGeneration() { ++generation_; }
  // Positions at or above this hold the current generation; below, they may hold older ones.
  void SetGenerationFloor(int32_t pos) { generation_floor_ = pos; }

 private:
  void CheckSelfAttention(const History& h, const Tokens& t, int32_t held,
                          const std::vector<int32_t>& exempt, const LayerSpec& spec, int layer) {
    ASSERT_NE(h.k.data, nullptr);
    ASSERT_NE(h.mask.data, nullptr);
    const int64_t L = h.k.ne[2];
    const int b = t.size();
    ASSERT_EQ(h.k.ne[0], kHeadDim);
    ASSERT_EQ(h.k.ne[1], kKvHeads);
    ASSERT_EQ(h.v.ne[2], L);
    ASSERT_EQ(h.mask.ne[0], L);
    ASSERT_EQ(h.mask.ne[1], b);
    ASSERT_LE(L, spec.cells) << "layer " << layer;
    // Decode every history cell once.
    std::vector<int32_t> cell_pos(L);
    std::vector<bool> cell_ok(L);
    for (int64_t j = 0; j < L; ++j) {
      const float* kr = static_cast<const float*>(RowPtr(h.k, 0, j));
      const float* vr = static_cast<const float*>(RowPtr(h.v, 0, j));
      const float* kr1 = static_cast<const float*>(RowPtr(h.k, 1, j));
      cell_pos[j] = static_cast<int32_t>(kr[0]);
      cell_ok[j] = kr[1] == static_cast<float>(layer) && kr1[3] == 1.0f &&
                   vr[0] == static_cast<float>(layer) &&
                   (cell_pos[j] < generation_floor_ || kr[2] == static_cast<float>(generation_));
    }
    // Rows to check: all for small batches, else a spread plus every exempt token.
    std::set<int> rows;
    if (b <= 16) {
      for (int i = 0; i < b; ++i) rows.insert(i);
    } else {
      for (int i : {0, 1, b / 3, b / 2, b - 2, b - 1}) rows.insert(i);
    }
    for (size_t e = 0; e < exempt.size(); e += std::max<size_t>(1, exempt.size() / 4)) {
      rows.insert(exempt[e]);
    }
    for (int i : rows) {
      const bool ex = std::find(exempt.begin(), exempt.end(), i) != exempt.end();
      const float* m = static_cast<const float*>(RowPtr(h.mask, i));
      std::vector<int32_t> seen;
      for (int64_t j = 0; j < L; ++j) {
        if (m[j] == 0.0f) {
          seen.push_back(cell_pos[j]);
          ASSERT_TRUE(cell_ok[j]) << "layer " << layer << " token " << i << " cell " << j
                                  << " holds another layer's or a stale row";
        } else {
          ASSERT_TRUE(std::isinf(m[j]) && m[j] < 0) << "mask value " << m[j];
        }
      }
      std::sort(seen.begin(), seen.end());
      std::vector<int32_t> want;
      for (int32_t p = 0; p < held; ++p) {
        if (spec.rule(t.pos[i], p, ex)) want.push_back(p);
      }
      ASSERT_EQ(seen, want) << "layer " << layer << " token " << i << " at position " << t.pos[i];
    }
  }

  WrapperCache* cache_;
  std::vector<LayerSpec> layers_;
  std::vector<float> k_buf_, v_buf_;
  int generation_ = 0;
  int32_t generation_floor_ = 0;
  const std::vector<float>* current_image_ = nullptr;
  int64_t image_tokens_now_ = 0;
};

std::unique_ptr<WrapperCache> Wrap(std::unique_ptr<Cache> a, std::unique_ptr<Cache> b) {
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(std::move(a));
  children.push_back(std::move(b));
  return NewWrapperCache(std::move(children));
}

int32_t Cells(WrapperCache* w, int child) {
  return static_cast<CausalCache*>(w->Child(child))->NumCells();
}

// Gemma 3 style: 5 sliding-window layers (window 1024) then 1 global, twice; an image's tokens see
// each other both ways (SetCausal exempts them from the causal rule).
TEST(ModelFamilies, InterleavedSlidingWindowWithImageTokens) {
  auto w = Wrap(NewSWACache(1024), NewCausalCache());
  ASSERT_TRUE(w->Init(DType::kF32, 1, 4096, 512).ok());
  const int32_t swa_cells = Cells(w.get(), 0), global_cells = Cells(w.get(), 1);
  EXPECT_EQ(swa_cells, 1024 + 512);  // memory = window, one sequence: window + batch cells
  EXPECT_EQ(global_cells, 4096);
  std::vector<LayerSpec> layers;
  for (int l = 0; l < 12; ++l) {
    if (l % 6 == 5) {
      layers.push_back({1, false, CausalRule(), global_cells});
    } else {
      layers.push_back({0, false, SwaRule(1024), swa_cells});
    }
  }
  Model model(w.get(), layers);
  int32_t n = 0;
  // Prefill 1700 tokens in batches of at most 512; the second batch carries a 64-token image at
  // batch indices 100..163 (positions 612..675).
  while (n < 1700) {
    const int b = std::min(512, 1700 - n);
    Tokens t = Range(n, b);
    std::vector<int32_t> exempt;
    if (n == 512) {
      for (int i = 100; i < 164; ++i) {
        exempt.push_back(i);
        t.mm.push_back(i);
      }
    }
    n += b;
    model.Forward(t, n, exempt);
    if (HasFatalFailure()) return;
  }
  // Decode: a window layer sees exactly 1025 keys, a global one everything.
  for (int step = 0; step < 24; ++step) {
    Tokens t = Range(n, 1);
    ++n;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
  w->SetLayerType(0);
  EXPECT_LE(w->Get().k.ne[2], swa_cells);
  w->SetLayerType(1);
  EXPECT_GE(w->Get().k.ne[2], n);
}

// Llama 4 style: chunked attention (chunk 8192) with every 4th layer global.
TEST(ModelFamilies, ChunkedWithEveryFourthLayerGlobal) {
  constexpr int32_t kChunk = 8192;
  auto w = Wrap(NewChunkedAttentionCache(kChunk), NewCausalCache());
  ASSERT_TRUE(w->Init(DType::kF32, 1, 8704, 1024).ok());
  std::vector<LayerSpec> layers;
  for (int l = 0; l < 8; ++l) {
    if (l % 4 == 3) {
      layers.push_back({1, false, CausalRule(), Cells(w.get(), 1)});
    } else {
      layers.push_back({0, false, ChunkRule(kChunk), Cells(w.get(), 0)});
    }
  }
  Model model(w.get(), layers);
  int32_t n = 0;
  // Prefill across the chunk boundary: the batch 7680..8703 holds tokens of both chunks.
  while (n < 8400) {
    const int b = std::min(1024, 8400 - n);
    Tokens t = Range(n, b);
    n += b;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
  for (int step = 0; step < 8; ++step) {
    Tokens t = Range(n, 1);
    ++n;
    model.Forward(t, n);  // chunk layers: positions 8192..P only
    if (HasFatalFailure()) return;
  }
}

// Sliding window with memory (window 128, memory 4096) alternating with global layers; the tail of
// the sequence is removed and the sequence resumes from the shorter prefix.
TEST(ModelFamilies, SlidingWindowWithMemoryResumesAfterTailRemoved) {
  auto w = Wrap(NewSWAMemCache(128, 4096), NewCausalCache());
  ASSERT_TRUE(w->Init(DType::kF32, 1, 8192, 512).ok());
  const int32_t swa_cells = Cells(w.get(), 0);
  EXPECT_EQ(swa_cells, 4096 + 512);
  std::vector<LayerSpec> layers;
  for (int l = 0; l < 6; ++l) {
    layers.push_back(l % 2 == 0 ? LayerSpec{0, false, SwaRule(128), swa_cells}
                                : LayerSpec{1, false, CausalRule(), Cells(w.get(), 1)});
  }
  Model model(w.get(), layers);
  int32_t n = 0;
  while (n < 4500) {
    const int b = std::min(512, 4500 - n);
    Tokens t = Range(n, b);
    n += b;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
  for (int step = 0; step < 6; ++step) {  // decoding trims the window child below n - 4096
    Tokens t = Range(n, 1);
    ++n;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
  // The window child now holds positions >= n - 1 - 4096 only: resuming far back is impossible.
  EXPECT_TRUE(w->CanResume(0, n));
  EXPECT_FALSE(w->CanResume(0, 300));
  EXPECT_TRUE(w->Child(1)->CanResume(0, 300));  // the global child alone could

  // Drop the tail from 4300 on (e.g. the runtime's prompt cache diverged there) and resume.
  const int32_t resume = 4300;
  ASSERT_TRUE(w->Remove(0, resume, kPosMax).ok());
  EXPECT_TRUE(w->CanResume(0, resume));
  EXPECT_FALSE(w->CanResume(0, resume + 1));  // a gap after the last stored position
  model.NextGeneration();
  model.SetGenerationFloor(resume);
  n = resume;
  {
    Tokens t = Range(n, 40);  // a short re-prefill of the new tail
    n += 40;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
  for (int step = 0; step < 6; ++step) {
    Tokens t = Range(n, 1);
    ++n;
    model.Forward(t, n);
    if (HasFatalFailure()) return;
  }
}

// Llama 3.2 Vision style: cross-attention layers read the encoder cache, self-attention layers the
// causal cache. A second image arrives mid-sequence; a context shift later removes the first one;
// removing the second's token finally invalidates the encoder.
TEST(ModelFamilies, EncoderPlusCausalWithImagesArrivingAndLeaving) {
  // Re-rotation stand-in: keys carry their position in K[0], so a shift adds the delta there.
  auto shift = [](int, TensorView key, std::span<const int32_t> delta) {
    for (int64_t i = 0; i < key.ne[2]; ++i) {
      for (int64_t h = 0; h < key.ne[1]; ++h) {
        static_cast<float*>(RowPtr(key, h, i))[0] += static_cast<float>(delta[i]);
      }
    }
    return Status::Ok();
  };
  auto w = Wrap(NewEncoderCache(), NewCausalCache(shift));
  ASSERT_TRUE(w->Init(DType::kF32, 1, 1024, 128).ok());
  auto* enc = static_cast<EncoderCache*>(w->Child(0));
  std::vector<LayerSpec> layers;
  for (int l = 0; l < 10; ++l) {
    layers.push_back(l == 3 || l == 8 ? LayerSpec{0, true, nullptr, 0}
                                      : LayerSpec{1, false, CausalRule(), Cells(w.get(), 1)});
  }
  Model model(w.get(), layers);
  std::vector<float> image1(kHeadDim * kKvHeads * 16, 1.5f),
      image2(kHeadDim * kKvHeads * 24, -2.5f);

  EXPECT_FALSE(enc->EncoderCached());
  // Prompt: the image token at position 0, then text.
  model.SetImage(&image1, 16);
  model.Forward(Range(0, 100, {0}), 100, {}, &image1, 16);
  if (HasFatalFailure()) return;
  EXPECT_TRUE(enc->EncoderCached());
  int32_t n = 100;
  for (int step = 0; step < 10; ++step, ++n) {  // decode reads the cached image
    model.Forward(Range(n, 1), n + 1);
    if (HasFatalFailure()) return;
  }
  // A new, larger image arrives at position 110 in the next user turn.
  model.SetImage(&image2, 24);
  model.Forward(Range(n, 40, {0}), n + 40, {}, &image2, 24);
  if (HasFatalFailure()) return;
  n += 40;
  for (int step = 0; step < 5; ++step, ++n) {
    model.Forward(Range(n, 1), n + 1);
    if (HasFatalFailure()) return;
  }
  // Context shift: drop positions [0, 50), which removes the first image's token. The current image
  // (token at 110, now 60) stays cached; the causal cache re-rotates the kept keys down by 50.
  ASSERT_TRUE(w->Remove(0, 0, 50).ok());
  EXPECT_TRUE(enc->EncoderCached());
  n -= 50;
  for (int step = 0; step < 5; ++step, ++n) {
    model.Forward(Range(n, 1), n + 1);
    if (HasFatalFailure()) return;
  }
  // Removing from 55 on takes the second image's token (now at 60) with it.
  ASSERT_TRUE(w->Remove(0, 55, kPosMax).ok());
  EXPECT_FALSE(enc->EncoderCached());
  EXPECT_TRUE(w->CanResume(0, 55));
  // The image is re-encoded when the runtime re-sends it.
  model.NextGeneration();
  model.SetGenerationFloor(55);
  n = 55;
  model.Forward(Range(n, 8, {5}), n + 8, {}, &image2, 24);
  if (HasFatalFailure()) return;
  EXPECT_TRUE(enc->EncoderCached());
}

// A batch the global child has no room for: the wrapper asks both children first, so the window
// child neither takes the batch nor trims the cells the batch would have pushed out of its
// memory (Ollama's wrapper starts it and then removes the batch again, which cannot give those
// cells back).
TEST(ModelFamilies, WrapperLeavesTheWindowChildAsItWasWhenTheGlobalChildIsFull) {
  auto w = Wrap(NewSWACache(4), NewCausalCache());
  ASSERT_TRUE(w->Init(DType::kF32, 1, 16, 4).ok());
  std::vector<float> k(static_cast<size_t>(kHeadDim) * kKvHeads * 4, 1.0f);
  TensorView kv = MakeView(k.data(), DType::kF32, {kHeadDim, kKvHeads, 4});
  for (int32_t p = 0; p < 16; p += 4) {
    Tokens t = Range(p, 4);
    ASSERT_TRUE(w->StartForward(t.batch(), false).ok());
    for (int l = 0; l < 2; ++l) {
      w->SetLayer(l);
      w->SetLayerType(l);
      ASSERT_TRUE(w->Put(kv, kv).ok());
    }
  }
  Cache* swa = w->Child(0);
  // The window child holds positions 8..15 (memory 4 below the last batch's lowest position 12).
  for (int32_t p = 0; p <= 17; ++p) {
    EXPECT_EQ(swa->CanResume(0, p), p >= 12 && p <= 16) << "position " << p;
  }
  std::vector<uint8_t> before, after;
  ASSERT_TRUE(SaveCache(*w, &before).ok());
  Tokens more = Range(16, 4);
  EXPECT_EQ(w->StartForward(more.batch(), false).code(), Code::kCacheFull);
  ASSERT_TRUE(SaveCache(*w, &after).ok());
  EXPECT_TRUE(before == after) << "a refused batch changed a child";
  // Had the window child run the batch, it would have dropped positions 8..11 (and could no
  // longer resume at 12..15); had it kept the batch, it could resume at 17..20.
  for (int32_t p = 0; p <= 21; ++p) {
    EXPECT_EQ(swa->CanResume(0, p), p >= 12 && p <= 16) << "position " << p;
  }
  // The runtime frees room (drops the sequence) and the same batch then goes through.
  ASSERT_TRUE(w->Remove(0, 0, kPosMax).ok());
  Tokens fresh = Range(0, 4);
  EXPECT_TRUE(w->StartForward(fresh.batch(), false).ok());
}

// Cross-attention end to end: the encoder's views (no mask, f16 as given, plain or permuted V)
// go straight into Attend and give the softmax over every image token.
TEST(ModelFamilies, CrossAttentionReadsEncoderViewsThroughAttend) {
  for (bool permuted : {false, true}) {
    SCOPED_TRACE(permuted ? "permuted V" : "plain V");
    auto w = Wrap(NewEncoderCache(), NewCausalCache());
    CacheConfig cfg;
    cfg.permuted_v = permuted;
    ASSERT_TRUE(w->SetConfig(cfg).ok());
    ASSERT_TRUE(w->Init(DType::kF16, 1, 256, 8).ok());
    constexpr int kImg = 16, kHeads = 4, kB = 3;
    std::vector<uint16_t> ik(kHeadDim * kKvHeads * kImg), iv(ik.size());
    for (size_t i = 0; i < ik.size(); ++i) {
      ik[i] = F32ToF16(std::sin(0.37f * static_cast<float>(i)));
      iv[i] = F32ToF16(std::cos(0.11f * static_cast<float>(i)));
    }
    Tokens t = Range(0, kB, {0});
    ASSERT_TRUE(w->StartForward(t.batch(), false).ok());
    w->SetLayer(0);
    w->SetLayerType(0);
    ASSERT_TRUE(w->Put(MakeView(ik.data(), DType::kF16, {kHeadDim, kKvHeads, kImg}),
                       MakeView(iv.data(), DType::kF16, {kHeadDim, kKvHeads, kImg}))
                    .ok());
    History h = w->Get();
    ASSERT_EQ(h.mask.data, nullptr);
    std::vector<float> q(kHeadDim * kB * kHeads), out(q.size(), 0.0f);
    for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.05f * static_cast<float>(i) + 1.0f);
    TensorView ov = MakeView(out.data(), DType::kF32, {kHeadDim, kB, kHeads});
    ASSERT_TRUE(
        Attend(MakeView(q.data(), DType::kF32, {kHeadDim, kB, kHeads}), h, AttentionParams{}, &ov)
            .ok());
    const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
    for (int hq = 0; hq < kHeads; ++hq) {
      const int hk = hq / (kHeads / kKvHeads);
      for (int b = 0; b < kB; ++b) {
        std::vector<double> logit(kImg);
        double mx = -1e300, sum = 0;
        for (int j = 0; j < kImg; ++j) {
          double d = 0;
          for (int e = 0; e < kHeadDim; ++e) {
            d += static_cast<double>(q[(hq * kB + b) * kHeadDim + e]) *
                 F16ToF32(ik[(j * kKvHeads + hk) * kHeadDim + e]);
          }
          logit[j] = d * scale;
          mx = std::max(mx, logit[j]);
        }
        for (int j = 0; j < kImg; ++j) sum += std::exp(logit[j] - mx);
        for (int e = 0; e < kHeadDim; ++e) {
          double o = 0;
          for (int j = 0; j < kImg; ++j) {
            o += std::exp(logit[j] - mx) / sum * F16ToF32(iv[(j * kKvHeads + hk) * kHeadDim + e]);
          }
          EXPECT_NEAR(out[(hq * kB + b) * kHeadDim + e], o, 1e-4) << hq << " " << b << " " << e;
        }
      }
    }
  }
}

// Memory accounting: a runtime can read what each child holds instead of assuming every layer
// keeps the full context.
TEST(ModelFamilies, MemoryAccountingPerChild) {
  // The planning flow: Init, one reserve pass at the largest batch (every layer's first Put sizes
  // its storage in the child that layer uses), then read what each child holds.
  auto w = Wrap(NewSWACache(128), NewCausalCache());
  ASSERT_TRUE(w->Init(DType::kF16, 1, 8192, 64).ok());
  EXPECT_EQ(w->ChildMemoryBytes().size(), 2u);
  std::vector<float> k(static_cast<size_t>(kHeadDim) * kKvHeads * 64, 0.25f);
  TensorView kv = MakeView(k.data(), DType::kF32, {kHeadDim, kKvHeads, 64});
  auto pass = [&](bool reserve) {
    Tokens t = Range(0, 64);
    ASSERT_TRUE(w->StartForward(t.batch(), reserve).ok());
    for (int l = 0; l < 4; ++l) {  // layers 0, 2: window; 1, 3: global
      w->SetLayer(l);
      w->SetLayerType(l % 2);
      ASSERT_TRUE(w->Put(kv, kv).ok());
    }
  };
  pass(/*reserve=*/true);
  if (HasFatalFailure()) return;
  const std::vector<size_t> bytes = w->ChildMemoryBytes();
  ASSERT_EQ(bytes.size(), 2u);
  EXPECT_EQ(bytes[0] + bytes[1], w->MemoryBytes());
  const size_t per_cell_layer = 2 * kHeadDim * kKvHeads * 2;  // K + V rows in f16
  const int32_t swa_cells = Cells(w.get(), 0), global_cells = Cells(w.get(), 1);
  EXPECT_EQ(swa_cells, 128 + 64);
  EXPECT_EQ(global_cells, 8192);
  // Each child holds its two layers' blocks (plus its mask and cell table), and the window child
  // far less than the global one: sizing every layer for the full context would over-estimate
  // the window layers ~40x here.
  EXPECT_GE(bytes[0], 2 * per_cell_layer * swa_cells);
  EXPECT_LT(bytes[0], 2 * per_cell_layer * swa_cells * 2);
  EXPECT_GE(bytes[1], 2 * per_cell_layer * global_cells);
  EXPECT_LT(bytes[0] * 10, bytes[1]);
  // The plan holds: real passes allocate nothing more.
  pass(/*reserve=*/false);
  if (HasFatalFailure()) return;
  EXPECT_EQ(w->ChildMemoryBytes(), bytes);
}

}  // namespace
}  // namespace kv
