#!/usr/bin/env python3
"""How many tokens a server holds at once in a fixed KV memory budget:
`snug serve` with TQ4 KV against `llama-server` with f16 KV, the same bytes.

    bench/serve-capacity.py SNUG LLAMA_SERVER MODEL.gguf OUT.json [--budget-mib 64] [--clients 16] [--parallel 8]

Both servers get the same budget for KV: snug as --memory-budget (its pool,
TQ4 pages plus the exact window's F16 twin pages); llama-server as the
largest context (a multiple of 256) whose f16 KV fits the same bytes, split
over as many slots as requests of this size fit. Then --clients requests
with distinct prompts of real text (Debian's license texts, bench/eval-text.sh)
arrive at once, each generating --gen tokens. While they run, the script
polls each server (snug: /metrics, KV pages used; llama-server: /slots,
prompt tokens processed or cached plus tokens decoded of every busy slot)
and reports the most requests running at once, the most KV tokens held at
once, every request's outcome, and the peak RSS.
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port, get, wait_up, metric  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))










def peak_rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def tokenize_len(snug, model, text):
    out = subprocess.run([snug, "tokenize", model, "-", "--json"], input=text, capture_output=True, text=True)
    return len(json.loads(out.stdout)["ids"])


def run(kind, cmd, port, prompts, gen, poll):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(p, port)
        results = [None] * len(prompts)

        def go(i):
            body = json.dumps({"prompt": prompts[i], "max_tokens": gen, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=900) as r:
                    results[i] = ("ok", json.load(r)["usage"])
            except urllib.error.HTTPError as e:
                results[i] = (f"http {e.code}", e.read().decode()[:200])
            except Exception as e:
                results[i] = ("error", str(e)[:200])

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        t0 = time.time()
        for t in threads:
            t.start()
        most_running, most_tokens = 0, 0
        while any(t.is_alive() for t in threads):
            try:
                running, tokens = poll(port)
                most_running = max(most_running, running)
                most_tokens = max(most_tokens, tokens)
            except Exception:
                pass
            time.sleep(0.05)
        wall = time.time() - t0
        rss = peak_rss(p.pid)
        return {"kind": kind, "cmd": cmd, "most_running": most_running, "most_tokens_held": most_tokens,
                "outcomes": [r[0] for r in results], "usage": [r[1] for r in results],
                "wall_s": wall, "peak_rss_bytes": rss}
    finally:
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snug")
    ap.add_argument("llama_server")
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--chars", type=int, default=3000, help="characters of text per prompt")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=8,
                    help="snug's --parallel (each running request keeps exact-window twin pages in F16)")
    a = ap.parse_args()

    text_path = os.path.join(HERE, "out", "licenses.txt")
    if not os.path.exists(text_path):
        subprocess.run([os.path.join(HERE, "eval-text.sh"), text_path], check=True)
    text = open(text_path).read()
    prompts = [text[i * a.chars:(i + 1) * a.chars] for i in range(a.clients)]
    longest = max(tokenize_len(a.snug, a.model, p) for p in prompts)
    per_request = longest + a.gen + 1
    budget = a.budget_mib << 20

    info = json.loads(subprocess.run([a.snug, "info", a.model, "--json"], capture_output=True, text=True).stdout)
    f16_per_token = info["kv_f16_bytes_per_1k_tokens"] / 1024
    n_ctx = int(budget // f16_per_token) // 256 * 256
    slots = max(1, n_ctx // per_request)

    port = free_port()
    snug_cmd = [a.snug, "serve", a.model, "--port", str(port), "--threads", str(a.threads), "--kv", "tq4",
                "--memory-budget", f"{a.budget_mib}MiB", "--parallel", str(a.parallel),
                "--max-queue", str(a.clients), "--guaranteed-output", str(a.gen), "--ctx", "4096"]

    def snug_poll(port):
        m = get(port, "/metrics")
        pt = metric(m, "snug_kv_page_tokens ")
        return metric(m, "snug_requests_running "), metric(m, 'snug_kv_pages{state="used"}') * pt

    snug = run("snug", snug_cmd, port, prompts, a.gen, snug_poll)
    m = None
    p = subprocess.Popen(snug_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(p, port)
        for _ in range(100):
            m = get(port, "/metrics")
            if 'part="kv_reserved"' in m:
                break
            time.sleep(0.1)
    finally:
        p.terminate()
        p.wait(timeout=60)
    snug["kv_bytes"] = metric(m, 'snug_memory_bytes{part="kv_reserved"}') + metric(
        m, 'snug_memory_bytes{part="kv_exact_window"}')
    snug["pool_tokens"] = metric(m, 'snug_kv_pages{state="total"}') * metric(m, "snug_kv_page_tokens ")

    port = free_port()
    llama_cmd = [a.llama_server, "-m", a.model, "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                 "-c", str(n_ctx), "-np", str(slots), "--metrics", "--no-webui", "-ctk", "f16", "-ctv", "f16"]

    def llama_poll(port):
        slots = [x for x in json.loads(get(port, "/slots")) if x.get("is_processing")]
        held = sum(x.get("n_prompt_tokens_processed", 0) + x.get("n_prompt_tokens_cache", 0)
                   + x["next_token"][0]["n_decoded"] for x in slots)
        return len(slots), held

    llama = run("llama-server", llama_cmd, port, prompts, a.gen, llama_poll)
    llama["kv_bytes"] = n_ctx * f16_per_token
    llama["pool_tokens"] = n_ctx

    report = {"model": a.model, "budget_bytes": budget, "prompt_tokens_max": longest, "gen": a.gen,
              "clients": a.clients, "snug": snug, "llama": llama}
    json.dump(report, open(a.out, "w"), indent=1)
    print("| server | KV format | KV bytes | tokens the pool holds | most requests at once | most tokens held at once | requests ok | wall s | peak RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r, fmt in ((snug, "tq4"), (llama, "f16")):
        ok = sum(1 for o in r["outcomes"] if o == "ok")
        print(f"| {r['kind']} | {fmt} | {r['kv_bytes'] / 2**20:.1f} MiB | {r['pool_tokens']:.0f} | {r['most_running']:.0f} | "
              f"{r['most_tokens_held']:.0f} | {ok}/{len(r['outcomes'])} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
