#!/bin/sh
# One call of a GPU machine for a change to the prefill's kernels, with
# llama.cpp beside it (its CUDA build in the background meanwhile):
# - bits (gpucheck: logits against the CPU at every step, every
#   invariance) of the built-in kernels on the synthesized SmolLM2, 1.5B
#   and 7B files (and those named in CHECK_MORE: `g3`, say), and of each
#   variant in CHECK_V (kernels.cu macros, `,` between them) on the
#   SmolLM2 and 1.5B files and those of CHECK_MORE (CHECK_BASE=0 leaves
#   the built-in kernels' checks out);
# - prefill of 512 (gpucheck --profile-prefill 7) on the 1.5B and 7B
#   files: the built-in kernels (-) and each variant in TIME_V, ROUNDS
#   rounds (1 unless set);
# - `snug bench` pp512 and tg128 on the three files, 64 SmolLM2 sequences
#   decoding together, then llama.cpp's llama-bench and
#   llama-batched-bench on the same files once built (until WAIT seconds
#   from the start, 330 unless set; LLAMA=0 leaves llama.cpp out);
# - the thread pool on the host CPU (no GPU): `poolbench` and SmolLM2's
#   decode at 16 threads, with .gpu/snug-b.gz and poolbench-b.gz (builds
#   before a pool change) alternating with the current ones, where carried;
#   with HOST=1, bench/gpu/threads.sh instead (HOST_MODELS, default smol;
#   HOST_PROFILE, default "2 16"). BENCH=0 leaves out the `snug bench`es.
# .gpu/ holds gpucheck.gz, snug.gz, synth.gz, tok.gguf, llama-src.tgz.
# Run from the repository root; a summary on stdout and $OUT/round.txt.
set -u
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }
ROOT=$PWD
. bench/gpu/setup.sh
gpu_setup /tmp/round gpucheck snug synth snug-b poolbench poolbench-b
export SNUG_HOME=/tmp/snug-home
[ "${LLAMA:-1}" = 0 ] || setsid sh -c "sh $ROOT/bench/gpu/llama.sh build /tmp/round/llama-src.tgz /tmp/round/ll > ll.out 2>&1; touch llbuilt" \
  > /dev/null 2>&1 &
