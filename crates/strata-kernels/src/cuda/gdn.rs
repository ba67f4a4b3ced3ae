//! Gated DeltaNet layers on the device (`cuda/gdn.cuh`): the causal conv with its rolling window
//! ([`gdn_conv`]), the delta rule over the recurrent state ([`gdn_delta`]) and the gated RMSNorm
//! ([`gdn_gated_norm`]). Algorithm: Yang, Kautz, Hatamizadeh 2024 (arXiv 2412.06464); CPU
//! reference `strata_models::gated_delta_net` (transformers `torch_recurrent_gated_delta_rule`).
//!
//! A pass of `T` tokens reads `row: [T, rw]`, per token the in-projections' outputs in
//! `[qkv (cd) | z (vw) | b (nv) | a (nv)]` order. [`gdn_delta`] runs the recurrent form token by
//! token, so a verify pass's rows equal decode steps bit for bit; prompt passes take
//! [`gdn_delta_chunked`] (the chunked form: `T / 16` dependent steps instead of `T`, equal up to
//! f32 rounding). The state tensors are updated in place.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{bail, Result, Tensor};

use super::{addr, alloc, check_f32, cuda_device, launch, Arg};

/// Most conv taps (`GDN_KMAX`).
const KMAX: usize = 8;
/// Largest key head dimension (`32 · GDN_RMAX`).
const DK_MAX: usize = 256;
/// Value columns per delta block (`GDN_WARPS`).
const WARPS: usize = 4;
/// Largest key head dimension of the chunked form (`GDN_CDK`).
const CHUNKED_DK_MAX: usize = 128;
/// Value columns per chunked block (`GDN_CT`).
const CHUNKED_COLS: usize = 32;
/// Passes of more tokens than this compute the conv's outputs all at once (`gdn_conv_rows`);
/// shorter ones (decode steps, verify passes) walk their tokens in one thread per channel.
const CONV_ROWS_MIN: usize = 16;

/// Whether prompt passes take the parallel conv and the chunked delta rule (on unless
/// `STRATA_GPU_GDN_CHUNKED=0`, which keeps the token-by-token kernels for every pass: a
/// measurement switch).
pub fn gdn_chunked_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_GPU_GDN_CHUNKED").map_or(true, |v| v != "0"))
}

/// A Gated DeltaNet layer's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnShape {
    pub k_heads: usize,
    pub v_heads: usize,
    /// Key (and query) head dimension.
    pub k_dim: usize,
    /// Value head dimension.
    pub v_dim: usize,
    /// Conv taps.
    pub kernel: usize,
    /// Value head `h` reads key head `h / (v_heads / k_heads)` (else `h % k_heads`).
    pub grouped: bool,
}

impl GdnShape {
    /// Conv channels `2 · k_heads · k_dim + v_heads · v_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.value_width()
    }

    /// `v_heads · v_dim`.
    pub fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// Width of a pass's input row: `conv_dim + value_width + 2 · v_heads`.
    pub fn row_width(&self) -> usize {
        self.conv_dim() + self.value_width() + 2 * self.v_heads
    }

    /// Whether prompt passes of this shape can take [`gdn_delta_chunked`]: key heads of up to
    /// 128, and [`gdn_chunked_enabled`].
    pub fn takes_chunked(&self) -> bool {
        self.k_dim <= CHUNKED_DK_MAX && gdn_chunked_enabled()
    }

    /// Whether the kernels take this shape (`kernel ≤ 8`, `k_dim ≤ 256`, heads that divide).
    pub fn supported(&self) -> bool {
        (1..=KMAX).contains(&self.kernel)
            && (1..=DK_MAX).contains(&self.k_dim)
            && self.v_dim > 0
            && self.k_heads > 0
            && self.v_heads.is_multiple_of(self.k_heads)
    }
}

