//! Building blocks shared by the model definitions: linear layers over quantized or dense weights,
//! RMSNorm, and the weight loader that checks shapes.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};

/// Formats that run on our kernels (`strata-kernels`) rather than candle's, dense layers and routed
/// experts alike: Q4_0, Q4_1 and Q8_0 (candle computes Q4_1 with scalar code and quantizes Q8_0
/// activations unlike ggml; Q4_0 for the tile kernels) and Q4_K/Q5_K/Q6_K (candle's x86 path
/// repacks Q4_K/Q6_K matrices on first use, a second copy of 1.33× their size and ~6 ms per
/// streamed expert; our tile kernels decode faster and keep resident memory at the file's size,
/// docs/performance.md "CPU kernels").
pub fn kernel_format(dtype: GgmlDType) -> Option<strata_kernels::BlockFormat> {
    match dtype {
        GgmlDType::Q4_0 => Some(strata_kernels::BlockFormat::Q4_0),
        GgmlDType::Q4_1 => Some(strata_kernels::BlockFormat::Q4_1),
        GgmlDType::Q8_0 => Some(strata_kernels::BlockFormat::Q8_0),
        GgmlDType::Q4K => Some(strata_kernels::BlockFormat::Q4K),
        GgmlDType::Q5K => Some(strata_kernels::BlockFormat::Q5K),
        GgmlDType::Q6K => Some(strata_kernels::BlockFormat::Q6K),
        _ => None,
    }
}

use candle_core::{Device, Module, Tensor};
use strata_formats::{ModelFiles, Weight};

use crate::error::{ModelError, Result};

/// Loads tensors by GGUF name from a [`ModelFiles`], checking shapes.
pub struct WeightLoader<'a> {
    pub files: &'a ModelFiles,
    pub device: Device,
    /// Added to every [`RmsNorm`] weight: 1 for checkpoints that store `w` of a `(1 + w)` norm
    /// (HF Qwen3-Next / Qwen3.5; llama.cpp's converter adds the 1 itself).
    pub norm_shift: f32,
}

impl<'a> WeightLoader<'a> {
    pub fn new(files: &'a ModelFiles, device: Device) -> Self {
        Self { files, device, norm_shift: 0.0 }
    }

    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        Ok(self.files.load(name, shape, &self.device)?)
    }

    /// A dense f32 tensor (norm weights, biases).
    pub fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let w = self.weight(name, shape)?;
        w.dequantize(&self.device).map_err(|e| ModelError::tensor(name, e))
    }

    pub fn has(&self, name: &str) -> bool {
        self.files.has_tensor(name)
    }

    /// A linear layer `y = x Wᵀ (+ b)` with `W: [out, in]`.
    pub fn linear(&self, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
        let w = self.weight(&format!("{name}.weight"), &[out_dim, in_dim])?;
        let b = if bias { Some(self.dense(&format!("{name}.bias"), &[out_dim])?) } else { None };
        Linear::new(w, b).map_err(|e| ModelError::tensor(name, e))
    }
}

/// The matmul implementation behind a [`Linear`].
#[derive(Debug, Clone)]
enum LinearWeight {
    /// candle: quantized matmul (activations quantized to the weight's vec-dot type, as ggml does)
    /// or f32 GEMM for dense weights.
    Candle(QMatMul),
    /// Our kernels for formats where candle is scalar or quantizes activations unlike ggml.
    Kernel(std::sync::Arc<strata_kernels::QuantMatrix>),
}

/// `y = x Wᵀ + b` with `W: [out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    w: LinearWeight,
    b: Option<Tensor>,
    out_dim: usize,
}

impl Linear {
    pub fn new(w: Weight, b: Option<Tensor>) -> candle_core::Result<Self> {
        Self::with_layout(w, b, true)
    }

    /// [`Self::new`]; `interleave`: our kernels' matrices may take the row-interleaved layout
    /// ([`strata_kernels::QuantMatrix::interleaved`]).
    fn with_layout(w: Weight, b: Option<Tensor>, interleave: bool) -> candle_core::Result<Self> {
        let mut l = match w {
            Weight::Quantized(q) => Self::from_quantized(std::sync::Arc::new(q), interleave)?,
            Weight::Dense(t) => {
                let out_dim = t.dims()[0];
                Self { w: LinearWeight::Candle(QMatMul::Tensor(t)), b: None, out_dim }
            }
        };
        l.b = b;
        Ok(l)
    }

