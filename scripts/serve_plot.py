#!/usr/bin/env python3
"""Bytes each request holds over time under one memory pool, against a static split of the cap and
preempt-and-recompute (docs/design.md 10.5), from llama2c_serve's --csv output.

Usage: python3 scripts/serve_plot.py [docs/serve/squeeze_bytes.csv] [docs/serve_pool.png]
(regenerate the CSV with: llama2c_serve --method squeeze --csv docs/serve/squeeze_bytes.csv)."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "docs/serve/squeeze_bytes.csv"
out = sys.argv[2] if len(sys.argv) > 2 else "docs/serve_pool.png"

ways = {}
with open(src, newline="") as f:
    rows = csv.DictReader(f)
    for r in rows:
        w = ways.setdefault(r["way"], {"step": [], "req": {}, "cap": int(r["cap"])})
        w["step"].append(int(r["step"]))
        for k, v in r.items():
            if k.startswith("request"):
                w["req"].setdefault(k, []).append(int(v) / 1024.0)

names = [w for w in ("pool", "static split", "preempt") if w in ways]
fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), sharey=True)
for ax, name in zip(axes, names):
    w = ways[name]
    keys = sorted(w["req"], key=lambda k: int(k[len("request"):]))
    ax.stackplot(w["step"], [w["req"][k] for k in keys], labels=[k.replace("request", "r") for k in keys])
    ax.axhline(w["cap"] / 1024.0, color="black", linestyle="--", linewidth=1, label="cap")
    ax.set_title(name)
    ax.set_xlabel("step (one token per running request)")
    ax.set_xlim(0, max(max(ways[n]["step"]) for n in names))
axes[0].set_ylabel("KiB held (stacked by request)")
axes[-1].legend(loc="upper right", fontsize=7, ncol=2)
fig.suptitle("stories260K, 8 requests under one cap: who holds the bytes over time")
fig.tight_layout()
fig.savefig(out, dpi=110)
print("wrote", out)
