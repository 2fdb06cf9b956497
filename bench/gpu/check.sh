#!/bin/sh
# Runs `gpucheck` (crates/snug-cuda/examples/gpucheck.rs) on a GPU machine
# that cannot reach a registry: the stripped, gzipped binary and a model
# split into parts are carried there, joined, and run.
#
# Here (the CPU machine):
#   cargo build --release -p snug-cuda --examples
#   strip -o /tmp/gpucheck target/release/examples/gpucheck
#   mkdir -p .gpu .gpu2; gzip -c /tmp/gpucheck > .gpu/gpucheck.gz
#   split -b 48M -d ~/.cache/snug/models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol.part
#   mv /tmp/smol.part00 .gpu/; mv /tmp/smol.part01 .gpu2/
# There, in calls made back to back (the first carrying .gpu, the second
# .gpu2; ignored paths stay while the machine is warm):
#   sh bench/gpu/check.sh smol SmolLM2-135M-Instruct.Q4_1.gguf "$OUT"
set -eu
prefix=$1
model=$2
out=${3:-.}
[ -x .gpu/gpucheck ] || { gunzip -c .gpu/gpucheck.gz > .gpu/gpucheck; chmod +x .gpu/gpucheck; }
[ -f ".gpu/$model" ] || cat .gpu*/"$prefix".part* > ".gpu/$model"
# NVRTC: the toolkit's, or the one in a Python package.
nvrtc=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib / -name 'libnvrtc.so*' 2>/dev/null | head -1 || true)
[ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
shift 3 || true
.gpu/gpucheck ".gpu/$model" --out "$out/gpucheck-$prefix.json" "$@"
