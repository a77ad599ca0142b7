// The C API (core/kvcache_c.h) against the C++ API: the same random call sequences on a C handle
// and on a C++ cache of each kind give the same codes, the same histories byte for byte and the
// same masks; attention and the sequence caches agree exactly; the configuration fields reach the
// cache. tests/c_api_c_test.c checks the C API from C.
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/kvcache_c_interop.h"
#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "kernels/highway_targets.h"
#include "kvcache/kvcache.h"
#include "kvcache/kvcache_c.h"

namespace {

struct CacheDeleter {
  void operator()(kvc_cache* c) const { kvc_cache_free(c); }
};
using CHandle = std::unique_ptr<kvc_cache, CacheDeleter>;

struct Kind {
  const char* name;
  std::unique_ptr<kv::CausalCache> (*make_cpp)();
  kvc_cache* (*make_c)();
};

const Kind kKinds[] = {
    {"causal", [] { return kv::NewCausalCache(kv::RopeShiftFn(10000.0f)); },
     [] {
       kvc_shift s = {};
       s.rope_base = 10000.0f;
       s.rope_freq_scale = 1.0f;
       return kvc_causal_new(&s);
     }},
    {"swa", [] { return kv::NewSWACache(3, kv::RopeShiftFn(10000.0f)); },
     [] {
       kvc_shift s = {};
       s.rope_base = 10000.0f;
       s.rope_freq_scale = 1.0f;
       return kvc_swa_new(3, &s);
     }},
    {"swa_mem", [] { return kv::NewSWAMemCache(2, 4); },
     [] { return kvc_swa_mem_new(2, 4, nullptr); }},
    {"chunked", [] { return kv::NewChunkedAttentionCache(3); },
     [] { return kvc_chunked_new(3, nullptr); }},
};

// Bytes of rows [0, L) of a [D, H, L] view, row by row (strides may differ between caches only in
// padding, which is not compared).
std::vector<uint8_t> RowBytesOf(const kv::TensorView& v) {
  std::vector<uint8_t> out;
  if (v.data == nullptr) return out;
  const size_t row = kv::RowBytes(v.dtype, v.ne[0]);
  for (int64_t j = 0; j < v.ne[2]; ++j) {
    for (int64_t h = 0; h < v.ne[1]; ++h) {
      const auto* p = static_cast<const uint8_t*>(kv::RowPtr(v, h, j));
      out.insert(out.end(), p, p + row);
    }
  }
  return out;
}

std::vector<float> MaskOf(const kv::TensorView& m) {
  std::vector<float> out;
  for (int64_t i = 0; i < m.ne[1]; ++i) {
    for (int64_t j = 0; j < m.ne[0]; ++j) out.push_back(kv::ElementAsF32(m, j, i));
  }
  return out;
}

void ExpectSameHistory(kv::CausalCache& cpp, kvc_cache* c, int layer) {
  cpp.SetLayer(layer);
  kvc_set_layer(c, layer);
  const kv::History a = cpp.Get();
  kvc_history hc;
  ASSERT_EQ(kvc_get(c, &hc), KVC_OK);
  const kv::History b = kv::HistoryFromC(hc);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(a.k.ne[d], b.k.ne[d]);
    EXPECT_EQ(a.mask.ne[d], b.mask.ne[d]);
  }
  EXPECT_EQ(RowBytesOf(a.k), RowBytesOf(b.k));
  EXPECT_EQ(RowBytesOf(a.v), RowBytesOf(b.v));
  EXPECT_EQ(MaskOf(a.mask), MaskOf(b.mask));
}

