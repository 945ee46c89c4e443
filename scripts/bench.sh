#!/usr/bin/env bash
# Builds and runs the Google Benchmark suite (installs missing build dependencies first).
# Extra arguments go to the benchmark binary, e.g.
#   bash scripts/bench.sh --benchmark_filter=Decode --benchmark_repetitions=5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
BUILD=${BUILD_DIR:-build-bench}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DVELOXQUANT_BUILD_TESTS=OFF \
      -DVELOXQUANT_BUILD_EXAMPLES=OFF -DVELOXQUANT_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target bench_update
"$BUILD"/bench/bench_update "$@"
