#!/usr/bin/env python3
"""Latency of typed decisions: one question against ten on the same state,
through `snug serve`'s /v1/systemone.

    bench/decide.py SNUG MODEL OUT.json [--reps 30] [--threads 2]

One server (prefix cache off, so every request prefills its state), one
warm-up; then each round sends the one-question request and the
ten-question request (in alternating order) about a ~100-token
customer-support message, timing each from send to the parsed answer.
P50 and P95 of each, and the ratio of the medians.
"""

import argparse
import json
import sys
import os
import socket
import statistics
import subprocess
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port  # noqa: E402

STATE = ("Hello, I bought the Aurora 2 desk lamp from your online shop on 12 March (order 88213). "
         "Since last week it flickers whenever I switch it to the brightest setting, and yesterday it "
         "stopped turning on at all. I have already tried another socket and a new bulb. I would like a "
         "replacement rather than a refund, and I need it before the end of the month because I work "
         "late. Could you tell me how to send it back? Thanks, Maria")

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "queue": {"type": "choice", "instructions": "Which team should handle this?",
              "criteria": {"returns": "returns and replacements", "billing": "payments", "tech": "the website"}},
    "urgency": {"type": "score", "instructions": "How urgent is this message?",
                "criteria": ["not urgent", "somewhat urgent", "urgent", "very urgent", "an emergency"]},
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "product": {"type": "choice", "instructions": "Which product is it about?",
                "criteria": ["lamp", "kettle", "desk", "chair"]},
    "order": {"type": "noul", "instructions": "Does the message give an order number?"},
    "polite": {"type": "score", "instructions": "How polite is the message?", "criteria": ["rude", "neutral", "polite"]},
    "lang": {"type": "choice", "instructions": "In which language is the message?",
             "criteria": ["English", "German", "French"]},
    "deadline": {"type": "noul", "instructions": "Does the customer mention a deadline?"},
    "sentiment": {"type": "choice", "instructions": "What is the sentiment?",
                  "criteria": {"positive": None, "neutral": None, "negative": None}},
}




def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/systemone", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.load(r)
    return time.perf_counter() - t0, out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snug")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    port = free_port()
    p = subprocess.Popen([a.snug, "serve", a.model, "--port", str(port), "--threads", str(a.threads),
                          "--no-prefix-cache", "--parallel", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.2)
        one = {"state": STATE, "questions": {"refund": QUESTIONS["refund"]}}
        ten = {"state": STATE, "questions": QUESTIONS}
        post(port, ten)
        t1, t10 = [], []
        for rep in range(a.reps):
            order = [(one, t1), (ten, t10)] if rep % 2 == 0 else [(ten, t10), (one, t1)]
            for body, into in order:
                dt, out = post(port, body)
                into.append(dt)
        state_tokens = out["usage"]["state_tokens"]
    finally:
        p.terminate()
        p.wait(timeout=60)
    res = {"model": a.model, "state_tokens": state_tokens, "one_s": t1, "ten_s": t10,
           "p50_one_ms": statistics.median(t1) * 1e3, "p95_one_ms": pct(t1, 95) * 1e3,
           "p50_ten_ms": statistics.median(t10) * 1e3, "p95_ten_ms": pct(t10, 95) * 1e3}
    res["ratio_p50"] = res["p50_ten_ms"] / res["p50_one_ms"]
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"| {a.model.split('/')[-1]} | {state_tokens} | {res['p50_one_ms']:.0f} | {res['p95_one_ms']:.0f} | "
          f"{res['p50_ten_ms']:.0f} | {res['p95_ten_ms']:.0f} | {res['ratio_p50']:.2f}x |")


if __name__ == "__main__":
    main()
