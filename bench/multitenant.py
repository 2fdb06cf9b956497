"""Many tenants' conversations through a router in front of several
`snug serve` replicas: round-robin against prefix-aware routing, and a
replica killed mid-run.

Workload: TENANTS tenants, each with its own long system prompt, each
running CONVS conversations of TURNS turns (a turn's request carries the
whole history so far), CONCURRENCY conversations at a time, greedy, sent
with the official openai client (streaming, so time to first token is
measured as a client sees it). Every answer is recorded: since a reply
never depends on which replica computed it, every run's transcripts must
be byte-identical to the first run's; the script exits non-zero if not.

Policies (each on freshly started replicas, so caches start empty):
  round_robin   sglang-router, round robin
  cache_aware   sglang-router's cache-aware policy (an approximate prefix
                tree of the requests it routed)
  kv_aware      vllm-router's kv_aware policy, fed by each replica's KV
                events (--kv-events) and its render route

Per run: prefix-cache hit rate (tokens reused / prompt tokens, from the
replicas' vllm:prefix_cache_* counters), TTFT p50/p95, aggregate output
tokens/s, errors.

--kill: one more run with the given policy where the replicas share a
--prefix-cache-dir, and one replica is killed (SIGKILL) once a third of
the turns are done. A turn that fails is retried by the client (as an
application would) up to 3 times; the run reports failed attempts, turns
lost (none may be), and the pages the survivors read from the shared
folder (the dead replica's conversations resuming elsewhere).

Usage:
  bench/multitenant.py --snug target/release/snug --model PATH \
      [--replicas 3] [--threads 1] [--policies round_robin,cache_aware,kv_aware] \
      [--kill cache_aware] [--out results.json]
Routers come from PyPI: pip install sglang-router vllm-router openai.
"""

import os
import sys

# This folder has a tokenize.py of its own, which must not hide the
# standard library's (which other modules import): nothing is imported
# from a path with this folder until servelib, below.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import openai  # noqa: E402

sys.path.insert(0, _here)
from servelib import free_port, get, metric, wait_up  # noqa: E402

TOPICS = [
    ("bicycle repairs", "brakes, gears, chains, tyres and wheel truing"),
    ("tea", "green, black, oolong and white teas, water temperature and steeping"),
    ("gardening", "soil, watering, pruning, pests and seasonal planting"),
    ("home networking", "routers, Wi-Fi channels, cables, firewalls and DNS"),
    ("baking bread", "flour, hydration, yeast, sourdough starters and ovens"),
    ("amateur astronomy", "telescopes, star charts, planets and light pollution"),
    ("personal budgeting", "savings, spending categories, debts and emergency funds"),
    ("running", "training plans, shoes, pacing, injuries and recovery"),
]
QUESTIONS = [
    "What is the first thing I should check?",
    "Why does that matter?",
    "Give me one more tip.",
    "What mistake do beginners make most often?",
    "How often should I do this?",
    "What tool do I need for it?",
]


def system_prompt(t):
    topic, scope = TOPICS[t % len(TOPICS)]
    rules = (
        f"You are the assistant of a help desk about {topic}. You answer questions about {scope}. "
        "Answer in at most two sentences. Be concrete and practical, and never invent facts. "
        "If a question is outside your subject, say so politely and suggest where to ask. "
    )
    return rules * 4 + f"Tenant {t}."


def start_replicas(a, n, shared_dir, events):
    procs = []
    for i in range(n):
        port = free_port()
        cmd = [
            a.snug, "serve", a.model, "--port", str(port), "--threads", str(a.threads),
            "--no-access-log", "--memory-budget", a.budget, "--kv-page", "16", "--parallel", "4",
            "--guaranteed-output", str(a.max_tokens),
        ]
        ev = None
        if events:
            ev = free_port()
            cmd += ["--kv-events", f"tcp://*:{ev}"]
        if shared_dir:
            cmd += ["--prefix-cache-dir", shared_dir]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append((p, port, ev))
    for p, port, _ in procs:
        wait_up(p, port)
    return procs


