//! Which of the GPU decode paths (our own CUDA kernels, `strata_kernels::cuda`) are on, read once
//! from the environment. On by default in a `cuda` build, each can be turned off for a
//! before/after measurement or to rule it out: `STRATA_GPU_ROUTING=0` (router top-k on the host,
//! one synchronisation per MoE layer), `STRATA_GPU_ATTENTION=0` (decode attention through
//! candle's matmul + softmax), `STRATA_GPU_GRAPHS=0` (decode steps launched op by op instead of
//! replayed from a captured CUDA graph), `STRATA_GPU_BATCH_GRAPHS=0` (only batched decode steps
//! of several sequences op by op), `STRATA_GPU_DENSE=0` (dense Q4_K products of 2 to
//! `MATMUL_ROWS_MAX` rows through candle: the whole matrix dequantized to f32, then cuBLAS),
//! `STRATA_GPU_MOE_TC=0` / `STRATA_GPU_DENSE_TC=0` (the Q4_K experts / dense Q4_K products of
//! prompt passes through candle instead of our tensor-core kernels: f16 inputs, f32 sums),
//! `STRATA_GPU_ATTN_TC=0` (prompt passes over an f16 KV cache attend through candle's f32
//! matmuls over an f32 copy of the cache instead of our tensor-core flash-attention kernel),
//! `STRATA_GPU_ATTN_TC_DECODE=0` (decode and verify passes over an f16 cache on the CUDA-core
//! split-K kernel `attend_decode` instead of the tensor-core one), `STRATA_GPU_ATTN_TC_ROWS=0`
//! (a batched prompt pass attends sequence by sequence instead of in one launch over a row
//! table), `STRATA_GPU_F32_ROWS=0` (a prompt pass's router logits through cuBLAS instead of our
//! row-independent f32 product),
//! `STRATA_GPU_MATVEC=0` (one-row dense Q4_K products through candle's DMMV kernel instead of
//! ours, q/k/v as three launches instead of one, router logits through cuBLAS),
//! `STRATA_GPU_Q8=0` (the Q4_K mat-vec and short-pass MoE kernels on f32 inputs instead of
//! inputs rounded to 8 bits per 32 values; read by `strata_kernels::cuda::activations`),
//! `STRATA_GPU_SHORT_MATVEC=0` (dense Q4_K products of 2 to `MATVEC_ROWS_MAX` rows — verify
//! passes — through the row-dequantizing `matmul_q4k` instead of the mat-vec kernel, four tokens
//! per warp), `STRATA_GPU_FUSE=0` (residual add and RMSNorm as two launches, per-head q/k norms through
//! candle instead of inside the RoPE kernel), `STRATA_GPU_MOE=0` (the Q4_K experts of short passes through candle's
//! `indexed_moe_forward` instead of our kernels), `STRATA_GPU_DELTANET=0` (hybrid models' Gated
//! DeltaNet layers and their recurrent state on the host, the projections copied there every
//! pass, instead of our kernels with the state on the device), `STRATA_GPU_ARGMAX=0` (greedy
//! picks, [`crate::Logits::Greedy`], from logits brought to the host instead of on the device),
//! `STRATA_GPU_SPLIT_MIXED=0` (a batched pass of decode rows and prompt chunks as one pass, the
//! decode rows on the prompt kernels, instead of two), `STRATA_GPU_GDN_TABLES=0` (an op-by-op
//! batched pass runs a hybrid's decode rows through each Gated DeltaNet layer sequence by
//! sequence instead of in one launch per kernel over a state table).
//!
//! Off by default, measured slower on the H100: `STRATA_GPU_MOE_GROUPED=1` runs the Q4_K
//! experts of batched passes (2 to `MOE_GROUPED_ROWS_MAX` tokens) on our kernels grouped by
//! expert instead (docs/performance.md, "Batched decode on the H100: where a 16-sequence step
//! goes").

use std::sync::OnceLock;

