#!/usr/bin/env python3
"""Render chat templates with Python's Jinja2, set up as Hugging Face's
`apply_chat_template` sets it up, and write the results for snug's tests.

Two kinds of case: the templates inside the real models (read from each
GGUF's `tokenizer.chat_template`, so the fixture stores only the rendered
strings), and small hand-written templates that exercise Jinja features
(loop controls, namespaces, string methods, tojson, whitespace control).

Usage: python3 scripts/make_template_fixtures.py MODEL_DIR OUT_JSON
(needs `pip install gguf==0.19.0 jinja2`).
"""
import json
import sys
from pathlib import Path

import gguf
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
import jinja2.ext


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
                                                      "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number", "default": 1.5}}}}},
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  leading and trailing spaces  \n"},
    ],
    "unicode_newlines": [{"role": "user", "content": "naïve café — 日本語\n\n```rust\nfn main() {}\n```\n🙂"}],
    "specials_in_content": [{"role": "user", "content": "print('<|im_start|>') # literal <|im_end|>"}],
    "empty_content": [{"role": "user", "content": ""}],
}

TOOL_CONVERSATIONS = {
    "tools_user": [{"role": "user", "content": "Weather in Paris?"}],
    "tools_system_user": [{"role": "system", "content": "Use tools when needed."}, {"role": "user", "content": "Add 2 and 3."}],
    "tool_call_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "second result"},
    ],
}

HANDWRITTEN = {
    "loop_controls": "{% for m in messages %}{% if loop.index0 > 1 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content | trim }}|{% endfor %}",
    "namespace": "{% set ns = namespace(n=0, roles=[]) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}{{ ns.n }}",
    "string_methods": "{% for m in messages %}{{ m.content.strip().upper() }}/{{ m.content.split(' ')|join(',') }}/{{ m['content'].replace('a', 'A') }}/{{ m.role.title() }}/{{ m.content.startswith('W') }}/{{ m.content.endswith('?') }}/{{ m.content.lstrip('W') }};{% endfor %}",
    "whitespace_control": "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n    {% else %}\n        O: {{ m.content }}\n    {% endif %}\n{% endfor %}\n{%- if add_generation_prompt %}\nA:{% endif %}",
    "tojson": "{{ messages | tojson }}\n{{ messages[0] | tojson(indent=2) }}\n{{ tools | tojson }}",
    "expressions": "{{ messages[0].content[1:4] }}|{{ messages|length }}|{{ (messages|last).role }}|{{ 'gen' if add_generation_prompt else 'nogen' }}|{{ true }}|{{ none }}|{{ 7 // 2 }}|{{ 7 / 2 }}|{{ messages[0].missing is defined }}|{{ bos_token ~ eos_token }}",
    "filters": "{{ messages|map(attribute='role')|join(' ') }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ 'abc'|upper }}|{{ ' x '|trim }}|{{ [3,1,2]|sort|join }}|{{ 'a,b'.split(',')[1] }}",
}


def main():
    model_dir, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    env = make_env()
    cases = []
    models = {
        "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    }
    for alias, fname in models.items():
        r = gguf.GGUFReader(str(model_dir / fname))
        f = r.fields["tokenizer.chat_template"]
        source = bytes(f.parts[f.data[0]]).decode()
        tmpl = env.from_string(source)
        convs = dict(CONVERSATIONS)
        with_tools = "tools" in source
        if with_tools:
            convs.update(TOOL_CONVERSATIONS)
        for name, msgs in convs.items():
            for gen in (True, False):
                extra = {"tools": TOOLS} if name.startswith("tool") else {}
                text = tmpl.render(messages=msgs, add_generation_prompt=gen, bos_token="<BOS>", eos_token="<EOS>", **extra)
                cases.append({"model": alias, "name": name, "messages": msgs, "add_generation_prompt": gen,
                              "extra": extra, "expected": text})
    for name, source in HANDWRITTEN.items():
        tmpl = env.from_string(source)
        msgs = CONVERSATIONS["multi_turn"] + [{"role": "assistant", "content": "What a day?"}]
        for gen in (True, False):
            text = tmpl.render(messages=msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>", tools=TOOLS)
            cases.append({"template": source, "name": name, "messages": msgs, "add_generation_prompt": gen,
                          "extra": {"tools": TOOLS}, "expected": text})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"renderer": f"jinja2 {jinja2.__version__}, Hugging Face chat environment",
                                    "bos_token_for_models": "<BOS>", "eos_token_for_models": "<EOS>",
                                    "cases": cases}, ensure_ascii=False, indent=1) + "\n")
    print(len(cases), "cases")


if __name__ == "__main__":
    main()
