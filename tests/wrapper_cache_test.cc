// Wrapper cache (SEMANTICS.md section 10) against hand-written fake children that record calls.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/cache.h"
#include "gtest/gtest.h"

namespace kv {
namespace {

// A child that logs every call as "<name>.<Call>(args)" into a shared log and fails on demand.
class FakeCache : public Cache {
 public:
  FakeCache(std::string name, std::vector<std::string>* log) : name_(std::move(name)), log_(log) {}

  Code fail_init = Code::kOk;
  Code fail_check_config = Code::kOk;  // what CheckConfig / CheckInit report
  Code fail_check_init = Code::kOk;
  Code fail_check_start = Code::kOk;  // what CheckStartForward reports
  Code fail_start = Code::kOk;        // what StartForward itself returns
  Code fail_remove = Code::kOk;
  Code fail_copy = Code::kOk;
  bool can_resume = true;
  bool supports_copy = true;
  size_t bytes = 0;
  int puts = 0;
  History history;  // what Get returns

  Status SetConfig(const CacheConfig& c) override {
    Log("SetConfig(" + std::to_string(c.padding) + ")");
    return Status::Ok();
  }
  Status CheckConfig(const CacheConfig&) const override { return Result(fail_check_config); }
  Status CheckInit(DType, int, int, int) const override { return Result(fail_check_init); }
  Status Init(DType, int seqs, int cap, int batch) override {
    Log("Init(" + std::to_string(seqs) + "," + std::to_string(cap) + "," + std::to_string(batch) +
        ")");
    return Result(fail_init);
  }
  Status CheckStartForward(const Batch&, bool) override { return Result(fail_check_start); }
  Status StartForward(const Batch& b, bool reserve) override {
    Log("StartForward(" + std::to_string(b.positions.size()) + (reserve ? ",reserve)" : ")"));
    return Result(fail_start);
  }
  void SetLayer(int layer) override { Log("SetLayer(" + std::to_string(layer) + ")"); }
  Status Put(const TensorView&, const TensorView&) override {
    Log("Put");
    ++puts;
    return Status::Ok();
  }
  History Get() override {
    Log("Get");
    return history;
  }
  Status CopyPrefix(int src, int dst, int32_t len) override {
    Log("CopyPrefix(" + std::to_string(src) + "," + std::to_string(dst) + "," +
        std::to_string(len) + ")");
    return Result(fail_copy);
  }
  bool CanResume(int, int32_t) const override { return can_resume; }
  Status Remove(int seq, int32_t b, int32_t e) override {
    Log("Remove(" + std::to_string(seq) + "," + std::to_string(b) + "," +
        (e == kPosMax ? std::string("end") : std::to_string(e)) + ")");
    return Result(fail_remove);
  }
  void Close() override { Log("Close"); }
  size_t MemoryBytes() const override { return bytes; }
  bool SupportsCopyPrefix() const override { return supports_copy; }

 private:
  void Log(const std::string& s) { log_->push_back(name_ + "." + s); }
  static Status Result(Code c) {
    return c == Code::kOk ? Status::Ok() : Status::Error(c, "fake failure");
  }
  std::string name_;
  std::vector<std::string>* log_;
};

struct Fixture {
  std::vector<std::string> log;
  std::vector<FakeCache*> fakes;
  std::unique_ptr<WrapperCache> wrapper;

