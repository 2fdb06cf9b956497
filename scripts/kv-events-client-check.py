"""Subscribes to `snug serve --kv-events` the way a router reads vLLM's KV
events (pyzmq + msgpack, from vLLM's documented format: ZMQ frames
(topic, 8-byte big-endian sequence, payload); payload
[ts, [event, ...], data_parallel_rank]; BlockStored / BlockRemoved /
AllBlocksCleared), drives the server with the openai client, and checks:

- every BlockStored's hashes are the SHA-256 chain of its tokens (the
  hash a replica gives a prefix is computable from the tokens alone, so
  replicas agree);
- the first request's full pages are stored, in order, from the root;
- a request sharing the prefix stores only its new pages;
- pages evicted under a small KV budget are reported removed, and only
  pages stored before;
- the replay socket returns the missed batches, then the end marker.

Usage: kv-events-client-check.py BASE_URL PUB_ENDPOINT REPLAY_ENDPOINT TOPIC
Prints one JSON line of what it saw; exits non-zero on a failed check.
"""

import hashlib
import json
import struct
import sys
import time

import msgpack
import openai
import zmq

base, pub, replay_ep, topic = sys.argv[1:5]
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(pub)
sub.setsockopt_string(zmq.SUBSCRIBE, topic)
time.sleep(0.5)  # a SUB socket joins late: let the subscription arrive

client = openai.OpenAI(base_url=base, api_key="none")

ROOT = bytes(32)
keys = {}  # block hash -> the full 32-byte key it came from
stored = []  # (hash, tokens) in the order they were stored
removed = []
cleared = 0
seqs = []
first_payload = None


def chain(parent, tokens):
    h = hashlib.sha256(parent)
    for t in tokens:
        h.update(struct.pack("<I", t))
    return h.digest()


def field(ev, name, pos):
    """A field of an event, in the map form or the positional one."""
    if isinstance(ev, dict):
        return ev.get(name)
    return ev[pos] if pos < len(ev) else None


def handle(payload):
    global cleared
    ts, events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(ts, float) and rank == 0, (ts, rank)
    for ev in events:
        kind = ev["type"] if isinstance(ev, dict) else ev[0]
        if kind == "BlockStored":
            hashes = field(ev, "block_hashes", 1)
            parent = field(ev, "parent_block_hash", 2)
            tokens = field(ev, "token_ids", 3)
            size = field(ev, "block_size", 4)
            assert field(ev, "medium", 6) in ("CPU", "GPU")
            assert len(tokens) == size * len(hashes), (len(tokens), size, hashes)
            key = ROOT if parent is None else keys[parent]
            for i, h in enumerate(hashes):
                page = tokens[i * size : (i + 1) * size]
                key = chain(key, page)
                assert int.from_bytes(key[:8], "big") == h, "a block hash is not the chain of its tokens"
                keys[h] = key
                stored.append((h, page))
        elif kind == "BlockRemoved":
            for h in field(ev, "block_hashes", 1):
                assert h in keys, "removed a block never stored"
                removed.append(h)
        elif kind == "AllBlocksCleared":
            cleared += 1
        else:
            raise AssertionError(f"unknown event {kind}")


def drain(wait=1.0):
    global first_payload
    deadline = time.time() + wait
    while time.time() < deadline:
        if sub.poll(100):
            t, seq, payload = sub.recv_multipart()
            assert t == topic.encode()
            seqs.append(int.from_bytes(seq, "big"))
            if first_payload is None:
                first_payload = payload
            handle(payload)
            deadline = time.time() + wait


def tokens_of(text):
    import urllib.request

    req = urllib.request.Request(
        base.removesuffix("/v1") + "/tokenize",
        data=json.dumps({"content": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def prompt(n):
    return " ".join(words[(i * 7 + n) % len(words)] + str(i % 10) for i in range(60))


# 1. A first request: its full pages are stored from the root, in order.
p0 = prompt(0)
client.completions.create(model="m", prompt=p0, max_tokens=4, temperature=0)
drain()
ids = tokens_of(p0)
size = len(stored[0][1])
first = [t for _, page in stored for t in page]
assert first[: (len(ids) // size) * size] == ids[: (len(ids) // size) * size], "stored tokens are the prompt's"
after_first = len(stored)

# 2. The same prompt again with more after it: only the new pages.
client.completions.create(model="m", prompt=p0 + " and then some more words follow here", max_tokens=4, temperature=0)
drain()
again = stored[after_first:]
assert all(h not in [x for x, _ in stored[:after_first]] for h, _ in again), "a cached page was stored twice"

# 3. Other prompts until the budget evicts: removals name stored pages.
for n in range(1, 8):
    client.completions.create(model="m", prompt=prompt(n), max_tokens=4, temperature=0)
drain()
assert removed, "no page was evicted under the small budget"

# 4. Replay from the start: every batch back, then the end marker.
req = ctx.socket(zmq.DEALER)
req.connect(replay_ep)
req.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while req.poll(2000):
    _, seq, payload = req.recv_multipart()
    s = int.from_bytes(seq, "big", signed=True)
    if s == -1:
        assert payload == b""
        break
    replayed.append(s)
    if s == 0:
        assert payload == first_payload, "the replayed batch differs"
assert replayed == seqs, (replayed, seqs)
assert seqs == list(range(len(seqs))), "sequence numbers run from 0 without gaps"

print(
    json.dumps(
        {
            "ok": True,
            "batches": len(seqs),
            "stored": len(stored),
            "first_request_pages": after_first,
            "prompt_tokens": len(ids),
            "block_size": size,
            "removed": len(removed),
            "cleared": cleared,
            "replayed": len(replayed),
        }
    )
)
