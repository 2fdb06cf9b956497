#!/usr/bin/env python3
"""A soak test of `snug serve`: many clients for many minutes, then SIGTERM.

    bench/soak.py [--binary target/release/snug] [--model smollm2-135m]
                  [--clients 8] [--minutes 30] [--seed 1] [--out soak.json]

Before the load, every prompt is answered alone (greedy, and sampled with a
fixed seed): those are the references. Then each client loops over a random
mix of
  - whole answers (completions and chat), greedy or seeded, compared with
    their reference;
  - streams read to the end, compared likewise;
  - streams cancelled after a few events (the socket closed);
  - slow readers: a stream read a few bytes at a time with pauses, then
    compared;
  - bad requests: broken JSON, wrong types and ranges, unknown roles and
    routes, bodies declared over --max-body, unknown encodings, bodies that
    do not decode, headers sent too slowly to finish.
Every answer's status must be one SERVER.md documents for it: 200 for a
good request (503 with Retry-After when the queue is full), and 400, 404,
413 or 415 for the bad ones (or the connection closed, for a request too
slow to finish). Every 15 s the server's resident set and KV page counts
are sampled. At the end the clients stop, the KV pages in use must come
back to zero, and a SIGTERM sent while two streams run must let both
finish whole and the process exit with status 0.

The summary (counts, mismatches, RSS over time, shutdown) is printed and
saved as JSON; the exit status is non-zero if any check failed.
"""

import argparse
import gzip
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port, get, metric, wait_up  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = open(os.path.join(HERE, "..", "crates", "snug-engine", "src", "calibration.txt")).read().split()

MAX_TOKENS = 24
MAX_BODY = 1 << 20


def prompts(n, rng):
    out = []
    for _ in range(n):
        at = rng.randrange(0, len(TEXT) - 80)
        out.append(" ".join(TEXT[at:at + rng.randrange(8, 60)]))
    return out


def body_for(kind, prompt, seed, stream):
    b = {"max_tokens": MAX_TOKENS, "stream": stream}
    if seed is None:
        b["temperature"] = 0
    else:
        b.update(temperature=0.8, top_k=40, top_p=0.95, seed=seed)
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    return b


def route(kind):
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def text_of(kind, answer):
    c = answer["choices"][0]
    return c["message"]["content"] if kind == "chat" else c["text"]


def events_text(kind, raw):
    """The text of a server-sent event stream, and whether it ended with
    [DONE]."""
    out, done = [], False
    for line in raw.split("\n"):
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        for c in ev.get("choices", []):
            if kind == "chat":
                out.append(c.get("delta", {}).get("content") or "")
            else:
                out.append(c.get("text") or "")
    return "".join(out), done


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []

    def count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, what):
        with self.lock:
            if len(self.failures) < 200:
                self.failures.append(what)
            self.counts["failures"] = self.counts.get("failures", 0) + 1


