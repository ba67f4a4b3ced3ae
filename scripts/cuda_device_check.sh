#!/usr/bin/env bash
# Runs ON the lent GPU machine (no Rust there): the carried `dist/strata-cuda.xz` from
# scripts/build_cuda.sh (dist/strata-cuda.xz, unpacked to /tmp). Prints tables and writes logs under $OUT.
#  1. GPU facts; measured device-to-device copy and pinned / pageable host-to-device copy (torch).
#  2. Correctness: `strata compare-devices` (cuda vs cpu logits over the fixture prompt, greedy
#     tokens) on the committed fixtures, and on SmolLM2 when models/SmolLM2-135M-Instruct.Q4_1.gguf
#     is there.
#  3. PART=bench: the synthetic qwen3-30b-a3b Q4_K generated on the machine's disk, decoded fully
#     resident in VRAM (`strata bench`), and with --stream-experts (experts in host RAM / page cache).
#  4. PART=tier (instead of 2 and 3): the GPU expert tier (--gpu-expert-cache). Correctness: the
#     tier on cuda vs the CPU (`compare-devices --gpu-expert-cache`, VRAM 10% so experts are
#     evicted and copied again; quantized models with STRATA_CPU_DEQUANTIZE=1, the f32 reference of
#     the DMMV kernels). Speed on the synthetic 30B: resident (fused and per-expert), VRAM tier 25%
#     / 50% over a host tier holding every expert (page-locked), and over a 50% host tier that
#     reads the drive with O_DIRECT; tier/runs.tgz holds the `generate --json` outputs.
#     BENCH_ONLY=1: alternating speed rounds only; CHECK_ONLY=1: correctness only; MAPPED_ROWS=1:
#     mapped experts against the host-routed tier and promotion limits (LLAMA=1: then llama-bench
#     -ncmoe beside `strata bench`, llama.cpp CUDA built as in PART=decode).
#     ROUTING=realistic (default) | uniform | local: the synthetic's `--routing`.
#  5. PART=decode (instead of 2-4): the GPU decode step's own kernels (issue 24). The kernel tests
#     (dist/cuda-kernels-test.xz from build_cuda.sh) against their CPU references; compare-devices
#     on tiny-moe synthetics (head dim 64: our attention; Q4_K: device routing into the fused
#     experts; Q8_0: host routing) with the GPU paths on and off; then the synthetic
#     qwen3-30b-a3b Q4_K (`--routing local`: the random routers decide, as in llama.cpp) resident
#     in VRAM, `strata bench` in alternating rounds: this build and the GPU paths turned off
#     (VARIANTS, default: new, candle-moe, candle-matvec, candle; also no-graphs*), and
#     dist/strata-cuda-base.xz (the build before them) when carried; DECODE_MODEL: another file
#     (SmolLM2 put together from its parts: compare-devices on it first). LLAMA=1 also builds
#     llama.cpp CUDA from dist/llamacpp-src.tar.xz (dist/llamacpp.sh, ~6 min) and runs
#     llama-bench on the same file in the same rounds.
#  6. PART=batch (instead of 2-5): continuous batching on the GPU (issue 25), everything in VRAM:
#     the kernel tests and `compare-devices --batch 2 / 4 / 16` on tiny-moe, tiny-hybrid and SmolLM2
#     (batched = alone on the device, a sequence joining mid-way, batched
#     steps captured as graphs and op by op; 8+ sequences over Q4_K dense layers within
#     BATCH_TOL_MMA, exact with STRATA_GPU_DENSE_MMA=0 STRATA_GPU_MOE_MMA=0; unless BENCH_ONLY), then `strata bench --batch
#     2,4,8,16` (batched decode in the engine) with the opt-in grouped MoE kernels on and off
#     (GROUPED, default "1 0 1"), batched steps op by op and captured (alternating), then
#     1 vs CLIENTS (16) streaming clients through `strata serve --parallel CLIENTS`
#     (scripts/bench_batching.sh, no llama-server; SERVER_ENVS, default "X=1"), for each of
#     MODELS (default: SmolLM2 when carried in models/ — its 96 MB exceed what a call carries —
#     then the synthetic qwen3-30b-a3b Q4_K with realistic routing generated on the machine's
#     disk).
#  7. PART=prefill (instead of 2-6): prompt passes on tensor cores (issue 24): kernel tests,
#     compare-devices with a long prompt, pp512 with the tensor-core paths on and off (VARIANTS),
#     LLAMA=1 as in PART=decode.
#  8. PART=profile (instead of 2-7): ncu per-kernel times of the decode step (NO_NCU=1 skips),
#     a 4-token prompt pass and 2/4/8-token verify passes (`strata bench --verify`) against a
#     decode step (VARIANTS), batched decode with the short-pass MoE kernels on and off
#     (BATCH_MOE, "" skips).
#  9. PART=graph-stats (instead of 2-8): a captured decode step's graph nodes by type and the GPU
#     time of its replays against the host's time per pass (STRATA_GPU_GRAPH_STATS=1), VARIANTS.
# 10. PART=ncu-llama (instead of 2-9; LLAMA=1): Strata's and llama.cpp's decode-step kernels under
#     ncu on the same 12-layer file, caches left alone and flushed (NCU_MODES).
# 11. PART=hybrid (instead of 2-10): hybrid models' Gated DeltaNet layers on the GPU (issue 24).
#     Unless BENCH_ONLY: the kernel tests; compare-devices on the qwen3_next / qwen3_5_moe fixtures
#     (HF and GGUF) and on a tiny-hybrid Q4_K synthetic, the DeltaNet kernels on and off
#     (STRATA_GPU_DELTANET=0: the host path); greedy speculative decoding (self, ngram) = plain
#     decoding on the GPU, kernels on and off; decode steps replayed from CUDA graphs = op by op
#     (greedy and sampled, 64 and 300 tokens). Then (unless CHECK_ONLY) the synthetic
#     qwen3.5-122b-a10b Q4_K cut to LAYERS (default 8) layers (ROUTING, default local: the random
#     routers decide, as llama.cpp reads the file) resident in VRAM: `strata bench -p 512 -n 128`
#     with the kernels on and off (VARIANTS, default "1 0"), alternating (ROUNDS, default 2), each
#     run's device→host reads per decode step printed; LLAMA=1: llama-bench on the same file in
#     the same rounds (llama.cpp CUDA built from the carried sdist as in PART=decode).
# 12. PART=ncu-batch (instead of 2-11): every kernel of a 16-sequence decode step under ncu, on a
#     12-layer cut of the synthetic 30B (realistic routing), and the cut's x1 / x16 step times.
# 13. PART=kv16 (instead of 2-12): the f16 KV cache (`--kv-cache-dtype f16`, issue 24). Unless
#     BENCH_ONLY: the kernel tests, compare-devices against the CPU's f32 reference with the
#     device's cache in f32 and in f16 (fixtures, a 69-word prompt on tiny-moe Q4_K batched and
#     on tiny-hybrid Q4_K — head dimension 64: f16 prompt passes attend on tensor cores), graphs = op by op and speculation = plain decoding with the f16 cache. Unless
#     CHECK_ONLY: `strata bench -p 512 -n 128 -d DEPTHS` (default 0,4096,16384) on the synthetic
#     30B (realistic routing) with f32 and f16 caches, alternating (ROUNDS, default 2), and with
#     LLAMA=1 llama-bench -d on the same file in the same rounds (its default cache: f16).
# 14. PART=ptx-variants (instead of 2-13): kernel variants as PTX files through STRATA_CUDA_PTX,
#     under ncu (NCU_VARS) and end to end (E2E_VARS); see the part itself.
# 15. PART=module-load (instead of 2-14): what loading the kernels costs on a cold driver cache
#     (dist/jit/: the module files to time; see the part itself).
# 16. PART=prefix (instead of 2-15): the prefix cache on the device. `strata serve` on PREFIX_MODEL
#     (default tiny-moe Q4_K, realistic routing) with the one-launch block copies and with
#     STRATA_GPU_KV_SPAN=0; scripts/prefix_check.py's greedy requests (prefix hits) must give
#     the same texts with both, and hit the cache.
# 17. PART=moe-mma (instead of 2-16): the grouped int8 MoE kernel (`moe_q4k_mma`, `moe_mmq_q8`;
#     issue 25) against the per-pair ones. The kernel tests whose names hold KTESTS (default "moe";
#     empty: all);
#     `compare-devices --batch 16` on tiny-moe Q4_K (local, realistic): the defaults within
#     BATCH_TOL_MMA with equal greedy tokens, and STRATA_GPU_MOE_MMA_MIN=1 STRATA_GPU_DENSE_MMA=0
#     (the grouped kernel for every pass, one token included; dense layers on the mat-vec) exact:
#     a token's products do not depend on the tokens beside it. Then ncu's time of the MoE kernels
#     (the last 24 launches of each kernel and grid: two 16-row steps) on a 12-layer cut of the
#     synthetic 30B (realistic routing) for each of MMA_ENVS, and `strata bench -p 16 -n 64 -r 2
#     --batch BATCHES` (default 1,16) on the full synthetic 30B in VRAM, MMA_ENVS alternating over
#     ROUNDS (default 2). MMA_ENVS: space-separated variants, each a comma-separated list of
#     assignments (default "STRATA_GPU_MOE_MMA=0 X=1": the per-pair kernels, then the defaults).
set -uo pipefail
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
S=${STRATA:-/tmp/strata-cuda}
if [ ! -x "$S" ]; then
  # build_cuda.sh's binary is 63 MB, near the 64 MiB a device call carries: it travels xz-compressed.
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" dist/strata-cuda.xz "$S" && chmod +x "$S"
fi
# SmolLM2 (98 MB) exceeds what one call carries beside the tracked tree: it travels in parts over
# back-to-back calls on a warm machine (scripts/split_for_device.sh: xfer1/smol.00 with
# xfer1/smol.sha256 and smol.count, xfer2/smol.01, ...; ignored paths stay there between calls)
# and is put together here once every part has come.
SMOL_FILE=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $SMOL_FILE ] && [ -f xfer1/smol.count ]; then
  parts=$(ls xfer*/smol.[0-9]* 2>/dev/null)
  if [ "$(echo "$parts" | grep -c .)" = "$(cat xfer1/smol.count)" ]; then
    mkdir -p models
    # shellcheck disable=SC2086
    cat $parts > $SMOL_FILE.tmp
    if [ "$(sha256sum < $SMOL_FILE.tmp | cut -d' ' -f1)" = "$(cat xfer1/smol.sha256)" ]; then
      mv $SMOL_FILE.tmp $SMOL_FILE && echo "SmolLM2 put together from $(echo $parts)"
    else
      echo "SmolLM2 parts do not match their checksum" >&2; rm -f $SMOL_FILE.tmp
    fi
  else
    echo "SmolLM2: $(echo "$parts" | grep -c .) of $(cat xfer1/smol.count) parts here"
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/bandwidth.txt"
import torch, time
def t(f, n=20):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n
a=torch.empty(1<<30, dtype=torch.uint8, device='cuda'); b=torch.empty_like(a)
d2d=t(lambda: b.copy_(a)); print(f"device-to-device copy: {2*a.numel()/d2d/1e9:.0f} GB/s (read + write)")
hp=torch.empty(1<<30, dtype=torch.uint8).pin_memory(); hg=torch.empty(1<<30, dtype=torch.uint8)
print(f"pinned host-to-device: {a.numel()/t(lambda: a.copy_(hp, non_blocking=True)):.3e} B/s")
print(f"pageable host-to-device: {a.numel()/t(lambda: a.copy_(hg), 5):.3e} B/s")
PY
if [ "${PART:-}" = batch ]; then
  if [ -f dist/cuda-kernels-test.xz ] && [ -z "${BENCH_ONLY:-}" ]; then
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" dist/cuda-kernels-test.xz /tmp/cuda-kernels-test && chmod +x /tmp/cuda-kernels-test
    /tmp/cuda-kernels-test --test-threads=1 > "$OUT/kernels.txt" 2>&1; echo "kernel tests exit $?" | tee -a "$OUT/batch.md"
    grep -E "^test |test result|panicked|off by" "$OUT/kernels.txt" | tee -a "$OUT/batch.md"
  fi
  # Batched decoding on the device = each sequence decoded alone there (compare-devices --batch:
  # greedy tokens and logits), with batched steps captured as graphs and op by op
  # (STRATA_GPU_BATCH_GRAPHS=0), on tiny-moe Q4_K (device routing; realistic routing: the host's
  # synthetic choice written before each step) and SmolLM2 when carried. (--tolerance 1: the
  # CPU-vs-GPU bounds are PART=decode's; here the batch check's own bound, 1e-5, decides.)
  if [ -z "${BENCH_ONLY:-}" ]; then
    echo "## batched = alone (compare-devices --batch)" | tee -a "$OUT/batch.md"
    for r in local realistic; do
      [ -f /tmp/tiny-bq-$r.gguf ] || "$S" synth --preset tiny-moe --quant Q4_K --routing $r --out /tmp/tiny-bq-$r.gguf >/dev/null 2>&1
    done
    # A hybrid (Gated DeltaNet) too: each sequence's recurrent state is its own in a batch.
    [ -f /tmp/tiny-bh.gguf ] || "$S" synth --preset tiny-hybrid --quant Q4_K --routing realistic --out /tmp/tiny-bh.gguf >/dev/null 2>&1
    for M in /tmp/tiny-bq-local.gguf /tmp/tiny-bq-realistic.gguf /tmp/tiny-bh.gguf models/SmolLM2-135M-Instruct.Q4_1.gguf; do
      [ -f "$M" ] || continue
      # Batches of 8-16 sequences take the int8 tensor-core kernels for Q4_K dense and MoE layers
      # (gpu::DENSE_MMA_ROWS_MIN, gpu::MOE_MMA_ROWS_MIN): each row summed in another order than
      # alone, then rounded to q8 at the next layer, so their logits get the documented bound
      # (BATCH_TOL_MMA) and equal greedy tokens; with both off (the mat-vec and the per-pair MoE
      # kernels for every row count: the mma value below is both switches) they must be exact.
      for v in "1 2 1" "1 4 1" "1 16 1" "0 4 1" "0 16 1" "1 16 0"; do
        set -- $v; bg=$1; b=$2; mma=$3
        # (a hybrid's batched passes keep the mat-vec whatever STRATA_GPU_DENSE_MMA: exact)
        tol=1e-5; [ "$b" -ge 8 ] && [ "$mma" = 1 ] && [ "$M" != /tmp/tiny-bh.gguf ] && tol=${BATCH_TOL_MMA:-2e-2}
        echo "$(basename "$M") batch $b STRATA_GPU_BATCH_GRAPHS=$bg STRATA_GPU_DENSE_MMA=STRATA_GPU_MOE_MMA=$mma (bound $tol):" | tee -a "$OUT/batch.md"
        STRATA_GPU_DENSE_MMA=$mma STRATA_GPU_MOE_MMA=$mma STRATA_GPU_BATCH_GRAPHS=$bg STRATA_GPU_GRAPH_STATS=1 timeout 300 "$S" compare-devices -m "$M" \
          --prompt "The quick brown fox jumps over the lazy dog. Once upon a time" -n 40 --batch $b --tolerance 1 \
          --batch-tolerance $tol > "$OUT/cmp-batch.log" 2>&1; echo "exit $?" | tee -a "$OUT/batch.md"
        grep -E '^\||captured|error' "$OUT/cmp-batch.log" | tail -6 | tee -a "$OUT/batch.md"
      done
    done
  fi
  M30=/tmp/q3-30b-realistic.gguf
  for M in ${MODELS:-models/SmolLM2-135M-Instruct.Q4_1.gguf $M30}; do
    if [ "$M" != "$M30" ] && [ ! -f "$M" ]; then
      echo "## $M: not carried, skipped" | tee -a "$OUT/batch.md"; continue
    fi
    if [ "$M" = "$M30" ] && [ ! -f $M30 ]; then
      "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M30 2>&1 | tail -1
    fi
    # Grouped MoE kernels (STRATA_GPU_MOE_GROUPED=1, opt-in) and candle's indexed_moe_forward, alternating.
    # STRATA_BENCH_SPLIT=1: each batch's time per step and the part of it until the pass
    # returned (the host's launches up to the first synchronisation).
    for g in ${GROUPED:-1 0 1}; do
      echo "## $M: batched decode in the engine, STRATA_GPU_MOE_GROUPED=$g" | tee -a "$OUT/batch.md"
      STRATA_BENCH_SPLIT=1 STRATA_GPU_MOE_GROUPED=$g "$S" bench -m "$M" --device cuda \
        --stream-experts off -p 64 -n 64 -r 2 --batch 2,4,8,16 2>&1 | grep -E '^\||per step' \
        | tee -a "$OUT/batch.md"
    done
    # BATCH_ENVS: one environment assignment per variant (X=1: the defaults), alternating over
    # ROUNDS, e.g. "X=1 STRATA_GPU_MV_TOKENS=4".
    for round in $(seq 1 ${ROUNDS:-2}); do
      for e in ${BATCH_ENVS:-}; do
        echo "## $M: batched decode in the engine, $e, round $round" | tee -a "$OUT/batch.md"
        env "$e" STRATA_BENCH_SPLIT=1 "$S" bench -m "$M" --device cuda --stream-experts off \
          -p 64 -n 64 -r 2 --batch 2,4,8,16 2>&1 | grep -E '^\||per step' | tee -a "$OUT/batch.md"
      done
    done
    # Batched steps op by op (STRATA_GPU_BATCH_GRAPHS=0; one sequence still graph-replayed)
    # after the default (captured), then the default again: alternating (BATCH_GRAPHS="": none).
    for bg in ${BATCH_GRAPHS-0 1}; do
      echo "## $M: batched decode, STRATA_GPU_BATCH_GRAPHS=$bg" | tee -a "$OUT/batch.md"
      STRATA_BENCH_SPLIT=1 STRATA_GPU_BATCH_GRAPHS=$bg "$S" bench -m "$M" --device cuda \
        --stream-experts off -p 64 -n 64 -r 2 --batch 2,4,8,16 2>&1 | grep -E '^\||per step' \
        | tee -a "$OUT/batch.md"
    done
    # SERVER_ENVS: one environment assignment per server variant (X=1: the defaults), e.g.
    # "X=1 STRATA_GPU_MOE_MMA=0"; each variant's rounds alternate 1 and CLIENTS clients.
    for e in ${SERVER_ENVS:-X=1}; do
      echo "## $M: server, 1 vs ${CLIENTS:-16} streaming clients, $e" | tee -a "$OUT/batch.md"
      env "$e" STRATA=$S EXTRA="--device cuda --stream-experts off" SKIP_LLAMA=1 \
        CLIENTS=${CLIENTS:-16} THREADS=16 ROUNDS=${ROUNDS:-2} bash scripts/bench_batching.sh "$M" \
        2>&1 | tail -3 | tee -a "$OUT/batch.md"
      cp /tmp/bench_batching_strata.log "$OUT/serve-$(basename "$M")-${e%%=*}.log" 2>/dev/null || true
      grep -E "INFO batch steps" /tmp/bench_batching_strata.log | tail -2 | tee -a "$OUT/batch.md"
    done
  done
  exit 0