CHECK_V=${CHECK_V:-MMT_RAW=2,MMT_S=2,MMT_WO=2,ATT_PVJ=1}
TIME_V=${TIME_V:-MMT_RAW=0 MMT_RAW=2,MMT_S=2,MMT_WO=2 ATT_PVJ=1 MMT_RAW=2,MMT_S=2,MMT_WO=2,ATT_PVJ=1}
defs() { [ "$1" = - ] || echo "$1" | tr ',' '\n' | sed 's/^/--define /' | tr '\n' ' '; }
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  gpu_synth smol 1.5b 7b ${CHECK_MORE:-} 2> synth.err
  echo "synthesized $(el)"
  check() {
    ./gpucheck $2.gguf --prompt 45 --gen 6 --pp 512 --tg 8 $(defs $1) --out c.json > /dev/null 2> c.err || tail -3 c.err
    cp c.json "$OUT/check-$2-$(echo $1 | tr ',=' '__').json" 2> /dev/null
    python3 -c '
import json, sys; d = json.load(open("c.json"))
ok = all(v for k, v in d.items() if k.startswith(("batch_inv", "graphs_same", "tiles_same")))
print(sys.argv[2], "[" + sys.argv[1] + "] bits:", d["logits_bitwise_equal_to_cpu_steps"], "of", d["generated"] + 1,
      "steps the CPU\x27s; invariant", ok)' "$1" $2
  }
  [ "${CHECK_BASE:-1}" = 0 ] || for m in smol 1.5b 7b ${CHECK_MORE:-}; do check - $m; done
  for v in $CHECK_V; do for m in smol 1.5b ${CHECK_MORE:-}; do check $v $m; done; done
  echo "checked $(el)"
  for r in $(seq 1 ${ROUNDS:-1}); do
    for m in 7b 1.5b; do
      for v in - $TIME_V; do
        echo "prefill $m [$v]: $(./gpucheck $m.gguf --prompt 512 --profile-prefill 7 $(defs $v) 2> /dev/null | tail -1)"
      done
    done
  done
  echo "prefills $(el)"
  [ "${BENCH:-1}" = 0 ] || for m in smol 1.5b 7b; do
    ./snug bench $m.gguf -p 512 -n 128 -r 3 --device cuda -o json > $OUT/bench-$m.json 2> bench.err
    python3 -c 'import json, sys; print("snug", sys.argv[2], [(d["test"], round(d["tok_s_median"], 1)) for d in json.load(open(sys.argv[1]))])' \
      $OUT/bench-$m.json $m || tail -2 bench.err
  done
  if [ "${BENCH:-1}" != 0 ]; then
    ./snug bench smol.gguf -p 128 -n 128 --parallel 1,64 -r 3 --device cuda -o json > $OUT/batched-smol.json 2> bench.err
    python3 -c 'import json, sys; print("snug batched", [(d["test"], round(d["tok_s_median"], 1)) for d in json.load(open(sys.argv[1]))])' \
      $OUT/batched-smol.json || tail -2 bench.err
  fi
  echo "snug benches $(el)"
  [ "${LLAMA:-1}" = 0 ] || while [ ! -f llbuilt ] && [ $(el) -lt ${WAIT:-330} ]; do sleep 2; done
  if [ -x ll/build/bin/llama-bench ]; then
    for m in smol 1.5b 7b; do
      ll/build/bin/llama-bench -m $m.gguf -p 512 -n 128 -r 3 -fa 0,1 -ngl 99 -o jsonl >> $OUT/llama-bench.jsonl 2> /dev/null
    done
    python3 -c '
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l); print("llama.cpp", d["model_filename"], "fa", d["flash_attn"], d["n_prompt"], d["n_gen"], round(d["avg_ts"], 1))' \
      $OUT/llama-bench.jsonl
    timeout 90 ll/build/bin/llama-batched-bench -m smol.gguf -c 20000 -b 2048 -ub 512 -ngl 99 -fa on -npp 128 -ntg 128 \
      -npl 1,64 > $OUT/llama-batched.txt 2>&1
    grep -E '^\|' $OUT/llama-batched.txt
  else
    echo "llama.cpp not built by $(el) s"; tail -3 ll.out
  fi
  echo "llama.cpp $(el)"
  if [ "${HOST:-0}" = 1 ]; then
    # The host CPU instead: bench/gpu/threads.sh (snug, snug-b and
    # llama.cpp's CPU build at 1 to 16 threads, profiles).
    (cd "$ROOT" && MODELS="${HOST_MODELS:-smol}" PROFILE="${HOST_PROFILE:-2 16}" sh bench/gpu/threads.sh > /dev/null 2>&1)
    grep -E '^(snug|llama|profile|pp|tg|\|)' "$OUT/threads.txt"
  elif [ -x snug-b ] && [ -x poolbench-b ]; then
    for r in 1 2 3; do
      for b in "" -b; do
        echo "poolbench$b: $(./poolbench$b 16 128 20 | cut -d: -f2) / $(./poolbench$b 16 16 2000 | cut -d: -f2)"
        ./snug$b bench smol.gguf -p 0 -n 64 -r 2 -t 16 -o json > tg$b.json 2> /dev/null
        python3 -c 'import json, sys; print("snug" + sys.argv[2], "t16", [(d["test"], round(d["tok_s_median"], 1)) for d in json.load(open(sys.argv[1]))])' \
          tg$b.json "$b"
      done
    done
  fi
  echo "end $(el)"
} 2>&1 | tee $OUT/round.txt
