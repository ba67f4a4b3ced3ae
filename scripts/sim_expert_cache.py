#!/usr/bin/env python3
"""Expert-cache simulator on recorded routing traces: drive reads per generated token for one
sequence decoding alone against N sequences decoding in one batch (each step reads the union of its
tokens' experts per layer once), under several eviction policies and Belady's optimal policy (the
lower bound of any policy; L. A. Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966).

    python3 scripts/sim_expert_cache.py --capacity 810 a.json b.json c.json d.json

Traces: `strata generate --routing-trace FILE` (`{"experts", "top_k", "layers", "tokens":
[token][moe layer][top_k]}`). One cache shared by every layer, as Strata's host expert cache is;
a step's experts of the current layer are never evicted while that layer is read. Decode steps only
(no prefill, no prefetch). Prints one JSON line per policy: misses per generated token alone (mean
over the traces) and batched, and their ratio.
"""
import argparse
import heapq
import json
import math


def load(path):
    t = json.load(open(path))
    return t["tokens"], t["experts"]


def steps_alone(trace):
    """One sequence: each step is one token's experts per layer."""
    return [[sorted(set(layer)) for layer in tok] for tok in trace]


def steps_batched(traces):
    """N sequences in lockstep: each step's experts per layer are the union over live sequences."""
    n = max(len(t) for t in traces)
    out = []
    for s in range(n):
        live = [t[s] for t in traces if s < len(t)]
        out.append([sorted(set().union(*(tok[l] for tok in live))) for l in range(len(live[0]))])
    return out


def accesses(steps):
    """Flattened (group, key) accesses; a group is one (step, layer)."""
    acc = []
    for s, layers in enumerate(steps):
        for l, ids in enumerate(layers):
            g = s * len(layers) + l
            acc.extend((g, (l, e)) for e in ids)
    return acc


def simulate(steps, capacity, policy):
    """Misses (expert reads) of `steps` under `policy` with room for `capacity` experts."""
    acc = accesses(steps)
    if policy == "belady":
        return belady(acc, capacity)
    per_group = len(steps[0]) if steps else 1
    decay = float(policy.split(":")[1]) if policy.startswith("lrfu:") else None
    cache = {}  # key -> (score, [last, prev, count, crf])
    heap = []
    tick = misses = 0
    current = -1
    protect = set()

    def score(u):
        if decay is not None:
            # LRFU (Lee et al., IEEE Trans. Computers 50(12), 2001) with time in decode steps: the
            # combined recency-frequency value C * decay^(now - last), ordered by ln C - last ln decay.
            return (math.log(u[3]) - u[0] * math.log(decay),)
        return {"lru": (u[0],), "lru2": (u[1], u[0]), "lfu": (u[2], u[0])}[policy]

    for g, k in acc:
        if g != current:
            current = g
            protect = group_keys(steps, g, per_group)
        tick += 1
        now = tick if decay is None else g // per_group
        if k in cache:
            u = cache[k][1]
            if decay is not None:
                u[3] = u[3] * decay ** (now - u[0]) + 1.0
            u[1], u[0], u[2] = u[0], now, u[2] + 1
        else:
            misses += 1
            if len(cache) >= capacity:
                held = []
                while True:
                    sc, x = heapq.heappop(heap)
                    if x not in cache or cache[x][0] != sc:
                        continue
                    if x in protect:
                        held.append((sc, x))
                        continue
                    del cache[x]
                    break
                for h in held:
                    heapq.heappush(heap, h)
            u = [now, 0, 1, 1.0]
        sc = score(u)
        cache[k] = (sc, u)
        heapq.heappush(heap, (sc, k))
    return misses


def group_keys(steps, g, per_group):
    s, l = divmod(g, per_group)
    return {(l, e) for e in steps[s][l]}


def belady(acc, capacity):
    """Optimal offline eviction: drop the cached expert whose next use is furthest away."""
    nxt = [0] * len(acc)
    seen = {}
    inf = len(acc) + 1
    for i in range(len(acc) - 1, -1, -1):
        k = acc[i][1]
        nxt[i] = seen.get(k, inf)
        seen[k] = i
    cache = {}  # key -> next use
    heap = []
    misses = 0
    for i, (g, k) in enumerate(acc):
        if k not in cache:
            misses += 1
            if len(cache) >= capacity:
                while True:
                    neg, x = heapq.heappop(heap)
                    if x in cache and cache[x] == -neg:
                        del cache[x]
                        break
        cache[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return misses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--capacity", type=int, nargs="+", required=True, help="cache sizes in experts")
    ap.add_argument("--policies", default="lru,lru2,lfu,lrfu:0.5,lrfu:0.8,belady")
    a = ap.parse_args()
    traces = [load(p)[0] for p in a.traces]
    tokens = sum(len(t) for t in traces)
    for capacity, policy in ((c, p) for c in a.capacity for p in a.policies.split(",")):
        alone = sum(simulate(steps_alone(t), capacity, policy) for t in traces) / tokens
        batched = simulate(steps_batched(traces), capacity, policy) / tokens
        print(json.dumps({
            "policy": policy, "capacity": capacity, "sequences": len(traces),
            "tokens": tokens, "reads_per_token_alone": round(alone, 2),
            "reads_per_token_batched": round(batched, 2),
            "batched_over_alone": round(batched / alone, 3),
        }))


if __name__ == "__main__":
    main()
