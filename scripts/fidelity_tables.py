#!/usr/bin/env python3
"""Tables of docs/fidelity.md ("Held-out windows") from the CSVs of scripts/fidelity_heldout.sh.

For every run (method x scoring x budget) of both halves: mean KL over windows, its 10th..90th
percentile and the mean top-1 agreement; then, window by window, how often each query-free
configuration has a lower KL than the recency window (streaming_llm) and the medians of both.

    python3 scripts/fidelity_tables.py [DIR [CONTEXT]]   (defaults: docs/fidelity_heldout, 512)
    python3 scripts/fidelity_tables.py adaptive [DOCS [CONTEXT]]   (docs/fidelity_adaptive*.csv)

The budgets are the ones in the CSVs (largest first); CONTEXT, the windows' length in tokens,
only labels them with their share of the context.
"""
import csv
import os
import sys


def quantile(values, q):
    """Linear interpolation between order statistics (as the harness prints them)."""
    v = sorted(values)
    at = q * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (at - lo) * (v[hi] - v[lo])


def load(path):
    """{(method, scoring, budget): {window: (kl, top1)}} of one CSV, without the mean rows."""
    runs = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["window"] == "mean" or r["budget"] == "full":
                continue
            key = (r["method"], r["scoring"], int(r["budget"]))
            runs.setdefault(key, {})[int(r["window"])] = (float(r["kl"]), float(r["top1"]))
    return runs


def fmt(x, mean):
    return f"{x:.3f}" if mean >= 0.01 else f"{x:.4f}"


def cell(windows):
    kl = [k for k, _ in windows.values()]
    top1 = [t for _, t in windows.values()]
    m = sum(kl) / len(kl)
    return (f"{fmt(m, m)} ({fmt(quantile(kl, 0.1), m)}..{fmt(quantile(kl, 0.9), m)}), "
            f"{100 * sum(top1) / len(top1):.1f}%")


def main(out, context):
    names = sorted({f.split("_", 1)[1][:-4] for f in os.listdir(out)
                    if f.endswith(".csv") and f.startswith("dev_")},
                   key=lambda n: (n != "all", n))
    data = {}
    for name in names:
        for half in ("dev", "report"):
            data[(name, half)] = load(os.path.join(out, f"{half}_{name}.csv"))
    budgets = sorted({k[2] for runs in data.values() for k in runs}, reverse=True)
    head = " | ".join(f"{b} rows ({100 * b / context:g}%)" for b in budgets)
    print(f"| run | method | scoring | half | {head} |")
    print("|---|---|---|---|" + "---:|" * len(budgets))
    for name in names:
        groups = []
        for (m, s, _b) in data[(name, "dev")]:
            if (m, s) not in groups:
                groups.append((m, s))
        for m, s in groups:
            for half in ("dev", "report"):
                runs = data[(name, half)]
                cells = " | ".join(cell(runs[(m, s, b)]) if (m, s, b) in runs else ""
                                   for b in budgets)
                print(f"| {name} | {m} | {s} | {half} | {cells} |")
    print()
    print("Window by window against the recency window (streaming_llm): windows with a lower KL, "
          "and median KL (recency's in brackets).")
    print()
    print(f"| run | method | half | {' | '.join(f'{b} rows' for b in budgets)} |")
    print("|---|---|---|" + "---:|" * len(budgets))
    for name in names:
        for half in ("dev", "report"):
            for m, s in sorted({(k[0], k[1]) for k in data[(name, half)]}):
                if s != "proxy" or m not in ("squeeze", "h2o", "squeeze_uniform"):
                    continue
                cells = []
                for b in budgets:
                    run = data[(name, half)].get((m, s, b))
                    rec = data[("all", half)].get(("streaming_llm", "-", b))
                    if run is None or rec is None:
                        cells.append("")
                        continue
                    wins = sum(run[w][0] < rec[w][0] for w in run)
                    med = quantile([k for k, _ in run.values()], 0.5)
                    med_rec = quantile([k for k, _ in rec.values()], 0.5)
                    cells.append(f"{wins}/{len(run)}, {fmt(med, med)} ({fmt(med_rec, med_rec)})")
                print(f"| {name} | {m} proxy | {half} | {' | '.join(cells)} |")


def load_bytes(path):
    """{(method, scoring, budget): {window: kept_bytes}} of one CSV, without the mean rows."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["window"] == "mean" or r["budget"] == "full":
                continue
            out.setdefault((r["method"], r["scoring"], int(r["budget"])), {})[int(r["window"])] = \
                float(r["kept_bytes"])
    return out


def adaptive(docs, context):
    """The tables of docs/fidelity.md "Adaptive heads": for each fidelity_adaptive*_{dev,report}.csv,
    every series (uniform heads = the plain method name, adaptive = METHOD_adaptiveFLOOR) at every
    budget: mean KL to 3 significant digits (10th..90th percentile), top-1, mean kept KiB, and against the same method's
    uniform heads the windows with a lower KL and whether every window kept the same bytes."""
    files = sorted(f for f in os.listdir(docs)
                   if f.startswith("fidelity_adaptive") and f.endswith(".csv"))
    for name in files:
        runs = load(os.path.join(docs, name))
        kept = load_bytes(os.path.join(docs, name))
        budgets = sorted({k[2] for k in runs}, reverse=True)
        print(f"{name}:")
        print()
        head = " | ".join(f"{b} rows ({100 * b / context:g}%)" for b in budgets)
        print(f"| series | scoring | {head} |")
        print("|---|---|" + "---:|" * len(budgets))
        groups = []
        for (m, s, _b) in runs:
            if (m, s) not in groups:
                groups.append((m, s))
        for m, s in groups:
            base = m.split("_adaptive")[0]
            cells = []
            for b in budgets:
                w = runs.get((m, s, b))
                if w is None:
                    cells.append("")
                    continue
                kl = [k for k, _ in w.values()]
                text = (f"{sum(kl) / len(kl):.3g} ({quantile(kl, 0.1):.2g}..{quantile(kl, 0.9):.2g}), "
                        f"{100 * sum(t for _, t in w.values()) / len(w):.1f}%")
                kib = sum(kept[(m, s, b)].values()) / len(w) / 1024
                text += f", {kib:.1f} KiB"
                ref = runs.get((base, s, b))
                if m != base and ref is not None:
                    wins = sum(w[i][0] < ref[i][0] for i in w)
                    same = all(kept[(m, s, b)][i] == kept[(base, s, b)][i] for i in w)
                    text += f", {wins}/{len(w)} lower" + ("" if same else ", OTHER BYTES")
                cells.append(text)
            print(f"| {m} | {s} | {' | '.join(cells)} |")
        print()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "adaptive":
        adaptive(sys.argv[2] if len(sys.argv) > 2 else "docs",
                 int(sys.argv[3]) if len(sys.argv) > 3 else 512)
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "docs/fidelity_heldout",
             int(sys.argv[2]) if len(sys.argv) > 2 else 512)
