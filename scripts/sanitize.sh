#!/usr/bin/env bash
# Runs the test suite under the sanitizers (issue 7):
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer): the whole test suite
#      (every tests/test_*.cpp, including the real-model tests that read ../shared/fixtures, and
#      the compile and header checks) built in build-asan/ and run with CTest; the examples are
#      built too and run briefly (the synthetic demo, and the llama2.c programs on the fixtures).
#   2. ThreadSanitizer: the tests that start threads (test_concurrency, test_squeeze_coordinator),
#      built in build-tsan/ without OpenMP: libgomp is not TSan-instrumented, its barriers are
#      invisible to TSan and every OpenMP region would be reported as a race. test_parallel is not
#      run there: without OpenMP it starts no thread, so TSan would have nothing to check; the
#      OpenMP head-parallel paths run under ASan/UBSan in step 1.
# Both steps always run; the script exits nonzero if any test fails or any sanitizer reports
# (UBSan does not recover, ASan and TSan halt on the first report, leaks fail the run).
#
# Usage: bash scripts/sanitize.sh [--asan-only | --tsan-only]
# Environment: JOBS (default: nproc), ASAN_BUILD_DIR (build-asan), TSAN_BUILD_DIR (build-tsan),
# VELOXQUANT_FIXTURES (the stories260K fixtures; default ../shared/fixtures).
# Installs what is missing first (Debian/Ubuntu, as root or with sudo): CMake, g++, Eigen,
# GoogleTest (scripts/deps.sh) and the sanitizer runtimes that come with g++ (libasan8,
# libubsan1, libtsan2 on Debian 12).
set -euo pipefail
cd "$(dirname "$0")/.."

run_asan=1
run_tsan=1
case "${1:-}" in
  "") ;;
  --asan-only) run_tsan=0 ;;
  --tsan-only) run_asan=0 ;;
  *) echo "usage: $0 [--asan-only | --tsan-only]" >&2; exit 2 ;;
esac

JOBS=${JOBS:-$(nproc)}
ASAN_DIR=${ASAN_BUILD_DIR:-build-asan}
TSAN_DIR=${TSAN_BUILD_DIR:-build-tsan}
CXX=${CXX:-g++}
export CXX

# float-cast-overflow is not part of GCC's -fsanitize=undefined; it catches NaN or out-of-range
# double -> int conversions (undefined behaviour).
ASAN_FLAGS="-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer"
TSAN_FLAGS="-fsanitize=thread -fno-omit-frame-pointer"
# -O1 with line tables (-g1: enough for symbolised reports, much faster to build than -g), and
# without NDEBUG, so Eigen's own index and shape assertions stay on as an extra check.
OPT_FLAGS="-O1 -g1"
# Warnings are the normal build's gate (scripts/test.sh, VELOXQUANT_WERROR): the instrumented
# builds turn -Werror off and silence GCC 12's false -Wmaybe-uninitialized reports inside
# libstdc++ (<regex>, <functional>) under -fsanitize.
WARN_FLAGS="-Wno-maybe-uninitialized"

log() { printf '[sanitize] %s\n' "$*"; }
now() { date +%s; }
failures=()
summary=()

bash scripts/deps.sh

# The sanitizer runtimes ship with g++ (Debian 12: libasan8, libubsan1, libtsan2 are dependencies
# of libgcc-12-dev). Check by linking a trivial program with each sanitizer; install if that fails.
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
printf '#include <thread>\nint main() { std::thread t([] {}); t.join(); return 0; }\n' \
  >"$probe_dir/probe.cpp"
links() { "$CXX" -std=c++17 "$1" "$probe_dir/probe.cpp" -o "$probe_dir/probe" -pthread >/dev/null 2>&1; }
if ! links "-fsanitize=address,undefined" || ! links "-fsanitize=thread"; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  log "installing the sanitizer runtimes (libasan8 libubsan1 libtsan2)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libasan8 libubsan1 libtsan2
  links "-fsanitize=address,undefined" || { log "cannot link with -fsanitize=address,undefined"; exit 1; }
  links "-fsanitize=thread" || { log "cannot link with -fsanitize=thread"; exit 1; }
fi

