#!/usr/bin/env python3
"""docs/fidelity_kvzip.png from the CSVs of scripts/fidelity_kvzip.sh: mean KL against the share
of the prompt's rows kept, one line per method (dev windows), KVzip with the repeat cue and
KVzip normalising over the prompt's rows alone dashed, and the held-out windows' KVzip, SnapKV
and KeyDiff as open markers. Also prints the table of
docs/fidelity.md.

    python3 scripts/kvzip_plot.py [DIR]   (default docs/fidelity_kvzip)
"""
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = 384


def means(path):
    """{(series, scoring): {budget: mean KL}} from a harness CSV's "mean" rows."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["window"] != "mean" or row["budget"] == "full":
                continue
            key = (row["method"], row["scoring"])
            out.setdefault(key, {})[int(row["budget"])] = float(row["kl"])
    return out


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "fidelity_kvzip")
    dev, cue, held, prompt_norm = (means(os.path.join(d, n)) for n in (
        "dev.csv", "dev_cue.csv", "heldout.csv", "dev_prompt.csv"))
    names = [(("kvzip", "-"), "KVzip"), (("snapkv", "queries"), "SnapKV (queries)"),
             (("keydiff", "proxy"), "KeyDiff"), (("squeeze", "queries"), "SqueezeAttention (queries)"),
             (("streaming_llm", "-"), "recency")]
    budgets = sorted({b for series in dev.values() for b in series}, reverse=True)
    print("| rows of the prompt | " + " | ".join(n for _, n in names) +
          " | KVzip, prompt's rows only | KVzip, BOS cue |")
    print("|---:|" + "---:|" * (len(names) + 2))
    for b in budgets:
        cells = [f"{dev[k][b]:.5f}" if k in dev and b in dev[k] else "-" for k, _ in names]
        for extra in (prompt_norm, cue):
            c = extra.get(("kvzip", "-"), {}).get(b)
            cells.append(f"{c:.5f}" if c is not None else "-")
        print(f"| {100 * b / PROMPT:g}% ({b}) | " + " | ".join(cells) + " |")
    if held:
        print("\nheld-out windows:")
        for k, n in names[:3]:
            if k in held:
                print(f"  {n}: " + ", ".join(f"{b}: {held[k][b]:.5f}" for b in budgets if b in held[k]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(matplotlib missing: apt-get install python3-matplotlib; no plot drawn)")
        return
    fig, ax = plt.subplots(figsize=(8, 5.2))
    colors = ["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:grey"]
    for (k, n), color in zip(names, colors):
        if k not in dev:
            continue
        pts = sorted(dev[k].items())
        ax.plot([100 * b / PROMPT for b, _ in pts], [y for _, y in pts], marker="o", color=color,
                label=n)
        if k in held:
            hp = sorted(held[k].items())
            ax.plot([100 * b / PROMPT for b, _ in hp], [y for _, y in hp], marker="o",
                    markerfacecolor="none", linestyle=":", color=color, label=n + ", held-out")
    for extra, label, style in ((prompt_norm, "KVzip, softmax over the prompt's rows only", "--"),
                                (cue, "KVzip, BOS cue", "-.")):
        if ("kvzip", "-") in extra:
            pts = sorted(extra[("kvzip", "-")].items())
            ax.plot([100 * b / PROMPT for b, _ in pts], [y for _, y in pts], marker="s",
                    linestyle=style, color="tab:red", alpha=0.5, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows of the 384-token prompt kept by the compress-once methods, %\n"
                  "(the others hold the same rows at the end of the window)")
    ax.set_ylabel("KL(full || compressed), mean over windows")
    ax.set_title("stories260K: a prompt compressed once, 127 tokens continued")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    out = os.path.join(ROOT, "docs", "fidelity_kvzip.png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
