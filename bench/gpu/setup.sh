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