# TSan of GCC 12 cannot map its shadow memory when the kernel randomises mmap with more than 28
# bits ("FATAL: ThreadSanitizer: unexpected memory mapping"); then the TSan tests run with
# address-space randomisation off, for their processes only.
TSAN_WRAP=()
if [ "$run_tsan" -eq 1 ]; then
  links "-fsanitize=thread"
  if ! "$probe_dir/probe" >"$probe_dir/out" 2>&1; then
    if grep -q "unexpected memory mapping" "$probe_dir/out" && command -v setarch >/dev/null &&
       setarch "$(uname -m)" -R "$probe_dir/probe"; then
      TSAN_WRAP=(setarch "$(uname -m)" -R)
      log "TSan needs address-space randomisation off here: running its tests under setarch -R"
    else
      cat "$probe_dir/out"
      log "a trivial TSan program fails on this machine"
      exit 1
    fi
  fi
fi

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:${TSAN_OPTIONS:-}"

# configure DIR FLAGS EXTRA_CMAKE_ARGS...
configure() {
  local dir=$1 flags=$2
  shift 2
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Sanitize \
    -DCMAKE_CXX_FLAGS_SANITIZE="$OPT_FLAGS" \
    -DCMAKE_CXX_FLAGS="$flags $WARN_FLAGS" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" \
    -DVELOXQUANT_BUILD_TESTS=ON -DVELOXQUANT_BUILD_BENCHMARKS=OFF \
    -DVELOXQUANT_PACKAGING_TESTS=OFF -DVELOXQUANT_WERROR=OFF "$@" >/dev/null
}

start_all=$(now)

if [ "$run_asan" -eq 1 ]; then
  t0=$(now)
  log "ASan+UBSan: configuring and building everything in $ASAN_DIR (-j$JOBS)"
  configure "$ASAN_DIR" "$ASAN_FLAGS" -DVELOXQUANT_BUILD_EXAMPLES=ON
  if cmake --build "$ASAN_DIR" -j"$JOBS"; then
    t1=$(now)
    summary+=("ASan+UBSan build: $((t1 - t0)) s")
    log "ASan+UBSan: running the test suite"
    ctest --test-dir "$ASAN_DIR" --output-on-failure -j"$JOBS" --timeout 900 ||
      failures+=("ASan+UBSan test suite")
    log "ASan+UBSan: running the examples"
    "$ASAN_DIR/examples/squeeze_demo" >/dev/null || failures+=("ASan+UBSan squeeze_demo")
    fixtures=${VELOXQUANT_FIXTURES:-../shared/fixtures}
    if [ -d "$fixtures/model" ]; then
      out=$(mktemp -d)
      "$ASAN_DIR/examples/llama2c_generate" --fixtures "$fixtures" --method squeeze --budget 16 \
        --queries --steps 48 --prompt "Once upon a time" >/dev/null ||
        failures+=("ASan+UBSan llama2c_generate")
      "$ASAN_DIR/examples/llama2c_story_demo" --fixtures "$fixtures" --steps 32 --budget 24 \
        >/dev/null || failures+=("ASan+UBSan llama2c_story_demo")
      "$ASAN_DIR/examples/llama2c_fidelity" --fixtures "$fixtures" --text sample --windows 1 \
        --length 96 --prompt 32 --budgets 32 --csv "$out/f.csv" --svg "$out/f.svg" >/dev/null ||
        failures+=("ASan+UBSan llama2c_fidelity")
      rm -rf "$out"
    else
      log "no fixtures at $fixtures: the llama2.c examples are not run (test_llama2c needs them)"
    fi
    summary+=("ASan+UBSan tests and examples: $(($(now) - t1)) s")
  else
    failures+=("ASan+UBSan build")
  fi
fi

if [ "$run_tsan" -eq 1 ]; then
  t0=$(now)
  tsan_tests=(test_concurrency test_squeeze_coordinator)
  log "TSan: configuring $TSAN_DIR (OpenMP off), building ${tsan_tests[*]} (-j$JOBS)"
  configure "$TSAN_DIR" "$TSAN_FLAGS" -DVELOXQUANT_OPENMP=OFF -DVELOXQUANT_BUILD_EXAMPLES=OFF
  if cmake --build "$TSAN_DIR" -j"$JOBS" --target "${tsan_tests[@]}"; then
    for t in "${tsan_tests[@]}"; do
      log "TSan: running $t"
      "${TSAN_WRAP[@]}" "$TSAN_DIR/tests/$t" --gtest_brief=1 || failures+=("TSan $t")
    done
  else
    failures+=("TSan build")
  fi
  summary+=("TSan build and run: $(($(now) - t0)) s")
fi

for line in "${summary[@]}"; do log "$line"; done
if [ ${#failures[@]} -gt 0 ]; then
  log "FAILED after $(($(now) - start_all)) s: ${failures[*]}"
  exit 1
fi
log "all sanitizer runs passed in $(($(now) - start_all)) s"
