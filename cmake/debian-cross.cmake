# The part of the cross toolchain files (cmake/aarch64-linux-gnu.cmake, arm-linux-gnueabihf.cmake,
# i686-linux-gnu.cmake, s390x-linux-gnu.cmake) that every Debian multiarch target shares. The
# including file sets KVCACHE_CROSS_TRIPLE (the GNU triple: Debian's compiler prefix and multiarch
# directory), CMAKE_SYSTEM_PROCESSOR and, where the host cannot run the binaries itself,
# CMAKE_CROSSCOMPILING_EMULATOR first.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_C_COMPILER ${KVCACHE_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${KVCACHE_CROSS_TRIPLE}-g++)
set(CMAKE_LIBRARY_ARCHITECTURE ${KVCACHE_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH /usr/${KVCACHE_CROSS_TRIPLE} /usr/lib/${KVCACHE_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
# Headers and CMake packages: the target's own live under /usr/lib/<triple>, the
# architecture-independent ones (CLI11, nlohmann-json, GoogleTest's headers) under /usr.
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
