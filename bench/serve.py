#!/usr/bin/env python3
"""Aggregate decode throughput of `snug serve` (or `llama-server`) at several
numbers of concurrent requests.

    bench/serve.py snug target/release/snug MODEL_PATH OUT.json [--reps 3] [--conc 1,2,4,8] [--extra "--kv tq4"]
    bench/serve.py llama LLAMA_SERVER_BIN MODEL_PATH OUT.json ...

Each round starts one server, sends C concurrent greedy completions of
distinct real-text prompts (--max-tokens each, no stop), and reports
generated tokens over the wall time from the first request to the last
answer. Prompts differ per client so no prefix is shared. Medians over the
repetitions are printed as a markdown table and saved as JSON.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = open(os.path.join(HERE, "..", "crates", "snug-engine", "src", "calibration.txt")).read().split()




def start(kind, binary, model, port, threads, parallel, extra):
    if kind == "snug":
        cmd = [binary, "serve", model, "--port", str(port), "--threads", str(threads),
               "--parallel", str(parallel)] + extra
    else:
        cmd = [binary, "-m", model, "--port", str(port), "-t", str(threads), "-tb", str(threads),
               "-np", str(parallel), "-c", str(4096 * parallel), "--no-webui"] + extra
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return p
        except Exception:
            time.sleep(0.2)
    p.kill()
    raise SystemExit(f"{kind} server did not start: {p.stderr.read()[-2000:]}")


def complete(port, prompt, max_tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def round_(port, conc, max_tokens, offset):
    prompts = [" ".join(TEXT[(offset + i * 17) % 100:(offset + i * 17) % 100 + 40]) for i in range(conc)]
    results = [None] * conc

    def go(i):
        results[i] = complete(port, prompts[i], max_tokens)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(conc)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return tokens, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["snug", "llama"])
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--conc", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="", help="more server flags, one string")
    a = ap.parse_args()
    rows = []
    for conc in [int(c) for c in a.conc.split(",")]:
        port = free_port()
        p = start(a.kind, a.binary, a.model, port, a.threads, max(conc, 1), a.extra.split())
        try:
            round_(port, 1, 8, 999)  # warm-up
            rates = []
            for rep in range(a.reps):
                tokens, wall = round_(port, conc, a.max_tokens, rep * 7)
                rates.append(tokens / wall)
            rows.append({"concurrent": conc, "tok_s": statistics.median(rates), "runs": rates})
            print(f"{a.kind} conc {conc}: {statistics.median(rates):.1f} tok/s {['%.1f' % r for r in rates]}",
                  file=sys.stderr)
        finally:
            p.terminate()
            p.wait(timeout=60)
    json.dump({"kind": a.kind, "model": a.model, "threads": a.threads, "max_tokens": a.max_tokens,
               "rows": rows}, open(a.out, "w"), indent=1)
    print("| concurrent | aggregate decode tok/s |\n| ---: | ---: |")
    for r in rows:
        print(f"| {r['concurrent']} | {r['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
