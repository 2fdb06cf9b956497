"""Embedding throughput of `snug serve`: batches of real sentences sent to
`/v1/embeddings` with the `openai` client, timed end to end (HTTP,
tokenization, the forward, pooling). Starts the server itself. (`-P`:
this folder holds a `tokenize.py` that would shadow the standard
library's.)

    python3 -P bench/embeddings.py [--bin target/release/snug] [--models smollm2-135m ...]
        [--batch 32] [--rounds 5] [--out FILE.json]
        [--reference-python PYTHON --reference-dir ~/.cache/snug/models/all-MiniLM-L6-v2]

A sentence-embedding model (`all-minilm-l6-v2`) is served the same way.
With `--reference-python` (a Python with sentence-transformers), the same
texts are also encoded by `SentenceTransformer.encode` on the same number
of threads, in one call per round, for a row to compare with.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

import openai

TEXT = os.path.join(os.path.dirname(__file__), "..", "crates", "snug-engine", "src", "calibration.txt")


def sentences(n):
    words = open(TEXT).read().split()
    out, i = [], 0
    while len(out) < n:
        k = 12 + (len(out) * 7) % 40
        out.append(" ".join(words[i % len(words):][:k]))
        i += k
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/snug")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference-python")
    ap.add_argument("--reference-dir")
    a = ap.parse_args()
    texts = sentences(a.batch)
    rows = []
    for model in a.models:
        srv = subprocess.Popen([a.bin, "serve", model, "--port", str(a.port), "--threads", str(a.threads), "--no-access-log"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{a.port}/v1", api_key="x", max_retries=0, timeout=600)
            for _ in range(600):
                try:
                    client.models.list()
                    break
                except Exception:
                    time.sleep(0.1)
            client.embeddings.create(model=model, input=texts[:2])  # warm up
            times, tokens = [], 0
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                r = client.embeddings.create(model=model, input=texts)
                times.append(time.perf_counter() - t0)
                tokens = r.usage.prompt_tokens
            secs = statistics.median(times)
            row = {"model": model, "inputs": len(texts), "tokens": tokens, "seconds": secs,
                   "tokens_per_s": tokens / secs, "inputs_per_s": len(texts) / secs, "rounds": a.rounds}
            rows.append(row)
            print(f"{model:22} {len(texts)} inputs, {tokens} tokens: {secs:.3f} s, "
                  f"{tokens / secs:.0f} tok/s, {len(texts) / secs:.1f} inputs/s", flush=True)
        finally:
            srv.terminate()
            srv.wait()
    if a.reference_python:
        rows.append(reference(a, texts))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


REFERENCE = """
import json, statistics, sys, time
import torch
from sentence_transformers import SentenceTransformer
directory, threads, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
texts = json.load(sys.stdin)
torch.set_num_threads(threads)
m = SentenceTransformer(directory, device="cpu")
m.encode(texts[:2], batch_size=32)
times = []
for _ in range(rounds):
    t0 = time.perf_counter()
    m.encode(texts, batch_size=32)
    times.append(time.perf_counter() - t0)
tokens = sum(len(m.tokenizer(t)["input_ids"]) for t in texts)
print(json.dumps({"seconds": statistics.median(times), "tokens": tokens}))
"""


def reference(a, texts):
    """sentence-transformers on the same texts and threads (no HTTP)."""
    out = subprocess.run([a.reference_python, "-c", REFERENCE, a.reference_dir, str(a.threads), str(a.rounds)],
                         input=json.dumps(texts), capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    secs, tokens = r["seconds"], r["tokens"]
    print(f"{'sentence-transformers':22} {len(texts)} inputs, {tokens} tokens: {secs:.3f} s, "
          f"{tokens / secs:.0f} tok/s, {len(texts) / secs:.1f} inputs/s", flush=True)
    return {"model": "all-minilm-l6-v2 (sentence-transformers, in process)", "inputs": len(texts), "tokens": tokens,
            "seconds": secs, "tokens_per_s": tokens / secs, "inputs_per_s": len(texts) / secs, "rounds": a.rounds}


if __name__ == "__main__":
    main()