/// A GPU path that can be turned off.
#[derive(Debug, Clone, Copy)]
pub enum GpuPath {
    /// MoE routing on the device ([`crate::SparseMoe`]): ids and weights never reach the host
    /// during the pass.
    Routing,
    /// RoPE + KV write + split-K attention kernels for passes of at most
    /// [`crate::attention::GPU_ATTEND_ROWS_MAX`] tokens; the causal softmax kernel for longer
    /// ones.
    Attention,
    /// Our Q4_K MoE kernels for passes of a few tokens ([`crate::FusedExperts`]): gate + up +
    /// SiLU in one launch, down + the weighted sum in another.
    Moe,
    /// Our Q4_K MoE kernels grouped by expert for passes of 2 to
    /// `strata_kernels::cuda::MOE_GROUPED_ROWS_MAX` tokens ([`crate::FusedExperts`]); off unless
    /// asked for.
    MoeGrouped,
    /// Our Q4_K MoE kernel on int8 tensor cores for passes of up to
    /// `strata_kernels::cuda::MOE_MMA_ROWS_MAX` tokens (`moe_q4k_mma`: pairs grouped by expert,
    /// each expert read once per pass), over q8 activations; the row counts it takes:
    /// `moe_mma_rows` (by default batched steps of [`MOE_MMA_ROWS_MIN`]–16 sequences).
    MoeMma,
    /// Dense Q4_K products of a few rows (batched decode steps, verify passes) on int8 tensor
    /// cores (`matmul_q4k_mma`); the row counts it takes: `dense_mma_rows`.
    DenseMma,
    /// Dense Q4_K products of 2 to `MATMUL_ROWS_MAX` rows on our kernel
    /// ([`crate::layers::Linear`]).
    Dense,
    /// One-row dense Q4_K / Q4_1 / Q8_0 products (decode steps) on our mat-vec kernel, a
    /// layer's q/k/v in one launch (a dense MLP's gate and up too), one-row f32 products (router
    /// logits) on ours ([`crate::layers::Linear`]).
    MatVec,
    /// Dense Q4_K products of 2 to [`MATVEC_ROWS_MAX`] rows (short verify passes) on the mat-vec
    /// kernel, four tokens per warp, so each row equals a decode step's product bit for bit
    /// ([`crate::layers::Linear`]); needs [`GpuPath::MatVec`].
    ShortMatVec,
    /// Launch fusions: residual add + RMSNorm ([`crate::layers::RmsNorm::add_forward`]),
    /// per-head q/k RMSNorm inside the RoPE kernel.
    Fuse,
    /// Q4_K experts of prompt passes (at least `strata_kernels::cuda::TC_ROWS_MIN` tokens) on
    /// our tensor-core kernels, grouped by expert ([`crate::FusedExperts`]).
    MoeTc,
    /// Dense Q4_K products of prompt passes on our tensor-core kernel ([`crate::layers::Linear`]).
    DenseTc,
    /// Attention of prompt passes over an f16 KV cache on our tensor-core kernel
    /// (`strata_kernels::cuda::attend_prefill`, [`crate::attention`]); needs
    /// [`GpuPath::Attention`].
    AttnTc,
    /// f32 products of many rows with at most `strata_kernels::cuda::MATMUL_F32_ROWS_MAX_OUT`
    /// outputs (a MoE router's logits in a prompt pass) on our row-independent kernel
    /// (`strata_kernels::cuda::matmul_f32_rows`) instead of cuBLAS, whose kernel choice made a
    /// prompt's logits depend on the other prompts of its pass ([`crate::layers::Linear`]).
    F32Rows,
    /// A batched prompt pass's attention (every sequence's chunk longer than
    /// [`crate::attention::GPU_ATTEND_ROWS_MAX`] tokens) over f16 KV caches in one launch of the
    /// tensor-core kernel over a row table (`strata_kernels::cuda::attend_prefill_rows`), RoPE
    /// and the cache writes in one more, instead of three launches per sequence; needs
    /// [`GpuPath::AttnTc`].
    AttnTcRows,
    /// Decode and verify passes (batched ones too) over an f16 KV cache on the tensor-core split-K
    /// kernel (`strata_kernels::cuda::attend_decode_tc`) instead of `attend_decode`; needs
    /// [`GpuPath::Attention`].
    AttnTcDecode,
    /// The decode step captured once per context bucket as a CUDA graph and replayed
    /// (`Transformer`'s graph path).
    Graphs,
    /// Batched decode steps of several sequences captured as CUDA graphs too (needs
    /// [`GpuPath::Graphs`]).
    BatchGraphs,
    /// Gated DeltaNet layers on our kernels, their recurrent state (and its speculative
    /// checkpoint) on the device ([`crate::recurrent::RecurrentCache::on_device`]).
    DeltaNet,
    /// The greedy pick of a [`crate::Logits::Greedy`] sequence made on the device
    /// (`strata_kernels::cuda::argmax_rows`): its logits stay there.
    Argmax,
    /// A prefix-cache block's keys and values copied out of (and back into) a KV cache in one
    /// launch over every layer (`strata_kernels::cuda::KvSpanTable`)
    /// instead of one candle copy per layer and tensor ([`crate::KvCache::export_block`]).
    KvSpan,
    /// A batched pass mixing decode rows with prompt chunks, every expert resident, as two
    /// passes: the decode rows as a batched decode step, then the chunks
    /// ([`crate::Transformer::splits_mixed`]).
    SplitMixed,
    /// The one-token sequences leading an op-by-op batched pass through a Gated DeltaNet layer
    /// (a hybrid's decode rows) in one launch per kernel over a state table
    /// (`strata_kernels::cuda::gdn_conv_seqs`, `gdn_delta_seqs`) instead of sequence by sequence
    /// (captured batched steps always take the table).
    GdnTables,
}

