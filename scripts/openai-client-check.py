"""Drives a running `snug serve` with the official `openai` Python client:
chat, completion, streaming with usage, models, error mapping, embeddings
and the Responses API (with parse()). Exits
non-zero with a message on the first mismatch.

    python3 scripts/openai-client-check.py http://127.0.0.1:8080/v1 [API_KEY]
"""

import sys

import openai
import pydantic


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


def main():
    base = sys.argv[1]
    key = sys.argv[2] if len(sys.argv) > 2 else "unused"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1, f"one model listed: {ids}")
    model = ids[0]

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, seed=1
    )
    choice = chat.choices[0]
    check(chat.object == "chat.completion", f"object: {chat.object}")
    check(choice.message.role == "assistant", f"role: {choice.message.role}")
    check(len(choice.message.content) > 0, "chat produced text")
    check(choice.finish_reason in ("stop", "length"), f"finish: {choice.finish_reason}")
    u = chat.usage
    check(u.prompt_tokens > 10 and 0 < u.completion_tokens <= 24, f"usage: {u}")
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens, f"total: {u}")

    # The same request streamed: the same text, and usage at the end.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(parts)
    check(streamed == choice.message.content, f"streamed {streamed!r} != {choice.message.content!r}")
    check(finish == choice.finish_reason, f"stream finish {finish} != {choice.finish_reason}")
    check(usage is not None and usage.completion_tokens == u.completion_tokens, f"stream usage: {usage}")

    # Plain completion, with a stop string.
    comp = client.completions.create(
        model=model, prompt="One, two, three, four,", max_tokens=16, temperature=0
    )
    text = comp.choices[0].text
    check(comp.object == "text_completion", f"object: {comp.object}")
    check(len(text) > 0, "completion produced text")
    check(comp.usage.completion_tokens <= 16, f"usage: {comp.usage}")
    stop = text.strip().split()[0] if text.strip() else None
    if stop:
        cut = client.completions.create(
            model=model, prompt="One, two, three, four,", max_tokens=16, temperature=0, stop=[stop]
        )
        check(stop not in cut.choices[0].text, f"stop string {stop!r} in {cut.choices[0].text!r}")
        check(cut.choices[0].finish_reason == "stop", f"stop finish: {cut.choices[0].finish_reason}")

    # Streamed completion.
    parts = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="One, two, three, four,", max_tokens=16, temperature=0, stream=True
    ) if c.choices]
    check("".join(parts) == text, f"streamed completion {''.join(parts)!r} != {text!r}")

    # Seeded sampling is reproducible.
    a = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0.9, seed=42)
    b = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0.9, seed=42)
    check(a.choices[0].message.content == b.choices[0].message.content, "same seed, same text")

    # Bad fields are 400s the client raises as BadRequestError.
    try:
        client.chat.completions.create(model=model, messages=messages, temperature=5)
        check(False, "temperature 5 accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "temperature" in str(e), f"error: {e}")
    # The Responses API: whole, streamed (the same text under greedy
    # sampling), a cut at max_output_tokens, and what it cannot do refused.
    r = client.responses.create(model=model, input="Name three colors.", instructions="Be brief.",
                                max_output_tokens=16, temperature=0)
    check(r.status in ("completed", "incomplete") and r.output_text, f"response: {r}")
    check(r.usage.output_tokens <= 16 and r.usage.input_tokens > 0, f"usage: {r.usage}")
    events = list(client.responses.create(model=model, input="Name three colors.", instructions="Be brief.",
                                          max_output_tokens=16, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(deltas == r.output_text, f"streamed response {deltas!r} != {r.output_text!r}")
    check(events[0].type == "response.created" and events[-1].response.output_text == r.output_text,
          f"events: {[e.type for e in events]}")
    # The client's stream helper wants a completed response: room to end.
    whole = client.responses.create(model=model, input="Name three colors.", instructions="Be brief.",
                                    max_output_tokens=200, temperature=0)
    check(whole.status == "completed", f"not completed in 200 tokens: {whole.status}")
    with client.responses.stream(model=model, input="Name three colors.", instructions="Be brief.",
                                 max_output_tokens=200, temperature=0) as stream:
        final = stream.get_final_response()
    check(final.output_text == whole.output_text, f"stream helper {final.output_text!r}")
    short = client.responses.create(model=model, input=[{"role": "user", "content": "Count to twenty."}],
                                    max_output_tokens=3, temperature=0)
    check(short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens", f"{short}")
    # Embeddings: a batch equals its inputs one at a time (bit for bit,
    # through the client's base64 default and as floats), unit length.
    texts = ["The cat sat on the mat.", "A cat is sitting on a mat.", "Stock markets fell sharply."]
    batch = client.embeddings.create(model=model, input=texts)
    check(len(batch.data) == 3 and batch.usage.prompt_tokens > 0, f"embeddings: {batch.usage}")
    for i, t in enumerate(texts):
        one = client.embeddings.create(model=model, input=t, encoding_format="float").data[0].embedding
        check(one == batch.data[i].embedding, f"embedding {i} alone differs from the batch's")
    norm = sum(x * x for x in batch.data[0].embedding) ** 0.5
    check(abs(norm - 1) < 1e-4, f"embedding norm {norm}")
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    e = [d.embedding for d in batch.data]
    check(dot(e[0], e[1]) > dot(e[0], e[2]), "a paraphrase is closer than an unrelated text")
    # Structured output through the Responses API's parse().
    class Colour(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        warm: bool

    parsed = client.responses.parse(model=model, input="Name one warm colour.", text_format=Colour,
                                    max_output_tokens=60, temperature=0)
    check(isinstance(parsed.output_parsed, Colour), f"responses parse: {parsed.output_text!r}")
    try:
        client.responses.create(model=model, input="x", previous_response_id="resp_1")
        check(False, "previous_response_id accepted")
    except openai.BadRequestError as e:
        check("previous_response_id" in str(e), f"error: {e}")
    print("openai client: chat, stream, completion, stop, seed, errors, embeddings, responses ok")


if __name__ == "__main__":
    main()
