//! Q4_K products of a few rows (batched steps, verify passes) on int8 tensor cores
//! (cuda/moe_mma.cuh): dense matrices ([`matmul_q4k_mma`], `q4k_mm3_q8`) and the routed-expert part
//! of a MoE block ([`moe_q4k_mma`], `moe_mmq_q8`): the pass's (token, slot) pairs grouped by expert
//! on the device, each selected expert's weights read once for all of its pairs. Both are the
//! defaults for batched steps of 8–16 sequences.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::CudaDevice;
use candle_core::quantized::QTensor;
use candle_core::{Result, Tensor};

use super::q8::kernel_inputs;
use super::{
    addr, addr_or_null, alloc, cuda_device, grouped_start, i32s, launch, moe_combine,
    moe_weight_args, Activations, Arg, ExpertTable, GroupedShape, MoeDims, SortedPairs,
};

/// Pairs (or rows) a tile takes (`MMA_TN` in moe_mma.cuh: the instruction's n).
const MMA_TN: usize = 8;
/// Weight rows of a `q4k_mm3_q8` block (`MMA_ROWS`; its warps split the super-blocks), and of
/// one warp of `moe_mmq_q8`.
const MMA_ROWS: usize = 16;

/// Warps of a `q4k_mm3_q8` block for rows of `nb` super-blocks: two super-blocks a warp (both
/// loads in flight at once), 1 to 8 warps (`MMQD_WARPS_MAX`). H200, a 16-row step of the
/// synthetic 30B (ncu): q/k/v (8 super-blocks) 10.1 µs with 4 warps against 13.1 with 8; o (16)
/// 9.7 µs with 8 against 12.8 with 4; the lm_head (8) 154 µs with 4 against 172 with 8
/// (docs/performance.md, thirty-fourth session).
fn dense_warps(nb: usize) -> usize {
    (nb / 2).clamp(1, 8)
}

/// Threads of a `moe_mmq_q8` block (`32 · MMQ_WARPS`).
const MMA_THREADS: u32 = 128;
/// Dynamic shared memory a `moe_mmq_q8` block may take without the kernel's opt-in: CUDA's default
/// limit of 48 KiB a block, less the kernel's 1 KiB of static shared memory.
const SMEM_DEFAULT_MAX: usize = 47 * 1024;

/// Bytes of `moe_mmq_q8`'s staged inputs for `cols`-value rows (the layout moe_mma.cuh reads,
/// `MMQ_PITCH`): a tile's q8 rows at a pitch of `cols + 32` bytes and their f32 scales, one per 32
/// values.
fn mmq_smem_bytes(cols: usize) -> usize {
    MMA_TN * (cols + 32) + MMA_TN * (cols / 32) * 4
}

/// Tokens a pass may have for [`moe_q4k_mma`] (the decode kernels' [`super::MOE_ROWS_MAX`]: longer
/// passes take the f16 tensor-core kernels, [`super::moe_q4k_tc`]). Measured and not taken (H200,
/// the synthetic 30B; docs/performance.md, thirty-fourth session): prompt passes of up to 256
/// tokens on these kernels ran 1.3–2.6× faster (57 tokens 4,391 against 1,710 tok/s), but a
/// prompt's kernels — and so its bits — would then depend on how many rows the prompts beside it
/// add to its pass (`compare-devices --batch 4`: 1.2e-1 against each sequence alone).
pub const MOE_MMA_ROWS_MAX: usize = super::MOE_ROWS_MAX;

