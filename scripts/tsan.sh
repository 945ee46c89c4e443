#!/usr/bin/env bash
# ThreadSanitizer over the tests that start threads (test_concurrency, test_squeeze_coordinator),
# built in build-tsan/: layers on threads of their own sharing a coordinator, and caches whose heads
# run on a std::thread parallel-for. Exits nonzero on any failure or report (TSan halts on the
# first).
#
# Usage: bash scripts/tsan.sh [--setup]   (--setup: install and probe only)
# Environment: JOBS (default nproc), TSAN_BUILD_DIR (default build-tsan).
# Installs what is missing first (scripts/deps.sh; libtsan2 if a TSan program does not link).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
DIR=${TSAN_BUILD_DIR:-build-tsan}
CXX=${CXX:-g++}
export CXX
log() { printf '[tsan] %s\n' "$*"; }
bash scripts/deps.sh

probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '#include <thread>\nint main() { std::thread t([] {}); t.join(); return 0; }\n' >"$probe/p.cpp"
links() { "$CXX" -std=c++17 -fsanitize=thread "$probe/p.cpp" -o "$probe/p" -pthread >/dev/null 2>&1; }
if ! links; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "installing the TSan runtime (libtsan2)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libtsan2
  links || { log "cannot link with -fsanitize=thread"; exit 1; }
fi
# TSan of GCC 12 cannot map its shadow memory when the kernel randomises mmap with more than 28
# bits ("FATAL: ThreadSanitizer: unexpected memory mapping"); then the tests run with
# address-space randomisation off, for their processes only.
WRAP=()
if ! "$probe/p" >"$probe/out" 2>&1; then
  if grep -q "unexpected memory mapping" "$probe/out" && command -v setarch >/dev/null &&
     setarch "$(uname -m)" -R "$probe/p"; then
    WRAP=(setarch "$(uname -m)" -R)
    log "TSan needs address-space randomisation off here: running under setarch -R"
  else
    cat "$probe/out"
    log "a trivial TSan program fails on this machine"
    exit 1
  fi
fi

# --setup: only install and probe (.ci/run does that first, then runs this beside the fuzzer).
if [ "${1:-}" = "--setup" ]; then
  log "set up"
  exit 0
fi

export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:${TSAN_OPTIONS:-}"
tests=(test_concurrency test_squeeze_coordinator)
log "configuring $DIR and building ${tests[*]} (-j$JOBS)"
cmake -S . -B "$DIR" -DCMAKE_BUILD_TYPE=Check -DCMAKE_CXX_FLAGS_CHECK="-O0 -g1" \
  -DVELOXQUANT_SANITIZE=thread -DVELOXQUANT_TEST_LIBRARY_FLAGS="-O1" \
  -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_EXAMPLES=OFF -DVELOXQUANT_PACKAGING_TESTS=OFF \
  -DVELOXQUANT_TEST_PCH=OFF \
  -DVELOXQUANT_FRONT_END_SKIP="$(printf '%s.cpp;' "${tests[@]}")" \
  >/dev/null
cmake --build "$DIR" -j"$JOBS" --target "${tests[@]}"
for t in "${tests[@]}"; do
  log "running $t"
  "${WRAP[@]}" "$DIR/tests/$t" --gtest_brief=1
done
log "passed"
