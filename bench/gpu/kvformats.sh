#!/bin/sh
# Q8 and TQ4 KV pages on the GPU against the CPU. One call, from the
# repository root, with .gpu/ carried (gpucheck.gz, snug.gz, synth.gz,
# tok.gguf; see layers.sh):
#
# - gpucheck over pages in each format of $KVS (keys/values), every page
#   with a twin, on the SmolLM2 shape, a gemma3 file (a sliding window:
#   attention that starts inside a page) and a qwen2 file: logits against
#   the CPU's at every step, and every invariance;
# - `snug run` greedy on both devices, speculation on and off, and
#   `snug eval ppl`, with `--kv` of each format (the engine's own exact
#   window of twins);
# - a session saved on the CPU, resumed on the GPU, against the same
#   session resumed on the CPU.
#
# A summary on stdout and in $OUT/kvformats.txt.
set -u
. bench/gpu/setup.sh
root=$(pwd)
gpu_setup /tmp/kvformats synth gpucheck snug
export SNUG_HOME=/tmp/kvformats/home
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2>/dev/null
./synth --like tok.gguf --arch gemma3 --shape "g3=512,4,8,2,1536" --window 40 --type q8_0 --head-type q8_0 --scale 0.02 --out gemma3.gguf 2>/dev/null
./synth --like tok.gguf --arch qwen2 --shape "q2=512,4,8,2,1536" --type q5_0 --head-type q8_0 --scale 0.02 --out qwen2.gguf 2>/dev/null
same() {
  if cmp -s "$1" "$2"; then echo "$3: the same"; else echo "$3: DIFFERENT"; diff "$1" "$2" | head -5; fi
}
# `--kv` flags of a keys/values spec.
flags() {
  k=${1%/*}
  v=${1#*/}
  echo "--kv-k $k --kv-v $v"
}
{
  for kv in ${KVS:-q8 tq4 f16/q8 q8/tq4 tq4/f16 f16}; do
    for m in ${FILES:-smol gemma3 qwen2}; do
      ./gpucheck $m.gguf --kv $kv --prompt 90 --gen 40 --pp 96 --tg 8 --out $m.json > $m.log 2>&1
      python3 -c "
import json; d=json.load(open('$m.json'))
print('$kv $m', {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'overlap'))})" || tail -3 $m.log
    done
    f=$(flags $kv)
    prompt="The river flows through the old town, past the mill and the bridge, and on to the sea. The river flows through the old town, past the mill"
    for d in cpu cuda; do
      for s in on off; do
        ./snug run smol.gguf -p "$prompt" -n 64 --temperature 0 $f --speculate $s --device $d 2>/dev/null > run-$d-$s.txt
      done
      ./snug eval ppl smol.gguf "$root/README.md" $f --device $d --ctx 160 --max-windows 6 --json 2>&1 |
        python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); d.pop('seconds', None); print(json.dumps(d))" > ppl-$d.json
    done
    same run-cpu-on.txt run-cuda-on.txt "$kv run, speculation on, cpu vs cuda"
    same run-cuda-on.txt run-cuda-off.txt "$kv run on cuda, speculation on vs off"
    same ppl-cpu.json ppl-cuda.json "$kv eval ppl, cpu vs cuda"
    cat ppl-cuda.json
    # Saved on the CPU; resumed on each device.
    rm -f s.snug
    ./snug run smol.gguf -p "$prompt" -n 40 --temperature 0 $f --save-session s.snug --device cpu > /dev/null 2>&1
    for d in cpu cuda; do
      cp s.snug s-$d.snug
      ./snug run smol.gguf -p " and then" --session s-$d.snug -n 40 --temperature 0 --device $d 2>/dev/null > resume-$d.txt
    done
    same resume-cpu.txt resume-cuda.txt "$kv session saved on cpu, resumed on cpu vs cuda"
  done
} 2>&1 | tee $OUT/kvformats.txt