/// The routed-expert part of a MoE block over Q4_K experts for a pass of a few tokens, on int8
/// tensor cores: shapes as [`super::moe_q4k`] (`x: [n, H]` f32, `gate`, `up: [E, I, H]`,
/// `down: [E, H, I]` Q4_K, `ids`, `weights: [n, k]`) → `[n, H]` = `Σⱼ weights[t, j] ·
/// down(silu(gate · x) ⊙ (up · x))` of expert `ids[t, j]`, no residual.
///
/// Six launches: `x` rounded to q8 ([`super::quantize_q8`], or the twin its producer wrote),
/// the pairs sorted by expert into tiles of 8 (`moe_tc_sort`), `moe_mmq_q8` over gate and up
/// (SwiGLU applied in the kernel), the activations rounded to q8, `moe_mmq_q8` over down, and
/// [`moe_combine`]. The arithmetic is llama.cpp's MMQ for Q4_K × Q8_1 (ggml-cuda mmq.cuh): a
/// 32-weight sub-block's integer dot product on the tensor cores (`mma.m16n8k32.s8`), scaled per
/// sub-block — the q8 kernels' values ([`super::moe_q4k_as`] with [`Activations::Q8`]) up to
/// summation order. A token's result does not depend on the other tokens of the pass (tested, bit
/// for bit): a batched step or a verify pass gives each token what it gets alone — but not the
/// bits a one-token pass gets from the per-pair kernels (another summation order).
///
/// H200, the synthetic 30B, a 16-sequence step (128 pairs on ~73 experts): gate/up 53.4 and down
/// 28.6 µs a layer against the per-pair kernels' 67.1 and 47.3 (docs/performance.md, thirty-third
/// session); the models take it for passes of `gpu::MOE_MMA_ROWS_MIN`–16 tokens.
///
/// `ids` must be below `E` (as a router's are): a pair with another id is never computed and its
/// output is undefined. With `table`, experts are read at the addresses it holds (the GPU expert
/// tier's mapped experts), the tensors giving only the shapes.
///
/// Errors: as [`super::moe_q4k`] (`n` up to [`MOE_MMA_ROWS_MAX`]), `E` up to
/// [`MOE_GROUPED_MAX_EXPERTS`].
pub fn moe_q4k_mma(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    ids: &Tensor,
    weights: &Tensor,
    table: Option<ExpertTable>,
) -> Result<Tensor> {
    let shape = GroupedShape { max_rows: MOE_MMA_ROWS_MAX, tile: MMA_TN, name: "moe_q4k_mma" };
    let (MoeDims { n, h, i, k, .. }, dev, sorted) =
        match grouped_start(x, [gate, up, down], ids, weights, table, shape)? {
            Ok(started) => started,
            Err(empty) => return Ok(empty),
        };
    let pairs = n * k;
    let ([gp, upp, dp], indirect) = moe_weight_args([gate, up, down], table)?;
    let a = alloc::<f32>(dev, (pairs, i))?;
    let glu = MmaLaunch { w: gp, w2: upp, rows: i, cols: h, k, per_token: true, indirect };
    mm_q8(dev, x, &sorted, pairs, glu, &a)?;
    let y = alloc::<f32>(dev, (pairs, h))?;
    let proj = MmaLaunch { w: dp, w2: 0, rows: h, cols: i, k: 1, per_token: false, indirect };
    mm_q8(dev, &a, &sorted, pairs, proj, &y)?;
    moe_combine(&y.reshape((n, k, h))?, &weights.contiguous()?)
}

/// One product of `moe_mmq_q8`: the weights' device addresses (tensors or tables), their shape,
/// and how pairs map to input rows.
struct MmaLaunch {
    w: u64,
    /// SwiGLU's up beside gate `w` (0: none).
    w2: u64,
    /// Weight rows per expert (the output's width).
    rows: usize,
    /// Values per weight row (the input's width, a multiple of 256).
    cols: usize,
    k: usize,
    /// Pair `p` reads input row `p / k` (else row `p`).
    per_token: bool,
    indirect: i32,
}

/// Runs `l` over `sorted`'s tiles: `src` (f32 `[rows, cols]`) rounded to q8, `out: [pairs,
/// l.rows]` f32. The caller checked the shapes.
fn mm_q8(
    dev: &CudaDevice,
    src: &Tensor,
    sorted: &SortedPairs,
    pairs: usize,
    l: MmaLaunch,
    out: &Tensor,
) -> Result<()> {
    let (_keep, mut args, _) = kernel_inputs(src, Activations::Q8)?;
    args.extend([
        Arg::Ptr(l.w),
        Arg::Ptr(l.w2),
        Arg::Ptr(addr(&sorted.order)?),
        Arg::Ptr(addr(&sorted.tiles)?),
        Arg::Ptr(addr(&sorted.ntiles)?),
        Arg::Ptr(addr(out)?),
    ]);
    args.extend(i32s(&[pairs, l.rows, l.cols, l.k, l.per_token as usize]));
    args.push(Arg::I32(l.indirect));
    // The tile's inputs in shared memory unless they would pass CUDA's default limit (then each
    // warp reads them from global memory: the same values).
    let smem = mmq_smem_bytes(l.cols);
    let staged = smem <= SMEM_DEFAULT_MAX;
    args.push(Arg::I32(staged as i32));
    // A block's warps take 16 rows each: four row groups of one matrix, or (with w2) two groups
    // of gate and the same two of up.
    let rows_per_block = if l.w2 != 0 { 2 * MMA_ROWS } else { 4 * MMA_ROWS };
    let cfg = LaunchConfig {
        grid_dim: (sorted.max_tiles as u32, l.rows.div_ceil(rows_per_block) as u32, 1),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: if staged { smem as u32 } else { 0 },
    };
    // SAFETY: arguments in `moe_mmq_q8`'s order; the caller checked that the weights are Q4_K
    // [E, rows, cols] (or a table of E such experts), that `src` holds a `cols`-value row per
    // token (per_token) or per pair, that `out` holds [pairs, rows], and `sorted` came from
    // `moe_tc_sort` over ids < E with tiles of MMA_TN.
    unsafe { launch(dev, "moe_mmq_q8", cfg, &args) }
}

