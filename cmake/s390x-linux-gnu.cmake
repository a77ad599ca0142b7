# Cross-compiling for IBM Z Linux (Debian s390x) on an x86-64 Debian host (the `s390x` presets,
# `.ci/cross s390x`), with the tests under qemu-user: the big-endian build. Highway 1.0.3 has no
# vector target there (its scalar and EMU128 ones run), so this checks byte order, not speed: the
# mask bitmaps and the save/load stream, whose integers and K/V values are little-endian on every
# machine (core/persistence.h), went wrong here until session 43.
set(KVCACHE_CROSS_TRIPLE s390x-linux-gnu)
set(CMAKE_SYSTEM_PROCESSOR s390x)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-s390x)
include(${CMAKE_CURRENT_LIST_DIR}/debian-cross.cmake)
