#!/usr/bin/env bash
# Builds llama.cpp, the peer snug is measured against, outside the repository:
# its source ships in the PyPI sdist of llama-cpp-python. Prints the folder
# holding the built programs (llama-tokenize, llama-bench, llama-completion, llama-perplexity, llama-lookup,
# llama-server).
#
# Usage: bench/build-llama-cpp.sh [DEST]   (default ~/.cache/snug-bench/llama.cpp)
set -euo pipefail
version=0.3.36
dest=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/snug-bench/llama.cpp}
mkdir -p "$dest"
cd "$dest"
if [ ! -d "llama_cpp_python-$version" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d . >&2
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src="$dest/llama_cpp_python-$version/vendor/llama.cpp"
if ! command -v cmake >/dev/null; then
  python3 -m pip install cmake >&2
fi
cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build build -j "$(nproc)" --target llama-tokenize llama-bench llama-completion llama-perplexity llama-lookup llama-server >&2
echo "$dest/build/bin"
