#!/bin/sh
# snug's CUDA backend beside llama.cpp's CUDA build on the same synthesized
# files, on a GPU machine that cannot reach a registry, in two calls made
# back to back (a call may run 600 s; the machine keeps /tmp while warm):
#
#   sh bench/gpu/compare.sh build    # llama.cpp's build in the background;
#                                    # meanwhile the bitwise checks and
#                                    # Nsight Compute's decode profile
#   sh bench/gpu/compare.sh bench    # the timed benches (nothing else
#                                    # running), then run, sessions, server
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
  ./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf 2> $R/synth.err
  ./synth --like tok.gguf --shape 1.5b --out 1.5b.gguf 2>> $R/synth.err
  ./synth --like tok.gguf --shape 7b --out 7b.gguf 2>> $R/synth.err
  ./gpucheck smol.gguf --out $R/check-smol.json > /dev/null 2> $R/check-smol.err
  ./gpucheck 7b.gguf --prompt 32 --gen 8 --out $R/check-7b.json > /dev/null 2> $R/check-7b.err
  ./gpucheck 1.5b.gguf --prompt 32 --gen 8 --out $R/check-1.5b.json > /dev/null 2> $R/check-1.5b.err
  echo "checks $(el)"
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  "$ncu" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv ./gpucheck 7b.gguf \
    --prompt 64 --profile-decode 3 --no-graphs > $R/ncu-7b.csv 2> $R/ncu-7b.err
  python3 $ROOT/bench/gpu/ncusum.py $R/ncu-7b.csv > $R/ncu-7b.txt; rm -f $R/ncu-7b.csv
  for n in 64 512; do
    for b in gpucheck-old gpucheck; do
      [ -x $b ] || continue
      for m in smol 1.5b 7b; do echo "$b $m depth $n: $(./$b $m.gguf --prompt $n --profile-decode 20 2>/dev/null | tail -1)"; done
    done
  done | tee $R/decode-steps.txt
  echo "ncu $(el)"
  for f in $R/check-*.json; do python3 -c "
import json; d=json.load(open('$f')); print('$f'.split('/')[-1], {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'tiles_same'))})"; done
  while [ ! -f $K/llbuilt ] && [ $(el) -lt 560 ]; do sleep 2; done
  echo "llama.cpp built? $(el)"; tail -3 $R/llbuild.out
  ;;
bench)
  cd $K
  [ -d $K/ll ] || echo "llama.cpp is not built: run the build call first, on the same machine"
  for m in smol 1.5b 7b; do
    ./snug bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-$m.json 2> $R/bench-$m.err
    [ -x snug-old ] && ./snug-old bench $K/$m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $R/bench-old-$m.json 2> $R/bench-old-$m.err
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
*) echo "usage: sh bench/gpu/compare.sh build|bench"; exit 2 ;;
esac