fn check_shape(s: &GdnShape, row: &Tensor) -> Result<usize> {
    if !s.supported() {
        bail!("gdn: unsupported shape {s:?}");
    }
    check_f32(row, "gdn row")?;
    let (t, rw) = row.dims2()?;
    if rw != s.row_width() {
        bail!("gdn: row width {rw}, shape {s:?} needs {}", s.row_width());
    }
    Ok(t)
}

/// The causal depthwise conv + SiLU over a pass: `row: [T, rw]` (its first `cd` columns are the
/// conv inputs), `conv_state: [kernel − 1, cd]` (the previous inputs, oldest first; advanced by
/// `T` rows in place), `weight: [cd, kernel]` → `Some([T, cd])`. Without `weight` only the window
/// moves (a rollback's replay) and `None` is returned.
///
/// Errors: shapes that disagree with `s`, not f32, not on one CUDA device.
pub fn gdn_conv(
    s: &GdnShape,
    row: &Tensor,
    conv_state: &Tensor,
    weight: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    let t = check_shape(s, row)?;
    let cd = s.conv_dim();
    check_f32(conv_state, "conv state")?;
    if conv_state.dims() != [s.kernel - 1, cd] {
        bail!("gdn_conv: conv state {:?}, expected [{}, {cd}]", conv_state.dims(), s.kernel - 1);
    }
    if let Some(w) = weight {
        check_f32(w, "conv weight")?;
        if w.dims() != [cd, s.kernel] {
            bail!("gdn_conv: weight {:?}, expected [{cd}, {}]", w.dims(), s.kernel);
        }
    }
    let dev = cuda_device(row)?;
    let out = weight.map(|_| alloc::<f32>(dev, (t, cd))).transpose()?;
    if t == 0 {
        return Ok(out);
    }
    let row = row.contiguous()?;
    let weight = weight.map(Tensor::contiguous).transpose()?;
    let (w, o) = (weight.as_ref().map_or(Ok(0), addr)?, out.as_ref().map_or(Ok(0), addr)?);
    let mut args = conv_args(s, &row, addr(conv_state)?, w, o, t)?;
    let blocks = cd.div_ceil(128) as u32;
    if out.is_some() && t > CONV_ROWS_MIN && gdn_chunked_enabled() {
        // Every output at once from the window as it was, then the window alone (`out` = 0).
        let cfg = LaunchConfig {
            grid_dim: (blocks, t as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `gdn_conv_rows` takes `gdn_conv`'s arguments in its order (without the row
        // table); shapes as below.
        unsafe { launch(dev, "gdn_conv_rows", cfg, &args) }?;
        args[4] = Arg::Ptr(0);
    }
    args.push(Arg::Ptr(0)); // no row table
    let cfg =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: arguments in `gdn_conv`'s order; row [T, rw], conv_state [K − 1, cd], weight
    // [cd, K] and out [T, cd] when given (checked above), all f32 on this device.
    unsafe { launch(dev, "gdn_conv", cfg, &args) }?;
    Ok(out)
}

/// `gdn_conv`'s arguments up to `K` (the kernel's row table follows; `gdn_conv_rows` takes these
/// alone): `row` as [`gdn_conv`] takes it, the conv window, weight and output addresses (0:
/// none), `t` tokens.
fn conv_args(
    s: &GdnShape,
    row: &Tensor,
    conv_state: u64,
    weight: u64,
    out: u64,
    t: usize,
) -> Result<Vec<Arg>> {
    Ok(vec![
        Arg::Ptr(addr(row)?),
        Arg::I32(s.row_width() as i32),
        Arg::Ptr(conv_state),
        Arg::Ptr(weight),
        Arg::Ptr(out),
        Arg::I32(t as i32),
        Arg::I32(s.conv_dim() as i32),
        Arg::I32(s.kernel as i32),
    ])
}

/// The gated delta rule over a pass, per value head: `qkv: [T, cd]` (the conv's output: q, k, v),
/// `row: [T, rw]` (its `b`, `a` columns), `a_neg: [v_heads]` (`−exp(A_log)`), `dt_bias:
/// [v_heads]`, `ssm: [v_heads, v_dim, k_dim]` — each head's `[k_dim, v_dim]` state stored
/// transposed, so that the warp owning a state column reads it contiguously (advanced by `T`
/// tokens in place). With `readout`
/// → `Some([T, v_heads · v_dim])`, each token's `Sᵀq̂` (q̂ the L2-normalised query times
/// `q_scale`); without (a rollback's replay), `None`.
///
/// Errors: shapes that disagree with `s`, not f32, not on one CUDA device.
#[allow(clippy::too_many_arguments)]
pub fn gdn_delta(
    s: &GdnShape,
    qkv: &Tensor,
    row: &Tensor,
    a_neg: &Tensor,
    dt_bias: &Tensor,
    ssm: &Tensor,
    q_scale: f32,
    readout: bool,
) -> Result<Option<Tensor>> {
    delta(s, qkv, row, a_neg, dt_bias, ssm, q_scale, readout, false)
}

/// Checks and launches `gdn_delta` (`chunked`: `gdn_delta_chunked`, readout only).
#[allow(clippy::too_many_arguments)]
fn delta(
    s: &GdnShape,
    qkv: &Tensor,
    row: &Tensor,
    a_neg: &Tensor,
    dt_bias: &Tensor,
    ssm: &Tensor,
    q_scale: f32,
    readout: bool,
    chunked: bool,
) -> Result<Option<Tensor>> {
    let t = check_shape(s, row)?;
    for (x, what) in [(qkv, "qkv"), (a_neg, "A"), (dt_bias, "dt_bias"), (ssm, "ssm state")] {
        check_f32(x, what)?;
    }
    let nv = s.v_heads;
    if qkv.dims() != [t, s.conv_dim()]
        || a_neg.dims() != [nv]
        || dt_bias.dims() != [nv]
        || ssm.dims() != [nv, s.v_dim, s.k_dim]
    {
        bail!(
            "gdn_delta: qkv {:?}, A {:?}, dt_bias {:?}, ssm {:?} for {t} tokens of {s:?}",
            qkv.dims(),
            a_neg.dims(),
            dt_bias.dims(),
            ssm.dims()
        );
    }
    let dev = cuda_device(row)?;
    let out = readout.then(|| alloc::<f32>(dev, (t, s.value_width()))).transpose()?;
    if t == 0 {
        return Ok(out);
    }
    let (qkv, row) = (qkv.contiguous()?, row.contiguous()?);
    let (name, cols, threads) = match chunked {
        true => ("gdn_delta_chunked", CHUNKED_COLS, 256),
        false => ("gdn_delta", WARPS, 32 * WARPS as u32),
    };
    let cfg = LaunchConfig {
        grid_dim: (nv as u32, s.v_dim.div_ceil(cols) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let out_ptr = out.as_ref().map_or(Ok(0), addr)?;
    let mut args = delta_args(s, &qkv, &row, [a_neg, dt_bias], addr(ssm)?, out_ptr, t, q_scale)?;
    if !chunked {
        args.push(Arg::Ptr(0)); // no row table
    }
    // SAFETY: arguments in `gdn_delta`'s order (`gdn_delta_chunked` takes the same without the
    // row table); every buffer's shape checked above (f32 on this device), k_dim ≤ 256
    // (`supported`; ≤ 128 for the chunked kernel, checked by its caller), an output whenever
    // `chunked`.
    unsafe { launch(dev, name, cfg, &args) }?;
    Ok(out)
}

/// `gdn_delta`'s arguments up to `q_scale` (the kernel's row table, when it takes one, follows):
/// `qkv`, `row`, `[a_neg, dt_bias]` as [`gdn_delta`] takes them, the state and output addresses
/// (0: none), `t` tokens.
#[allow(clippy::too_many_arguments)]
fn delta_args(
    s: &GdnShape,
    qkv: &Tensor,
    row: &Tensor,
    [a_neg, dt_bias]: [&Tensor; 2],
    ssm: u64,
    out: u64,
    t: usize,
    q_scale: f32,
) -> Result<Vec<Arg>> {
    Ok(vec![
        Arg::Ptr(addr(qkv)?),
        Arg::Ptr(addr(row)?),
        Arg::I32(s.row_width() as i32),
        Arg::Ptr(addr(a_neg)?),
        Arg::Ptr(addr(dt_bias)?),
        Arg::Ptr(ssm),
        Arg::Ptr(out),
        Arg::I32(t as i32),
        Arg::I32(s.k_heads as i32),
        Arg::I32(s.v_heads as i32),
        Arg::I32(s.k_dim as i32),
        Arg::I32(s.v_dim as i32),
        Arg::I32(s.grouped as i32),
        Arg::F32(q_scale),
    ])
}

/// [`gdn_delta`] with readout over a prompt pass in the chunked form (Yang et al. 2024 §3.3; CPU
/// reference `strata_models::gated_delta_net::chunked_delta_rule`): the same shapes and result up
/// to f32 rounding, in `T / 16` dependent steps. Returns `[T, v_heads · v_dim]`.
///
/// Errors: as [`gdn_delta`], and a key head dimension over 128.
#[allow(clippy::too_many_arguments)]
pub fn gdn_delta_chunked(
    s: &GdnShape,
    qkv: &Tensor,
    row: &Tensor,
    a_neg: &Tensor,
    dt_bias: &Tensor,
    ssm: &Tensor,
    q_scale: f32,
) -> Result<Tensor> {
    if s.k_dim > CHUNKED_DK_MAX {
        bail!("gdn_delta_chunked: key head dimension {} over {CHUNKED_DK_MAX}", s.k_dim);
    }
    delta(s, qkv, row, a_neg, dt_bias, ssm, q_scale, true, true)?
        .ok_or_else(|| candle_core::Error::msg("gdn_delta_chunked gave no output"))
}

/// `Qwen3NextRMSNormGated` per token and value head, in place on `y: [T, v_heads · v_dim]`:
/// `o · 1/√(mean(o²) + eps) · weight · silu(z)`, `z` the `row`'s z columns, `weight: [v_dim]`.
/// Returns `y`.
///
/// Errors: shapes that disagree with `s`, not f32, not on one CUDA device.
pub fn gdn_gated_norm(
    s: &GdnShape,
    y: Tensor,
    row: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<Tensor> {
    let t = check_shape(s, row)?;
    check_f32(&y, "gdn output")?;
    check_f32(weight, "norm weight")?;
    if y.dims() != [t, s.value_width()] || weight.dims() != [s.v_dim] || !y.is_contiguous() {
        bail!(
            "gdn_gated_norm: y {:?}, weight {:?} for {t} tokens of {s:?}",
            y.dims(),
            weight.dims()
        );
    }
    if t == 0 {
        return Ok(y);
    }
    let dev = cuda_device(&y)?;
    let row = row.contiguous()?;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, s.v_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(addr(&y)?),
        Arg::Ptr(addr(&row)?),
        Arg::I32(s.row_width() as i32),
        Arg::I32(s.conv_dim() as i32),
        Arg::Ptr(addr(weight)?),
        Arg::I32(s.v_heads as i32),
        Arg::I32(s.v_dim as i32),
        Arg::F32(eps),
    ];
    // SAFETY: arguments in `gdn_gated_norm`'s order; y [T, vw] contiguous, row [T, rw], weight
    // [dv], f32 on this device; the kernel's block is the 128 threads it assumes.
    unsafe { launch(dev, "gdn_gated_norm", cfg, &args) }?;
    Ok(y)
}

/// One sequence's state of one Gated DeltaNet layer on the device: the conv window `conv: [kernel
/// − 1, cd]` and the delta-rule state `ssm: [v_heads, v_dim, k_dim]` (f32, contiguous), as
/// [`gdn_conv`] and [`gdn_delta`] take them.
#[derive(Debug, Clone, Copy)]
pub struct GdnState<'a> {
    pub conv: &'a Tensor,
    pub ssm: &'a Tensor,
}

impl GdnState<'_> {
    /// The two tensors' device addresses as a state table entry's last four words (conv low,
    /// conv high, ssm low, ssm high), for [`GdnStates::in_buffer`].
    ///
    /// Errors: shapes other than `s`'s, not f32, not contiguous on a CUDA device.
    pub fn address_words(&self, s: &GdnShape) -> Result<[u32; 4]> {
        check_f32(self.conv, "conv state")?;
        check_f32(self.ssm, "ssm state")?;
        if self.conv.dims() != [s.kernel - 1, s.conv_dim()]
            || self.ssm.dims() != [s.v_heads, s.v_dim, s.k_dim]
            || !self.conv.is_contiguous()
            || !self.ssm.is_contiguous()
        {
            bail!(
                "gdn state: conv {:?}, ssm {:?} (contiguous) expected for {s:?}",
                self.conv.dims(),
                self.ssm.dims()
            );
        }
        let (c, m) = (addr(self.conv)?, addr(self.ssm)?);
        Ok([c as u32, (c >> 32) as u32, m as u32, (m >> 32) as u32])
    }
}

/// A batched decode step's state table on the device, for [`gdn_conv_seqs`] and
/// [`gdn_delta_seqs`]: u32 `[rows, 5]`, per row a position word (unused by these kernels: the
/// layout of a [`super::RowTable`]'s rows, so one buffer holds every layer's table) then one
/// sequence's [`GdnState::address_words`]. Row `i` of a pass over the table is one token of
/// that sequence.
#[derive(Debug)]
pub struct GdnStates {
    table: Tensor,
    shape: GdnShape,
}

impl GdnStates {
    /// A table the caller keeps on the device and rewrites before each launch (a captured CUDA
    /// graph's: which sequences share a step changes, the launches stay).
    ///
    /// Errors: `table` not contiguous u32 `[rows, 5]` on a CUDA device, `shape` unsupported.
    ///
    /// # Safety
    /// Every row of `table` must hold, when a launch over it runs, the [`GdnState::address_words`]
    /// (checked against `shape`) of states alive until that launch completes, and no sequence's
    /// state twice (the kernels write them).
    pub unsafe fn in_buffer(table: Tensor, shape: GdnShape) -> Result<Self> {
        if table.dtype() != candle_core::DType::U32
            || table.dims2()?.1 != 5
            || !table.is_contiguous()
            || !table.device().is_cuda()
            || !shape.supported()
        {
            bail!(
                "gdn state table: expected contiguous u32 [rows, 5] on a CUDA device for a \
                 supported shape, got {:?} {:?} ({shape:?})",
                table.dtype(),
                table.dims()
            );
        }
        Ok(Self { table, shape })
    }

    /// The table's rows: the sequences of a pass over it.
    pub fn rows(&self) -> usize {
        self.table.dim(0).unwrap_or(0)
    }

    fn check(&self, s: &GdnShape, row: &Tensor) -> Result<usize> {
        let t = check_shape(s, row)?;
        if *s != self.shape || t != self.rows() {
            bail!(
                "gdn: {t} rows of {s:?} over a state table of {} rows of {:?}",
                self.rows(),
                self.shape
            );
        }
        Ok(t)
    }
}

/// [`gdn_conv`] over a batched decode step: `row: [n, rw]`, row `i` one token of the sequence
/// whose conv window is `states`' row `i` (advanced by that token in place), `weight: [cd,
/// kernel]` → `[n, cd]`. Each row's arithmetic is [`gdn_conv`]'s for one token (the same
/// kernel), so it equals that sequence's own decode step bit for bit, in one launch for all.
///
/// Errors: shapes that disagree with `s` or with the table's shape and rows, not f32, not on one
/// CUDA device.
pub fn gdn_conv_seqs(
    s: &GdnShape,
    row: &Tensor,
    states: &GdnStates,
    weight: &Tensor,
) -> Result<Tensor> {
    let n = states.check(s, row)?;
    let cd = s.conv_dim();
    check_f32(weight, "conv weight")?;
    if weight.dims() != [cd, s.kernel] {
        bail!("gdn_conv_seqs: weight {:?}, expected [{cd}, {}]", weight.dims(), s.kernel);
    }
    let dev = cuda_device(row)?;
    let out = alloc::<f32>(dev, (n, cd))?;
    if n == 0 {
        return Ok(out);
    }
    let (row, weight) = (row.contiguous()?, weight.contiguous()?);
    let mut args = conv_args(s, &row, 0, addr(&weight)?, addr(&out)?, 1)?;
    args.push(Arg::Ptr(addr(&states.table)?));
    let cfg = LaunchConfig {
        grid_dim: (cd.div_ceil(128) as u32, n as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments in `gdn_conv`'s order; row [n, rw], weight [cd, K], out [n, cd] (checked
    // above), f32 on this device; the table's n rows address live conv windows [K − 1, cd]
    // (`GdnStates::in_buffer`'s contract).
    unsafe { launch(dev, "gdn_conv", cfg, &args) }?;
    Ok(out)
}

/// [`gdn_delta`] with readout over a batched decode step: `qkv: [n, cd]`, `row: [n, rw]`, row
/// `i` one token of the sequence whose delta-rule state is `states`' row `i` (advanced in
/// place) → `[n, v_heads · v_dim]`. Each row's arithmetic is [`gdn_delta`]'s for one token (the
/// same kernel): that sequence's own decode step bit for bit, in one launch for all.
///
/// Errors: as [`gdn_conv_seqs`].
#[allow(clippy::too_many_arguments)]
pub fn gdn_delta_seqs(
    s: &GdnShape,
    qkv: &Tensor,
    row: &Tensor,
    a_neg: &Tensor,
    dt_bias: &Tensor,
    states: &GdnStates,
    q_scale: f32,
) -> Result<Tensor> {
    let n = states.check(s, row)?;
    for (x, what) in [(qkv, "qkv"), (a_neg, "A"), (dt_bias, "dt_bias")] {
        check_f32(x, what)?;
    }
    let nv = s.v_heads;
    if qkv.dims() != [n, s.conv_dim()] || a_neg.dims() != [nv] || dt_bias.dims() != [nv] {
        bail!(
            "gdn_delta_seqs: qkv {:?}, A {:?}, dt_bias {:?} for {n} rows of {s:?}",
            qkv.dims(),
            a_neg.dims(),
            dt_bias.dims()
        );
    }
    let dev = cuda_device(row)?;
    let out = alloc::<f32>(dev, (n, s.value_width()))?;
    if n == 0 {
        return Ok(out);
    }
    let (qkv, row) = (qkv.contiguous()?, row.contiguous()?);
    let cfg = LaunchConfig {
        grid_dim: (nv as u32, s.v_dim.div_ceil(WARPS) as u32, n as u32),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = delta_args(s, &qkv, &row, [a_neg, dt_bias], 0, addr(&out)?, 1, q_scale)?;
    args.push(Arg::Ptr(addr(&states.table)?));
    // SAFETY: arguments in `gdn_delta`'s order; qkv [n, cd], row [n, rw], A and dt_bias [nv],
    // out [n, vw] (checked above), f32 on this device, k_dim ≤ 256 (`supported`); the table's n
    // rows address live states [nv, dv, dk] (`GdnStates::in_buffer`'s contract).
    unsafe { launch(dev, "gdn_delta", cfg, &args) }?;
    Ok(out)
}
