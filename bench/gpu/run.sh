#!/bin/sh
# The GPU run of SmolLM2 on a GPU machine (see check.sh for how the files
# get there): gpucheck, `snug run` and `snug bench` on the GPU and on the
# host's CPU cores, and a session saved on the CPU resumed on the GPU.
# Writes results.tar.gz (JSON and logs) into DEST, and a summary to stdout.
set -u
dest=${1:-.}
out=/tmp/gpuout
rm -rf "$out"; mkdir -p "$out"
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
# The engine's GPU test (crates/snug-engine/tests/gpu.rs, built with
# `cargo test --release -p snug-engine --test gpu --no-run`, stripped).
if [ -f .gpu/gputest.gz ]; then
  gunzip -c .gpu/gputest.gz > .gpu/gputest; chmod +x .gpu/gputest
  SNUG_TEST_MODELS=.gpu .gpu/gputest --nocapture > "$out/gputest.txt" 2>&1
fi
# Synthesized 1.5B and 7B shapes (Q4_K, Q6_K head; SmolLM2's tokenizer).
[ -x .gpu/synth ] || { gunzip -c .gpu/synth.gz > .gpu/synth; chmod +x .gpu/synth; }
for s in 1.5b 7b; do
  .gpu/synth --like "$model" --shape $s --out /tmp/synth-$s.gguf 2>> "$out/synth.err"
  .gpu/gpucheck /tmp/synth-$s.gguf --prompt 32 --gen 8 --out "$out/gpucheck-$s.json" > /dev/null 2>> "$out/synth.err"
done
ls -la "$out"
for f in "$out"/*.err "$out"/*.txt; do echo "== $f"; tail -8 "$f"; done
python3 - "$out" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "unreadable", e); continue
    if isinstance(d, dict):
        d = {k: v for k, v in d.items() if k not in ("cpu_tokens", "gpu_tokens", "token_ids")}
        if "text" in d: d["text"] = d["text"][:160]
    print(os.path.basename(f), json.dumps(d)[:1500])
PY
tar czf "$dest/results.tar.gz" -C /tmp gpuout
