#!/usr/bin/env python3
"""How often greedy runs agree with the shared llama.cpp fixture, for snug
and for llama.cpp itself under other settings of its own.

    bench/greedy.py LLAMA_BIN_DIR OUT.json [--models a,b] [--snug target/release/snug]
                    [--fixture-settings-only]
                    [--build LABEL=DIR ...]

The fixture (../shared/fixtures/greedy/llama.cpp.json) holds 32 greedy
tokens per prompt from `llama-server` (2 threads, f16 KV, flash attention
at its default). Each llama.cpp variant here starts `llama-server` on
loopback with those settings changed in one way (flash attention off, one
thread, weight repacking off) and
asks the same raw prompts for 32 greedy tokens (`--build` adds another
build of llama.cpp, such as one for another instruction set, run with the
fixture's settings); snug answers through
`snug run -p PROMPT -n 32 --json`, once with its own numerics and once
with `--numerics llama.cpp`. For every pair of runs the script counts
the prompts whose 32 tokens are identical, and where they part, the
fixture's top-2 log-probability margin at that step. A variant that
changes only the order of floating-point work tells how much of the
fixture's exact text is a property of one build's arithmetic rather than
of the model.
"""

import argparse
import json
import os
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servelib import free_port, wait_up  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "shared", "fixtures", "greedy", "llama.cpp.json")

# name -> extra llama-server flags; the first is the fixture's own settings.
VARIANTS = {
    "llama.cpp as the fixture": ["-t", "2"],
    "llama.cpp -fa off": ["-t", "2", "-fa", "off"],
    "llama.cpp -t 1": ["-t", "1"],
    "llama.cpp --no-repack": ["-t", "2", "--no-repack"],
}


def model_path(snug, alias):
    out = subprocess.run([snug, "pull", alias], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def llama_runs(server, path, flags, cases):
    port = free_port()
    cmd = [server, "-m", path, "--port", str(port), "-c", "4096", "-np", "1",
           "--no-webui", "--temp", "0"] + flags
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(p, port)
        runs = []
        for case in cases:
            body = json.dumps({"prompt": case["prompt"], "n_predict": 32, "temperature": 0,
                               "top_k": 1, "cache_prompt": False, "return_tokens": True,
                               "samplers": ["top_k"]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                runs.append(json.load(r)["tokens"])
        return runs
    finally:
        p.terminate()
        p.wait()


def snug_runs(snug, alias, cases, extra=()):
    runs = []
    for case in cases:
        out = subprocess.run([snug, "run", alias, "-p", case["prompt"], "-n", "32", "-t", "2",
                              "--json", *extra], check=True, capture_output=True, text=True)
        runs.append(json.loads(out.stdout)["token_ids"])
    return runs


def margin(step):
    top = step["top"]
    return top[0]["logprob"] - top[1]["logprob"]


def compare(a, b, cases):
    """Identical runs of `a` and `b`, and the fixture's margin where each
    other pair first parts."""
    same, parts = 0, []
    for ra, rb, case in zip(a, b, cases):
        n = min(len(ra), len(rb), 32)
        first = next((i for i in range(n) if ra[i] != rb[i]), None)
        if first is None and len(ra) == len(rb):
            same += 1
        elif first is not None:
            # Where both runs still followed the fixture, its margin there.
            fx = case["ids"]
            if ra[:first] == fx[:first]:
                parts.append(round(margin(case["steps"][first]), 3))
            else:
                parts.append(None)
    return same, parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_bin")
    ap.add_argument("out")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--snug", default=os.path.join(HERE, "..", "target", "release", "snug"))
    ap.add_argument("--fixture-settings-only", action="store_true",
                    help="run llama.cpp with the fixture's settings only, not the variants")
    ap.add_argument("--build", action="append", default=[],
                    help="LABEL=DIR: another llama.cpp build, run with the fixture's settings")
    args = ap.parse_args()
    fixture = json.load(open(FIXTURE))["models"]
    server = os.path.join(args.llama_bin, "llama-server")
    report = {}
    print("| model | run | identical to the fixture (of 8) | fixture's top-2 margin where it parts | identical to snug |")
    print("| --- | --- | ---: | --- | ---: |")
    for alias in args.models.split(","):
        cases = fixture[alias]["cases"]
        path = model_path(args.snug, alias)
        runs = {"snug": snug_runs(args.snug, alias, cases),
                "snug --numerics llama.cpp": snug_runs(args.snug, alias, cases, ["--numerics", "llama.cpp"])}
        for name, flags in VARIANTS.items():
            if args.fixture_settings_only and name != "llama.cpp as the fixture":
                continue
            runs[name] = llama_runs(server, path, flags, cases)
        for b in args.build:
            label, folder = b.split("=", 1)
            runs[label] = llama_runs(os.path.join(folder, "llama-server"), path, VARIANTS["llama.cpp as the fixture"], cases)
        fx = [c["ids"] for c in cases]
        report[alias] = {}
        for name, r in runs.items():
            same, parts = compare(r, fx, cases)
            with_snug, _ = compare(r, runs["snug"], cases)
            report[alias][name] = {"tokens": r, "identical_to_fixture": same, "margins": parts,
                                   "identical_to_snug": with_snug}
            shown = ", ".join("—" if m is None else f"{m:.3f}" for m in parts) or "—"
            print(f"| {alias} | {name} | {same} | {shown} | {with_snug} |", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
