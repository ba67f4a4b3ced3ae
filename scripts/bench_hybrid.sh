#!/usr/bin/env bash
# Hybrid-model benchmarks (docs/performance.md, "Hybrid models").
#  1. Rollback cost at Qwen3.5-122B-A10B's recurrent-state size (examples/rollback_cost.rs):
#     checkpoint copy, one token's state update, restore + replay vs one state per position.
#  2. The synthetic qwen3.5-122b-a10b Q4_K cut to $LAYERS layers ($M, `strata synth --preset
#     qwen3.5-122b-a10b --layers 12`, uniform routing) with streamed experts, expert cache sized by the plan, page
#     cache dropped before every run, in a 6 GiB memory cgroup (v1, needs root): the plan, plain
#     decoding, and self-draft / n-gram speculation (greedy tokens must be identical).
set -euo pipefail
cd "$(dirname "$0")/.."
S=./target/release/strata
T=${THREADS:-2}
N=${TOKENS:-16}
M=${M:-/work/bench/q35-122b-l12-q4k.gguf}
echo "## rollback cost (Qwen3.5-122B-A10B state)"
cargo run -q --release -p strata-models --example rollback_cost 4
[ -f "$M" ] || { echo "no $M: strata synth --preset qwen3.5-122b-a10b --layers 12 --out $M"; exit 0; }
echo "## $M, streamed experts, plan-sized cache, cold page cache, 6 GiB cgroup, $N tokens"
CG=/sys/fs/cgroup/memory/strata6g
mkdir -p $CG
echo $((6*1024*1024*1024)) > $CG/memory.limit_in_bytes
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; echo $$ > $CG/cgroup.procs; }
Q=(-m "$M" --prompt "The quick brown fox jumps over the lazy dog. The quick brown fox" -n "$N" --ctx-size 512 --stream-experts)
cold; "$S" info "${Q[@]:0:2}" --ctx-size 512 --stream-experts | grep -E "memory|strategy|estimate|overcommit"
run() { # label, args...
  local label=$1; shift
  echo "### $label"
  "$S" generate --temp 0 --ignore-eos -t "$T" "$@" 2>&1 >/dev/null | grep -E "^(prompt|experts|spec|decode)" || true
}
cold; run plain "${Q[@]}"
cold; run "self L=3 adaptive" "${Q[@]}" --spec self --draft-layers 3
cold; run "ngram adaptive" "${Q[@]}" --spec ngram --ngram-min 1
