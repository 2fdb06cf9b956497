# Sourced by the GPU scripts from the repository root: `gpu_setup DIR
# PROGRAM...` copies .gpu/ into DIR, unpacks the gzipped programs named
# that are there, enters DIR, and puts the toolkit's NVRTC on the library
# path.
gpu_setup() {
  dir=$1
  shift
  mkdir -p "$dir"
  cp -r .gpu/. "$dir/"
  cd "$dir" || exit 1
  for f in "$@"; do
    if [ -f "$f.gz" ]; then
      gunzip -c "$f.gz" > "$f"
      chmod +x "$f"
    fi
  done
  nvrtc=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -1)
  export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# `gpu_synth MODEL...` synthesizes MODEL.gguf in the current folder (with
# ./synth and tok.gguf there) for each name not already there: `smol` the
# SmolLM2 shape (Q4_1, a Q8_0 head), `g3` Gemma 3 270M's (heads of 256,
# a window of 512 on five layers of six; Q5_0, a Q8_0 head), any other
# name a shape synth_gguf knows (`1.5b`, `7b`: Q4_K, a Q6_K head). Errors
# go to stderr.
gpu_synth() {
  for m in "$@"; do
    [ -f "$m.gguf" ] && continue
    case $m in
      smol) ./synth --like tok.gguf --shape "smol=576,30,9,3,1536" --type q4_1 --head-type q8_0 --out smol.gguf ;;
      g3) ./synth --like tok.gguf --arch gemma3 --shape "g3=640,18,4,1,2048,256" --window 512 --type q5_0 \
        --head-type q8_0 --out g3.gguf ;;
      *) ./synth --like tok.gguf --shape "$m" --out "$m.gguf" ;;
    esac
  done
}
