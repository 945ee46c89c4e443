#!/usr/bin/env bash
# Builds the fidelity harness (examples/llama2c_fidelity, Release, no tests) for the fidelity
# scripts (scripts/fidelity_*.sh) and prints its path; the build's output goes to stderr.
# Environment: BUILD_DIR (default build-fidelity, relative to the repository's root).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh --demo-only >&2
BUILD=${BUILD_DIR:-build-fidelity}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DVELOXQUANT_BUILD_TESTS=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target llama2c_fidelity >&2
echo "$BUILD/examples/llama2c_fidelity"