TEST(CApi, RandomCallsMatchTheCppApiForEveryCausalKind) {
  for (const Kind& kind : kKinds) {
    for (kv::DType dt : {kv::DType::kF16, kv::DType::kQ8_0}) {
      SCOPED_TRACE(std::string(kind.name) + " dtype " + std::to_string(static_cast<int>(dt)));
      std::mt19937 rng(7);
      auto cpp = kind.make_cpp();
      CHandle c(kind.make_c());
      ASSERT_NE(c, nullptr);
      kv::CacheConfig cfg;
      cfg.padding = 2;
      cfg.mask_dtype = kv::DType::kF16;
      cfg.window_convention = kv::WindowConvention::kInclusive;
      kvc_config ccfg = kvc_config_default();
      ccfg.padding = 2;
      ccfg.mask_dtype = KVC_F16;
      ccfg.window_inclusive = 1;
      ASSERT_TRUE(cpp->SetConfig(cfg).ok());
      ASSERT_EQ(kvc_set_config(c.get(), &ccfg), KVC_OK);
      constexpr int kSeqs = 3, kCap = 12, kBatch = 4, kD = 32, kH = 2, kLayers = 2;
      ASSERT_TRUE(cpp->Init(dt, kSeqs, kCap, kBatch).ok());
      ASSERT_EQ(kvc_init(c.get(), static_cast<kvc_dtype>(dt), kSeqs, kCap, kBatch), KVC_OK);
      std::vector<int32_t> next(kSeqs, 0);
      std::uniform_real_distribution<float> val(-2.0f, 2.0f);
      int forwards = 0, failed_forwards = 0, middle_removes = 0;
      for (int step = 0; step < 60; ++step) {
        const int op = static_cast<int>(rng() % 10);
        if (op < 6) {  // a forward pass with Puts into every layer
          const int b = 1 + static_cast<int>(rng() % (kBatch + 1));  // kBatch + 1 is an error
          std::vector<int32_t> pos(b), seq(b);
          for (int i = 0; i < b; ++i) {
            seq[i] = static_cast<int32_t>(rng() % kSeqs);
            pos[i] = next[seq[i]] + (rng() % 8 == 0 ? 1 : 0);
          }
          kv::Batch batch;
          batch.positions = pos;
          batch.sequences = seq;
          const kv::Status s = cpp->StartForward(batch, false);
          const kvc_code code =
              kvc_start_forward(c.get(), pos.data(), seq.data(), b, nullptr, 0, 0);
          ASSERT_EQ(static_cast<int>(s.code()), static_cast<int>(code)) << s.message();
          if (!s.ok()) {
            EXPECT_STREQ(kvc_last_error(), s.message());
            ++failed_forwards;
            continue;
          }
          ++forwards;
          for (int i = 0; i < b; ++i) next[seq[i]] = std::max(next[seq[i]], pos[i] + 1);
          std::vector<float> k(static_cast<size_t>(kD) * kH * b), v(k.size());
          for (float& x : k) x = val(rng);
          for (float& x : v) x = val(rng);
          for (int l = 0; l < kLayers; ++l) {
            cpp->SetLayer(l);
            kvc_set_layer(c.get(), l);
            const kv::TensorView kt = kv::MakeView(k.data(), kv::DType::kF32, {kD, kH, b});
            const kv::TensorView vt = kv::MakeView(v.data(), kv::DType::kF32, {kD, kH, b});
            const int64_t ne[3] = {kD, kH, b};
            const kvc_tensor kc = kvc_make_tensor(k.data(), KVC_F32, 3, ne);
            const kvc_tensor vc = kvc_make_tensor(v.data(), KVC_F32, 3, ne);
            ASSERT_TRUE(cpp->Put(kt, vt).ok());
            ASSERT_EQ(kvc_put(c.get(), &kc, &vc), KVC_OK);
          }
          for (int l = 0; l < kLayers; ++l) ExpectSameHistory(*cpp, c.get(), l);
        } else if (op < 8) {  // Remove a middle range or the tail
          const int seq = static_cast<int>(rng() % kSeqs);
          const int32_t begin = static_cast<int32_t>(rng() % 8);
          const int32_t end = rng() % 2 ? kv::kPosMax : begin + 1 + static_cast<int32_t>(rng() % 3);
          const kv::Status s = cpp->Remove(seq, begin, end);
          ASSERT_EQ(static_cast<int>(s.code()),
                    static_cast<int>(kvc_remove(c.get(), seq, begin, end)))
              << s.message();
          if (s.ok() && end == kv::kPosMax) next[seq] = std::min(next[seq], begin);
          middle_removes += s.ok() && end != kv::kPosMax;
        } else if (op < 9) {  // CopyPrefix
          const int src = static_cast<int>(rng() % kSeqs), dst = static_cast<int>(rng() % kSeqs);
          const int32_t len = static_cast<int32_t>(rng() % 10);
          const kv::Status s = cpp->CopyPrefix(src, dst, len);
          ASSERT_EQ(static_cast<int>(s.code()),
                    static_cast<int>(kvc_copy_prefix(c.get(), src, dst, len)));
        } else {
          for (int seq = 0; seq < kSeqs; ++seq) {
            for (int32_t p = 0; p < 14; ++p) {
              EXPECT_EQ(cpp->CanResume(seq, p), kvc_can_resume(c.get(), seq, p) == 1);
            }
          }
        }
      }
      // The script reached the interesting paths: passes that land, batches the cache refuses,
      // and removals that shift later tokens.
      EXPECT_GE(forwards, 10);
      EXPECT_GE(failed_forwards, 1);
      EXPECT_GE(middle_removes, 1);
      EXPECT_EQ(cpp->MemoryBytes(), kvc_memory_bytes(c.get()));
      // Saved streams are identical.
      std::vector<uint8_t> a;
      ASSERT_TRUE(kv::SaveCache(*cpp, &a).ok());
      size_t size = 0;
      ASSERT_EQ(kvc_save(c.get(), -1, nullptr, 0, &size), KVC_OK);
      std::vector<uint8_t> b(size);
      ASSERT_EQ(kvc_save(c.get(), -1, b.data(), b.size(), &size), KVC_OK);
      EXPECT_EQ(a, b);
    }
  }
}