/// Rows of `x` up to which a dense Q4_K product runs on the mat-vec kernel
/// ([`GpuPath::ShortMatVec`]): speculative verify passes (a decode token and its draft) and
/// continuous batches of up to 16 sequences. (With 8, a batch of 10 sequences on the 30B took
/// 17.4 ms a step against 10.6 ms for 8: rows 9–16 went to `matmul_q4k`.)
pub const MATVEC_ROWS_MAX: usize = 16;

/// Whether a dense Q4_K product of `rows` rows runs on the mat-vec kernel: one row with
/// [`GpuPath::MatVec`] on, up to [`MATVEC_ROWS_MAX`] with [`GpuPath::ShortMatVec`] on too.
pub fn matvec_rows(rows: usize) -> bool {
    enabled(GpuPath::MatVec)
        && (rows == 1 || ((2..=MATVEC_ROWS_MAX).contains(&rows) && enabled(GpuPath::ShortMatVec)))
}

/// Rows of `x` up to which a dense Q4_1 / Q8_0 product runs on the mat-vec kernel: these formats
/// have no multi-row kernel of ours (candle's path dequantizes the whole matrix to f32 for cuBLAS),
/// so the mat-vec, four tokens per warp, also serves small batches (continuous batching).
pub const MATVEC_B32_ROWS_MAX: usize = 16;

/// [`matvec_rows`] for a matrix of `dtype`: up to [`MATVEC_B32_ROWS_MAX`] rows for Q4_1 / Q8_0.
pub fn matvec_rows_of(dtype: candle_core::quantized::GgmlDType, rows: usize) -> bool {
    use candle_core::quantized::GgmlDType;
    let b32 = matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q8_0);
    matvec_rows(rows)
        || (b32
            && (2..=MATVEC_B32_ROWS_MAX).contains(&rows)
            && enabled(GpuPath::MatVec)
            && enabled(GpuPath::ShortMatVec))
}

