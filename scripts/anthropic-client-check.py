#!/usr/bin/env python3
"""Drives `snug serve`'s Messages API with Anthropic's official Python client.

    scripts/anthropic-client-check.py http://127.0.0.1:PORT KEY

Sends a message (whole and streamed, which must agree under greedy
sampling), counts tokens, and checks that an unsupported field comes back
as the client's BadRequestError and a wrong key as AuthenticationError.
Prints one JSON object of what it saw; exits non-zero on any mismatch.
"""

import json
import sys

import anthropic

base, key = sys.argv[1], sys.argv[2]
c = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)
out = {}
msgs = [{"role": "user", "content": "Name a color."}]
# Greedy, for whole and streamed to agree: newer clients have no
# temperature argument, so it goes as an extra field of the body.
kw = dict(model="snug", max_tokens=12, system="Be brief.", messages=msgs, extra_body={"temperature": 0})
whole = c.messages.create(**kw)
assert whole.type == "message" and whole.role == "assistant", whole
assert whole.content[0].type == "text" and whole.content[0].text, whole
assert whole.stop_reason in ("end_turn", "max_tokens"), whole
assert 0 < whole.usage.output_tokens <= 12, whole
out["text"] = whole.content[0].text
out["stop_reason"] = whole.stop_reason
out["input_tokens"] = whole.usage.input_tokens

with c.messages.stream(**kw) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == whole.content[0].text, (streamed, whole.content[0].text)
assert final.stop_reason == whole.stop_reason, final
assert final.usage.output_tokens == whole.usage.output_tokens, final
out["streamed_equal"] = True

stopped = c.messages.create(model="snug", max_tokens=40, messages=msgs, stop_sequences=["e"], extra_body={"temperature": 0})
assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "e", stopped
out["stop_sequence"] = stopped.stop_sequence

counted = c.messages.count_tokens(model="snug", system="Be brief.", messages=msgs)
assert counted.input_tokens == whole.usage.input_tokens, (counted, whole.usage)

try:
    c.messages.create(model="snug", max_tokens=5, messages=msgs, tools=[{"name": "f", "input_schema": {"type": "object"}}])
    raise SystemExit("tools were accepted")
except anthropic.BadRequestError as e:
    out["refused"] = e.body["error"]["message"]
try:
    anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**kw)
    raise SystemExit("a wrong key was accepted")
except anthropic.AuthenticationError:
    pass
print(json.dumps(out))