fi
ids() { python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['input_ids'])))" "$1"; }
F=tests/fixtures
unxz_to() { python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$1" "$2" && chmod +x "$2"; }
# bench_row FILE LABEL TG: "| LABEL | pp512 tok/s | tgTG tok/s |" from a `strata bench` or
# llama-bench (-o md) output in FILE (its last such rows), FAILED where a row is missing.
bench_row() {
  python3 - "$1" "$2" "$3" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
pp = re.findall(r"pp512\D+([0-9.]+)", t); tg = re.findall(r"tg" + sys.argv[3] + r"\D+([0-9.]+)", t)
print(f"| {sys.argv[2]} | {pp[-1] if pp else 'FAILED'} | {tg[-1] if tg else 'FAILED'} |")
PY
}
# variant_envs V: sets envs=(…) to the environment of the decode variant V (one of the
# switches of crates/strata-models/src/gpu.rs and strata-kernels' cuda.rs; "new" and any other
# name: the defaults).
variant_envs() {
  case $1 in
    candle-moe) envs=(STRATA_GPU_MOE=0) ;;
    candle-matvec) envs=(STRATA_GPU_MATVEC=0) ;;
    candle) envs=(STRATA_GPU_MOE=0 STRATA_GPU_MATVEC=0 STRATA_GPU_FUSE=0) ;;
    no-fuse) envs=(STRATA_GPU_FUSE=0) ;;
    no-short-matvec) envs=(STRATA_GPU_SHORT_MATVEC=0) ;;
    tokens1) envs=(STRATA_GPU_MV_TOKENS=1) ;;
    rows1|rows2|rows4) envs=(STRATA_GPU_MV_ROWS=${1#rows}) ;;
    f32act) envs=(STRATA_GPU_Q8=0) ;;
    no-q8-fuse) envs=(STRATA_GPU_Q8_FUSE=0) ;;
    no-silu-q8) envs=(STRATA_GPU_SILU_Q8=0) ;;
    no-pdl) envs=(STRATA_GPU_PDL=0) ;;
    chunk256) envs=(STRATA_GPU_ATTN_CHUNK=256) ;;
    norm256) envs=(STRATA_GPU_NORM_THREADS=256) ;;
    no-graphs) envs=(STRATA_GPU_GRAPHS=0) ;;
    host-routing) envs=(STRATA_GPU_ROUTING=0) ;;
    mmvq) envs=(STRATA_CUDA_MMVQ=1) ;;
    no-graphs-no-gpu-routing) envs=(STRATA_GPU_GRAPHS=0 STRATA_GPU_ROUTING=0) ;;
    no-graphs-no-gpu-attention) envs=(STRATA_GPU_GRAPHS=0 STRATA_GPU_ATTENTION=0) ;;
    no-graphs-event-tracking) envs=(STRATA_GPU_GRAPHS=0 STRATA_CUDA_EVENT_TRACKING=1) ;;
    *) envs=(X=1) ;;
  esac
}
# ncu_table CSV [LAST] [grid]: per-kernel launches, mean µs and share from an ncu `--metrics
# gpu__time_duration.sum --csv` output, and the total per layer (over attention launches); with
# LAST, over each kernel's last LAST launches only; with `grid`, per kernel and grid size (one
# kernel launched for different products, e.g. gate/up and down).
ncu_table() {
  python3 - "$1" "${2:-0}" "${3:-}" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no rows"); sys.exit()
hdr = rows[0]; k, u, v = hdr.index("Kernel Name"), hdr.index("Metric Unit"), hdr.index("Metric Value")
gi = hdr.index("Grid Size") if sys.argv[3] == "grid" and "Grid Size" in hdr else None
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
t = collections.defaultdict(list)
for r in rows[1:]:
    name = r[k].split("(")[0][:70] + (f" grid {r[gi]}" if gi is not None else "")
    t[name].append(float(r[v].replace(",", "")) * scale.get(r[u], 1.0))
last = int(sys.argv[2])
if last:
    t = {n: x[-last:] for n, x in t.items()}
total = sum(sum(x) for x in t.values())
layers = sum(len(x) for n, x in t.items() if n.startswith("attn_decode") or "flash_attn_ext" in n)
per_layer = f", {layers} layers: {total / layers:.1f} µs per layer" if layers else ""
print(f"total {total:.0f} µs over {sum(len(x) for x in t.values())} launches{per_layer}")
print("| kernel | launches | mean µs | share |\n|---|---|---|---|")
for name, x in sorted(t.items(), key=lambda kv: -sum(kv[1])):
    print(f"| {name} | {len(x)} | {sum(x)/len(x):.1f} | {100*sum(x)/total:.1f}% |")
PY
}
# kernel_tests DIR: the kernel test binary against its CPU references, results in DIR/check.md.
kernel_tests() {
  echo "## kernels vs CPU references" | tee "$1/check.md"
  unxz_to dist/cuda-kernels-test.xz /tmp/cuda-kernels-test
  timeout 300 /tmp/cuda-kernels-test --test-threads=1 > "$1/kernels.txt" 2>&1; echo "kernel tests exit $?" | tee -a "$1/check.md"
  grep -E "^test |test result|panicked|off by|differ" "$1/kernels.txt" | tee -a "$1/check.md"
}
# With LLAMA set: builds llama.cpp CUDA from the carried sdist once per machine, in the background
# (a new session, so it outlives this command on a machine kept warm for the next call): the
# correctness checks do not time anything; the speed rounds wait for /tmp/llama-build.done, so no
# timing shares the CPU with the compiler.
start_llama_build() {
  if [ -n "${LLAMA:-}" ] && [ ! -f /tmp/llama-build.started ]; then
    touch /tmp/llama-build.started
    setsid bash -c 't0=$(date +%s); bash dist/llamacpp.sh cuda dist/llamacpp-src.tar.xz /tmp/llama > /tmp/llama-build.txt 2>&1; echo "llama.cpp build: $(( $(date +%s) - t0 )) s, exit $?" >> /tmp/llama-build.txt; touch /tmp/llama-build.done' < /dev/null > /dev/null 2>&1 &
  fi
}
if [ "${PART:-}" = prefill ]; then
  # Prompt passes on tensor cores (moe_q4k_tc, matmul_q4k_tc): the kernel tests, compare-devices
  # with a prompt longer than TC_ROWS_MIN on tiny-moe Q4_K (tensor-core paths on, then off), then
  # `strata bench -p 512` on the synthetic 30B (ROUTING, default local as in PART=decode) with
  # both paths on, each off, both off, alternating (VARIANTS), and llama-bench when LLAMA=1.
  D="$OUT/prefill"; mkdir -p "$D"
  start_llama_build
  if [ -z "${BENCH_ONLY:-}" ]; then
    unxz_to dist/cuda-kernels-test.xz /tmp/cuda-kernels-test
    /tmp/cuda-kernels-test --test-threads=1 > "$D/kernels.txt" 2>&1; echo "kernel tests exit $?" | tee "$D/check.md"
    grep -E "^test |test result|panicked|off by" "$D/kernels.txt" | tee -a "$D/check.md"
    P="In the beginning the river ran quietly through the valley, past the mill and the old stone bridge, where children gathered every summer evening to watch the swallows dive for insects above the slow green water while their parents talked"
    "$S" synth --preset tiny-moe --quant Q4_K --routing local --out /tmp/tiny-Q4_K.gguf >/dev/null 2>&1
    for v in on off; do
      envs=(X=1); [ $v = off ] && envs=(STRATA_GPU_MOE_TC=0 STRATA_GPU_DENSE_TC=0)
      echo "tiny-moe Q4_K, long prompt, tensor-core paths $v:" | tee -a "$D/check.md"
      env "${envs[@]}" STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-Q4_K.gguf -p "$P" -n 32 --tolerance 5e-2 2>>"$D/compare.err" | tail -3 | tee -a "$D/check.md"
    done
  fi
  [ -z "${CHECK_ONLY:-}" ] || exit 0
  R=${ROUTING:-local}; M=/tmp/q3-30b-$R.gguf
  [ -f $M ] || { "$S" synth --preset qwen3-30b-a3b --routing "$R" --out $M 2>&1 | tail -1 > "$D/synth.txt"; sync; sleep 3; }
  if [ -f /tmp/llama-build.started ]; then
    while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
    tail -1 /tmp/llama-build.txt
  fi
  {
    echo "| run | pp512 tok/s | tg32 tok/s |"
    echo "|---|---|---|"
    for round in 1 2; do
      for v in ${VARIANTS:-tc no-moe-tc no-dense-tc none}; do
        envs=(X=1)
        case $v in
          no-moe-tc) envs=(STRATA_GPU_MOE_TC=0) ;;
          no-dense-tc) envs=(STRATA_GPU_DENSE_TC=0) ;;
          none) envs=(STRATA_GPU_MOE_TC=0 STRATA_GPU_DENSE_TC=0) ;;
        esac
        env "${envs[@]}" timeout 300 "$S" bench -m $M --device cuda -p 512 -n 32 -r ${REPS:-2} --stream-experts off > /tmp/bench-$v.txt 2>&1
        bench_row /tmp/bench-$v.txt "$v-$round" 32
      done
      if [ -x /tmp/llama/bin/llama-bench ]; then
        /tmp/llama/bin/llama-bench -m $M -ngl 99 -p 512 -n 32 -r ${REPS:-2} -o md > /tmp/llama-$round.txt 2>&1
        bench_row /tmp/llama-$round.txt "llama.cpp-$round" 32
      fi
    done
  } 2>&1 | tee "$D/bench.md"
  cp /tmp/bench-tc.txt "$D/" 2>/dev/null
  exit 0
