#!/usr/bin/env python3
"""Side-by-side table from bench/compare.sh's output folder: for each model
and test, llama.cpp's best of -fa 0 and -fa 1, snug's median, and the ratio;
then the decode roofline (bytes read per step / the run's mean measured
read bandwidth) and each program's share of it at tg128.

Usage: python3 bench/summarize.py [bench/out]
"""
import re
import sys
from pathlib import Path

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def parse(path, llama):
    rows = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.search(r"\d", cells[-1]):
            continue
        test = cells[-2]
        m = re.match(r"([\d.]+)\s*±\s*([\d.]+)", cells[-1])
        if not m:
            continue
        test = re.sub(r"\s+", " ", test.replace("@ ", "@").replace("@", "@ "))
        value = float(m.group(1))
        key = test
        if llama:
            fa = cells[-3]
            rows.setdefault(key, {})[fa] = (value, float(m.group(2)))
        else:
            rows[key] = (value, float(m.group(2)))
    return rows


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out")
    print("| model | test | llama.cpp t/s (best of fa 0/1) | snug t/s | snug / llama.cpp |")
    print("| --- | --- | ---: | ---: | ---: |")
    for m in MODELS:
        lp, sp = out / f"llama-{m}.md", out / f"snug-{m}.md"
        if not lp.exists() or not sp.exists():
            continue
        ll, ss = parse(lp, True), parse(sp, False)
        for test, s in ss.items():
            l = ll.get(test)
            if not l:
                continue
            fa, (lv, lsd) = max(l.items(), key=lambda kv: kv[1][0])
            print(f"| {m} | {test} | {lv:.2f} ± {lsd:.2f} (fa {fa}) | {s[0]:.2f} ± {s[1]:.2f} | {s[0] / lv:.2f}x |")
    bw_path = out / "bandwidth.txt"
    if not bw_path.exists():
        return
    bws = [float(x) for x in re.findall(r"([\d.]+) GB/s", bw_path.read_text())]
    if not bws:
        return
    bw = sum(bws) / len(bws)
    print()
    print(f"Read bandwidth: {', '.join(f'{b:.1f}' for b in bws)} GB/s (start, end); roofline at {bw:.1f} GB/s:")
    print()
    print("| model | bytes read per token | roofline tok/s | snug tg128 | share | llama.cpp tg128 | share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for m in MODELS:
        bp, lp, sp = out / f"bytes-{m}.txt", out / f"llama-{m}.md", out / f"snug-{m}.md"
        if not (bp.exists() and lp.exists() and sp.exists()):
            continue
        b = int(bp.read_text().split()[0])
        roof = bw * 1e9 / b
        s = parse(sp, False).get("tg128")
        l = parse(lp, True).get("tg128")
        if not s or not l:
            continue
        lv = max(v[0] for v in l.values())
        print(f"| {m} | {b / 1e6:.1f} MB | {roof:.1f} | {s[0]:.1f} | {100 * s[0] / roof:.0f}% | {lv:.1f} | {100 * lv / roof:.0f}% |")


if __name__ == "__main__":
    main()
