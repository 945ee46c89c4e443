#!/usr/bin/env bash
# The test suite on aarch64 (SPEC 16, docs/testing.md "ARM64"): cross-built with
# g++-aarch64-linux-gnu (GoogleTest from /usr/src/googletest) and run under qemu-user. The NEON
# path is the default there, and the tests that sweep the kernel paths run it against the scalar
# path. Then the determinism digest once more with Clang 14 for aarch64 (--target), under qemu: it
# must be the recorded one (tests/determinism/expected_scalar_digest.txt), as on x86-64.
#
#   bash scripts/test_aarch64.sh           the CI's selection (below), then the Clang build
#   bash scripts/test_aarch64.sh --full    every test of the suite through CTest (examples and
#                                          packaging aside), then the Clang build
#   bash scripts/test_aarch64.sh --setup   only install what is missing
#
# The CI's selection: under emulation the library runs about 20x slower than natively, and the
# whole suite takes ~840 test-seconds there (~420 s on 2 cores), more than the CI's 12 minutes
# leave. What differs on aarch64 is the NEON and fp16 code and the CRC32C instruction; everything
# above them is the same portable code as on x86-64, where the whole suite runs under the
# sanitizers. So the CI runs every test of the kernel TUs (each kernel of each path against the
# scalar path, the path selection, the quantized rows of every policy), the prompt-cache TU (the
# checksums; not the loader's exhaustive refusals) and the attend TU (the fused pass; its state
# sweep on half rows only), then the determinism digest: every policy and API at -O3 with fp16
# arithmetic (--full adds the -O0 and -O3 baseline builds; the suite's instances are the -O2
# baseline, its tests -O0), built with -Werror, must print the scalar digest recorded on x86-64.
# (The CI dropped the -O0 digest on 2026-12-06: 8 compile-seconds and 8 s of qemu for the one
# build the -O0 tests above and the -O0 x86-64 digest leave least to find.) The contract
# suites, the real-model TU, the policy-oracle sweeps, the threading tests and the fuzz
# regressions compute the same bits as on x86-64 (the digests check that) and run with --full.
#
# Environment: BUILD_DIR (default build-aarch64), JOBS (default nproc), VELOXQUANT_FIXTURES.
# No sanitizers (they stay on x86-64: scripts/test.sh, tsan.sh, fuzz.sh). Timings under qemu are
# emulation: use them only as ratios between paths (BENCHMARKS.md section 12).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
need=()
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || need+=(qemu-user)
[ -f /usr/src/googletest/CMakeLists.txt ] || need+=(googletest)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v clang++ >/dev/null 2>&1 || need+=(clang)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[aarch64] installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
[ "${1:-}" = "--setup" ] && exit 0

MODE=${1:-ci}
BUILD=${BUILD_DIR:-build-aarch64}
JOBS=${JOBS:-$(nproc)}
# The cross libraries first (cmake/toolchains/aarch64-linux-gnu.cmake says why).
QEMU=(qemu-aarch64 -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)
start=$(date +%s)
stamp() { echo "[aarch64] $1: $(( $(date +%s) - start )) s"; }

CI_TESTS="test_simd_kernels|test_simd_levels|test_kernel_checks|test_quant|test_prompt_cache|\
test_attend"
selection=""
examples=ON
digests=()  # the three of tests/determinism/CMakeLists.txt
if [ "$MODE" != "--full" ]; then
  selection="${CI_TESTS//|/.cpp|}.cpp"
  examples=OFF
  digests=(-DVELOXQUANT_DIGEST_FLAGS="-O3 -march=armv8.2-a+fp16 -DNDEBUG")
fi

# The layout of scripts/test.sh without the sanitizers: the tests at -O0, the library's instances
# at -O2 (the NEON kernels optimised, as users build them), the heavy TU at -O1. The consumer
# packaging checks are architecture-independent and stay in the x86-64 suite.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Check -DCMAKE_CXX_FLAGS_CHECK="-O0" \
  -DVELOXQUANT_TEST_LIBRARY_FLAGS="-O2" -DVELOXQUANT_TEST_HEAVY_FLAGS="-O1" \
  -DVELOXQUANT_PACKAGING_TESTS=OFF -DVELOXQUANT_BUILD_TESTS=ON \
  -DVELOXQUANT_BUILD_EXAMPLES="$examples" -DVELOXQUANT_TEST_SELECTION="$selection" \
  -UVELOXQUANT_DIGEST_FLAGS "${digests[@]}" >/dev/null

if [ "$MODE" = "--full" ]; then
  cmake --build "$BUILD" -j"$JOBS"
  stamp "build"
  ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS" --timeout 900
  stamp "tests"
else
  targets=$(echo "$CI_TESTS" | tr '|' ' ')
  cmake --build "$BUILD" -j"$JOBS" --target $targets \
    determinism_digest_0
  stamp "build"
  # Each test binary runs once, whole (GoogleTest's own runner: no process per test case), two at
  # a time; a failing binary's output is printed.
  # The parallel == serial sweep (test_parallel) stays on x86-64 (and --full): qemu-user runs the
  # guest's threads with the host's memory ordering, so under emulation it tests nothing the
  # x86-64 run (under ThreadSanitizer too) does not.
  # The loader's exhaustive refusals (every corrupted byte, every truncation of a file) are
  # portable parsing over checksums whose aarch64 kernel Crc32cKernel checks on every path, length
  # and alignment: they run on x86-64 under the sanitizers (and with --full), not under qemu here
  # (21 of the prompt-cache TU's 29 CPU-seconds under emulation).
  filter="-AttendTest/1.SameState*:AttendTest/2.SameState*"
  filter+=":PromptCacheLoad.EveryCorruptedByteIsRefused:PromptCacheLoad.EveryTruncationIsRefused"
  logs="$BUILD/aarch64-logs"
  mkdir -p "$logs"
  export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu QEMU_SET_ENV=LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib
  printf '%s\n' $targets | xargs -P "$JOBS" -I{} sh -c \
    'if qemu-aarch64 "$1/tests/$2" --gtest_filter="$3" >"$4/$2.log" 2>&1; then
       echo "[aarch64] $2: $(grep -E "^\[  PASSED  \]|tests? ran" "$4/$2.log" | tr "\n" " ")"
     else
       cat "$4/$2.log"; echo "[aarch64] $2 FAILED"; exit 1
     fi' _ "$BUILD" {} "$filter" "$logs"
  ctest --test-dir "$BUILD" --output-on-failure -R '^determinism\.' --timeout 900
  stamp "tests"
fi
# Clang for aarch64: the headers and the kernels compile with it (warnings as errors) and give
# the recorded digest, checked as determinism.across_builds checks it (the program itself fails
# when neon differs from scalar).
clang_bin="$BUILD/digest-clang"
clang++ --target=aarch64-linux-gnu -std=c++17 -O2 -DNDEBUG -Wall -Wextra -Wpedantic -Wshadow \
  -Wconversion -Werror -Iinclude -isystem /usr/include/eigen3 tests/determinism/digest.cpp \
  -o "$clang_bin"
emulator=$(IFS=';'; echo "${QEMU[*]}")
cmake -DPROGRAMS="$clang_bin" -DEMULATOR="$emulator" \
  -DEXPECTED=tests/determinism/expected_scalar_digest.txt -P tests/determinism/compare.cmake
echo "[aarch64] total: $(( $(date +%s) - start )) s"