TEST(CApi, AttentionAndParallelForMatchTheCppApi) {
  auto cpp = kv::NewCausalCache();
  ASSERT_TRUE(cpp->Init(kv::DType::kQ8_0, 1, 64, 8).ok());
  std::vector<int32_t> pos(8), seq(8, 0);
  for (int i = 0; i < 8; ++i) pos[i] = i;
  kv::Batch batch;
  batch.positions = pos;
  batch.sequences = seq;
  ASSERT_TRUE(cpp->StartForward(batch, false).ok());
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  constexpr int kD = 64, kHkv = 2, kHq = 8;
  std::vector<float> k(kD * kHkv * 8), v(k.size()), q(kD * 8 * kHq), sinks(kHq);
  for (float& x : k) x = val(rng);
  for (float& x : v) x = val(rng);
  for (float& x : q) x = val(rng);
  for (float& x : sinks) x = val(rng);
  cpp->SetLayer(0);
  ASSERT_TRUE(cpp->Put(kv::MakeView(k.data(), kv::DType::kF32, {kD, kHkv, 8}),
                       kv::MakeView(v.data(), kv::DType::kF32, {kD, kHkv, 8}))
                  .ok());
  const kv::History h = cpp->Get();
  kv::AttentionParams p;
  p.softcap = 5.0f;
  p.sinks = sinks.data();
  std::vector<float> want(q.size()), got(q.size()), got_pf(q.size());
  kv::TensorView out = kv::MakeView(want.data(), kv::DType::kF32, {kD, 8, kHq});
  const kv::TensorView qv = kv::MakeView(q.data(), kv::DType::kF32, {kD, 8, kHq});
  ASSERT_TRUE(kv::Attend(qv, h, p, &out).ok());

  const kvc_history hc = kv::HistoryToC(h);
  const kvc_tensor qc = kv::ViewToC(qv);
  kvc_attention_params cp = kvc_attention_params_default();
  cp.softcap = 5.0f;
  cp.sinks = sinks.data();
  kvc_tensor oc = kv::ViewToC(kv::MakeView(got.data(), kv::DType::kF32, {kD, 8, kHq}));
  ASSERT_EQ(kvc_attend(&qc, &hc, &cp, &oc, nullptr), KVC_OK);
  EXPECT_EQ(want, got);

  // A caller's parallel-for that runs the tasks in reverse order and counts them.
  struct Counter {
    int64_t tasks = 0;
  } counter;
  kvc_parallel_for pf;
  pf.run = [](void* user, int64_t n, void (*task)(void*, int64_t), void* ctx) {
    static_cast<Counter*>(user)->tasks += n;
    for (int64_t i = n - 1; i >= 0; --i) task(ctx, i);
  };
  pf.user = &counter;
  pf.num_threads = 2;
  kvc_tensor opf = kv::ViewToC(kv::MakeView(got_pf.data(), kv::DType::kF32, {kD, 8, kHq}));
  ASSERT_EQ(kvc_attend_parallel(&qc, &hc, &cp, &opf, &pf), KVC_OK);
  EXPECT_GT(counter.tasks, 0);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(want[i], got_pf[i], 1e-5f) << i;

  // The integer passes' flags reach the kernel: a decode row (B = 1) with integer_k and integer_v
  // gives the C++ result with them, which differs from the f32 result where they run (AVX3_DL).
  kv::History h1 = h;
  h1.mask.ne[1] = 1;
  const kv::TensorView q1 = kv::MakeView(q.data(), kv::DType::kF32, {kD, 1, kHq});
  std::vector<float> f32_1(kD * kHq), int_1(kD * kHq), c_1(kD * kHq);
  kv::TensorView o1 = kv::MakeView(f32_1.data(), kv::DType::kF32, {kD, 1, kHq});
  ASSERT_TRUE(kv::Attend(q1, h1, p, &o1).ok());
  p.integer_k = p.integer_v = true;
  o1.data = int_1.data();
  ASSERT_TRUE(kv::Attend(q1, h1, p, &o1).ok());
  cp.integer_k = cp.integer_v = 1;
  const kvc_history hc1 = kv::HistoryToC(h1);
  const kvc_tensor qc1 = kv::ViewToC(q1);
  kvc_tensor oc1 = kv::ViewToC(kv::MakeView(c_1.data(), kv::DType::kF32, {kD, 1, kHq}));
  ASSERT_EQ(kvc_attend(&qc1, &hc1, &cp, &oc1, nullptr), KVC_OK);
  EXPECT_EQ(c_1, int_1);
  EXPECT_EQ(f32_1 != int_1, kv::kernels::DispatchedTarget() == HWY_AVX3_DL);
}