fi
if [ "${PART:-}" = profile ]; then
  # Where the decode step's time goes, and what a short pass costs: (1) ncu per-kernel GPU times of
  # op-by-op decode steps (STRATA_GPU_GRAPHS=0) on a 12-layer cut of the synthetic 30B, kernels
  # serialized with caches flushed (upper bounds, not step times); (2) on the 48-layer file, a
  # 4-token pass (`-p 4`, op by op: what a 4-token verify pass costs) against the decode step
  # (tg32, graph-replayed), VARIANTS (default: new, candle), alternating; (3) batched decode
  # (`--batch 2,4,8,16`) with our short-pass MoE kernels on and off (STRATA_GPU_MOE).
  D="$OUT/profile"; mkdir -p "$D"
  M12=/tmp/q3-30b-12l.gguf; M=/tmp/q3-30b-local.gguf
  [ -f $M12 ] || "$S" synth --preset qwen3-30b-a3b --routing local --layers 12 --out $M12 > /dev/null 2>&1
  [ -f $M ] || "$S" synth --preset qwen3-30b-a3b --routing local --out $M > /dev/null 2>&1
  # NCU_VERIFY=1: the launches profiled are 4-token verify passes' instead of decode steps'.
  NCU_ARGS=(-n 64); [ -n "${NCU_VERIFY:-}" ] && NCU_ARGS=(-n 16 --verify 4)
  [ -z "${NO_NCU:-}" ] && STRATA_GPU_GRAPHS=0 timeout 300 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv \
    --launch-skip 3000 --launch-count 1500 "$S" bench -m $M12 --device cuda --stream-experts off \
    -p 8 -r 1 "${NCU_ARGS[@]}" > "$D/ncu.csv" 2> "$D/ncu.err"
  [ -z "${NO_NCU:-}" ] && ncu_table "$D/ncu.csv" | tee "$D/kernels.md"
  {
    # pp4: a 4-token prompt pass from an empty cache; verifyW: `strata bench --verify W` (W-token
    # passes with every position's logits, rolled back to one token: zero acceptance) — its
    # "× a tg step" is the pass's time over a tg32 step's (graph-replayed, same run).
    echo "| run | pp4 tok/s | tg32 tok/s | 4-token prompt pass ÷ step | verify2 ÷ step | verify4 ÷ step | verify8 ÷ step |"
    echo "|---|---|---|---|---|---|---|"
    for round in $(seq 1 ${ROUNDS:-2}); do
      for v in ${VARIANTS:-new no-graphs no-short-matvec candle}; do
        variant_envs "$v"
        env "${envs[@]}" timeout 200 "$S" bench -m $M --device cuda --stream-experts off -p 4 -n 32 -r 3 --verify 2,4,8 > /tmp/p4.txt 2>&1
        cp /tmp/p4.txt "$D/verify-$v-$round.txt"
        python3 - /tmp/p4.txt "$v-$round" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
pp = re.findall(r"pp4\D+([0-9.]+)", t); tg = re.findall(r"tg32\D+([0-9.]+)", t)
ver = {w: re.findall(r"verify" + w + r" x\d+: ([0-9.]+) ms per pass = ([0-9.]+)", t) for w in ("2", "4", "8")}
cells = [f"{v[-1][1]} ({v[-1][0]} ms)" if v else "FAILED" for v in ver.values()]
if pp and tg:
    print(f"| {sys.argv[2]} | {pp[-1]} | {tg[-1]} | {(4/float(pp[-1]))/(1/float(tg[-1])):.2f} | " + " | ".join(cells) + " |")
else:
    print(f"| {sys.argv[2]} | FAILED | FAILED | | | | |")
PY
      done
    done
    for g in ${BATCH_MOE-1 0}; do
      echo "batched decode, STRATA_GPU_MOE=$g:"
      STRATA_GPU_MOE=$g timeout 300 "$S" bench -m $M --device cuda --stream-experts off -p 64 -n 64 -r 2 --batch 2,4,8,16 2>&1 | grep '^|'
    done
  } 2>&1 | tee "$D/bench.md"
  exit 0
fi
if [ "${PART:-}" = graph-stats ]; then
  # Where a graph-replayed decode step goes (issue 24): the captured graph's nodes by type and
  # each replay's GPU time (CUDA events) against the host's time per pass
  # (STRATA_GPU_GRAPH_STATS=1), for VARIANTS (default: new, chunk256 (STRATA_GPU_ATTN_CHUNK=256: the attention chunking before), no-pdl), synthetic 30B local routing.
  D="$OUT/graph-stats"; mkdir -p "$D"
  M=/tmp/q3-30b-local.gguf
  [ -f $M ] || "$S" synth --preset qwen3-30b-a3b --routing local --out $M > /dev/null 2>&1
  for v in ${VARIANTS:-new chunk256 no-pdl}; do
    variant_envs "$v"
    echo "## $v" | tee -a "$D/stats.md"
    env "${envs[@]}" STRATA_GPU_GRAPH_STATS=1 "$S" bench -m $M --device cuda --stream-experts off -p 8 -n 128 -r 2 2>&1 \
      | grep -E "captured|graph replays: (64|128|256)|^\| (pp|tg)|rror" | tee -a "$D/stats.md"
  done
  exit 0
