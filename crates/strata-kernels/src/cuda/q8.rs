//! q8 activations of the GPU mat-vec kernels (llama.cpp's MMVQ inputs, `quantize_q8_1` without
//! the sums): which inputs the kernels take ([`Activations`]), the rounding kernel
//! ([`quantize_q8`]), and the roundings that fused kernels write beside their f32 outputs.
//!
//! **Twins.** `add_rms_norm`, `attend_decode` and `silu_mul` write an output's q8 rounding in the
//! same pass when the rows are few enough for the q8 kernels ([`q8_beside`]) — saving a
//! `quantize_q8` launch for the q/k/v, o, MoE and dense-MLP down inputs of a decode step. The
//! rounding is kept here, keyed by the f32 output's device address and shape, and holding a clone of that
//! output (so its memory cannot be reused while the key stands); a kernel input that is such an
//! output takes the kept rounding instead of a new launch ([`kernel_inputs`]). Both roundings
//! come from one device function (`q8_round_warp`), so the bytes are the same either way
//! (tested). Per thread, at most [`TWINS_KEPT`] kept; [`release_q8_twins`] drops them — a pass
//! captured as a CUDA graph must call it before the capture ends (an allocation the capture
//! made must be freed inside it).

use std::cell::RefCell;

use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, Result, Tensor};

use super::{addr, aligned16, alloc, check_f32, cuda_device, launch, Arg, MOE_ROWS_MAX};

/// How the Q4_K mat-vec kernels take their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// f32 inputs (`mv_q4k_r*`): the f32 reference's result up to summation order.
    F32,
    /// Inputs rounded to 8 bits per 32 values first ([`quantize_q8`], `mv_q4k_q8_r*`: integer
    /// dot products, llama.cpp's MMVQ arithmetic): a quarter of the input reads.
    Q8,
}

/// The inputs the mat-vec kernels take by default: [`Activations::Q8`] unless
/// `STRATA_GPU_Q8=0`.
pub fn activations() -> Activations {
    static ACT: std::sync::OnceLock<Activations> = std::sync::OnceLock::new();
    *ACT.get_or_init(|| match std::env::var("STRATA_GPU_Q8") {
        Ok(v) if v == "0" => Activations::F32,
        _ => Activations::Q8,
    })
}

/// Whether a kernel writing `[n, k]` f32 activations also writes their q8 rounding as a twin:
/// q8 inputs on ([`activations`], and not `STRATA_GPU_Q8_FUSE=0`), `k` a multiple of 32, and
/// `n` at most [`MOE_ROWS_MAX`] (decode steps and short verify passes — the row counts the q8
/// kernels take).
pub fn q8_beside(n: usize, k: usize) -> bool {
    static FUSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let fuse = *FUSE.get_or_init(|| std::env::var("STRATA_GPU_Q8_FUSE").map_or(true, |v| v != "0"));
    fuse && activations() == Activations::Q8
        && k.is_multiple_of(32)
        && (1..=MOE_ROWS_MAX).contains(&n)
}

