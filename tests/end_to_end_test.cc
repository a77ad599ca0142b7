// End-to-end correctness (issue 7): a tiny transformer (tests/tiny_transformer.h) decodes through
// every cache kind and storage dtype, and its logits must match a double-precision recomputation
// of attention over the whole token sequence without a cache, under the same visibility rule.
//
// How a case runs:
// 1. The reference greedy-decodes 64 tokens after an 8-token prompt (and, for the causal family,
//    applies a context shift before token 40: Remove(0, 4, 17), the later tokens renumbered).
// 2. The f32 model is *forced* along the reference's token sequence (so one near-tie cannot
//    cascade into a different continuation), in batches: the prompt in two batches (5 + 3), single
//    tokens, and multi-token batches after the shift / after the rotating window wrapped.
// 3. Every processed token's logits are compared with the exact reference's (tolerance per dtype)
//    and with the stored-value reference's (the same, with K/V rounded through the storage dtype:
//    tight for every dtype, so that a q4_0 cache is checked as sharply as an f32 one). Generated
//    token ids are compared where the exact reference's top-2 margin exceeds twice the tolerance.
// Cases: causal, SWA(8), chunked(8), wrapper of SWA-with-memory(6, 10) + causal (alternating
// layers), wrapper of encoder + causal (self, cross, self layers; the image rides on token 0), all
// five with the context shift; rotating(16, keep 4) and growing SequenceCaches, whose {D, T, H, B}
// views go to Attend per batch entry with dims 1 and 2 swapped and a mask the runtime builds.
// Each case runs for f32, f16, bf16, q8_0 and q4_0 storage. EndToEndSensitivity shows that a
// rule off by one moves the logits far beyond the tolerances.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/attend.h"
#include "core/cache.h"
#include "core/rope_shift.h"
#include "core/sequence_cache.h"
#include "gtest/gtest.h"
#include "kernels/convert.h"
#include "tiny_transformer.h"

namespace kv::tiny {
namespace {

constexpr int kPrompt = 8;
constexpr int kGen = 64;
constexpr int kTokens = kPrompt + kGen;  // tokens processed (the last generated one is not)
constexpr int kCapacity = 96;
constexpr int kMaxBatch = 8;
constexpr float kRopeBase = 10000.0f;
const int32_t kPromptTokens[kPrompt] = {3, 17, 42, 8, 25, 60, 11, 5};

// Max |logit - exact reference| allowed, per storage dtype (max |logit| is 7.5 to 10). Measured
// maxima over the seven cases in brackets (Release, AVX-512 machine).
// - f32 [4e-6]: storage is exact; what remains is f32 arithmetic in the model and in Attend (dot
//   products of 32-128 terms at 2^-24 relative, through 2-3 layers, and the shift's f32 rotation).
//   1e-4 still catches any visibility or position error (EndToEndSensitivity: >= 0.1).
// - f16 [3e-3]: K/V rounded to 2^-11 relative (|K|, |V| up to ~3) move attention scores by ~1e-3,
//   amplified through two layers and the output projection: 2e-2.
// - bf16 [2.5e-2]: 2^-8 relative, 8x f16's unit: 0.1.
// - q8_0 [6.3e-2]: per block of 32, step max|x| / 127 (0.8% of the block max, ~2x bf16): 0.2.
// - q4_0 [1.19]: step max|x| / 8 (12% of the block max): noise on every K and V element, which
//   moves logits by up to ~15% of their range. 2.0 only bounds it; what proves a q4_0 cache right
//   is the stored-value comparison below, which is as tight for q4_0 as for f32.
double Tolerance(DType t) {
  switch (t) {
    case DType::kF32:
      return 1e-4;
    case DType::kF16:
      return 2e-2;
    case DType::kBF16:
      return 0.1;
    case DType::kQ8_0:
      return 0.2;
    case DType::kQ4_0:
      return 2.0;
  }
  return 0;
}

// Max |logit - stored-value reference| (the same computation with K/V rounded through the storage
// dtype in the reference too, tiny_transformer.h). What remains is f32 arithmetic (~4e-6, as for
// f32), plus the elements whose f32 value (the model's) and double value (the reference's) fall on
// different sides of a rounding boundary of the storage grid: f16/bf16 flip one ulp of a few
// elements [4.5e-4 measured]; q8_0/q4_0 flip one element by a whole step, rarely (about one per
// case), each moving the logits of the tokens that see it by [1.8e-3 for q8_0, 1.3e-2 for q4_0].
// The bounds allow a few such flips and stay below a one-key visibility error (>= 0.1).
double StoredTolerance(DType t) {
  switch (t) {
    case DType::kF32:
      return 1e-4;
    case DType::kF16:
    case DType::kBF16:
      return 2e-3;
    case DType::kQ8_0:
      return 1e-2;
    case DType::kQ4_0:
      return 5e-2;
  }
  return 0;
}

using Model = TinyModel;
using Shift = TinyModel::Shift;

// The model's cache, however it is built: starts a batch, stores, attends, shifts.
class Backend : public AttentionBackend {
 public:
  virtual Status Begin(std::span<const int32_t> pos, bool multimodal) = 0;
  virtual Status Remove(int32_t begin, int32_t end) = 0;
};

TensorView F32View(const float* p, std::initializer_list<int64_t> ne) {
  return MakeView(const_cast<float*>(p), DType::kF32, ne);
}

// A Cache (causal family, or a wrapper of children) driven as a runtime drives it.
class CacheBackend : public Backend {
 public:
  // wrapper: the same object as cache when it is a WrapperCache (no RTTI in the library).
  CacheBackend(const Model& m, std::unique_ptr<Cache> cache, WrapperCache* wrapper, DType dtype)
      : m_(m), cache_(std::move(cache)), wrapper_(wrapper), dtype_(dtype) {}
  Status Init() { return cache_->Init(dtype_, 1, kCapacity, kMaxBatch); }

