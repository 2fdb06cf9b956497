#!/usr/bin/env bash
# snug and llama.cpp on a busy machine: one CPU-bound process (`yes`)
# runs beside each measurement. Rounds alternate snug and llama-bench
# (and a second snug build, OTHER, where given), pp128 and tg64, the
# same threads; medians of REPS within each, and every round printed.
#
# Usage: bench/busy.sh LLAMA_BIN_DIR [MODELS...]
#   THREADS (2), ROUNDS (3), REPS (3), HOGS (1: CPU-bound processes),
#   OTHER=path/to/another/snug, LLAMA_ARGS (e.g. "--repack 0").
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
shift
models=${*:-smollm2-135m}
threads=${THREADS:-2}
rounds=${ROUNDS:-3}
reps=${REPS:-3}
hogs=${HOGS:-1}
cargo build --release -p snug >&2
snug=target/release/snug
pids=()
stop_hogs() {
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  pids=()
}
trap stop_hogs EXIT
start_hogs() {
  for _ in $(seq "$hogs"); do
    yes > /dev/null &
    pids+=($!)
  done
}
snug_row() { # LABEL BINARY PATH
  start_hogs
  "$2" bench "$3" -t "$threads" -p 128 -n 64 -r "$reps" -o json 2> /dev/null |
    python3 -c "import json, sys
print('$1', ' '.join(f\"{d['test']} {d['tok_s_median']:.1f}\" for d in json.load(sys.stdin)))"
  stop_hogs
}
for m in $models; do
  path=$($snug pull "$m" | tail -n 1)
  echo "# $m, $threads threads, $hogs CPU-bound process(es) beside"
  for r in $(seq "$rounds"); do
    snug_row "snug r$r" "$snug" "$path"
    [ -z "${OTHER:-}" ] || snug_row "other r$r" "$OTHER" "$path"
    start_hogs
    # shellcheck disable=SC2086
    "$bin/llama-bench" -m "$path" -t "$threads" -p 128 -n 64 -fa 0,1 -r "$reps" ${LLAMA_ARGS:-} -o csv 2> /dev/null |
      python3 -c "import csv, sys
best = {}
for r in csv.DictReader(sys.stdin):
    t = f\"pp{r['n_prompt']}\" if r['n_gen'] == '0' else f\"tg{r['n_gen']}\"
    best[t] = max(best.get(t, 0.0), float(r['avg_ts']))
print('llama.cpp r$r', ' '.join(f'{t} {v:.1f}' for t, v in best.items()))"
    stop_hogs
  done
done
