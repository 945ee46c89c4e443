# Cross-compiling for aarch64 Linux from an x86-64 Debian/Ubuntu host (scripts/test_aarch64.sh):
# g++-aarch64-linux-gnu (or Clang with VELOXQUANT_CROSS_CLANG=ON: clang++ --target, the same
# sysroot), and qemu-user to run the tests (CMAKE_CROSSCOMPILING_EMULATOR: CTest and GoogleTest's
# test discovery run every test binary through it). Eigen is header-only and found on the host;
# GoogleTest is built from the host's sources for the target (VELOXQUANT_GTEST_SOURCE_DIR).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(VELOXQUANT_CROSS_TRIPLE aarch64-linux-gnu)
if(VELOXQUANT_CROSS_CLANG)
  set(CMAKE_CXX_COMPILER clang++)
  set(CMAKE_CXX_COMPILER_TARGET ${VELOXQUANT_CROSS_TRIPLE})
  set(CMAKE_C_COMPILER clang)
  set(CMAKE_C_COMPILER_TARGET ${VELOXQUANT_CROSS_TRIPLE})
else()
  set(CMAKE_CXX_COMPILER ${VELOXQUANT_CROSS_TRIPLE}-g++)
  set(CMAKE_C_COMPILER ${VELOXQUANT_CROSS_TRIPLE}-gcc)
endif()
set(CMAKE_FIND_ROOT_PATH /usr/${VELOXQUANT_CROSS_TRIPLE})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)  # Eigen3Config.cmake (header-only) from the host
# The guest's library path names the cross libraries first: on a host that also has arm64
# multiarch packages, the loader's cache lists /usr/lib/aarch64-linux-gnu too, and a program that
# mixed the two C libraries hung in its first pthread_create.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/${VELOXQUANT_CROSS_TRIPLE}
    -E LD_LIBRARY_PATH=/usr/${VELOXQUANT_CROSS_TRIPLE}/lib)
set(VELOXQUANT_GTEST_SOURCE_DIR /usr/src/googletest CACHE PATH
    "GoogleTest sources built for the target")
