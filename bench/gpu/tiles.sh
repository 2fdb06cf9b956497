#!/bin/sh
# Variants of the staged tiles of the products on tensor cores
# (kernels.cu's MMT_* macros, set through `gpucheck --define`), in one call
# of a GPU machine: each variant's bits (logits against the CPU, staged
# tiles against a warp's tiles, every invariance check) on the
# synthesized 1.5B file and on small Q5_K and Q6_K files, then prefill
# times of the 1.5B and 7B shapes (a warp's tiles, then each variant's
# staged tiles), and Nsight Compute's per-kernel times of one 7B
# prefill. .gpu/ holds gpucheck.gz, synth.gz and tok.gguf. Run from the
# repository root (V="MMT_R=2,MMT_S=1 ..." picks the variants; "-" is the
# defaults; the Q5_K and Q6_K files are checked with the defaults only;
# ONLY=bench leaves out the profile, ONLY=ncu does only it, ONLY=checks and
# ONLY=times do only the bits or only the times; CHECK_MODELS and
# TIME_MODELS name the files checked and timed, WARP=0 leaves out a warp's
# tiles' times); a summary on stdout and in $OUT/tiles.txt.
set -u
ROOT=$PWD
. bench/gpu/setup.sh
gpu_setup /tmp/tiles gpucheck synth
V=${V:-"-"}
defs() { [ "$1" = - ] || echo "$1" | tr ',' '\n' | sed 's/^/--define /' | tr '\n' ' '; }
[ -f 7b.gguf ] || {
  ./synth --like tok.gguf --shape 1.5b --out 1.5b.gguf 2> /dev/null
  ./synth --like tok.gguf --shape 7b --out 7b.gguf 2> /dev/null
  ./synth --like tok.gguf --shape "k=1024,4,8,2,2816" --type q5_k --out q5k.gguf 2> /dev/null
  ./synth --like tok.gguf --shape "k=1024,4,8,2,2816" --type q6_k --out q6k.gguf 2> /dev/null
  ./synth --like tok.gguf --shape 1.5b --type q5_k --out 1.5b-q5k.gguf 2> /dev/null
}
{
  case ${ONLY:-} in ncu | times) ;; *) for v in $V; do
    for m in ${CHECK_MODELS:-1.5b $([ "$v" = - ] && echo q5k q6k)}; do
      ./gpucheck $m.gguf --prompt ${CHECK_PROMPT:-45} --gen 6 --pp 512 --tg 8 $(defs $v) --out c.json > /dev/null 2> c.err || tail -3 c.err
      python3 -c '
import json, sys; d = json.load(open("c.json"))
ok = all(v for k, v in d.items() if k.startswith(("batch_inv", "graphs_same", "tiles_same")))
print(sys.argv[1], sys.argv[2], "bits:", d["logits_bitwise_equal_to_cpu_steps"], "of", d["generated"] + 1,
      "steps the CPU\x27s; invariant", ok, "; pp512 staged", round(d["pp_tok_s"]), "warp", round(d["pp_tok_s_warp_tiles"]))' "$v" $m
    done
  done ;; esac
  case ${ONLY:-} in ncu | checks) ;; *) for m in ${TIME_MODELS:-1.5b 7b 1.5b-q5k}; do
    [ "${WARP:-1}" = 0 ] || for tl in warp; do
      echo "$tl tiles $m: $(./gpucheck $m.gguf --prompt 512 --profile-prefill 7 --tiles $tl 2>/dev/null | tail -1)"
    done
    for v in $V; do
      echo "staged $v $m: $(./gpucheck $m.gguf --prompt 512 --profile-prefill 7 $(defs $v) 2>/dev/null | tail -1)"
    done
  done ;; esac
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # DETAIL=1: Nsight Compute's sections on one Q4_K product of a 7B prefill.
  [ -n "${DETAIL:-}" ] && "$ncu" --kernel-name mmt_q4_k --launch-skip 20 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section LaunchStats ./gpucheck 7b.gguf --prompt 512 --profile-prefill 1 \
    $(defs ${NCU_V:--}) 2>&1 | grep -v '^==PROF==' | grep -E '^ +[A-Z]|^ +-|Stall|stall|Issue|Warp|Throughput|Occupancy|Registers|Shared' | head -120
  case ${ONLY:-} in bench | times | checks) ;; *) [ -n "${DETAIL:-}" ] || for m in ${NCU_MODELS:-1.5b 7b}; do
    "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv ./gpucheck $m.gguf --prompt 512 \
      --profile-prefill 1 $(defs ${NCU_V:--}) > ncu.csv 2> ncu.err
    echo "ncu $m prefill, staged tiles ${NCU_V:--}"; python3 $ROOT/bench/gpu/ncusum.py ncu.csv prefill
  done ;; esac
} 2>&1 | tee $OUT/tiles.txt
