#!/usr/bin/env bash
# Decode speed deep in the context, F16 KV against TQ4 KV: `snug bench -p 0
# -n 64 -d DEPTH -r 3` for each format in turn, ROUNDS rounds (the order
# alternating), 2 threads. Prints each format's median tok/s and the median
# of the per-round TQ4/F16 ratios; writes OUT/kvdepth-MODEL.json.
#
# Usage: bench/kv-depth.sh [OUT] [DEPTH] [ROUNDS] [MODELS...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out}
depth=${2:-4096}
rounds=${3:-5}
shift $(( $# >= 3 ? 3 : $# ))
models=${*:-smollm2-135m qwen2.5-coder-0.5b}
mkdir -p "$out"
cargo build --release -p snug >&2
for m in $models; do
  f="$out/kvdepth-$m.json"
  echo "[]" > "$f"
  for r in $(seq 1 "$rounds"); do
    if (( r % 2 )); then order="f16 tq4"; else order="tq4 f16"; fi
    for kv in $order; do
      target/release/snug bench "$m" -p 0 -n 64 -d "$depth" -r 3 -t 2 --kv "$kv" -o json \
        | python3 -c "import json,sys; a=json.load(open('$f')); a+=[dict(r, round=$r) for r in json.load(sys.stdin)]; json.dump(a, open('$f','w'))"
    done
  done
  python3 - "$f" "$m" "$depth" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))
by = {}
for r in rows:
    by.setdefault(r["kv"], {})[r["round"]] = r["tok_s_median"]
f16, tq4 = by["f16"], by["tq4"]
ratios = [tq4[k] / f16[k] for k in f16 if k in tq4]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {statistics.median(f16.values()):.2f} | {statistics.median(tq4.values()):.2f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds) |")
PY
done
