#!/bin/bash
# Estimated (plan) vs measured decode tok/s of the synthetic Qwen3-30B-A3B in memory cgroups of
# 6, 12 and 20 GiB (strata's default --stream-experts auto); prints one markdown row per cgroup.
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
# One row per cgroup: the plan line's strategy, cache, expected hit and estimate; the measured
# decode (the 32-token run's decode tok/s) and byte hit rate (1 − bytes read ÷ bytes touched).
for g in ${GIBS:-6 12 20}; do
  python3 - "$OUTDIR/p$g-32" "$g" <<'PY'
import json, re, sys
f, g = sys.argv[1], sys.argv[2]
d = json.load(open(f + ".json")); err = open(f + ".err").read()
line = next((l for l in err.splitlines() if l.startswith("plan: ")), "")
strategy = line.split()[1] if line else "?"
cache = re.search(r"expert cache ([\d.]+ GB)", line)
hit = re.search(r"expected hit rate (\d+)%, ([^)]*)\)", line)
est = float(re.search(r"est\. decode ([\d.]+)", line).group(1))
x = d.get("experts_decode") or {}
byte_hit = f"{100 * (1 - x['bytes_read'] / x['touched_bytes']):.1f}%" if x.get("touched_bytes") else "—"
meas = d["decode_tok_s"]
print(f"| {g} GiB | {strategy}{', ' + cache.group(1) + ' cache' if cache else ''} | {hit.group(1) + '% (' + hit.group(2) + ')' if hit else '—'} | {est:.1f} | {meas:.2f} | {byte_hit} | {100 * (est - meas) / meas:+.0f}% |")
PY
done
