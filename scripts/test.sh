#!/usr/bin/env bash
# Builds and runs the whole test suite (installs missing build dependencies first): the unit,
# contract, differential and real-model tests, the examples, the packaging consumers, the header
# and compile-fail checks. One build, instrumented with AddressSanitizer + UndefinedBehaviorSanitizer
# (+ LeakSanitizer): the tests compile at -O0, the library's templates once at -O1 (see
# tests/CMakeLists.txt), warnings are errors, and with GCC the library is also compiled at -O3
# -DNDEBUG under the same warnings (tests/headers). docs/testing.md explains the layout.
#
# Environment: BUILD_DIR (default build), JOBS (default nproc), VELOXQUANT_SANITIZE (default
# address,undefined,float-cast-overflow; empty for an uninstrumented build), VELOXQUANT_FIXTURES
# (the stories260K fixtures; default ../shared/fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
BUILD=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
SANITIZE=${VELOXQUANT_SANITIZE-address,undefined,float-cast-overflow}
# The suite compiles with Clang unless CXX says otherwise: under the sanitizers Clang builds it in
# about half GCC's time (docs/testing.md). GCC builds the library and the threaded tests in
# scripts/tsan.sh and the aarch64 selection in scripts/test_aarch64.sh; CXX=g++ builds all of it.
# (CMake keeps a build directory's compiler: a directory configured with another one is
# reconfigured from scratch.)
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_install() {
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
}
if [ -z "${CXX:-}" ]; then
  CXX=clang++
  if ! command -v clang++ >/dev/null 2>&1; then
    echo "[test] installing clang"
    apt_install clang
  fi
fi
export CXX
cxx_is_clang=false
"$CXX" --version | grep -qi clang && cxx_is_clang=true
# Clang's OpenMP runtime (Debian: libomp-dev), for the OpenMP header check (tests/headers).
if $cxx_is_clang; then
  probe=$(mktemp -d)
  printf '#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n' \
    >"$probe/p.cpp"
  if ! "$CXX" -fopenmp "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
    echo "[test] installing Clang's OpenMP runtime (libomp-dev)"
    apt_install libomp-dev
  fi
  rm -rf "$probe"
fi

if [ -n "$SANITIZE" ]; then
  # The sanitizer runtimes: Debian 12 ships GCC's as libasan8 and libubsan1 (with libgcc-12-dev)
  # and Clang's in libclang-rt-14-dev (Ubuntu: libclang-common-14-dev); install them if a trivial
  # program does not link.
  probe=$(mktemp -d)
  printf 'int main() { return 0; }\n' >"$probe/p.cpp"
  if ! "$CXX" -fsanitize="$SANITIZE" "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
    if $cxx_is_clang; then
      v=$("$CXX" -dumpversion | cut -d. -f1)
      echo "[test] installing Clang's sanitizer runtimes (libclang-rt-$v-dev)"
      apt_install "libclang-rt-$v-dev" || apt_install "libclang-common-$v-dev"
    else
      echo "[test] installing GCC's sanitizer runtimes (libasan8 libubsan1)"
      apt_install libasan8 libubsan1
    fi
  fi
  rm -rf "$probe"
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
fi

# -O0 -g1: the tests compile fast (under UBSan, -O1 costs three times as much) with line tables
# for symbolised reports; no NDEBUG, so Eigen's own index and shape assertions stay on.
# The C compiler of the same family builds the C ABI's tests and C example (clang++ -> clang).
CC_OF_CXX=${CC:-$(echo "$CXX" | sed -e 's/clang++/clang/' -e 's/g++/gcc/')}
cmake -S . -B "$BUILD" -DCMAKE_CXX_COMPILER="$(command -v "$CXX")" \
  -DCMAKE_C_COMPILER="$(command -v "$CC_OF_CXX")" -DPython3_EXECUTABLE=/usr/bin/python3 \
  -DCMAKE_BUILD_TYPE=Check -DCMAKE_CXX_FLAGS_CHECK="-O0 -g1" -DCMAKE_C_FLAGS_CHECK="-O0 -g1" \
  -DVELOXQUANT_SANITIZE="$SANITIZE" -DVELOXQUANT_TEST_LIBRARY_FLAGS="-O1" \
  -DVELOXQUANT_TEST_HEAVY_FLAGS="-O1" \
  -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" --timeout 900
