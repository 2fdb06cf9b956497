#!/usr/bin/env python3
"""Sessions: restoring saved KV against prefilling the same tokens, and a
chat's third turn with and without KV reuse.

Restore: the first 2,048 tokens of the GPL-3 text as Debian ships it (text
no one here wrote). Each round, in one process `snug run -p TEXT -n 1
--session F` prefills them and saves; then a new process `snug run
--session F -n 1` restores them. Reported: the prefill's time
(prefill_tokens / prefill_tok_s), the restore's (opening and checking the
file, the model's identity, reading the pages: `session.restore_ms`), their
ratio, and both processes' time to first token. Medians over ROUNDS.

Chat: three user turns about a document (~1,000 tokens of the Apache
License 2.0, in the first turn), greedy, 32 tokens a reply. The third
turn's time to first token (from `--metrics-file`): (a) one `snug chat`
process reusing its KV between turns, (b) turns 1-2 in one process with
`--session`, turn 3 in a new process that resumes the session (its restore time added), (c) one
process with `--no-cache-reuse` (the whole conversation prefilled every
turn).

Prefix cache across a restart: a prompt with the same document and
another question, its time to first token cold (`--no-prefix-cache`) and
in a new process after one run of the first question filled a
`--prefix-cache-dir` (the disk tier).

Usage: bench/session.py SNUG OUT ROUNDS MODEL... [--kv f16,tq4]
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def run(cmd, stdin=None):
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd[:6])} ...\n{p.stderr}")
    return p


def first_tokens_text(snug, model, text, n):
    """The text of the model's first `n` tokens of `text`."""
    p = run([snug, "tokenize", model, "-", "--json", "--no-bos"], stdin=text)
    pieces = json.loads(p.stdout)["pieces"]
    return "".join(pieces[:n])


def restore_round(snug, model, text, kv, path):
    if os.path.exists(path):
        os.remove(path)
    common = ["-t", "2", "--kv", kv, "--speculate", "off", "--json", "--ctx", "4096"]
    a = json.loads(run([snug, "run", model, "-p", text, "-n", "1", "--session", path] + common).stdout)
    b = json.loads(run([snug, "run", model, "-n", "1", "--session", path, "-t", "2", "--speculate", "off", "--json"]).stdout)
    s = a["stats"]
    prefill_ms = s["prefill_tokens"] / s["prefill_tok_s"] * 1e3
    return {
        "tokens": s["prefill_tokens"],
        "prefill_ms": prefill_ms,
        "restore_ms": b["session"]["restore_ms"],
        "ttft_prefill_ms": s["ttft_ms"],
        "ttft_restore_ms": b["stats"]["ttft_ms"],
        "file_bytes": os.path.getsize(path),
    }


def chat(snug, model, turns, extra, metrics):
    if os.path.exists(metrics):
        os.remove(metrics)
    p = run(
        [snug, "chat", model, "-n", "32", "-t", "2", "--speculate", "off", "--metrics-file", metrics] + extra,
        stdin="".join(t + "\n" for t in turns),
    )
    lines = [json.loads(l) for l in open(metrics)]
    # A resumed session's restore happens before its first turn: count it.
    m = re.search(r"tokens restored in ([0-9.]+) ms", p.stderr)
    if m:
        lines[0]["ttft_ms"] += float(m.group(1))
    return lines


def main():
    args = sys.argv[1:]
    kvs = ["f16"]
    if "--kv" in args:
        i = args.index("--kv")
        kvs = args[i + 1].split(",")
        del args[i : i + 2]
    snug, out, rounds, models = args[0], args[1], int(args[2]), args[3:]
    os.makedirs(out, exist_ok=True)
    gpl = open("/usr/share/common-licenses/GPL-3").read()
    apache = " ".join(open("/usr/share/common-licenses/Apache-2.0").read().split())
    doc = apache[: apache.index("3. Grant of Patent License.")]
    turns = [
        f"Here is a license text: {doc} Summarize it in one sentence.",
        "Name one condition it sets.",
        "And one right it grants?",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            text = first_tokens_text(snug, model, gpl, 2048)
            for kv in kvs:
                rows = [restore_round(snug, model, text, kv, os.path.join(tmp, "s.snug")) for _ in range(rounds)]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                ratios = [r["prefill_ms"] / r["restore_ms"] for r in rows]
                results[f"{model} {kv} restore"] = {"rounds": rows, "median": med}
                print(
                    f"| {model} | {kv} | {med['tokens']:.0f} | {med['prefill_ms']:.0f} | {med['restore_ms']:.1f} "
                    f"| {statistics.median(ratios):.0f}x ({min(ratios):.0f}-{max(ratios):.0f}) "
                    f"| {med['ttft_prefill_ms']:.0f} | {med['ttft_restore_ms']:.0f} | {med['file_bytes'] / 2**20:.1f} MiB |",
                    flush=True,
                )
            third = {"reuse": [], "resumed": [], "none": []}
            for _ in range(rounds):
                m = os.path.join(tmp, "m.jsonl")
                third["reuse"].append(chat(snug, model, turns, [], m)[2])
                third["none"].append(chat(snug, model, turns, ["--no-cache-reuse"], m)[2])
                sess = os.path.join(tmp, "c.snug")
                if os.path.exists(sess):
                    os.remove(sess)
                chat(snug, model, turns[:2], ["--session", sess], m)
                third["resumed"].append(chat(snug, model, turns[2:], ["--session", sess], m)[0])
            med = {k: statistics.median(r["ttft_ms"] for r in v) for k, v in third.items()}
            reused = {k: v[0]["reused_tokens"] for k, v in third.items()}
            prompt = third["none"][0]["prompt_tokens"]
            results[f"{model} chat"] = third
            print(
                f"| {model} | {prompt} | {med['none']:.0f} | {med['reuse']:.0f} ({reused['reuse']} reused) "
                f"| {med['resumed']:.0f} ({reused['resumed']} reused) | {med['none'] / med['reuse']:.1f}x |",
                flush=True,
            )
            # Prefix cache across a restart: the same document, another question.
            pa, pb = turns[0], turns[0].replace("Summarize it in one sentence.", "Name one condition it sets.")
            cold, warm = [], []
            for _ in range(rounds):
                d = os.path.join(tmp, "kv")
                subprocess.run(["rm", "-rf", d], check=True)
                base = [snug, "run", model, "-n", "1", "-t", "2", "--speculate", "off", "--json"]
                cold.append(json.loads(run(base + ["-p", pb, "--no-prefix-cache"]).stdout))
                run(base + ["-p", pa, "--prefix-cache-dir", d])
                warm.append(json.loads(run(base + ["-p", pb, "--prefix-cache-dir", d]).stdout))
            mc = statistics.median(r["stats"]["ttft_ms"] for r in cold)
            mw = statistics.median(r["stats"]["ttft_ms"] for r in warm)
            results[f"{model} prefix"] = {"cold": cold, "warm": warm}
            print(
                f"| {model} | {cold[0]['prompt_tokens']} | {mc:.0f} | {mw:.0f} "
                f"({warm[0]['stats']['prefix_cache']['reused_tokens']} reused from disk) | {mc / mw:.1f}x |",
                flush=True,
            )
    json.dump(results, open(os.path.join(out, "session.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
