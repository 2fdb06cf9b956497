"""Structured output and tool calls through the official `openai` Python
client against a running `snug serve`: `parse()` with Pydantic models on a
small suite of prompts, `json_object`, a constrained answer that is the
same alone and beside other requests, and (with --tools) tool calls with
tool_choice required / named / auto, streamed deltas that reassemble to
the same calls, and a tool result sent back. Prints one JSON summary;
exits non-zero with a message on the first failure.

    python3 scripts/structured-client-check.py http://127.0.0.1:8080/v1 [--tools]
"""

import concurrent.futures
import json
import sys
from enum import Enum
from typing import List

import openai
from pydantic import BaseModel, Field


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    hobbies: List[str] = Field(max_length=3)


class Mood(str, Enum):
    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Review(BaseModel):
    sentiment: Mood
    stars: int = Field(ge=1, le=5)


class Step(BaseModel):
    action: str = Field(max_length=60)


class Recipe(BaseModel):
    title: str = Field(max_length=50)
    steps: List[Step] = Field(max_length=3)


SUITE = [
    ("Give me facts about Paris.", City),
    ("Invent a person who likes the outdoors.", Person),
    ("Review: 'The soup was cold and the waiter was rude.' Classify it.", Review),
    ("A recipe for toast, in at most three steps.", Recipe),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}


def main():
    base = sys.argv[1]
    with_tools = "--tools" in sys.argv[2:]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    summary = {"model": model, "parsed": []}

    for prompt, schema in SUITE:
        r = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format=schema,
            temperature=0,
            max_tokens=200,
        )
        msg = r.choices[0].message
        check(r.choices[0].finish_reason == "stop", f"{schema.__name__}: finish {r.choices[0].finish_reason}: {msg.content!r}")
        check(isinstance(msg.parsed, schema), f"{schema.__name__}: parsed {msg.parsed!r} from {msg.content!r}")
        summary["parsed"].append(msg.content)

    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(text), dict), f"json_object: {text!r}")

    # A constrained answer is the same alone and beside other requests.
    def person(seed):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}},
            temperature=0.9,
            seed=seed,
            max_tokens=80,
        ).choices[0].message.content

    alone = person(11)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(person, s) for s in (11, 12, 13, 14)]
        together = [f.result() for f in futures]
    check(together[0] == alone, f"batched {together[0]!r} != alone {alone!r}")
    summary["batched_equal"] = True

    # A grammar that does not compile is a 400 naming the field.
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            extra_body={"guided_regex": "(unclosed"},
        )
        check(False, "a bad regex was accepted")
    except openai.BadRequestError as e:
        check("guided_regex" in str(e), f"bad regex error: {e}")

    if with_tools:
        question = [{"role": "user", "content": "What is the weather in Oslo and in Bergen, in celsius?"}]
        r = client.chat.completions.create(
            model=model, messages=question, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=200
        )
        c = r.choices[0]
        check(c.finish_reason == "tool_calls", f"required: finish {c.finish_reason}")
        calls = c.message.tool_calls
        check(calls and all(t.function.name in ("get_weather", "get_time") for t in calls), f"required: {calls}")
        for t in calls:
            args = json.loads(t.function.arguments)
            check(isinstance(args.get("city"), str), f"arguments: {t.function.arguments}")
        summary["required"] = [(t.function.name, json.loads(t.function.arguments)) for t in calls]

        # Streamed: the deltas reassemble to the same calls.
        stream = client.chat.completions.create(
            model=model,
            messages=question,
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=0,
            max_tokens=200,
            stream=True,
        )
        acc = {}
        finish = None
        for chunk in stream:
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    e = acc.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    e["id"] = d.id or e["id"]
                    e["name"] += d.function.name or ""
                    e["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        streamed = [(acc[i]["name"], json.loads(acc[i]["arguments"])) for i in sorted(acc)]
        check(finish == "tool_calls", f"stream finish {finish}")
        check(streamed == summary["required"], f"streamed {streamed} != {summary['required']}")
        check(all(acc[i]["id"] for i in acc), "every streamed call has an id")

        # A named function: exactly one call to it.
        r = client.chat.completions.create(
            model=model,
            messages=question,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            temperature=0,
            max_tokens=100,
        )
        calls = r.choices[0].message.tool_calls
        check(len(calls) == 1 and calls[0].function.name == "get_time", f"named: {calls}")

        # The result goes back through the template; the model answers
        # (in text, or with further calls).
        first = summary["required"][0]
        history = question + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": first[0], "arguments": json.dumps(first[1])}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees celsius, light rain"},
        ]
        r = client.chat.completions.create(
            model=model, messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=60
        )
        m = r.choices[0].message
        check(bool(m.content) or bool(m.tool_calls), f"an answer after a tool result: {m}")
        for t in m.tool_calls or []:
            json.loads(t.function.arguments)
        summary["after_result"] = {"text": m.content, "calls": len(m.tool_calls or [])}

        r = client.chat.completions.create(
            model=model, messages=question, tools=[WEATHER, TIME], temperature=0, max_tokens=120
        )
        c = r.choices[0]
        summary["auto"] = {"finish": c.finish_reason, "calls": len(c.message.tool_calls or [])}
        for t in c.message.tool_calls or []:
            json.loads(t.function.arguments)

        # The Responses API: function tools, a required call whole and
        # through the stream helper, then the output sent back.
        rtools = [{"type": "function", "name": f["function"]["name"], "description": f["function"]["description"],
                   "parameters": f["function"]["parameters"]} for f in (WEATHER, TIME)]
        ask = "What is the weather in Oslo, in celsius?"
        # One call (not parallel), so the grammar ends after it and the
        # response completes well inside the token limit.
        r = client.responses.create(model=model, input=ask, tools=rtools, tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=200)
        calls = [o for o in r.output if o.type == "function_call"]
        check(calls and all(isinstance(json.loads(c.arguments), dict) for c in calls), f"responses calls: {r.output}")
        with client.responses.stream(model=model, input=ask, tools=rtools, tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=200) as st:
            final = st.get_final_response()
        streamed = [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
        check(streamed == [(c.name, json.loads(c.arguments)) for c in calls], f"responses stream {streamed}")
        back = [{"role": "user", "content": ask}] + [
            {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls
        ] + [{"type": "function_call_output", "call_id": c.call_id, "output": "12 degrees"} for c in calls]
        after = client.responses.create(model=model, input=back, tools=rtools, temperature=0, max_output_tokens=60)
        check(after.output, f"responses after the output: {after}")
        summary["responses_calls"] = [(c.name, json.loads(c.arguments)) for c in calls]

    print(json.dumps(summary))


if __name__ == "__main__":
    main()
