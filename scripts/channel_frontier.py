#!/usr/bin/env python3
"""KL against kept bytes for quantized rows along tokens and along channels (docs/fidelity.md,
"Channel-axis quantization"): reads the harness CSVs of docs/fidelity_channel/, prints the tables
of the section (markdown) and draws docs/fidelity_channel.png.

    /usr/bin/python3 scripts/channel_frontier.py [DIR]

The CSVs are written by examples/llama2c/fidelity.cpp with --storage half (scripts/
fidelity_channel.sh runs it): token.csv and channel_B.csv (SqueezeAttention at the recommended
settings, rows quantized along tokens, or along channels in blocks of B positions) and
full_token.csv and full_channel_B.csv (the standard cache, which keeps every row). Bytes are
kept_bytes / full_bytes: the full cache of half rows is 100%.
"""
import collections
import csv
import os
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "fidelity_channel")


def load(name):
    """{(method, widths, budget): (mean KL, mean bytes fraction, windows)} of one CSV."""
    path = os.path.join(DIR, name)
    if not os.path.exists(path):
        return {}
    agg = collections.defaultdict(list)
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["method"] == "full":
                continue
            key = (r["method"], r["key_bits"] + "/" + r["value_bits"], r["budget"])
            agg[key].append((float(r["kl"]), float(r["kept_bytes"]) / float(r["full_bytes"])))
    return {k: (statistics.mean(x[0] for x in v), statistics.mean(x[1] for x in v), len(v))
            for k, v in agg.items()}


def main():
    token = load("token.csv")
    full_token = load("full_token.csv")
    channel = {b: load(f"channel_{b}.csv") for b in (8, 16, 32)}
    full = {b: load(f"full_channel_{b}.csv") for b in (8, 16, 32)}
    widths = ["16/16", "8/8", "4/4", "4/2"]
    budgets = ["32", "64", "128"]

    print("Every row kept (the standard cache): KL against the full cache of half rows, bytes")
    print()
    print("| key/value bits | tokens, group 8 | channels, block 8 | block 16 | block 32 |")
    print("|---|---:|---:|---:|---:|")
    for w in widths[1:] + ["2/2"]:
        cells = []
        t = next((v for k, v in full_token.items() if k[1] == w), None)
        cells.append(f"{t[0]:.4f} ({100 * t[1]:.1f}%)" if t else "-")
        for b in (8, 16, 32):
            c = next((v for k, v in full[b].items() if k[1] == w), None)
            cells.append(f"{c[0]:.4f} ({100 * c[1]:.1f}%)" if c else "-")
        print(f"| {w} | " + " | ".join(cells) + " |")
    print()
    print("SqueezeAttention, recommended settings with queries: KL (bytes) at 6.25 / 12.5 / 25% of"
          " the rows")
    print()
    print("| rows | key/value bits | tokens, group 8 | channels, block 8 | block 16 | block 32 |")
    print("|---|---|---:|---:|---:|---:|")
    for b in budgets:
        for w in widths:
            cells = []
            t = token.get(("squeeze_adaptive0.2", w, b))
            cells.append(f"{t[0]:.4f} ({100 * t[1]:.2f}%)" if t else "-")
            for blk in (8, 16, 32):
                c = channel[blk].get(("squeeze_adaptive0.2", w, b))
                cells.append(f"{c[0]:.4f} ({100 * c[1]:.2f}%)" if c else "-")
            print(f"| {b} | {w} | " + " | ".join(cells) + " |")

    # The frontier: every configuration's (bytes, KL); the lowest KL at or below each byte level.
    points = []
    for (m, w, b), (kl, by, _) in token.items():
        if m.startswith("squeeze"):
            points.append(("tokens", w, b, by, kl))
    for blk in (8, 16, 32):
        for (m, w, b), (kl, by, _) in channel[blk].items():
            points.append((f"channels, block {blk}", w, b, by, kl))
    print()
    print("The frontier (the lowest KL at or below each fraction of the full cache's bytes)")
    print()
    print("| bytes at most | lowest KL | configuration |")
    print("|---:|---:|---|")
    for cap in (0.03, 0.045, 0.0625, 0.09, 0.125, 0.25):
        best = min((p for p in points if p[3] <= cap), key=lambda p: p[4], default=None)
        if best:
            print(f"| {100 * cap:.2f}% | {best[4]:.4f} | {best[0]}, {best[1]} bits, "
                  f"{best[2]} rows ({100 * best[3]:.2f}%) |")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: apt-get install python3-matplotlib; no plot drawn)")
        return
    fig, ax = plt.subplots(figsize=(8, 5.2))
    styles = {"tokens": ("tab:red", "o"), "channels, block 8": ("tab:blue", "s"),
              "channels, block 16": ("tab:green", "^"), "channels, block 32": ("tab:purple", "D")}
    for series, (color, marker) in styles.items():
        for w in widths:
            pts = sorted((p[3], p[4]) for p in points if p[0] == series and p[1] == w)
            if not pts:
                continue
            ax.plot([100 * x for x, _ in pts], [max(y, 1e-4) for _, y in pts], marker=marker,
                    color=color, alpha=1.0 if w in ("4/4", "16/16") else 0.45,
                    linestyle={"4/4": "-", "16/16": ":", "8/8": "-."}.get(w, "--"),
                    label=f"{series}, {w}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("kept bytes, % of the full cache of half rows")
    ax.set_ylabel("KL(full || compressed), mean over windows")
    ax.set_title("stories260K, SqueezeAttention with queries (recommended settings):\n"
                 "eviction x quantization along tokens or channels")
    ax.axvline(6.25, color="grey", linewidth=0.8)
    ax.axhline(0.013, color="grey", linewidth=0.8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    out = os.path.join(ROOT, "docs", "fidelity_channel.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
