#!/usr/bin/env bash
# Streaming figures on realistic and uniform routing (issue 21; docs/performance.md, "Realistic
# routing"). Needs root (memory cgroups v1, drop_caches) and the synthetic Qwen3-30B-A3B written
# with each routing:
#   strata synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $DIR/q3-30b-realistic.gguf
#   strata synth --preset qwen3-30b-a3b --quant Q4_K --routing uniform   --out $DIR/q3-30b-uniform.gguf
# PARTS (default all): report (routing statistics, resident, 256 tokens), stream (6 and 12 GiB
# cgroups, cache sizes, prefetch off/pregate, buffered/O_DIRECT), policy (eviction policies at 10%).
# Every streamed run: page cache dropped, greedy, 43-token prompt, $TOKENS tokens; one line with
# decode tok/s, hit rate, MB read per token, GB/s while reading, stall, and the read floor
# (resident decode time + miss bytes ÷ the drive's peak $PEAK GB/s, from `strata bench --disk`).
set -euo pipefail
cd "$(dirname "$0")/.."
S=${STRATA:-$PWD/target/release/strata}
DIR=${DIR:-/work/bench}
ROUTINGS=${ROUTINGS:-realistic uniform}
N=${TOKENS:-32}
PEAK=${PEAK:-1.6}
OUT=${OUT:-/tmp/bench-routing}
mkdir -p "$OUT"
cg() { # GiB -> cgroup dir
  local d=/sys/fs/cgroup/memory/strata$1g
  mkdir -p "$d"; echo $(($1 * 1024 * 1024 * 1024)) > "$d/memory.limit_in_bytes"; echo "$d"
}
summary() { # label json resident_ms
  python3 - "$@" <<'PY'
import json, sys, hashlib
label, path, resident_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
d = json.load(open(path))
x = d["experts_decode"]; n = max(d["generated_tokens"] - 1, 1)
hits = x["hits"] / max(x["hits"] + x["misses"], 1)
mb = x["bytes_read"] / 1e6 / n
gbps = x["bytes_read"] / max(x["io_busy_ns"], 1)
peak = float(sys.argv[4])
floor_ms = resident_ms + mb / 1e3 / peak * 1e3
tok = d["decode_tok_s"]
ids = hashlib.sha1(json.dumps(d["generated_token_ids"]).encode()).hexdigest()[:10]
pf = x["prefetch_reads"] / n
print(f"| {label} | {tok:.2f} | {100*hits:.1f}% | {mb:.1f} | {gbps:.2f} ({100*gbps/peak:.0f}%) | {x['stall_ns']/1e6/n:.1f} | {pf:.1f} ({100*x['prefetch_used']/max(x['prefetch_reads'],1):.0f}% used) | {1e3/floor_ms:.2f} | {100*tok*floor_ms/1e3:.0f}% | {ids} |", flush=True)
PY
}
stream() { # routing gib label args...
  local r=$1 g=$2 label=$3; shift 3
  local d; d=$(cg "$g")
  local f="$OUT/$r-$g-$(echo "$label" | tr ' %/' '_p_').json"
  sync; echo 3 > /proc/sys/vm/drop_caches
  bash -c "echo \$\$ > $d/cgroup.procs; exec $S generate -m $DIR/q3-30b-$r.gguf --prompt 'The quick brown fox jumps over the lazy dog' -n $N --ignore-eos --temp 0 --ctx-size 512 -t 2 --json --stream-experts $*" > "$f" 2> "${f%.json}.err" || { echo "| $label | failed: $(tail -1 "${f%.json}.err") |"; return; }
  summary "$label, $g GiB" "$f" "$(cat "$OUT/$r-resident-ms")" "$PEAK"
}
for r in $ROUTINGS; do
  M=$DIR/q3-30b-$r.gguf
  echo "## $r routing ($M), $N tokens, 2 threads, drive peak $PEAK GB/s"
  if [[ ${PARTS:-all} == all || ${PARTS} == *report* ]]; then
    # Resident (no cgroup): the routing statistics of 256 greedy tokens and the compute floor.
    "$S" bench --routing -m "$M" -n 256 --routing-temp 0 -t 2 --ctx-size 1024 --json > "$OUT/$r-report.json"
    python3 - "$OUT/$r-report.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = d["routing"]
print(f"resident decode {d['decode_tok_s']:.2f} tok/s; reuse {r['reuse']['mean']:.3f} ({r['reuse']['min']:.3f}-{r['reuse']['max']:.3f}), zipf {r['zipf']['mean']:.2f}, top expert {100*r['top_expert_share']:.1f}%, 90% mass {100*r['experts_for_90_percent']:.0f}% of experts")
print("LRU per layer: " + ", ".join(f"{100*p['fraction']:.1f}%: {100*p['hit_rate']:.1f}%" for p in r["lru_per_layer"]))
print("LRU shared:    " + ", ".join(f"{100*p['fraction']:.1f}%: {100*p['hit_rate']:.1f}%" for p in r["lru_shared"]))
print("predictors (P/R): " + ", ".join(f"{n} {f['precision']:.2f}/{f['recall']:.2f}" for n, f in r["predictors"]))
open(sys.argv[1].replace("-report.json", "-resident-ms"), "w").write(f"{1e3/d['decode_tok_s']:.2f}")
PY
  fi
  [ -f "$OUT/$r-resident-ms" ] || { echo "run PARTS=report first (resident decode time)"; exit 1; }
  echo "| run | decode tok/s | hit rate | MB read / token | GB/s while reading (of peak) | stall ms / token | prefetched / token | floor tok/s | of floor | tokens |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  if [[ ${PARTS:-all} == all || ${PARTS} == *stream* ]]; then
    # 6 GiB holds the plan's cache (auto: 2.45 GB, 15% of the experts) and 10%; 25% (4.08 GB)
    # does not fit there (dense 0.91 GB + candle's repacked dense copies 2.7 GB after a prefill
    # + cache), so it runs in 12 GiB beside the auto cache.
    for c in auto 10%; do
      stream "$r" 6 "cache $c, prefetch off" --expert-cache "$c" --prefetch off
      stream "$r" 6 "cache $c, prefetch pregate" --expert-cache "$c"
      stream "$r" 6 "cache $c, prefetch pregate, O_DIRECT" --expert-cache "$c" --direct-io
    done
    stream "$r" 12 "cache 25%, prefetch off" --expert-cache 25% --prefetch off
    stream "$r" 12 "cache 25%, prefetch pregate" --expert-cache 25%
    stream "$r" 12 "cache auto, prefetch pregate" --expert-cache auto
    stream "$r" 12 "cache auto, prefetch pregate, O_DIRECT" --expert-cache auto --direct-io
  fi
  if [[ ${PARTS:-all} == all || ${PARTS} == *policy* ]]; then
    for p in lru lru2 lfu; do
      stream "$r" 6 "cache 10%, $p, prefetch off" --expert-cache 10% --prefetch off --expert-cache-policy "$p"
    done
  fi
done