  Status Begin(std::span<const int32_t> pos, bool multimodal) override {
    seq_.assign(pos.size(), 0);
    static const int32_t kFirst[1] = {0};
    Batch b{pos, seq_, multimodal ? std::span<const int32_t>(kFirst) : std::span<const int32_t>()};
    return cache_->StartForward(b, false);
  }
  Status Remove(int32_t begin, int32_t end) override { return cache_->Remove(0, begin, end); }

  Status SelfAttention(int layer, int n, std::span<const int32_t>, const float* k, const float* v,
                       const float* q, float* out) override {
    const TinyConfig& c = m_.config();
    Select(layer);
    KV_RETURN_IF_ERROR(cache_->Put(F32View(k, {c.head_dim, c.kv_heads, n}),
                                   F32View(v, {c.head_dim, c.kv_heads, n})));
    const History h = cache_->Get();
    if (h.mask.data == nullptr) return Status::Error(Code::kCorrupt, "self-attention: no mask");
    return Run(h, n, q, out);
  }

  Status CrossAttention(int layer, int n, bool store_encoder, const float* enc_k,
                        const float* enc_v, const float* q, float* out) override {
    const TinyConfig& c = m_.config();
    Select(layer);
    if (store_encoder) {
      // The encoder cache stores K/V as given: hand them over in the storage dtype when that is
      // a float type, so f16/bf16 cases exercise f16/bf16 cross-attention too.
      const DType in = IsQuantized(dtype_) ? DType::kF32 : dtype_;
      const int64_t elems = static_cast<int64_t>(c.head_dim) * c.kv_heads * c.enc_tokens;
      kbuf_.resize(elems * 4);
      vbuf_.resize(elems * 4);
      kernels::ConvertRowRef(enc_k, DType::kF32, kbuf_.data(), in, elems);
      kernels::ConvertRowRef(enc_v, DType::kF32, vbuf_.data(), in, elems);
      KV_RETURN_IF_ERROR(
          cache_->Put(MakeView(kbuf_.data(), in, {c.head_dim, c.kv_heads, c.enc_tokens}),
                      MakeView(vbuf_.data(), in, {c.head_dim, c.kv_heads, c.enc_tokens})));
    }
    const History h = cache_->Get();
    if (h.k.data == nullptr) return Status::Error(Code::kCorrupt, "cross-attention: no encoder");
    if (h.mask.data != nullptr) return Status::Error(Code::kCorrupt, "cross-attention: mask");
    return Run(h, n, q, out);
  }

 private:
  void Select(int layer) {
    cache_->SetLayer(layer);
    if (wrapper_ != nullptr) wrapper_->SetLayerType(m_.layers()[layer].cache_type);
  }
  Status Run(const History& h, int n, const float* q, float* out) {
    const TinyConfig& c = m_.config();
    TensorView ov = F32View(out, {c.head_dim, n, c.n_heads});
    return Attend(F32View(q, {c.head_dim, n, c.n_heads}), h, AttentionParams{}, &ov);
  }

