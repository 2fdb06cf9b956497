#!/bin/sh
# Variants of the one-row product's tuning macros (kernels.cu's MV_U and
# MV_BLOCKS, through `gpucheck --define`), in one call: each variant's
# logits and invariance checks on the synthesized 7B file, then decode
# steps of the SmolLM2, 1.5B and 7B shapes, variants alternating. .gpu/
# holds gpucheck.gz, synth.gz and tok.gguf. Run from the repository root;
# a summary on stdout and in $OUT/sweep.txt.
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/sweep gpucheck synth
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2> /dev/null
./synth --like tok.gguf --shape 1.5b --out 1.5b.gguf 2> /dev/null
./synth --like tok.gguf --shape 7b --out 7b.gguf 2> /dev/null
V="MV_U=2 MV_U=4 MV_U=1 MV_U=8"
{
  for v in $V; do
    ./gpucheck 7b.gguf --prompt 32 --gen 8 --pp 64 --tg 8 --define $v --out c.json > /dev/null 2>&1
    python3 -c "
import json; d=json.load(open('c.json'))
print('$v 7b', d['logits_bitwise_equal_to_cpu_steps'], 'of', d['greedy_steps_equal_to_cpu'], all(v for k, v in d.items() if k.startswith(('batch_inv', 'graphs_same'))))"
  done
  for round in 1 2; do
    for m in smol 1.5b 7b; do
      for v in $V; do
        echo "$v $m depth 64: $(./gpucheck $m.gguf --prompt 64 --profile-decode 30 --define $v 2>/dev/null | tail -1)"
      done
    done
  done
} 2>&1 | tee $OUT/sweep.txt
