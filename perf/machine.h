// What a benchmark report says about the machine it ran on, shared by the perf programs.
#ifndef KVCACHE_PERF_MACHINE_H_
#define KVCACHE_PERF_MACHINE_H_

#include <cstdint>

#include "hwy/targets.h"
#include "kernels/highway_targets.h"

namespace kvbench {

// The target HWY_DYNAMIC_DISPATCH picks in the kernels: the best one this CPU supports among those
// compiled, or the static target where libhwy reports none of them. Every unit of the project
// compiles the same list (HWY_TARGETS, AVX3_DL included: kernels/highway_targets.h).
inline const char* DispatchedTargetName() {
  return hwy::TargetName(kv::kernels::DispatchedTarget());
}

}  // namespace kvbench

#endif  // KVCACHE_PERF_MACHINE_H_
