#!/bin/sh
# The build before a change against the build after, on the synthesized
# SmolLM2, 1.5B and 7B files, in one call of a GPU machine: logits against
# the CPU and every invariance check (the new build), then decode steps
# and `snug bench` of the two builds alternating. .gpu/ as for compare.sh,
# with gpucheck-old.gz and snug-old.gz; no llama.cpp. Run from the
# repository root (STEPS=0 leaves out the decode steps); a summary on
# stdout and in $OUT/ab.txt.
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/ab gpucheck synth snug gpucheck-old snug-old
export SNUG_HOME=/tmp/snug-home
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2> /dev/null
./synth --like tok.gguf --shape 1.5b --out 1.5b.gguf 2> /dev/null
./synth --like tok.gguf --shape 7b --out 7b.gguf 2> /dev/null
{
  for m in smol 1.5b 7b; do
    ./gpucheck $m.gguf --prompt 32 --gen 8 --pp 64 --tg 8 --out check-$m.json > /dev/null 2>&1
    python3 -c "
import json; d=json.load(open('check-$m.json'))
print('$m', {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'tiles_same'))})"
  done
  [ "${STEPS:-1}" = 0 ] || for n in 64 512; do
    for m in smol 1.5b 7b; do
      for b in gpucheck-old gpucheck gpucheck-old gpucheck; do
        echo "$b $m depth $n: $(./$b $m.gguf --prompt $n --profile-decode 30 2>/dev/null | tail -1)"
      done
    done
  done
  for m in smol 1.5b 7b; do
    for b in snug-old snug; do
      ./$b bench $m.gguf -p 512 -n 128 -r 3 --device cuda -o json > bench-$b-$m.json 2> /dev/null
      python3 -c "
import json; print('$b $m', [(d['test'], round(d['tok_s_median'], 1)) for d in json.load(open('bench-$b-$m.json'))])"
    done
  done
} 2>&1 | tee $OUT/ab.txt
