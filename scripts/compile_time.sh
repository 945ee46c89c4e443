#!/usr/bin/env bash
# Compile time of an engine TU that uses one cache (bench/compile/consumer.cpp) against the same TU
# with Eigen's Tensor module alone (bench/compile/eigen_only.cpp), at -O2, median of 5 runs:
# header-only, and with the caches compiled once elsewhere (VELOXQUANT_EXTERN_TEMPLATES, the
# veloxquant::compiled target; src/veloxquant.cpp's own compile time is printed too).
# BENCHMARKS.md section 4. Environment: CXX (default g++), CXXFLAGS (default -O2).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
FLAGS=${CXXFLAGS:--O2}
EIGEN=$(pkg-config --cflags eigen3 2>/dev/null || echo -I/usr/include/eigen3)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

median() {  # median <command...>: seconds of wall time, median of 5
  local times=()
  for _ in 1 2 3 4 5; do
    local t0 t1
    t0=$(date +%s.%N)
    "$@" >/dev/null
    t1=$(date +%s.%N)
    times+=("$(python3 -c "print($t1 - $t0)")")
  done
  printf '%s\n' "${times[@]}" | sort -n | sed -n 3p
}

base=$(median "$CXX" -std=c++17 $FLAGS $EIGEN -c bench/compile/eigen_only.cpp -o "$out/a.o")
header=$(median "$CXX" -std=c++17 $FLAGS -Iinclude $EIGEN -c bench/compile/consumer.cpp -o "$out/b.o")
extern=$(median "$CXX" -std=c++17 $FLAGS -DVELOXQUANT_EXTERN_TEMPLATES -Iinclude $EIGEN \
  -c bench/compile/consumer.cpp -o "$out/c.o")
lib=$(median "$CXX" -std=c++17 $FLAGS -Iinclude $EIGEN -c src/veloxquant.cpp -o "$out/d.o")
printf '| TU (%s %s) | seconds | ratio to Eigen Tensor alone |\n|---|---:|---:|\n' "$CXX" "$FLAGS"
printf '| Eigen Tensor alone | %.2f | 1.00x |\n' "$base"
printf '| consumer, header-only | %.2f | %.2fx |\n' "$header" "$(python3 -c "print($header / $base)")"
printf '| consumer, extern templates (veloxquant::compiled) | %.2f | %.2fx |\n' "$extern" \
  "$(python3 -c "print($extern / $base)")"
printf '| src/veloxquant.cpp (once per build: half, bfloat16, float) | %.2f | |\n' "$lib"
