#!/usr/bin/env bash
# The KVzip measurement of docs/fidelity.md ("KVzip: compress once, then continue", issue 46):
# stories260K, windows of 511 tokens, a 384-token prompt as one call compressed once, then 127
# one-token calls; 25 / 12.5 / 6.25% of the prompt's rows (budgets 96 / 48 / 24) for KVzip and
# SnapKV, and the same rows at the end of the window for the methods that evict while decoding
# (--compress-once: budget + 127). Each run writes a CSV and the harness's table (.txt) to
# docs/fidelity_kvzip/ (its progress and SVG go to a temporary directory):
#   dev            16 windows of the dev half (bytes 0..400000): kvzip, snapkv, keydiff, squeeze,
#                  streaming_llm, by the key proxy and by queries where they apply (kvzip with
#                  KVzip's own normalisation, the harness's default: --kvzip-norm reread);
#   dev_prompt     the same windows, kvzip normalising over the prompt's rows alone (observe(q));
#   dev_cue        the same windows, kvzip re-reading each chunk after a BOS token (a repeat cue);
#   heldout, heldout_prompt
#                  16 windows of the rest of the file (bytes 400000..): kvzip, snapkv, keydiff;
#   channel_16_16, channel_4_4, and _prompt
#                  the dev windows over half rows, kvzip and snapkv (queries), with half rows and
#                  with 4-bit keys and values along channels (blocks of 16 positions).
# Then docs/fidelity_kvzip.png (scripts/kvzip_plot.py, python3-matplotlib). About 4 minutes.
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
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/veloxquant-kvzip.XXXXXX")  # progress and the harness's SVGs
run() {  # run NAME harness-options...
  local name=$1
  shift
  "$F" "${COMMON[@]}" "$@" --csv "$OUT/$name.csv" --svg "$LOGS/$name.svg" >"$OUT/$name.txt" \
    2>"$LOGS/$name.log"
}
run dev "${DEV[@]}" --methods kvzip,snapkv,keydiff,squeeze,streaming_llm --scoring proxy,queries \
  "$@"
run dev_prompt "${DEV[@]}" --methods kvzip --kvzip-norm prompt "$@"
run dev_cue "${DEV[@]}" --methods kvzip --kvzip-cue bos "$@"
run heldout --range 400000: --methods kvzip,snapkv,keydiff --scoring proxy,queries "$@"
run heldout_prompt --range 400000: --methods kvzip --kvzip-norm prompt "$@"
CH=(--storage half --set key_axis=channel,value_axis=channel,quant_block=16)
for w in 16/16 4/4; do
  tag=${w/\//_}
  run "channel_$tag" "${DEV[@]}" "${CH[@]}" --widths "$w" --methods kvzip,snapkv \
    --scoring queries "$@"
  run "channel_${tag}_prompt" "${DEV[@]}" "${CH[@]}" --widths "$w" --methods kvzip \
    --kvzip-norm prompt "$@"
done
PY=python3
/usr/bin/python3 -c "import matplotlib" 2>/dev/null && PY=/usr/bin/python3
"$PY" scripts/kvzip_plot.py "$OUT"
