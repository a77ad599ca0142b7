// What a benchmark report says about the machine it ran on, shared by the perf programs.
#ifndef KVCACHE_PERF_MACHINE_H_
#define KVCACHE_PERF_MACHINE_H_

#include <cstdint>

#include "hwy/targets.h"

namespace kvbench {

// The target HWY_DYNAMIC_DISPATCH picks in a translation unit compiled for the targets `compiled`:
// the best (lowest bit) one this CPU supports. Pass HWY_TARGETS for a unit built like the caller;
// the attention units also compile AVX3_DL (HWY_WANT_AVX3_DL in kernels/attention*.cc).
inline const char* DispatchedTargetName(int64_t compiled) {
  const int64_t t = hwy::SupportedTargets() & compiled;
  return hwy::TargetName(t & -t);
}

}  // namespace kvbench

#endif  // KVCACHE_PERF_MACHINE_H_
