#!/usr/bin/env bash
# Builds the libFuzzer binary fuzz/fuzz_cache.cpp (clang, AddressSanitizer + UndefinedBehaviorSanitizer)
# into build-fuzz/ and runs its three targets side by side for SECONDS each (default 60):
#   ops   operation sequences on every policy against the oracles (save-and-reload included),
#         from the seed corpus fuzz/corpus/ and the saved regressions fuzz/regressions/;
#   load  prompt-cache files through the loader, from fuzz/corpus_load/ (real saved files) and
#         fuzz/regressions_load/;
#   pool  several sets of caches sharing one MemoryPool (fuzz/fuzz_pool.hpp: the cap, the
#         accounting, the floors, the refusals), from fuzz/corpus_pool/ and fuzz/regressions_pool/.
# The checked-in corpora are never written: each target works on a copy in a temporary
# directory, and its artifacts go to another one.
#
#   bash scripts/fuzz.sh [SECONDS] [TARGETS]   (TARGETS: "ops load pool", the default, or any of
#                                               them; or --setup: install what it needs; --build:
#                                               and build it)
#
# Exits nonzero on any crash, sanitizer report, oracle/invariant violation, timeout or OOM, and
# prints the path of the crashing input, its base64 (so a CI log is enough to reproduce it) and the
# replay command. Environment: FUZZ_KEEP=1 keeps the temporary directories; FUZZ_MAX_LEN overrides
# libFuzzer's -max_len (default 1024 for ops, 16384 for load, 512 for pool); FUZZ_OPT the optimisation level
# (default -O1; the binary is build-fuzz/fuzz_cache-O1). The CI builds at -O0: 32 CPU-seconds
# instead of 118, for about a quarter of the executions per second (ops alone: 9 against 38 on the
# 2-core machine, 2026-12-06; in the CI, beside the other lanes, 92 ops runs in its 20 seconds
# against 538 at -O1): its run replays both corpora (the saved regressions among them) and mutates
# a little from them; finding new failures is the -O1 campaigns' job (docs/robustness.md).
set -euo pipefail
cd "$(dirname "$0")/.."

SETUP_ONLY=0
BUILD_ONLY=0
if [ "${1:-}" = "--setup" ]; then  # install what the fuzzer needs, and stop
  SETUP_ONLY=1
  set -- 0
elif [ "${1:-}" = "--build" ]; then  # install and build, and stop
  BUILD_ONLY=1
  set -- 0
fi
SECS=${1:-60}
TARGETS=${2:-"ops load pool"}
if ! [[ "$SECS" =~ ^[0-9]+$ ]] || ! [[ "$TARGETS" =~ ^(ops|load|pool)(\ (ops|load|pool))*$ ]]; then
  echo "usage: bash scripts/fuzz.sh [SECONDS] [\"ops load pool\" or a part of it]" >&2
  exit 2
fi

# --- dependencies (Debian/Ubuntu, as root or with sudo): clang, its fuzzer runtime, Eigen -------
have_fuzzer_runtime() {
  command -v clang++ >/dev/null 2>&1 || return 1
  local dir
  dir=$(clang++ --print-runtime-dir 2>/dev/null) || return 1
  [ -f "$dir/libclang_rt.fuzzer-$(uname -m).a" ] || [ -f "$dir/libclang_rt.fuzzer.a" ]
}
need=()
command -v clang++ >/dev/null 2>&1 || need+=(clang)
have_fuzzer_runtime || need+=(libclang-rt-14-dev)   # libclang_rt.fuzzer on Debian 12
[ -f /usr/include/eigen3/Eigen/Core ] || need+=(libeigen3-dev)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[fuzz] installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
have_fuzzer_runtime || { echo "[fuzz] clang's libFuzzer runtime is still missing" >&2; exit 1; }
if [ "$SETUP_ONLY" = 1 ]; then
  echo "[fuzz] set up"
  exit 0
fi

# --- build (only when a source is newer than the binary) ----------------------------------------
BUILD=build-fuzz
OPT=${FUZZ_OPT:--O1}
[[ "$OPT" =~ ^-O[0-3sg]$ ]] || { echo "[fuzz] FUZZ_OPT must be -O0 .. -O3, -Os or -Og" >&2; exit 2; }
BIN=$BUILD/fuzz_cache$OPT
mkdir -p "$BUILD"
if [ ! -x "$BIN" ] || [ -n "$(find include fuzz tests/reference tests/support -newer "$BIN" \
                                 \( -name '*.hpp' -o -name '*.cpp' \) -print -quit)" ]; then
  echo "[fuzz] building $BIN"
  # -g1 (line tables): a report's stack trace names each frame's file and line, as with -g, and
  # the build takes 112 CPU-seconds instead of 137 (2026-12-06, 2-core machine).
  clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    "$OPT" -g1 -std=c++17 -I include -I tests -isystem /usr/include/eigen3 \
    fuzz/fuzz_cache.cpp -o "$BIN.tmp"
  mv "$BIN.tmp" "$BIN"
