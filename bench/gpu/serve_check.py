# `snug serve --device cuda` beside `snug serve` on the CPU, with Python's
# standard library only (the GPU machine has no package index): six chat
# requests, greedy, first one at a time, then all at once on the GPU, then
# one at a time on the CPU. Prints whether the concurrent answers equal the
# lone ones and whether the GPU's equal the CPU's.
#
#   python3 bench/gpu/serve_check.py GPU_PORT CPU_PORT
import json
import sys
import threading
import urllib.request

port_gpu, port_cpu = sys.argv[1], sys.argv[2]
prompts = ["Write a haiku about the sea.", "List three prime numbers.", "What is a lighthouse?",
           "Say hello in French.", "Describe a cat in one sentence.", "Count from one to five."]


def ask(port, prompt, n=48):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]


alone = [ask(port_gpu, p) for p in prompts]
together = [None] * len(prompts)


def run(i):
    together[i] = ask(port_gpu, prompts[i])


threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
for t in threads:
    t.start()
for t in threads:
    t.join()
cpu = [ask(port_cpu, p) for p in prompts]
print(json.dumps({"gpu_concurrent_equal_alone": together == alone, "gpu_equal_cpu": alone == cpu,
                  "requests": len(prompts)}))
