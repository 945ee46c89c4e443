#!/usr/bin/env bash
# The KVzip measurement of docs/fidelity.md ("KVzip: compress once, then continue", issue 46):
# stories260K, windows of 511 tokens, a 384-token prompt as one call compressed once, then 127
# one-token calls; 25 / 12.5 / 6.25% of the prompt's rows (budgets 96 / 48 / 24) for KVzip and
# SnapKV, and the same rows at the end of the window for the methods that evict while decoding
# (--compress-once: budget + 127). Runs, each writing a CSV to docs/fidelity_kvzip/:
#   dev.csv       16 windows of the dev half (bytes 0..400000): kvzip, snapkv, keydiff, squeeze,
#                 streaming_llm (key proxy and queries where they apply);
#   cue.csv       the same windows, kvzip re-reading each chunk after a BOS token (the repeat cue);
#   heldout.csv   16 windows of the rest of the file (bytes 400000..): kvzip, snapkv, keydiff;
#   channel.csv   the dev windows over half rows, kvzip and snapkv (queries) with 4-bit keys and
#                 values along channels (blocks of 16 positions) and with half rows.
# Then docs/fidelity_kvzip.png (scripts/kvzip_plot.py, python3-matplotlib). About 8 minutes.
#   bash scripts/fidelity_kvzip.sh [other harness options, e.g. --windows 4]
# Environment: OUT_DIR (default docs/fidelity_kvzip), BUILD_DIR (default build-fidelity).
set -euo pipefail
cd "$(dirname "$0")/.."
F=$(bash scripts/fidelity_build.sh)
OUT=${OUT_DIR:-docs/fidelity_kvzip}
mkdir -p "$OUT"
COMMON=(--text validation --windows 16 --length 511 --prompt 384 --budgets 96,48,24
        --compress-once)
DEV=(--range 0:400000)
"$F" "${COMMON[@]}" "${DEV[@]}" --methods kvzip,snapkv,keydiff,squeeze,streaming_llm \
  --scoring proxy,queries --csv "$OUT/dev.csv" --svg "$OUT/dev.svg" "$@" >"$OUT/dev.txt" \
  2>"$OUT/dev.log"
"$F" "${COMMON[@]}" "${DEV[@]}" --methods kvzip --kvzip-cue bos --csv "$OUT/cue.csv" \
  --svg "$OUT/cue.svg" "$@" >"$OUT/cue.txt" 2>"$OUT/cue.log"
"$F" "${COMMON[@]}" --range 400000: --methods kvzip,snapkv,keydiff --scoring proxy,queries \
  --csv "$OUT/heldout.csv" --svg "$OUT/heldout.svg" "$@" >"$OUT/heldout.txt" 2>"$OUT/heldout.log"
for w in 16/16 4/4; do
  tag=${w/\//_}
  "$F" "${COMMON[@]}" "${DEV[@]}" --methods kvzip,snapkv --scoring queries --storage half \
    --widths "$w" --set key_axis=channel,value_axis=channel,quant_block=16 \
    --csv "$OUT/channel_$tag.csv" --svg "$OUT/channel_$tag.svg" "$@" >"$OUT/channel_$tag.txt" \
    2>"$OUT/channel_$tag.log"
done
PY=python3
/usr/bin/python3 -c "import matplotlib" 2>/dev/null && PY=/usr/bin/python3
"$PY" scripts/kvzip_plot.py "$OUT"