fi
if [ "$BUILD_ONLY" = 1 ]; then
  echo "[fuzz] built $BIN"
  exit 0
fi

# --- run: each target on a copy of its corpus, side by side ---------------------------------------
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
KEEP=()
cleanup() {
  for d in "${KEEP[@]}"; do
    if [ "${FUZZ_KEEP:-0}" = "1" ]; then
      echo "[fuzz] kept $d"
    elif [[ "$d" == *corpus* || "$d" == *state* ]] || [ -z "$(ls -A "$d" 2>/dev/null)" ]; then
      rm -rf "$d"  # artifacts of a failing run are kept: their paths were printed
    fi
  done
}
trap cleanup EXIT

STATE=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-fuzz-state.XXXXXX")
KEEP+=("$STATE")
# prepare NAME CORPUS REGRESSIONS: a working copy of the corpus and an artifact directory (in this
# shell, so the clean-up knows them), paths in $STATE/NAME.work and $STATE/NAME.art.
prepare() {
  local name=$1 corpus=$2 regressions=$3 work art
  work=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-fuzz-$name-corpus.XXXXXX")
  art=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-fuzz-$name-artifacts.XXXXXX")
  KEEP+=("$work" "$art")
  cp "$corpus"/* "$work"/ 2>/dev/null || true
  cp "$regressions"/* "$work"/ 2>/dev/null || true
  rm -f "$work"/README*
  echo "$work" >"$STATE/$name.work"
  echo "$art" >"$STATE/$name.art"
  echo "[fuzz] $name: running $BIN for ${SECS}s on a copy of $corpus + $regressions ($(ls "$work" | wc -l) inputs)"
}
# run NAME MAX_LEN: libFuzzer on the prepared copy; its exit code in $STATE/NAME.rc.
run() {
  local name=$1 max_len=$2 work art
  work=$(cat "$STATE/$name.work")
  art=$(cat "$STATE/$name.art")
  set +e
  # A fixed seed (FUZZ_SEED, default 1) makes the run reproducible: the same inputs in the same
  # order, so a CI run explores a prefix of what a longer local run with the same seed explored.
  VELOXQUANT_FUZZ_TARGET=$name "$BIN" -seed="${FUZZ_SEED:-1}" -max_total_time="$SECS" \
    -rss_limit_mb=2048 -timeout=60 -max_len="${FUZZ_MAX_LEN:-$max_len}" -print_final_stats=1 \
    -artifact_prefix="$art/" "$work" >"$art/fuzz.log.txt" 2>&1
  echo $? >"$STATE/$name.rc"
}

pids=()
for t in $TARGETS; do
  case $t in
    ops) prepare ops fuzz/corpus fuzz/regressions; run ops 1024 & ;;
    load) prepare load fuzz/corpus_load fuzz/regressions_load; run load 16384 & ;;
    pool) prepare pool fuzz/corpus_pool fuzz/regressions_pool; run pool 512 & ;;
  esac
  pids+=($!)
done
wait "${pids[@]}"

status=0
for t in $TARGETS; do
  art=$(cat "$STATE/$t.art")
  rc=$(cat "$STATE/$t.rc" 2>/dev/null || echo 1)
  grep -v -E '^#[0-9]+\s+(NEW|REDUCE|pulse)|^"|^###### (Recommended|End of recommended)|NEW_FUNC' \
    "$art/fuzz.log.txt" | sed "s/^/[fuzz $t] /" | tail -n 25
  crashes=$(find "$art" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
                                -o -name 'oom-*' \) | sort)
  if [ "$rc" -ne 0 ] || [ -n "$crashes" ]; then
    echo "[fuzz] $t FAILED (libFuzzer exit code $rc); log: $art/fuzz.log.txt" >&2
    for f in $crashes; do
      echo "[fuzz]   crashing input: $f" >&2
      echo "[fuzz]   base64: $(base64 -w0 "$f")" >&2
      echo "[fuzz]   replay: VELOXQUANT_FUZZ_TARGET=$t VELOXQUANT_FUZZ_TRACE=1 $BIN $f" >&2
    done
    echo "[fuzz]   to keep it as a regression: cp <input> fuzz/regressions$([ "$t" != ops ] && echo "_$t")/ (replayed by test_fuzz_regressions)" >&2
    status=1
  else
    rm -f "$art/fuzz.log.txt"
    echo "[fuzz] $t OK: no crash in ${SECS}s"
  fi
done
exit "$status"