/// `x: [n, K]` f32 times a Q4_K matrix `w: [R, K]` → `[n, R]` (`y = x · wᵀ`) for passes of a
/// few rows (the models take it for 8 to [`MOE_MMA_ROWS_MAX`]: batched decode steps, verify
/// passes) on int8 tensor cores: `x` rounded to q8 (or its twin taken), then `q4k_mm3_q8` over
/// blocks of 16 rows — each weight row read once per 16 rows instead of once per 4 (the mat-vec
/// kernel's tokens per warp). The q8 mat-vec's values up to summation order; a row's result does
/// not depend on the other rows (tested). One matrix of [`matmul_q4k_mma_many`].
///
/// Errors: `w` not Q4_K `[R, K]` with `K` a multiple of 256, `x` not f32 `[n, K]` on the same
/// device.
pub fn matmul_q4k_mma(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    Ok(matmul_q4k_mma_many(x, &[w])?.remove(0))
}

/// [`matmul_q4k_mma`] over up to three Q4_K matrices `ws[m]: [R_m, K]` sharing the input `x: [n,
/// K]` (a layer's q, k and v) in one launch (`q4k_mm3_q8`; `x` rounded to q8 once) → `[n, R_m]`
/// each, every one equal bit for bit to that matrix's launch alone (tested). A 16-row step's k and
/// v (512 rows each, 32 blocks) cost about the kernel's latency alone; fused with q they fill the
/// GPU together (docs/performance.md, twentieth session). A block takes 16 weight rows and 16 of
/// `x`'s rows (two tiles of 8 sharing each weight fragment), its warps splitting K; H200, a 16-row
/// step of the synthetic 30B: q/k/v 10.1 µs, o 9.7, the lm_head 154 against 11.9, 11.8 and 202
/// with the block this replaced (one tile a block, its weights staged in shared memory;
/// docs/performance.md, thirty-fourth session).
///
/// Errors: no matrix or more than three; any matrix refused as by [`matmul_q4k_mma`] (the same
/// `K` for all).
pub fn matmul_q4k_mma_many(x: &Tensor, ws: &[&QTensor]) -> Result<Vec<Tensor>> {
    if ws.is_empty() || ws.len() > 3 {
        candle_core::bail!("matmul_q4k_mma_many: {} matrices (1 to 3)", ws.len());
    }
    let mut rows = [0usize; 3];
    let mut n = 0;
    for (m, w) in ws.iter().enumerate() {
        let (nn, r, _) = super::check_dense_q4k(x, w, "matmul_q4k_mma_many")?;
        (n, rows[m]) = (nn, r);
    }
    let dev = cuda_device(x)?;
    let outs =
        (0..ws.len()).map(|m| alloc::<f32>(dev, (n, rows[m]))).collect::<Result<Vec<_>>>()?;
    if n == 0 || rows.iter().all(|&r| r == 0) {
        return Ok(outs);
    }
    let x = x.contiguous()?;
    let (_keep, mut args, _) = kernel_inputs(&x, Activations::Q8)?;
    for m in 0..3 {
        args.push(Arg::Ptr(match ws.get(m) {
            Some(w) => w.device_ptr()? as u64,
            None => 0,
        }));
    }
    for m in 0..3 {
        args.push(addr_or_null(outs.get(m))?);
    }
    args.extend(i32s(&[n, rows[0], rows[1], rows[2], x.dim(1)?]));
    let groups: usize = rows.iter().map(|r| r.div_ceil(MMA_ROWS)).sum();
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(2 * MMA_TN) as u32, groups as u32, 1),
        block_dim: (32 * dense_warps(x.dim(1)? / 256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments in `q4k_mm3_q8`'s order; every matrix checked Q4_K [R_m, K] against x
    // [n, K] (K a multiple of 256), each output [n, R_m], absent ones null with R = 0.
    unsafe { launch(dev, "q4k_mm3_q8", cfg, &args) }?;
    Ok(outs)
}
