#!/usr/bin/env bash
# Coverage-guided fuzzing of the hostile-input surfaces (issue 22): GGUF files, safetensors files,
# OpenAI request bodies. Targets live in fuzz/ (cargo-fuzz layout, libFuzzer); each runs for
# $SECONDS_PER_TARGET (default 600) seeded with the committed corpus and fixtures. Crashes land in
# fuzz/artifacts/<target>/; copy any into tests/fixtures/hostile/ (the CI replay) once fixed.
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). libFuzzer's instrumentation flags are nightly-only;
# on a stable toolchain this script sets RUSTC_BOOTSTRAP=1 for the fuzz build only.
#   TARGETS="gguf safetensors request" SECONDS_PER_TARGET=600 JOBS=1 bash scripts/fuzz.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz is required: cargo install cargo-fuzz" >&2; exit 1; }
SECS=${SECONDS_PER_TARGET:-600}
export RUSTC_BOOTSTRAP=1
seeds=$(mktemp -d)
tar -xJf tests/fixtures/hostile/corpus.tar.xz -C "$seeds"
for t in ${TARGETS:-gguf safetensors request}; do
  c=fuzz/corpus/$t
  mkdir -p "$c"
  case $t in
    gguf) cp "$seeds"/*.gguf tests/fixtures/moe-tiny/qwen3_moe.gguf "$c"/ ;;
    safetensors) cp "$seeds"/*.safetensors tests/fixtures/moe-tiny/qwen3_moe/model.safetensors "$c"/ ;;
    request)
      printf '%s' '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"temperature":0.5,"stop":["x"],"logprobs":true,"top_logprobs":2}' > "$c/chat.json"
      printf '%s' '{"model":"m","prompt":[1,2,3],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}' > "$c/tokens.json"
      printf '%s' '{"model":"m","prompt":"hi","echo":false,"best_of":1,"tools":[],"tool_choice":"none"}' > "$c/defaults.json" ;;
  esac
  echo "== $t: ${SECS}s"
  # With JOBS > 1 libFuzzer writes each job's log to fuzz-N.log (ignored by git).
  par=(); [ "${JOBS:-1}" -gt 1 ] && par=(-jobs="$JOBS" -workers="$JOBS")
  cargo fuzz run --sanitizer none --release "$t" "$c" -- -max_total_time="$SECS" -timeout=20 -rss_limit_mb=4096 -max_len=2000000 "${par[@]}" -print_final_stats=1 2>&1 | grep -E "^(Done|stat::)|ERROR|panicked|crash-|timeout-|oom-"
done
rm -rf "$seeds"
