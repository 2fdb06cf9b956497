#!/usr/bin/env bash
# KV formats against context depth, on every SIMD level this CPU has: for
# each level (SNUG_SIMD=avx512, then avx2 forced on the same machine, and
# scalar when LEVELS asks for it), ROUNDS rounds of
#   snug bench MODEL -p PP -n TG -d 0,1024,4096 --kv f16,q8,tq4 -r REPS -t 2
# the formats' order reversed every other round. Writes OUT/kvdepth-MODEL.json
# and prints, per level and depth, each format's median prefill and decode
# tok/s and the median of the per-round ratios to F16 in the same round.
# Run it before any change to KV storage or attention is called done: lossy
# KV must not fall behind F16 as the context grows.
#
# Usage: bench/kv-depth.sh [OUT] [ROUNDS] [MODELS...]
#   env: DEPTHS (0,1024,4096) PP (256) TG (32) REPS (2) LEVELS (auto)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out}
rounds=${2:-2}
shift $(( $# >= 2 ? 2 : $# ))
models=${*:-smollm2-135m}
depths=${DEPTHS:-0,1024,4096}
pp=${PP:-256}
tg=${TG:-32}
reps=${REPS:-2}
if [[ -z "${LEVELS:-}" ]]; then
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  LEVELS=""
  if [[ $flags == *avx512f* && $flags == *avx512bw* && $flags == *avx512vl* && $flags == *avx512_vnni* ]]; then
    LEVELS="avx512"
  fi
  if [[ $flags == *avx2* && $flags == *fma* && $flags == *f16c* ]]; then
    LEVELS="$LEVELS avx2"
  fi
  LEVELS=${LEVELS:-scalar}
fi
mkdir -p "$out"
cargo build --release -p snug >&2
for m in $models; do
  f="$out/kvdepth-$m.json"
  echo "[]" > "$f"
  for level in $LEVELS; do
    for r in $(seq 1 "$rounds"); do
      if (( r % 2 )); then kvs="f16,q8,tq4"; else kvs="tq4,q8,f16"; fi
      echo "$m $level round $r: $kvs" >&2
      SNUG_SIMD=$level target/release/snug bench "$m" -p "$pp" -n "$tg" -d "$depths" -r "$reps" -t 2 \
          --kv "$kvs" -o json \
        | python3 -c "import json,sys; a=json.load(open('$f')); a+=[dict(r, round=$r) for r in json.load(sys.stdin)]; json.dump(a, open('$f','w'), indent=1)"
    done
  done
  python3 - "$f" <<'PY'
import json, statistics, sys
rows = json.load(open(sys.argv[1]))
cell = {}
for r in rows:
    cell[(r["simd"], r["depth"], r["test"], r["kv"], r["round"])] = r["tok_s_median"]
model = rows[0]["model"]
levels = list(dict.fromkeys(r["simd"] for r in rows))
depths = sorted({r["depth"] for r in rows})
tests = list(dict.fromkeys(r["test"] for r in rows))
rounds = sorted({r["round"] for r in rows})
print(f"{model}: tok/s, median of rounds (ratio to F16 in the same round, median)")
print()
print("| simd | depth | test | f16 | q8 | tq4 |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for lv in levels:
    for d in depths:
        for t in tests:
            out = []
            for kv in ("f16", "q8", "tq4"):
                v = [cell[k] for k in ((lv, d, t, kv, r) for r in rounds) if k in cell]
                if not v:
                    out.append("-")
                    continue
                s = f"{statistics.median(v):.1f}"
                if kv != "f16":
                    ratios = [cell[(lv, d, t, kv, r)] / cell[(lv, d, t, "f16", r)]
                              for r in rounds if (lv, d, t, kv, r) in cell and (lv, d, t, "f16", r) in cell]
                    s += f" ({statistics.median(ratios):.2f}x)"
                out.append(s)
            print(f"| {lv} | {d} | {t} | " + " | ".join(out) + " |")
PY
done
