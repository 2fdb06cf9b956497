"""What constrained decoding costs: `snug run` with and without a JSON
schema, interleaved, several rounds, the same prompt and token count.
Prints per model and schema the median decode tok/s constrained and free,
their ratio (noisy: the two runs write different text), the grammar's
share of the constrained run's decode time as measured inside it (time in
the grammar engine over the decode time), and the first-run cost of
building the vocabulary's trie and compiling the grammar (wall time of a
one-token run, constrained minus free).

    python3 bench/grammar.py [--bin target/release/snug] [--rounds 5]
        [--models smollm2-135m ...] [--speculate off] [--temperature 0]
        [--out FILE.json]
"""

import argparse
import json
import statistics
import subprocess
import time

SCHEMAS = {
    # Mostly free text inside strings.
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "hobbies"],
    },
    # Mostly structure: every few tokens a choice among keys, enums, numbers.
    "rows": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "ok": {"type": "boolean"},
                        "tag": {"enum": ["red", "green", "blue"]},
                    },
                    "required": ["id", "ok", "tag"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["rows"],
    },
}

PROMPT = {
    "person": "Describe a fictional person as JSON with name, age and hobbies.",
    "rows": "List many rows of data as JSON, each with id, ok and tag.",
}


def run(bin_, model, prompt, n, speculate, schema, temp=0.0):
    cmd = [bin_, "run", model, "--chat", "-p", prompt, "-n", str(n), "-t", "2", "--speculate", speculate, "--json"]
    cmd += ["--temperature", str(temp), "--seed", "1"]
    if schema is not None:
        cmd += ["--json-schema", json.dumps(schema)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    d = json.loads(out)
    st = d["stats"]
    return st["decode_tok_s"], st["decode_tokens"], wall, st.get("grammar_ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/snug")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--speculate", default="off")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--out")
    a = ap.parse_args()
    results = []
    for model in a.models:
        for name, schema in SCHEMAS.items():
            free, shaped, free_n, shaped_n, share = [], [], [], [], []
            for r in range(a.rounds):
                order = [None, schema] if r % 2 == 0 else [schema, None]
                for s in order:
                    tps, n, _, g_ms = run(a.bin, model, PROMPT[name], a.tokens, a.speculate, s, a.temperature)
                    (free if s is None else shaped).append(tps)
                    (free_n if s is None else shaped_n).append(n)
                    if s is not None and n > 1:
                        # The grammar's share of the decode time, measured
                        # inside the same run (the first token's mask
                        # included: an overestimate).
                        share.append(g_ms / (1e3 * (n - 1) / tps))
            setup = []
            for _ in range(3):
                w_free = run(a.bin, model, PROMPT[name], 1, "off", None)[2]
                w_shaped = run(a.bin, model, PROMPT[name], 1, "off", schema)[2]
                setup.append((w_shaped - w_free) * 1e3)
            row = {
                "model": model,
                "schema": name,
                "speculate": a.speculate,
                "temperature": a.temperature,
                "free_tok_s": statistics.median(free),
                "constrained_tok_s": statistics.median(shaped),
                "ratio": statistics.median(s / f for s, f in zip(shaped, free)),
                "free_tokens": statistics.median(free_n),
                "constrained_tokens": statistics.median(shaped_n),
                "setup_ms": statistics.median(setup),
                "grammar_share": statistics.median(share),
                "rounds": a.rounds,
            }
            results.append(row)
            print(
                f"{model:22} {name:7} spec {a.speculate:4} temp {a.temperature} free {row['free_tok_s']:7.1f} tok/s "
                f"({row['free_tokens']:.0f} tok)  constrained {row['constrained_tok_s']:7.1f} tok/s "
                f"({row['constrained_tokens']:.0f} tok)  ratio {row['ratio']:.3f}  grammar share {row['grammar_share']:.3f}  "
                f"setup {row['setup_ms']:.0f} ms",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
