#!/usr/bin/env bash
# The channel-axis measurement of docs/fidelity.md ("Channel-axis quantization", issue 45):
# stories260K, 32 windows of 512 tokens from the dev half of tinystories_validation_head.txt
# (bytes 0..400000), a 128-token prompt as one call, then 384 one-token calls with the model's
# queries, caches of half rows (the reference: the full cache of half rows). SqueezeAttention at
# the recommended settings (value_norm_power 2, squeeze_decay 0.95, squeeze_n_sink 0, adaptive
# heads) at 32 / 64 / 128 rows per head (6.25 / 12.5 / 25% of the context), and the standard cache
# (every row kept), at key/value widths 16/16, 8/8, 4/4, 4/2 (and 2/2 with every row kept): along
# tokens (quant_group 8, the model's head dim) and along channels in blocks of 8, 16 and 32
# positions. Writes the CSVs to docs/fidelity_channel/, then the tables and
# docs/fidelity_channel.png (scripts/channel_frontier.py, python3-matplotlib). About 40 minutes on
# one core.
#
#   bash scripts/fidelity_channel.sh [other harness options, e.g. --windows 4]
# Environment: OUT_DIR (default docs/fidelity_channel), BUILD_DIR (default build-fidelity).
set -euo pipefail
cd "$(dirname "$0")/.."
F=$(bash scripts/fidelity_build.sh)
OUT=${OUT_DIR:-docs/fidelity_channel}
mkdir -p "$OUT"
COMMON=(--text validation --range 0:400000 --windows 32 --length 512 --prompt 128 --scoring queries
        --storage half)
REC=value_norm_power=2,squeeze_decay=0.95,squeeze_n_sink=0,head_budgets=adaptive
WIDTHS=16/16,8/8,4/4,4/2
"$F" "${COMMON[@]}" --budgets 32,64,128 --methods squeeze --widths "$WIDTHS" \
  --set "$REC,key_axis=token,value_axis=token" --csv "$OUT/token.csv" --svg "$OUT/token.svg" \
  "$@" 2>"$OUT/token.log"
"$F" "${COMMON[@]}" --budgets 64 --methods standard --widths 8/8,4/4,4/2,2/2 \
  --csv "$OUT/full_token.csv" --svg "$OUT/full_token.svg" "$@" 2>"$OUT/full_token.log"
for blk in 8 16 32; do
  "$F" "${COMMON[@]}" --budgets 32,64,128 --methods squeeze --widths "$WIDTHS" \
    --set "$REC,key_axis=channel,value_axis=channel,quant_block=$blk" \
    --csv "$OUT/channel_$blk.csv" --svg "$OUT/channel_$blk.svg" "$@" 2>"$OUT/channel_$blk.log"
  "$F" "${COMMON[@]}" --budgets 64 --methods standard --widths 8/8,4/4,4/2,2/2 \
    --set "key_axis=channel,value_axis=channel,quant_block=$blk" \
    --csv "$OUT/full_channel_$blk.csv" --svg "$OUT/full_channel_$blk.svg" "$@" \
    2>"$OUT/full_channel_$blk.log"
done
PY=python3
/usr/bin/python3 -c "import matplotlib" 2>/dev/null && PY=/usr/bin/python3
"$PY" scripts/channel_frontier.py "$OUT"
