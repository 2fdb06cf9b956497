#!/bin/sh
# The GPU run of SmolLM2 on a GPU machine (see check.sh for how the files
# get there): gpucheck, `snug run` and `snug bench` on the GPU and on the
# host's CPU cores, and a session saved on the CPU resumed on the GPU.
# Writes JSON and text into OUT.
set -u
out=${1:-.}
model=.gpu/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x .gpu/gpucheck ] || { gunzip -c .gpu/gpucheck.gz > .gpu/gpucheck; chmod +x .gpu/gpucheck; }
[ -x .gpu/snug ] || { gunzip -c .gpu2/snug.gz > .gpu/snug; chmod +x .gpu/snug; }
[ -f "$model" ] || cat .gpu*/smol.part* > "$model"
nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
[ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SNUG_HOME=/tmp/snug-home
cores=$(nproc)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/device.txt"
echo "nvrtc: $nvrtc; cores: $cores" >> "$out/device.txt"
.gpu/gpucheck "$model" --out "$out/gpucheck.json" > /dev/null 2> "$out/gpucheck.err"
p="Write a short story about a lighthouse keeper who finds a message in a bottle."
for d in cuda cpu; do
  .gpu/snug run "$model" --chat -p "$p" -n 96 --temperature 0 --speculate off --device $d --json \
    > "$out/run-$d.json" 2> "$out/run-$d.err"
  .gpu/snug run "$model" --chat -p "$p" -n 96 --temperature 0 --speculate on --device $d --json \
    > "$out/run-spec-$d.json" 2>> "$out/run-$d.err"
done
# A session saved on the CPU after 48 tokens, resumed on the GPU for 48.
rm -f /tmp/s.snug
.gpu/snug run "$model" --chat -p "$p" -n 48 --temperature 0 --speculate off --save-session /tmp/s.snug --json \
  > "$out/session-cpu-first.json" 2> "$out/session.err"
.gpu/snug run "$model" --session /tmp/s.snug -n 48 --temperature 0 --speculate off --device cuda --json \
  > "$out/session-gpu-rest.json" 2>> "$out/session.err"
.gpu/snug bench "$model" -p 512 -n 128 -r 3 --device cuda -o json > "$out/bench-cuda.json" 2> "$out/bench.err"
.gpu/snug bench "$model" -p 512 -n 128 -r 3 -t "$cores" -o json > "$out/bench-cpu.json" 2>> "$out/bench.err"
ls -la "$out"
