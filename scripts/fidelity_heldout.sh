#!/usr/bin/env bash
# The held-out fidelity measurement of docs/fidelity.md ("Held-out windows"): stories260K, 64
# windows of 512 tokens from each half of tinystories_validation_head.txt (dev: bytes 0..400000,
# where decisions are made; report: bytes 400000.., only reported), a 128-token prompt as one call
# and 384 teacher-forced one-token calls, budgets of 32 / 64 / 128 rows per KV head (6.25 / 12.5 /
# 25% of the context). Runs every method with the defaults, then SqueezeAttention with the option
# settings of the table, and the query-free scorers (proxy_scoring, docs/design.md 4.7; without
# queries only: calls with queries ignore the field), writes one CSV and one plot per run into
# docs/fidelity_heldout/ and prints the tables (scripts/fidelity_tables.py). About 16 minutes on
# 2 cores (two runs at a time). Then adaptive head budgets (docs/fidelity.md "Adaptive heads"):
# uniform heads against adaptive ones at every floor of the sweep on the dev half only, and the
# chosen floor on the report half, one run at a time, into docs/fidelity_adaptive*.csv/.svg (about
# 5.5 minutes more; ONLY=adaptive,adaptive_keydiff runs just these).
#
#   bash scripts/fidelity_heldout.sh [--fixtures DIR] [other harness options, e.g. --windows 4]
# Environment: OUT_DIR (default docs/fidelity_heldout), BUILD_DIR (default build-fidelity), both
# relative to the repository's root; ONLY (run names, comma-separated: a subset, e.g.
# ONLY=keydiff,knorm). Each run's progress and errors go to a .log beside its CSV.
set -euo pipefail
cd "$(dirname "$0")/.."
F=$(bash scripts/fidelity_build.sh)
OUT=${OUT_DIR:-docs/fidelity_heldout}
mkdir -p "$OUT"
COMMON=(--text validation --windows 64 --length 512 --prompt 128 --budgets 32,64,128
        --scoring proxy,queries "$@")
# name|harness arguments (every --set applies to each evicting run of that invocation)
RUNS=(
  "all|"
  "squeeze_ratio0.75|--methods squeeze --set squeeze_recent_ratio=0.75"
  "squeeze_ratio0.9|--methods squeeze --set squeeze_recent_ratio=0.9"
  "squeeze_ratio1|--methods squeeze --set squeeze_recent_ratio=1"
  "squeeze_decay0.95|--methods squeeze --set squeeze_decay=0.95"
  "squeeze_decay0.9|--methods squeeze --set squeeze_decay=0.9"
  "squeeze_decay0.95_ratio0.9|--methods squeeze --set squeeze_decay=0.95 --set squeeze_recent_ratio=0.9"
  "keydiff|--methods squeeze,h2o,pyramidkv --scoring proxy --set proxy_scoring=keydiff"
  "knorm|--methods squeeze,h2o,pyramidkv --scoring proxy --set proxy_scoring=knorm"
  "keydiff_ratio0.75|--methods squeeze --scoring proxy --set proxy_scoring=keydiff --set squeeze_recent_ratio=0.75"
  "keydiff_ratio0.9|--methods squeeze --scoring proxy --set proxy_scoring=keydiff --set squeeze_recent_ratio=0.9"
  "knorm_ratio0.9|--methods squeeze --scoring proxy --set proxy_scoring=knorm --set squeeze_recent_ratio=0.9"
  "vnorm1|--methods squeeze --scoring queries --set value_norm_power=1"
  "vnorm2|--methods squeeze,h2o,pyramidkv --scoring queries --set value_norm_power=2"
  "vnorm2_decay0.95|--methods squeeze,h2o --scoring queries --set value_norm_power=2 --set squeeze_decay=0.95 --set h2o_decay=0.95"
  "vnorm1.5_decay0.95|--methods squeeze --scoring queries --set value_norm_power=1.5 --set squeeze_decay=0.95"
  "vnorm2_decay0.95_sink1|--methods squeeze --scoring queries --set value_norm_power=2 --set squeeze_decay=0.95 --set squeeze_n_sink=1"
  "vnorm2_decay0.95_sink0|--methods squeeze,h2o --scoring queries --set value_norm_power=2 --set squeeze_decay=0.95 --set h2o_decay=0.95 --set squeeze_n_sink=0 --set h2o_n_sink=0"
)
run_one() {  # half name prefix harness-arguments...: CSV and plot at prefix.csv / .svg, the
  # printed table and the log in $OUT
  local half=$1 name=$2 prefix=$3
  shift 3
  "$F" "${COMMON[@]}" "$@" --csv "$prefix.csv" --svg "$prefix.svg" \
    >"$OUT/${half}_${name}.txt" 2>"$OUT/${half}_${name}.log" || {
    echo "[fidelity] $half $name failed: $OUT/${half}_${name}.log" >&2
    tail -3 "$OUT/${half}_${name}.log" >&2
    return 1
  }
  echo "[fidelity] $half $name done"
}
run_half() {  # half range
  local half=$1 range=$2 entry name args
  for entry in "${RUNS[@]}"; do
    name=${entry%%|*}
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
    read -r -a args <<<"${entry#*|}"
    run_one "$half" "$name" "$OUT/${half}_${name}" --range "$range" ${args[@]+"${args[@]}"} ||
      return 1
  done
}
run_half dev 0:400000 &
dev=$!
run_half report 400000: &
report=$!
status=0
wait "$dev" || status=1
wait "$report" || status=1
[ "$status" -eq 0 ] || exit 1
python3 scripts/fidelity_tables.py "$OUT"

# Adaptive heads. The floor is chosen on the dev half (the sweep); the report half only runs the
# chosen one. CSVs and plots go to docs/ (ADAPTIVE_DIR), the printed tables and logs beside the
# held-out runs.
ADAPTIVE_DIR=${ADAPTIVE_DIR:-docs}
FLOOR=0.2  # the chosen floor: KVCacheConfig::head_budget_floor's default
SWEEP=uniform,adaptive:0.1,adaptive:0.2,adaptive:0.3,adaptive:0.5,adaptive:0.6,adaptive:0.7,adaptive:0.8,adaptive:0.9
# name|harness arguments|the dev half's heads (floor 1 is uniform heads' control)
ADAPTIVE_RUNS=(
  "adaptive|--methods squeeze,h2o --scoring queries --set value_norm_power=2 --set squeeze_decay=0.95 --set squeeze_n_sink=0 --set h2o_decay=0.95 --set h2o_n_sink=0|$SWEEP,adaptive:1"
  "adaptive_keydiff|--methods squeeze --scoring proxy --set proxy_scoring=keydiff --set squeeze_recent_ratio=0.9|$SWEEP,adaptive:0.95,adaptive:1"
)
for entry in "${ADAPTIVE_RUNS[@]}"; do
  name=${entry%%|*}
  rest=${entry#*|}
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  read -r -a args <<<"${rest%%|*}"
  for half in dev report; do
    if [ "$half" = dev ]; then range=0:400000 heads=${rest#*|}; else range=400000: heads=uniform,adaptive:$FLOOR; fi
    run_one "$half" "$name" "$ADAPTIVE_DIR/fidelity_${name}_${half}" --range "$range" \
      "${args[@]}" --heads "$heads" || exit 1
  done
done
python3 scripts/fidelity_tables.py adaptive "$ADAPTIVE_DIR"