  explicit Fixture(int n) {
    std::vector<std::unique_ptr<Cache>> children;
    for (int i = 0; i < n; ++i) {
      std::string name = "c";
      name += static_cast<char>('0' + i);  // (GCC 12 warns falsely on "c" + to_string)
      auto f = std::make_unique<FakeCache>(name, &log);
      fakes.push_back(f.get());
      children.push_back(std::move(f));
    }
    wrapper = NewWrapperCache(std::move(children));
  }
};

using Log = std::vector<std::string>;

TEST(WrapperCache, FactoryRejectsEmptyOrNullChildren) {
  EXPECT_EQ(NewWrapperCache({}), nullptr);
  std::vector<std::unique_ptr<Cache>> with_null;
  with_null.push_back(nullptr);
  EXPECT_EQ(NewWrapperCache(std::move(with_null)), nullptr);
}

TEST(WrapperCache, ConfigInitSetLayerCloseReachEveryChild) {
  Fixture f(2);
  CacheConfig cfg;
  cfg.padding = 4;
  ASSERT_TRUE(f.wrapper->SetConfig(cfg).ok());
  ASSERT_TRUE(f.wrapper->Init(DType::kF16, 2, 128, 16).ok());
  f.wrapper->SetLayer(7);
  f.wrapper->Close();
  EXPECT_EQ(f.log,
            (Log{"c0.SetConfig(4)", "c1.SetConfig(4)", "c0.Init(2,128,16)", "c1.Init(2,128,16)",
                 "c0.SetLayer(7)", "c1.SetLayer(7)", "c0.Close", "c1.Close"}));
}

TEST(WrapperCache, ConfigAndInitCheckEveryChildBeforeChangingAny) {
  // A child that would refuse the arguments is found before any child is configured or
  // initialized: the wrapper's error changes nothing.
  Fixture f(3);
  f.fakes[2]->fail_check_config = Code::kInvalidArgument;
  f.fakes[1]->fail_check_init = Code::kInvalidArgument;
  CacheConfig cfg;
  cfg.padding = 2;
  EXPECT_EQ(f.wrapper->SetConfig(cfg).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.wrapper->CheckConfig(cfg).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.wrapper->Init(DType::kF32, 1, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.wrapper->CheckInit(DType::kF32, 1, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.log, Log{});
}

TEST(WrapperCache, InitFailingInALaterChildClosesEveryChild) {
  // Arguments every child accepted, then child 1 runs out of memory: child 0 is already
  // initialized, so every child is closed (a first Init: the state before the call; the children
  // never disagree about what they hold).
  Fixture f(3);
  f.fakes[1]->fail_init = Code::kOutOfMemory;
  EXPECT_EQ(f.wrapper->Init(DType::kF32, 1, 16, 4).code(), Code::kOutOfMemory);
  EXPECT_EQ(f.log, (Log{"c0.Init(1,16,4)", "c1.Init(1,16,4)", "c0.Close", "c1.Close", "c2.Close"}));
}

TEST(WrapperCache, RealChildRefusingTheConfigLeavesTheOthersUnconfigured) {
  // The encoder cannot pad; the causal child before it must not keep padding 2 (its history
  // would come back padded to 4 cells instead of 3).
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(NewCausalCache());
  children.push_back(NewEncoderCache());
  auto w = NewWrapperCache(std::move(children));
  CacheConfig cfg;
  cfg.padding = 2;
  EXPECT_EQ(w->SetConfig(cfg).code(), Code::kInvalidArgument);
  ASSERT_TRUE(w->Init(DType::kF32, 1, 16, 4).ok());
  const int32_t pos[] = {0, 1, 2};
  const int32_t seq[] = {0, 0, 0};
  ASSERT_TRUE(w->StartForward(Batch{pos, seq, {}}, false).ok());
  w->SetLayer(0);
  w->SetLayerType(0);
  EXPECT_EQ(w->Get().mask.ne[0], 3);
}

TEST(WrapperCache, RealChildRefusingInitLeavesTheOthersAsTheyWere) {
  // SWA with memory 2 below its window 4 is refused for one sequence (for two, memory becomes
  // window + 1): neither a first Init nor a re-Init may change the causal child before it.
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(NewCausalCache());
  children.push_back(NewSWAMemCache(4, 2));
  auto w = NewWrapperCache(std::move(children));
  auto* causal = static_cast<CausalCache*>(w->Child(0));
  const int32_t pos[] = {0, 1, 2};
  const int32_t seq[] = {0, 0, 0};
  EXPECT_EQ(w->Init(DType::kF32, 1, 16, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(causal->StartForward(Batch{pos, seq, {}}, false).code(), Code::kInvalidArgument)
      << "the causal child was initialized by a failed Init";

  ASSERT_TRUE(w->Init(DType::kF32, 2, 16, 4).ok());
  ASSERT_TRUE(w->StartForward(Batch{pos, seq, {}}, false).ok());
  EXPECT_EQ(causal->NumCells(), 32);
  EXPECT_EQ(w->Init(DType::kF32, 1, 64, 4).code(), Code::kInvalidArgument);
  EXPECT_EQ(causal->NumCells(), 32);
  const int32_t next_pos[] = {3};
  const int32_t next_seq[] = {0};
  ASSERT_TRUE(causal->StartForward(Batch{next_pos, next_seq, {}}, false).ok());
  EXPECT_EQ(causal->Get().mask.ne[0], 4) << "the causal child lost its tokens";
}

TEST(WrapperCache, StartForwardAsksEveryChildBeforeStartingAny) {
  // The last child would refuse the batch: no child starts it, so none needs unwinding.
  for (bool reserve : {false, true}) {
    Fixture f(3);
    f.fakes[2]->fail_check_start = Code::kCacheFull;
    const int32_t pos[] = {7, 8, 3};
    const int32_t seq[] = {0, 0, 1};
    EXPECT_EQ(f.wrapper->StartForward(Batch{pos, seq, {}}, reserve).code(), Code::kCacheFull);
    EXPECT_EQ(f.log, Log{});
    EXPECT_EQ(f.wrapper->CheckStartForward(Batch{pos, seq, {}}, reserve).code(), Code::kCacheFull);
  }
  // The first refusal in child order is the one returned.
  Fixture f(3);
  f.fakes[1]->fail_check_start = Code::kInvalidArgument;
  f.fakes[2]->fail_check_start = Code::kCacheFull;
  const int32_t pos[] = {0};
  const int32_t seq[] = {0};
  EXPECT_EQ(f.wrapper->StartForward(Batch{pos, seq, {}}, false).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.log, Log{});
}

TEST(WrapperCache, StartForwardUnwindsEarlierChildrenWhenALaterOneFailsAfterItsCheck) {
  // A child that fails only when it runs (out of memory, or a child of the caller's own that
  // does not check ahead): the earlier children are unwound as in Ollama.
  Fixture f(3);
  f.fakes[2]->fail_start = Code::kCacheFull;
  const int32_t pos[] = {7, 8, 3};
  const int32_t seq[] = {0, 0, 1};
  Batch b{pos, seq, {}};
  EXPECT_EQ(f.wrapper->StartForward(b, false).code(), Code::kCacheFull);
  // Children 1 then 0 drop every batch token's position to the end of its sequence; the failing
  // child (which left itself unchanged) is not touched again.
  EXPECT_EQ(f.log, (Log{"c0.StartForward(3)", "c1.StartForward(3)", "c2.StartForward(3)",
                        "c1.Remove(0,7,end)", "c1.Remove(0,8,end)", "c1.Remove(1,3,end)",
                        "c0.Remove(0,7,end)", "c0.Remove(0,8,end)", "c0.Remove(1,3,end)"}));
}

TEST(WrapperCache, FirstChildFailingNeedsNoUnwind) {
  Fixture f(2);
  f.fakes[0]->fail_start = Code::kInvalidArgument;
  const int32_t pos[] = {0};
  const int32_t seq[] = {0};
  EXPECT_EQ(f.wrapper->StartForward(Batch{pos, seq, {}}, false).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.log, (Log{"c0.StartForward(1)"}));
}

TEST(WrapperCache, ReservePassIsNotUnwound) {
  // A reserve pass changes no metadata; removing its positions would delete real tokens.
  Fixture f(2);
  f.fakes[1]->fail_start = Code::kCacheFull;
  const int32_t pos[] = {0, 1};
  const int32_t seq[] = {0, 0};
  EXPECT_EQ(f.wrapper->StartForward(Batch{pos, seq, {}}, true).code(), Code::kCacheFull);
  EXPECT_EQ(f.log, (Log{"c0.StartForward(2,reserve)", "c1.StartForward(2,reserve)"}));
}

TEST(WrapperCache, LayerTypeRoutesPutAndGet) {
  Fixture f(2);
  float a = 1, b = 2;
  f.fakes[0]->history.k.data = &a;
  f.fakes[1]->history.k.data = &b;
  TensorView kv = MakeView(&a, DType::kF32, {1, 1, 1});
  EXPECT_EQ(f.wrapper->NumChildren(), 2);
  EXPECT_EQ(f.wrapper->UnderlyingCache(), f.fakes[0]);  // type 0 by default
  f.wrapper->SetLayerType(1);
  EXPECT_EQ(f.wrapper->UnderlyingCache(), f.fakes[1]);
  EXPECT_EQ(f.wrapper->Child(1), f.fakes[1]);
  EXPECT_EQ(f.wrapper->Child(2), nullptr);
  ASSERT_TRUE(f.wrapper->Put(kv, kv).ok());
  EXPECT_EQ(f.wrapper->Get().k.data, &b);
  EXPECT_EQ(f.fakes[0]->puts, 0);
  EXPECT_EQ(f.fakes[1]->puts, 1);
  // StartForward resets the type to 0 (as Ollama).
  const int32_t pos[] = {0};
  const int32_t seq[] = {0};
  ASSERT_TRUE(f.wrapper->StartForward(Batch{pos, seq, {}}, false).ok());
  EXPECT_EQ(f.wrapper->Get().k.data, &a);
  // An unknown type selects nothing.
  f.wrapper->SetLayerType(5);
  EXPECT_EQ(f.wrapper->UnderlyingCache(), nullptr);
  EXPECT_EQ(f.wrapper->Put(kv, kv).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.wrapper->Get().k.data, nullptr);
}

TEST(WrapperCache, CanResumeIsTheAnd) {
  Fixture f(3);
  EXPECT_TRUE(f.wrapper->CanResume(0, 5));
  f.fakes[1]->can_resume = false;
  EXPECT_FALSE(f.wrapper->CanResume(0, 5));
}

TEST(WrapperCache, RemoveStopsAtTheFirstError) {
  Fixture f(3);
  ASSERT_TRUE(f.wrapper->Remove(1, 2, 5).ok());
  f.fakes[1]->fail_remove = Code::kNotSupported;
  EXPECT_EQ(f.wrapper->Remove(0, 2, 5).code(), Code::kNotSupported);
  EXPECT_EQ(f.log, (Log{"c0.Remove(1,2,5)", "c1.Remove(1,2,5)", "c2.Remove(1,2,5)",
                        "c0.Remove(0,2,5)", "c1.Remove(0,2,5)"}));
}

TEST(WrapperCache, CopyPrefixReachesEveryChildOrNone) {
  Fixture f(2);
  ASSERT_TRUE(f.wrapper->CopyPrefix(0, 1, 9).ok());
  EXPECT_EQ(f.log, (Log{"c0.CopyPrefix(0,1,9)", "c1.CopyPrefix(0,1,9)"}));
  f.log.clear();
  // A child that can never copy (a single-sequence encoder) makes the wrapper refuse up front,
  // wherever it sits, so no child is left half copied.
  f.fakes[1]->supports_copy = false;
  EXPECT_FALSE(f.wrapper->SupportsCopyPrefix());
  EXPECT_EQ(f.wrapper->CopyPrefix(0, 1, 9).code(), Code::kNotSupported);
  EXPECT_TRUE(f.log.empty());
  // Any other error stops at the child that reports it.
  f.fakes[1]->supports_copy = true;
  f.fakes[0]->fail_copy = Code::kInvalidArgument;
  EXPECT_EQ(f.wrapper->CopyPrefix(0, 9, 9).code(), Code::kInvalidArgument);
  EXPECT_EQ(f.log, (Log{"c0.CopyPrefix(0,9,9)"}));
}

TEST(WrapperCache, CopyPrefixWithRealEncoders) {
  std::vector<std::unique_ptr<Cache>> single;
  single.push_back(NewEncoderCache());
  auto w = NewWrapperCache(std::move(single));
  ASSERT_TRUE(w->Init(DType::kF32, 1, 16, 4).ok());
  EXPECT_EQ(w->CopyPrefix(0, 0, 4).code(), Code::kNotSupported);

  std::vector<std::unique_ptr<Cache>> per_seq;
  per_seq.push_back(NewEncoderCache(EncoderOptions{.per_sequence = true}));
  auto w2 = NewWrapperCache(std::move(per_seq));
  ASSERT_TRUE(w2->Init(DType::kF32, 2, 16, 4).ok());
  EXPECT_TRUE(w2->CopyPrefix(0, 1, 4).ok());
}

// UnderlyingCache() returns a Cache*; the seeds reach the encoder's EncoderCached through a type
// assertion, and a consumer built with RTTI (the default) writes dynamic_cast. Until core was
// built with RTTI the library's caches carried no type information and that cast crashed.
TEST(WrapperCache, ChildrenCanBeDowncastWithDynamicCast) {
#ifndef __cpp_rtti
  GTEST_SKIP() << "built without RTTI";
#else
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(NewEncoderCache());
  children.push_back(NewCausalCache());
  children.push_back(NewSWACache(4));
  auto w = NewWrapperCache(std::move(children));
  ASSERT_NE(w, nullptr);
  Cache* as_cache = w.get();
  EXPECT_EQ(dynamic_cast<WrapperCache*>(as_cache), w.get());
  EXPECT_EQ(dynamic_cast<CausalCache*>(as_cache), nullptr);

  w->SetLayerType(0);
  auto* encoder = dynamic_cast<EncoderCache*>(w->UnderlyingCache());
  ASSERT_NE(encoder, nullptr);
  EXPECT_FALSE(encoder->EncoderCached());
  EXPECT_EQ(dynamic_cast<CausalCache*>(w->UnderlyingCache()), nullptr);
  for (int type : {1, 2}) {
    w->SetLayerType(type);
    EXPECT_NE(dynamic_cast<CausalCache*>(w->UnderlyingCache()), nullptr) << type;
    EXPECT_EQ(dynamic_cast<EncoderCache*>(w->UnderlyingCache()), nullptr) << type;
  }
#endif
}

// The sanitizer build checks that a downcast reaches an object of that type (UBSan's vptr check,
// which needs core/'s RTTI): a static_cast of a causal cache to EncoderCache stops the program
// with a report. Without the check the same call reads a CausalCache as an EncoderCache.
TEST(DowncastDeathTest, WrongStaticDowncastIsReportedBySanitizer) {
#if !KV_UBSAN_VPTR
  GTEST_SKIP() << "UBSan's vptr check runs in the sanitizer build only";
#else
  std::unique_ptr<Cache> causal = NewCausalCache();
  ASSERT_NE(causal, nullptr);
  EXPECT_DEATH(static_cast<void>(static_cast<EncoderCache*>(causal.get())->EncoderCached()),
               "downcast of address .* which does not point to an object of type "
               "'(kv::)?EncoderCache'");  // g++ names it without the namespace
#endif
}

TEST(WrapperCache, SetAllocatorReachesEveryChild) {
  int calls = 0;
  ArenaAllocator counting{[](size_t bytes, void* ctx) {
                            ++*static_cast<int*>(ctx);
                            return SystemAllocator().allocate(bytes, nullptr);
                          },
                          [](void* p, void*) { SystemAllocator().release(p, nullptr); }, &calls};
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(NewEncoderCache());
  children.push_back(NewEncoderCache());
  auto w = NewWrapperCache(std::move(children));
  ASSERT_TRUE(w->SetAllocator(counting).ok());
  ASSERT_TRUE(w->Init(DType::kF32, 1, 16, 4).ok());
  const int32_t pos[] = {0};
  const int32_t seq[] = {0};
  const int32_t mm[] = {0};
  ASSERT_TRUE(w->StartForward(Batch{pos, seq, mm}, false).ok());
  std::vector<float> x(8, 1.0f);
  TensorView t = MakeView(x.data(), DType::kF32, {4, 2, 1});
  for (int type = 0; type < 2; ++type) {
    w->SetLayerType(type);
    ASSERT_TRUE(w->Put(t, t).ok());
  }
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(w->SetAllocator(counting).code(), Code::kInvalidArgument);
}

TEST(WrapperCache, MemoryIsReportedPerChild) {
  Fixture f(3);
  f.fakes[0]->bytes = 1000;
  f.fakes[1]->bytes = 24;
  f.fakes[2]->bytes = 0;
  EXPECT_EQ(f.wrapper->MemoryBytes(), 1024u);
  EXPECT_EQ(f.wrapper->ChildMemoryBytes(), (std::vector<size_t>{1000, 24, 0}));
}

TEST(WrapperCache, UnwindLeavesARealEncoderChildConsistent) {
  // Encoder first, then a child that reports kCacheFull: the unwind's Remove calls reach the
  // encoder; its image (at position 2, before the failed batch) stays cached.
  std::vector<std::string> log;
  std::vector<std::unique_ptr<Cache>> children;
  children.push_back(NewEncoderCache());
  auto fake = std::make_unique<FakeCache>("full", &log);
  FakeCache* full = fake.get();
  children.push_back(std::move(fake));
  auto w = NewWrapperCache(std::move(children));
  ASSERT_TRUE(w->Init(DType::kF32, 1, 64, 8).ok());
  auto* enc = static_cast<EncoderCache*>(w->Child(0));

  const int32_t pos0[] = {0, 1, 2, 3};
  const int32_t seq0[] = {0, 0, 0, 0};
  const int32_t mm0[] = {2};
  ASSERT_TRUE(w->StartForward(Batch{pos0, seq0, mm0}, false).ok());
  std::vector<float> img(8, 1.0f);
  TensorView t = MakeView(img.data(), DType::kF32, {4, 1, 2});
  w->SetLayer(0);
  w->SetLayerType(0);
  ASSERT_TRUE(w->Put(t, t).ok());
  EXPECT_TRUE(enc->EncoderCached());

  full->fail_start = Code::kCacheFull;
  const int32_t pos1[] = {4, 5};
  const int32_t seq1[] = {0, 0};
  EXPECT_EQ(w->StartForward(Batch{pos1, seq1, {}}, false).code(), Code::kCacheFull);
  EXPECT_TRUE(enc->EncoderCached());
  // A failed batch that rewound over the image does invalidate it (the image token is gone).
  const int32_t pos2[] = {2, 3};
  EXPECT_EQ(w->StartForward(Batch{pos2, seq1, {}}, false).code(), Code::kCacheFull);
  EXPECT_FALSE(enc->EncoderCached());
}

}  // namespace
}  // namespace kv