  const Model& m_;
  std::unique_ptr<Cache> cache_;
  WrapperCache* wrapper_ = nullptr;
  DType dtype_;
  std::vector<int32_t> seq_;
  std::vector<uint8_t> kbuf_, vbuf_;
};

// One SequenceCache per layer (the [B, H, T, D] caches); the runtime builds the mask itself.
class SequenceBackend : public Backend {
 public:
  // max_size 0: the growing cache.
  SequenceBackend(const Model& m, int max_size, int keep, DType dtype)
      : m_(m), max_size_(max_size), keep_(keep) {
    for (int l = 0; l < m.num_layers(); ++l)
      caches_.push_back(max_size == 0 ? NewKVCache(dtype)
                                      : NewRotatingKVCache(max_size, keep, dtype));
  }
  Status Begin(std::span<const int32_t>, bool) override { return Status::Ok(); }
  Status Remove(int32_t, int32_t) override {
    return Status::Error(Code::kNotSupported, "sequence caches have no Remove");
  }
  Status CrossAttention(int, int, bool, const float*, const float*, const float*, float*) override {
    return Status::Error(Code::kNotSupported, "no cross-attention here");
  }

  Status SelfAttention(int layer, int n, std::span<const int32_t> pos, const float* k,
                       const float* v, const float* q, float* out) override {
    const TinyConfig& c = m_.config();
    SequenceCache& sc = *caches_[layer];
    const int32_t off = sc.Offset(), held = sc.Len();
    if (off != pos[0]) return Status::Error(Code::kCorrupt, "offset %d, position %d", off, pos[0]);
    // The model's K is [D, H, n] (token slowest); Update takes {D, n, H, B}: a strided view.
    auto as_dnhb = [&](const float* p) {
      TensorView t = F32View(p, {c.head_dim, n, c.kv_heads, 1});
      t.nb[1] = sizeof(float) * c.head_dim * c.kv_heads;
      t.nb[2] = sizeof(float) * c.head_dim;
      t.nb[3] = t.nb[1] * n;
      return t;
    };
    TensorView ko, vo;
    KV_RETURN_IF_ERROR(sc.Update(as_dnhb(k), as_dnhb(v), n, &ko, &vo));
    const int64_t L = ko.ne[1];
    // SEMANTICS.md section 11: how many rows come back.
    int64_t want = off + n;
    if (max_size_ > 0 && off > 0)
      want = n > 1 ? std::min<int64_t>(held, max_size_ - 1) + n : std::min(held + 1, max_size_);
    if (L != want || vo.ne[1] != L || ko.ne[2] != c.kv_heads || ko.ne[3] != 1) {
      return Status::Error(Code::kCorrupt, "Update returned %lld rows, expected %lld",
                           static_cast<long long>(L), static_cast<long long>(want));
    }
    // Row positions: the sinks, then the newest held tokens, then the n new ones.
    const int64_t m = L - n;
    rowpos_.resize(L);
    for (int64_t r = 0; r < L; ++r) rowpos_[r] = r < keep_ ? r : off - (m - r);
    mask_.assign(static_cast<size_t>(L) * n, 0.0f);
    const Visibility& vis = m_.layers()[layer].vis;
    for (int i = 0; i < n; ++i)
      for (int64_t r = 0; r < L; ++r)
        if (!vis.Visible(static_cast<int32_t>(rowpos_[r]), pos[i]))
          mask_[static_cast<size_t>(i) * L + r] = -INFINITY;
    // Attend reads [D, Hkv, L]: dims 1 and 2 of the {D, L, H, B} view swapped (B == 1).
    History h;
    h.k = ko;
    h.v = vo;
    for (TensorView* t : {&h.k, &h.v}) {
      const TensorView s = *t;
      t->ne[1] = s.ne[2];
      t->ne[2] = s.ne[1];
      t->nb[1] = s.nb[2];
      t->nb[2] = s.nb[1];
      t->ne[3] = 1;
    }
    h.mask = F32View(mask_.data(), {L, n});
    TensorView ov = F32View(out, {c.head_dim, n, c.n_heads});
    return Attend(F32View(q, {c.head_dim, n, c.n_heads}), h, AttentionParams{}, &ov);
  }

