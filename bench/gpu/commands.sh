#!/bin/sh
# `snug chat`, `snug decide` and `snug eval ppl` on the GPU against the
# CPU, on the synthesized SmolLM2 shape: each command runs once with
# `--device cuda` and once without, and their outputs (timings left out)
# must be the same. One call, from the repository root, with .gpu/ carried
# (snug.gz, synth.gz, tok.gguf; see layers.sh). A summary on stdout and in
# $OUT/commands.txt.
set -u
. bench/gpu/setup.sh
root=$(pwd)
gpu_setup /tmp/commands synth snug
export SNUG_HOME=/tmp/commands/home
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2>/dev/null
same() {
  if cmp -s "$1" "$2"; then echo "$3: the same on both devices"; else echo "$3: DIFFERENT"; diff "$1" "$2" | head -5; fi
}
{
  for d in cpu cuda; do
    printf 'Hello there\nTell me more about it\n/quit\n' | ./snug chat smol.gguf -n 24 --device $d 2>&1 |
      grep -v '^\[' > chat-$d.txt
    ./snug decide smol.gguf --device $d --json --state "The invoice was paid twice by mistake." \
      -q "kind:choice:What is this about?:billing,shipping,other" -q "urgent:noul:Is it urgent?" > decide-$d.json 2>&1
    ./snug eval ppl smol.gguf "$root/README.md" --device $d --ctx 128 --max-windows 8 --json 2>&1 |
      python3 -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); d.pop('seconds', None); print(json.dumps(d))" > ppl-$d.json
  done
  same chat-cpu.txt chat-cuda.txt "chat (two turns, greedy)"
  same decide-cpu.json decide-cuda.json "decide (a choice and a yes/no)"
  same ppl-cpu.json ppl-cuda.json "eval ppl (8 windows of 128)"
  cat ppl-cuda.json
  head -c 400 decide-cuda.json; echo
} 2>&1 | tee $OUT/commands.txt
