#!/usr/bin/env python3
"""Renders the chat templates in tests/fixtures/chat/*.jinja with transformers' own renderer
(`transformers.utils.chat_template_utils.render_jinja_template`, the code behind
`apply_chat_template`) and writes tests/fixtures/chat/expected.json, which the Rust test
`chat_template` compares against. Needs `pip install transformers jinja2` (no torch).

Run from the repository root:  python3 scripts/make_chat_template_fixture.py
"""
import json
import pathlib

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIR = ROOT / "tests" / "fixtures" / "chat"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Write \"quotes\" and ünïcode: 日本 🦀  "},
    ],
    [
        {"role": "user", "content": "line one\nline two"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "{{ not a template }} {% raw %}"},
    ],
]
TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def main():
    cases = []
    for tpl_path in sorted(DIR.glob("*.jinja")):
        template = tpl_path.read_text()
        for i, messages in enumerate(CONVERSATIONS):
            for gen in (True, False):
                rendered, _ = render_jinja_template(
                    conversations=[messages], chat_template=template, add_generation_prompt=gen, **TOKENS
                )
                cases.append({
                    "template": tpl_path.name,
                    "conversation": i,
                    "messages": messages,
                    "add_generation_prompt": gen,
                    "expected": rendered[0],
                })
    out = {"transformers_version": transformers.__version__, "tokens": TOKENS, "cases": cases}
    (DIR / "expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases with transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
