#!/usr/bin/env bash
# Speed of each tensor type: a synthesized file of one shape per type
# (random weights, `synth_gguf`; speed does not depend on the values),
# `snug bench` beside `llama-bench` (llama.cpp at its defaults, best of
# -fa 0 and 1; without weight repacking where its repacking crashes) on
# the same file and threads: pp512 and tg64.
#
# Usage: bench/types.sh LLAMA_BIN_DIR [OUT] [TYPES...]
#   SHAPE (default 1.5b: Qwen2.5-1.5B's), ARCH (llama), EXPERTS
#   (COUNT,USED,FF: a mixture of experts), THREADS (2), REPS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1
out=${2:-bench/out-types}
shift $(( $# >= 2 ? 2 : 1 ))
types=${*:-q4_k q2_k q3_k q5_k iq4_nl iq4_xs mxfp4 bf16}
shape=${SHAPE:-1.5b}
threads=${THREADS:-2}
reps=${REPS:-2}
mkdir -p "$out"
cargo build --release -p snug >&2
cargo build --release -p snug-model --example synth_gguf >&2
like=$(target/release/snug pull smollm2-135m | tail -n 1)
for ty in $types; do
  f="$out/synth-${shape%%=*}-$ty.gguf"
  target/release/examples/synth_gguf --like "$like" --shape "$shape" --arch "${ARCH:-llama}" \
    ${EXPERTS:+--experts "$EXPERTS"} --type "$ty" --head-type q6_k --out "$f" 2>/dev/null
  # llama.cpp's AMX repacking crashes on some of these files on AMX
  # machines: then without repacking (said in the output).
  if ! "$bin/llama-bench" -m "$f" -t "$threads" -p 512 -n 64 -fa 0,1 -r "$reps" -o md > "$out/llama-$ty.md" 2>/dev/null; then
    echo "(llama.cpp with --repack 0)" > "$out/llama-$ty.md"
    "$bin/llama-bench" -m "$f" -t "$threads" -p 512 -n 64 -fa 0,1 -r "$reps" --repack 0 -o md >> "$out/llama-$ty.md" 2>/dev/null
  fi
  target/release/snug bench "$f" -t "$threads" -p 512 -n 64 -r "$reps" > "$out/snug-$ty.md"
  cat "$out/llama-$ty.md" "$out/snug-$ty.md"
  rm -f "$f"
done
