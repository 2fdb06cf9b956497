"""Helpers the server benchmarks share: a free port, GETs, waiting for a
server's /health, reading one Prometheus metric."""

import json
import socket
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(port, path, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read().decode()


def wait_up(p, port, seconds=180):
    """Waits until the server answers /health with status ok; exits if
    the process dies or the time runs out."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if p.poll() is not None:
            err = p.stderr.read()[-3000:] if p.stderr else ""
            raise SystemExit(f"server exited: {err}")
        try:
            if json.loads(get(port, "/health", timeout=1)).get("status") == "ok":
                return
        except Exception:
            time.sleep(0.2)
    p.kill()
    raise SystemExit("server did not start")


def metric(text, name):
    """The sum of the samples whose line starts with `name`, or None."""
    total = None
    for line in text.splitlines():
        if line.startswith(name):
            total = (total or 0) + float(line.rsplit(" ", 1)[1])
    return total