    /// A routed expert's projection: like [`Self::new`] without bias, and in the file's layout
    /// whether resident or streamed (a streamed expert is used where it was read), so that both
    /// give the same bits.
    pub fn for_expert(w: Weight) -> candle_core::Result<Self> {
        Self::with_layout(w, None, false)
    }

    /// A linear layer over a quantized tensor, which may be shared (tied embeddings). Formats our
    /// kernels implement are copied into them; others use candle's `QMatMul`.
    pub fn from_shared(q: std::sync::Arc<QTensor>) -> candle_core::Result<Self> {
        Self::from_quantized(q, true)
    }

    fn from_quantized(q: std::sync::Arc<QTensor>, interleave: bool) -> candle_core::Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        if q.device().is_cpu() && std::env::var("STRATA_CPU_DEQUANTIZE").is_ok_and(|v| v == "1") {
            // Diagnostics (`strata compare-devices`): f32 weights and activations on the CPU, the
            // reference for GPU kernels that dequantize weights and keep activations in f32.
            return Ok(Self {
                w: LinearWeight::Candle(QMatMul::Tensor(q.dequantize(&candle_core::Device::Cpu)?)),
                b: None,
                out_dim: rows,
            });
        }
        let w = match kernel_format(q.dtype()) {
            Some(format) if q.device().is_cpu() => {
                let data = q.data()?.into_owned();
                let m = if interleave {
                    strata_kernels::QuantMatrix::interleaved(format, data, rows, cols)
                } else {
                    strata_kernels::QuantMatrix::new(format, data, rows, cols)
                }
                .map_err(candle_core::Error::msg)?;
                LinearWeight::Kernel(std::sync::Arc::new(m))
            }
            _ => LinearWeight::Candle(QMatMul::from_arc(q)?),
        };
        Ok(Self { w, b: None, out_dim: rows })
    }

    /// A linear layer over a matrix already in our kernels' layout (a streamed expert's bytes).
    pub fn from_kernel(m: strata_kernels::QuantMatrix) -> Self {
        let out_dim = m.rows();
        Self { w: LinearWeight::Kernel(std::sync::Arc::new(m)), b: None, out_dim }
    }

    /// One layer computing `parts` side by side (outputs concatenated on the last dim), when they
    /// all run on our kernels with the same format; `None` otherwise.
    pub fn fuse(parts: &[&Linear]) -> candle_core::Result<Option<Linear>> {
        let mut mats = Vec::with_capacity(parts.len());
        for p in parts {
            match &p.w {
                LinearWeight::Kernel(m) => mats.push(m.as_ref()),
                LinearWeight::Candle(_) => return Ok(None),
            }
        }
        let Some(m) = strata_kernels::QuantMatrix::concat_rows(&mats) else { return Ok(None) };
        let b = if parts.iter().any(|p| p.b.is_some()) {
            let bs = parts
                .iter()
                .map(|p| {
                    p.b.clone().map_or_else(
                        || {
                            Tensor::zeros(
                                p.out_dim,
                                candle_core::DType::F32,
                                &candle_core::Device::Cpu,
                            )
                        },
                        Ok,
                    )
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        let out_dim = m.rows();
        Ok(Some(Linear { w: LinearWeight::Kernel(std::sync::Arc::new(m)), b, out_dim }))
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// The matrix when this layer runs on our kernels without a bias.
    pub fn kernel(&self) -> Option<&strata_kernels::QuantMatrix> {
        match &self.w {
            LinearWeight::Kernel(m) if self.b.is_none() => Some(m),
            _ => None,
        }
    }

    /// The quantized tensor when this layer runs on candle's quantized matmul.
    pub fn candle_qtensor(&self) -> Option<&std::sync::Arc<QTensor>> {
        match &self.w {
            LinearWeight::Candle(QMatMul::QTensor(q)) if self.b.is_none() => Some(q),
            _ => None,
        }
    }

    /// Bytes of the weight as stored (quantized blocks, or f32 for dense weights).
    pub fn weight_bytes(&self) -> usize {
        match &self.w {
            LinearWeight::Kernel(m) => m.size_in_bytes(),
            LinearWeight::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            LinearWeight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }

    /// The f32 weight `[out, in]` of a dense layer without bias (`None` for a quantized or biased
    /// one): for kernels that fuse the product with what follows it.
    pub fn dense_f32(&self) -> Option<&Tensor> {
        match (&self.w, &self.b) {
            (LinearWeight::Candle(QMatMul::Tensor(t)), None)
                if t.dtype() == candle_core::DType::F32 =>
            {
                Some(t)
            }
            _ => None,
        }
    }

    /// `x: [.., in] → [.., out]`. Each row's result is bit-identical however many rows are
    /// passed (up to [`crate::EXACT_ROWS_MAX`]).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(x, true)
    }

    /// Like [`Self::forward`] without the bit-identity guarantee: short multi-row inputs use
    /// candle's GEMM too (draft models, whose outputs only propose tokens).
    pub fn forward_batched(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(x, false)
    }

    fn forward_with(&self, x: &Tensor, exact_rows: bool) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            LinearWeight::Candle(QMatMul::Tensor(t)) if exact_rows && x.device().is_cpu() => {
                match f32_matmul_short(t, x)? {
                    Some(y) => y,
                    None => self.forward_candle(x, exact_rows)?,
                }
            }
            LinearWeight::Candle(_) => self.forward_candle(x, exact_rows)?,
            LinearWeight::Kernel(w) => host_matmul(x, w.rows(), |xs, m| w.matmul_vec(xs, m))?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// candle's matmul (one row at a time for short CPU passes when `exact_rows`: its multi-row
    /// kernels sum in another order than its one-row kernel).
    fn forward_candle(&self, x: &Tensor, exact_rows: bool) -> candle_core::Result<Tensor> {
        let LinearWeight::Candle(w) = &self.w else { unreachable!("a candle weight") };
        let rows = if x.rank() == 2 { x.dim(0)? } else { 0 };
        if exact_rows && rows > 1 && rows <= crate::attention::EXACT_ROWS_MAX && x.device().is_cpu()
        {
            // candle's multi-row CPU kernels (x86 repacked Q4_K tiles) sum in another order
            // than its one-row kernel: short passes (speculative verification) go row by row
            // so that their outputs are bit-identical to decoding.
            let parts = (0..rows)
                .map(|r| w.forward(&x.narrow(0, r, 1)?))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        } else {
            #[cfg(feature = "cuda")]
            if let Some(y) = dense_quant_gpu(w, x).or_else(|| dense_f32_gpu(w, x)) {
                return y;
            }
            w.forward(x)
        }
    }
}

/// `x: [.., in] · tᵀ` for an f32 `t: [out, in]` on our parallel f32 kernel
/// (`strata_kernels::f32`) when the pass is short (≤ [`crate::EXACT_ROWS_MAX`] rows: decode,
/// verify); `None` for longer passes or other dtypes (candle's GEMM then).
fn f32_matmul_short(t: &Tensor, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    use candle_core::{DType, Storage};
    let (rows, cols) = t.dims2()?;
    let m = x.elem_count() / cols.max(1);
    if t.dtype() != DType::F32 || x.dtype() != DType::F32 || m > crate::attention::EXACT_ROWS_MAX {
        return Ok(None);
    }
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    let w = &cpu.as_slice::<f32>()?[start..end];
    host_matmul(x, rows, |xs, m| {
        let mut out = vec![0f32; m * rows];
        strata_kernels::f32::matmul_f32(w, rows, cols, xs, m, &mut out);
        out
    })
    .map(Some)
}

/// `x: [.., in] → [.., rows]` through a host kernel `f(x rows, row count m) → out [m, rows]`.
fn host_matmul(
    x: &Tensor,
    rows: usize,
    f: impl FnOnce(&[f32], usize) -> Vec<f32>,
) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let m = x.elem_count() / dims.last().copied().unwrap_or(0).max(1);
    let out = with_host_f32(x, |xs| f(xs, m))?;
    if let Some(l) = dims.last_mut() {
        *l = rows;
    }
    Tensor::from_vec(out, dims, x.device())
}

/// `f` over `x`'s elements in row-major order as one host slice: borrowed from the tensor's
/// storage when `x` is a contiguous f32 CPU tensor (no copy: a decode step's activations), else
/// a copy (converted to f32). The storage stays read-locked while `f` runs.
///
/// Errors: the copy fails (another dtype that does not convert).
pub(crate) fn with_host_f32<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    use candle_core::{DType, Storage};
    if x.dtype() == DType::F32 {
        let (storage, layout) = x.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&cpu.as_slice::<f32>()?[start..end]));
        }
    }
    let v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x²) + eps) * w` over the last dim.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    w: Tensor,
    /// `w` on the host, for the CPU path (read once at load, not per call).
    w_host: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    /// Loads `w` (plus [`WeightLoader::norm_shift`]).
    pub fn load(l: &WeightLoader, name: &str, dim: usize, eps: f64) -> Result<Self> {
        let mut w = l.dense(name, &[dim])?;
        if l.norm_shift != 0.0 {
            w = (w + l.norm_shift as f64).map_err(|e| ModelError::tensor(name, e))?;
        }
        let w_host = w.to_vec1::<f32>().map_err(|e| ModelError::tensor(name, e))?;
        Ok(Self { w, w_host, eps: eps as f32 })
    }

    /// The weight `[dim]` (on the model's device) and epsilon, for kernels that fuse the norm.
    pub fn weight_eps(&self) -> (&Tensor, f32) {
        (&self.w, self.eps)
    }

    /// `(x + h, self.forward(x + h))`: a residual add and this norm, in one launch on a GPU
    /// (`strata_kernels::cuda::add_rms_norm`) unless `STRATA_GPU_FUSE=0`; elsewhere the add and
    /// [`Self::forward`].
    pub fn add_forward(&self, x: &Tensor, h: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && x.rank() == 2
            && x.dtype() == candle_core::DType::F32
            && crate::gpu::enabled(crate::gpu::GpuPath::Fuse)
        {
            return strata_kernels::cuda::add_rms_norm(x, h, &self.w, self.eps);
        }
        if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 && x.shape() == h.shape() {
            // One pass over host buffers: the sum (candle's f32 add), then its norm.
            self.check_dim(x)?;
            let mut sum = Vec::with_capacity(x.elem_count());
            with_host_f32(x, |xs| {
                with_host_f32(h, |hs| sum.extend(xs.iter().zip(hs).map(|(&a, &b)| a + b)))
            })??;
            let normed = self.norm_rows(&sum);
            let dims = x.dims();
            return Ok((
                Tensor::from_vec(sum, dims, x.device())?,
                Tensor::from_vec(normed, dims, x.device())?,
            ));
        }
        let sum = (x + h)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }

    /// Over the last dim of `x`. On CPU this follows ggml's `ggml_compute_forward_rms_norm_f32`
    /// operation for operation (sum of squares in f64, scale in f32, then the weight), so that
    /// activations quantized downstream round like llama.cpp's.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !x.device().is_cpu() {
            return candle_nn::ops::rms_norm(&x.contiguous()?, &self.w, self.eps);
        }
        self.check_dim(x)?;
        let v = with_host_f32(x, |xs| self.norm_rows(xs))?;
        Tensor::from_vec(v, x.dims(), x.device())
    }

    fn check_dim(&self, x: &Tensor) -> candle_core::Result<()> {
        let last = x.dims().last().copied().unwrap_or(0);
        if last != self.w_host.len() {
            candle_core::bail!(
                "rms_norm: {:?} against a weight of {}",
                x.dims(),
                self.w_host.len()
            );
        }
        Ok(())
    }

    /// The CPU norm of [`Self::forward`] over host rows `x: [.., dim]` (row-major) → a new buffer
    /// of the same shape.
    fn norm_rows(&self, x: &[f32]) -> Vec<f32> {
        let w = &self.w_host;
        let n = w.len().max(1);
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks_exact(n) {
            let mean = (strata_kernels::f32::sum_squares_f64(row) / n as f64) as f32;
            let scale = 1.0f32 / (mean + self.eps).sqrt();
            out.extend(row.iter().zip(w).map(|(&a, &g)| (a * scale) * g));
        }
        out
    }
}

/// Products `x: [n, in]` of several quantized projections of one format without biases (a
/// layer's q, k and v; an MLP's gate and up) in one launch on a GPU for the row counts the
/// mat-vec kernel takes ([`crate::gpu::matvec_rows`]: decode steps, short verify passes;
/// `strata_kernels::cuda::matvec_quant_many`, the kernel of [`Linear::forward`] for such rows, so
/// each result equals that projection's own forward), and for Q4_K the rows
/// [`crate::gpu::dense_mma_rows`] takes (`strata_kernels::cuda::matmul_q4k_mma_many`, up to three
/// matrices: again each result that projection's own forward) → `[n, out_m]` each. `None`: another
/// device, a format the kernel lacks ([`strata_kernels::cuda::matvec_supports`]), mixed formats,
/// another row count, a bias, or the paths off.
#[cfg(feature = "cuda")]
pub fn matvec_quant_fused(ls: &[&Linear], x: &Tensor) -> Option<candle_core::Result<Vec<Tensor>>> {
    use strata_kernels::cuda::{activations, matvec_supports};
    if !x.device().is_cuda() || x.rank() != 2 {
        return None;
    }
    let (n, k) = (x.dims()[0], x.dims()[1]);
    let ws = ls
        .iter()
        .map(|l| match (&l.w, &l.b) {
            (LinearWeight::Candle(QMatMul::QTensor(q)), None)
                if matvec_supports(q.dtype(), k, activations()) =>
            {
                Some(q.as_ref())
            }
            _ => None,
        })
        .collect::<Option<Vec<&QTensor>>>()?;
    if ws.is_empty() || ws.iter().any(|w| w.dtype() != ws[0].dtype()) {
        return None;
    }
    if ws[0].dtype() == GgmlDType::Q4K && crate::gpu::dense_mma_rows(n) && ws.len() <= 3 {
        // One launch on int8 tensor cores: each result equals its own product's bit for bit.
        return Some(strata_kernels::cuda::matmul_q4k_mma_many(x, &ws));
    }
    if !crate::gpu::matvec_rows_of(ws[0].dtype(), n) {
        return None;
    }
    Some(x.contiguous().and_then(|x| strata_kernels::cuda::matvec_quant_many(&x, &ws)))
}

/// An f32 product `x: [.., in]` of the row counts [`crate::gpu::matvec_rows`] takes (a MoE
/// router's logits in a decode step or a short verify pass: each row the decode step's result)
/// on our mat-vec kernel (`strata_kernels::cuda::matvec_f32`, one launch instead of cuBLAS's
/// GEMV pair) unless `STRATA_GPU_MATVEC=0`; more rows (prompt passes) of a matrix of at most
/// `MATMUL_F32_ROWS_MAX_OUT` outputs (routers, gates) on `matmul_f32_rows` (each row's result
/// independent of the pass's other rows) unless `STRATA_GPU_F32_ROWS=0`. `None`: another
/// device, dtype, a larger matrix's prompt pass, or a width not a multiple of 4.
#[cfg(feature = "cuda")]
fn dense_f32_gpu(w: &QMatMul, x: &Tensor) -> Option<candle_core::Result<Tensor>> {
    let QMatMul::Tensor(t) = w else { return None };
    let k = *x.dims().last()?;
    let n = x.elem_count() / k.max(1);
    if !x.device().is_cuda()
        || t.dtype() != candle_core::DType::F32
        || x.dtype() != candle_core::DType::F32
        || !k.is_multiple_of(4)
        || t.rank() != 2
    {
        return None;
    }
    // Passes longer than the mat-vec's (prompts) of a router-sized matrix: our row-independent
    // product, so that a prompt's logits do not depend on the other prompts of its pass. (Decode
    // steps and verify passes keep their own switches: `STRATA_GPU_MATVEC=0` sends them to cuBLAS.)
    let many = n > crate::gpu::MATVEC_ROWS_MAX
        && t.dim(0).is_ok_and(|r| r <= strata_kernels::cuda::MATMUL_F32_ROWS_MAX_OUT)
        && crate::gpu::enabled(crate::gpu::GpuPath::F32Rows);
    if !many && !crate::gpu::matvec_rows(n) {
        return None;
    }
    let run = || {
        let mut dims = x.dims().to_vec();
        let x2 = x.reshape((n, k))?.contiguous()?;
        let y = match many {
            true => strata_kernels::cuda::matmul_f32_rows(&x2, t)?,
            false => strata_kernels::cuda::matvec_f32(&x2, t)?,
        };
        *dims.last_mut().expect("rank ≥ 1") = y.dim(1)?;
        y.reshape(dims)
    };
    Some(run())
}

/// A dense quantized product `x: [.., in]` on a GPU through our kernels. One row (a decode step)
/// runs on our mat-vec kernel (`strata_kernels::cuda::matvec_quant`: Q4_K, Q4_1 and Q8_0 over
/// q8-rounded inputs by default) unless `STRATA_GPU_MATVEC=0` (candle's DMMV kernel), and so do 2
/// to `gpu::MATVEC_ROWS_MAX` rows (a verify pass, a small batch: each row then equals a decode
/// step's product) unless `STRATA_GPU_SHORT_MATVEC=0`. Q4_K only: 2 to `MATMUL_ROWS_MAX` rows
/// beyond those on `strata_kernels::cuda::matmul_q4k` (each weight row dequantized once for all
/// rows, f32 activations; every row's result independent of the others) unless
/// `STRATA_GPU_DENSE=0`, and longer passes (prompts, from `TC_ROWS_MIN` rows) on tensor cores
/// (`strata_kernels::cuda::matmul_q4k_tc`: f16 inputs, f32 sums) unless `STRATA_GPU_DENSE_TC=0`;
/// candle's path (with `STRATA_CUDA_MMVQ` unset) dequantizes the whole matrix to f32 and runs
/// cuBLAS for more than one row. `None`: another device, format, rank or size.
#[cfg(feature = "cuda")]
fn dense_quant_gpu(w: &QMatMul, x: &Tensor) -> Option<candle_core::Result<Tensor>> {
    use strata_kernels::cuda::{
        activations, matmul_q4k, matmul_q4k_tc, matvec_quant, matvec_supports,
        moe_grouped_supports, MATMUL_ROWS_MAX,
    };
    let QMatMul::QTensor(q) = w else { return None };
    let k = *x.dims().last()?;
    let n = x.elem_count() / k.max(1);
    if !x.device().is_cuda() {
        return None;
    }
    // `[.., k]` as `[n, k]`, the product's `[n, R]` back as `[.., R]`.
    let run = |f: fn(&Tensor, &QTensor) -> candle_core::Result<Tensor>| {
        let mut dims = x.dims().to_vec();
        let y = f(&x.reshape((n, k))?.contiguous()?, q)?;
        *dims.last_mut().expect("rank ≥ 1") = y.dim(1)?;
        y.reshape(dims)
    };
    if q.dtype() != GgmlDType::Q4K {
        // Q4_1 / Q8_0 (llama-family dense layers): our q8 mat-vec for the rows it takes.
        let ours = matvec_supports(q.dtype(), k, activations())
            && crate::gpu::matvec_rows_of(q.dtype(), n);
        return ours.then(|| run(matvec_quant));
    }
    if k.is_multiple_of(256) && crate::gpu::dense_mma_rows(n) {
        return Some(run(strata_kernels::cuda::matmul_q4k_mma));
    }
    if k.is_multiple_of(256) && crate::gpu::matvec_rows(n) {
        return Some(run(matvec_quant));
    }
    if n >= strata_kernels::cuda::TC_ROWS_MIN
        && k.is_multiple_of(256)
        && crate::gpu::enabled(crate::gpu::GpuPath::DenseTc)
    {
        return Some(run(matmul_q4k_tc));
    }
    if !(2..=MATMUL_ROWS_MAX).contains(&n)
        || !moe_grouped_supports(k, k)
        || !crate::gpu::enabled(crate::gpu::GpuPath::Dense)
    {
        return None;
    }
    Some(run(matmul_q4k))
}
