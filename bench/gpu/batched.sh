#!/bin/sh
# Many sequences decoding together on the GPU, snug beside llama.cpp's
# `llama-batched-bench`, on the synthesized SmolLM2 shape.
#
#   sh bench/gpu/batched.sh start   # llama.cpp's CUDA build in the
#                                   # background (about 250 s on 16 cores)
#   sh bench/gpu/batched.sh run     # waits for the build (until WAIT
#                                   # seconds after start, 330 unless set),
#                                   # then both benches: 64 sequences of a
#                                   # 128-token prompt, 128 tokens each
#
# Between the two, the call may run anything else (tiles.sh, steps.sh).
# .gpu/ holds snug.gz, synth.gz, tok.gguf and llama-src.tgz. Run from the
# repository root; results in $OUT/batched/.
set -u
ROOT=$PWD
K=/tmp/batched
. bench/gpu/setup.sh
case ${1:-} in
start)
  gpu_setup $K snug synth
  date +%s > $K/t0
  setsid sh -c "sh $ROOT/bench/gpu/llama.sh build $K/llama-src.tgz $K/ll > $K/llbuild.out 2>&1; touch $K/llbuilt" \
    > /dev/null 2>&1 &
  gpu_synth smol 2> $K/synth.err
  ;;
run)
  cd $K || exit 1
  nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
  export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  R=$OUT/batched
  mkdir -p $R
  ./snug bench smol.gguf -p 128 -n 128 --parallel 1,64 -r 3 --device cuda -o json > $R/snug.json 2> $R/snug.err
  python3 -c 'import json, sys; print("snug", [(d["test"], round(d["tok_s_median"], 1)) for d in json.load(open(sys.argv[1]))])' \
    $R/snug.json || tail -3 $R/snug.err
  while [ ! -f llbuilt ] && [ $(( $(date +%s) - $(cat t0) )) -lt ${WAIT:-330} ]; do sleep 2; done
  if [ -x ll/build/bin/llama-batched-bench ]; then
    timeout 90 ll/build/bin/llama-batched-bench -m smol.gguf -c 20000 -b 2048 -ub 512 -ngl 99 -fa on \
      -npp 128 -ntg 128 -npl 1,64 > $R/llama.txt 2>&1
    grep -E '^\|' $R/llama.txt
  else
    echo "llama.cpp not built by then"; tail -3 llbuild.out
  fi
  ;;
*) echo "usage: sh bench/gpu/batched.sh start|run"; exit 2 ;;
esac
