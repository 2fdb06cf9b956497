#!/usr/bin/env bash
# The longest context a fixed KV budget holds, per format: snug's
# `kv_budget_tokens` (pages that fit after the exact window's twins, from
# `snug run --kv-budget B --json`) beside llama.cpp's KV buffer for 8,192
# cells (`llama-completion -lv 4` prints it) scaled to the budget in whole
# 256-cell steps. Prints a markdown table.
#
# Usage: bench/kv-budget.sh LLAMA_BIN_DIR [BUDGET_MIB] [MODELS...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
mib=${2:-256}
shift $(( $# >= 2 ? 2 : 1 ))
models=${*:-smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b}
cargo build --release -p snug >&2
echo "| model | snug f16 | snug q8 | snug tq4 | llama.cpp f16 | llama.cpp q8_0 | llama.cpp q4_0 |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for m in $models; do
  path=$(target/release/snug pull "$m" | tail -n 1)
  row="| $m"
  for kv in f16 q8 tq4; do
    n=$(target/release/snug run "$path" -p hi -n 1 -t 2 --speculate off --kv "$kv" --kv-budget "${mib}MiB" --json \
      | python3 -c "import json,sys; print(json.load(sys.stdin)['stats']['kv_budget_tokens'])")
    row="$row | $n"
  done
  for kv in f16 q8_0 q4_0; do
    # One line per cache (Gemma 3 has a full one and a sliding-window one):
    # "size = X MiB ( N cells, ...".
    n=$("$bin/llama-completion" -m "$path" -c 8192 -n 1 -p hi -t 2 -fa on -ctk "$kv" -ctv "$kv" -no-cnv -lv 4 2>&1 \
      | grep "llama_kv_cache: size" \
      | python3 -c "
import re, sys
full = fixed = 0.0
for line in sys.stdin:
    mib, cells = re.search(r'size = +([\d.]+) MiB \( *(\d+) cells', line).groups()
    if int(cells) == 8192:
        full += float(mib) / 8192
    else:
        fixed += float(mib)
print(int(($mib - fixed) / full) // 256 * 256)")
    row="$row | $n"
  done
  echo "$row |"
done
