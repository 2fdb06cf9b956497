#!/usr/bin/env python3
"""Drives `snug serve`'s Messages API with Anthropic's official Python client.

    scripts/anthropic-client-check.py http://127.0.0.1:PORT KEY

Sends a message (whole and streamed, which must agree under greedy
sampling), counts tokens, calls a tool (whole and streamed, then sends the
result back), and checks that an unsupported tool comes back as the
client's BadRequestError and a wrong key as AuthenticationError.
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

# Tool use: tool_choice "any" makes the model call; the stream's final
# message holds the same tool_use blocks; the result goes back as a
# tool_result block and the model answers.
weather = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"]}}
ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
tkw = dict(model="snug", max_tokens=100, messages=ask, tools=[weather], tool_choice={"type": "any"},
           extra_body={"temperature": 0})
used = c.messages.create(**tkw)
uses = [b for b in used.content if b.type == "tool_use"]
assert used.stop_reason == "tool_use" and uses, used
assert all(u.name == "get_weather" and isinstance(u.input.get("city"), str) for u in uses), uses
with c.messages.stream(**tkw) as stream:
    final = stream.get_final_message()
streamed_uses = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
assert streamed_uses == [(u.name, u.input) for u in uses], (streamed_uses, uses)
assert final.stop_reason == "tool_use", final
out["tool_use"] = [{"name": u.name, "input": u.input} for u in uses]
back = ask + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "12 degrees, rain"}
                                           for u in uses]}]
after = c.messages.create(model="snug", max_tokens=40, messages=back, tools=[weather], extra_body={"temperature": 0})
assert after.content, after
out["after_tool"] = after.stop_reason
try:
    c.messages.create(model="snug", max_tokens=5, messages=msgs, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    raise SystemExit("a server tool was accepted")
except anthropic.BadRequestError as e:
    out["refused"] = e.body["error"]["message"]
try:
    anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**kw)
    raise SystemExit("a wrong key was accepted")
except anthropic.AuthenticationError:
    pass
print(json.dumps(out))
