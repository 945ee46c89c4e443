#!/usr/bin/env bash
# Builds the project with its tests, examples and benchmarks in every CMake build type, warnings
# as errors (VELOXQUANT_WERROR, on by default), with one compiler: CXX (default g++; CXX=clang++
# for Clang). Builds only: the suite runs under the sanitizers in scripts/test.sh. The CI does
# not run this (each build type is a whole build); it compiles the optimised configurations that
# raise warnings the suite's build does not (docs/testing.md, "Build types").
#
#   bash scripts/build_types.sh                   Debug, Release, RelWithDebInfo, MinSizeRel
#   TYPES="Release MinSizeRel" bash scripts/build_types.sh
#
# Environment: CXX, TYPES, JOBS (default nproc), BUILD_ROOT (default build-types: one directory
# per compiler and type).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
CXX=${CXX:-g++}
JOBS=${JOBS:-$(nproc)}
ROOT=${BUILD_ROOT:-build-types}
TYPES=${TYPES:-Debug Release RelWithDebInfo MinSizeRel}
status=0
for type in $TYPES; do
  dir="$ROOT/$(basename "$CXX")-$type"
  start=$(date +%s)
  if cmake -S . -B "$dir" -DCMAKE_CXX_COMPILER="$(command -v "$CXX")" -DCMAKE_BUILD_TYPE="$type" \
       -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_EXAMPLES=ON \
       -DVELOXQUANT_BUILD_BENCHMARKS=ON >/dev/null &&
     cmake --build "$dir" -j"$JOBS"; then
    echo "[build-types] $CXX $type: built in $(( $(date +%s) - start )) s"
  else
    echo "[build-types] $CXX $type: FAILED after $(( $(date +%s) - start )) s"
    status=1
  fi
done
exit "$status"
