#!/usr/bin/env bash
# Line coverage of include/ by the test suite (gcov through gcovr): builds the suite in
# build-cov/ at -O0 with --coverage (the library's instances too), runs it with CTest and prints
# the gcovr table for include/. Installs gcovr if missing (Debian/Ubuntu).
# Usage: bash scripts/coverage.sh [OUT.txt]   Environment: JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
if ! command -v gcovr >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcovr
fi
JOBS=${JOBS:-$(nproc)}
BUILD=build-cov
out=${1:-$BUILD/coverage.txt}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Coverage -DCMAKE_CXX_FLAGS_COVERAGE="-O0 -g0 --coverage" \
  -DCMAKE_EXE_LINKER_FLAGS="--coverage" -DVELOXQUANT_PACKAGING_TESTS=OFF -DVELOXQUANT_WERROR=OFF \
  -DVELOXQUANT_BUILD_EXAMPLES=OFF >/dev/null
find "$BUILD" -name '*.gcda' -delete
cmake --build "$BUILD" -j"$JOBS"
ctest --test-dir "$BUILD" -j"$JOBS" --timeout 3600 -E '^(headers|compile_)' | tail -3
gcovr -r . --filter 'include/' --object-directory "$BUILD" -j"$JOBS" --gcov-ignore-parse-errors \
  --txt "$out"
cat "$out"
