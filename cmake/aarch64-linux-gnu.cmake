# Cross-compiling for 64-bit Arm Linux on an x86-64 Debian host (the `aarch64` presets,
# `.ci/cross aarch64`): Debian's cross compiler (g++-aarch64-linux-gnu), the arm64 builds of the
# dependencies installed side by side with the host's (multiarch: dpkg --add-architecture arm64;
# libhwy-dev:arm64, ...), and the tests run under qemu-user. qemu finds the arm64 loader and
# libraries where multiarch put them (/lib/aarch64-linux-gnu); pointing it at the cross compiler's
# own sysroot instead (-L /usr/aarch64-linux-gnu) pairs that loader with the multiarch libc, which
# hangs.
set(KVCACHE_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
include(${CMAKE_CURRENT_LIST_DIR}/debian-cross.cmake)
