# Cross-compiling for 32-bit Arm Linux (armv7-a, hard float, NEON) on an x86-64 Debian host (the
# `armhf` presets, `.ci/cross armhf`): Debian's cross compiler (g++-arm-linux-gnueabihf), the armhf
# builds of the dependencies installed side by side with the host's (multiarch), and the tests run
# under qemu-user, as for aarch64 (cmake/aarch64-linux-gnu.cmake). This is the 32-bit edge target
# (Cortex-A7/A9/A53 boards on a 32-bit OS): size_t and pointers are 32 bits wide, which the x86-64
# and aarch64 builds cannot exercise.
#
# Debian's armhf default is VFPv3-D16 without NEON, where Highway 1.0.3 falls back to its scalar
# emulation; -mfpu=neon-vfpv4 gives Highway's NEON target (armv7 NEON: no f64 vectors, no division,
# subnormals flushed; FMA from VFPv4), the one such a board runs. VFPv4 also converts f16 <-> f32,
# which makes Highway 1.0.3 name the compiler's __fp16 as hwy::float16_t; GCC defines __fp16 on
# armv7 only with -mfp16-format. Debian's libhwy itself is built without NEON and reports only
# SCALAR and EMU128 at run time; kv::kernels::DispatchableTargets() (kernels/highway_targets.h)
# accounts for that.
set(KVCACHE_CROSS_TRIPLE arm-linux-gnueabihf)
set(CMAKE_SYSTEM_PROCESSOR armv7l)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-arm)
set(CMAKE_C_FLAGS_INIT "-mfpu=neon-vfpv4 -mfp16-format=ieee")
set(CMAKE_CXX_FLAGS_INIT "-mfpu=neon-vfpv4 -mfp16-format=ieee")
include(${CMAKE_CURRENT_LIST_DIR}/debian-cross.cmake)
