#!/usr/bin/env bash
# The C ABI's tests (c_api.shared, c_api.exports) under GCC's AddressSanitizer and
# UndefinedBehaviorSanitizer, the library included: libveloxquant_c is compiled with the
# sanitizers too (the suite's VELOXQUANT_SANITIZE instruments only the test drivers, the library
# staying the package's build). A C caller may pass any int where the header declares an enum;
# this is the build that reports the library reading one it should not (docs/c_abi.md, Errors and
# Tests). Halts on the first report: any report fails the run.
#
# Builds only the shared veloxquant_c and its C driver, in their own directory, Debug (-O0 -g).
# c_api.static runs the same program against an archive of the same objects: the suite runs it,
# and here it would only run the same program a second time.
# Environment: BUILD_DIR (default build-c-ubsan), JOBS (default nproc), CC / CXX (default gcc /
# g++: GCC's UBSan checks enum loads, -fsanitize=enum, which is how the bug this guards against
# was found).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD_DIR:-build-c-ubsan}
JOBS=${JOBS:-$(nproc)}
CC=${CC:-gcc}
CXX=${CXX:-g++}
FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_COMPILER="$(command -v "$CC")" -DCMAKE_CXX_COMPILER="$(command -v "$CXX")" \
  -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_EXAMPLES=OFF \
  -DVELOXQUANT_PACKAGING_TESTS=OFF -DVELOXQUANT_SANITIZE= >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target veloxquant_c test_c_api
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" -R '^c_api\.(shared|exports)$'
