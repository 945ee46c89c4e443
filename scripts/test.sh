#!/usr/bin/env bash
# Builds and runs the whole test suite (installs missing build dependencies first): the unit,
# contract, differential and real-model tests, the examples, the packaging consumers, the header
# and compile-fail checks. One build, instrumented with AddressSanitizer + UndefinedBehaviorSanitizer
# (+ LeakSanitizer): the tests compile at -O0, the library's templates once at -O1 (see
# tests/CMakeLists.txt), warnings are errors, and the library is also compiled at -O3 -DNDEBUG
# under the same warnings (tests/headers). docs/testing.md explains the layout.
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
CXX=${CXX:-g++}

if [ -n "$SANITIZE" ]; then
  # The sanitizer runtimes ship with g++ (Debian 12: libasan8 and libubsan1 come with
  # libgcc-12-dev); install them if a trivial program does not link.
  probe=$(mktemp -d)
  printf 'int main() { return 0; }\n' >"$probe/p.cpp"
  if ! "$CXX" -fsanitize="$SANITIZE" "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "[test] installing the sanitizer runtimes (libasan8 libubsan1)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libasan8 libubsan1
  fi
  rm -rf "$probe"
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:${ASAN_OPTIONS:-}"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
fi

# -O0 -g1: the tests compile fast (under UBSan, -O1 costs three times as much) with line tables
# for symbolised reports; no NDEBUG, so Eigen's own index and shape assertions stay on.
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Check -DCMAKE_CXX_FLAGS_CHECK="-O0 -g1" \
  -DVELOXQUANT_SANITIZE="$SANITIZE" -DVELOXQUANT_TEST_LIBRARY_FLAGS="-O1" \
  -DVELOXQUANT_TEST_HEAVY_FLAGS="-O1" \
  -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" --timeout 900
