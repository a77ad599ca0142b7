// The FMA-peak baseline the benchmarks compare arithmetic with: how many flops the machine does
// when it does nothing but multiply-adds.
//
// What is measured: independent FMA chains on the best target Highway dispatches to, on every
// thread of a kv::ThreadPool, for about 10 ms per run; flops (2 per lane and FMA) / wall seconds of
// the run, the pool's dispatch included (as it is in the kernel timings compared with it).
#ifndef KVCACHE_PERF_FMA_PEAK_H_
#define KVCACHE_PERF_FMA_PEAK_H_

#include "core/thread_pool.h"

namespace kvbench {

// One run on every thread of `pool` (at most 64 threads): flop/s.
double FmaPeakRun(kv::ThreadPool& pool);

// The best of `runs` runs (flop/s), so that one quiet moment of a shared machine is enough.
double MeasureFmaPeak(kv::ThreadPool& pool, int runs);

}  // namespace kvbench

#endif  // KVCACHE_PERF_FMA_PEAK_H_
