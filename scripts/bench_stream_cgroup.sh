#!/bin/bash
# Runs strata generate on the synthetic Qwen3-30B-A3B inside a memory cgroup (v1; 6 GiB unless GIB
# says), caches dropped first. STRATA, MODEL, TOKENS, TEMP and EXTRA (more generate flags) override.
set -e
CG=/sys/fs/cgroup/memory/strata6g
mkdir -p $CG
echo 0 > $CG/memory.force_empty 2>/dev/null || true
echo $((${GIB:-6}*1024*1024*1024)) > $CG/memory.limit_in_bytes
echo 0 > $CG/memory.max_usage_in_bytes 2>/dev/null || true
sync; echo 3 > /proc/sys/vm/drop_caches
bash -c "echo \$\$ > $CG/cgroup.procs; exec ${STRATA:-/work/main/target/release/strata} generate -m ${MODEL:-/work/bench/q3-30b-q4k.gguf} --prompt 'The quick brown fox jumps over the lazy dog' --max-tokens ${TOKENS:-16} --ignore-eos --temp ${TEMP:-0} --seed 7 --ctx-size 512 --stream-experts ${EXTRA:-} --json"
echo "cgroup max usage: $(cat $CG/memory.max_usage_in_bytes) failcnt: $(cat $CG/memory.failcnt)"
