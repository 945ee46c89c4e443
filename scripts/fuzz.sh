#!/usr/bin/env bash
# Builds the libFuzzer target fuzz/fuzz_cache.cpp (clang, AddressSanitizer + UndefinedBehaviorSanitizer)
# into build-fuzz/ and runs it for SECONDS (default 60), starting from the checked-in seed corpus
# fuzz/corpus/ and the saved regressions fuzz/regressions/. The checked-in corpus is never written:
# the fuzzer works on a copy in a temporary directory, and its artifacts go to another one.
#
#   bash scripts/fuzz.sh [SECONDS]     (or --setup: install what it needs; --build: and build it)
#
# Exits nonzero on any crash, sanitizer report, oracle/invariant violation, timeout or OOM, and
# prints the path of the crashing input, its base64 (so a CI log is enough to reproduce it) and the
# replay command. Environment: FUZZ_KEEP=1 keeps the temporary directories; FUZZ_MAX_LEN (default
# 1024) is libFuzzer's -max_len.
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
if ! [[ "$SECS" =~ ^[0-9]+$ ]]; then
  echo "usage: bash scripts/fuzz.sh [SECONDS]" >&2
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
BIN=$BUILD/fuzz_cache
mkdir -p "$BUILD"
if [ ! -x "$BIN" ] || [ -n "$(find include fuzz tests/reference tests/support -newer "$BIN" \
                                 \( -name '*.hpp' -o -name '*.cpp' \) -print -quit)" ]; then
  echo "[fuzz] building $BIN"
  clang++ -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -O1 -g -std=c++17 -I include -I tests -isystem /usr/include/eigen3 \
    fuzz/fuzz_cache.cpp -o "$BIN.tmp"
  mv "$BIN.tmp" "$BIN"
fi
if [ "$BUILD_ONLY" = 1 ]; then
  echo "[fuzz] built $BIN"
  exit 0
fi

# --- run ------------------------------------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-fuzz-corpus.XXXXXX")
ART=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-fuzz-artifacts.XXXXXX")
cleanup() {
  if [ "${FUZZ_KEEP:-0}" = "1" ]; then
    echo "[fuzz] kept working corpus $WORK and artifacts $ART"
  else
    rm -rf "$WORK"
    # Artifacts of a failing run are kept: their paths were printed.
    [ -z "$(ls -A "$ART" 2>/dev/null)" ] && rm -rf "$ART"
  fi
}
trap cleanup EXIT
cp fuzz/corpus/* "$WORK"/ 2>/dev/null || true
cp fuzz/regressions/* "$WORK"/ 2>/dev/null || true
rm -f "$WORK"/README*

echo "[fuzz] running $BIN for ${SECS}s on a copy of fuzz/corpus + fuzz/regressions ($(ls "$WORK" | wc -l) inputs)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
set +e
# A fixed seed (FUZZ_SEED, default 1) makes the run reproducible: the same inputs in the same order,
# so a CI run explores a prefix of what a longer local run with the same seed explored.
"$BIN" -seed="${FUZZ_SEED:-1}" -max_total_time="$SECS" -rss_limit_mb=2048 -timeout=60 -max_len="${FUZZ_MAX_LEN:-1024}" \
  -print_final_stats=1 -artifact_prefix="$ART/" "$WORK" 2>&1 | tee "$ART/fuzz.log.txt" | \
  grep -v -E '^#[0-9]+\s+(NEW|REDUCE|pulse)|^"|^###### (Recommended|End of recommended)'
rc=${PIPESTATUS[0]}
set -e

crashes=$(find "$ART" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
                              -o -name 'oom-*' \) | sort)
if [ "$rc" -ne 0 ] || [ -n "$crashes" ]; then
  echo "[fuzz] FAILED (libFuzzer exit code $rc); log: $ART/fuzz.log.txt" >&2
  for f in $crashes; do
    echo "[fuzz] crashing input: $f" >&2
    echo "[fuzz]   base64: $(base64 -w0 "$f")" >&2
    echo "[fuzz]   replay: VELOXQUANT_FUZZ_TRACE=1 $BIN $f" >&2
  done
  echo "[fuzz] to keep it as a regression: cp <input> fuzz/regressions/ (replayed by test_fuzz_regressions)" >&2
  exit 1
fi
rm -f "$ART/fuzz.log.txt"
echo "[fuzz] OK: no crash in ${SECS}s"
