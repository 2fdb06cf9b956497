#!/usr/bin/env python3
"""llama.cpp's greedy reference on the synthesized models of
crates/snug-engine/tests/synthesized.rs.

    scripts/make_synth_fixtures.py LLAMA_BIN_DIR SYNTH_GGUF MODELS_DIR OUT.json

LLAMA_BIN_DIR holds llama-server (bench/build-llama-cpp.sh builds it);
SYNTH_GGUF is the `synth_gguf` example of snug-model; MODELS_DIR holds the
real GGUF files whose tokenizers the synthesized ones take (snug's model
cache). For every spec (the same as the test's), the file is written with
the same bytes the test writes, served by llama-server (2 threads, f16 KV,
flash attention at its default, as the shared fixtures), and asked for 16
greedy tokens after the test's stand-in prompt, given as token ids, with
the top-2 log-probabilities of every step.
"""

import json
import os
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from servelib import free_port, wait_up  # noqa: E402

# (name, arch, tokenizer file, dim, layers, heads, kv_heads, ff, head_dim, type, head type,
# more synth_gguf arguments): synthesized.rs's specs() (and its rope_freqs() and rope_linear()).
SPECS = [
    ("llama", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0", []),
    ("qwen2", "qwen2", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf", 256, 2, 4, 2, 512, 64, "q4_0", "q8_0", []),
    ("qwen3", "qwen3", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf", 256, 2, 8, 2, 768, 64, "q5_0", "q8_0", []),
    ("gemma3", "gemma3", "gemma-3-270m-q4_k_m.gguf", 256, 6, 4, 1, 512, 128, "q8_0", "q8_0", []),
    ("smollm3", "smollm3", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 4, 4, 2, 512, 64, "q8_0", "q8_0", []),
    ("granite", "granite", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0", []),
    ("llama3", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0",
     ["--rope-freqs", "1,1.5,3,8"]),
    ("llama-linear", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0",
     ["--rope-linear", "4"]),
    ("qwen3moe", "qwen3moe", "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf", 256, 2, 8, 2, 512, 64, "q8_0", "q8_0", []),
    ("mixtral", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0",
     ["--experts", "4,2,512"]),
    ("phi", "phi3", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, "q8_0", "q8_0", []),
] + [(f"llama-{ty}", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf", 256, 2, 4, 2, 512, 64, ty, "q8_0", [])
     for ty in ["q2_k", "q3_k", "q5_k", "iq4_nl", "iq4_xs", "mxfp4", "f16", "bf16"]]
STEPS = 16


def prompt(vocab):
    # synthesized.rs's prompt(): stand-in ids.
    return [((i * 7919 + 13) % (vocab - 1)) + 1 for i in range(40)]


def main():
    bins, synth, models, out = sys.argv[1:5]
    result = {"steps": STEPS, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, arch, like, dim, layers, heads, kvh, ff, hd, ty, head_ty, more in SPECS:
            path = os.path.join(tmp, f"{name}.gguf")
            made = subprocess.run([synth, "--like", os.path.join(models, like), "--arch", arch,
                                   "--shape", f"{name}={dim},{layers},{heads},{kvh},{ff},{hd}",
                                   "--type", ty, "--head-type", head_ty, "--window", "8", "--scale", "0.02",
                                   "--name", f"synthetic {name}", "--out", path] + more,
                                  check=True, capture_output=True, text=True)
            ids = prompt(int(made.stderr.rsplit("vocabulary", 1)[1].split()[0]))
            port = free_port()
            p = subprocess.Popen([os.path.join(bins, "llama-server"), "-m", path, "--port", str(port),
                                  "-c", "256", "-np", "1", "-t", "2", "--no-webui", "--temp", "0",
                                  "--no-repack"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                wait_up(p, port)
                body = json.dumps({"prompt": ids, "n_predict": STEPS, "temperature": 0, "top_k": 1,
                                   "cache_prompt": False, "return_tokens": True, "n_probs": 2,
                                   "samplers": ["top_k"], "post_sampling_probs": False}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    resp = json.load(r)
            finally:
                p.terminate()
                p.wait()
            # One step per generated token. llama-server leaves out the
            # probabilities of a token whose text ends inside a UTF-8
            # character, so they are matched to the tokens by id, and a
            # token without them gets "top": null.
            probs = list(resp["completion_probabilities"])
            steps = []
            for tok in resp["tokens"]:
                if probs and probs[0].get("id") == tok:
                    top = probs.pop(0).get("top_logprobs") or []
                    steps.append({"top": [{"id": t["id"], "logprob": t["logprob"]} for t in top[:2]]})
                else:
                    steps.append({"top": None})
            result["models"][name] = {"prompt_ids": ids, "ids": resp["tokens"], "steps": steps}
            print(name, resp["tokens"], file=sys.stderr)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
