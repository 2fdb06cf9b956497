#!/usr/bin/env bash
# KV format quality: `snug eval ppl` with f16, q8 and tq4 KV beside
# llama.cpp's `llama-perplexity` with f16, q8_0 and q4_0 KV (flash
# attention on, which quantized V needs), same text, model and 512-token
# windows, 2 threads. Writes OUT/kvq-*.{json,txt} and prints a table.
# snug's f16 figures come from the F16 engine each compressed run compares
# against. SNUG_KVS and LLAMA_KVS choose the formats run (defaults: "q8
# tq4" and "f16 q8_0 q4_0").
#
# Usage: bench/kv-quality.sh LLAMA_BIN_DIR [OUT] [MODELS...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
out=${2:-bench/out}
shift $(( $# >= 2 ? 2 : 1 ))
models=${*:-smollm2-135m qwen2.5-coder-0.5b}
text="$out/licenses.txt"
bench/eval-text.sh "$text"
cargo build --release -p snug >&2
for m in $models; do
  path=$(target/release/snug pull "$m" | tail -n 1)
  for kv in ${SNUG_KVS:-q8 tq4}; do
    target/release/snug eval ppl "$path" "$text" --kv "$kv" --ctx 512 -t 2 --json > "$out/kvq-snug-$m-$kv.json"
    cat "$out/kvq-snug-$m-$kv.json"
  done
  for kv in ${LLAMA_KVS:-f16 q8_0 q4_0}; do
    "$bin/llama-perplexity" -m "$path" -f "$text" -c 512 -b 512 -t 2 -fa on -ctk "$kv" -ctv "$kv" \
      > "$out/kvq-llama-$m-$kv.txt" 2>&1
    grep -o "Final estimate: PPL = [0-9.]*" "$out/kvq-llama-$m-$kv.txt" | sed "s/^/$m $kv: /"
  done
done
python3 - "$out" $models <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| model | KV | tokens | snug ppl (f16) | ΔPPL vs f16 | KL vs f16 | top-1 vs f16 | llama.cpp KV | llama.cpp ppl (f16) | ΔPPL vs f16 |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
def lp(m, kv):
    f = out / f"kvq-llama-{m}-{kv}.txt"
    if not f.exists():
        return None
    r = re.search(r"Final estimate: PPL = ([\d.]+)", f.read_text())
    return float(r.group(1)) if r else None
for m in sys.argv[2:]:
    lf = lp(m, "f16")
    for kv, lkv in [("q8", "q8_0"), ("tq4", "q4_0")]:
        f = out / f"kvq-snug-{m}-{kv}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        d = 100 * (r["ppl"] / r["ppl_f16"] - 1)
        l = lp(m, lkv)
        ld = f"{100 * (l / lf - 1):+.2f}%" if l and lf else "-"
        ls = f"{l:.4f} ({lf:.4f})" if l and lf else "-"
        print(f"| {m} | {kv} | {r['tokens']} | {r['ppl']:.4f} ({r['ppl_f16']:.4f}) | {d:+.2f}% | {r['kl_vs_f16']:.5f} | {100 * r['top1_vs_f16']:.2f}% | {lkv} | {ls} | {ld} |")
PY
