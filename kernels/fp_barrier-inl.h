// Per-target helpers that keep a product rounded to f32 before it is added or converted.
//
// Why: bit-exactness with the scalar references (llama.cpp's quantizers, the RoPE reference)
// needs x * y rounded on its own. GCC's C++ default is -ffp-contract=fast, and on FMA targets it
// fuses even Highway's separate Mul and Add (or vectorizes a scalar tail into vfmaddsub);
// `#pragma GCC optimize("fp-contract=off")` does not stop it. An empty asm that "modifies" the
// register hides the value from the optimizer at no run-time cost. Only x86 targets with FMA
// instructions (AVX2 and up) need it; SSE4, SSSE3 and SCALAR have none, so there it is a no-op
// (which also keeps clang happy: it rejects tied memory operands on non-register types). Since
// session 40 the project is compiled with -ffp-contract=off on every platform (CMakeLists.txt),
// which covers the references as well; the barrier stays so that these kernels keep their promise
// when built by other means (another build system, flags that override ours). On aarch64 it is a
// no-op.
//
// Include inside a Highway per-target translation unit, after hwy/highway.h.
#if defined(KVCACHE_KERNELS_FP_BARRIER_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVCACHE_KERNELS_FP_BARRIER_INL_H_
#undef KVCACHE_KERNELS_FP_BARRIER_INL_H_
#else
#define KVCACHE_KERNELS_FP_BARRIER_INL_H_
#endif

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kv::kernels {
namespace HWY_NAMESPACE {

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && (defined(__GNUC__) || defined(__clang__))
#if HWY_TARGET <= HWY_AVX3
#define KV_FP_BARRIER_REG "+v"  // any of zmm0-31
#else
#define KV_FP_BARRIER_REG "+x"  // any of ymm0-15
#endif
template <class V>
HWY_INLINE V KeepRounded(V v) {
  asm("" : KV_FP_BARRIER_REG(v.raw));
  return v;
}
HWY_INLINE float KeepRoundedScalar(float f) {
  asm("" : KV_FP_BARRIER_REG(f));
  return f;
}
#undef KV_FP_BARRIER_REG
#else
template <class V>
HWY_INLINE V KeepRounded(V v) {
  return v;
}
HWY_INLINE float KeepRoundedScalar(float f) { return f; }
#endif

}  // namespace HWY_NAMESPACE
}  // namespace kv::kernels
HWY_AFTER_NAMESPACE();

#endif  // KVCACHE_KERNELS_FP_BARRIER_INL_H_
