#!/bin/sh
# One GPU call, no model to carry: a tokenizer-only GGUF (a couple of MB,
# `synth_gguf --like MODEL --tokenizer-only`) goes in .gpu/tok.gguf with
# gpucheck.gz and synth.gz; SmolLM2's and a 7B shape are synthesized there,
# each decode step is timed, and Nsight Compute gives each kernel's GPU
# time over three decode steps of SmolLM2's shape. Summary to stdout.
set -u
for f in gpucheck gpucheck-old synth; do [ -f .gpu/$f.gz ] || continue; [ -x .gpu/$f ] || { gunzip -c .gpu/$f.gz > .gpu/$f; chmod +x .gpu/$f; }; done
nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
[ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
.gpu/synth --like .gpu/tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out /tmp/smol.gguf
.gpu/synth --like .gpu/tok.gguf --shape 7b --out /tmp/7b.gguf
echo "smol shape, checks:"
.gpu/gpucheck /tmp/smol.gguf --out /tmp/check.json > /dev/null 2>&1
python3 -c "import json; d=json.load(open('/tmp/check.json')); print({k: d[k] for k in d if k.startswith('batch_inv') or k in ('greedy_steps_equal_to_cpu', 'pp_tok_s', 'tg_tok_s')})"
if [ -x .gpu/gpucheck-old ]; then
  .gpu/gpucheck-old /tmp/smol.gguf --out /tmp/check-old.json > /dev/null 2>&1
  python3 -c "
import json; a=json.load(open('/tmp/check.json')); b=json.load(open('/tmp/check-old.json'))
print('same tokens and logit differences as the build before:', a['gpu_tokens']==b['gpu_tokens'] and a['max_abs_logit_diff_per_step']==b['max_abs_logit_diff_per_step'])"
fi
# Decode steps timed; `gpucheck-old`, where carried, is the build before a
# change, run beside it.
for b in gpucheck-old gpucheck; do
  [ -x .gpu/$b ] || continue
  for n in 64 512; do echo "$b smol shape, depth $n:"; .gpu/$b /tmp/smol.gguf --prompt $n --profile-decode 50 2>/dev/null; done
  echo "$b 7b shape, depth 512:"; .gpu/$b /tmp/7b.gguf --prompt 512 --profile-decode 20 2>/dev/null
done
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
  .gpu/gpucheck /tmp/smol.gguf --prompt 64 --profile-decode 3 > /tmp/ncu.csv 2>/tmp/ncu.err
tail -3 /tmp/ncu.err
python3 "$(dirname "$0")/ncusum.py" /tmp/ncu.csv
