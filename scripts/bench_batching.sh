#!/usr/bin/env bash
# Continuous batching against llama-server, alternating rounds on the same GGUF and machine.
#
#   LLAMA=/path/to/llama.cpp/bin bash scripts/bench_batching.sh [MODEL]
#
# Each round: `strata serve --parallel P` then `llama-server -np P -c P·CTX` (continuous batching
# is llama-server's default), both with THREADS threads; against each, 1 streaming client, then
# CLIENTS at once (scripts/bench_batching.py: max_tokens TOKENS, ignore_eos, temperature 0, a prompt
# of each client's own), after an untimed 8-token warm-up request; every measured prompt is new to
# the server (CLIENTS ≤ 18). Prints one JSON line per
# measurement, then the median ratios:
# Strata CLIENTS / Strata 1 (the batching gain) and Strata / llama-server at CLIENTS.
# Build llama.cpp with `bash ../shared/tools/llamacpp.sh cpu DIR` (LLAMA=DIR/bin).
# Env: ROUNDS (3), CLIENTS (8), TOKENS (128), CTX (1024 per slot), THREADS (2), PORT (8097),
# STRATA (target/release/strata), EXTRA (more `strata serve` flags), LLAMA_EXTRA (more
# `llama-server` flags, e.g. "-ngl 99 -fa on" on a GPU), SKIP_LLAMA=1, RATE (requests per second
# of the CLIENTS run as Poisson arrivals, so new prompts meet running decodes; default: all at
# once).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-3}; CLIENTS=${CLIENTS:-8}; TOKENS=${TOKENS:-128}; CTX=${CTX:-1024}
THREADS=${THREADS:-2}; PORT=${PORT:-8097}; STRATA=${STRATA:-target/release/strata}
OUT=$(mktemp)
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) | flags: $(grep -m1 -o 'avx512[a-z_]*\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "model: $MODEL | $CLIENTS clients × $TOKENS tokens | ctx $CTX per slot | $THREADS threads"

wait_up() {
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server did not come up" >&2; return 1
}

measure() {  # NAME: an untimed warm-up request (a GPU's first pass loads modules and captures
  # graphs; llama-server warms itself up at start), then one client, then CLIENTS. Each measured
  # prompt is new to the server (prompts CLIENTS + 1, CLIENTS, then 0 .. CLIENTS − 1), so none
  # is in its prefix cache: one client pays its prompt's prefill as each of the CLIENTS does.
  python3 scripts/bench_batching.py --url "http://127.0.0.1:$PORT" --clients 1 --max-tokens 8 --first-prompt $((CLIENTS + 1)) --label warmup >/dev/null
  python3 scripts/bench_batching.py --url "http://127.0.0.1:$PORT" --clients 1 --max-tokens "$TOKENS" --first-prompt "$CLIENTS" --label "$1 x1" | tee -a "$OUT"
  python3 scripts/bench_batching.py --url "http://127.0.0.1:$PORT" --clients "$CLIENTS" --max-tokens "$TOKENS" --request-rate "${RATE:-0}" --label "$1 x$CLIENTS" | tee -a "$OUT"
}

for r in $(seq 1 "$ROUNDS"); do
  $STRATA serve --model "$MODEL" --parallel "$CLIENTS" --ctx-size "$CTX" -t "$THREADS" --port "$PORT" ${EXTRA:-} >/tmp/bench_batching_strata.log 2>&1 &
  pid=$!; wait_up; measure strata; kill $pid; wait $pid 2>/dev/null || true
  if [ -z "${SKIP_LLAMA:-}" ]; then
    "${LLAMA:?LLAMA=llama.cpp bin dir}/llama-server" -m "$MODEL" -np "$CLIENTS" -c $((CLIENTS * CTX)) -t "$THREADS" --port "$PORT" ${LLAMA_EXTRA:-} >/tmp/bench_batching_llama.log 2>&1 &
    pid=$!; wait_up; measure llama-server; kill $pid; wait $pid 2>/dev/null || true
  fi
done

python3 - "$OUT" "$CLIENTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
n = sys.argv[2]
def runs(label): return [r["tok_s"] for r in rows if r["label"] == label]
s1, sn, ln = runs("strata x1"), runs(f"strata x{n}"), runs(f"llama-server x{n}")
print(f"strata x1 tok/s {s1} | strata x{n} {sn} | llama-server x{n} {ln} | llama-server x1 {runs('llama-server x1')}")
print(f"median batching gain (strata x{n} / x1, paired): {statistics.median(b / a for a, b in zip(s1, sn)):.2f}")
l1 = runs("llama-server x1")
if ln and l1:
    print(f"median llama-server batching gain (x{n} / x1, paired): {statistics.median(b / a for a, b in zip(l1, ln)):.2f}")
if ln:
    print(f"median strata / llama-server at x{n} (paired): {statistics.median(a / b for a, b in zip(sn, ln)):.2f}")
EOF