 private:
  const Model& m_;
  int max_size_, keep_;
  std::vector<std::unique_ptr<SequenceCache>> caches_;
  std::vector<int64_t> rowpos_;
  std::vector<float> mask_;
};

// ---- cases --------------------------------------------------------------------------------------

struct Case {
  std::string name;
  std::vector<LayerSpec> layers;
  std::vector<int> schedule;  // batch sizes, summing to kTokens
  Shift shift;
  bool encoder = false;  // the first batch carries the image (token 0)
  std::function<std::unique_ptr<Backend>(const Model&, DType, Status*)> make;
};

LayerSpec Self(Visibility v, int type = 0) { return LayerSpec{false, v, type}; }
Visibility Causal() { return {}; }
Visibility Window(int32_t w) { return {Visibility::kWindow, w, 0, 0, 0}; }
Visibility Chunked(int32_t c) { return {Visibility::kChunked, 0, c, 0, 0}; }
Visibility Sinks(int32_t max_size, int32_t keep) {
  return {Visibility::kSinks, 0, 0, max_size, keep};
}

// Prompt 5 + 3; singles to the shift at 40; a batch of 4 right after it; a batch of 3 at 60.
std::vector<int> CausalSchedule() {
  std::vector<int> s = {5, 3};
  for (int t = kPrompt; t < 40; ++t) s.push_back(1);
  s.push_back(4);
  for (int t = 44; t < 60; ++t) s.push_back(1);
  s.push_back(3);
  for (int t = 63; t < kTokens; ++t) s.push_back(1);
  return s;
}
// Prompt in one batch (the rotating cache's first Update); multi-token batches after wrap-around.
std::vector<int> SequenceSchedule() {
  std::vector<int> s = {kPrompt};
  for (int t = kPrompt; t < 30; ++t) s.push_back(1);
  s.push_back(3);
  for (int t = 33; t < 50; ++t) s.push_back(1);
  s.push_back(5);
  for (int t = 55; t < kTokens; ++t) s.push_back(1);
  return s;
}

const Shift kShift{40, 4, 17};  // before token 40: drop positions [4, 17), renumber by -13

std::unique_ptr<Backend> MakeCache(const Model& m, std::unique_ptr<Cache> c, DType dt, Status* st) {
  auto b = std::make_unique<CacheBackend>(m, std::move(c), nullptr, dt);
  *st = b->Init();
  return b;
}
std::unique_ptr<Backend> MakeWrapper(const Model& m, std::vector<std::unique_ptr<Cache>> ch,
                                     DType dt, Status* st) {
  std::unique_ptr<WrapperCache> w = NewWrapperCache(std::move(ch));
  WrapperCache* raw = w.get();
  auto b = std::make_unique<CacheBackend>(m, std::move(w), raw, dt);
  *st = b->Init();
  return b;
}

std::vector<Case> AllCases() {
  std::vector<Case> cs;
  cs.push_back({"causal",
                {Self(Causal()), Self(Causal())},
                CausalSchedule(),
                kShift,
                false,
                [](const Model& m, DType dt, Status* st) {
                  return MakeCache(m, NewCausalCache(RopeShiftFn(kRopeBase)), dt, st);
                }});
  cs.push_back({"swa8",
                {Self(Window(8)), Self(Window(8))},
                CausalSchedule(),
                kShift,
                false,
                [](const Model& m, DType dt, Status* st) {
                  return MakeCache(m, NewSWACache(8, RopeShiftFn(kRopeBase)), dt, st);
                }});
  cs.push_back({"chunked8",
                {Self(Chunked(8)), Self(Chunked(8))},
                CausalSchedule(),
                kShift,
                false,
                [](const Model& m, DType dt, Status* st) {
                  return MakeCache(m, NewChunkedAttentionCache(8, RopeShiftFn(kRopeBase)), dt, st);
                }});
  // Interleaved: layer 0 sliding window 6 with memory 10 (child 0), layer 1 causal (child 1).
  cs.push_back({"wrapper_swamem6_causal",
                {Self(Window(6), 0), Self(Causal(), 1)},
                CausalSchedule(),
                kShift,
                false,
                [](const Model& m, DType dt, Status* st) {
                  std::vector<std::unique_ptr<Cache>> ch;
                  ch.push_back(NewSWAMemCache(6, 10, RopeShiftFn(kRopeBase)));
                  ch.push_back(NewCausalCache(RopeShiftFn(kRopeBase)));
                  return MakeWrapper(m, std::move(ch), dt, st);
                }});
  // Encoder-decoder: self (causal child 1), cross (encoder child 0), self. Token 0 carries the
  // image; the shift keeps it, so the encoder stays cached throughout.
  cs.push_back({"wrapper_encoder_causal",
                {Self(Causal(), 1), LayerSpec{true, {}, 0}, Self(Causal(), 1)},
                CausalSchedule(),
                kShift,
                true,
                [](const Model& m, DType dt, Status* st) {
                  std::vector<std::unique_ptr<Cache>> ch;
                  ch.push_back(NewEncoderCache());
                  ch.push_back(NewCausalCache(RopeShiftFn(kRopeBase)));
                  return MakeWrapper(m, std::move(ch), dt, st);
                }});
  cs.push_back({"rotating16_sinks4",
                {Self(Sinks(16, 4)), Self(Sinks(16, 4))},
                SequenceSchedule(),
                Shift{},
                false,
                [](const Model& m, DType dt, Status* st) {
                  *st = Status::Ok();
                  return std::unique_ptr<Backend>(new SequenceBackend(m, 16, 4, dt));
                }});
  cs.push_back({"growing",
                {Self(Causal()), Self(Causal())},
                SequenceSchedule(),
                Shift{},
                false,
                [](const Model& m, DType dt, Status* st) {
                  *st = Status::Ok();
                  return std::unique_ptr<Backend>(new SequenceBackend(m, 0, 0, dt));
                }});
  return cs;
}

struct Param {
  int case_index;
  DType dtype;
};

// GoogleTest prints a parameter without a PrintTo byte by byte, padding included (indeterminate
// bytes: valgrind reports them).
void PrintTo(const Param& p, std::ostream* os) {
  *os << "case " << p.case_index << ", " << DTypeName(p.dtype);
}

class EndToEnd : public ::testing::TestWithParam<Param> {};

TEST_P(EndToEnd, LogitsMatchFullRecompute) {
  static const std::vector<Case> cases = AllCases();
  const Case& cs = cases[GetParam().case_index];
  const DType dt = GetParam().dtype;
  const double tol = Tolerance(dt);
  int total = 0;
  for (int b : cs.schedule) total += b;
  ASSERT_EQ(total, kTokens);

  // Same weights for every case (fixed seed); the reference depends on the case, not the dtype.
  static std::map<int, std::unique_ptr<Model>> models;
  static std::map<int, Model::RefResult> refs;
  const int ci = GetParam().case_index;
  if (models.find(ci) == models.end()) {
    models[ci] = std::make_unique<Model>(TinyConfig{}, cs.layers);
    refs[ci] = models[ci]->Reference(kPromptTokens, kGen, cs.shift);
  }
  const Model& model = *models[ci];
  const Model::RefResult& ref = refs[ci];
  ASSERT_EQ(ref.tokens.size(), static_cast<size_t>(kTokens + 1));
  // The same computation with K/V rounded through the storage dtype, along the same tokens.
  const Model::RefResult stored = model.Reference(kPromptTokens, kGen, cs.shift, dt, &ref.tokens);
  const double stol = StoredTolerance(dt);

  Status st;
  std::unique_ptr<Backend> be = cs.make(model, dt, &st);
  ASSERT_TRUE(st.ok()) << st.message();

  const int vocab = model.config().vocab;
  double max_err = 0, max_err_pre_shift = 0, max_abs_logit = 0, max_stored_err = 0;
  int max_err_token = -1, ids_checked = 0;
  std::vector<float> logits;
  int t = 0;
  for (int n : cs.schedule) {
    if (t == cs.shift.at) {
      st = be->Remove(cs.shift.begin, cs.shift.end);
      ASSERT_TRUE(st.ok()) << "Remove: " << st.message();
    }
    std::span<const int32_t> tok(&ref.tokens[t], n), pos(&ref.positions[t], n);
    const bool image = cs.encoder && t == 0;
    st = be->Begin(pos, image);
    ASSERT_TRUE(st.ok()) << "token " << t << ": StartForward: " << st.message();
    st = model.ForwardBatch(tok, pos, image, be.get(), &logits);
    ASSERT_TRUE(st.ok()) << "token " << t << ": " << st.message();
    for (int i = 0; i < n; ++i) {
      const int ti = t + i;
      const std::vector<double>& want = ref.logits[ti];
      const float* got = &logits[static_cast<size_t>(i) * vocab];
      double err = 0, serr = 0;
      for (int j = 0; j < vocab; ++j) {
        err = std::max(err, std::abs(got[j] - want[j]));
        serr = std::max(serr, std::abs(got[j] - stored.logits[ti][j]));
        max_abs_logit = std::max(max_abs_logit, std::abs(want[j]));
      }
      EXPECT_LE(err, tol) << cs.name << " " << DTypeName(dt) << ": token " << ti << " (position "
                          << ref.positions[ti] << ")";
      EXPECT_LE(serr, stol) << cs.name << " " << DTypeName(dt) << ": token " << ti
                            << " against the stored-value reference";
      max_stored_err = std::max(max_stored_err, serr);
      if (err > max_err) {
        max_err = err;
        max_err_token = ti;
      }
      if (cs.shift.at < 0 || ti < cs.shift.at) max_err_pre_shift = std::max(max_err_pre_shift, err);
      // The generated id, where the reference's margin cannot be closed by the tolerance.
      if (ti + 1 >= kPrompt) {
        std::vector<double> sorted(want);
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        if (sorted[0] - sorted[1] > 2 * tol) {
          ++ids_checked;
          EXPECT_EQ(std::max_element(got, got + vocab) - got, ref.tokens[ti + 1])
              << cs.name << " " << DTypeName(dt) << ": token " << ti;
        }
      }
    }
    t += n;
  }
  std::printf(
      "[ e2e ] %-24s %-5s max|err| %.3g (token %d; before shift %.3g), tol %.3g; vs stored-value "
      "reference %.3g, tol %.3g; max|logit| %.3g, ids checked %d/%d\n",
      cs.name.c_str(), DTypeName(dt), max_err, max_err_token, max_err_pre_shift, tol,
      max_stored_err, stol, max_abs_logit, ids_checked, kGen + 1);
}

std::vector<Param> AllParams() {
  std::vector<Param> ps;
  const int n = static_cast<int>(AllCases().size());
  for (int c = 0; c < n; ++c)
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0})
      ps.push_back({c, d});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(AllKinds, EndToEnd, ::testing::ValuesIn(AllParams()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           static const std::vector<Case> cases = AllCases();
                           return cases[info.param.case_index].name + "_" +
                                  DTypeName(info.param.dtype);
                         });

}  // namespace
}  // namespace kv::tiny

