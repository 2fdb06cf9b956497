#!/usr/bin/env bash
# snug bench beside llama-bench on the same GGUF files, same threads:
# pp128, pp512, tg128, and tg64 at depth 2048; llama.cpp with -fa 0 and 1.
# Writes one markdown file per program and model into OUT (default
# bench/out, not committed) and prints them; also the machine's read
# bandwidth before and after (bandwidth.txt) and each model's bytes read
# per decode step (bytes-MODEL.txt), for the roofline. Ends with the
# side-by-side table and roofline shares (bench/summarize.py, also kept
# as summary.md); where OUT is bench/results/MACHINE/compare, also the
# chart docs/img/compare-MACHINE.svg (bench/charts.py).
#
# Usage: bench/compare.sh LLAMA_BIN_DIR [OUT] [MODELS...]
#   THREADS (2), REPS (3), LLAMA_ARGS: more llama-bench flags ("--repack 0"
#   where its repacked AMX kernels stop on an illegal instruction).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
out=${2:-bench/out}
shift $(( $# >= 2 ? 2 : 1 ))
models=${*:-smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b}
threads=${THREADS:-2}
reps=${REPS:-3}
mkdir -p "$out"
cargo build --release -p snug >&2
cargo build --release -p snug-kernels --example bandwidth -p snug-model --example bytes_per_token >&2
target/release/examples/bandwidth "$threads" | tail -n 1 > "$out/bandwidth.txt"
for m in $models; do
  path=$(target/release/snug pull "$m" | tail -n 1)
  "$bin/llama-bench" -m "$path" -t "$threads" -p 128,512 -n 128 -fa 0,1 -r "$reps" ${LLAMA_ARGS:-} -o md > "$out/llama-$m.md" 2>/dev/null
  "$bin/llama-bench" -m "$path" -t "$threads" -p 0 -n 64 -d 2048 -fa 0,1 -r "$reps" ${LLAMA_ARGS:-} -o md 2>/dev/null | grep "d2048" >> "$out/llama-$m.md"
  target/release/snug bench "$path" -t "$threads" -p 128,512 -n 128 -r "$reps" > "$out/snug-$m.md"
  target/release/snug bench "$path" -t "$threads" -p "" -n 64 -d 2048 -r "$reps" | tail -n 1 >> "$out/snug-$m.md"
  target/release/examples/bytes_per_token "$path" > "$out/bytes-$m.txt"
  cat "$out/llama-$m.md" "$out/snug-$m.md"
done
target/release/examples/bandwidth "$threads" | tail -n 1 >> "$out/bandwidth.txt"
python3 bench/summarize.py "$out" | tee "$out/summary.md"
case "$(cd "$out" && pwd)" in
  "$(pwd)"/bench/results/*/compare) python3 bench/charts.py ;;
esac
