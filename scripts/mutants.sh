#!/usr/bin/env bash
# Mutation check: builds the test suite once per mutant of tests/mutants/mutants.txt (a
# deliberately broken copy of the library) and reports whether the suite fails on it ("caught").
# Usage: bash scripts/mutants.sh [--suite TREE] [--only ID[,ID...]] [OUT]
#   --suite TREE  run another checkout's test suite (its tests/test_*.cpp, tests/reference,
#                 tests/support headers and fuzz/ headers) against this library, built by this
#                 tree's tests/CMakeLists.txt: how an older suite fares on the same mutants
#   OUT          the result table (default build-mutants/results.txt)
# Each mutant gets a scratch copy of the tree under build-mutants/; the suite is built without
# sanitizers (tests -O0, the library's instances -O1) and CTest stops at the first failure.
# Slow by nature: one build of the test executables per mutant (about 1-2 minutes each on 2 cores
# with Clang, CXX=clang++). Only the test executables are built and run: mutants.applicable would
# fail on every mutated tree and count the mutant as caught; the header, warnings, packaging and
# example checks are not about behaviour; the determinism digests (three more builds of the
# library) are left out for time.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
suite=""
only=""
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite=$(cd "$2" && pwd); shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) out=$1; shift ;;
  esac
done
work=${MUTANTS_DIR:-$root/build-mutants}
mkdir -p "$work"
out=${out:-$work/results.txt}
JOBS=${JOBS:-$(nproc)}
bash scripts/deps.sh

tree=$work/tree
rm -rf "$tree"
mkdir -p "$tree"
cp -r CMakeLists.txt cmake include src examples tests fuzz "$tree"/
if [ -n "$suite" ]; then
  # The other suite's test files, oracles, support code and fuzzer headers; this tree's build.
  rm -rf "$tree"/tests/test_*.cpp "$tree"/tests/reference
  cp "$suite"/tests/test_*.cpp "$tree"/tests/
  cp -r "$suite"/tests/reference "$tree"/tests/
  for f in "$suite"/tests/support/*.hpp "$suite"/tests/support/*.cpp; do
    cp "$f" "$tree"/tests/support/
  done
  # A suite from before issue 16's support TU defines its helpers in the header: this tree's
  # tests/CMakeLists.txt still compiles support/test_support.cpp, so it must be empty there.
  [ -f "$suite"/tests/support/test_support.cpp ] || : >"$tree"/tests/support/test_support.cpp
  for f in "$suite"/fuzz/*.hpp; do cp "$f" "$tree"/fuzz/; done
fi
build=$work/build
cmake -S "$tree" -B "$build" -DCMAKE_BUILD_TYPE=Check -DCMAKE_CXX_FLAGS_CHECK="-O0" \
  -DVELOXQUANT_TEST_LIBRARY_FLAGS="-O1" -DVELOXQUANT_WERROR=OFF -DVELOXQUANT_PACKAGING_TESTS=OFF \
  -DVELOXQUANT_BUILD_EXAMPLES=OFF -DVELOXQUANT_FIXTURES_DIR="$root/../shared/fixtures" >/dev/null

# The test executables (tests/CMakeLists.txt: one per tests/test_*.cpp, the contract suite over
# quantized rows and the bad-input suite with the library's asserts compiled out), and the CTest
# names that are not theirs (the C ABI's and the Python module's tests need libraries this build
# does not make).
targets=$(cd "$tree/tests" && ls test_*.cpp | sed 's/\.cpp$//' | tr '\n' ' ')
targets="$targets test_contract_q84 test_bad_inputs_ndebug"
not_suite='^(headers|compile_|consumer|examples|determinism|mutants|c_api|python)'

# Parses mutants.txt into id|file|old|new lines.
mapfile -t mutants < <(python3 - "$root/tests/mutants/mutants.txt" <<'PY'
import sys
cur = None
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    if line.startswith("@@ "):
        _, mid, path = line.split()
        cur = [mid, path, None, None]
    elif line.startswith("- ") and cur:
        cur[2] = line[2:]
    elif line.startswith("+ ") and cur:
        cur[3] = line[2:]
        print("\x1f".join(cur))
        cur = None
PY
)

: >"$out"
# The unmutated library first: the suite must pass, or the table means nothing.
t0=$(date +%s)
cmake --build "$build" -j"$JOBS" --target $targets >"$work/baseline.build.log" 2>&1 ||
  { echo "the unmutated suite does not build: $work/baseline.build.log"; exit 1; }
ctest --test-dir "$build" -j"$JOBS" --timeout 600 -E "$not_suite" \
  >"$work/baseline.ctest.log" 2>&1 ||
  { echo "the unmutated suite fails: $work/baseline.ctest.log"; exit 1; }
echo "unmutated: passes ($(( $(date +%s) - t0 )) s, $(grep -Eo '[0-9]+ tests passed|out of [0-9]+' "$work/baseline.ctest.log" | tail -1))" | tee -a "$out"
caught=0
total=0
for m in "${mutants[@]}"; do
  IFS=$'\x1f' read -r id path old new <<<"$m"
  if [ -n "$only" ] && [[ ",$only," != *",$id,"* ]]; then continue; fi
  total=$((total + 1))
  file=$tree/include/veloxquant/cache/$path
  cp "$root/include/veloxquant/cache/$path" "$file"
  if ! python3 - "$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"mutant text found {text.count(old)} times in {path}")
open(path, "w").write(text.replace(old, new))
PY
  then
    echo "$id: NOT APPLIED" | tee -a "$out"
    continue
  fi
  t0=$(date +%s)
  if ! cmake --build "$build" -j"$JOBS" --target $targets >"$work/$id.build.log" 2>&1; then
    result="caught (does not compile)"
    caught=$((caught + 1))
  elif ctest --test-dir "$build" -j"$JOBS" --stop-on-failure --timeout 600 \
       -E "$not_suite" >"$work/$id.ctest.log" 2>&1; then
    result="SURVIVED"
  else
    first=$(grep -m1 -E '\*\*\*Failed|\(Failed\)|\*\*\*Exception|\(Subprocess aborted\)' "$work/$id.ctest.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.+.*//')
    result="caught by ${first:-a failing test}"
    caught=$((caught + 1))
  fi
  cp "$root/include/veloxquant/cache/$path" "$file"
  echo "$id: $result ($(( $(date +%s) - t0 )) s)" | tee -a "$out"
done
echo "caught $caught of $total" | tee -a "$out"
