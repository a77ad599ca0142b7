// The Highway target list, checked by every translation unit of kernels/ that includes Highway.
//
// Every unit of the project compiles the same targets: Highway 1.0.3's default list plus AVX3_DL
// (AVX-512 with VNNI, VBMI and VBMI2: Ice Lake and later, Zen 4), which 1.0.3 leaves out unless
// HWY_WANT_AVX3_DL is defined. The attention kernels need it (q8_0's integer K and V passes use
// vpdpbusd / vpdpwssd). CMakeLists.txt defines it for all units.
//
// Why one list for all: Highway maps the chosen target to a slot of a unit's dispatch table with
// an inline function built from the including unit's list (hwy::ChosenTarget::GetIndex).
// Optimized code inlines it; at -O0 the linker keeps one unit's copy, and with two lists a call
// reaches another list's slot. Until session 41 only the attention units asked for AVX3_DL, and a
// Debug build crashed in BuildMask, which called the empty AVX3_DL slot of mask.cc's table.
#ifndef KVCACHE_KERNELS_HIGHWAY_TARGETS_H_
#define KVCACHE_KERNELS_HIGHWAY_TARGETS_H_

#ifndef HWY_WANT_AVX3_DL
#error "define HWY_WANT_AVX3_DL for every unit (CMakeLists.txt does): see kernels/highway_targets.h"
#endif

#include <cstdint>
#include <vector>

#include "hwy/targets.h"

namespace kv::kernels {

// The targets HWY_DYNAMIC_DISPATCH can pick in this build on this CPU, best first: the compiled
// targets (HWY_TARGETS) that libhwy's CPU detection reports. Where it reports none of them, the
// dispatch tables fall back to the static target (Highway's HWY_CHOOSE_FALLBACK), so that one is
// returned. This happens when libhwy was built for a lower baseline than this project: Debian's
// armhf libhwy (VFPv3, no NEON) reports only SCALAR and EMU128, and the armhf preset compiles NEON
// alone; hwy::SupportedAndGeneratedTargets() is then empty. Tests and the perf programs enumerate
// targets with this function instead, and hwy::SetSupportedTargetsForTest(t) works for each t.
inline std::vector<int64_t> DispatchableTargets() {
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  if (targets.empty()) targets.push_back(HWY_STATIC_TARGET);
  return targets;
}

// The target the kernels run on now (the first of DispatchableTargets()).
inline int64_t DispatchedTarget() {
  const int64_t t = hwy::SupportedTargets() & HWY_TARGETS;
  return t != 0 ? t & -t : HWY_STATIC_TARGET;
}

}  // namespace kv::kernels

#endif  // KVCACHE_KERNELS_HIGHWAY_TARGETS_H_
