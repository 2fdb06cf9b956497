#!/bin/sh
# The CUDA backend against the CPU's on synthesized files of the layers
# and types added last: the SmolLM2 shape, smollm3 (layers without RoPE),
# phi3 (fused matrices split at load), llama with F16 and with BF16
# matrices, qwen2 (biases on queries, keys and values), gemma3 (GELU,
# post-norms, a sliding window), qwen3 (query and key norms, Q4_K), and a
# qwen3moe file (which the CUDA backend refuses), and Q2_K, Q3_K,
# IQ4_NL, IQ4_XS and MXFP4 files. One call,
# from the repository root, with .gpu/ carried: gpucheck.gz (`cargo build
# --release -p snug-cuda --example gpucheck`, stripped), synth.gz (the
# `synth_gguf` example of snug-model) and tok.gguf (`synth_gguf --like
# SmolLM2 --tokenizer-only`). Prints, per file, gpucheck's bitwise fields.
set -u
. bench/gpu/setup.sh
gpu_setup /tmp/layers synth gpucheck
./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2>/dev/null
./synth --like tok.gguf --arch smollm3 --shape "s=512,8,8,2,1536" --type q8_0 --head-type q8_0 --scale 0.02 --out s3.gguf 2>/dev/null
./synth --like tok.gguf --arch phi3 --shape "p=512,4,8,2,1536" --type q8_0 --head-type q8_0 --scale 0.02 --name "synthetic phi" --out phi.gguf 2>/dev/null
./synth --like tok.gguf --shape "f=512,4,8,2,1536" --type f16 --head-type q8_0 --scale 0.02 --out f16.gguf 2>/dev/null
./synth --like tok.gguf --shape "b=512,4,8,2,1536" --type bf16 --head-type q8_0 --scale 0.02 --out bf16.gguf 2>/dev/null
./synth --like tok.gguf --arch qwen2 --shape "q2=512,4,8,2,1536" --type q5_0 --head-type q8_0 --scale 0.02 --out qwen2.gguf 2>/dev/null
./synth --like tok.gguf --arch gemma3 --shape "g3=512,4,8,2,1536" --window 8 --type q8_0 --head-type q8_0 --scale 0.02 --out gemma3.gguf 2>/dev/null
./synth --like tok.gguf --arch qwen3 --shape "q3=512,4,8,2,1536,64" --type q4_k --head-type q6_k --scale 0.02 --out qwen3.gguf 2>/dev/null
./synth --like tok.gguf --arch qwen3moe --shape "m=512,4,8,2,1536" --type q8_0 --head-type q8_0 --scale 0.02 --out moe.gguf 2>/dev/null
# The types added later: K-quants with 16-element groups, 4-bit codes
# looked up in a table of levels, and MXFP4's E8M0 scales.
for t in q2_k q3_k iq4_nl iq4_xs mxfp4; do
  ./synth --like tok.gguf --shape "t=512,4,8,2,1536" --type $t --head-type q8_0 --scale 0.02 --out $t.gguf 2>/dev/null
done
for m in ${FILES:-smol s3 phi f16 bf16 qwen2 gemma3 qwen3 q2_k q3_k iq4_nl iq4_xs mxfp4}; do
  ./gpucheck $m.gguf --prompt 40 --gen 8 --pp 64 --tg 8 --out $m.json > $m.log 2>&1
  python3 -c "
import json; d=json.load(open('$m.json'))
print('$m', {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'tiles_same', 'overlap', 'dequantize_random'))})" || tail -3 $m.log
done
# Refused at upload: the error gpucheck stops on.
./gpucheck moe.gguf --prompt 8 --gen 2 2>&1 | grep -m1 -i "experts"
