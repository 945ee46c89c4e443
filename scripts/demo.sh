#!/usr/bin/env bash
# Builds and runs the demo (installs missing build dependencies first): a story from the real
# stories260K model with SqueezeAttention caches, read from examples/llama2c/ where it ships (or
# from DIR/model with --fixtures DIR). If the model files are missing the story demo says where to
# get them and exits with status 2, and the synthetic six-layer demo runs instead. Arguments go to
# the story demo (e.g. --budget 32 --prompt "...").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh --demo-only
BUILD=${BUILD_DIR:-build-demo}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DVELOXQUANT_BUILD_TESTS=OFF >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target llama2c_story_demo squeeze_demo
status=0
"$BUILD"/examples/llama2c_story_demo "$@" || status=$?
if [ "$status" -eq 2 ]; then
  echo "Running the synthetic demo instead."
  echo
  "$BUILD"/examples/squeeze_demo
elif [ "$status" -ne 0 ]; then
  exit "$status"
fi
