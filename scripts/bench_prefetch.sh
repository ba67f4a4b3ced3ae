#!/usr/bin/env bash
# Expert prefetch and the bundled layout (issue 6; docs/performance.md, "Prefetch and bundled
# layout"). The synthetic qwen3-30b-a3b Q4_K ($MOE; `strata synth --preset qwen3-30b-a3b`) and its
# `strata repack` copy ($BUNDLED), streamed experts, expert cache $CACHE (default 25%), page cache
# dropped before every run (cold), in a 6 GiB memory cgroup (v1, needs root), greedy, $TOKENS
# tokens: every --prefetch predictor on both layouts. Prints decode tok/s, hit rate, MB read and
# stall per token, GB/s while reading, prefetch reads used, every predictor's precision/recall;
# greedy tokens must be identical across runs (same hash).
set -euo pipefail
cd "$(dirname "$0")/.."
S=$PWD/target/release/strata
MOE=${MOE:-/work/bench/q3-30b-q4k.gguf}
BUNDLED=${BUNDLED:-${MOE%.gguf}-bundled.gguf}
N=${TOKENS:-32}
CACHE=${CACHE:-25%}
[ -f "$BUNDLED" ] || "$S" repack "$MOE" "$BUNDLED"
CG=/sys/fs/cgroup/memory/strata6g
mkdir -p $CG
echo $((6*1024*1024*1024)) > $CG/memory.limit_in_bytes
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; echo $$ > $CG/cgroup.procs; }
run() { # label, args...
  local label=$1; shift
  local out
  cold
  out=$("$S" generate --temp 0 --ignore-eos --json -t 2 --prompt "The quick brown fox jumps over the lazy dog" \
        -n "$N" --ctx-size 512 --stream-experts --expert-cache "$CACHE" ${EXTRA:-} "$@" 2>/dev/null)
  python3 - "$label" "$out" <<'PY'
import json, sys, hashlib
label, d = sys.argv[1], json.loads(sys.argv[2])
x, p = d["experts_decode"], d.get("prefetch_decode")
n = max(d["generated_tokens"] - 1, 1)
ids = hashlib.sha1(json.dumps(d["generated_token_ids"]).encode()).hexdigest()[:10]
hits = x["hits"] / max(x["hits"] + x["misses"], 1)
gbps = x["bytes_read"] / max(x["io_busy_ns"], 1)
line = (f"{label:<28} decode {d['decode_tok_s']:5.2f} tok/s | hit {100*hits:4.1f}% | read {x['bytes_read']/1e6/n:6.1f} MB/tok"
        f" at {gbps:4.2f} GB/s | {x['reads']/n:5.1f} reads/tok | stall {x['stall_ns']/1e6/n:6.1f} ms/tok"
        f" | prefetched {x['prefetch_reads']/n:4.1f}/tok, {100*x['prefetch_used']/max(x['prefetch_reads'],1):3.0f}% used"
        f" | uncached precision {x['prefetch_candidates_used']/max(x['prefetch_candidates'],1):.2f} of {x['prefetch_candidates']/n:4.1f}/tok")
if p:
    f = lambda s: f"{s['correct']/max(s['predicted'],1):.2f}/{s['correct']/max(s['actual'],1):.2f}"
    line += f" | P/R pregate {f(p['pregate'])} previous {f(p['previous'])} union {f(p['union'])}"
print(line + f" | tokens {ids}", flush=True)
PY
}
echo "## $(basename "$MOE"), cache $CACHE, cold, 6 GiB cgroup, $N tokens, 2 threads ${EXTRA:-}"
# LAYOUTS="original bundled" (default both); PREFETCH: the predictors; GATE: --prefetch-min-precision
# values (2 = never read: the predictor is only measured; 0 = always read).
for P in ${PREFETCH:-off union pregate previous}; do
  GATES=${GATE:-0.5}
  [ "$P" = off ] && GATES=${GATES%% *} # the gate does not apply: one run
  for G in $GATES; do
    for L in ${LAYOUTS:-original bundled}; do
      M=$MOE; [ "$L" = bundled ] && M=$BUNDLED
      run "$L --prefetch $P gate $G" -m "$M" --prefetch "$P" --prefetch-min-precision "$G"
    done
  done
done
