// No heap allocation in steady-state decode (ARCHITECTURE.md rules of the house): after warm-up,
// StartForward + Put + Get + Attend for B = 1 allocate nothing, for every cache kind of the causal
// family and every storage dtype, with Attend on the calling thread and on a 2-thread pool.
//
// Allocations are counted by tests/malloc_hooks.cc, which this executable links: it defines malloc
// and its relatives, so the counter sees every heap allocation in the process. Sanitizer builds
// bring their own malloc; there the tests skip.
//
// Warm-up, as a runtime does it: Init, one reserve pass (StartForward(reserve = true) with the
// largest batch, then Put, Get and Attend on every layer: it allocates the layers, grows the mask
// to B x cells and Attend's per-thread scratch to the largest history), then a few ordinary steps.
// Each pool worker is also made to run one decode-shaped Attend, because a worker's per-thread
// scratch is created by the first task it happens to take.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/kvcache_c_interop.h"
#include "core/sequence_cache.h"
#include "core/thread_pool.h"
#include "decode_driver.h"
#include "gtest/gtest.h"
#include "hwy/aligned_allocator.h"
#include "malloc_hooks.h"

namespace kv {
namespace {

using heap_hooks::g_allocations;
using heap_hooks::g_counting;
using testing::AllCacheKinds;
using testing::CacheKind;
using testing::Driver;
using testing::kAllDTypes;

TEST(NoAllocation, TheCounterSeesEveryKindOfAllocation) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  // volatile: the compiler may not elide an allocation whose pointer escapes.
  void* volatile a = nullptr;
  int* volatile b = nullptr;
  void* volatile c = nullptr;
  g_allocations = 0;
  g_counting = true;
  a = std::malloc(10);
  b = new int[4];
  c = std::aligned_alloc(64, 128);
  g_counting = false;
  std::free(a);
  delete[] b;
  std::free(c);
  EXPECT_EQ(g_allocations.load(), 3);
  // Allocations inside the library and inside Highway's shared library are seen too.
  g_allocations = 0;
  g_counting = true;
  {
    auto cache = NewCausalCache();
    EXPECT_TRUE(cache->Init(DType::kF16, 1, 16, 4).ok());
    auto buf = hwy::AllocateAligned<float>(100);
    EXPECT_NE(buf.get(), nullptr);
  }
  g_counting = false;
  EXPECT_GE(g_allocations.load(), 3);
}

struct Barrier {
  std::atomic<int> arrived{0};
  int n = 0;
};

// Runs one decode-shaped Attend (single-threaded) on the calling thread: grows that thread's
// attention scratch as a B = 1 task would.
struct WorkerWarmup {
  Barrier barrier;
  TensorView q, out;
  History hist;
};

void WarmWorker(void* ctx, int64_t i) {
  auto* w = static_cast<WorkerWarmup*>(ctx);
  w->barrier.arrived.fetch_add(1);
  while (w->barrier.arrived.load() < w->barrier.n) {
  }  // every thread takes exactly one task
  TensorView out = w->out;
  out.data = static_cast<float*>(out.data) + i * out.ne[0] * out.ne[2];  // a row of its own
  (void)Attend(w->q, w->hist, AttentionParams(), &out);
}

// Warm-up as described at the top, then `steps` decode steps of one token under the counter.
// Returns the allocations counted; *ok is false when a call failed.
int64_t MeasureDecodeOnThisThread(const CacheKind& kind, DType dtype, int threads, int steps,
                                  bool reserve, bool* ok);

// Runs on a fresh thread: Attend's per-thread scratch of an earlier measurement must not count as
// this one's warm-up.
int64_t MeasureDecode(const CacheKind& kind, DType dtype, int threads, int steps, bool reserve,
                      bool* ok) {
  int64_t n = -1;
  std::thread t([&] { n = MeasureDecodeOnThisThread(kind, dtype, threads, steps, reserve, ok); });
  t.join();
  return n;
}

int64_t MeasureDecodeOnThisThread(const CacheKind& kind, DType dtype, int threads, int steps,
                                  bool reserve, bool* ok) {
  *ok = false;
  Driver d;
  auto cache = kind.make();
  if (!cache->Init(dtype, 1, 256, d.max_batch).ok()) return -1;
  ThreadPool pool(threads);
  ThreadPool* p = threads > 1 ? &pool : nullptr;
  std::vector<float> out(d.layers * d.out.size());
  if (reserve) {
    if (!cache->StartForward(d.SetRun(0, 0, d.max_batch), true).ok()) return -1;
    for (int l = 0; l < d.layers; ++l) {
      cache->SetLayer(l);
      if (!cache
               ->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, d.max_batch}),
                     MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, d.max_batch}))
               .ok())
        return -1;
      TensorView qv = MakeView(d.q.data(), DType::kF32, {d.dk, d.max_batch, d.q_heads});
      TensorView ov = MakeView(out.data(), DType::kF32, {d.dv, d.max_batch, d.q_heads});
      if (!Attend(qv, cache->Get(), AttentionParams(), &ov, p).ok()) return -1;
      // The same history as a decode row (B = 1) sizes the calling thread's decode scratch.
      History h = cache->Get();
      h.mask.ne[1] = 1;
      TensorView q1 = MakeView(d.q.data(), DType::kF32, {d.dk, 1, d.q_heads});
      TensorView o1 = MakeView(out.data(), DType::kF32, {d.dv, 1, d.q_heads});
      if (!Attend(q1, h, AttentionParams(), &o1, p).ok()) return -1;
    }
  }
  if (!d.Prefill(cache.get(), 0, 0, 8, out.data()).ok()) return -1;
  int32_t pos = 8;
  for (int t = 0; t < 4; ++t) {
    d.seq[0] = 0;
    d.pos[0] = pos++;
    if (!d.Step(cache.get(), 1, out.data(), p).ok()) return -1;
  }
  if (threads > 1) {
    WorkerWarmup w;
    w.barrier.n = pool.NumThreads();
    cache->SetLayer(0);
    w.hist = cache->Get();
    w.q = MakeView(d.q.data(), DType::kF32, {d.dk, 1, d.q_heads});
    std::vector<float> wout(static_cast<size_t>(pool.NumThreads()) * d.dv * d.q_heads);
    w.out = MakeView(wout.data(), DType::kF32, {d.dv, 1, d.q_heads});
    pool.Run(pool.NumThreads(), WarmWorker, &w);
  }
  bool all_ok = true;
  g_allocations = 0;
  g_counting = true;
  for (int t = 0; t < steps; ++t) {
    d.seq[0] = 0;
    d.pos[0] = pos++;
    all_ok &= d.Step(cache.get(), 1, out.data(), p).ok();
  }
  g_counting = false;
  *ok = all_ok;
  return g_allocations.load();
}

