#!/usr/bin/env python3
"""Tokenizer throughput, snug beside llama.cpp, on the same text and model.

Each run is one process that loads the model's vocabulary and tokenizes a
text of about 1 MB (the test corpus's strings: code, prose in many scripts,
emoji, whitespace runs, repeated to size). A second run on a one-word text
measures the fixed cost (process start and vocabulary load), so tokens per
second are reported both end to end and with that cost taken out. Runs
alternate between the two programs; figures are medians of --reps runs.
Both programs' ids are compared on the big text and must be identical.

Usage:
  python3 bench/tokenize.py --llama-tokenize PATH [--snug target/release/snug] [--reps 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}


def cache_dir():
    if os.environ.get("SNUG_HOME"):
        return Path(os.environ["SNUG_HOME"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "snug"
    return Path.home() / ".cache" / "snug"


def timed(cmd, stdin_path=None):
    t0 = time.perf_counter()
    with open(stdin_path, "rb") if stdin_path else open(os.devnull, "rb") as f:
        out = subprocess.run(cmd, stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True)
    return time.perf_counter() - t0, out.stdout


def snug_cmd(snug, model):
    return [snug, "tokenize", str(model), "-", "--json"]


def llama_cmd(llama, model, path):
    return [llama, "-m", str(model), "-f", str(path), "--ids", "--log-disable", "--no-escape"]


def llama_ids(stdout):
    return json.loads(stdout.decode().strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-tokenize", required=True)
    ap.add_argument("--snug", default=str(ROOT / "target" / "release" / "snug"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bytes", type=int, default=1_000_000)
    args = ap.parse_args()

    corpus = json.load(open(ROOT / "crates/snug-model/tests/data/tokenize_corpus.json"))
    strings = [c["text"] for c in corpus["models"]["smollm2-135m"]["cases"]]
    text = ""
    while len(text.encode()) < args.bytes:
        text += "\n".join(strings) + "\n"
    tmp = Path(tempfile.mkdtemp())
    big, small = tmp / "big.txt", tmp / "small.txt"
    big.write_bytes(text.encode()[: args.bytes].decode("utf-8", "ignore").encode())
    small.write_text("hello")
    size = big.stat().st_size

    rows = []
    for alias, fname in MODELS.items():
        model = cache_dir() / "models" / fname
        if not model.exists():
            print(f"skipping {alias}: {model} not found (snug pull {alias})", file=sys.stderr)
            continue
        _, out_s = timed(snug_cmd(args.snug, model), big)
        _, out_l = timed(llama_cmd(args.llama_tokenize, model, big))
        ids_s, ids_l = json.loads(out_s)["ids"], llama_ids(out_l)
        if ids_s != ids_l:
            sys.exit(f"{alias}: ids differ ({len(ids_s)} vs {len(ids_l)} tokens)")
        times = {k: [] for k in ("snug", "snug0", "llama", "llama0")}
        for _ in range(args.reps):
            times["snug"].append(timed(snug_cmd(args.snug, model), big)[0])
            times["llama"].append(timed(llama_cmd(args.llama_tokenize, model, big))[0])
            times["snug0"].append(timed(snug_cmd(args.snug, model), small)[0])
            times["llama0"].append(timed(llama_cmd(args.llama_tokenize, model, small))[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        n = len(ids_s)
        rows.append((alias, n, med))

    print(f"text: {size} bytes; medians of {args.reps} runs; ids identical on every model\n")
    print("| model | tokens | snug total s | llama.cpp total s | snug load s | llama.cpp load s | snug tok/s (no load) | llama.cpp tok/s (no load) | speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for alias, n, m in rows:
        ts = n / max(m["snug"] - m["snug0"], 1e-9)
        tl = n / max(m["llama"] - m["llama0"], 1e-9)
        print(f"| {alias} | {n} | {m['snug']:.2f} | {m['llama']:.2f} | {m['snug0']:.2f} | {m['llama0']:.2f} | {ts/1e3:.0f}k | {tl/1e3:.0f}k | {ts/tl:.2f}x |")


if __name__ == "__main__":
    main()