def request(port, method, path, body=b"", headers=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def whole(port, kind, prompt, seed, stats, refs):
    status, headers, data = request(port, "POST", route(kind), json.dumps(body_for(kind, prompt, seed, False)))
    if status == 503 and "Retry-After" in headers:
        stats.count("busy_503")
        return
    if status != 200:
        stats.fail(f"whole {kind}: status {status}: {data[:200]!r}")
        return
    got = text_of(kind, json.loads(data))
    if got != refs[(kind, prompt, seed)]:
        stats.fail(f"whole {kind} seed={seed}: {got!r} != alone {refs[(kind, prompt, seed)]!r}")
    else:
        stats.count("whole_equal")


def open_stream(port, kind, prompt, seed, rcvbuf=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(120)
    s.connect(("127.0.0.1", port))
    body = json.dumps(body_for(kind, prompt, seed, True)).encode()
    s.sendall(
        f"POST {route(kind)} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
    )
    return s


def read_all(s, chunk=65536, pause=0.0):
    parts = []
    while True:
        b = s.recv(chunk)
        if not b:
            break
        parts.append(b)
        if pause:
            time.sleep(pause)
    s.close()
    return b"".join(parts)


def split_http(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = [], body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line.split(b";")[0] or b"0", 16)
            if n == 0:
                break
            out.append(rest[:n])
            rest = rest[n + 2:]
        body = b"".join(out)
    return status, headers, body.decode("utf-8", "replace")


def streamed(port, kind, prompt, seed, stats, refs, slow=False):
    s = open_stream(port, kind, prompt, seed, rcvbuf=4096 if slow else None)
    raw = read_all(s, chunk=64 if slow else 65536, pause=0.02 if slow else 0.0)
    status, headers, body = split_http(raw)
    name = "slow" if slow else "stream"
    if status == 503 and "retry-after" in headers:
        stats.count("busy_503")
        return
    if status != 200:
        stats.fail(f"{name} {kind}: status {status}: {body[:200]!r}")
        return
    got, done = events_text(kind, body)
    if not done:
        stats.fail(f"{name} {kind}: no [DONE]")
    elif got != refs[(kind, prompt, seed)]:
        stats.fail(f"{name} {kind} seed={seed}: {got!r} != alone {refs[(kind, prompt, seed)]!r}")
    else:
        stats.count(f"{name}_equal")


def cancelled(port, kind, prompt, seed, stats, rng):
    s = open_stream(port, kind, prompt, seed)
    want = rng.randrange(1, 6)
    got = b""
    try:
        while got.count(b"data: ") < want:
            b = s.recv(4096)
            if not b:
                break
            got += b
    finally:
        s.close()
    stats.count("cancelled")


BAD = [
    ("POST", "/v1/completions", b"{not json", {}, {400}),
    ("POST", "/v1/completions", b"", {}, {400}),
    ("POST", "/v1/completions", json.dumps({"prompt": 5}).encode(), {}, {400}),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "temperature": 9}).encode(), {}, {400}),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": -1}).encode(), {}, {400}),
    ("POST", "/v1/completions", json.dumps({"prompt": [99999999]}).encode(), {}, {400}),
    ("POST", "/v1/chat/completions", json.dumps({"messages": []}).encode(), {}, {400}),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), {}, {400}),
    ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), {}, {400}),
    ("POST", "/v1/nothing", b"{}", {}, {404}),
    ("GET", "/v2/models", b"", {}, {404}),
    ("POST", "/v1/completions", b"{}", {"Content-Encoding": "br"}, {415}),
    ("POST", "/v1/completions", b"\x1f\x8b\x08garbage", {"Content-Encoding": "gzip"}, {400}),
    ("POST", "/v1/completions", b"x" * (MAX_BODY + 10), {}, {413}),
    ("POST", "/v1/completions", gzip.compress(b" " * (MAX_BODY + 10)), {"Content-Encoding": "gzip"}, {413}),
]


def bad(port, stats, rng):
    i = rng.randrange(len(BAD) + 2)
    if i == len(BAD):
        # Headers that never finish: the read timeout closes the connection.
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.time()
        try:
            while True:
                s.sendall(b"X-Slow: 1\r\n")
                s.settimeout(1)
                try:
                    if s.recv(1024) == b"":
                        break
                    break  # an answer (408/400) before the close is fine too
                except socket.timeout:
                    pass
                if time.time() - t0 > 60:
                    stats.fail("slow headers: still open after 60 s")
                    break
        except OSError:
            pass
        s.close()
        stats.count("bad_slow_headers")
        return
    if i == len(BAD) + 1:
        # A Content-Length over the limit, and no body: refused at once.
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY * 4}\r\n\r\n".encode())
        status, _, _ = split_http(read_all(s))
        if status != 413:
            stats.fail(f"declared too large: status {status}")
        stats.count("bad_declared_413")
        return
    method, path, body, headers, want = BAD[i]
    try:
        status, _, data = request(port, method, path, body, headers)
    except (ConnectionError, http.client.HTTPException) as e:
        # A 413 may close the connection before the whole body is sent.
        if 413 in want:
            stats.count("bad_413_closed")
            return
        stats.fail(f"bad {i}: {e}")
        return
    if status not in want:
        stats.fail(f"bad {i} ({path}): status {status}, wanted {sorted(want)}: {data[:200]!r}")
        return
    try:
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str)
    except Exception:
        stats.fail(f"bad {i}: not an OpenAI error object: {data[:200]!r}")
        return
    stats.count(f"bad_{status}")


