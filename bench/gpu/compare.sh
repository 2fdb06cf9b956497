#!/bin/sh
# One GPU call: snug's CUDA backend beside llama.cpp's CUDA build on the
# same synthesized files, on a machine that cannot reach a registry.
#
# .gpu/ (carried) holds: gpucheck.gz (`cargo build --release -p snug-cuda
# --example gpucheck`, stripped), snug.gz (the release binary), synth.gz
# (`--example synth_gguf` of snug-model), tok.gguf, tok-gemma.gguf and
# tok-qwen.gguf (`synth_gguf --like MODEL --tokenizer-only` of SmolLM2,
# Gemma 3 and Qwen2.5), llama-src.tgz (see llama.sh) and ncusum.py (in
# this folder). Run from the repository root; results go to $OUT/r.
# Each step checks the time left (one call may run 600 s): llama.cpp
# builds in the background while the checks run, and the timed benches
# start once it is done, so that no benchmark shares the host's cores
# with the compiler.
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
K=/tmp/keep; mkdir -p $K; cp -r .gpu/. $K/
R=$OUT/r; mkdir -p $R
ROOT=$PWD
cp $ROOT/bench/gpu/ncusum.py $K/ 2>/dev/null
cd $K
for f in gpucheck synth snug; do gunzip -c $f.gz > $f; chmod +x $f; done
nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SNUG_HOME=/tmp/snug-home
( sh $ROOT/bench/gpu/llama.sh build $K/llama-src.tgz $K/ll > $R/llbuild.out 2>&1; echo done > $K/llbuilt ) &
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out $K/smol.gguf 2> $R/synth.err
./gpucheck $K/smol.gguf --out $R/check-smol.json > /dev/null 2> $R/check-smol.err
echo "smol check $(el)"
./synth --like tok.gguf --shape 1.5b --out $K/1.5b.gguf 2>> $R/synth.err
./synth --like tok.gguf --shape 7b --out $K/7b.gguf 2>> $R/synth.err
./gpucheck $K/7b.gguf --prompt 32 --gen 8 --out $R/check-7b.json > /dev/null 2> $R/check-7b.err
echo "7b check $(el)"
./synth --like tok-gemma.gguf --arch gemma3 --shape "g=1024,6,4,1,2048,256" --window 32 --type q4_k --out $K/gemma.gguf 2>> $R/synth.err
./synth --like tok-qwen.gguf --arch qwen2 --shape "q=1536,4,12,2,8960" --type q5_0 --head-type q8_0 --out $K/qwen.gguf 2>> $R/synth.err
for m in gemma qwen; do ./gpucheck $K/$m.gguf --prompt 48 --gen 16 --out $R/check-$m.json > /dev/null 2> $R/check-$m.err; done
echo "gemma qwen checks $(el)"
p="Write a short story about a lighthouse keeper who finds a message in a bottle."
o="--temperature 0 --speculate off --json"
./snug run $K/smol.gguf -p "$p" -n 96 $o > $R/sess-full-cpu.json 2> $R/sess.err
./snug run $K/smol.gguf -p "$p" -n 96 $o --device cuda --stats > $R/sess-full-gpu.json 2>> $R/sess.err
./snug run $K/smol.gguf -p "$p" -n 48 $o --save-session /tmp/c.snug > $R/sess-cpu-first.json 2>> $R/sess.err
./snug run $K/smol.gguf --session /tmp/c.snug -n 48 $o --device cuda > $R/sess-gpu-rest.json 2>> $R/sess.err
./snug run $K/smol.gguf -p "$p" -n 48 $o --device cuda --save-session /tmp/g.snug > $R/sess-gpu-first.json 2>> $R/sess.err
./snug run $K/smol.gguf --session /tmp/g.snug -n 48 $o > $R/sess-cpu-rest.json 2>> $R/sess.err
echo "sessions $(el)"
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv ./gpucheck $K/smol.gguf --prompt 64 --profile-decode 3 --no-graphs > $R/ncu-smol.csv 2>$R/ncu-smol.err
python3 $K/ncusum.py $R/ncu-smol.csv > $R/ncu-smol.txt
"$ncu" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv ./gpucheck $K/7b.gguf --prompt 64 --profile-decode 3 --no-graphs > $R/ncu-7b.csv 2>$R/ncu-7b.err
python3 $K/ncusum.py $R/ncu-7b.csv > $R/ncu-7b.txt
echo "ncu $(el)"
i=0; while [ ! -f $K/llbuilt ] && [ $(el) -lt 470 ]; do sleep 2; done
echo "llama built? $(el)"; tail -3 $R/llbuild.out
for m in smol 1.5b 7b; do
  ./snug bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-$m.json 2> $R/bench-$m.err
done
echo "benches $(el)"
if [ -x $K/ll/build/bin/llama-bench ]; then
  for m in smol 1.5b 7b; do
    [ $(el) -lt 540 ] && sh $ROOT/bench/gpu/llama.sh bench $K/ll $R $K/$m.gguf
  done
fi
for m in smol 7b; do
  [ $(el) -lt 560 ] && ./snug bench $K/$m.gguf -p 128 -n 128 --parallel 1,64 -r 2 --device cuda -o json > $R/batched-$m.json 2> $R/batched-$m.err
  [ $(el) -lt 570 ] && [ -x $K/ll/build/bin/llama-batched-bench ] && $K/ll/build/bin/llama-batched-bench -m $K/$m.gguf -c 20000 -b 2048 -ub 512 -ngl 99 -fa on -npp 128 -ntg 128 -npl 1,64 > $R/llama-batched-$m.txt 2>&1
done
echo "end $(el)"
