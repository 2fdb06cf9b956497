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

Usage: python3 bench/charts.py   (no third-party packages)
"""
import json
import statistics
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


def main():
    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    for machine in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        kv = sorted(machine.glob("kvdepth-*.json"))
        if kv:
            made.append(kv_depth(machine.name, kv))
        for sub in sorted(p for p in machine.iterdir() if p.is_dir() and any(p.glob("ab-*.json"))):
            made.append(ab(machine.name, sub.name, sub))
    for m in made:
        print(f"docs/img/{m}")


if __name__ == "__main__":
    main()
