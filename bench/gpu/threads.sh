#!/bin/sh
# snug beside llama.cpp on the GPU machine's host CPU, 1 to 16 threads: no
# GPU used. Builds llama.cpp's CPU programs there (GGML_NATIVE, from
# .gpu*/llama-src.tgz, as bench/gpu/llama.sh), then for SmolLM2 (the real
# file, joined from .gpu*/smol.part* where present, else its synthesized
# shape) and the synthesized Qwen2.5 0.5B shape (`qwen2`, Q5_0, Q8_0
# head; with MODELS naming them, `g3`, Gemma 3 270M's shape in Q5_0 with
# a Q8_0 head, and `1.5b`, Qwen2.5 1.5B's in Q4_K; all with the --like
# file's vocabulary): `snug bench -p 512 -n 128 -r 2 -t T` and `llama-bench -p 512
# -n 128 -fa 0,1 -r 2 -t T` for T in THREADS (default 1 2 4 8 16), the
# two programs alternating per thread count. The CPU's description first.
# Run from the repository root with .gpu/ carried (snug.gz, synth.gz,
# tok.gguf; snug-b.gz, another build of snug, is timed beside snug where
# present); PROFILE="2 16" adds `snug bench --profile` at those counts;
# results in $OUT/threads.txt and $OUT/*.json*.
set -u
root=$(pwd)
. bench/gpu/setup.sh
gpu_setup /tmp/thr synth snug snug-b
export SNUG_HOME=/tmp/snug-home
{
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3"
  grep -o -w -E "avx512_vnni|amx_int8|amx_tile|avx512f" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
} > "$OUT/threads.txt"
src=$(ls "$root"/.gpu*/llama-src.tgz 2> /dev/null | head -1)
mkdir -p /tmp/llcpu
[ -d /tmp/llcpu/llama.cpp ] || tar xzf "$src" -C /tmp/llcpu
cmake -S /tmp/llcpu/llama.cpp -B /tmp/llcpu/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > /tmp/llcpu/cmake.log 2>&1
cmake --build /tmp/llcpu/build --target llama-bench -j"$(nproc)" > /tmp/llcpu/build.log 2>&1 ||
  tail -20 /tmp/llcpu/build.log >> "$OUT/threads.txt"
bench=/tmp/llcpu/build/bin/llama-bench
if ls "$root"/.gpu*/smol.part* > /dev/null 2>&1; then
  cat "$root"/.gpu*/smol.part* > smol.gguf
else
  ./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2> /dev/null
fi
./synth --like tok.gguf --arch qwen2 --shape "0.5b=896,24,14,2,4864,64" --type q5_0 --head-type q8_0 \
  --out 0.5b.gguf 2> /dev/null
case " ${MODELS:-} " in
  *" g3 "*) ./synth --like tok.gguf --arch gemma3 --shape "g3=640,18,4,1,2048,256" --window 512 \
    --type q5_0 --head-type q8_0 --out g3.gguf 2> /dev/null ;;
esac
case " ${MODELS:-} " in
  *" 1.5b "*) ./synth --like tok.gguf --arch qwen2 --shape 1.5b --out 1.5b.gguf 2> /dev/null ;;
esac
sha256sum smol.gguf >> "$OUT/threads.txt"
for m in ${MODELS:-smol 0.5b}; do
  for t in ${THREADS:-1 2 4 8 16}; do
    ./snug bench $m.gguf -p 512 -n 128 -r 2 -t "$t" -o json 2> /dev/null > "snug-$m-$t.json"
    python3 -c "
import json
print('snug $m t$t', ' '.join(f\"{d['test']} {d['tok_s_median']:.1f}\" for d in json.load(open('snug-$m-$t.json'))))"
    if [ -x snug-b ]; then
      ./snug-b bench $m.gguf -p 512 -n 128 -r 2 -t "$t" -o json 2> /dev/null > "snug-b-$m-$t.json"
      python3 -c "
import json
print('snug-b $m t$t', ' '.join(f\"{d['test']} {d['tok_s_median']:.1f}\" for d in json.load(open('snug-b-$m-$t.json'))))"
    fi
    "$bench" -m $m.gguf -p 512 -n 128 -fa 0,1 -r 2 -t "$t" -o jsonl 2> /dev/null > "llama-$m-$t.jsonl"
    python3 -c "
import json
best = {}
for line in open('llama-$m-$t.jsonl'):
    d = json.loads(line)
    k = f\"pp{d['n_prompt']}\" if d['n_gen'] == 0 else f\"tg{d['n_gen']}\"
    best[k] = max(best.get(k, 0.0), d['avg_ts'])
print('llama.cpp $m t$t', ' '.join(f'{k} {v:.1f}' for k, v in best.items()))"
  done
done 2>&1 | tee -a "$OUT/threads.txt"
# Where snug's time goes at the counts in PROFILE (none unless set):
# `snug bench --profile`, microseconds a token by operation.
for m in ${MODELS:-smol 0.5b}; do
  for t in ${PROFILE:-}; do
    echo "profile $m t$t"
    ./snug bench $m.gguf -p 512 -n 128 -r 2 -t "$t" --profile 2> /dev/null | grep -E '^(pp|tg)|^\| [a-z]'
  done
done 2>&1 | tee -a "$OUT/threads.txt"
cp snug-*.json llama-*.jsonl "$OUT/" 2> /dev/null
