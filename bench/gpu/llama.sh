#!/bin/sh
# llama.cpp's CUDA build, the peer of `--device cuda`, on the GPU machine.
#
#   bench/gpu/llama.sh build SRC.tgz DIR
#       SRC.tgz holds `llama.cpp/` from the llama-cpp-python 0.3.36 sdist
#       (its vendor/ folder, models/ docs/ tests/ and the other backends
#       left out); builds llama-bench and llama-batched-bench for the
#       device's architecture in DIR/build. About 6 minutes on 16 cores.
#   bench/gpu/llama.sh bench DIR OUT MODEL...
#       llama-bench pp512 and tg128, three repetitions, flash attention
#       off and on, each model; JSON lines into OUT/llama-bench.jsonl.
#   bench/gpu/llama.sh batched DIR OUT MODEL
#       llama-batched-bench, 64 sequences of a 128-token prompt each
#       generating 128, into OUT/llama-batched.txt.
set -eu
cmd=$1; shift
nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
case $cmd in
build)
  src=$1 dir=$2
  mkdir -p "$dir"
  [ -d "$dir/llama.cpp" ] || tar xzf "$src" -C "$dir"
  cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > "$dir/cmake.log" 2>&1
  cmake --build "$dir/build" --target llama-bench llama-batched-bench -j"$(nproc)" > "$dir/build.log" 2>&1
  ls -la "$dir/build/bin"
  ;;
bench)
  dir=$1 out=$2; shift 2
  for m in "$@"; do
    "$dir/build/bin/llama-bench" -m "$m" -p 512 -n 128 -r 3 -fa 0,1 -ngl 99 -o jsonl >> "$out/llama-bench.jsonl" 2>> "$out/llama-bench.err"
  done
  ;;
batched)
  dir=$1 out=$2 m=$3
  "$dir/build/bin/llama-batched-bench" -m "$m" -c 16384 -b 2048 -ub 512 -ngl 99 -fa on \
    -npp 128 -ntg 128 -npl 1,64 > "$out/llama-batched.txt" 2>> "$out/llama-batched.err"
  ;;
esac