/// Whether `path` is on: its variable is not `0` ([`GpuPath::MoeGrouped`], [`GpuPath::MoeMma`]:
/// is `1`).
pub fn enabled(path: GpuPath) -> bool {
    static ROUTING: OnceLock<bool> = OnceLock::new();
    static ATTENTION: OnceLock<bool> = OnceLock::new();
    static GRAPHS: OnceLock<bool> = OnceLock::new();
    static BATCH_GRAPHS: OnceLock<bool> = OnceLock::new();
    static MOE: OnceLock<bool> = OnceLock::new();
    static MOE_GROUPED: OnceLock<bool> = OnceLock::new();
    static MOE_MMA: OnceLock<bool> = OnceLock::new();
    static DENSE_MMA: OnceLock<bool> = OnceLock::new();
    static DENSE: OnceLock<bool> = OnceLock::new();
    static MATVEC: OnceLock<bool> = OnceLock::new();
    static FUSE: OnceLock<bool> = OnceLock::new();
    static SHORT_MATVEC: OnceLock<bool> = OnceLock::new();
    static MOE_TC: OnceLock<bool> = OnceLock::new();
    static DENSE_TC: OnceLock<bool> = OnceLock::new();
    static ATTN_TC: OnceLock<bool> = OnceLock::new();
    static ATTN_TC_DECODE: OnceLock<bool> = OnceLock::new();
    static ATTN_TC_ROWS: OnceLock<bool> = OnceLock::new();
    static F32_ROWS: OnceLock<bool> = OnceLock::new();
    static DELTANET: OnceLock<bool> = OnceLock::new();
    static ARGMAX: OnceLock<bool> = OnceLock::new();
    static KV_SPAN: OnceLock<bool> = OnceLock::new();
    static SPLIT_MIXED: OnceLock<bool> = OnceLock::new();
    static GDN_TABLES: OnceLock<bool> = OnceLock::new();
    let (cell, var) = match path {
        GpuPath::Routing => (&ROUTING, "STRATA_GPU_ROUTING"),
        GpuPath::Attention => (&ATTENTION, "STRATA_GPU_ATTENTION"),
        GpuPath::Graphs => (&GRAPHS, "STRATA_GPU_GRAPHS"),
        GpuPath::BatchGraphs => (&BATCH_GRAPHS, "STRATA_GPU_BATCH_GRAPHS"),
        GpuPath::Moe => (&MOE, "STRATA_GPU_MOE"),
        GpuPath::MoeGrouped => (&MOE_GROUPED, "STRATA_GPU_MOE_GROUPED"),
        GpuPath::MoeMma => (&MOE_MMA, "STRATA_GPU_MOE_MMA"),
        GpuPath::DenseMma => (&DENSE_MMA, "STRATA_GPU_DENSE_MMA"),
        GpuPath::Dense => (&DENSE, "STRATA_GPU_DENSE"),
        GpuPath::MatVec => (&MATVEC, "STRATA_GPU_MATVEC"),
        GpuPath::Fuse => (&FUSE, "STRATA_GPU_FUSE"),
        GpuPath::ShortMatVec => (&SHORT_MATVEC, "STRATA_GPU_SHORT_MATVEC"),
        GpuPath::MoeTc => (&MOE_TC, "STRATA_GPU_MOE_TC"),
        GpuPath::DenseTc => (&DENSE_TC, "STRATA_GPU_DENSE_TC"),
        GpuPath::AttnTc => (&ATTN_TC, "STRATA_GPU_ATTN_TC"),
        GpuPath::AttnTcDecode => (&ATTN_TC_DECODE, "STRATA_GPU_ATTN_TC_DECODE"),
        GpuPath::AttnTcRows => (&ATTN_TC_ROWS, "STRATA_GPU_ATTN_TC_ROWS"),
        GpuPath::F32Rows => (&F32_ROWS, "STRATA_GPU_F32_ROWS"),
        GpuPath::DeltaNet => (&DELTANET, "STRATA_GPU_DELTANET"),
        GpuPath::Argmax => (&ARGMAX, "STRATA_GPU_ARGMAX"),
        GpuPath::KvSpan => (&KV_SPAN, "STRATA_GPU_KV_SPAN"),
        GpuPath::SplitMixed => (&SPLIT_MIXED, "STRATA_GPU_SPLIT_MIXED"),
        GpuPath::GdnTables => (&GDN_TABLES, "STRATA_GPU_GDN_TABLES"),
    };
    *cell.get_or_init(|| match (path, std::env::var(var)) {
        (GpuPath::MoeGrouped, v) => v.is_ok_and(|v| v == "1"),
        (_, v) => !v.is_ok_and(|v| v == "0"),
    })
}

/// Fewest tokens a pass has for its MoE layers to take [`GpuPath::MoeMma`] by default: a batched
/// step of 8–16 sequences reads the union of its tokens' experts once (H200, the synthetic 30B
/// with realistic routing: 16 sequences' MoE kernels 87 µs a layer with the pairs' sort and
/// combine, against 114 µs; docs/performance.md, thirty-third session). Such a pass then sums each
/// token's expert products in another order than a one-token step's per-pair kernels do (as
/// [`DENSE_MMA_ROWS_MIN`]).
pub const MOE_MMA_ROWS_MIN: usize = 8;

