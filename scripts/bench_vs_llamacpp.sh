#!/usr/bin/env bash
# Alternating rounds of llama.cpp's llama-bench and `strata bench` on the same GGUF, threads and
# machine; prints each round's tok/s, the paired ratios (Strata / llama.cpp) and their medians
# (docs/performance.md, "CPU kernels"). llama.cpp is not part of Strata: build it with
# `../shared/tools/llamacpp.sh cpu DIR` and point LLAMA_BENCH at DIR's llama-bench.
#
#   LLAMA_BENCH=…/llama-bench [MODEL=…gguf] [PP="512"] [TG=128] [THREADS=2] [ROUNDS=3] [REPS=3]
#   [STRATA=./target/release/strata] [STRATA_ARGS="--stream-experts off"]
#   [LLAMA_PP_ARGS="--repack 0"] [LLAMA_TG_ARGS=…] scripts/bench_vs_llamacpp.sh
#
# LLAMA_PP_ARGS / LLAMA_TG_ARGS go to llama-bench's prompt / generation runs: on the Xeon VM
# (AMX) llama.cpp 0c1e570's default weight repacking crashes in prompt processing (SIGSEGV), so
# its prompt runs there need `--repack 0` while its generation runs keep the (faster) default.
# A llama-bench run that fails is reported and leaves that round's pair out.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary}"
M=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
T=${THREADS:-2}
R=${REPS:-3}
PP=${PP:-512}
TG=${TG:-128}
S=${STRATA:-./target/release/strata}
OUT=$(mktemp -d)
echo "model: $M, threads $T, pp [$PP], tg $TG, $R reps per run, ${ROUNDS:-3} rounds"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
echo "simd: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512[a-z_0-9]*)$' | sort | tr '\n' ' ')"
"$LLAMA_BENCH" --version 2>&1 | grep -i -E 'version|commit' | head -2 || true
echo "strata: $("$S" --version); llama-bench pp args: ${LLAMA_PP_ARGS:-none}, tg args: ${LLAMA_TG_ARGS:-none}"
last_pp=${PP##* }
for round in $(seq "${ROUNDS:-3}"); do
  for p in $PP; do
    # llama-bench: one markdown row per test; the value column is "mean ± sd".
    # shellcheck disable=SC2086
    { "$LLAMA_BENCH" -m "$M" -t "$T" -p "$p" -n 0 -r "$R" ${LLAMA_PP_ARGS:-} 2>/dev/null \
      || echo "note: llama-bench pp$p failed (exit $?)" >&2; } \
      | awk -F'|' -v r="$round" '/ pp[0-9]+ /{gsub(/ /,"",$(NF-2)); split($(NF-1),v," "); print "llama", r, $(NF-2), v[1]}' >>"$OUT/rows"
    n=0
    if [ "$p" = "$last_pp" ]; then
      # shellcheck disable=SC2086
      { "$LLAMA_BENCH" -m "$M" -t "$T" -p 0 -n "$TG" -r "$R" ${LLAMA_TG_ARGS:-} 2>/dev/null \
        || echo "note: llama-bench tg$TG failed (exit $?)" >&2; } \
        | awk -F'|' -v r="$round" '/ tg[0-9]+ /{gsub(/ /,"",$(NF-2)); split($(NF-1),v," "); print "llama", r, $(NF-2), v[1]}' >>"$OUT/rows"
      n=$TG
    fi
    # One load per call: the prompt test, and the generation test with the last prompt size.
    # shellcheck disable=SC2086
    "$S" bench -m "$M" -t "$T" -p "$p" -n "$n" -r "$R" --json ${STRATA_ARGS:-} 2>/dev/null \
      | python3 -c 'import json,sys; r=sys.argv[1]; [print("strata", r, x["test"], x["median_tok_s"]) for x in json.load(sys.stdin)["results"] if x["tokens"] > 0]' "$round" >>"$OUT/rows"
  done
  echo "## round $round"
  grep -E "^(llama|strata) $round " "$OUT/rows" | awk '{printf "  %-7s %-6s %8.2f tok/s\n", $1, $3, $4}'
done
python3 - "$OUT/rows" <<'EOF'
import collections, statistics, sys
v = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    who, rnd, test, tps = line.split()
    v[test].setdefault(rnd, {})[who] = float(tps)
print("| test | llama.cpp tok/s (median) | Strata tok/s (median) | paired ratios | median ratio |")
print("|---|---|---|---|---|")
for test, rounds in v.items():
    pairs = [(r["llama"], r["strata"]) for r in rounds.values() if "llama" in r and "strata" in r]
    if not pairs:
        continue
    ratios = [s / l for l, s in pairs]
    print(f"| {test} | {statistics.median(l for l, _ in pairs):.2f} | {statistics.median(s for _, s in pairs):.2f} "
          f"| {', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}×** |")
EOF
rm -r "$OUT"
