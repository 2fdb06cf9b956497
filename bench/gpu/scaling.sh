#!/bin/sh
# Where snug's prefill loses from 1 to 2 threads on the GPU machine's host
# CPU: `snug bench -p 512 -n 0` on the SmolLM2 shape (synthesized, Q4_1
# with a Q8_0 head) and the Qwen2.5 0.5B shape (Q5_0), at 1 to 4 threads,
# three ways: as is, pinned to the first cores (`taskset`), and with the
# kernels capped below AMX (`SNUG_SIMD=avx512`), pinned one thread per
# physical core (`spread`, from lscpu); each cell twice. The CPU topology
# is printed first. MODELS, THREADS and ROUNDS narrow the run. Run from
# the repository root with .gpu/ carried (snug.gz, synth.gz, tok.gguf);
# results in $OUT/scaling.txt.
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/scal synth snug
export SNUG_HOME=/tmp/snug-home
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2> /dev/null
./synth --like tok.gguf --arch qwen2 --shape "0.5b=896,24,14,2,4864,64" --type q5_0 --head-type q8_0 \
  --out 0.5b.gguf 2> /dev/null
{
  lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA|MHz|L2|L3'
  lscpu -e=CPU,CORE,SOCKET,NODE | head -20
  nproc
  uptime
} 2>&1 | tee "$OUT/topology.txt"
# The first CPU of each distinct (socket, core), in CPU order.
spread_cpus() {
  lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | awk -F, '!seen[$3" "$2]++ {print $1}' | head -"$1" | paste -sd,
}
pp() {
  "$@" -p 512 -n 0 -r 3 -o json 2> /dev/null |
    python3 -c "import json,sys; print(' '.join(f\"{d['tok_s_median']:.1f}\" for d in json.load(sys.stdin)))"
}
for m in ${MODELS:-smol 0.5b}; do
  for t in ${THREADS:-1 2 3 4}; do
    cores=$(seq -s, 0 $((t - 1)))
    for rep in $(seq "${ROUNDS:-2}"); do
      echo "$m t$t rep$rep plain $(pp ./snug bench $m.gguf -t $t)" \
        "pinned $(pp taskset -c "$cores" ./snug bench $m.gguf -t $t)" \
        "avx512 $(pp env SNUG_SIMD=avx512 ./snug bench $m.gguf -t $t)" \
        "spread($(spread_cpus $t)) $(pp taskset -c "$(spread_cpus $t)" ./snug bench $m.gguf -t $t)"
    done
  done
done 2>&1 | tee "$OUT/scaling.txt"
