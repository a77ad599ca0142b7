# Cross-compiling for 32-bit x86 Linux (Debian i386) on an x86-64 Debian host (the `i386` presets,
# `.ci/cross i386`): Debian's cross compiler (g++-i686-linux-gnu) and the i386 builds of the
# dependencies side by side with the host's (multiarch). The x86-64 kernel runs the tests natively,
# so no emulator: the fastest build where size_t and pointers are 32 bits wide, with Highway's
# SSSE3 and SSE4 kernels (1.0.3 leaves AVX2 and AVX-512 out on 32-bit x86) and its scalar target.
# The project adds -msse2 -mfpmath=sse there (CMakeLists.txt, layouts/dtype.h): Debian's i386
# default computes floats on the x87 unit, which the library's rounding does not survive.
set(KVCACHE_CROSS_TRIPLE i686-linux-gnu)
set(CMAKE_SYSTEM_PROCESSOR i686)
include(${CMAKE_CURRENT_LIST_DIR}/debian-cross.cmake)
