#!/usr/bin/env bash
# Batch-aware expert streaming: `strata serve --parallel CLIENTS --stream-experts on` on a synthetic
# MoE inside a memory cgroup (v1; root needed), 1 streaming client against CLIENTS at once.
#
#   bash scripts/bench_batching_stream.sh /path/q3-30b-realistic.gguf
#
# Model: `strata synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out FILE`.
# Each round starts a fresh server in the cgroup (page cache dropped), warms it with one 8-token
# request, then measures 1 client and CLIENTS clients (order alternating between rounds; every
# prompt a different one, so the warm-up's experts are no measured prompt's) with
# scripts/bench_batching.py: aggregate tok/s and drive bytes read per generated token (from
# /metrics). Prints the median paired ratios: aggregate (CLIENTS / 1) and bytes per token (CLIENTS / 1).
# Env: ROUNDS (2), CLIENTS (4), TOKENS (32), MEM (6 GiB), CTX (512 per slot), THREADS (2),
# PORT (8098), STRATA (target/release/strata), EXTRA (more serve flags).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?synthetic MoE GGUF}
ROUNDS=${ROUNDS:-2}; CLIENTS=${CLIENTS:-4}; TOKENS=${TOKENS:-32}; MEM=${MEM:-$((6 << 30))}
CTX=${CTX:-512}; THREADS=${THREADS:-2}; PORT=${PORT:-8098}; STRATA=$(realpath "${STRATA:-target/release/strata}")
CG=/sys/fs/cgroup/memory/strata_batch
mkdir -p $CG
OUT=$(mktemp)
echo "model: $MODEL | cgroup $((MEM >> 20)) MiB | $CLIENTS clients × $TOKENS tokens | $THREADS threads"

wait_up() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server did not come up" >&2; return 1
}

one() {  # CLIENTS LABEL FIRST_PROMPT
  python3 scripts/bench_batching.py --url "http://127.0.0.1:$PORT" --clients "$1" --max-tokens "$TOKENS" --first-prompt "$3" --label "$2" | tee -a "$OUT"
}

for r in $(seq 1 "$ROUNDS"); do
  echo 0 > $CG/memory.force_empty 2>/dev/null || true
  echo "$MEM" > $CG/memory.limit_in_bytes
  echo 0 > $CG/memory.max_usage_in_bytes; echo 0 > $CG/memory.failcnt
  sync; echo 3 > /proc/sys/vm/drop_caches
  bash -c "echo \$\$ > $CG/cgroup.procs; exec $STRATA serve --model $MODEL --parallel $CLIENTS --ctx-size $CTX --stream-experts on --prefix-cache 0 -t $THREADS --port $PORT ${EXTRA:-}" >/tmp/bench_batching_stream.log 2>&1 &
  pid=$!; wait_up
  python3 scripts/bench_batching.py --url "http://127.0.0.1:$PORT" --clients 1 --max-tokens 8 --first-prompt $((CLIENTS + 1)) --label warmup >/dev/null
  if [ $((r % 2)) -eq 1 ]; then one 1 x1 "$CLIENTS"; one "$CLIENTS" "x$CLIENTS" 0; else one "$CLIENTS" "x$CLIENTS" 0; one 1 x1 "$CLIENTS"; fi
  kill $pid; wait $pid 2>/dev/null || true
  echo "cgroup max usage $(( $(cat $CG/memory.max_usage_in_bytes) >> 20 )) MiB, failcnt $(cat $CG/memory.failcnt)"
done
grep -m1 "plan:" /tmp/bench_batching_stream.log || true

python3 - "$OUT" "$CLIENTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n = sys.argv[2]
one = [r for r in rows if r["label"] == "x1"]
many = [r for r in rows if r["label"] == f"x{n}"]
print("x1:", [(r["tok_s"], r.get("expert_read_bytes_per_token")) for r in one])
print(f"x{n}:", [(r["tok_s"], r.get("expert_read_bytes_per_token")) for r in many])
print(f"median aggregate x{n} / x1 (paired): {statistics.median(b['tok_s'] / a['tok_s'] for a, b in zip(one, many)):.2f}")
print(f"median drive bytes per token x{n} / x1 (paired): {statistics.median(b['expert_read_bytes_per_token'] / a['expert_read_bytes_per_token'] for a, b in zip(one, many)):.2f}")
EOF
