#!/usr/bin/env python3
"""The OpenAI API surface with the official `openai` client against a Strata server (issue 27):
tool calling (a full round trip, streamed and not; `tool_choice` required and named honoured every
time), 20 JSON schemas (every output validated with the `jsonschema` package), JSON mode, `n`,
`logit_bias`, embeddings, and refused fields. Prints one line per part and the grammar mask cost.

Usage: python3 scripts/openai_api_check.py http://127.0.0.1:8080/v1 BANNED_ID HIDDEN_SIZE
(BANNED_ID: the token id greedy decoding of "The capital of France is" starts with; HIDDEN_SIZE: the
model's width.)
Needs: pip install openai jsonschema
"""
import json
import sys
import time

import jsonschema
import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
client = openai.OpenAI(base_url=base, api_key="none")
model = client.models.list().data[0].id

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
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
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(calls, allowed):
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function", c
        assert c.id, c
        assert c.function.name in allowed, c.function.name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])


def stream_calls(**kw):
    """Streams a chat request; returns (content, tool_calls as dicts, finish_reason)."""
    content, calls, finish = "", {}, None
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            d = ch.delta
            if d.content:
                content += d.content
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function.name:
                    c["name"] += tc.function.name
                if tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# 1. A full tool round trip: tools → tool_calls → tool message → final answer; plain and streamed.
messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
for streamed in (False, True):
    kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    if streamed:
        content, calls, finish = stream_calls(**kw)
        assert finish == "tool_calls", finish
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        call_msgs = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", r
        check_calls(r.choices[0].message.tool_calls, SCHEMAS)
        call_msgs = [c.model_dump() for c in r.choices[0].message.tool_calls]
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": call_msgs}]
    follow += [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature": 21, "sky": "clear"})} for c in call_msgs]
    kw2 = dict(model=model, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0)
    if streamed:
        content, calls, finish = stream_calls(**kw2)
        assert content and not calls and finish in ("stop", "length"), (content, calls, finish)
    else:
        r2 = client.chat.completions.create(**kw2)
        assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls, r2
print(f"tool round trip (plain and streamed): ok")

# 2. `required` and a named function are honoured every time (sampled, several seeds).
for seed in range(6):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a joke."}],
                                       tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=160)
    check_calls(r.choices[0].message.tool_calls, SCHEMAS)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What's the weather in Oslo?"}],
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=1.0, seed=seed, max_tokens=160)
    check_calls(r.choices[0].message.tool_calls, {"get_time"})
    _, calls, finish = stream_calls(model=model, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    temperature=1.0, seed=seed, max_tokens=160, parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather", calls
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
print("tool_choice required / named honoured: 18 of 18")

# 3. 20 JSON schemas: every output validates.
S = lambda props, req=None, **extra: {"type": "object", "properties": props, "required": req or list(props), "additionalProperties": False, **extra}
short = {"type": "string", "maxLength": 24}
schemas = [
    S({"name": short, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    S({"answer": {"enum": ["yes", "no", "maybe"]}}),
    S({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    S({"tags": {"type": "array", "items": short, "minItems": 1, "maxItems": 3}}),
    S({"point": S({"x": {"type": "integer"}, "y": {"type": "integer"}})}),
    S({"ok": {"type": "boolean"}, "reason": short}),
    S({"items": {"type": "array", "items": S({"id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": short}), "maxItems": 3}}),
    S({"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    S({"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}),
    S({"city": short, "country": short, "population": {"type": "integer", "minimum": 0, "maximum": 50000000}}),
    S({"a": {"type": "integer", "minimum": 1, "maximum": 9}, "b": {"type": "integer", "minimum": 1, "maximum": 9}, "sum": {"type": "integer", "minimum": 2, "maximum": 18}}),
    S({"title": short, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "maxItems": 2}}),
    S({"user": S({"name": short, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}), "active": {"type": "boolean"}}),
    S({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    S({"priority": {"type": "integer", "enum": [1, 2, 3]}, "task": short}),
    S({"steps": {"type": "array", "items": short, "minItems": 2, "maxItems": 3}, "done": {"type": "boolean"}}),
    S({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 10}]}}),
    S({"note": {"type": ["string", "null"], "maxLength": 20}, "count": {"type": "integer", "minimum": 0, "maximum": 5}}),
    S({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}),
    S({"word": {"type": "string", "minLength": 3, "maxLength": 8, "pattern": "^[a-z]+$"}, "letters": {"type": "integer", "minimum": 3, "maximum": 8}}),
]
assert len(schemas) == 20
# An output the grammar lets run on (a number's digits are unbounded in JSON) can be cut by
# max_tokens: at most one of the 40 may end that way; every finished one must validate.
valid, cut = 0, []
for i, schema in enumerate(schemas):
    for temp in (0.0, 0.8):
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Fill in the JSON object for a typical example."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            temperature=temp, seed=i, max_tokens=200)
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "length":
            cut.append((i, temp, text[-40:]))
            continue
        assert r.choices[0].finish_reason == "stop", (i, temp, r.choices[0].finish_reason, text)
        jsonschema.validate(json.loads(text), schema)
        valid += 1
assert len(cut) <= 1, cut
print(f"json_schema: {valid} of {len(schemas) * 2} outputs valid, {len(cut)} cut by max_tokens {cut} (20 schemas, temperature 0 and 0.8)")

# JSON mode: every output that ends parses as an object (frequency_penalty keeps this 135M model
# from repeating one word for ever inside a string). Outputs can still run to max_tokens (valid
# JSON so far, cut off; which ones depends on the last bits of the logits): at most one of the
# four greedy ones may; sampled ones are counted, not failed.
prompts = ["Describe a cat as JSON.", "Give a book as JSON with title and author.",
           "A JSON object for a user named Ann.", "Return the weather in Rome as JSON."]
greedy_ended = 0
for p in prompts:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=400, frequency_penalty=1.0)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "length":
        continue
    assert r.choices[0].finish_reason == "stop", (r.choices[0].finish_reason, text)
    assert isinstance(json.loads(text), dict), text
    greedy_ended += 1
assert greedy_ended >= 3, greedy_ended
ended = cut = 0
for seed in range(4):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[seed]}],
                                       response_format={"type": "json_object"}, temperature=0.7, seed=seed, max_tokens=400, frequency_penalty=1.0)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
        ended += 1
    else:
        cut += 1