/// Fewest rows a dense Q4_K product has to take [`GpuPath::DenseMma`] by default: batched
/// steps of 8–16 sequences ran faster on it, 2–4 slower than on the mat-vec kernel (H200, the
/// synthetic 30B; docs/performance.md). A pass of 8–16 rows (a batch, a long verify pass) then
/// sums each row in another order than a one-row decode step does.
pub const DENSE_MMA_ROWS_MIN: usize = 8;

/// `rows` within `[VAR (unset: default_min), MOE_MMA_ROWS_MAX]`, q8 activations on.
#[cfg(feature = "cuda")]
fn mma_rows(rows: usize, cell: &OnceLock<usize>, var: &str, default_min: usize) -> bool {
    use strata_kernels::cuda as k;
    let min = *cell.get_or_init(|| {
        std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default_min)
    });
    (min.max(1)..=k::MOE_MMA_ROWS_MAX).contains(&rows) && k::activations() == k::Activations::Q8
}

/// Whether a MoE layer's pass of `rows` tokens runs on the int8 tensor-core kernel:
/// [`GpuPath::MoeMma`] on (`STRATA_GPU_MOE_MMA=0` turns it off), q8 activations on, not inside
/// [`rows_exact_scope`], and `rows` from `STRATA_GPU_MOE_MMA_MIN` (unset: [`MOE_MMA_ROWS_MIN`]) up
/// to `strata_kernels::cuda::MOE_MMA_ROWS_MAX`.
#[cfg(feature = "cuda")]
pub fn moe_mma_rows(rows: usize) -> bool {
    static MIN: OnceLock<usize> = OnceLock::new();
    enabled(GpuPath::MoeMma)
        && !ROWS_EXACT.with(std::cell::Cell::get)
        && mma_rows(rows, &MIN, "STRATA_GPU_MOE_MMA_MIN", MOE_MMA_ROWS_MIN)
}

/// Whether a dense Q4_K product of `rows` rows runs on the int8 tensor-core kernel:
/// [`GpuPath::DenseMma`] on, q8 activations on, and `rows` from `STRATA_GPU_DENSE_MMA_MIN` (unset:
/// [`DENSE_MMA_ROWS_MIN`]) up to `strata_kernels::cuda::MOE_MMA_ROWS_MAX`.
#[cfg(feature = "cuda")]
pub fn dense_mma_rows(rows: usize) -> bool {
    static MIN: OnceLock<usize> = OnceLock::new();
    enabled(GpuPath::DenseMma)
        && !ROWS_EXACT.with(std::cell::Cell::get)
        && mma_rows(rows, &MIN, "STRATA_GPU_DENSE_MMA_MIN", DENSE_MMA_ROWS_MIN)
}

thread_local! {
    static ROWS_EXACT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (a batched pass of a model with recurrent layers) with the dense products of 8–16
/// rows on the mat-vec kernel instead of the int8 tensor-core tiles ([`dense_mma_rows`] false on
/// this thread), and its MoE layers on the per-pair kernels ([`moe_mma_rows`] false), so that each
/// row is a one-row step's bits. A Gated DeltaNet state carries a difference in the last bits on
/// to every later token of its sequence: on tiny-hybrid Q4_K, 16
/// sequences batched with the tiles kept 557 of 620 greedy tokens of each decoded alone
/// (`compare-devices --batch 16`), and every one without them (docs/performance.md).
pub fn rows_exact_scope<R>(f: impl FnOnce() -> R) -> R {
    strata_kernels::with_thread_flag(&ROWS_EXACT, true, f)
}

/// Device → host reads the model's layers made during forward passes on a GPU, since the
/// process started ([`host_reads`]): the host paths that copy a layer's tensors to the host
/// mid-pass (a Gated DeltaNet layer's projections, a router's logits for a top-k on the host) and
/// the one read of a pass's device routing record at its end. The logits the caller reads are not
/// counted. A decode step that never waits for the host between layers counts at most one (the
/// routing record).
static HOST_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts `n` device → host reads of a forward pass on a GPU ([`host_reads`]).
pub(crate) fn note_host_reads(n: u64) {
    HOST_READS.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// Device → host reads of the model's layers on a GPU so far (see [`note_host_reads`]'s static:
/// the benchmark reports them per decode step).
pub fn host_reads() -> u64 {
    HOST_READS.load(std::sync::atomic::Ordering::Relaxed)
}
