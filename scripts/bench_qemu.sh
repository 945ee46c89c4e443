#!/usr/bin/env bash
# Instructions of a decode attend() step on the NEON and scalar paths, counted under qemu-aarch64
# (BENCHMARKS.md section 12). Emulated time is no measure of either path (qemu runs each NEON
# floating-point lane in software, so a vector instruction costs what its lanes would cost as
# scalar ones); the count of guest instructions is: a TCG plugin (bench/qemu/insn_count.c) adds
# up every executed block, and a step's count is the difference between 10 steps and none.
#   bash scripts/bench_qemu.sh        (installs the cross compiler and qemu-user where missing)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test_aarch64.sh --setup
out=build-qemu-bench
mkdir -p "$out"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$out/insn_count.so" bench/qemu/insn_count.c
QEMU=(qemu-aarch64 -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib
      -plugin "$out/insn_count.so")
count() { "${QEMU[@]}" "$@" 2>&1 >/dev/null | sed -n 's/^insns: //p'; }
echo "| build | budget | scalar path | neon path | scalar / neon |"
echo "|---|---:|---:|---:|---:|"
for flags in "-O2" "-O3"; do
  bin="$out/attend_steps${flags// /}"
  aarch64-linux-gnu-g++ -std=c++17 $flags -DNDEBUG -Wall -Wextra -Werror -Iinclude \
    -isystem /usr/include/eigen3 bench/qemu/attend_steps.cpp -o "$bin"
  for budget in 512 2048; do
    per=()
    for path in scalar neon; do
      base=$(count "$bin" "$path" 0 "$budget")
      ten=$(count "$bin" "$path" 10 "$budget")
      per+=($(( (ten - base) / 10 )))
    done
    ratio=$(python3 -c "print(f'{${per[0]} / ${per[1]}:.1f}x')")
    echo "| $flags | $budget | ${per[0]} | ${per[1]} | $ratio |"
  done
done
