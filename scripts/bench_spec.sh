#!/usr/bin/env bash
# Speculative decoding benchmarks (docs/performance.md, "Speculative decoding").
#  1. SmolLM2-135M Q4_1, resident, input-grounded tasks (scripts/spec_rewrite_prompt.txt: rename
#     one function in a code listing, chat; scripts/spec_config_prompt.txt and
#     scripts/spec_rename_fewshot_prompt.txt: raw completions): plain decoding vs n-gram,
#     self-draft, fixed and adaptive.
#  2. The synthetic qwen3-30b-a3b Q4_K ($MOE, `strata synth --preset qwen3-30b-a3b`) with streamed
#     experts, expert cache 25% of expert bytes, page cache dropped before every run (cold), in a
#     6 GiB memory cgroup (v1, needs root): plain vs adaptive vs fixed N=4.
#  3. PART=dflash: the same model and cgroup with a random-weight DFlash draft (`strata synth
#     --dflash-draft-for`, 2 layers, block 16; acceptance ≈ 0 like the fixture's draft_random),
#     expert cache $DFLASH_CACHE (default 2500MiB) for every run: plain vs --dflash adaptive vs
#     --dflash fixed (the whole block verified every round).
# Every run prints decode tok/s and the speculation stats line; greedy tokens must be identical.
set -euo pipefail
cd "$(dirname "$0")/.."
S=${STRATA:-./target/release/strata}
N=${TOKENS:-256}
EOS_FLAG=--ignore-eos
T=${THREADS:-2}
run() { # label, args...
  local label=$1; shift
  local out
  out=$("$S" generate --temp 0 $EOS_FLAG --json -t "$T" "$@" 2>/dev/null)
  python3 - "$label" "$out" <<'PY'
import json, sys, hashlib
label, d = sys.argv[1], json.loads(sys.argv[2])
s = d.get("spec")
ids = hashlib.sha1(json.dumps(d["generated_token_ids"]).encode()).hexdigest()[:10]
extra = ""
if s:
    extra = f" | acceptance {s['acceptance_rate']:.2f}, {s['mean_accepted_length']:.2f} tok/round, N hist {s['n_hist']}"
    if s.get("mean_fanout"):
        extra += f", fan-out {s['mean_fanout']:.1f}"
print(f"{label:<34} decode {d['decode_tok_s']:7.2f} tok/s  tokens {ids}{extra}", flush=True)
PY
}
if [ "${PART:-all}" = dflash ]; then
  MOE=${MOE:-/work/bench/q3-30b-q4k.gguf}
  NM=${MOE_TOKENS:-48}
  DRAFT=${DFLASH_DRAFT:-$(dirname "$MOE")/dflash-random-$(basename "$MOE" .gguf)}
  [ -f "$DRAFT/model.safetensors" ] || "$S" synth --dflash-draft-for "$MOE" --out "$DRAFT" --layers 2 --block-size 16
  echo "## synthetic qwen3-30b-a3b Q4_K + random DFlash draft, streamed experts, cache ${DFLASH_CACHE:-2500MiB}, cold page cache, 6 GiB cgroup, $NM tokens"
  CG=/sys/fs/cgroup/memory/strata6g
  mkdir -p $CG
  echo $((6*1024*1024*1024)) > $CG/memory.limit_in_bytes
  cold() { sync; echo 3 > /proc/sys/vm/drop_caches; echo $$ > $CG/cgroup.procs; }
  # One expert cache size for every run: the plan shrinks a 25% cache to make room for the draft's
  # weights (0.49 GB as f32), which would compare the policy against plain decoding with more cache.
  Q=(-m "$MOE" --prompt "The quick brown fox jumps over the lazy dog. The quick brown fox" -n "$NM" --ctx-size 512 --stream-experts --expert-cache "${DFLASH_CACHE:-2500MiB}")
  for rep in 1 2; do
    cold; run "plain ($rep)" "${Q[@]}"
    cold; run "dflash adaptive ($rep)" "${Q[@]}" --dflash --draft-model "$DRAFT"
  done
  cold; run "dflash fixed 15 (whole block)" "${Q[@]}" --dflash --draft-model "$DRAFT" --draft-policy fixed
  exit 0
fi
if [ "${PART:-all}" != moe ]; then
  echo "## SmolLM2-135M Q4_1, resident, $N tokens, $T threads, code-rewrite prompt"
  P=(-m models/SmolLM2-135M-Instruct.Q4_1.gguf --chat "$(cat scripts/spec_rewrite_prompt.txt)" -n "$N")
  run plain "${P[@]}"
  run "ngram adaptive (max 8)" "${P[@]}" --spec ngram --num-draft-tokens 8
  run "ngram adaptive (max 4)" "${P[@]}" --spec ngram
  run "ngram fixed 4" "${P[@]}" --spec ngram --draft-policy fixed
  run "ngram fixed 8" "${P[@]}" --spec ngram --draft-policy fixed --num-draft-tokens 8
  for L in 8 15 22; do
    run "self L=$L adaptive" "${P[@]}" --spec self --draft-layers $L
  done
  run "self L=22 fixed 4" "${P[@]}" --spec self --draft-layers 22 --draft-policy fixed
  # Raw-completion prompts: a config file "with one change" (the 135M model copies the file, then
  # stops: run to its own end of text, no --ignore-eos), and a one-example few-shot rename of the
  # listing above (the model writes a short wrapper, then repeats its own pattern; --ignore-eos).
  # Three alternating rounds each.
  for F in spec_config_prompt spec_rename_fewshot_prompt; do
    if [ $F = spec_config_prompt ]; then EOS_FLAG=; else EOS_FLAG=--ignore-eos; fi
    echo "## SmolLM2-135M Q4_1, resident, up to $N tokens ($EOS_FLAG), $T threads, raw prompt scripts/$F.txt"
    R=(-m models/SmolLM2-135M-Instruct.Q4_1.gguf --prompt-file "scripts/$F.txt" -n "$N")
    for rep in 1 2 3; do
      run "plain ($rep)" "${R[@]}"
      run "ngram fixed 4 ($rep)" "${R[@]}" --spec ngram --draft-policy fixed
      run "ngram adaptive, max 4 ($rep)" "${R[@]}" --spec ngram
    done
  done
  EOS_FLAG=--ignore-eos
fi
if [ "${PART:-all}" != smollm2 ]; then
  MOE=${MOE:-/work/bench/q3-30b-q4k.gguf}
  NM=${MOE_TOKENS:-32}
  echo "## $(basename "$MOE"), streamed experts, cache ${MOE_CACHE:-auto}, cold page cache, 6 GiB cgroup, $NM tokens"
  CG=/sys/fs/cgroup/memory/strata6g
  mkdir -p $CG
  echo $((6*1024*1024*1024)) > $CG/memory.limit_in_bytes
  cold() { sync; echo 3 > /proc/sys/vm/drop_caches; echo $$ > $CG/cgroup.procs; }
  Q=(-m "$MOE" --prompt "The quick brown fox jumps over the lazy dog. The quick brown fox" -n "$NM" --ctx-size 512 --stream-experts --expert-cache "${MOE_CACHE:-auto}")
  cold; run plain "${Q[@]}"
  cold; run "ngram adaptive" "${Q[@]}" --spec ngram --ngram-min 1
  cold; run "ngram fixed 4" "${Q[@]}" --spec ngram --ngram-min 1 --draft-policy fixed
  cold; run "self L=12 adaptive" "${Q[@]}" --spec self --draft-layers 12
  cold; run "self L=12 fixed 4" "${Q[@]}" --spec self --draft-layers 12 --draft-policy fixed
fi
