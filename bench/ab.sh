#!/usr/bin/env bash
# Two snug binaries against each other on the same machine, interleaved:
# for each of ROUNDS rounds and each model,
#   BIN bench MODEL -p PP -n TG -r REPS -t 2 -o json
# with A then B in odd rounds and B then A in even ones. Writes
# OUT/ab-MODEL-{a,b}-ROUND.json and prints, per model and test, each
# binary's median tok/s and the median of the per-round ratios B/A.
# Use it to show a change that must not move speed is within noise.
#
# Usage: bench/ab.sh A_BIN B_BIN OUT [ROUNDS] [MODELS...]
#   env: PP (128) TG (32) REPS (3) NUMERICS (native)
set -euo pipefail
a=$1 b=$2 out=$3
rounds=${4:-3}
shift $(( $# >= 4 ? 4 : 3 ))
models=${*:-smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b}
pp=${PP:-128} tg=${TG:-32} reps=${REPS:-3} numerics=${NUMERICS:-native}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for m in $models; do
    order="a b"; (( r % 2 == 0 )) && order="b a"
    for side in $order; do
      bin=$a; [[ $side == b ]] && bin=$b
      "$bin" bench "$m" -p "$pp" -n "$tg" -r "$reps" -t 2 --numerics "$numerics" -o json \
        > "$out/ab-$m-$side-$r.json"
    done
  done
done
python3 - "$out" $models <<'PY'
import json, statistics, sys
from pathlib import Path
out, models = Path(sys.argv[1]), sys.argv[2:]
print("| model | test | A tok/s | B tok/s | B/A (median of rounds) |")
print("| --- | --- | ---: | ---: | ---: |")
for m in models:
    runs = {}
    for f in sorted(out.glob(f"ab-{m}-*.json")):
        side, r = f.stem.split("-")[-2:]
        for rec in json.loads(f.read_text()):
            runs.setdefault(rec["test"], {}).setdefault(r, {})[side] = rec["tok_s_median"]
    for test, by_round in runs.items():
        pairs = [v for v in by_round.values() if "a" in v and "b" in v]
        a = statistics.median(v["a"] for v in pairs)
        b = statistics.median(v["b"] for v in pairs)
        ratio = statistics.median(v["b"] / v["a"] for v in pairs)
        print(f"| {m} | {test} | {a:.1f} | {b:.1f} | {ratio:.3f} |")
PY
