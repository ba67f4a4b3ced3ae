#!/bin/bash
# Estimated (plan) vs measured decode tok/s of the synthetic Qwen3-30B-A3B in memory cgroups of
# 6, 12 and 20 GiB (strata's default --stream-experts auto). Decode = 32-token run minus 1-token run.
set -e
CG=/sys/fs/cgroup/memory/strata_plan
mkdir -p $CG
run() { # GiB TOKENS OUT
  echo $(($1*1024*1024*1024)) > $CG/memory.limit_in_bytes
  sync; echo 3 > /proc/sys/vm/drop_caches
  bash -c "echo \$\$ > $CG/cgroup.procs; exec $STRATA generate -m $MODEL --prompt 'The quick brown fox jumps over the lazy dog' --max-tokens $2 --ignore-eos --temp 1.0 --seed 7 --ctx-size 512 --json" > $3.json 2> $3.err
}
for g in ${GIBS:-6 12 20}; do
  run $g 1 $OUTDIR/p$g-1
  run $g 32 $OUTDIR/p$g-32
done