namespace kv::tiny {
namespace {

// The tolerances above mean something only if a cache that shows one key too many or too few, or
// shifts one position wrong, moves the logits by more than them: compare exact references whose
// rules differ by one, along one token sequence.
double MaxLogitDiff(const std::vector<LayerSpec>& a, const Shift& sa,
                    const std::vector<LayerSpec>& b, const Shift& sb) {
  const Model ma(TinyConfig{}, a), mb(TinyConfig{}, b);
  const Model::RefResult ra = ma.Reference(kPromptTokens, kGen, sa);
  const Model::RefResult rb = mb.Reference(kPromptTokens, kGen, sb, std::nullopt, &ra.tokens);
  double m = 0;
  for (int t = 0; t < kTokens; ++t)
    for (size_t j = 0; j < ra.logits[t].size(); ++j)
      m = std::max(m, std::abs(ra.logits[t][j] - rb.logits[t][j]));
  return m;
}

TEST(EndToEndSensitivity, OffByOneRulesMoveLogitsBeyondTolerances) {
  const double bound = 0.1;  // above every stored-value tolerance and f32/f16's exact ones
  const struct {
    const char* what;
    std::vector<LayerSpec> a, b;
    Shift sa, sb;
  } pairs[] = {
      {"window 8 vs 9",
       {Self(Window(8)), Self(Window(8))},
       {Self(Window(9)), Self(Window(9))},
       Shift{},
       Shift{}},
      {"chunk 8 vs 9",
       {Self(Chunked(8)), Self(Chunked(8))},
       {Self(Chunked(9)), Self(Chunked(9))},
       Shift{},
       Shift{}},
      {"sinks keep 4 vs 3",
       {Self(Sinks(16, 4)), Self(Sinks(16, 4))},
       {Self(Sinks(16, 3)), Self(Sinks(16, 3))},
       Shift{},
       Shift{}},
      {"shift [4, 17) vs [5, 17)",
       {Self(Causal()), Self(Causal())},
       {Self(Causal()), Self(Causal())},
       kShift,
       Shift{40, 5, 17}},
  };
  for (const auto& p : pairs) {
    const double d = MaxLogitDiff(p.a, p.sa, p.b, p.sb);
    std::printf("[ e2e ] sensitivity %-28s max|diff| %.3g\n", p.what, d);
    EXPECT_GT(d, bound) << p.what;
  }
}

}  // namespace
}  // namespace kv::tiny
