#!/usr/bin/env bash
# Accuracy and expected calibration error of typed decisions on the labeled
# reviews (data/decide/reviews.jsonl), two-fold: temperatures fitted on one
# half of the pairs and measured on the other, both ways round, before and
# after calibration. Prints one markdown row per model and question type
# (each figure the mean of the two folds; temperatures of both folds).
#
# Usage: bench/decide-eval.sh SNUG OUTDIR MODEL...
set -euo pipefail
snug=$1; out=$2; shift 2
mkdir -p "$out"
set=data/decide/reviews.jsonl
for m in "$@"; do
  for fit in even odd; do
    test=$([ $fit = even ] && echo odd || echo even)
    "$snug" decide eval "$m" "$set" --half $test --uncalibrated --json > "$out/decide-$m-$test-before.json"
    "$snug" decide calibrate "$m" "$set" --half $fit -o "$out/decide-$m-$fit-temps.json" >/dev/null 2>&1
    "$snug" decide eval "$m" "$set" --half $test --calibration "$out/decide-$m-$fit-temps.json" --json > "$out/decide-$m-$test-after.json"
  done
  python3 - "$m" "$out" <<'PY'
import json, sys
m, out = sys.argv[1], sys.argv[2]
load = lambda n: json.load(open(f"{out}/decide-{m}-{n}.json"))
folds = [(load(f"{t}-before"), load(f"{t}-after"), load(f"{f}-temps")) for f, t in (("even", "odd"), ("odd", "even"))]
for kind in ("choice", "noul"):
    k = ["choice", "score", "noul"].index(kind)
    mean = lambda key, i: sum(f[i]["by_type"][kind][key] for f in folds) / len(folds)
    n = sum(f[0]["by_type"][kind]["questions"] for f in folds)
    temps = "/".join(f"{f[2]['temperature'][k]:.2f}" for f in folds)
    print(f"| {m} | {kind} | {n} | {mean('accuracy', 0)*100:.1f}% | {mean('ece', 0):.3f} | {mean('ece', 1):.3f} | "
          f"{mean('nll', 0):.3f} | {mean('nll', 1):.3f} | {temps} |")
PY
done
