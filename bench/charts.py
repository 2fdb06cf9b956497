#!/usr/bin/env python3
"""SVG charts for docs/ from the benchmark JSON kept in bench/results/.

Each folder bench/results/MACHINE/ holds the JSON that bench scripts
wrote on one machine class (for example zen4-2c): kvdepth-MODEL.json from
bench/kv-depth.sh, and ab-*.json from bench/ab.sh. For each it draws:

  docs/img/kv-depth-MACHINE.svg   lossy KV's speed as a ratio to F16's in
                                  the same round, per SIMD level, depth
                                  and test (median of the rounds)
  docs/img/ab-MACHINE-NAME.svg    B/A speed per model and test from
                                  bench/ab.sh's folder NAME
  docs/img/threads-MACHINE.svg    snug over llama.cpp per model, thread
                                  count and test, from the lines of
                                  threads.txt (bench/gpu/threads.sh)
  docs/img/compare-MACHINE.svg    snug over llama.cpp per model and test
                                  from bench/compare.sh's output folder
                                  bench/results/MACHINE/compare/

Usage: python3 bench/charts.py   (no third-party packages)
"""
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
IMG = ROOT / "docs" / "img"
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948"]


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def bar_chart(title, groups, series, values, y_max, note, unit_line=1.0):
    """Grouped bars: `groups` along x, one bar per series in each group;
    values[(group, series)] -> float (missing: no bar). A dashed line at
    `unit_line`."""
    bar, gap, left, top, height = 16, 14, 56, 40, 220
    width = left + len(groups) * (len(series) * bar + gap) + 20
    legend_w = sum(12 + 8 * len(s) + 22 for s in series)
    width = max(width, left + legend_w + 20)
    h_total = top + height + 90
    y = lambda v: top + height - min(v, y_max) / y_max * height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h_total}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{h_total}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="13" font-weight="bold">{esc(title)}</text>',
    ]
    step = 0.25 if y_max <= 1.5 else 0.5
    t = 0.0
    while t <= y_max + 1e-9:
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:.2f}</text>')
        t += step
    out.append(
        f'<line x1="{left}" x2="{width - 10}" y1="{y(unit_line):.1f}" y2="{y(unit_line):.1f}" '
        'stroke="#333" stroke-dasharray="4 3"/>'
    )
    x = left + gap / 2
    for g in groups:
        for i, s in enumerate(series):
            v = values.get((g, s))
            if v is not None:
                out.append(
                    f'<rect x="{x + i * bar:.1f}" y="{y(v):.1f}" width="{bar - 2}" '
                    f'height="{top + height - y(v):.1f}" fill="{COLORS[i % len(COLORS)]}">'
                    f"<title>{esc(g)} {esc(s)}: {v:.3f}</title></rect>"
                )
                out.append(
                    f'<text x="{x + i * bar + (bar - 2) / 2:.1f}" y="{y(v) - 3:.1f}" '
                    f'text-anchor="middle" font-size="8">{v:.2f}</text>'
                )
        cx = x + len(series) * bar / 2
        for j, line in enumerate(str(g).split("\n")):
            out.append(f'<text x="{cx:.1f}" y="{top + height + 14 + 12 * j}" text-anchor="middle">{esc(line)}</text>')
        x += len(series) * bar + gap
    lx = left
    ly = top + height + 48
    for i, s in enumerate(series):
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}">{esc(s)}</text>')
        lx += 12 + 8 * len(s) + 22
    out.append(f'<text x="{left}" y="{ly + 22}" fill="#555">{esc(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def kv_depth(machine, files):
    # ratio to F16 in the same (round, level, depth, test), median over rounds
    recs = [r for f in files for r in json.loads(f.read_text())]
    by = defaultdict(dict)
    for r in recs:
        by[(r.get("round", 1), r["simd"], r["depth"], r["test"])][r["kv"]] = r["tok_s_median"]
    ratios = defaultdict(list)
    for (rnd, simd, depth, test), kv in by.items():
        if "f16" not in kv:
            continue
        for fmt, v in kv.items():
            if fmt != "f16":
                ratios[(simd, depth, test, fmt)].append(v / kv["f16"])
    levels = sorted({k[0] for k in ratios}, reverse=True)
    fmts = sorted({k[3] for k in ratios})
    groups, values = [], {}
    for simd in levels:
        for depth in sorted({k[1] for k in ratios if k[0] == simd}):
            for test in sorted({k[2] for k in ratios if k[0] == simd and k[1] == depth}):
                g = f"{simd}\nd{depth} {test}"
                groups.append(g)
                for fmt in fmts:
                    if (simd, depth, test, fmt) in ratios:
                        values[(g, fmt)] = statistics.median(ratios[(simd, depth, test, fmt)])
    models = sorted({r["model"] for r in recs})
    y_max = max(1.25, max(values.values(), default=1) * 1.1)
    svg = bar_chart(
        f"Lossy KV speed / F16 speed ({machine})",
        groups,
        fmts,
        values,
        y_max,
        f"{', '.join(models)}; 2 threads; median of per-round ratios (bench/kv-depth.sh)",
    )
    (IMG / f"kv-depth-{machine}.svg").write_text(svg)
    return f"kv-depth-{machine}.svg"


def ab(machine, name, folder):
    runs = defaultdict(lambda: defaultdict(dict))
    for f in sorted(folder.glob("ab-*.json")):
        parts = f.stem.split("-")
        model, side, rnd = "-".join(parts[1:-2]), parts[-2], parts[-1]
        for r in json.loads(f.read_text()):
            runs[(model, r["test"])][rnd][side] = r["tok_s_median"]
    groups, values = [], {}
    for (model, test), by_round in sorted(runs.items()):
        pairs = [v for v in by_round.values() if "a" in v and "b" in v]
        if not pairs:
            continue
        g = f"{model}\n{test}"
        groups.append(g)
        values[(g, "B/A")] = statistics.median(v["b"] / v["a"] for v in pairs)
    svg = bar_chart(
        f"{name}: speed of B over A ({machine})",
        groups,
        ["B/A"],
        values,
        1.5,
        "snug bench, 2 threads; median of per-round ratios, A and B interleaved (bench/ab.sh)",
    )
    (IMG / f"ab-{machine}-{name}.svg").write_text(svg)
    return f"ab-{machine}-{name}.svg"


def threads(machine, files):
    """snug / llama.cpp from `snug MODEL tT pp512 X tg128 Y` and
    `llama.cpp MODEL tT ...` lines (lines without a model name are
    SmolLM2's)."""
    speed = {}
    for f in files:
        for line in f.read_text().splitlines():
            w = line.split()
            # A line may follow the CPU's flags on the same line.
            at = next((i for i, x in enumerate(w) if x in ("snug", "llama", "llama.cpp")), None)
            if at is None or len(w) - at < 6:
                continue
            w = w[at:]
            if w[1].startswith("t") and w[1][1:].isdigit():
                w.insert(1, "smol")
            prog = "snug" if w[0] == "snug" else "llama"
            for k in range(3, len(w) - 1, 2):
                speed[(w[1], int(w[2][1:]), w[k], prog)] = float(w[k + 1])
    names = {"smol": "SmolLM2", "g3": "Gemma3 270M", "0.5b": "Qwen 0.5B", "1.5b": "Qwen 1.5B"}
    models = [m for m in names if any(k[0] == m for k in speed)]
    counts = sorted({k[1] for k in speed})
    groups, values = [], {}
    for m in models:
        for t in counts:
            g = f"{names[m]}\n{t}t"
            groups.append(g)
            for test in ("pp512", "tg128"):
                a, b = speed.get((m, t, test, "snug")), speed.get((m, t, test, "llama"))
                if a and b:
                    values[(g, test)] = a / b
    svg = bar_chart(
        f"snug over llama.cpp by thread count ({machine})",
        groups,
        ["pp512", "tg128"],
        values,
        3.5,
        "snug bench -p 512 -n 128 -r 2 -t T against llama-bench (best of -fa 0,1), GGML_NATIVE (bench/gpu/threads.sh)",
    )
    (IMG / f"threads-{machine}.svg").write_text(svg)
    return f"threads-{machine}.svg"


def compare(machine, folder):
    """snug / llama.cpp (its better of -fa 0 and 1) per model and test, as
    bench/summarize.py reads bench/compare.sh's folder."""
    sys.path.insert(0, str(ROOT / "bench"))
    import summarize

    tests = ["pp128", "pp512", "tg128", "tg64 @ d2048"]
    groups, values = [], {}
    for m in summarize.MODELS:
        lp, sp = folder / f"llama-{m}.md", folder / f"snug-{m}.md"
        if not (lp.exists() and sp.exists()):
            continue
        ll, ss = summarize.parse(lp, True), summarize.parse(sp, False)
        groups.append(m)
        for test in tests:
            if test in ss and test in ll:
                values[(m, test)] = ss[test][0] / max(v[0] for v in ll[test].values())
    top = max(values.values(), default=1.0)
    svg = bar_chart(
        f"snug over llama.cpp ({machine})",
        groups,
        tests,
        values,
        max(2.5, float(int(top * 2 + 1)) / 2),
        "snug bench against llama-bench (best of -fa 0,1), same files and threads (bench/compare.sh)",
    )
    (IMG / f"compare-{machine}.svg").write_text(svg)
    return f"compare-{machine}.svg"


def main():
    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    host = sorted(RESULTS.glob("h200-*/threads.txt"))
    if host:
        made.append(threads("h200-host-16c", host))
    for machine in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        kv = sorted(machine.glob("kvdepth-*.json"))
        if kv:
            made.append(kv_depth(machine.name, kv))
        if (machine / "compare").is_dir():
            made.append(compare(machine.name, machine / "compare"))
        for sub in sorted(p for p in machine.iterdir() if p.is_dir() and any(p.glob("ab-*.json"))):
            made.append(ab(machine.name, sub.name, sub))
    for m in made:
        print(f"docs/img/{m}")


if __name__ == "__main__":
    main()
