#!/usr/bin/env python3
"""Speculative decoding ON vs OFF, beside llama.cpp's prompt-lookup decoding.

Four workloads built from text on the machine that no one here wrote:
verbatim copy (a paragraph of the Apache License 2.0 as Debian ships it),
code edit (a function of Python's own `textwrap` module), extraction (the
first services of /etc/services) and free chat. Each prompt is a ChatML
user turn (the format of both SmolLM2 and Qwen2.5), passed as the same text
to every program. Greedy decoding, N tokens.

For each model and workload, in one run and interleaved: `snug run
--speculate off` and `--speculate on` (and `auto`), then llama.cpp's
`llama-completion` (plain) and `llama-lookup` (n-gram drafts of up to 8),
REPS times each; medians of decode tokens per second. snug's ON and OFF
texts are also compared (they must be identical).

Usage: bench/speculate.py --llama-bin DIR [--models a,b] [--reps 3] [-n 128]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import textwrap


def workloads():
    lic = open("/usr/share/common-licenses/Apache-2.0").read()
    start = lic.index("2. Grant of Copyright License.")
    para = " ".join(lic[start : lic.index("3. Grant of Patent License.")].split())
    # The source of textwrap.dedent, read from the file (this folder's
    # tokenize.py shadows the module `inspect` would need).
    src = open(textwrap.__file__).read()
    start = src.index("def dedent(")
    code = src[start : src.index("\ndef ", start + 1) + 1]
    services = [
        l.split("#")[0].strip()
        for l in open("/etc/services")
        if l.strip() and not l.startswith("#")
    ][:25]
    return [
        ("verbatim", f"Repeat the following text exactly, word for word:\n\n{para}"),
        (
            "code edit",
            "Rewrite this Python function, renaming the variable `margin` to "
            "`common_prefix`. Keep everything else exactly the same.\n\n```python\n"
            f"{code}```",
        ),
        (
            "extraction",
            "From this list, write each service name and its port number, one per "
            "line as `name: port`.\n\n" + "\n".join(services),
        ),
        ("chat", "What are some good habits for staying healthy while working from home?"),
    ]


def chatml(user):
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def snug_run(snug, model, prompt, n, mode, threads):
    out = subprocess.run(
        [snug, "run", model, "-p", prompt, "-n", str(n), "-t", str(threads),
         "--speculate", mode, "--json"],
        capture_output=True, text=True, check=True,
    )
    v = json.loads(out.stdout)
    return v["stats"]["decode_tok_s"], v["text"], v["stats"]["speculation"], len(v["token_ids"])


def llama_speed(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    err = out.stderr + out.stdout
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", err)
    if m:
        return float(m.group(3)), err
    m = re.search(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs.*?([\d.]+) tokens per second", err)
    if m:
        return float(m.group(2)), err
    raise RuntimeError("no speed in llama.cpp output:\n" + err[-2000:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--snug", default="target/release/snug")
    ap.add_argument("--llama-bin", default="")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--workloads", help="comma-separated subset of the workloads")
    ap.add_argument("--snug-only", action="store_true", help="skip llama.cpp")
    a = ap.parse_args()
    raw = []
    rows = []
    for alias in a.models.split(","):
        path = subprocess.run([a.snug, "pull", alias], capture_output=True, text=True,
                              check=True).stdout.strip().splitlines()[-1]
        for kind, user in workloads():
            if a.workloads and kind not in a.workloads.split(","):
                continue
            prompt = chatml(user)
            res = {"off": [], "on": [], "auto": [], "llama": [], "lookup": []}
            spec = {}
            texts = {}
            for _ in range(a.reps):
                for mode in ("off", "on", "auto"):
                    tps, text, s, ntok = snug_run(a.snug, path, prompt, a.n, mode, a.threads)
                    res[mode].append(tps)
                    texts.setdefault(mode, text)
                    spec[mode] = s
                if a.snug_only:
                    res["llama"].append(float("nan"))
                    res["lookup"].append(float("nan"))
                    continue
                base = [f"{a.llama_bin}/llama-completion", "-m", path, "-p", prompt, "-n", str(a.n),
                        "-t", str(a.threads), "--temp", "0", "-no-cnv", "--no-warmup"]
                res["llama"].append(llama_speed(base)[0])
                look = [f"{a.llama_bin}/llama-lookup", "-m", path, "-p", prompt, "-n", str(a.n),
                        "-t", str(a.threads), "--temp", "0", "--spec-draft-n-max", "8"]
                res["lookup"].append(llama_speed(look)[0])
            same = texts["off"] == texts["on"] == texts["auto"]
            med = {k: statistics.median(v) for k, v in res.items()}
            raw.append({"model": alias, "workload": kind, "runs": res, "speculation": spec,
                        "identical": same, "tokens": ntok})
            rows.append((alias, kind, med, spec["on"], same))
            print(f"{alias} {kind}: {med} identical={same}", file=sys.stderr)
    print("| model | workload | snug off t/s | snug on t/s | on/off | snug auto t/s | auto/off "
          "| accepted / drafted (on) | llama.cpp t/s | llama-lookup t/s | lookup/plain | ON == OFF |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for alias, kind, m, s, same in rows:
        print(f"| {alias} | {kind} | {m['off']:.1f} | {m['on']:.1f} | {m['on'] / m['off']:.2f}x "
              f"| {m['auto']:.1f} | {m['auto'] / m['off']:.2f}x | {s['accepted']} / {s['drafted']} "
              f"| {m['llama']:.1f} | {m['lookup']:.1f} | {m['lookup'] / m['llama']:.2f}x "
              f"| {'yes' if same else 'NO'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
