#!/bin/sh
# Decode with Q8 and TQ4 pages on the GPU against F16: gpucheck's bitwise
# fields over each coded pair on the SmolLM2 shape and a gemma3 file (a
# sliding window), then each decode step
# timed at depths 64 and 500 on the SmolLM2 and 1.5B shapes (two rounds,
# formats alternating), and `snug bench -p 512 -n 128 --kv f16,q8,tq4`.
# One call, from the repository root, with .gpu/ carried (see layers.sh);
# STEPS=0 leaves out the decode steps, BENCH=0 `snug bench`.
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/kvm synth gpucheck snug
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2>/dev/null
./synth --like tok.gguf --shape 1.5b --out 1.5b.gguf 2>/dev/null
./synth --like tok.gguf --arch gemma3 --shape "g3=512,4,8,2,1536" --window 40 --type q8_0 --head-type q8_0 --scale 0.02 --out gemma3.gguf 2>/dev/null
for m in smol gemma3; do
  for kv in q8 tq4 q8/tq4; do
    ./gpucheck $m.gguf --kv $kv --prompt 90 --gen 40 --pp 96 --tg 8 --out c.json > c.log 2>&1
    python3 -c "
import json; d=json.load(open('c.json'))
print('$m $kv', d['logits_bitwise_equal_to_cpu_steps'], all(v for k, v in d.items() if k.startswith(('batch','graphs_same','overlap_same'))))" || tail -3 c.log
  done
done
[ "${STEPS:-1}" = 0 ] || for m in smol 1.5b; do for r in 1 2; do for kv in f16 q8 tq4; do for n in 64 500; do printf "$m $kv depth$n "; ./gpucheck $m.gguf --kv $kv --prompt $n --profile-decode 40 2>&1 | tail -1; done; done; done; done
[ "${BENCH:-1}" = 0 ] || for m in smol 1.5b; do ./snug bench $m.gguf -p 512 -n 128 -r 3 --kv f16,q8,tq4 --device cuda 2>&1 | tail -6; done
