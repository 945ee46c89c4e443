#!/usr/bin/env bash
# Builds and runs the demo (installs missing build dependencies first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh --demo-only
BUILD=${BUILD_DIR:-build-demo}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DVELOXQUANT_BUILD_TESTS=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target squeeze_demo
"$BUILD"/examples/squeeze_demo "$@"