fi
if [ "${PART:-}" = ncu-batch ]; then
  # Where a 16-sequence decode step's time goes (issue 25): every kernel of `strata bench --batch
  # 16` on a cut of the synthetic 30B (realistic routing; NCU_LAYERS, default 12) under ncu,
  # serialized, caches and clocks left alone, op by op (graphs and PDL off). The run's last pass
  # is a 16-row step: batch.md lists its kernels (ncu_table over that pass's launches). Then the
  # cut's engine step times, x1 and x16.
  D="$OUT/ncu-batch"; mkdir -p "$D"
  NL=${NCU_LAYERS:-12}; MC=/tmp/ncu-batch-$NL.gguf
  [ -f $MC ] || "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --layers $NL --out $MC > /dev/null 2>&1
  STRATA_GPU_GRAPHS=0 STRATA_GPU_BATCH_GRAPHS=0 STRATA_GPU_PDL=0 timeout 400 /usr/local/cuda/bin/ncu \
    --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
    "$S" bench -m $MC --device cuda --stream-experts off -p 1 -n 3 -r 1 --batch ${NCU_BATCH:-16} \
    > "$D/all.csv" 2> "$D/all.err"; echo "ncu exit $?" | tee "$D/batch.md"
  # The last pass: the run ends with batched steps of identical kernel sequences, so a pass is
  # the shortest period P (over 20 launches) with the last P names equal to the P before them.
  python3 - "$D/all.csv" > "$D/last.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr, body = rows[0], rows[1:]
