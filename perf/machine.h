// What a benchmark report says about the machine it ran on, shared by the perf programs.
#ifndef KVCACHE_PERF_MACHINE_H_
#define KVCACHE_PERF_MACHINE_H_

#include <cstdint>

#include "hwy/targets.h"

namespace kvbench {

// The target HWY_DYNAMIC_DISPATCH picks in the kernels: the best (lowest bit) one this CPU supports
// among those compiled. Every unit of the project compiles the same list (HWY_TARGETS, AVX3_DL
// included: kernels/highway_targets.h).
inline const char* DispatchedTargetName() {
  const int64_t t = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(t & -t);
}

}  // namespace kvbench

#endif  // KVCACHE_PERF_MACHINE_H_
