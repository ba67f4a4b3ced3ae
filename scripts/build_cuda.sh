#!/usr/bin/env bash
# Builds `strata` with the CUDA backend (`--features cuda`) on a machine with no GPU, for the lent
# H100/H200 (sm_90). The CUDA 13.0 toolkit comes from PyPI wheels through
# ../shared/tools/cuda-toolkit.sh (override with CUDA_TOOLKIT_SH); cold build ~15 min on 2 cores.
# Output: dist/strata-cuda (stripped; git-ignored; carry it to the device with `carry: ["dist"]`).
# This is also how the code behind the `cuda` feature is type-checked: CI builds without it.
set -euo pipefail
cd "$(dirname "$0")/.."
TK=${CUDA_TOOLKIT_SH:-../shared/tools/cuda-toolkit.sh}
[ -f "$TK" ] || { echo "build_cuda.sh: $TK not found (set CUDA_TOOLKIT_SH)" >&2; exit 1; }
cargo fetch --quiet
# shellcheck disable=SC1090
source "$TK"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
cargo build --release --features cuda -p strata-cli
mkdir -p dist
strip -o dist/strata-cuda "$CARGO_TARGET_DIR/release/strata"
ls -la dist/strata-cuda