TEST(NoAllocation, SteadyStateDecodeEveryKindDTypeAndThreadCount) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  for (const CacheKind& kind : AllCacheKinds()) {
    for (DType dtype : kAllDTypes) {
      for (int threads : {1, 2}) {
        bool ok = false;
        const int64_t n = MeasureDecode(kind, dtype, threads, 100, /*reserve=*/true, &ok);
        EXPECT_TRUE(ok) << kind.name << " " << DTypeName(dtype) << " threads " << threads;
        EXPECT_EQ(n, 0) << kind.name << " " << DTypeName(dtype) << " threads " << threads;
      }
    }
  }
}

// step(n, reserve) runs one forward pass of n tokens. The warm-up of the top comment (a reserve
// pass of max_batch tokens, a prefill of 8, warm_steps decode steps), then 100 decode steps under
// the counter: returns the allocations they made.
template <class Step>
int64_t CountDecodeAllocations(const Step& step, int max_batch, int warm_steps) {
  step(max_batch, true);
  step(8, false);
  for (int i = 0; i < warm_steps; ++i) step(1, false);
  g_allocations = 0;
  g_counting = true;
  for (int i = 0; i < 100; ++i) step(1, false);
  g_counting = false;
  return g_allocations.load();
}

// The wrapper (SWA + causal, interleaved layers) and the rotating / growing sequence caches.
TEST(NoAllocation, SteadyStateDecodeWrapperAndSequenceCaches) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  int64_t wrapper_allocs = -1, rotating_allocs = -1, growing_allocs = -1;
  bool ok = true;
  std::thread t([&] {
    Driver d;
    std::vector<std::unique_ptr<Cache>> children;
    children.push_back(NewSWACache(8));
    children.push_back(NewCausalCache());
    auto w = NewWrapperCache(std::move(children));
    ok &= w->Init(DType::kF16, 1, 256, d.max_batch).ok();
    std::vector<float> out(d.out.size());
    int32_t pos = 0;
    auto step = [&](int n, bool reserve) {
      ok &= w->StartForward(d.SetRun(0, pos, n), reserve).ok();
      for (int l = 0; l < 4; ++l) {
        w->SetLayer(l);
        w->SetLayerType(l % 2);
        ok &= w->Put(MakeView(d.k.data(), DType::kF32, {d.dk, d.kv_heads, n}),
                     MakeView(d.v.data(), DType::kF32, {d.dv, d.kv_heads, n}))
                  .ok();
        TensorView q = MakeView(d.q.data(), DType::kF32, {d.dk, n, d.q_heads});
        TensorView o = MakeView(out.data(), DType::kF32, {d.dv, n, d.q_heads});
        History h = w->Get();
        ok &= Attend(q, h, AttentionParams(), &o).ok();
        if (reserve) {  // size the decode scratch for the longest history
          h.mask.ne[1] = 1;
          TensorView q1 = MakeView(d.q.data(), DType::kF32, {d.dk, 1, d.q_heads});
          TensorView o1 = MakeView(out.data(), DType::kF32, {d.dv, 1, d.q_heads});
          ok &= Attend(q1, h, AttentionParams(), &o1).ok();
        }
      }
      if (!reserve) pos += n;
    };
    wrapper_allocs = CountDecodeAllocations(step, d.max_batch, 4);

    // Sequence caches: one token per Update after warm-up; the rotating cache wraps around
    // (max_size 64, slack 256; warm-up: long enough for the block to reach its full size and wrap),
    // the growing one stays inside its first 256-token block.
    const int D = 32, H = 2;
    std::vector<float> kv(static_cast<size_t>(D) * H, 0.25f);
    TensorView ko, vo;
    for (int kind = 0; kind < 2; ++kind) {
      auto c = kind == 0 ? NewRotatingKVCache(64, 4, DType::kQ8_0) : NewKVCache(DType::kF16);
      for (int i = 0; i < (kind == 0 ? 1000 : 16); ++i)
        ok &= c->Update(MakeView(kv.data(), DType::kF32, {D, 1, H, 1}),
                        MakeView(kv.data(), DType::kF32, {D, 1, H, 1}), 1, &ko, &vo)
                  .ok();
      g_allocations = 0;
      g_counting = true;
      for (int i = 0; i < (kind == 0 ? 600 : 200); ++i)
        ok &= c->Update(MakeView(kv.data(), DType::kF32, {D, 1, H, 1}),
                        MakeView(kv.data(), DType::kF32, {D, 1, H, 1}), 1, &ko, &vo)
                  .ok();
      g_counting = false;
      (kind == 0 ? rotating_allocs : growing_allocs) = g_allocations.load();
    }
  });
  t.join();
  EXPECT_TRUE(ok);
  EXPECT_EQ(wrapper_allocs, 0);
  EXPECT_EQ(rotating_allocs, 0);
  EXPECT_EQ(growing_allocs, 0);
}