k = hdr.index("Kernel Name")
names = [r[k] for r in body]
P = next((p for p in range(20, len(names) // 2) if names[-p:] == names[-2 * p:-p]), len(names))
w = csv.writer(sys.stdout); w.writerow(hdr)
for r in body[-P:]: w.writerow(r)
print(f"{len(body)} launches; the last pass: {P}", file=sys.stderr)
PY
  ncu_table "$D/last.csv" | tee -a "$D/batch.md"
  for b in 1 16; do
    STRATA_BENCH_SPLIT=1 "$S" bench -m $MC --device cuda --stream-experts off -p 16 -n 64 -r 2 --batch $b 2>&1 \
      | grep -E '^\||per step' | tee -a "$D/batch.md"
  done
  exit 0
fi
if [ "${PART:-}" = module-load ]; then
  # What loading the kernels costs a process whose driver cache is cold (the first start on a
  # machine, or after a driver update). (1) The driver's load of each module file under
  # dist/jit/ (NAME.ptx.xz: PTX, compiled by the driver; NAME.fatbin.xz: nvcc's fat binary with
  # sm_90 machine code), with CUDA_CACHE_DISABLE=1 so every load compiles what it must. (2) `strata
  # serve`'s warm-up (two short requests before it listens: the modules it uses loaded, graphs
  # captured) on the synthetic 30B, each variant with its own empty driver cache, then again with
  # that cache filled: the build's embedded kernels, and STRATA_CUDA_PTX=dist/jit/strata_decode.ptx
  # (the PTX the builds before this one embedded). (3) The kernel tests. (4) `strata bench --batch
  # BATCHES` (default 16) with each, alternating over ROUNDS (default 1). LOADS: loads per file in
  # (1), default 1; PARALLEL=N: then the PTX files loaded again from N threads (wall time).
  D="$OUT/module-load"; mkdir -p "$D"
  for f in dist/jit/*.xz; do unxz_to "$f" "${f%.xz}"; done
  echo "## driver load of each module, CUDA_CACHE_DISABLE=1 (ms)" | tee "$D/load.md"
  CUDA_CACHE_DISABLE=1 python3 - dist/jit/*.ptx dist/jit/*.fatbin <<'PY' 2>&1 | tee -a "$D/load.md"
import ctypes, os, sys, time
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
cu.cuDeviceGet(ctypes.byref(dev), 0)
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
for path in sys.argv[1:]:
    data = open(path, "rb").read() + b"\0"
    for rep in range(int(os.environ.get("LOADS", "1"))):
        mod = ctypes.c_void_p()
        t = time.perf_counter()
        rc = cu.cuModuleLoadData(ctypes.byref(mod), data)
        ms = (time.perf_counter() - t) * 1e3
        print(f"| {os.path.basename(path)} | {len(data) / 1e6:.1f} MB | load {rep + 1} | rc {rc} | {ms:.0f} ms |")
        if rc == 0:
            cu.cuModuleUnload(mod)
threads = int(os.environ.get("PARALLEL", "0"))
if threads:
    # The same loads from a pool of threads: does the driver compile modules side by side?
    from concurrent.futures import ThreadPoolExecutor
    paths = [p for p in sys.argv[1:] if p.endswith(".ptx")]
    datas = {p: open(p, "rb").read() + b"\0" for p in paths}
    def load(p):
        cu.cuCtxSetCurrent(ctx)
        mod = ctypes.c_void_p()
        return cu.cuModuleLoadData(ctypes.byref(mod), datas[p])
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        rcs = set(pool.map(load, paths))
    print(f"{len(paths)} PTX files from {threads} threads: {(time.perf_counter() - t) * 1e3:.0f} ms of wall time, rc {rcs}")
PY
  M30=/tmp/q3-30b-realistic.gguf
  [ -f $M30 ] || "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M30 > /dev/null 2>&1
  echo "## strata serve warm-up, each variant from its own empty driver cache, then again" | tee -a "$D/load.md"
  for start in 1 2; do
    for v in fatbin ptx; do
      env_v=(); [ $v = ptx ] && env_v=(STRATA_CUDA_PTX=dist/jit/strata_decode.ptx)
      [ $start = 1 ] && rm -rf /tmp/cc-$v
      env CUDA_CACHE_PATH=/tmp/cc-$v "${env_v[@]}" "$S" serve -m $M30 --device cuda --stream-experts off \
        --parallel 16 --port 8097 > "$D/serve-$v-$start.log" 2>&1 &
      pid=$!
      for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8097/v1/models > /dev/null 2>&1 && break; sleep 0.5; done
      echo "$v, start $start: $(grep -o 'warm-up: [0-9]* ms' "$D/serve-$v-$start.log"); cache $(du -sh /tmp/cc-$v 2>/dev/null | cut -f1)" | tee -a "$D/load.md"
      kill $pid; wait $pid 2>/dev/null
    done
  done
  kernel_tests "$D"
  echo "## strata bench, the embedded kernels and the PTX alternating (tok/s)" | tee -a "$D/load.md"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in fatbin ptx; do
      env_v=(); [ $v = ptx ] && env_v=(STRATA_CUDA_PTX=dist/jit/strata_decode.ptx)
      echo "$v round $r: $(env CUDA_CACHE_PATH=/tmp/cc-$v "${env_v[@]}" timeout 120 "$S" bench -m $M30 --device cuda \
        --stream-experts off -p 16 -n 64 -r 2 --batch "${BATCHES:-16}" 2>&1 | grep -E '^\| [^-]' \
        | grep -E 'tg|pp' | awk -F'|' '{printf "%s %s;", $4, $5}')" | tee -a "$D/load.md"
    done
  done
  exit 0
fi
if [ "${PART:-}" = prefix ]; then
  D="$OUT/prefix"; mkdir -p "$D"
  PM=${PREFIX_MODEL:-/tmp/tiny-prefix.gguf}
  [ -f "$PM" ] || "$S" synth --preset tiny-moe --quant Q4_K --routing realistic --out "$PM" > /dev/null 2>&1
  for v in 1 0; do
    STRATA_GPU_KV_SPAN=$v "$S" serve --model "$PM" --device cuda --stream-experts off --parallel 4 \
      --ctx-size 4096 --port 8123 > "$D/serve-$v.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8123/v1/models > /dev/null 2>&1 && break; sleep 0.5; done
    python3 scripts/prefix_check.py --url http://127.0.0.1:8123 > "$D/span-$v.json" 2> "$D/span-$v.err"
    kill $pid; wait $pid 2>/dev/null
  done
  python3 - "$D/span-1.json" "$D/span-0.json" <<'PY' | tee "$D/prefix.md"
import json, sys
a, b = [json.load(open(f)) for f in sys.argv[1:]]
same = [x["text"] == y["text"] for x, y in zip(a["results"], b["results"])]
hits = a["metrics"].get("strata_prefix_cache_hits_total") or 0
reused = a["metrics"].get("strata_prefix_cache_reused_tokens_total") or 0
print(f"prefix hits {hits:.0f}, reused tokens {reused:.0f}; "
      f"texts with the one-launch copies = without: {same}; seconds {[r['s'] for r in a['results']]} "
      f"against {[r['s'] for r in b['results']]}")
print("PASS" if all(same) and len(same) == 5 and hits >= 3 else "FAIL")
PY
  exit 0
fi
if [ "${PART:-}" = moe-mma ]; then
  D="$OUT/moe-mma"; mkdir -p "$D"
  VARS=${MMA_ENVS:-STRATA_GPU_MOE_MMA=0 X=1}
  if [ -z "${BENCH_ONLY:-}" ]; then
    unxz_to dist/cuda-kernels-test.xz /tmp/cuda-kernels-test
    /tmp/cuda-kernels-test --test-threads=1 ${KTESTS-moe} > "$D/kernels.txt" 2>&1; echo "kernel tests (${KTESTS-moe}) exit $?" | tee "$D/mma.md"
    grep -E "^test |test result|panicked" "$D/kernels.txt" | tee -a "$D/mma.md"
    for r in local realistic; do
      M=/tmp/tiny-bq-$r.gguf
      [ -f $M ] || "$S" synth --preset tiny-moe --quant Q4_K --routing $r --out $M >/dev/null 2>&1
      for v in "X=1 ${BATCH_TOL_MMA:-2e-2}" "STRATA_GPU_MOE_MMA_MIN=1,STRATA_GPU_DENSE_MMA=0 1e-5"; do
        set -- $v
        echo "tiny-moe $r: batch 16, $1 (bound $2):" | tee -a "$D/mma.md"
        env ${1//,/ } timeout 300 "$S" compare-devices -m $M --prompt "The quick brown fox jumps over the lazy dog. Once upon a time" \
          -n 40 --batch 16 --tolerance 1 --batch-tolerance "$2" > "$D/cmp.log" 2>&1; echo "exit $?" | tee -a "$D/mma.md"
        grep -E '^\||error' "$D/cmp.log" | tail -3 | tee -a "$D/mma.md"
      done
    done
  fi
  MC=/tmp/moe-mma-cut.gguf; M30=/tmp/q3-30b-realistic.gguf
  [ -f $MC ] || "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --layers 12 --out $MC > /dev/null 2>&1
  for v in $VARS; do
    STRATA_GPU_GRAPHS=0 STRATA_GPU_BATCH_GRAPHS=0 STRATA_GPU_PDL=0 timeout 200 env ${v//,/ } /usr/local/cuda/bin/ncu \
      --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \
      -k "regex:${KERNELS:-^(moe_|quantize_q8)}" \
      "$S" bench -m $MC --device cuda --stream-experts off -p 1 -n 3 -r 1 --batch 16 > "$D/ncu.csv" 2>/dev/null
    echo "## ncu, $v: the last 24 launches of each kernel and grid (two 16-row steps)" | tee -a "$D/mma.md"
    ncu_table "$D/ncu.csv" 24 grid | tee -a "$D/mma.md"
  done
  [ -f $M30 ] || "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M30 > /dev/null 2>&1
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in $VARS; do
      echo "## $v round $r: $(env ${v//,/ } timeout 150 "$S" bench -m $M30 --device cuda --stream-experts off \
        -p 16 -n 64 -r 2 --batch "${BATCHES:-1,16}" 2>&1 | grep -E '^\| [^-]' | grep tg \
        | awk -F'|' '{printf "%s %s;", $4, $5}')" | tee -a "$D/mma.md"
    done
  done
  exit 0
fi
if [ "${PART:-}" = ptx-variants ]; then
  # Kernel variants without a rebuild (STRATA_CUDA_PTX, strata-kernels' src/cuda.rs): each NAME of
  # NCU_VARS / E2E_VARS is dist/ptx/NAME.ptx.xz, made here with `nvcc --ptx -O3 -std=c++17
  # -arch=compute_90 [-DFLAG=...] crates/strata-kernels/cuda/decode.cu` then xz. NCU_VARS: ncu's
  # time of the kernels matching KERNELS (default ^moe_) over `strata bench --batch 16 -p 1 -n 3`
  # on a 12-layer cut of the synthetic 30B (realistic routing; serialized, caches and clocks left
  # alone, graphs and PDL off), each kernel's mean over its last 12 launches (the last 16-row
  # step's layers). E2E_VARS: `strata bench -p 16 -n 64 -r 2 --batch BATCHES` (default 16) on the
  # full synthetic 30B in VRAM, the variants alternating over ROUNDS (default 2).
  D="$OUT/ptx-variants"; mkdir -p "$D"
  for f in dist/ptx/*.ptx.xz; do [ -f "${f%.xz}" ] || unxz_to "$f" "${f%.xz}"; done
  MC=/tmp/ptx-variants-cut.gguf; M30=/tmp/q3-30b-realistic.gguf
  if [ -n "${NCU_VARS:-}" ] && [ ! -f $MC ]; then
    "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --layers 12 --out $MC > /dev/null 2>&1
  fi
  for v in ${NCU_VARS:-}; do
    STRATA_CUDA_PTX=dist/ptx/$v.ptx STRATA_GPU_GRAPHS=0 STRATA_GPU_BATCH_GRAPHS=0 STRATA_GPU_PDL=0 \
      timeout 200 /usr/local/cuda/bin/ncu --cache-control none --clock-control none \
      --metrics gpu__time_duration.sum --csv -k "regex:${KERNELS:-^moe_}" \
      "$S" bench -m $MC --device cuda --stream-experts off -p 1 -n 3 -r 1 --batch 16 > "$D/ncu-$v.csv" 2>/dev/null
    echo "## $v" | tee -a "$D/variants.md"; ncu_table "$D/ncu-$v.csv" 12 | tee -a "$D/variants.md"
  done
  if [ -n "${E2E_VARS:-}" ] && [ ! -f $M30 ]; then
    "$S" synth --preset qwen3-30b-a3b --quant Q4_K --routing realistic --out $M30 > /dev/null 2>&1
  fi
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in ${E2E_VARS:-}; do
      echo "## $v round $r: $(STRATA_CUDA_PTX=dist/ptx/$v.ptx timeout 100 "$S" bench -m $M30 --device cuda \
        --stream-experts off -p 16 -n 64 -r 2 --batch "${BATCHES:-16}" 2>&1 | grep -E '^\| [^-]' | grep tg \
        | awk -F'|' '{printf "%s %s;", $4, $5}')" | tee -a "$D/variants.md"
    done
  done
  exit 0
fi
if [ "${PART:-}" = ncu-llama ]; then
  # Decode-step kernels of Strata and llama.cpp side by side under ncu (issue 24), on the same
  # 12-layer cut of the synthetic 30B: every kernel serialized, with caches and clocks left alone
  # (NCU_MODES: "none flush", the second flushed and locked as PART=profile), 1000 launches after the first 3000
  # (decode steps). Strata op by op (ncu cannot follow its graph capture), llama.cpp as it runs.
  # "per layer" = the window's total over its attention launches.
  D="$OUT/ncu-llama"; mkdir -p "$D"
  start_llama_build
  # NCU_PRESET / NCU_LAYERS: another cut (e.g. qwen3.5-122b-a10b, 8: the hybrid's decode step).
  NP=${NCU_PRESET:-qwen3-30b-a3b}; NL=${NCU_LAYERS:-12}
  M12=/tmp/ncu-$NP-$NL.gguf
  [ -f $M12 ] || "$S" synth --preset $NP --routing local --layers $NL --out $M12 > /dev/null 2>&1
  while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
  for mode in ${NCU_MODES:-none flush}; do
  CTL=(--cache-control none --clock-control none); [ $mode = flush ] && CTL=()
  for who in strata llama; do
    if [ $who = strata ]; then
      CMD=(env STRATA_GPU_GRAPHS=0 STRATA_GPU_PDL=0 "$S" bench -m $M12 --device cuda --stream-experts off -p 8 -n 64 -r 1)
    else
      CMD=(/tmp/llama/bin/llama-bench -m $M12 -ngl 99 -p 0 -n 64 -r 1)
    fi
    timeout 300 /usr/local/cuda/bin/ncu "${CTL[@]}" --metrics gpu__time_duration.sum --csv \
      --launch-skip 3000 --launch-count 1000 "${CMD[@]}" > "$D/kernels-$who-$mode.csv" 2> "$D/kernels-$who-$mode.err"
    echo "## $who: kernels ($NP cut to $NL layers, 1000 launches after 3000, ${CTL[*]:-flushed, locked})" | tee -a "$D/ncu.md"
    ncu_table "$D/kernels-$who-$mode.csv" | tee -a "$D/ncu.md"
  done
  done
  exit 0
fi
if [ "${PART:-}" = hybrid ]; then
  D="$OUT/hybrid"; mkdir -p "$D"
  start_llama_build
  if [ -z "${BENCH_ONLY:-}" ]; then
    kernel_tests "$D"
    echo "## compare-devices (cuda vs cpu), DeltaNet kernels on (1) and off (0)" | tee -a "$D/check.md"
    for m in qwen3_next qwen3_5_moe; do
      I=$(ids $F/moe-tiny/$m.reference.json)
      for form in $F/moe-tiny/$m $F/moe-tiny/$m.gguf; do
        for v in 1 0; do
          printf "%s, STRATA_GPU_DELTANET=%s: " "$form" $v | tee -a "$D/check.md"
          STRATA_GPU_DELTANET=$v timeout 120 "$S" compare-devices -m "$form" --ids "$I" -n 16 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
        done
      done
    done
    "$S" synth --preset tiny-hybrid --quant Q4_K --routing realistic --out /tmp/tiny-hybrid.gguf >/dev/null 2>&1
    for v in 1 0; do
      printf "tiny-hybrid Q4_K (realistic routing), STRATA_GPU_DELTANET=%s: " $v | tee -a "$D/check.md"
      STRATA_GPU_DELTANET=$v STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-hybrid.gguf -p "The quick brown fox" -n 32 --tolerance 5e-2 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
    done
    SP="one two three four five six seven eight nine ten one two three four five six seven eight nine ten one two three"
    echo "## prompt passes of more than 32 tokens: parallel conv + chunked delta rule (STRATA_GPU_GDN_CHUNKED=1) or the token-by-token kernels (0)" | tee -a "$D/check.md"
    for form in $F/moe-tiny/qwen3_next $F/moe-tiny/qwen3_5_moe.gguf /tmp/tiny-hybrid.gguf; do
      tol=(); case $form in *tiny-hybrid*) tol=(--tolerance 5e-2);; esac
      for v in 1 0; do
        printf "%s, 69-word prompt, STRATA_GPU_GDN_CHUNKED=%s: " "$form" $v | tee -a "$D/check.md"
        STRATA_GPU_GDN_CHUNKED=$v STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m "$form" -p "$SP $SP $SP" -n 16 "${tol[@]}" 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
      done
    done
    echo "## speculative decoding = plain decoding on the GPU, greedy, tiny-hybrid (rollback of the recurrent state)" | tee -a "$D/check.md"
    for v in 1 0; do
      STRATA_GPU_DELTANET=$v "$S" generate -m /tmp/tiny-hybrid.gguf --device cuda -p "$SP" -n 96 --ignore-eos --temp 0 --json 2>>"$D/compare.err" > /tmp/gen-plain-$v.json
      for spec in "--spec self --draft-layers 1" "--spec ngram"; do
        STRATA_GPU_DELTANET=$v "$S" generate -m /tmp/tiny-hybrid.gguf --device cuda -p "$SP" -n 96 --ignore-eos --temp 0 $spec --draft-policy fixed --num-draft-tokens 4 --json 2>>"$D/compare.err" > /tmp/gen-spec.json
        python3 -c "
import json; a=json.load(open('/tmp/gen-spec.json')); b=json.load(open('/tmp/gen-plain-$v.json'))['generated_token_ids']
g=a['generated_token_ids']; same=sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(g,b)))
print('DELTANET=$v $spec: equal prefix', same, 'of', len(b), '| identical:', g==b, '| spec:', {k: v for k, v in a.items() if 'spec' in k or 'draft' in k or 'accept' in k})" | tee -a "$D/check.md"
      done
    done
    python3 -c "
import json; a=json.load(open('/tmp/gen-plain-1.json'))['generated_token_ids']; b=json.load(open('/tmp/gen-plain-0.json'))['generated_token_ids']
print('plain greedy, kernels on vs off: identical', a==b, '| equal prefix', sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(a,b))), 'of', len(b))" | tee -a "$D/check.md"
    echo "## tiny-hybrid decode steps replayed from CUDA graphs vs launched op by op (generated token ids)" | tee -a "$D/check.md"
    for samp in "--temp 0" "--temp 1 --seed 7"; do
      for n in 64 300; do # 300: past the 255-position bucket boundary, two captures
        for v in graphs opbyop; do
          envs=(X=1); [ $v = opbyop ] && envs=(STRATA_GPU_GRAPHS=0)
          env "${envs[@]}" "$S" generate -m /tmp/tiny-hybrid.gguf --device cuda -p "The quick brown fox" -n $n --ignore-eos $samp --json 2>>"$D/compare.err" > /tmp/gen-$v.json
        done
        python3 -c "
import json; a=json.load(open('/tmp/gen-graphs.json'))['generated_token_ids']; b=json.load(open('/tmp/gen-opbyop.json'))['generated_token_ids']
print('$samp, $n tokens: equal prefix', sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(a,b))), 'of', len(b), '| identical:', a==b)" | tee -a "$D/check.md"
      done
    done
    grep -iE "error|panick|capture" "$D/compare.err" | sort | uniq -c | head -5 | tee -a "$D/check.md"
  fi
  [ -z "${CHECK_ONLY:-}" ] || exit 0
  L=${LAYERS:-8}; R=${ROUTING:-local}
  M=/tmp/q35-122b-l$L-$R.gguf
  [ -f $M ] || { t0=$(date +%s); "$S" synth --preset qwen3.5-122b-a10b --layers $L --routing $R --out $M 2>&1 | tail -1 > "$D/synth.txt"; sync; echo "synth $(( $(date +%s) - t0 )) s: $(cat "$D/synth.txt")"; }
  ls -l $M | tee -a "$D/bench.md"
  if [ -f /tmp/llama-build.started ]; then
    while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
    cp /tmp/llama-build.txt "$D/"; tail -1 /tmp/llama-build.txt
  fi
  {
    echo "| run | pp512 tok/s | tg128 tok/s |"
    echo "|---|---|---|"
    for round in $(seq 1 ${ROUNDS:-2}); do
      for v in ${VARIANTS:-1 0}; do
        # VARIANTS: 1 (kernels, graphs), 0 (host path), nograph (kernels, op by op), norm256
        # (kernels, graphs, add_rms_norm on 256 threads: the block before 2026-11-27), recurrent
        # (kernels, graphs, prompt passes token by token: STRATA_GPU_GDN_CHUNKED=0)
        g=1 dn=$v nt=1024 ch=1; [ "$v" = nograph ] && { dn=1; g=0; }; [ "$v" = norm256 ] && { dn=1; nt=256; }
        [ "$v" = recurrent ] && { dn=1; ch=0; }
        STRATA_GPU_GDN_CHUNKED=$ch STRATA_GPU_NORM_THREADS=$nt STRATA_GPU_GRAPHS=$g STRATA_GPU_DELTANET=$dn timeout 300 "$S" bench -m $M --device cuda -p 512 -n 128 -r ${REPS:-2} --stream-experts off > /tmp/hb-$v.txt 2>/tmp/hb-$v.err
        bench_row /tmp/hb-$v.txt "deltanet=$dn graphs=$g norm threads=$nt chunked=$ch round $round" 128
        grep -h "device→host" /tmp/hb-$v.err | sed "s/^/    deltanet=$dn graphs=$g: /"
        grep -hiE "error|panick|capture" /tmp/hb-$v.err | head -3
      done
      if [ -x /tmp/llama/bin/llama-bench ]; then
        /tmp/llama/bin/llama-bench -m $M -ngl 99 -p 512 -n 128 -r ${REPS:-2} -o md > /tmp/hb-llama.txt 2>&1
        bench_row /tmp/hb-llama.txt "llama.cpp round $round" 128
      fi
    done
  } 2>&1 | tee -a "$D/bench.md"
  exit 0
fi
if [ "${PART:-}" = kv16 ]; then
  D="$OUT/kv16"; mkdir -p "$D"
  start_llama_build
  SP="one two three four five six seven eight nine ten one two three four five six seven eight nine ten one two three"
  if [ -z "${BENCH_ONLY:-}" ]; then
    kernel_tests "$D"
    grep -h "f16 KV cache" "$D/kernels.txt" | tee -a "$D/check.md"
    echo "## compare-devices (cuda vs the CPU's f32 cache): device cache f32, then f16" | tee -a "$D/check.md"
    "$S" synth --preset tiny-moe --quant Q4_K --routing realistic --out /tmp/tiny-Q4_K.gguf >/dev/null 2>&1
    "$S" synth --preset tiny-hybrid --quant Q4_K --routing realistic --out /tmp/tiny-hybrid-Q4_K.gguf >/dev/null 2>&1
    for kv in f32 f16; do
      for m in qwen3_moe qwen3_5_moe; do
        I=$(ids $F/moe-tiny/$m.reference.json)
        printf "%s.gguf, %s cache: " $m $kv | tee -a "$D/check.md"
        timeout 120 "$S" compare-devices -m $F/moe-tiny/$m.gguf --ids "$I" -n 16 --kv-cache-dtype $kv 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
      done
      printf "qwen3_next (HF), 69-word prompt, %s cache: " $kv | tee -a "$D/check.md"
      STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m $F/moe-tiny/qwen3_next -p "$SP $SP $SP" -n 16 --kv-cache-dtype $kv 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
      printf "tiny-moe Q4_K, 69-word prompt, 64 tokens, batch 4, %s cache: " $kv | tee -a "$D/check.md"
      STRATA_CPU_DEQUANTIZE=1 timeout 180 "$S" compare-devices -m /tmp/tiny-Q4_K.gguf -p "$SP $SP $SP" -n 64 --tolerance 5e-2 --batch 4 --kv-cache-dtype $kv 2>>"$D/compare.err" | tail -3 | tee -a "$D/check.md"
      # tiny-moe and tiny-hybrid have head dimension 64: with the f16 cache their 69-word prompt
      # passes attend on tensor cores (attend_prefill), the hybrid's beside its Gated DeltaNet.
      printf "tiny-hybrid Q4_K, 69-word prompt, %s cache: " $kv | tee -a "$D/check.md"
      STRATA_CPU_DEQUANTIZE=1 timeout 180 "$S" compare-devices -m /tmp/tiny-hybrid-Q4_K.gguf -p "$SP $SP $SP" -n 16 --tolerance 5e-2 --kv-cache-dtype $kv 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
    done
    echo "## f16 cache: graphs = op by op, speculation = plain decoding (greedy, 300 and 96 tokens)" | tee -a "$D/check.md"
    for v in graphs opbyop; do
      envs=(X=1); [ $v = opbyop ] && envs=(STRATA_GPU_GRAPHS=0)
      env "${envs[@]}" "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda --kv-cache-dtype f16 -p "The quick brown fox" -n 300 --ignore-eos --temp 0 --json 2>>"$D/compare.err" > /tmp/gen-$v.json
    done
    python3 -c "
import json; a=json.load(open('/tmp/gen-graphs.json'))['generated_token_ids']; b=json.load(open('/tmp/gen-opbyop.json'))['generated_token_ids']
print('f16 cache, graphs vs op by op, 300 tokens: identical:', a==b, len(a))" | tee -a "$D/check.md"
    "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda --kv-cache-dtype f16 -p "$SP" -n 96 --ignore-eos --temp 0 --json 2>>"$D/compare.err" > /tmp/gen-plain.json
    for spec in "--spec self --draft-layers 1" "--spec ngram"; do
      "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda --kv-cache-dtype f16 -p "$SP" -n 96 --ignore-eos --temp 0 $spec --draft-policy fixed --num-draft-tokens 4 --json 2>>"$D/compare.err" > /tmp/gen-spec.json
      python3 -c "
import json; a=json.load(open('/tmp/gen-spec.json')); b=json.load(open('/tmp/gen-plain.json'))['generated_token_ids']
g=a['generated_token_ids']; print('f16 cache $spec: identical to plain:', g==b, len(g))" | tee -a "$D/check.md"
    done
  fi
  [ -z "${CHECK_ONLY:-}" ] || exit 0
  M=/tmp/q3-30b-realistic.gguf
  [ -f $M ] || { "$S" synth --preset qwen3-30b-a3b --routing realistic --out $M 2>&1 | tail -1 > "$D/synth.txt"; sync; sleep 3; }
  DEPTHS=${DEPTHS:-0,4096,16384}
  if [ -f /tmp/llama-build.started ]; then
    while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
    cp /tmp/llama-build.txt "$D/"; tail -1 /tmp/llama-build.txt
  fi
  for round in $(seq 1 ${ROUNDS:-2}); do
    for kv in f32 f16; do
      echo "### strata, $kv cache, round $round" | tee -a "$D/bench.md"
      timeout 400 "$S" bench -m $M --device cuda -p 512 -n 128 -d $DEPTHS -r ${REPS:-2} --stream-experts off --kv-cache-dtype $kv 2>/tmp/kvb.err | grep "^|" | tee -a "$D/bench.md"
      tail -2 /tmp/kvb.err >> "$D/bench.err"
    done
    if [ -x /tmp/llama/bin/llama-bench ]; then
      echo "### llama.cpp (f16 cache, flash attention auto), round $round" | tee -a "$D/bench.md"
      timeout 400 /tmp/llama/bin/llama-bench -m $M -ngl 99 -p 512 -n 128 -d $DEPTHS -r ${REPS:-2} -o md 2>&1 | grep "^|" | tee -a "$D/bench.md"
    fi
  done
  exit 0
fi
if [ "${PART:-}" = decode ]; then
  D="$OUT/decode"; mkdir -p "$D"
  start_llama_build
  if [ -z "${BENCH_ONLY:-}" ]; then
    kernel_tests "$D"
    echo "## compare-devices (cuda vs cpu): GPU paths on, then off" | tee -a "$D/check.md"
    for q in Q4_K Q8_0; do
      "$S" synth --preset tiny-moe --quant $q --routing local --out /tmp/tiny-$q.gguf >/dev/null 2>&1
      for v in on off; do
        envs=(X=1); [ $v = off ] && envs=(STRATA_GPU_ROUTING=0 STRATA_GPU_ATTENTION=0 STRATA_GPU_GRAPHS=0 STRATA_GPU_MOE=0 STRATA_GPU_MATVEC=0 STRATA_GPU_FUSE=0)
        # STRATA_CPU_DEQUANTIZE=1: the CPU side in f32 (the reference of the f32-activation
        # kernels). Q4_K: the prompt pass (>= TC_ROWS_MIN tokens) rounds activations to f16 on
        # tensor cores, and with the GPU paths off candle's fused experts round them to Q8_1
        # (documented 6.9e-3): tolerance 5e-2 there. Q8_0 with the paths on: the dense mat-vecs
        # round activations to 8 bits (2.69e-2 measured 2026-11-27): 5e-2.
        tol=1e-4; { [ $q = Q4_K ] || [ $v = on ]; } && tol=5e-2
        echo "tiny-moe $q, GPU paths $v:" | tee -a "$D/check.md"
        env "${envs[@]}" STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-$q.gguf -p "The quick brown fox" -n 32 --tolerance $tol 2>>"$D/compare.err" | tail -2 | tee -a "$D/check.md"
      done
    done
    # A captured pass that is never replayed (a sequence ending right after its capture): freeing
    # its outputs unlaunched failed later calls (CUDA_ERROR_INVALID_VALUE, fixed 2026-11-27).
    echo "## passes captured and never replayed (-r 1: the second pass of a shape is the last)" | tee -a "$D/check.md"
    for p in 1 4 16; do
      if timeout 60 "$S" bench -m /tmp/tiny-Q4_K.gguf --device cuda --stream-experts off -p $p -n 0 -r 1 \
        >/tmp/capture-once.txt 2>&1; then r=ok; else r="FAILED: $(grep -m1 -i error /tmp/capture-once.txt)"; fi
      echo "pp$p, one rep: $r" | tee -a "$D/check.md"
    done
    echo "## decode steps replayed from CUDA graphs vs launched op by op (generated token ids)" | tee -a "$D/check.md"
    for samp in "--temp 0" "--temp 1 --seed 7"; do
      for n in 64 700; do # 700: past two bucket boundaries (255, 511), so three captures
        for v in graphs opbyop; do
          envs=(); [ $v = opbyop ] && envs=(STRATA_GPU_GRAPHS=0)
          env "${envs[@]}" "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda -p "The quick brown fox" -n $n --ignore-eos $samp --json 2>>"$D/compare.err" > /tmp/gen-$v.json
        done
        python3 -c "
import json,sys; a=json.load(open('/tmp/gen-graphs.json'))['generated_token_ids']; b=json.load(open('/tmp/gen-opbyop.json'))['generated_token_ids']
same=sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(a,b)))
print('$samp, $n tokens: equal prefix', same, 'of', len(b), '| identical:', a==b)" | tee -a "$D/check.md"
      done
    done
    grep -i "graph" "$D/compare.err" | sort | uniq -c | head -5 | tee -a "$D/check.md"
    echo "## synthetic routing processes (realistic, uniform) chosen on the host, weighed on the device: tokens and routing vs host routing" | tee -a "$D/check.md"
    for r in realistic uniform; do
      "$S" synth --preset tiny-moe --quant Q4_K --routing $r --out /tmp/tiny-$r.gguf >/dev/null 2>&1
      for samp in "--temp 0" "--temp 1 --seed 7"; do
        for v in graphs opbyop host; do
          envs=(X=1); [ $v = opbyop ] && envs=(STRATA_GPU_GRAPHS=0); [ $v = host ] && envs=(STRATA_GPU_ROUTING=0)
          env "${envs[@]}" "$S" generate -m /tmp/tiny-$r.gguf --device cuda -p "The quick brown fox" -n 300 --ignore-eos $samp --json 2>>"$D/compare.err" > /tmp/gen-$v.json
        done
        python3 -c "
import json; t={v: json.load(open(f'/tmp/gen-{v}.json'))['generated_token_ids'] for v in ('graphs','opbyop','host')}
same=lambda a,b: sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(t[a],t[b])))
print('$r $samp, 300 tokens: graphs = host routing for', same('graphs','host'), '| op by op = host routing for', same('opbyop','host'), '| graphs = op by op:', t['graphs']==t['opbyop'])" | tee -a "$D/check.md"
      done
      STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-$r.gguf -p "The quick brown fox" -n 32 --tolerance 5e-2 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
    done
    echo "## speculative decoding on the GPU (verify passes graph-replayed) vs plain decoding, greedy" | tee -a "$D/check.md"
    SP="one two three four five six seven eight nine ten one two three four five six seven eight nine ten one two three"
    "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda -p "$SP" -n 96 --ignore-eos --temp 0 --json 2>>"$D/compare.err" > /tmp/gen-plain.json
    for spec in "--spec self --draft-layers 1" "--spec ngram"; do
      for v in graphs opbyop; do
        envs=(X=1); [ $v = opbyop ] && envs=(STRATA_GPU_GRAPHS=0)
        env "${envs[@]}" "$S" generate -m /tmp/tiny-Q4_K.gguf --device cuda -p "$SP" -n 96 --ignore-eos --temp 0 $spec --draft-policy fixed --num-draft-tokens 4 --json 2>>"$D/compare.err" > /tmp/gen-spec.json
        python3 -c "
import json; a=json.load(open('/tmp/gen-spec.json')); b=json.load(open('/tmp/gen-plain.json'))['generated_token_ids']
g=a['generated_token_ids']; same=sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(g,b)))
print('$spec ($v): equal prefix', same, 'of', len(b), '| identical:', g==b, '| spec:', {k: v for k, v in a.items() if 'spec' in k or 'draft' in k or 'accept' in k})" | tee -a "$D/check.md"
      done
    done
    for m in qwen3_moe qwen3_5_moe; do
      I=$(ids $F/moe-tiny/$m.reference.json)
      timeout 120 "$S" compare-devices -m $F/moe-tiny/$m.gguf --ids "$I" -n 16 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
    done
  fi
  [ -z "${CHECK_ONLY:-}" ] || exit 0
  M=${DECODE_MODEL:-/tmp/q3-30b-local.gguf}
  R=local; case $M in *realistic*) R=realistic ;; *uniform*) R=uniform ;; esac # the file name says its routing
  [ -f $M ] || { "$S" synth --preset qwen3-30b-a3b --routing $R --out $M 2>&1 | tail -1 > "$D/synth.txt"; sync; sleep 3; }
  if [ "$M" = $SMOL_FILE ] && [ -z "${NO_COMPARE:-}" ]; then
    # Correctness on the real file first: cuda vs cpu logits and greedy tokens, both sides
    # rounding activations to 8 bits (our q8 mat-vecs; the CPU's kernels): 5.22e-2, greedy 32/32
    # measured 2026-11-27; then with candle's DMMV (STRATA_GPU_MATVEC=0, f32 activations) against
    # the CPU's f32 reference: 1.73e-6, greedy 64/64.
    "$S" compare-devices -m "$M" -p "The capital of France is" -n 64 --tolerance 1e-1 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
    STRATA_GPU_MATVEC=0 STRATA_CPU_DEQUANTIZE=1 "$S" compare-devices -m "$M" -p "The capital of France is" -n 64 --tolerance 1e-4 2>>"$D/compare.err" | tail -1 | tee -a "$D/check.md"
  fi
  [ -f dist/strata-cuda-base.xz ] && unxz_to dist/strata-cuda-base.xz /tmp/strata-base
  if [ -f /tmp/llama-build.started ]; then
    while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
    cp /tmp/llama-build.txt "$D/"; tail -1 /tmp/llama-build.txt
  fi
  bench() { # name, binary, env... : one `strata bench` line pair (pp512, tg128)
    local n=$1 b=$2; shift 2
    env "$@" timeout 300 "$b" bench -m $M --device cuda -p 512 -n 128 -r ${REPS:-2} --stream-experts off > /tmp/bench-$n.txt 2>&1
    bench_row /tmp/bench-$n.txt "$n" 128
  }
  {
    echo "| run | pp512 tok/s | tg128 tok/s |"
    echo "|---|---|---|"
    for round in $(seq 1 ${ROUNDS:-2}); do
      for v in ${VARIANTS:-new candle-moe candle-matvec candle}; do
        variant_envs "$v"
        bench "$v-$round" "$S" "${envs[@]}"
      done
      [ -x /tmp/strata-base ] && bench "base-$round" /tmp/strata-base
      if [ -x /tmp/llama/bin/llama-bench ]; then
        /tmp/llama/bin/llama-bench -m $M -ngl 99 -p 512 -n 128 -r ${REPS:-2} -o md > /tmp/llama-$round.txt 2>&1
        bench_row /tmp/llama-$round.txt "llama.cpp-$round" 128
      fi
    done
  } 2>&1 | tee "$D/bench.md"
  cp /tmp/bench-new-1.txt "$D/bench-new-1.txt" 2>/dev/null
  exit 0
fi
if [ "${PART:-}" = tier ]; then
  mkdir -p "$OUT/tier" /tmp/tier
  start_llama_build
  [ -n "${BENCH_ONLY:-}" ] || {
    echo "## MoE kernel tests (mapped experts: expert tables over VRAM rows and mapped host memory)"
    unxz_to dist/cuda-kernels-test.xz /tmp/cuda-kernels-test
    /tmp/cuda-kernels-test --test-threads=1 moe_ > /tmp/tier/kernels.txt 2>&1; echo "kernel tests exit $?"
    grep -E "^test |test result|panicked" /tmp/tier/kernels.txt
    echo "## GPU expert tier vs CPU (logits; greedy tokens)"
    "$S" synth --preset tiny-moe --quant Q4_K --out /tmp/tiny-q4k.gguf >/dev/null 2>&1
    # Per-expert VRAM storage (DMMV, f32 activations: our q8 mat-vecs off) against the CPU's f32
    # reference (with the q8 mat-vecs this row measured 1.08e-2, the activation rounding).
    for g in 10% 100%; do
      STRATA_FUSED_MOE=0 STRATA_GPU_MATVEC=0 STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-q4k.gguf -p "The quick brown fox" -n 32 --gpu-expert-cache $g 2>>/tmp/tier/compare.err | tail -2
    done
    # The VRAM pool (the fused kernels: f32 activations for passes of <= 16 tokens, f16 on tensor
    # cores for the 19-token prompt; Q8_1 with STRATA_GPU_MOE=0) against the CPU's f32 reference:
    # off by the activation rounding, like the resident fused path.
    for g in 10% 100%; do
      STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m /tmp/tiny-q4k.gguf -p "The quick brown fox" -n 32 --tolerance 5e-2 --gpu-expert-cache $g 2>>/tmp/tier/compare.err | tail -2
    done
    for m in qwen3_moe mixtral; do
      I=$(ids $F/moe-tiny/$m.reference.json)
      timeout 120 "$S" compare-devices -m $F/moe-tiny/$m --ids "$I" -n 16 --gpu-expert-cache 10% 2>>/tmp/tier/compare.err | tail -2
      STRATA_CPU_DEQUANTIZE=1 timeout 120 "$S" compare-devices -m $F/moe-tiny/$m.gguf --ids "$I" -n 16 --gpu-expert-cache 10% 2>>/tmp/tier/compare.err | tail -2
    done
    echo "## the VRAM pool vs resident fused experts (the same kernels): generated token ids"
    for samp in "--temp 0" "--temp 1 --seed 7"; do
      for mode in resident pool25 pool100 pool10 pool25host; do
        envs=(X=1)
        case $mode in
          resident) f=(--stream-experts off);;
          # The host-routed tier (lookups and copies before each launch) instead of mapped experts.
          pool25host) envs=(STRATA_GPU_TIER_MAPPED=0); f=(--stream-experts on --expert-cache 100% --gpu-expert-cache 25% --prefetch-min-precision 0);;
          # 16 of 64 experts: the prompt's 13 per layer fit, decode evicts and copies again.
          pool25) f=(--stream-experts on --expert-cache 100% --gpu-expert-cache 25% --prefetch-min-precision 0);;
          pool100) f=(--stream-experts on --expert-cache 100% --gpu-expert-cache 100%);;
          # 7 slots: prefill (13 experts per layer) falls back to one launch per expert (DMMV).
          pool10) f=(--stream-experts on --expert-cache 100% --gpu-expert-cache 10% --prefetch-min-precision 0);;
        esac
        env "${envs[@]}" "$S" generate -m /tmp/tiny-q4k.gguf --device cuda -p "The quick brown fox" -n 64 --ignore-eos $samp --json "${f[@]}" 2>>/tmp/tier/compare.err > /tmp/tier/tiny-$mode.json
      done
      python3 -c "
import json,sys; g={m: json.load(open(f'/tmp/tier/tiny-{m}.json')) for m in ('resident','pool25','pool100','pool10','pool25host')}
t={m: v['generated_token_ids'] for m, v in g.items()}
same=lambda m: sum(1 for _ in __import__('itertools').takewhile(lambda p: p[0]==p[1], zip(t[m], t['resident'])))
hits=lambda m: (lambda x: f\"{x.get('hits',0)}/{x.get('hits',0)+x.get('misses',0)}\")(g[m].get('experts_decode') or {})
print('$samp: tokens equal to resident fused, of', len(t['resident']), '| mapped pool 25%:', same('pool25'), '(VRAM hits', hits('pool25'), ') | 100%:', same('pool100'), '| 10%:', same('pool10'), '| host-routed 25%:', same('pool25host'))"
    done
  } 2>&1 | tee "$OUT/tier/compare.md"
  [ -z "${CHECK_ONLY:-}" ] || exit 0
  M=/tmp/q3-30b-q4k-${ROUTING:-realistic}.gguf
  if [ ! -f $M ]; then
    t0=$(date +%s)
    "$S" synth --preset qwen3-30b-a3b --routing "${ROUTING:-realistic}" --out $M 2>&1 | tail -1 > "$OUT/tier/synth.txt"
    echo "synth: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tier/synth.txt"
    sync; sleep 5 # the synthetic's dirty pages written back before anything is timed
  fi
  P="The quick brown fox"
  run() { # name, then generate flags
    local n=$1; shift
    timeout 240 "$S" generate -m $M --device cuda -p "$P" -n ${TOKENS:-128} --ignore-eos --json "$@" > /tmp/tier/$n.json 2> /tmp/tier/$n.err
    python3 - /tmp/tier/$n.json "$n" <<'PY'
import json, sys
try: g = json.load(open(sys.argv[1]))
except Exception as e: print(f"| {sys.argv[2]} | FAILED ({e}) |"); sys.exit()
x = g.get("experts_decode") or {}
n = max(1, len(g["generated_token_ids"]) - 1)
print(f"| {sys.argv[2]} | {g['decode_tok_s']:.1f} | {100*x.get('hits',0)/max(1,x.get('hits',0)+x.get('misses',0)):.1f}% | {x.get('upload_bytes',0)/n/1e6:.1f} | {x.get('bytes_read',0)/n/1e6:.1f} | {x.get('stall_ns',0)/n/1e6:.2f} | {x.get('prefetch_reads',0)}/{x.get('prefetch_used',0)} |")
PY
  }
  {
    echo "| run | decode tok/s | VRAM hit rate | copied MB/token | drive MB/token | stall ms/token | prefetch copies/used |"
    echo "|---|---|---|---|---|---|---|"
    G=(--temp 0); R=(--temp 1 --seed 7)
    if [ -n "${MAPPED_ROWS:-}" ]; then
      # Mapped experts (the default over a complete host tier) against the host-routed tier
      # (STRATA_GPU_TIER_MAPPED=0) and without promotions, alternating.
      # The host tier fills through the page cache (--direct-io off; the file was just written):
      # a run's load is then seconds, and every row starts from the same warm host tier.
      T=(--stream-experts on --expert-cache 100% --direct-io off)
      if [ -n "${LLAMA:-}" ]; then
        # No timing while llama.cpp builds on every core.
        while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
      fi
      for rep in 1 2; do
        run resident-fused-$rep --stream-experts off "${R[@]}"
        for g in 50% 25%; do
          for v in ${MAPPED_VARIANTS:-mapped nopromote hostrouted}; do
            case $v in
              mapped) envs=(X=1);;
              nopromote) envs=(STRATA_GPU_TIER_PROMOTE=0);;
              promoteall) envs=(STRATA_GPU_TIER_PROMOTE=100000);;
              p[0-9]*) envs=(STRATA_GPU_TIER_PROMOTE=${v#p});;
              hostrouted) envs=(STRATA_GPU_TIER_MAPPED=0);;
            esac
            (export "${envs[@]}"; run $v-vram$g-$rep "${T[@]}" --gpu-expert-cache $g "${R[@]}")
          done
        done
      done
      if [ -n "${LLAMA:-}" ]; then
        # llama.cpp keeping the experts of its first N layers on the CPU (-ncmoe): 24 of 48 ~ VRAM
        # 50%, 36 ~ 25%; beside `strata bench` tg128 with the same VRAM shares, alternating.
        while [ ! -f /tmp/llama-build.done ]; do sleep 5; done
        tail -1 /tmp/llama-build.txt
        for rep in 1 2; do
          for pair in "50% 24" "25% 36"; do
            set -- $pair
            echo "strata bench, VRAM $1, round $rep:"
            "$S" bench -m $M --device cuda --stream-experts on --expert-cache 100% --direct-io off --gpu-expert-cache $1 -p 16 -n 128 -r 1 2>/dev/null | grep -E "tg128|pp16"
            echo "llama-bench -ncmoe $2, round $rep:"
            /tmp/llama/bin/llama-bench -m $M -ngl 99 -ncmoe $2 -p 0 -n 128 -r 1 2>/dev/null | grep tg128
          done
        done
      fi
    elif [ -n "${BENCH_ONLY:-}" ]; then
      # Alternating rounds: this machine's run-to-run spread is large (resident 49–84 tok/s).
      for rep in 1 2; do
        run resident-fused-$rep --stream-experts off "${R[@]}"
        run pool-vram50-host100-$rep --stream-experts on --expert-cache 100% --gpu-expert-cache 50% "${R[@]}"
        run pool-vram25-host100-$rep --stream-experts on --expert-cache 100% --gpu-expert-cache 25% "${R[@]}"
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
        run pool-vram25-host50-drive-$rep --stream-experts on --expert-cache 50% --gpu-expert-cache 25% --direct-io "${R[@]}"
      done
    else
    run pool-vram100-sampled-noprefetch --stream-experts on --expert-cache 100% --gpu-expert-cache 100% --prefetch off "${R[@]}"
    run resident-fused-greedy --stream-experts off "${G[@]}"
    run resident-fused-sampled --stream-experts off "${R[@]}"
    run pool-vram100-sampled --stream-experts on --expert-cache 100% --gpu-expert-cache 100% "${R[@]}"
    for g in 50% 25%; do
      run pool-vram$g-host100-greedy --stream-experts on --expert-cache 100% --gpu-expert-cache $g "${G[@]}"
      run pool-vram$g-host100-sampled --stream-experts on --expert-cache 100% --gpu-expert-cache $g "${R[@]}"
      run pool-vram$g-host100-sampled-noprefetch --stream-experts on --expert-cache 100% --gpu-expert-cache $g --prefetch off "${R[@]}"
    done
    STRATA_FUSED_MOE=0 run perexpert-vram25-host100-sampled --stream-experts on --expert-cache 100% --gpu-expert-cache 25% "${R[@]}"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
    run pool-vram25-host50-drive-sampled --stream-experts on --expert-cache 50% --gpu-expert-cache 25% --direct-io "${R[@]}"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
    run pool-vram25-host50-drive-greedy --stream-experts on --expert-cache 50% --gpu-expert-cache 25% --direct-io "${G[@]}"
    fi
  } 2>&1 | tee "$OUT/tier/bench.md"
  grep -H "expert streaming\|experts:\|rror\|panic" /tmp/tier/*.err | head -60 > "$OUT/tier/lines.txt"
  tar czf "$OUT/tier/runs.tgz" -C /tmp tier
  "$S" info -m $M --device cuda --json > "$OUT/tier/info-h100.json" 2>&1
  "$S" bench --disk $M --disk-seconds 1 >> "$OUT/tier/synth.txt" 2>&1
  "$S" info -m $M --device cuda --vram 12GiB >> "$OUT/tier/synth.txt" 2>&1
  exit 0
fi
echo "## compare-devices (cuda vs cpu, f32 activations)" | tee "$OUT/compare.md"
ids() { python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['input_ids'])))" "$1"; }
F=tests/fixtures
DT=$(ids $F/dflash-tiny/reference.json)
"$S" compare-devices -m $F/dflash-tiny/target --ids "$DT" -n 48 2>>"$OUT/compare.err" | tail -1 | tee -a "$OUT/compare.md"
for m in qwen3_moe qwen2_moe mixtral olmoe qwen3_next qwen3_5_moe; do
  I=$(ids $F/moe-tiny/$m.reference.json)
  for form in "$F/moe-tiny/$m" "$F/moe-tiny/$m.gguf"; do
    timeout 120 "$S" compare-devices -m "$form" --ids "$I" -n 16 2>>"$OUT/compare.err" | tail -1 | tee -a "$OUT/compare.md" || echo "| $form | FAILED (see compare.err) |" | tee -a "$OUT/compare.md"
  done
done
SMOL=${SMOL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -f "$SMOL" ]; then
  # q8 activations on both sides (5.22e-2 measured), then DMMV against the f32 reference (PART=decode).
  "$S" compare-devices -m "$SMOL" -p "The capital of France is" -n 64 --tolerance 1e-1 2>>"$OUT/compare.err" | tail -1 | tee -a "$OUT/compare.md"
  STRATA_GPU_MATVEC=0 STRATA_CPU_DEQUANTIZE=1 "$S" compare-devices -m "$SMOL" -p "The capital of France is" -n 64 --tolerance 1e-4 2>>"$OUT/compare.err" | tail -1 | tee -a "$OUT/compare.md"
fi
echo "## DFlash on cuda (fixture target + draft_memo): greedy tokens equal plain decoding" | tee "$OUT/dflash.md"
for mode in plain dflash; do
  extra=(); [ $mode = dflash ] && extra=(--dflash --draft-model $F/dflash-tiny/draft_memo --draft-policy fixed)
  "$S" generate -m $F/dflash-tiny/target --device cuda -p "the quick brown fox" -n 48 --temp 0 --ignore-eos --json "${extra[@]}" 2>/dev/null > "$OUT/$mode.json"
done
python3 -c "
import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2]))
print('dflash == plain:', a['generated_token_ids']==b['generated_token_ids'], '| spec:', (b.get('spec') or {}).get('mean_accepted_length'))" "$OUT/plain.json" "$OUT/dflash.json" | tee -a "$OUT/dflash.md"
if [ "${PART:-}" = bench ]; then
  M=/tmp/q3-30b-q4k.gguf
  [ -f $M ] || "$S" synth --preset qwen3-30b-a3b --out $M 2>&1 | tail -1 | tee "$OUT/synth.txt"
  echo "## resident in VRAM (quantized matmuls: DMMV, f32 activations)" | tee "$OUT/bench.md"
  "$S" bench -m $M --device cuda -p 512 -n 128 -r 3 --stream-experts off 2>&1 | tee -a "$OUT/bench.md" | tail -4
  echo "## resident in VRAM, STRATA_CUDA_MMVQ=1 (Q8_1 activations)" | tee -a "$OUT/bench.md"
  STRATA_CUDA_MMVQ=1 "$S" bench -m $M --device cuda -p 512 -n 128 -r 3 --stream-experts off 2>&1 | tee -a "$OUT/bench.md" | tail -4
  echo "## --stream-experts, expert cache 25% (host RAM), experts copied to the GPU per use" | tee -a "$OUT/bench.md"
  "$S" generate -m $M --device cuda --stream-experts --expert-cache 25% -p "The quick brown fox" -n 64 --ignore-eos --temp 0 2>&1 >/dev/null | tee -a "$OUT/bench.md" | tail -4
fi
cat "$OUT/compare.md"
