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
import http.client
import json
import time
import urllib.parse


def call(url, method, path, body=None):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request(method, path, body, {"Content-Type": "application/json"} if body else {})
    r = c.getresponse()
    return r.status, r.read().decode()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--words", type=int, default=600, help="words of the shared prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args()
    model = json.loads(call(a.url, "GET", "/v1/models")[1])["data"][0]["id"]
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
        status, text = call(a.url, "POST", "/v1/completions", body)
        if status != 200:
            raise SystemExit(f"request failed: {status} {text[:300]}")
        r = json.loads(text)
        results.append({"text": r["choices"][0]["text"], "s": round(time.perf_counter() - t, 3),
                        "prompt_tokens": r["usage"]["prompt_tokens"]})
    metrics = {}
    for line in call(a.url, "GET", "/metrics")[1].splitlines():
        if line.startswith("strata_prefix_cache_"):
            name, value = line.split()[:2]
            metrics[name] = float(value)
    print(json.dumps({"results": results, "metrics": metrics}))


if __name__ == "__main__":
    main()
