#!/usr/bin/env python3
"""Concurrent streaming clients against an OpenAI-compatible server (Strata or llama-server).

    python3 scripts/bench_batching.py --url http://127.0.0.1:8080 --clients 8 --max-tokens 128

Each client sends one streaming `/v1/completions` request (a prompt of its own, `ignore_eos`,
temperature 0) at the same moment; the script prints one JSON line: clients, generated tokens
(counted from the stream's chunks, cross-checked with `usage` where the server sends it), wall
seconds from the first request sent to the last stream ended, aggregate tok/s, mean TTFT and, for
Strata, the drive bytes read per generated token (from `/metrics`, before and after).

`--request-rate R`: the clients arrive as a Poisson process of R requests per second (seeded
exponential gaps, as vLLM's `benchmark_serving.py --request-rate`) instead of all at once, so new
prompts keep meeting running decodes (a server's mixed steps); the line then also gives the mean
time per output token after the first (`mean_tpot_ms`).
`--first-prompt N`: client i sends prompt N + i (each prompt's topic differs from its first
words on, so no two share a prefix-cache block while N + clients ≤ the 20 topics; the harness
gives its warm-up and its one-client run prompts of their own, so that no measured prompt is in
the server's prefix cache when sent);
`--shared-prefix N`: every prompt starts with the same N-word preamble (prefix-cache runs);
`--ttft-pair`: sends one request with a long shared preamble, then a second with the same
preamble and another question, and prints both TTFTs (the prefix cache's figure).
Standard library only (no client package needed).
"""
import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse

TOPICS = [
    "the history of the printing press", "how volcanoes form", "the rules of chess",
    "a day in the life of a lighthouse keeper", "why the sky is blue", "the water cycle",
    "how bread rises", "the first moon landing", "how bees make honey", "the invention of the telephone",
    "a recipe for tomato soup", "the life of a river", "how compilers work", "the Roman aqueducts",
    "migrating birds", "the northern lights", "the life cycle of a star", "how glaciers carve valleys",
    "the building of a cathedral", "how tides work",
]


def conn(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=3600)


def metric(url, name):
    try:
        c = conn(url)
        c.request("GET", "/metrics")
        body = c.getresponse().read().decode()
    except OSError:
        return None
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def stream_one(url, model, prompt, max_tokens, out, start_evt, delay=0.0):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    start_evt.wait()
    if delay:
        time.sleep(delay)
    t0 = time.perf_counter()
    c = conn(url)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        out.update(error=f"{r.status} {r.read()[:200]!r}")
        return
    chunks, ttft, usage = 0, None, None
    buf = b""
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"].get("completion_tokens")
        for ch in ev.get("choices", []):
            if ch.get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    out.update(t0=t0, t1=time.perf_counter(), ttft=ttft, chunks=chunks, tokens=usage or chunks)


def served_model(url):
    c = conn(url)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def run_clients(a, model):
    preamble = " ".join(f"word{i}" for i in range(a.shared_prefix)) + "\n" if a.shared_prefix else ""
    start = threading.Event()
    outs = [dict() for _ in range(a.clients)]
    threads = []
    rng, at, delays = random.Random(0), 0.0, []
    for i in range(a.clients):
        delays.append(at)
        if a.request_rate > 0:
            at += rng.expovariate(a.request_rate)
    for i in range(a.clients):
        j = a.first_prompt + i
        prompt = f"{preamble}Write a long essay about {TOPICS[j % len(TOPICS)]} (essay {j}).\n\n"
        t = threading.Thread(target=stream_one,
                             args=(a.url, model, prompt, a.max_tokens, outs[i], start, delays[i]))
        t.start()
        threads.append(t)
    bytes0 = metric(a.url, "strata_expert_read_bytes_total")
    gen0 = metric(a.url, "strata_generated_tokens_total")
    time.sleep(0.2)
    start.set()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise SystemExit(f"errors: {errors}")
    t0 = min(o["t0"] for o in outs)
    t1 = max(o["t1"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    res = {"clients": a.clients, "tokens": tokens, "wall_s": round(t1 - t0, 3),
           "tok_s": round(tokens / (t1 - t0), 2),
           "mean_ttft_s": round(sum(o["ttft"] or 0 for o in outs) / len(outs), 3),
           "per_client_tok_s": round(sum(o["tokens"] / (o["t1"] - o["t0"]) for o in outs) / len(outs), 2)}
    if a.request_rate > 0:
        res["request_rate"] = a.request_rate
        tpot = [(o["t1"] - o["t0"] - o["ttft"]) / (o["tokens"] - 1) for o in outs if o["ttft"] and o["tokens"] > 1]
        res["mean_tpot_ms"] = round(1e3 * sum(tpot) / max(len(tpot), 1), 2)
    bytes1 = metric(a.url, "strata_expert_read_bytes_total")
    gen1 = metric(a.url, "strata_generated_tokens_total")
    if None not in (bytes0, bytes1, gen0, gen1) and gen1 > gen0:
        res["expert_read_bytes_per_token"] = round((bytes1 - bytes0) / (gen1 - gen0))
    return res


def ttft_pair(a, model):
    preamble = " ".join(f"Rule {i}: answer politely and briefly." for i in range(a.ttft_pair // 8))
    res = {}
    for name, q in [("first", "What is rule 5?"), ("second", "What is the last rule?")]:
        out, start = {}, threading.Event()
        start.set()
        stream_one(a.url, model, f"{preamble}\nQuestion: {q}\nAnswer:", 4, out, start)
        if "error" in out:
            raise SystemExit(out["error"])
        res[f"{name}_ttft_s"] = round(out["ttft"], 3)
    res["ratio"] = round(res["second_ttft_s"] / res["first_ttft_s"], 3)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="requests per second (Poisson arrivals); 0: all at once")
    p.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("--first-prompt", type=int, default=0, help="client i sends prompt N + i")
    p.add_argument("--ttft-pair", type=int, default=0, help="words of shared preamble")
    p.add_argument("--label", default="")
    a = p.parse_args()
    model = served_model(a.url)
    res = ttft_pair(a, model) if a.ttft_pair else run_clients(a, model)
    res["label"] = a.label
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