def client(port, stop_at, rng, work, stats, refs):
    while time.time() < stop_at:
        kind, prompt, seed = rng.choice(work)
        r = rng.random()
        try:
            if r < 0.35:
                whole(port, kind, prompt, seed, stats, refs)
            elif r < 0.55:
                streamed(port, kind, prompt, seed, stats, refs)
            elif r < 0.65:
                streamed(port, kind, prompt, seed, stats, refs, slow=True)
            elif r < 0.8:
                cancelled(port, kind, prompt, seed, stats, rng)
            else:
                bad(port, stats, rng)
        except Exception as e:  # a failure of the server shows up here
            stats.fail(f"{type(e).__name__}: {e}")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(HERE, "..", "target", "release", "snug"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("--extra", default="", help="more flags for snug serve")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    port = free_port()
    cmd = [a.binary, "serve", a.model, "--port", str(port), "--threads", "2", "--parallel", "4",
           "--max-queue", "16", "--read-timeout", "5", "--max-body", str(MAX_BODY),
           "--shutdown-timeout", "60"] + a.extra.split()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = []
    threading.Thread(target=lambda: log.extend(p.stderr), daemon=True).start()
    wait_up(p, port)

    # References: every (kind, prompt, seed) answered alone.
    texts = prompts(a.prompts, rng)
    work = [(k, t, s) for t in texts for k in ("completion", "chat") for s in (None, 7)]
    refs = {}
    for kind, prompt, seed in work:
        status, _, data = request(port, "POST", route(kind), json.dumps(body_for(kind, prompt, seed, False)))
        assert status == 200, (status, data)
        refs[(kind, prompt, seed)] = text_of(kind, json.loads(data))
    t0 = time.time()
    stop_at = t0 + a.minutes * 60
    stats = Stats()
    samples = []
    threads = [
        threading.Thread(target=client, args=(port, stop_at, random.Random(a.seed * 1000 + i), work, stats, refs))
        for i in range(a.clients)
    ]
    for t in threads:
        t.start()
    while time.time() < stop_at:
        m = get(port, "/metrics")
        samples.append({
            "t": round(time.time() - t0, 1),
            "rss_mib": round(rss_kib(p.pid) / 1024, 1),
            "kv_used": metric(m, 'snug_kv_pages{state="used"}'),
            "kv_cached": metric(m, 'snug_kv_pages{state="cached"}'),
            "running": metric(m, "snug_requests_running"),
        })
        time.sleep(min(15, max(0.1, stop_at - time.time())))
    for t in threads:
        t.join()

    # Afterwards: no page held by a request.
    deadline = time.time() + 30
    while True:
        m = get(port, "/metrics")
        used = metric(m, 'snug_kv_pages{state="used"}')
        reserved = metric(m, 'snug_kv_pages{state="reserved"}')
        running = metric(m, "snug_requests_running")
        if (used, reserved, running) == (0, 0, 0) or time.time() > deadline:
            break
        time.sleep(0.2)
    leak_ok = (used, reserved, running) == (0, 0, 0)
    if not leak_ok:
        stats.fail(f"after the load: kv used {used}, reserved {reserved}, running {running}")
    finished = metric(m, "snug_requests_finished_total")

    # RSS: the second half of the run against the first (after warm-up).
    rss = [s["rss_mib"] for s in samples]
    quarter = max(1, len(rss) // 4)
    early = max(rss[quarter:len(rss) // 2 + 1] or rss)
    late = max(rss[len(rss) // 2:] or rss)
    rss_growth = (late - early) / early if early else 0.0
    if rss_growth > 0.05:
        stats.fail(f"RSS grew {rss_growth:.1%} from the first half to the second ({early} -> {late} MiB)")

    # SIGTERM while two streams run: both finish whole, exit status 0.
    kind, prompt, seed = work[0]
    socks = [open_stream(port, kind, prompt, seed) for _ in range(2)]
    time.sleep(0.3)
    t_sig = time.time()
    p.send_signal(signal.SIGTERM)
    shutdown_ok = True
    for s in socks:
        status, _, body = split_http(read_all(s))
        got, done = events_text(kind, body) if status == 200 else ("", False)
        if status != 200 or not done or got != refs[(kind, prompt, seed)]:
            shutdown_ok = False
            stats.fail(f"a stream running at SIGTERM: status {status}, done {done}, {got!r}")
    try:
        rc = p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = None
    exit_s = round(time.time() - t_sig, 2)
    if rc != 0:
        shutdown_ok = False
        stats.fail(f"exit status after SIGTERM: {rc}")

    summary = {
        "command": " ".join(cmd),
        "clients": a.clients,
        "minutes": a.minutes,
        "counts": dict(sorted(stats.counts.items())),
        "requests_finished_total": finished,
        "kv_pages_back_to_zero": leak_ok,
        "rss_mib_first": rss[0] if rss else None,
        "rss_mib_first_half_max": early,
        "rss_mib_second_half_max": late,
        "rss_growth": round(rss_growth, 4),
        "sigterm_streams_whole": shutdown_ok,
        "exit_status": rc,
        "exit_seconds_after_sigterm": exit_s,
        "failures": stats.failures,
        "samples": samples,
    }
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    sys.exit(1 if stats.counts.get("failures") else 0)


if __name__ == "__main__":
    main()
