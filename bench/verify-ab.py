#!/usr/bin/env python3
"""Two snug builds side by side on the verbatim-copy workload of
`bench/speculate.py`: decode tokens per second with speculation off and on,
and the time of a verify round (`verify_ms / rounds` from `--json`),
medians over interleaved repetitions.

    bench/verify-ab.py BIN_A BIN_B [--models smollm2-135m:5,qwen2.5-coder-1.5b:3] [-n 128]

For kernel changes that touch multi-row forwards (verifies) and not
one-row decode steps: build each variant, copy its `target/release/snug`
aside, and compare them in one run, so the machine's load falls on both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speculate  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--models", default="smollm2-135m:5,qwen2.5-coder-1.5b:3")
    ap.add_argument("-n", type=int, default=128)
    args = ap.parse_args()
    prompt = speculate.chatml(dict(speculate.workloads())["verbatim"])
    print("| model | build | off t/s | on t/s | on/off | verify ms per round |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for spec in args.models.split(","):
        model, reps = spec.split(":")
        res = {}
        for _ in range(int(reps)):
            for b in (args.a, args.b):
                for mode in ("off", "on"):
                    out = subprocess.run([b, "run", model, "-p", prompt, "-n", str(args.n), "-t", "2",
                                          "--speculate", mode, "--json"],
                                         capture_output=True, text=True, check=True)
                    v = json.loads(out.stdout)
                    sp = v["stats"]["speculation"]
                    res.setdefault((b, mode), []).append(
                        (v["stats"]["decode_tok_s"], sp["verify_ms"] / max(sp["rounds"], 1)))
        for b in (args.a, args.b):
            off = statistics.median(x[0] for x in res[(b, "off")])
            on = statistics.median(x[0] for x in res[(b, "on")])
            ver = statistics.median(x[1] for x in res[(b, "on")])
            print(f"| {model} | {b} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {ver:.1f} |", flush=True)


if __name__ == "__main__":
    main()
