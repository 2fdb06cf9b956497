#!/bin/sh
# The build before a change against the build after, on the synthesized
# SmolLM2, 1.5B and 7B files, in one call of a GPU machine: logits against
# the CPU and every invariance check (the new build), then decode steps
# and `snug bench` of the two builds alternating. .gpu/ as for compare.sh,
# with gpucheck-old.gz and snug-old.gz; no llama.cpp. Run from the
# repository root (STEPS=0 leaves out the decode steps, BENCH=0 `snug
# bench`; MODELS, VARIANTS, DEPTHS and NSYS=1 below); a summary on
# stdout and in $OUT/ab.txt. BENCH_ARGS are added to `snug bench`
# (e.g. "--kv q8,tq4").
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/ab gpucheck synth snug gpucheck-old snug-old
export SNUG_HOME=/tmp/snug-home
models=${MODELS:-smol 1.5b 7b}
gpu_synth $models 2> /dev/null
{
  for m in $models; do
    ./gpucheck $m.gguf --prompt 32 --gen 8 --pp 64 --tg 8 --out check-$m.json > /dev/null 2>&1
    python3 -c "
import json; d=json.load(open('check-$m.json'))
print('$m', {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'tiles_same', 'overlap'))})"
  done
  # Decode-step variants, `|` between them (a build and its flags).
  variants=${VARIANTS:-gpucheck-old|gpucheck|gpucheck-old|gpucheck}
  [ "${STEPS:-1}" = 0 ] || for n in ${DEPTHS:-64 512}; do
    for m in $models; do
      echo "$variants" | tr '|' '\n' | while read -r b flags; do
        echo "$b $flags $m depth $n: $(./$b $m.gguf --prompt $n --profile-decode 30 $flags 2>/dev/null < /dev/null | tail -1)"
      done
    done
  done
  # NSYS=1: GPU time per kernel inside the 7B shape's decode graphs.
  nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  if [ "${NSYS:-0}" = 1 ] && [ -n "$nsys" ]; then
    $nsys profile -q -t cuda --cuda-graph-trace=node -o /tmp/ab/n7b -f true ./gpucheck 7b.gguf --prompt 64 --profile-decode 20 > /dev/null 2>&1
    $nsys stats -q -r cuda_gpu_kern_sum -f csv /tmp/ab/n7b.nsys-rep > $OUT/nsys-7b.csv 2>&1
    $nsys stats -q -r cuda_gpu_trace -f csv /tmp/ab/n7b.nsys-rep 2>/dev/null | tail -400 > $OUT/nsys-7b-trace.csv
    head -20 $OUT/nsys-7b.csv
  fi
  [ "${BENCH:-1}" = 0 ] || for m in $models; do
    for b in snug-old snug; do
      ./$b bench $m.gguf -p 512 -n 128 -r 3 --device cuda ${BENCH_ARGS:-} -o json > bench-$b-$m.json 2> /dev/null
      python3 -c "
import json; print('$b $m', [(d['test'], d.get('kv'), round(d['tok_s_median'], 1)) for d in json.load(open('bench-$b-$m.json'))])"
    done
  done
} 2>&1 | tee $OUT/ab.txt
