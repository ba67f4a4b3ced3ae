#!/usr/bin/env bash
# llama.cpp's mmap path on the same GGUF in the same memory cgroup as Strata's streamed runs
# (docs/performance.md, "Realistic routing"): page cache dropped, `llama-completion` with
# `--no-repack` (its CPU repack copies the mapped weights into anonymous memory and is OOM-killed
# under a limit), greedy, $TOKENS tokens, for each read-ahead setting in $READAHEAD_KB (the
# drive's queue/read_ahead_kb, restored afterwards) and each cgroup size in $GIBS.
# llama.cpp ignores Strata's routing-override metadata: it routes a synthetic file by its random
# routers (local routing), which favours its page cache.
#   LLAMA=/work/llama/bin MODEL=/work/bench/q3-30b-realistic.gguf bash scripts/bench_llamacpp_mmap.sh
set -euo pipefail
LLAMA=${LLAMA:?directory with llama-completion (../shared/tools/llamacpp.sh cpu DIR)}
MODEL=${MODEL:?GGUF}
N=${TOKENS:-8}
dev=$(lsblk -no PKNAME "$(df --output=source "$MODEL" | tail -1)" 2>/dev/null || true)
dev=${dev:-$(basename "$(df --output=source "$MODEL" | tail -1)")}
ra=/sys/block/$dev/queue/read_ahead_kb
orig=$(cat "$ra")
trap 'echo "$orig" > "$ra"' EXIT
for g in ${GIBS:-6}; do
  cg=/sys/fs/cgroup/memory/strata${g}g; mkdir -p "$cg"; echo $((g << 30)) > "$cg/memory.limit_in_bytes"
  for kb in ${READAHEAD_KB:-$orig 128}; do
    echo "$kb" > "$ra"
    sync; echo 3 > /proc/sys/vm/drop_caches
    out=$(bash -c "echo \$\$ > $cg/cgroup.procs; exec $LLAMA/llama-completion -m $MODEL -p 'The quick brown fox jumps over the lazy dog' -n $N -t 2 --temp 0 -c 512 --no-warmup --no-repack -no-cnv" 2>&1 </dev/null || true)
    # "prompt eval time = … (… tokens per second)" and "eval time = … / N runs (… tokens per second)"
    pp=$(echo "$out" | grep -E "prompt eval time" | tail -1 | sed -E 's/.*, *([0-9.]+) tokens per second.*/\1/')
    tg=$(echo "$out" | grep -E "[^t] eval time|^ *eval time|: +eval time" | grep -v prompt | tail -1 | sed -E 's/.*, *([0-9.]+) tokens per second.*/\1/')
    echo "| ${g} GiB | read_ahead_kb $kb | prefill ${pp:-failed} tok/s | decode ${tg:-failed} tok/s |"
  done
done
