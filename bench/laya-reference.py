#!/usr/bin/env python3
"""Latency of the reference SDK (`laya`, PyTorch on the CPU) on a Laya
checkpoint, measured as bench/decide.py measures `snug serve`: the same
customer-support message, one request with one yes/no question and one
with ten questions, alternating, after one warm-up.

    bench/laya-reference.py CHECKPOINT_DIR OUT.json [--reps 10] [--threads 2]

Needs torch, transformers and laya==0.4.15. The SDK is called in-process
(`Agent.system_one`), so no HTTP time is counted on its side; bench/decide.py
counts snug's HTTP round trip on loopback, well under a millisecond.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    from laya.agent import Agent
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "decide_bench", os.path.join(os.path.dirname(os.path.abspath(__file__)), "decide.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    agent = Agent(a.checkpoint, device="cpu")
    one = {"refund": bench.QUESTIONS["refund"]}
    ten = bench.QUESTIONS
    out = agent.system_one(bench.STATE, ten)
    t1, t10 = [], []
    for rep in range(a.reps):
        order = [(one, t1), (ten, t10)] if rep % 2 == 0 else [(ten, t10), (one, t1)]
        for qs, into in order:
            t0 = time.perf_counter()
            out = agent.system_one(bench.STATE, qs)
            into.append(time.perf_counter() - t0)
    res = {"checkpoint": a.checkpoint, "threads": a.threads, "torch": torch.__version__,
           "state_tokens": out["usage"]["state_tokens"], "one_s": t1, "ten_s": t10,
           "p50_one_ms": statistics.median(t1) * 1e3, "p95_one_ms": bench.pct(t1, 95) * 1e3,
           "p50_ten_ms": statistics.median(t10) * 1e3, "p95_ten_ms": bench.pct(t10, 95) * 1e3}
    res["ratio_p50"] = res["p50_ten_ms"] / res["p50_one_ms"]
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"| reference {os.path.basename(a.checkpoint.rstrip('/'))} | {res['state_tokens']} | "
          f"{res['p50_one_ms']:.0f} | {res['p95_one_ms']:.0f} | {res['p50_ten_ms']:.0f} | "
          f"{res['p95_ten_ms']:.0f} | {res['ratio_p50']:.2f}x |")


if __name__ == "__main__":
    main()
