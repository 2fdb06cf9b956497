"""Drives `snug serve EMBEDDING_MODEL` with the official `openai` and
`ollama` Python clients and prints what they returned as one JSON object,
for the caller to compare with the reference embeddings:

    python3 scripts/embeddings-client-check.py http://127.0.0.1:8080 TEXTS_FILE

TEXTS_FILE holds one text per line. The script itself checks what the
clients decode (floats and base64 agree, one input equals the same input
in a batch, errors map to the client's exception types).
"""

import base64
import json
import struct
import sys

import ollama
import openai


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    base = sys.argv[1]
    texts = [t for t in open(sys.argv[2], encoding="utf-8").read().splitlines() if t]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    batch = client.embeddings.create(model=model, input=texts)
    check(len(batch.data) == len(texts), f"{len(batch.data)} embeddings for {len(texts)} texts")
    check([d.index for d in batch.data] == list(range(len(texts))), "indices in order")
    check(batch.usage.prompt_tokens == batch.usage.total_tokens > 0, f"usage: {batch.usage}")

    # The client asks for base64 by default when numpy is present and
    # decodes it; ask for both explicitly and compare.
    floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
    b64 = client.embeddings.create(model=model, input=texts[0], encoding_format="base64")
    check(floats.data[0].embedding == batch.data[0].embedding, "one text alone equals it in the batch")
    raw = base64.b64decode(b64.data[0].embedding)
    decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    check(decoded == floats.data[0].embedding, "base64 holds the same float32 values")

    try:
        client.embeddings.create(model=model, input="word " * 1000)
        check(False, "an over-long input is refused")
    except openai.BadRequestError as e:
        check(e.code == "context_length_exceeded" and "256" in e.message, f"over-long input: {e}")

    o = ollama.Client(host=base, timeout=300)
    oe = o.embed(model=model, input=texts[:2])
    check(len(oe.embeddings) == 2, "ollama embed returns two vectors")
    check(list(oe.embeddings[0]) == batch.data[0].embedding, "ollama and openai routes agree")

    print(
        json.dumps(
            {
                "model": model,
                "dimensions": len(batch.data[0].embedding),
                "embeddings": [d.embedding for d in batch.data],
                "prompt_tokens": batch.usage.prompt_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
