"""The official openai client against a router (vllm-router, kv_aware)
in front of snug replicas that publish KV events.

For each replica, a conversation with its own long system prompt is sent
to that replica directly (so only it caches the prefix); then a follow-up
of each conversation goes through the router. Checks:

- every follow-up is answered, and by the replica that holds its prefix
  (the router read that from the replicas' KV events): every replica
  answers through the router;
- each answer through the router is the answer another replica gives
  the same request directly (routing never changes output).

Usage: router-client-check.py ROUTER_BASE_URL REPLICA_URL...
Prints one JSON line; exits non-zero on a failed check.
"""

import json
import sys
import time
import urllib.request

import openai

router = sys.argv[1]
replicas = sys.argv[2:]


def served(url):
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
    )


def system(i):
    topic = ["tea", "bicycles", "gardening", "astronomy", "bread", "running"][i % 6]
    return (f"You are a help desk about {topic}. Answer in one short sentence, plainly and without lists. " * 6
            + f"Desk {i}.")


def ask(client, messages):
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    return r.choices[0].message.content


via_router = openai.OpenAI(base_url=router, api_key="none", max_retries=0)
direct = [openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0) for u in replicas]

# Warm: each replica alone computes its desk's prefix.
for i, c in enumerate(direct):
    ask(c, [{"role": "system", "content": system(i)}, {"role": "user", "content": "Hello?"}])
time.sleep(1.0)  # the events reach the router

routed_to = []
for i in range(len(replicas)):
    before = [served(u) for u in replicas]
    messages = [{"role": "system", "content": system(i)}, {"role": "user", "content": "What should I try first?"}]
    answer = ask(via_router, messages)
    after = [served(u) for u in replicas]
    delta = [a - b for a, b in zip(after, before)]
    assert sum(delta) == 1, delta
    routed_to.append(delta.index(1))
    other = direct[(i + 1) % len(direct)]
    assert answer == ask(other, messages), "the routed answer differs from another replica's"

assert routed_to == list(range(len(replicas))), f"requests went to {routed_to}, not to the replicas holding their prefixes"
print(json.dumps({"ok": True, "routed_to": routed_to}))
