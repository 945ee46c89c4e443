#!/usr/bin/env bash
# The benchmarks of BENCHMARKS.md (installs missing build dependencies first).
#
#   bash scripts/bench.sh                 the flag matrix (section 1): bench/bench_core.cpp built
#                                         once per flag set, the same flags for the library and
#                                         the comparison points; prints the table of medians and
#                                         ratios, keeps the JSON in build-bench/<flags>.json
#   bash scripts/bench.sh --suite [ARGS]  the policy / memory / query suite (bench_update.cpp,
#                                         -O3 native), ARGS passed to the binary
#
# On aarch64 the same commands build the ARM flag sets below (BENCHMARKS.md section 12).
#   bash scripts/bench.sh --compile       consumer compile times (section 4)
#   bash scripts/bench.sh --prompt-cache  prompt caches saved and loaded (section 9):
#                                         bench/bench_prompt_cache.cpp at each flag set, JSON in
#                                         build-bench/prompt-<flags>.json
#   bash scripts/bench.sh --scorers       the query-free scorers (section 10): the Scorer
#                                         benchmarks of bench_update.cpp at each flag set
#
# Environment: FLAG_SETS (names from the list below, space-separated), REPS (default 5),
# FILTER (a --benchmark_filter regex for the matrix).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
ROOT=build-bench
mkdir -p "$ROOT"

# The flag sets of the machine: baseline and native ISA at -O2 and -O3 (aarch64: the ARMv8.0
# baseline and -mcpu=native, which GCC and Clang accept there; Apple Silicon, Graviton, phones).
case "$(uname -m)" in
  aarch64 | arm64)
    declare -A FLAGS=(
      [O2-armv8-a]="-O2 -march=armv8-a"
      [O3-armv8-a]="-O3 -march=armv8-a"
      [O2-native]="-O2 -mcpu=native"
      [O3-native]="-O3 -mcpu=native"
    )
    ORDER=(O3-native O2-native O3-armv8-a O2-armv8-a)
    NATIVE="-O3 -mcpu=native"
    ;;
  *)
    declare -A FLAGS=(
      [O2-x86-64]="-O2 -march=x86-64"
      [O2-x86-64-v3]="-O2 -march=x86-64-v3"
      [O3-x86-64-v3]="-O3 -march=x86-64-v3"
      [O2-native]="-O2 -march=native"
      [O3-native]="-O3 -march=native"
    )
    ORDER=(O3-native O2-native O3-x86-64-v3 O2-x86-64-v3 O2-x86-64)
    NATIVE="-O3 -march=native"
    ;;
esac

build() {  # build <name> <flags> <target>
  cmake -S . -B "$ROOT/$1" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$2 -DNDEBUG" \
    -DVELOXQUANT_BUILD_TESTS=OFF -DVELOXQUANT_BUILD_EXAMPLES=OFF \
    -DVELOXQUANT_BUILD_BENCHMARKS=ON >/dev/null
  cmake --build "$ROOT/$1" -j"$(nproc)" --target "$3" >/dev/null
}

case "${1:-}" in
  --suite)
    shift
    build suite "$NATIVE" bench_update
    exec "$ROOT/suite/bench/bench_update" "$@"
    ;;
  --compile)
    exec bash scripts/compile_time.sh
    ;;
  --scorers)
    for name in ${FLAG_SETS:-${ORDER[@]}}; do
      echo "[bench] building bench_update with ${FLAGS[$name]}" >&2
      build "$name" "${FLAGS[$name]}" bench_update
      "$ROOT/$name/bench/bench_update" --benchmark_filter=Scorer \
        --benchmark_repetitions="${REPS:-5}" --benchmark_report_aggregates_only=true \
        --benchmark_out="$ROOT/scorers-$name.json" --benchmark_out_format=json |
        grep median | sed "s/^/[$name] /"
    done
    exit 0
    ;;
  --prompt-cache)
    for name in ${FLAG_SETS:-${ORDER[@]}}; do
      echo "[bench] building bench_prompt_cache with ${FLAGS[$name]}" >&2
      build "$name" "${FLAGS[$name]}" bench_prompt_cache
      "$ROOT/$name/bench/bench_prompt_cache" --benchmark_repetitions="${REPS:-5}" \
        --benchmark_report_aggregates_only=true --benchmark_out="$ROOT/prompt-$name.json" \
        --benchmark_out_format=json | sed "s/^/[$name] /"
    done
    exit 0
    ;;
esac

sets=(${FLAG_SETS:-${ORDER[@]}})
for name in "${sets[@]}"; do
  echo "[bench] building bench_core with ${FLAGS[$name]}" >&2
  build "$name" "${FLAGS[$name]}" bench_core
done
for name in "${sets[@]}"; do
  echo "[bench] running $name" >&2
  "$ROOT/$name/bench/bench_core" --benchmark_repetitions="${REPS:-5}" \
    --benchmark_report_aggregates_only=true --benchmark_filter="${FILTER:-.}" \
    --benchmark_out="$ROOT/$name.json" --benchmark_out_format=json >/dev/null
done
python3 scripts/bench_table.py "$ROOT" "${sets[@]}"
