#!/usr/bin/env bash
# Accuracy and expected calibration error of typed decisions on the labeled
# reviews (data/decide/reviews.jsonl): temperatures fitted on one half of
# the pairs (`--half even`), measured on the other (`--half odd`), before
# and after calibration. Prints one markdown row per model.
#
# Usage: bench/decide-eval.sh SNUG OUTDIR MODEL...
set -euo pipefail
snug=$1; out=$2; shift 2
mkdir -p "$out"
set=data/decide/reviews.jsonl
for m in "$@"; do
  "$snug" decide eval "$m" "$set" --half odd --uncalibrated --json > "$out/decide-$m-before.json"
  "$snug" decide calibrate "$m" "$set" --half even -o "$out/decide-$m-temps.json" >/dev/null
  "$snug" decide eval "$m" "$set" --half odd --calibration "$out/decide-$m-temps.json" --json > "$out/decide-$m-after.json"
  python3 - "$m" "$out/decide-$m-before.json" "$out/decide-$m-after.json" "$out/decide-$m-temps.json" <<'PY'
import json, sys
m, b, a, t = sys.argv[1], *[json.load(open(p)) for p in sys.argv[2:5]]
for kind in ("choice", "noul"):
    bb, aa = b["by_type"][kind], a["by_type"][kind]
    temp = t["temperature"][["choice", "score", "noul"].index(kind)]
    print(f"| {m} | {kind} | {bb['questions']} | {bb['accuracy']*100:.1f}% | {bb['ece']:.3f} | {aa['ece']:.3f} | {bb['nll']:.3f} | {aa['nll']:.3f} | {temp:.2f} |")
PY
done
