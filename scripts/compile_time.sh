#!/usr/bin/env bash
# Compile time of an engine TU that builds a model's caches with KVCacheBuilder::for_model
# (bench/compile/builder.cpp, the README's way in) against the same work with Eigen's Tensor module
# alone (bench/compile/eigen_only.cpp), at -O2, median of 5 runs: header-only; with the caches
# compiled once elsewhere (VELOXQUANT_EXTERN_TEMPLATES: what linking veloxquant::compiled
# defines); and the same work in C through the C ABI (bench/compile/c_abi.c). The one-class probe
# of earlier measurements (bench/compile/consumer.cpp) and the compiled libraries' own TUs
# (src/veloxquant.cpp, src/c_api.cpp: once per build) are printed too, and a probe of what the
# header-only TU costs without its kernels: the same TU against a copy of the headers in which the
# SIMD kernels are declared but never defined (so not linkable: a measurement of the rest of the
# library, the part no kernel work can make cheaper).
# BENCHMARKS.md section 4. Environment: CXX (default g++), CC (default gcc), CXXFLAGS (default -O2).
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=${CXX:-g++}
CC=${CC:-gcc}
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
row() {  # row LABEL SECONDS: a table row with the ratio to the Eigen-only TU
  printf '| %s | %.2f | %.2fx |\n' "$1" "$2" "$(python3 -c "print($2 / $base)")"
}

cxx=("$CXX" -std=c++17 $FLAGS -Iinclude $EIGEN -c)
base=$(median "${cxx[@]}" bench/compile/eigen_only.cpp -o "$out/a.o")
header=$(median "${cxx[@]}" bench/compile/builder.cpp -o "$out/b.o")
compiled=$(median "${cxx[@]}" -DVELOXQUANT_EXTERN_TEMPLATES bench/compile/builder.cpp -o "$out/c.o")
c_abi=$(median "$CC" -std=c99 $FLAGS -Iinclude -c bench/compile/c_abi.c -o "$out/d.o")
one=$(median "${cxx[@]}" bench/compile/consumer.cpp -o "$out/e.o")
one_compiled=$(median "${cxx[@]}" -DVELOXQUANT_EXTERN_TEMPLATES bench/compile/consumer.cpp \
  -o "$out/f.o")
cp -r include "$out/floor-include"
sed -i 's/^#define VELOXQUANT_DETAIL_KERNELS_DEFINED 1$/#define VELOXQUANT_DETAIL_KERNELS_DEFINED 0/' \
  "$out/floor-include/veloxquant/cache/detail/simd_kernels.hpp"
grep -q '^#define VELOXQUANT_DETAIL_KERNELS_DEFINED 1$' \
  "$out/floor-include/veloxquant/cache/detail/simd_kernels.hpp" && { echo "floor probe: sed failed"; exit 1; }
floor=$(median "$CXX" -std=c++17 $FLAGS -w -I"$out/floor-include" $EIGEN -c bench/compile/builder.cpp \
  -o "$out/i.o")
lib=$(median "${cxx[@]}" src/veloxquant.cpp -o "$out/g.o")
capi=$(median "${cxx[@]}" -DVELOXQUANT_EXTERN_TEMPLATES src/c_api.cpp -o "$out/h.o")
printf '| TU (%s / %s %s) | seconds | ratio to Eigen Tensor alone |\n|---|---:|---:|\n' \
  "$CXX" "$CC" "$FLAGS"
row "Eigen Tensor alone (eigen_only.cpp)" "$base"
row "builder TU, header-only (builder.cpp)" "$header"
row "builder TU, linking veloxquant::compiled" "$compiled"
row "the same in C through the C ABI (c_abi.c)" "$c_abi"
row "builder TU, header-only, kernels declared only (probe, not linkable)" "$floor"
row "one-class TU, header-only (consumer.cpp)" "$one"
row "one-class TU, linking veloxquant::compiled" "$one_compiled"
row "src/veloxquant.cpp (once per build)" "$lib"
row "src/c_api.cpp (once per build)" "$capi"
