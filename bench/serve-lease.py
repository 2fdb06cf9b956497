#!/usr/bin/env python3
"""What leasing out the output head saves and costs: `snug serve` with and
without --lease-head, one long prompt at a time (prefill chunks that need
no logits, then a short answer).

    bench/serve-lease.py SNUG MODEL.gguf OUT.json [--reps 3] [--chars 6000]

For each repetition and mode (alternating), a fresh server gets a warm-up
request, then one streamed completion of a long real-text prompt (Debian's
license texts) with a distinct start, so no prefix is shared. The script
polls /metrics every 20 ms while the request runs and reports the time to
first token, the lowest and highest resident set seen during the request,
and the head bytes given back. Medians over repetitions.
"""

import argparse
import json
import sys
import os
import socket
import statistics
import subprocess
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port, get, metric  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))








def one(snug, model, lease, prompt, threads):
    port = free_port()
    cmd = [snug, "serve", model, "--port", str(port), "--threads", str(threads), "--speculate", "off",
           "--parallel", "1", "--no-prefix-cache"] + (["--lease-head"] if lease else [])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                get(port, "/health")
                break
            except Exception:
                time.sleep(0.2)

        def post(body):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            return urllib.request.urlopen(req, timeout=900)

        post({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).read()
        samples = []
        done = threading.Event()

        def poll():
            while not done.is_set():
                try:
                    samples.append(metric(get(port, "/metrics"), 'snug_memory_bytes{part="rss"}'))
                except Exception:
                    pass
                time.sleep(0.02)

        t = threading.Thread(target=poll)
        t.start()
        t0 = time.perf_counter()
        ttft = None
        with post({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            for line in r:
                if line.startswith(b"data: ") and ttft is None and b'"text":"' in line:
                    ttft = time.perf_counter() - t0
        done.set()
        t.join()
        m = get(port, "/metrics")
        return {"ttft_s": ttft, "rss_min": min(samples), "rss_max": max(samples),
                "released_bytes": metric(m, "snug_lease_released_bytes_total ") or 0,
                "releases": metric(m, "snug_lease_releases_total ") or 0}
    finally:
        p.terminate()
        p.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snug")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chars", type=int, default=6000)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    text_path = os.path.join(HERE, "out", "licenses.txt")
    if not os.path.exists(text_path):
        subprocess.run([os.path.join(HERE, "eval-text.sh"), text_path], check=True)
    text = open(text_path).read()
    runs = {"off": [], "on": []}
    for rep in range(a.reps):
        for mode in ("off", "on"):
            start = (rep * 2 + (mode == "on")) * 7919 % (len(text) - a.chars)
            runs[mode].append(one(a.snug, a.model, mode == "on", text[start:start + a.chars], a.threads))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    json.dump({"model": a.model, "chars": a.chars, "runs": runs, "median": med}, open(a.out, "w"), indent=1)
    print("| --lease-head | TTFT ms | lowest RSS during the request MiB | highest RSS MiB | head bytes given back MiB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode in ("off", "on"):
        r = med[mode]
        print(f"| {mode} | {r['ttft_s'] * 1e3:.0f} | {r['rss_min'] / 2**20:.0f} | {r['rss_max'] / 2**20:.0f} | "
              f"{r['released_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
