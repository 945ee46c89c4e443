#!/usr/bin/env python3
"""The flag-matrix table of BENCHMARKS.md section 1 from bench_core's JSON (medians).

Usage: bench_table.py DIR NAME...   (reads DIR/NAME.json for each flag-set NAME)
"""
import json
import sys


def medians(path):
    with open(path) as f:
        data = json.load(f)
    out = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name = b["run_name"].replace("/real_time", "")
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[b["time_unit"]]
        # Multi-threaded runs are timed in real time; the others by CPU time of the one thread.
        t = b["real_time"] if "Threads" in name else b["cpu_time"]
        out[name] = t * scale  # microseconds
    return out


# The kernel paths by their SimdLevel number (BM_DecodeAttendPath's second argument).
PATHS = ("scalar", "sse2", "avx2", "avx512", "neon")


def fmt(us):
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def main():
    root, names = sys.argv[1], sys.argv[2:]
    runs = {n: medians(f"{root}/{n}.json") for n in names}
    print("| build | budget | decode view | attention fp32 (GEMV) | attention fp16 (F16C) |"
          " ratio to the faster | decode on 2 threads |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        m = runs[n]
        for budget in (512, 2048):
            view = m.get(f"BM_DecodeView/{budget}")
            f32 = m.get(f"BM_AttentionF32Gemv/{budget + 1}")
            f16 = m.get(f"BM_AttentionF16Dot/{budget + 1}")
            thr = m.get(f"BM_DecodeViewThreads/{budget}")
            if view is None or f32 is None:
                continue
            best = min(x for x in (f32, f16) if x is not None)
            print(f"| {n} | {budget} | {fmt(view)} | {fmt(f32)} | {fmt(f16) if f16 else '-'} |"
                  f" {view / best:.2f}x | {fmt(thr) if thr else '-'} |")
    print()
    print("| build | S | prefill (key-as-query, H = 32) | causal attention (H = 32) | ratio |"
          " prefill with queries (G = 4, H = 8) | causal attention (Hq = 32, H = 8) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        m = runs[n]
        for s in (1024, 4096):
            p = m.get(f"BM_PrefillView/{s}")
            c = m.get(f"BM_CausalAttention/{s}/32")
            pq = m.get(f"BM_PrefillViewQueries/{s}")
            cq = m.get(f"BM_CausalAttention/{s}/8")
            if None in (p, c, pq, cq):
                continue
            print(f"| {n} | {s} | {fmt(p)} | {fmt(c)} | {p / c:.2f}x | {fmt(pq)} | {fmt(cq)} |"
                  f" {pq / cq:.2f}x |")
    print()
    print("| build | budget | decode attend (G = 4, H = 8) | dense GQA fp32 (Eigen) |"
          " dense GQA fp16 (hardware fp16) | ratio to the faster |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        m = runs[n]
        for budget in (512, 2048):
            a = m.get(f"BM_DecodeAttend/{budget}")
            f32 = m.get(f"BM_DecodeGQAF32Gemm/{budget + 1}")
            f16 = m.get(f"BM_DecodeGQAF16/{budget + 1}")
            if a is None or f32 is None:
                continue
            best = min(x for x in (f32, f16) if x is not None)
            print(f"| {n} | {budget} | {fmt(a)} | {fmt(f32)} | {fmt(f16) if f16 else '-'} |"
                  f" **{a / best:.2f}x** |")
    print()
    print("| build | S | prefill attend (into budget 512) | causal GQA attention with P.V |"
          " ratio |")
    print("|---|---:|---:|---:|---:|")
    for n in names:
        m = runs[n]
        for s in (512, 2048, 8192):
            a = m.get(f"BM_PrefillAttend/{s}")
            c = m.get(f"BM_CausalAttention/{s}/8")
            if a is None or c is None:
                continue
            print(f"| {n} | {s} | {fmt(a)} | {fmt(c)} | **{a / c:.2f}x** |")
    print()
    print("| build | budget | " + " | ".join(f"attend on {p}" for p in PATHS) +
          " | scalar / best |")
    print("|---|---:|" + "---:|" * (len(PATHS) + 1))
    for n in names:
        m = runs[n]
        for budget in (512, 2048):
            t = [m.get(f"BM_DecodeAttendPath/{budget}/{level}") for level in range(len(PATHS))]
            if t[0] is None:
                continue
            best = min(x for x in t if x is not None)
            cells = " | ".join(fmt(x) if x is not None else "-" for x in t)
            print(f"| {n} | {budget} | {cells} | {t[0] / best:.1f}x |")
    ref = runs.get("O3-native")
    if ref:
        print()
        print("| build | decode view / O3-native's (512) | (2048) |")
        print("|---|---:|---:|")
        for n in names:
            m = runs[n]
            r = [m.get(f"BM_DecodeView/{b}", 0) / ref[f"BM_DecodeView/{b}"] for b in (512, 2048)]
            print(f"| {n} | {r[0]:.2f}x | {r[1]:.2f}x |")


if __name__ == "__main__":
    main()
