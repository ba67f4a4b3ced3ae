#!/usr/bin/env python3
"""Greedy requests that share long prompt prefixes, against a running Strata server: prints one
JSON object with each request's text and seconds and the server's prefix-cache counters, so that
two servers (two builds, or one build with a path switched off) can be compared text for text.

    python3 scripts/prefix_check.py --url http://127.0.0.1:8080 > a.json

Requests, in order (temperature 0, `ignore_eos`, --max-tokens each): a long prompt P + question
1, P + question 2 (a prefix hit), P + question 1 again (a hit), the first third of P + another
question (a hit on fewer blocks), an unrelated short prompt. Standard library only.
"""
import argparse
import json
import time

from bench_batching import conn, metric, served_model

METRICS = ["strata_prefix_cache_hits_total", "strata_prefix_cache_reused_tokens_total"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--words", type=int, default=600, help="words of the shared prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args()
    model = served_model(a.url)
    sentence = "the river carries stone and salt past the old mill while the town sleeps "
    words = (sentence * (a.words // 14 + 1)).split()[: a.words]
    pre = " ".join(words)
    prompts = [pre + " First question: what", pre + " Second question: why",
               pre + " First question: what", " ".join(words[: a.words // 3]) + " A shorter one",
               "Unrelated prompt about bees"]
    results = []
    for prompt in prompts:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": a.max_tokens,
                           "temperature": 0, "ignore_eos": True})
        t = time.perf_counter()
        c = conn(a.url)
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = c.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            raise SystemExit(f"request failed: {resp.status} {text[:300]}")
        r = json.loads(text)
        results.append({"text": r["choices"][0]["text"], "s": round(time.perf_counter() - t, 3),
                        "prompt_tokens": r["usage"]["prompt_tokens"]})
    metrics = {name: metric(a.url, name) for name in METRICS}
    print(json.dumps({"results": results, "metrics": metrics}))


if __name__ == "__main__":
    main()
