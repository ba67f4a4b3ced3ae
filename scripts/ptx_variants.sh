#!/usr/bin/env bash
# Runs ON the lent GPU machine: kernel variants compared without a rebuild, through
# STRATA_CUDA_PTX (strata-kernels' src/cuda.rs). Make each variant here with
#   nvcc --ptx -O3 -std=c++17 -arch=compute_90 [-DFLAG=...] crates/strata-kernels/cuda/decode.cu \
#     -o dist/ptx/NAME.ptx && xz dist/ptx/NAME.ptx
# and carry `dist` (with dist/strata-cuda.xz from scripts/build_cuda.sh). Then:
#  1. NCU_VARS: for each NAME, ncu's time of every `moe_*` kernel over `strata bench --batch 16
#     -p 1 -n 3` on a 12-layer cut of the synthetic 30B (realistic routing; serialized, caches
#     and clocks left alone, graphs and PDL off), the mean of each kernel's last 12 launches
#     (the last 16-row step's layers); KERNELS overrides the regex (default ^moe_).
#  2. E2E_VARS: `strata bench -p 16 -n 64 -r 2 --batch BATCHES` (default 16) on the full 48-layer
#     synthetic 30B in VRAM, the variants alternating over ROUNDS (default 2).
# Writes $OUT/ncu-NAME.csv; prints one line per variant (and per round).
set -uo pipefail
OUT=${OUT:-/tmp/strata-out}; mkdir -p "$OUT"
unxz_to() { python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$1" "$2"; }
for f in dist/ptx/*.ptx.xz; do [ -f "${f%.xz}" ] || unxz_to "$f" "${f%.xz}"; done
S=${STRATA:-/tmp/strata-cuda}; MC=/tmp/ptx-variants-cut.gguf; M=/tmp/q3-30b-realistic.gguf
[ -x "$S" ] || { unxz_to dist/strata-cuda.xz "$S" && chmod +x "$S"; }
if [ -n "${NCU_VARS:-}" ] && [ ! -f $MC ]; then
  "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --layers 12 --out $MC > /dev/null 2>&1
fi
for v in ${NCU_VARS:-}; do
  STRATA_CUDA_PTX=dist/ptx/$v.ptx STRATA_GPU_GRAPHS=0 STRATA_GPU_BATCH_GRAPHS=0 STRATA_GPU_PDL=0 \
    timeout 200 /usr/local/cuda/bin/ncu --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum --csv -k "regex:${KERNELS:-^moe_}" \
    "$S" bench -m $MC --device cuda --stream-experts off -p 1 -n 3 -r 1 --batch 16 > "$OUT/ncu-$v.csv" 2>/dev/null
  python3 - "$OUT/ncu-$v.csv" "$v" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print(sys.argv[2], "no rows"); sys.exit()
h = rows[0]; k, v, u = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}
t = collections.defaultdict(list)
for r in rows[1:]:
    t[r[k].split("(")[0]].append(float(r[v].replace(",", "")) * scale.get(r[u], 1))
print(sys.argv[2], " ".join(f"{n}: {sum(x[-12:]) / len(x[-12:]):.1f} µs (of {len(x)})" for n, x in t.items()))
PY
done
if [ -n "${E2E_VARS:-}" ] && [ ! -f $M ]; then
  "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M > /dev/null 2>&1
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in ${E2E_VARS:-}; do
    echo "## $v round $r: $(STRATA_CUDA_PTX=dist/ptx/$v.ptx timeout 100 "$S" bench -m $M --device cuda \
      --stream-experts off -p 16 -n 64 -r 2 --batch "${BATCHES:-16}" 2>&1 | grep -E '^\| [^-]' | grep tg \
      | awk -F'|' '{printf "%s %s;", $4, $5}')"
  done
done
