#!/bin/sh
# Where a decode step's time goes on the GPU, in one call. In order, each
# part left out once the call has run LIMIT seconds (default 540):
# - the memory's read bandwidth (PyTorch, a sum over 4 GiB; BW=0 leaves
#   it out);
# - bits on each model (logits against the CPU and every invariance) of
#   CHECK_VARIANTS (as VARIANTS below; default the built-in kernels;
#   CHECK=0 leaves it out);
# - the decode step (`gpucheck --profile-decode 30`, median ms) of kernel
#   variants alternating, two rounds: VARIANTS, `|` between them, each a
#   label and gpucheck's arguments (`--source FILE.cu` carried in .gpu/,
#   `--define NAME=VALUE`); `builtin` alone is the built-in kernels;
# - the step with each kind of kernel switched off in turn (kernels.cu's
#   SKIP knob: 1 norms, 2 one-row products, 4 attention, 8 rotation and
#   KV writes, 16 quantization and the gated activation; the outputs are
#   then wrong, the time is what is left), on SKIP_MODELS;
# - GPU time per kernel inside the decode graphs (Nsight Systems) and each
#   kernel's time and DRAM bytes alone, caches kept (Nsight Compute), on
#   the 7B shape, where the machine has them.
# Run from the repository root with .gpu/ carried (gpucheck.gz, synth.gz,
# tok.gguf; MODEL_DIR: where synthesized files already are); MODELS,
# DEPTH narrow it. Results in $OUT/steps.txt.
set -u
T0=$(date +%s)
left() { [ $(($(date +%s) - T0)) -lt "${LIMIT:-540}" ]; }
ROOT=$PWD
. bench/gpu/setup.sh
gpu_setup /tmp/steps gpucheck synth
models=${MODELS:-smol 1.5b 7b}
for m in $models; do
  # Files already synthesized (compare.sh's) are used as they are.
  [ -f "${MODEL_DIR:-/nonexistent}/$m.gguf" ] && ln -sf "$MODEL_DIR/$m.gguf" $m.gguf
done
gpu_synth $models 2> /dev/null
step() { ./gpucheck "$@" 2> /dev/null < /dev/null | tail -1; }
d=${DEPTH:-64}
{
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total,driver_version --format=csv,noheader
  [ "${BW:-1}" = 0 ] || python3 - <<'PY' 2>&1 | tail -1
import torch
x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").fill_(1.0)
for _ in range(3): x.sum()
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
t = []
for _ in range(10):
    s.record(); x.sum(); e.record(); torch.cuda.synchronize(); t.append(s.elapsed_time(e))
t.sort()
print(f"read bandwidth (torch sum of 4 GiB, median of 10): {4 * 2**30 / t[5] / 1e6:.0f} GB/s")
PY
  # Bits: logits against the CPU and every invariance (as ab.sh).
  [ "${CHECK:-1}" = 0 ] || for m in $models; do
    echo "${CHECK_VARIANTS:-builtin}" | tr '|' '\n' | while read -r label args; do
      left || break
      f=$OUT/check-$m.json
      [ "$label" = builtin ] || f=$OUT/check-$m-$label.json
      ./gpucheck $m.gguf --prompt 32 --gen 8 --pp 64 --tg 8 --out $f $args > /dev/null 2>&1 < /dev/null
      python3 -c "
import json; d=json.load(open('$f'))
print('$m $label', {k: v for k, v in d.items() if k.startswith(('batch', 'logits_bit', 'graphs_same', 'greedy', 'tiles_same', 'overlap'))})"
    done
  done
  for round in 1 2; do
    for m in $models; do
      echo "${VARIANTS:-builtin}" | tr '|' '\n' | while read -r label args; do
        left && echo "$m depth $d $label round $round: $(step $m.gguf --prompt $d --profile-decode 30 $args)"
      done
    done
  done
  for m in ${SKIP_MODELS:-1.5b 7b}; do
    for skip in ${SKIPS:-0 1 2 4 8 16}; do
      left && echo "$m depth $d skip $skip: $(step $m.gguf --prompt $d --profile-decode 30 --define SKIP=$skip)"
    done
  done
  nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2> /dev/null | head -1)
  echo "nsys: ${nsys:-none}"
  if [ -n "$nsys" ] && left; then
    timeout 120 $nsys profile -q -t cuda --cuda-graph-trace=node -o /tmp/steps/n7b -f true ./gpucheck 7b.gguf --prompt $d --profile-decode 20 > /dev/null 2>&1
    $nsys stats -q -r cuda_gpu_kern_sum -f csv /tmp/steps/n7b.nsys-rep > $OUT/nsys-7b.csv 2>&1
    $nsys stats -q -r cuda_gpu_trace -f csv /tmp/steps/n7b.nsys-rep 2> /dev/null | tail -700 > $OUT/nsys-7b-trace.csv
    head -16 $OUT/nsys-7b.csv | cut -c1-220
  fi
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  echo "ncu: ${ncu:-none}"
  if [ -n "$ncu" ] && left; then
    timeout 150 "$ncu" --cache-control none --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      --csv ./gpucheck 7b.gguf --prompt $d --profile-decode 3 --no-graphs > /tmp/steps/ncu.csv 2> /dev/null
    gzip -c /tmp/steps/ncu.csv > $OUT/ncu-7b.csv.gz
    python3 $ROOT/bench/gpu/ncusum.py /tmp/steps/ncu.csv 2>&1 | head -30
  fi
  echo "elapsed $(($(date +%s) - T0)) s"
} 2>&1 | tee $OUT/steps.txt