def start_router(a, policy, replicas):
    port = free_port()
    urls = [f"http://127.0.0.1:{r[1]}" for r in replicas]
    if policy == "kv_aware":
        cmd = [os.path.join(a.venv, "vllm-router"), "--worker-urls", *urls, "--policy", "kv_aware",
               "--port", str(port), "--prometheus-port", str(free_port()),
               "--kv-event-block-size", "16", "--kv-event-model", "snug"]
        for r in replicas:
            cmd += ["--kv-event-source", f"http://127.0.0.1:{r[1]}=tcp://127.0.0.1:{r[2]}"]
    else:
        cmd = [os.path.join(a.venv, "python"), "-m", "sglang_router.launch_router", "--worker-urls", *urls,
               "--policy", policy, "--port", str(port), "--prometheus-port", str(free_port())]
    log = open(os.path.join(a.logs, f"router-{policy}-{port}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            get(port, "/v1/models", timeout=1)
            time.sleep(1)
            return p, port
        except Exception:
            if p.poll() is not None:
                raise SystemExit(f"the router exited; see {log.name}")
            time.sleep(0.3)
    raise SystemExit("the router did not start")


def counters(replicas):
    out = []
    for p, port, _ in replicas:
        if p.poll() is not None:
            out.append(None)
            continue
        try:
            m = get(port, "/metrics")
        except Exception:
            out.append(None)
            continue
        out.append({
            "queries": metric(m, "vllm:prefix_cache_queries_total") or 0,
            "hits": metric(m, "vllm:prefix_cache_hits_total") or 0,
            "disk_reads": metric(m, 'snug_prefix_cache_total{event="disk_reads"}') or 0,
            "requests": metric(m, "vllm:request_success_total") or 0,
        })
    return out


def conversation(client, t, c, turns, max_tokens, log, stop_flag):
    rng = random.Random(t * 1000 + c)
    messages = [{"role": "system", "content": system_prompt(t)}]
    transcript = []
    for turn in range(turns):
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        for attempt in range(4):
            start = time.time()
            first = None
            text = ""
            tokens = 0
            try:
                stream = client.chat.completions.create(
                    model="m", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.time()
                        text += chunk.choices[0].delta.content
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                log.append({"ok": True, "ttft": (first or time.time()) - start, "tokens": tokens,
                            "tenant": t, "conv": c, "turn": turn, "attempt": attempt})
                break
            except Exception as e:  # a failed attempt: counted, then retried
                log.append({"ok": False, "error": f"{type(e).__name__}: {e}"[:200], "tenant": t,
                            "conv": c, "turn": turn, "attempt": attempt})
                time.sleep(0.5)
        else:
            transcript.append(None)
            return transcript
        messages.append({"role": "assistant", "content": text})
        transcript.append(text)
        stop_flag.done += 1
    return transcript


class Progress:
    done = 0


def run(a, policy, kill=False):
    shared = tempfile.mkdtemp(prefix="snug-shared-") if kill else None
    replicas = start_replicas(a, a.replicas, shared, events=(policy == "kv_aware"))
    router, rport = start_router(a, policy, replicas)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{rport}/v1", api_key="none", max_retries=0, timeout=300)
    before = counters(replicas)
    log = []
    progress = Progress()
    total_turns = a.tenants * a.convs * a.turns
    killed = {}

    def killer():
        while progress.done < total_turns // 3:
            time.sleep(0.1)
        victim = replicas[0][0]
        killed["at_turn"] = progress.done
        killed["counters"] = counters(replicas)[0]
        victim.send_signal(signal.SIGKILL)

    if kill:
        threading.Thread(target=killer, daemon=True).start()
    jobs = [(t, c) for c in range(a.convs) for t in range(a.tenants)]
    t0 = time.time()
    with cf.ThreadPoolExecutor(a.concurrency) as pool:
        futs = {pool.submit(conversation, client, t, c, a.turns, a.max_tokens, log, progress): (t, c) for t, c in jobs}
        transcripts = {f"{futs[f][0]}/{futs[f][1]}": f.result() for f in cf.as_completed(futs)}
    wall = time.time() - t0
    after = counters(replicas)
    router.terminate()
    router.wait()
    for p, _, _ in replicas:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, _, _ in replicas:
        p.wait()
    if shared:
        shutil.rmtree(shared, ignore_errors=True)

    ok = [r for r in log if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok)
    q = h = reads = 0
    per_replica = []
    for i, (b, e) in enumerate(zip(before, after)):
        if e is None and kill and i == 0:
            e = killed.get("counters")
        if b is None or e is None:
            per_replica.append(None)
            continue
        d = {k: e[k] - b[k] for k in b}
        per_replica.append(d)
        q += d["queries"]
        h += d["hits"]
        reads += d["disk_reads"] if not (kill and i == 0) else 0
    lost = sum(1 for tr in transcripts.values() for x in tr if x is None)
    return {
        "policy": policy,
        "kill": kill,
        "turns": total_turns,
        "turns_answered": len(ok),
        "failed_attempts": len(log) - len(ok),
        "turns_lost": lost,
        "errors": sorted({r["error"] for r in log if not r["ok"]})[:5],
        "hit_rate": h / q if q else None,
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] if ttft else None,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "wall_s": wall,
        "requests_per_replica": [None if d is None else d["requests"] for d in per_replica],
        "survivor_disk_reads": reads if kill else None,
        "killed_at_turn": killed.get("at_turn"),
        "transcripts": transcripts,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--snug", default="target/release/snug")
    ap.add_argument("--model", required=True)
    ap.add_argument("--venv", default=os.path.dirname(sys.executable), help="folder with vllm-router and python")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", default="32MiB", help="each replica's --memory-budget")
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--convs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    ap.add_argument("--kill", default="", help="policy of the replica-kill run (none if empty)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    a.logs = tempfile.mkdtemp(prefix="snug-multitenant-")
    results = []
    for policy in [p for p in a.policies.split(",") if p]:
        results.append(run(a, policy))
    if a.kill:
        results.append(run(a, a.kill, kill=True))
    reference = results[0]["transcripts"]
    identical = all(
        r["transcripts"] == reference if not r["kill"]
        else all(v == reference[k] for k, v in r["transcripts"].items() if None not in v)
        for r in results
    )
    print(f"{'policy':<12} {'kill':<5} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'out tok/s':>9} "
          f"{'failed':>6} {'lost':>4} {'per replica':<16} disk reads")
    for r in results:
        print(f"{r['policy']:<12} {str(r['kill']):<5} {r['hit_rate']:>8.3f} {r['ttft_p50_s']:>8.3f}s "
              f"{r['ttft_p95_s']:>8.3f}s {r['output_tokens_per_s']:>9.1f} {r['failed_attempts']:>6} "
              f"{r['turns_lost']:>4} {str(r['requests_per_replica']):<16} {r['survivor_disk_reads']}")
    print(f"transcripts identical across runs: {identical}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "identical": identical,
                       "results": [{k: v for k, v in r.items() if k != "transcripts"} for r in results]}, f, indent=1)
    lost = sum(r["turns_lost"] for r in results)
    sys.exit(0 if identical and lost == 0 else 1)


if __name__ == "__main__":
    main()
