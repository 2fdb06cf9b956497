#!/usr/bin/env bash
# Writes starting inputs for the fuzz targets into fuzz/corpus/: saved
# sessions of the small model (F16, Q8, TQ4), a page file of every
# format pair, request bodies for each route (plain, gzip, zstd), and the
# real models' chat templates. Needs a release build of snug and the
# models pulled.
set -euo pipefail
cd "$(dirname "$0")"
snug=../target/release/snug
mkdir -p corpus/session corpus/kvpage corpus/http corpus/template corpus/grammar
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for kv in f16 q8 tq4; do
  "$snug" run smollm2-135m -p "Hi" -n 2 --temperature 0 --kv $kv --kv-page 4 \
    --save-session "$tmp/$kv.snug" > /dev/null 2>&1
  # First byte odd: the target sets the checksums right (they already are).
  (printf '\x01'; cat "$tmp/$kv.snug") > corpus/session/seed-$kv
done
python3 - "$HOME/.cache/snug/models" <<'PY'
import gzip, glob, json, os, struct, subprocess, sys
# Page files: 2 layers x 2 KV heads x 4 positions, head_dim 64, for each
# (key, value) format pair, in the order the target enumerates them.
vector = {"f16": 128, "f32": 256, "q8": 66, "tq4": 34}
formats = ["f16", "f32", "q8", "tq4"]
i = 0
for k in formats:
    for v in formats:
        size = 16 * (vector[k] + vector[v])
        open(f"corpus/kvpage/seed-{k}-{v}", "wb").write(bytes([(i << 1) | 1]) + os.urandom(size))
        i += 1
# Request bodies: the first byte's low nibble is the route (mod 9), its
# high nibble the encoding (0 none, 1 gzip, 2 zstd).
bodies = [
    (0, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stop": ["\n"],
         "stream": True, "stream_options": {"include_usage": True}}),
    (0, {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "b"}],
         "top_p": 0.9, "top_k": 5, "seed": 3, "n": 1, "logit_bias": {"1": 2}}),
    (1, {"prompt": "Once", "max_tokens": 8, "temperature": 0.5, "min_p": 0.1, "repeat_penalty": 1.1, "stop": "x"}),
    (1, {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}),
    (1, {"prompt": ["a", "b"]}),
    (2, {"state": "The ticket says the printer is on fire.",
         "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"},
                       "team": {"type": "choice", "instructions": "Which team?", "criteria": {"it": "IT", "hr": None}},
                       "sev": {"type": "score", "instructions": "How bad?", "levels": ["low", "mid", "high"]}},
         "min_confidence": 0.5}),
    (3, {"states": ["a", {"x": 1}], "questions": {"q": {"type": "choice", "instructions": "?", "options": ["a", "b"]}},
         "min_confidence": {"q": 0.2}}),
    (4, {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}}),
    (5, {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["x"],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Yo"}],
         "temperature": 0.5, "top_k": 3, "stream": True}),
    (6, {"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0, "stream": True,
         "input": [{"role": "developer", "content": "x"}, {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}]}]}),
    (7, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
         "options": {"temperature": 0, "num_predict": 4, "stop": ["\n"], "seed": 1, "num_ctx": 2048, "mirostat": 0}}),
    (8, {"model": "m", "prompt": "Once", "system": "s", "raw": False, "options": {"top_k": 5, "repeat_last_n": -1}}),
]
for n, (route, body) in enumerate(bodies):
    raw = json.dumps(body).encode()
    open(f"corpus/http/seed-{n}", "wb").write(bytes([route]) + raw)
    open(f"corpus/http/seed-{n}-gz", "wb").write(bytes([0x10 | route]) + gzip.compress(raw))
    zst = subprocess.run(["zstd", "-q", "-c"], input=raw, capture_output=True).stdout
    if zst:
        open(f"corpus/http/seed-{n}-zst", "wb").write(bytes([0x20 | route]) + zst)
# The models' chat templates, read from their GGUF metadata.
key = b"tokenizer.chat_template"
for path in glob.glob(os.path.join(sys.argv[1], "*.gguf")):
    head = open(path, "rb").read(32 << 20)
    at = head.find(struct.pack("<Q", len(key)) + key + struct.pack("<I", 8))
    if at < 0:
        continue
    at += 8 + len(key) + 4
    (n,) = struct.unpack("<Q", head[at:at + 8])
    open(f"corpus/template/{os.path.basename(path)}.jinja", "wb").write(head[at + 8:at + 8 + n])
# Grammars of each kind: the first byte is the kind (0 GBNF, 1 Lark,
# 2 regex, 3 JSON schema, 4 choices split at '|').
grammars = [
    (0, 'root ::= object\nobject ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}"\n'
        'value ::= object | string | [0-9]+ | "true" | "false" | "null"\n'
        'string ::= "\\"" ( [^"\\\\] | "\\\\" ["\\\\/bfnrt] )* "\\""\nws ::= [ \\t\\n]{0,4}\n'),
    (0, 'root ::= ("yes" | "no") (", " [a-z-]{1,8})? .\n'),
    (1, 'start: item ("," item)*\nitem: /[a-z]+/ | %json {"type": "integer"}\n'),
    (2, r"\d{4}-\d{2}-\d{2}( [A-Z][a-z]+)*"),
    (3, json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, "x", None]}},
                    "b": {"$ref": "#/$defs/b"}}, "$defs": {"b": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
                    "required": ["a"]})),
    (4, "positive|negative|neutral"),
]
for i, (kind, text) in enumerate(grammars):
    open(f"corpus/grammar/seed-{i}", "wb").write(bytes([kind]) + text.encode())
PY
echo "seeded $(find corpus -type f | wc -l) inputs"
