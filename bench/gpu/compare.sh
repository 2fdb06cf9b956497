#!/bin/sh
# snug's CUDA backend beside llama.cpp's CUDA build on the same synthesized
# files, on a GPU machine that cannot reach a registry, in two calls made
# back to back (a call may run 600 s; the machine keeps /tmp while warm):
#
#   sh bench/gpu/compare.sh build    # llama.cpp's build in the background;
#                                    # meanwhile steps.sh: the bitwise
#                                    # checks, decode-step variants and
#                                    # where a step's time goes
#   sh bench/gpu/compare.sh bench    # the timed benches (nothing else
#                                    # running), then run, sessions, server;
#                                    # with SNUG_CUDA_DEFINES set, the
#                                    # built-in kernels' benches beside
#   sh bench/gpu/compare.sh all      # one call: the build beside steps.sh,
#                                    # then the benches (no run, session or
#                                    # server checks)
#
# .gpu/ (carried by the first call) holds: gpucheck.gz (`cargo build
# --release -p snug-cuda --example gpucheck`, stripped), snug.gz (the release
# binary), synth.gz (`--example synth_gguf` of snug-model), tok.gguf
# (`synth_gguf --like MODEL --tokenizer-only` of SmolLM2) and llama-src.tgz
# (see llama.sh); optionally gpucheck-old.gz and snug-old.gz, the build
# before a change, timed beside it. Run from the repository root; the
# results end in $OUT/res.tgz (folder r/) after the second call.
set -u
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
K=/tmp/keep
ROOT=$PWD
. bench/gpu/setup.sh
nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SNUG_HOME=/tmp/snug-home
R=$K/r
case ${1:-} in
build)
  mkdir -p $K $R; cp -r .gpu/. $K/; cd $K
  for f in gpucheck synth snug gpucheck-old snug-old; do
    [ -f $f.gz ] && { gunzip -c $f.gz > $f; chmod +x $f; }
  done
  # In a session of its own, so that it goes on after this call if it must.
  setsid sh -c "sh $ROOT/bench/gpu/llama.sh build $K/llama-src.tgz $K/ll > $R/llbuild.out 2>&1; echo done > $K/llbuilt" &
  gpu_synth smol 1.5b 7b 2> $R/synth.err
  # Bits, decode-step variants and where a step's time goes (steps.sh;
  # VARIANTS as there, SKIP_MODELS for the breakdown).
  (cd $ROOT && OUT=$R MODEL_DIR=$K LIMIT=${LIMIT:-420} sh bench/gpu/steps.sh > /dev/null 2>&1)
  cat $R/steps.txt
  while [ ! -f $K/llbuilt ] && [ $(el) -lt 560 ]; do sleep 2; done
  echo "llama.cpp built? $(el)"; tail -3 $R/llbuild.out
  ;;
bench)
  cd $K
  [ -d $K/ll ] || echo "llama.cpp is not built: run the build call first, on the same machine"
  for m in smol 1.5b 7b; do
    ./snug bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-$m.json 2> $R/bench-$m.err
    [ -x snug-old ] && ./snug-old bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-old-$m.json 2> $R/bench-old-$m.err
    # A variant set by SNUG_CUDA_DEFINES is timed beside the built-in kernels.
    [ -n "${SNUG_CUDA_DEFINES:-}" ] && env -u SNUG_CUDA_DEFINES ./snug bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json \
      > $R/bench-builtin-$m.json 2> $R/bench-builtin-$m.err
  done
  while [ ! -f $K/llbuilt ] && [ $(el) -lt 300 ]; do sleep 2; done
  for m in smol 1.5b 7b; do sh $ROOT/bench/gpu/llama.sh bench $K/ll $R $K/$m.gguf; done
  echo "benches $(el)"
  ./snug bench $K/smol.gguf -p 128 -n 128 --parallel 1,64 -r 2 --device cuda -o json > $R/batched-smol.json 2> $R/batched-smol.err
  $K/ll/build/bin/llama-batched-bench -m $K/smol.gguf -c 20000 -b 2048 -ub 512 -ngl 99 -fa on -npp 128 -ntg 128 \
    -npl 1,64 > $R/llama-batched-smol.txt 2>&1
  echo "batched $(el)"
  p="Write a short story about a lighthouse keeper who finds a message in a bottle."
  o="--temperature 0 --speculate off --json"
  ./snug run smol.gguf -p "$p" -n 96 $o > $R/sess-full-cpu.json 2> $R/sess.err
  ./snug run smol.gguf -p "$p" -n 96 $o --device cuda --stats > $R/sess-full-gpu.json 2>> $R/sess.err
  ./snug run smol.gguf -p "$p" -n 96 --temperature 0 --speculate on --json --device cuda > $R/run-gpu-spec.json 2>> $R/sess.err
  ./snug run smol.gguf -p "$p" -n 48 $o --save-session /tmp/c.snug > $R/sess-cpu-first.json 2>> $R/sess.err
  ./snug run smol.gguf --session /tmp/c.snug -n 48 $o --device cuda > $R/sess-gpu-rest.json 2>> $R/sess.err
  ./snug run smol.gguf -p "$p" -n 48 $o --device cuda --save-session /tmp/g.snug > $R/sess-gpu-first.json 2>> $R/sess.err
  ./snug run smol.gguf --session /tmp/g.snug -n 48 $o > $R/sess-cpu-rest.json 2>> $R/sess.err
  ./snug serve smol.gguf --device cuda --port 8091 > $R/serve-gpu.log 2>&1 & g=$!
  ./snug serve smol.gguf --port 8092 > $R/serve-cpu.log 2>&1 & c=$!
  for i in $(seq 1 60); do curl -s localhost:8091/health > /dev/null && curl -s localhost:8092/health > /dev/null && break; sleep 1; done
  python3 $ROOT/bench/gpu/serve_check.py 8091 8092 > $R/serve.json 2> $R/serve.err
  curl -s localhost:8091/metrics | grep -E "device" > $R/metrics.txt
  kill $g $c
  echo "end $(el)"
  sh $ROOT/bench/gpu/summary.sh $R
  tar czf $OUT/res.tgz -C $K r
  ;;
