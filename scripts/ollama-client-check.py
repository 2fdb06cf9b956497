#!/usr/bin/env python3
"""Drives `snug serve`'s ollama routes with ollama's official Python client.

    scripts/ollama-client-check.py http://127.0.0.1:PORT

Lists and shows the model, chats (whole and streamed, which must agree
under greedy sampling), generates, and checks that a field snug does not
support comes back as the client's ResponseError. Prints one JSON object
of what it saw; exits non-zero on any mismatch.
"""

import json
import sys

import ollama

host = sys.argv[1]
c = ollama.Client(host=host)
out = {}

tags = c.list()
assert len(tags.models) == 1, tags
name = tags.models[0].model
out["model"] = name
out["details"] = tags.models[0].details.model_dump()

shown = c.show(name)
assert shown.template, "no template"
out["capabilities"] = shown.capabilities

opts = {"temperature": 0, "num_predict": 12, "seed": 1}
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
whole = c.chat(model=name, messages=msgs, options=opts)
assert whole.done and whole.message.role == "assistant", whole
assert whole.eval_count and whole.eval_count <= 12, whole
assert whole.prompt_eval_count and whole.prompt_eval_count > 5, whole
parts = list(c.chat(model=name, messages=msgs, options=opts, stream=True))
streamed = "".join(p.message.content for p in parts)
assert parts[-1].done and parts[-1].done_reason in ("stop", "length"), parts[-1]
assert streamed == whole.message.content, (streamed, whole.message.content)
out["chat"] = whole.message.content
out["chat_chunks"] = len(parts)

gen = c.generate(model=name, prompt="The capital of France is", options=opts, raw=True)
assert gen.done and gen.response, gen
gen_streamed = "".join(p.response for p in c.generate(model=name, prompt="The capital of France is", options=opts, raw=True, stream=True))
assert gen_streamed == gen.response, (gen_streamed, gen.response)
out["generate"] = gen.response

# Structured output: `format` as "json" and as a schema.
schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 20}},
          "required": ["colour"], "additionalProperties": False}
shaped = c.chat(model=name, messages=[{"role": "user", "content": "Name one colour."}],
                format=schema, options={"temperature": 0, "num_predict": 40})
value = json.loads(shaped.message.content)
assert list(value) == ["colour"], shaped.message.content
out["format_schema"] = value
loose = c.generate(model=name, prompt="A cat as JSON:", format="json", options={"temperature": 0, "num_predict": 40})
if loose.done_reason == "stop":
    assert isinstance(json.loads(loose.response), dict), loose.response

# Tool calls: the model answers a weather question with a call to the
# function (as ollama's message.tool_calls, arguments an object), whole and
# streamed alike.
def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
      city: the city's name
    """
    return "12 degrees"

ask = [{"role": "user", "content": "What is the weather in Oslo? Use the get_weather tool."}]
called = c.chat(model=name, messages=ask, tools=[get_weather], options={"temperature": 0, "num_predict": 80})
calls = called.message.tool_calls or []
streamed_calls = [tc for part in c.chat(model=name, messages=ask, tools=[get_weather], stream=True,
                                        options={"temperature": 0, "num_predict": 80})
                  for tc in (part.message.tool_calls or [])]
assert [(t.function.name, dict(t.function.arguments)) for t in calls] == \
       [(t.function.name, dict(t.function.arguments)) for t in streamed_calls], (calls, streamed_calls)
out["tool_calls"] = [{"name": t.function.name, "arguments": dict(t.function.arguments)} for t in calls]
if calls:
    # The result goes back as a tool message; the model answers.
    follow = c.chat(model=name, messages=ask + [called.message, {"role": "tool", "content": "12 degrees", "tool_name": "get_weather"}],
                    tools=[get_weather], options={"temperature": 0, "num_predict": 40})
    out["after_tool"] = follow.message.content

emb = c.embed(model=name, input=["The cat sat on the mat.", "A cat is sitting on a mat."])
assert len(emb.embeddings) == 2 and len(emb.embeddings[0]) > 0, emb
out["embed_dims"] = len(emb.embeddings[0])

try:
    c.chat(model=name, messages=msgs, options={"mirostat": 2})
    raise SystemExit("mirostat was accepted")
except ollama.ResponseError as e:
    assert e.status_code == 400 and "mirostat" in e.error, e
    out["refused"] = e.error
try:
    c.show("no-such-model")
    raise SystemExit("an unknown model was shown")
except ollama.ResponseError as e:
    assert e.status_code == 404, e
print(json.dumps(out))
