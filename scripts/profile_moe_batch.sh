#!/usr/bin/env bash
# Runs ON the lent GPU machine (no Rust there): Nsight Compute profiles of the MoE kernels of
# 16-sequence decode steps of the synthetic qwen3-30b-a3b Q4_K (realistic routing, generated on
# the machine's disk), everything in VRAM, for each Q4_K MoE path at 16 rows: the per-pair q8
# kernels (default), tensor cores (STRATA_GPU_MOE=0: `q4k_mm_tc`) and the grouped kernel
# (STRATA_GPU_MOE_GROUPED=1). Carry `dist` (scripts/build_cuda.sh). Writes $OUT/ncu/LABEL.txt.
#   COUNT (6): kernels profiled per path; SKIP (2000): matching launches skipped first (past the
#   prompt passes, into the decode steps).
set -uo pipefail
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT/ncu"
S=/tmp/strata-cuda
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" dist/strata-cuda.xz $S && chmod +x $S
M=/tmp/q3-30b-realistic.gguf
[ -f $M ] || "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M 2>&1 | tail -1
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
  --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis)
profile() {  # LABEL KERNEL-REGEX ENV...
  local label=$1 kernels=$2
  shift 2
  # Op by op (graphs off) so that every kernel is its own launch.
  env "$@" STRATA_GPU_BATCH_GRAPHS=0 STRATA_GPU_GRAPHS=0 timeout 500 ncu --clock-control none \
    --kernel-name "regex:$kernels" --launch-skip "${SKIP:-2000}" --launch-count "${COUNT:-6}" \
    "${SECTIONS[@]}" "$S" bench -m $M --device cuda --stream-experts off -p 16 -n 32 -r 1 \
    --batch 16 > "$OUT/ncu/$label.txt" 2>&1
  echo "$label: exit $?"
}
profile q8-per-pair 'moe_(gate_up|down)_q4k' STRATA_GPU_MOE_GROUPED=0
profile tensor-cores 'q4k_mm_tc' STRATA_GPU_MOE=0
profile grouped 'moe_rows_q4k_grouped' STRATA_GPU_MOE_GROUPED=1
for f in "$OUT"/ncu/*.txt; do
  echo "== $f"
  grep -E '^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput|No Eligible|Issued Warp' "$f" | head -60
done