print(f"json_object: {greedy_ended} of 4 greedy outputs ended and parse; sampled: {ended} ended and parse, {cut} cut by max_tokens")

# 4. n, logit_bias, embeddings, a refused field.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say something."}], n=3,
                                   temperature=1.0, seed=3, max_tokens=12)
assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2], r
# `logit_bias` −100 on the greedy answer's first token (its id given by the caller) removes it.
BANNED, WIDTH = int(sys.argv[2]), int(sys.argv[3])
plain = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  logprobs=0)
biased = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                   logprobs=0, logit_bias={str(BANNED): -100})
first_plain = plain.choices[0].logprobs.tokens[0]
assert first_plain not in biased.choices[0].logprobs.tokens, (first_plain, biased.choices[0].logprobs.tokens)
e1 = client.embeddings.create(model=model, input=["hello world", "the sky is blue"])
e2 = client.embeddings.create(model=model, input="hello world")
assert len(e1.data) == 2 and all(len(d.embedding) == WIDTH for d in e1.data), len(e1.data[0].embedding)
assert e1.data[0].embedding == e2.data[0].embedding, "embeddings are deterministic"
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   extra_body={"audio": {"voice": "alloy", "format": "wav"}})
    raise SystemExit("audio was not refused")
except openai.BadRequestError as e:
    assert "audio" in str(e), e
print(f"n=3, logit_bias, embeddings (width {len(e1.data[0].embedding)}, deterministic), refused fields: ok")
print("openai api check: ok")