TEST(CApi, SequenceCachesMatchTheCppApi) {
  for (int rotating = 0; rotating < 2; ++rotating) {
    auto cpp = rotating ? kv::NewRotatingKVCache(40, 2, kv::DType::kBF16)
                        : kv::NewKVCache(kv::DType::kBF16);
    kvc_seq_cache* c =
        rotating ? kvc_rotating_cache_new(40, 2, KVC_BF16) : kvc_kv_cache_new(KVC_BF16);
    ASSERT_NE(c, nullptr);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> val(-3.0f, 3.0f);
    for (int step = 0; step < 30; ++step) {
      const int n = step % 7 == 0 ? 17 : 1;
      std::vector<float> k(static_cast<size_t>(16) * n * 2), v(k.size());
      for (float& x : k) x = val(rng);
      for (float& x : v) x = val(rng);
      const kv::TensorView kt = kv::MakeView(k.data(), kv::DType::kF32, {16, n, 2, 1});
      const kv::TensorView vt = kv::MakeView(v.data(), kv::DType::kF32, {16, n, 2, 1});
      kv::TensorView ka, va;
      ASSERT_TRUE(cpp->Update(kt, vt, n, &ka, &va).ok());
      const int64_t ne[4] = {16, n, 2, 1};
      const kvc_tensor kc = kvc_make_tensor(k.data(), KVC_F32, 4, ne);
      const kvc_tensor vc = kvc_make_tensor(v.data(), KVC_F32, 4, ne);
      kvc_tensor kb, vb;
      ASSERT_EQ(kvc_seq_update(c, &kc, &vc, n, &kb, &vb), KVC_OK);
      ASSERT_EQ(ka.ne[1], kb.ne[1]);
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t t = 0; t < ka.ne[1]; ++t) {
          EXPECT_EQ(0, std::memcmp(kv::RowPtr(ka, t, h), kv::RowPtr(kv::ViewFromC(kb), t, h), 32));
          EXPECT_EQ(0, std::memcmp(kv::RowPtr(va, t, h), kv::RowPtr(kv::ViewFromC(vb), t, h), 32));
        }
      }
      EXPECT_EQ(cpp->Offset(), kvc_seq_offset(c));
      EXPECT_EQ(cpp->Len(), kvc_seq_len(c));
    }
    std::vector<uint8_t> a;
    ASSERT_TRUE(kv::SaveSequenceCache(*cpp, &a).ok());
    size_t size = 0;
    ASSERT_EQ(kvc_seq_save(c, nullptr, 0, &size), KVC_OK);
    std::vector<uint8_t> b(size);
    ASSERT_EQ(kvc_seq_save(c, b.data(), b.size(), &size), KVC_OK);
    EXPECT_EQ(a, b);
    kvc_seq_cache_free(c);
  }
}

// Init (1 sequence, 8 cells, batch 2), one pass of positions 0 and 1 and a Put of `kv` (as K and
// V, 2 tokens) into layer 0; layer_type >= 0 selects a wrapper's child first.
void InitAndPutTwoTokens(kvc_cache* c, kvc_dtype dtype, int layer_type, const kvc_tensor& kv) {
  ASSERT_EQ(kvc_init(c, dtype, 1, 8, 2), KVC_OK);
  const int32_t pos[2] = {0, 1}, seq[2] = {0, 0};
  ASSERT_EQ(kvc_start_forward(c, pos, seq, 2, nullptr, 0, 0), KVC_OK);
  if (layer_type >= 0) {
    ASSERT_EQ(kvc_set_layer_type(c, layer_type), KVC_OK);
  }
  kvc_set_layer(c, 0);
  ASSERT_EQ(kvc_put(c, &kv, &kv), KVC_OK);
}