// The C API (core/kvcache_c.h) adds nothing on the decode path: a sliding-window q8_0 cache driven
// by kvc_start_forward / kvc_put / kvc_get / kvc_attend_parallel on a 2-thread pool, warmed up as
// above (a reserve pass, ordinary steps, and one decode-shaped Attend on each worker).
TEST(NoAllocation, SteadyStateDecodeThroughTheCApi) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  int64_t allocs = -1;
  bool ok = true;
  std::thread t([&] {
    Driver d;
    ThreadPool pool(2);
    kvc_parallel_for pf;
    pf.run = [](void* user, int64_t n, void (*task)(void*, int64_t), void* ctx) {
      static_cast<ThreadPool*>(user)->Run(n, task, ctx);
    };
    pf.user = &pool;
    pf.num_threads = pool.NumThreads();
    kvc_cache* c = kvc_swa_new(16, nullptr);
    ok &= kvc_init(c, KVC_Q8_0, 1, 256, d.max_batch) == KVC_OK;
    std::vector<float> out(d.out.size());
    int32_t pos = 0;
    auto step = [&](int n, bool reserve) {
      d.SetRun(0, pos, n);
      ok &= kvc_start_forward(c, d.pos.data(), d.seq.data(), n, nullptr, 0, reserve) == KVC_OK;
      const int64_t k_ne[3] = {d.dk, d.kv_heads, n}, v_ne[3] = {d.dv, d.kv_heads, n};
      const int64_t q_ne[3] = {d.dk, n, d.q_heads}, o_ne[3] = {d.dv, n, d.q_heads};
      const kvc_tensor k = kvc_make_tensor(d.k.data(), KVC_F32, 3, k_ne);
      const kvc_tensor v = kvc_make_tensor(d.v.data(), KVC_F32, 3, v_ne);
      const kvc_tensor q = kvc_make_tensor(d.q.data(), KVC_F32, 3, q_ne);
      kvc_tensor o = kvc_make_tensor(out.data(), KVC_F32, 3, o_ne);
      for (int l = 0; l < d.layers; ++l) {
        kvc_set_layer(c, l);
        ok &= kvc_put(c, &k, &v) == KVC_OK;
        kvc_history h;
        ok &= kvc_get(c, &h) == KVC_OK;
        ok &= kvc_attend_parallel(&q, &h, nullptr, &o, &pf) == KVC_OK;
        if (reserve) {  // size the decode scratch: this thread's, then each worker's
          h.mask.ne[1] = 1;
          const int64_t q1_ne[3] = {d.dk, 1, d.q_heads}, o1_ne[3] = {d.dv, 1, d.q_heads};
          const kvc_tensor q1 = kvc_make_tensor(d.q.data(), KVC_F32, 3, q1_ne);
          kvc_tensor o1 = kvc_make_tensor(out.data(), KVC_F32, 3, o1_ne);
          ok &= kvc_attend(&q1, &h, nullptr, &o1, nullptr) == KVC_OK;
          WorkerWarmup w;
          w.barrier.n = pool.NumThreads();
          w.hist = HistoryFromC(h);
          w.q = ViewFromC(q1);
          std::vector<float> wout(static_cast<size_t>(pool.NumThreads()) * d.dv * d.q_heads);
          w.out = MakeView(wout.data(), DType::kF32, {d.dv, 1, d.q_heads});
          pool.Run(pool.NumThreads(), WarmWorker, &w);
        }
      }
      if (!reserve) pos += n;
    };
    allocs = CountDecodeAllocations(step, d.max_batch, 8);
    kvc_cache_free(c);
  });
  t.join();
  EXPECT_TRUE(ok);
  EXPECT_EQ(allocs, 0);
}

// Without the reserve pass, only ordinary decode steps as warm-up: the history grows by one cell a
// step, and nothing in the cache or in Attend may grow with it.
// Attend's span scratch (B * (L / 2 + 1) slots) used to be reallocated to the exact size whenever
// L grew, i.e. every second decode step (50 allocations in 100 steps); it now grows
// geometrically from a floor that covers these histories.
TEST(NoAllocation, SteadyStateDecodeWithoutAReservePass) {
  KV_SKIP_UNLESS_MALLOC_HOOKED();
  for (const CacheKind& kind : AllCacheKinds()) {
    for (int threads : {1, 2}) {
      bool ok = false;
      const int64_t n = MeasureDecode(kind, DType::kF16, threads, 100, /*reserve=*/false, &ok);
      EXPECT_TRUE(ok);
      EXPECT_EQ(n, 0) << kind.name << " threads " << threads;
    }
  }
}

}  // namespace
}  // namespace kv
