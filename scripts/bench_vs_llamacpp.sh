#!/usr/bin/env bash
# Alternating pp512 / tg128 runs of llama.cpp's llama-bench and `strata bench` on the same GGUF,
# threads and machine (docs/performance.md, "SmolLM2-135M-Instruct Q4_1"). llama.cpp is not part of
# Strata: build it yourself and point LLAMA_BENCH at it, e.g. from the llama-cpp-python sdist on
# PyPI (its vendor/llama.cpp): `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
# -DCMAKE_BUILD_TYPE=Release && cmake --build build -j2 --target llama-bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary}"
M=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
T=${THREADS:-2}
R=${REPS:-5}
S=${STRATA:-./target/release/strata}
"$LLAMA_BENCH" --version 2>&1 | grep -i -E 'version|commit' | head -2 || true
for round in $(seq "${ROUNDS:-2}"); do
  echo "## round $round"
  "$LLAMA_BENCH" -m "$M" -t "$T" -p 512 -n 128 -r "$R" 2>/dev/null | grep -E 'pp512|tg128' | awk -F'|' '{printf "llama.cpp  %s %s\n", $(NF-2), $(NF-1)}'
  "$S" bench -m "$M" -t "$T" -r "$R" 2>&1 | grep -E 'pp512|tg128' | awk -F'|' '{printf "strata     %s  %s  (runs %s)\n", $4, $5, $6}'
done