TEST(CApi, FilesRoundTripAndBadHandlesAreRejected) {
  const std::string path = ::testing::TempDir() + "kvc_c_api_test.kvc";
  kvc_cache* c = kvc_causal_new(nullptr);
  float x[4] = {1, 2, 3, 4};
  const int64_t ne[3] = {2, 1, 2};
  const kvc_tensor t = kvc_make_tensor(x, KVC_F32, 3, ne);
  InitAndPutTwoTokens(c, KVC_F32, -1, t);
  ASSERT_EQ(kvc_save_file(c, path.c_str(), -1), KVC_OK);
  kvc_cache* d = kvc_causal_new(nullptr);
  ASSERT_EQ(kvc_init(d, KVC_F32, 1, 8, 2), KVC_OK);
  ASSERT_EQ(kvc_load_file(d, path.c_str(), -1), KVC_OK);
  EXPECT_EQ(kvc_can_resume(d, 0, 2), 1);
  EXPECT_EQ(kvc_load_file(d, (path + ".missing").c_str(), -1), KVC_INVALID_ARGUMENT);

  // NULL handles and arguments: an error code and a message, never a crash.
  EXPECT_EQ(kvc_init(nullptr, KVC_F32, 1, 8, 2), KVC_INVALID_ARGUMENT);
  EXPECT_NE(std::strlen(kvc_last_error()), 0u);
  EXPECT_EQ(kvc_put(c, nullptr, &t), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_get(c, nullptr), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_save(c, -1, nullptr, 0, nullptr), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_load(c, nullptr, 10, -1), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_can_resume(nullptr, 0, 0), 0);
  EXPECT_EQ(kvc_memory_bytes(nullptr), 0u);
  EXPECT_EQ(kvc_set_causal(c, nullptr, 1), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_set_causal(c, nullptr, 0), KVC_OK);
  // An out-of-range dtype is the C++ API's kInvalidArgument, not undefined behaviour.
  kvc_cache* e = kvc_causal_new(nullptr);
  EXPECT_EQ(kvc_init(e, static_cast<kvc_dtype>(9), 1, 8, 2), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_init(e, static_cast<kvc_dtype>(-5), 1, 8, 2), KVC_INVALID_ARGUMENT);
  EXPECT_EQ(kvc_init(e, static_cast<kvc_dtype>(70000), 1, 8, 2), KVC_INVALID_ARGUMENT);
  const kvc_tensor bad = kvc_make_tensor(x, static_cast<kvc_dtype>(9), 3, ne);
  EXPECT_EQ(bad.nb[0], 0u);
  EXPECT_STREQ(kvc_code_name(static_cast<kvc_code>(1000)), "unknown");
  kvc_cache_free(c);
  kvc_cache_free(d);
  kvc_cache_free(e);
}

TEST(CApi, HandlesExposeTheirCppObjects) {
  kvc_cache* children[2] = {kvc_encoder_new_per_sequence(1), kvc_swa_new(2, nullptr)};
  kv::EncoderCache* enc = kv::EncoderFromC(children[0]);
  kv::CausalCache* swa = kv::CausalFromC(children[1]);
  ASSERT_NE(enc, nullptr);
  ASSERT_NE(swa, nullptr);
  EXPECT_EQ(kv::CausalFromC(children[0]), nullptr);
  EXPECT_EQ(kv::WrapperFromC(children[1]), nullptr);
  EXPECT_EQ(kv::CacheFromC(nullptr), nullptr);
  kvc_cache* w = kvc_wrapper_new(children, 2);
  ASSERT_NE(w, nullptr);
  kv::WrapperCache* wc = kv::WrapperFromC(w);
  ASSERT_NE(wc, nullptr);
  EXPECT_EQ(kv::CacheFromC(w), static_cast<kv::Cache*>(wc));
  // The children are the wrapper's own objects, reachable through either API.
  EXPECT_EQ(wc->Child(0), static_cast<kv::Cache*>(enc));
  EXPECT_EQ(wc->Child(1), static_cast<kv::Cache*>(swa));
  EXPECT_EQ(kv::CausalFromC(kvc_wrapper_child(w, 1)), swa);
  float x[4] = {1, 2, 3, 4};
  const int64_t ne[3] = {2, 1, 2};
  InitAndPutTwoTokens(w, KVC_F16, 1, kvc_make_tensor(x, KVC_F32, 3, ne));
  EXPECT_TRUE(swa->CanResume(0, 2));  // the tokens reached the child's C++ object
  EXPECT_EQ(kv::LoadAsF32(kv::RowPtr(swa->Get().k, 0, 1), kv::DType::kF16, 0), 3.0f);
  EXPECT_TRUE(swa->CheckConsistency().ok());
  EXPECT_FALSE(enc->EncoderCached());
  kvc_cache_free(w);
}

}  // namespace
