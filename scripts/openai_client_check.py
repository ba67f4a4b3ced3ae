#!/usr/bin/env python3
"""Runs the official `openai` Python client against a Strata server: chat (plain and streamed),
completions, model listing, and one error surfaced as the right exception class.

Usage: python3 scripts/openai_client_check.py http://127.0.0.1:8080/v1
"""
import sys

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/v1"
client = openai.OpenAI(base_url=base, api_key="none")

models = client.models.list()
model = models.data[0].id
assert "/" not in model, model

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0
)
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].message.content
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

deltas, roles, finish, usage = [], [], None, None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=16,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            deltas.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert roles[:1] == ["assistant"], roles
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage
assert "".join(deltas) == chat.choices[0].message.content, ("".join(deltas), chat.choices[0].message.content)

comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
assert comp.choices[0].text.startswith(" Paris"), comp.choices[0].text

try:
    client.chat.completions.create(model=model, messages=[], max_tokens=4)
    raise SystemExit("an empty messages list was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400

try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=100000)
    raise SystemExit("an oversized max_tokens was accepted")
except openai.BadRequestError as e:
    assert "context" in str(e).lower()

print("openai client check: ok")