all)
  # Everything that fits one call: llama.cpp's build in the background
  # while steps.sh runs (STEPS_LIMIT seconds), snug's benches, then
  # llama.cpp's once built (if by BUILD_WAIT seconds), and the batched
  # pair if time is left; no run, session or server checks.
  # Results straight into $OUT/r, so that a call cut short keeps them.
  R=$OUT/r
  mkdir -p $K $R; cp -r .gpu/. $K/; cd $K
  for f in gpucheck synth snug gpucheck-old snug-old; do
    [ -f $f.gz ] && { gunzip -c $f.gz > $f; chmod +x $f; }
  done
  snug_benches() {
    for m in smol 1.5b 7b; do
      ./snug bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-$m.json 2> $R/bench-$m.err
      python3 -c "import json; print('$m', [(d['test'], round(d['tok_s_median'], 1)) for d in json.load(open('$R/bench-$m.json'))])"
    done
    echo "snug benches $(el)"
  }
  # (LLAMA=0: no llama.cpp in this call, and snug's benches first.)
  [ "${LLAMA:-1}" = 0 ] ||
    setsid sh -c "sh $ROOT/bench/gpu/llama.sh build $K/llama-src.tgz $K/ll > $R/llbuild.out 2>&1; echo done > $K/llbuilt" &
  gpu_synth smol 1.5b 7b 2> $R/synth.err
  [ "${LLAMA:-1}" = 0 ] && snug_benches
  (cd $ROOT && OUT=$R MODEL_DIR=$K LIMIT=${STEPS_LIMIT:-300} sh bench/gpu/steps.sh > /dev/null 2>&1)
  cat $R/steps.txt
  echo "steps $(el)"
  [ "${LLAMA:-1}" = 0 ] || snug_benches
  [ "${LLAMA:-1}" = 0 ] || while [ ! -f $K/llbuilt ] && [ $(el) -lt ${BUILD_WAIT:-470} ]; do sleep 2; done
  [ "${LLAMA:-1}" = 0 ] || { echo "llama.cpp built? $(el)"; tail -2 $R/llbuild.out; }
  if [ -f $K/llbuilt ]; then
    for m in smol 1.5b 7b; do sh $ROOT/bench/gpu/llama.sh bench $K/ll $R $K/$m.gguf; done
    echo "llama.cpp benches $(el)"
  fi
  if [ $(el) -lt 500 ]; then
    ./snug bench $K/smol.gguf -p 128 -n 128 --parallel 1,64 -r 2 --device cuda -o json > $R/batched-smol.json 2> $R/batched-smol.err
    [ -f $K/llbuilt ] && timeout 60 $K/ll/build/bin/llama-batched-bench -m $K/smol.gguf -c 20000 -b 2048 -ub 512 -ngl 99 -fa on \
      -npp 128 -ntg 128 -npl 1,64 > $R/llama-batched-smol.txt 2>&1
  fi
  echo "end $(el)"
  sh $ROOT/bench/gpu/summary.sh $R
  ;;
*) echo "usage: sh bench/gpu/compare.sh build|bench|all"; exit 2 ;;
esac
