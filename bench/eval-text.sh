#!/usr/bin/env bash
# Writes the evaluation text for `snug eval ppl` to OUT (default
# bench/out/licenses.txt): every license text Debian ships in
# /usr/share/common-licenses (real text no one here wrote, present on a
# fresh Debian or Ubuntu machine), symlinks skipped, in name order. About
# 266 KB, 60k tokens.
set -euo pipefail
out=${1:-bench/out/licenses.txt}
mkdir -p "$(dirname "$out")"
: > "$out"
for f in /usr/share/common-licenses/*; do
  [ -L "$f" ] && continue
  cat "$f" >> "$out"
  printf '\n\n' >> "$out"
done
wc -c "$out" >&2
