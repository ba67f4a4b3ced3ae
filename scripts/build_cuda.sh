#!/usr/bin/env bash
# Builds `strata` with the CUDA backend (`--features cuda`) on a machine with no GPU, for the lent
# H100/H200 (sm_90). The CUDA 13.0 toolkit comes from PyPI wheels through
# ../shared/tools/cuda-toolkit.sh (override with CUDA_TOOLKIT_SH); cold build ~15 min on 2 cores.
# Output: dist/strata-cuda.xz (stripped, xz-compressed; git-ignored; carry it to the device with
# `carry: ["dist"]`; scripts/cuda_device_check.sh unpacks it there), and dist/cuda-kernels-test.xz:
# the test binary of crates/strata-models/tests/cuda_kernels.rs (our CUDA kernels against their
# CPU references; `PART=decode` runs it there); with JIT=1 also dist/jit/ (PART=module-load's files).
# This is also how the code behind the `cuda` feature is type-checked: CI builds without it.
set -euo pipefail
cd "$(dirname "$0")/.."
TK=${CUDA_TOOLKIT_SH:-../shared/tools/cuda-toolkit.sh}
[ -f "$TK" ] || { echo "build_cuda.sh: $TK not found (set CUDA_TOOLKIT_SH)" >&2; exit 1; }
cargo fetch --quiet
# shellcheck disable=SC1090
source "$TK"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
# (the toolkit script may relax the shell's options: check the build explicitly, so that a failed
# build never ships the previous binary)
cargo build --release --features cuda -p strata-cli || { echo "build_cuda.sh: cargo build failed" >&2; exit 1; }
mkdir -p dist
T=$(cargo test --release --features cuda -p strata-models --test cuda_kernels --no-run --message-format=json 2>/dev/null \
  | python3 -c "import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get('reason')=='compiler-artifact' and m.get('executable') and m['target']['name']=='cuda_kernels': print(m['executable'])") \
  || true
[ -n "$T" ] || { echo "build_cuda.sh: the cuda_kernels test did not build" >&2; cargo test --release --features cuda -p strata-models --test cuda_kernels --no-run; exit 1; }
strip -o dist/cuda-kernels-test "$T"
xz -T0 -6 -c dist/cuda-kernels-test > dist/cuda-kernels-test.xz
rm dist/cuda-kernels-test
strip -o dist/strata-cuda "$CARGO_TARGET_DIR/release/strata"
# 63 MB stripped (candle's PTX): too large for a device call with the working tree; 8 MB as xz.
xz -T0 -6 -c dist/strata-cuda > dist/strata-cuda.xz
rm dist/strata-cuda
if [ -n "${JIT:-}" ]; then
  # JIT=1: the module files PART=module-load of scripts/cuda_device_check.sh times — candle's PTX
  # modules, ours as PTX (what builds before the fat binary embedded) and the fat binary.
  mkdir -p dist/jit
  C=$(dirname "$(ls -t "$CARGO_TARGET_DIR"/release/build/candle-kernels-*/out/quantized.ptx | head -1)")
  for f in "$C"/*.ptx; do xz -T0 -6 -c "$f" > "dist/jit/candle_$(basename "$f").xz"; done
  # (build.rs's flags, PTX only)
  nvcc --ptx -O3 -std=c++17 -arch=compute_"${CUDA_COMPUTE_CAP:-90}" -o dist/jit/strata_decode.ptx crates/strata-kernels/cuda/decode.cu
  xz -f -T0 -6 dist/jit/strata_decode.ptx
  xz -T0 -6 -c "$(ls -t "$CARGO_TARGET_DIR"/release/build/strata-kernels-*/out/strata_decode.fatbin | head -1)" > dist/jit/strata_decode.fatbin.xz
fi
ls -la dist/