/// `x: [n, K]` f32 (K a multiple of 32, contiguous) rounded to 8 bits per 32 consecutive values:
/// `q: [n, K]` (u8 holding i8) and `d: [n, K / 32]` f32 with `x ≈ d · q`, `d = max|x| / 127`
/// (IEEE division), `q = round_half_even(x / d)` (0 where `d = 0`) — llama.cpp's `quantize_q8_1`
/// without the sums. One launch.
///
/// Errors: `x` not f32 `[n, K]` contiguous on a CUDA device, `K` not a multiple of 32.
pub fn quantize_q8(x: &Tensor) -> Result<(Tensor, Tensor)> {
    check_f32(x, "x")?;
    let (n, k) = x.dims2()?;
    if !k.is_multiple_of(32) {
        bail!("quantize_q8: x {:?} (K a multiple of 32)", x.dims());
    }
    let dev = cuda_device(x)?;
    let (q, d) = alloc_q8(dev, n, k)?;
    let total = n * k;
    if total == 0 {
        return Ok((q, d));
    }
    let cfg = candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (total.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let args =
        [Arg::Ptr(addr(x)?), Arg::Ptr(addr(&q)?), Arg::Ptr(addr(&d)?), Arg::I32(total as i32)];
    // SAFETY: arguments in `quantize_q8`'s order; x [n, K] f32, q [n, K] bytes, d [n, K / 32].
    unsafe { launch(dev, "quantize_q8", cfg, &args) }?;
    Ok((q, d))
}

/// Uninitialised q8 buffers for `[n, k]` values: `q: [n, k]` u8, `d: [n, k / 32]` f32.
fn alloc_q8(dev: &CudaDevice, n: usize, k: usize) -> Result<(Tensor, Tensor)> {
    Ok((alloc::<u8>(dev, (n, k))?, alloc::<f32>(dev, (n, k / 32))?))
}

/// Twins kept per thread (a layer's attention-norm, attention-output, FFN-norm and SwiGLU outputs,
/// and one spare).
pub const TWINS_KEPT: usize = 5;

/// An f32 output and its q8 rounding `(q, d)`.
struct Twin {
    x: Tensor,
    q: Tensor,
    d: Tensor,
}

thread_local! {
    static TWINS: RefCell<Vec<Twin>> = const { RefCell::new(Vec::new()) };
}

/// The q8 rounding a kernel writes beside its `[n, k]` f32 output where [`q8_beside`] says so
/// (`add_rms_norm`, `attend_decode`), kept as that output's twin once written.
pub(super) struct Q8Outputs(Option<(Tensor, Tensor)>);

impl Q8Outputs {
    /// Buffers for the rounding of `[n, k]` values, or none.
    pub(super) fn new(dev: &CudaDevice, n: usize, k: usize) -> Result<Self> {
        Ok(Self(if q8_beside(n, k) { Some(alloc_q8(dev, n, k)?) } else { None }))
    }

    /// No rounding written.
    pub(super) fn none() -> Self {
        Self(None)
    }

    /// The `q` and `d` addresses as kernel arguments (`0, 0`: write none).
    pub(super) fn addrs(&self) -> Result<(u64, u64)> {
        match &self.0 {
            Some((q, d)) => Ok((addr(q)?, addr(d)?)),
            None => Ok((0, 0)),
        }
    }

    /// Keeps the rounding as the twin of `out`, the f32 output the same launches wrote.
    pub(super) fn keep_for(self, out: &Tensor) {
        if let Some((q, d)) = self.0 {
            remember_q8(out, q, d);
        }
    }
}

/// Keeps `(q, d)` as the q8 rounding of `x` (a contiguous f32 `[n, K]` output just written with
/// it), dropping the oldest twin past [`TWINS_KEPT`].
fn remember_q8(x: &Tensor, q: Tensor, d: Tensor) {
    TWINS.with(|t| {
        let mut t = t.borrow_mut();
        if t.len() == TWINS_KEPT {
            t.remove(0);
        }
        t.push(Twin { x: x.clone(), q, d });
    });
}

/// The kept q8 rounding of `x`: a twin whose output starts at `x`'s address with `x`'s shape.
/// (The twin holds its output alive, so no other tensor can start at that address.)
pub fn q8_twin(x: &Tensor) -> Option<(Tensor, Tensor)> {
    let a = addr(x).ok()?;
    TWINS.with(|t| {
        t.borrow().iter().find_map(|w| {
            (w.x.dims() == x.dims() && addr(&w.x).ok() == Some(a))
                .then(|| (w.q.clone(), w.d.clone()))
        })
    })
}

/// Drops this thread's kept twins (and with them the outputs they hold). A pass captured as a
/// CUDA graph calls it before the capture ends; other passes may, to free the memory sooner.
pub fn release_q8_twins() {
    TWINS.with(|t| t.borrow_mut().clear());
}

/// A kernel's input for `x: [rows, K]` f32 taken as `act` says: the tensors to keep alive until
/// the launch (`[x]` 16-byte aligned, or `[q, d]`: a kept twin's, else [`quantize_q8`]'s), their
/// addresses as the kernel's first arguments, and the kernel-name suffix (`""`, `"_q8"`).
pub(super) fn kernel_inputs(
    x: &Tensor,
    act: Activations,
) -> Result<(Vec<Tensor>, Vec<Arg>, &'static str)> {
    let (ts, suffix) = match act {
        Activations::F32 => (vec![aligned16(x)?], ""),
        Activations::Q8 => {
            let (q, d) = match q8_twin(x) {
                Some(qd) => qd,
                None => quantize_q8(&x.contiguous()?)?,
            };
            (vec![q, d], "_q8")
        }
    };
    let args = ts.iter().map(|t| addr(t).map(Arg::Ptr)).collect::<Result<Vec<_>>>()?;
    Ok((ts, args, suffix))
}
