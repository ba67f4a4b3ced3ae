//! Strata's own CUDA kernels for the GPU decode step (`cuda` feature): the fat binary (machine code
//! and PTX) that build.rs makes with nvcc from `cuda/decode.cu`, launched on candle's CUDA stream
//! over candle tensors.
//!
//! Every function takes and returns f32 tensors on one CUDA device, in the shapes its docs give,
//! and errors (never panics) on a tensor off the device, of another dtype or shape. Each kernel
//! is tested on the device against its CPU reference (`crates/strata-models/tests/cuda_kernels.rs`,
//! run by `scripts/cuda_device_check.sh`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{
    result, CudaFunction, CudaModule, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor};

pub use crate::ExpertTable;

mod gdn;
mod moe_mma;
mod q8;
pub use gdn::{
    gdn_chunked_enabled, gdn_conv, gdn_conv_seqs, gdn_delta, gdn_delta_chunked, gdn_delta_seqs,
    gdn_gated_norm, GdnShape, GdnState, GdnStates,
};
pub use moe_mma::{matmul_q4k_mma, matmul_q4k_mma_many, moe_q4k_mma, MOE_MMA_ROWS_MAX};
pub use q8::{
    activations, q8_beside, q8_twin, quantize_q8, release_q8_twins, Activations, TWINS_KEPT,
};
use q8::{kernel_inputs, Q8Outputs};

/// The kernels as build.rs compiled them: a fat binary holding machine code for the build's GPU
/// (`sm_{CUDA_COMPUTE_CAP}`) and the PTX (`compute_{CUDA_COMPUTE_CAP}`) the driver compiles for any
/// later GPU. With the machine code the driver loads the module without compiling it — before,
/// the embedded PTX was compiled by the driver at the first launch of each process on a machine
/// whose driver cache did not hold it yet (docs/performance.md, "The kernels as machine code").
const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata_decode.fatbin"));

/// Where the kernels are loaded from: the fat binary build.rs embedded or, as a measurement
/// override for kernel work on the device without a rebuild, the PTX file `STRATA_CUDA_PTX` names
/// (made by `nvcc --ptx` from this crate's `cuda/decode.cu`, so its kernels keep the embedded
/// ones' names and parameters). The override is announced once on the log (warn).
///
/// # Errors
/// The named file cannot be read.
fn kernel_image() -> Result<Ptx> {
    match std::env::var_os("STRATA_CUDA_PTX") {
        None => Ok(Ptx::from_binary(FATBIN.to_vec())),
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                candle_core::Error::Msg(format!(
                    "strata cuda kernels: STRATA_CUDA_PTX={}: {e}",
                    path.to_string_lossy()
                ))
            })?;
            tracing::warn!(
                "CUDA kernels from STRATA_CUDA_PTX={} instead of the built-in ones",
                path.to_string_lossy()
            );
            Ok(Ptx::from_src(text))
        }
    }
}

/// Our kernels' module, loaded once per device (CUDA context ordinal), and the functions taken
/// from it (by name).
struct Loaded {
    ordinal: usize,
    module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

/// Kernel `name` of our module on `dev`'s context, loading the module at the first call for that
/// device (the cost of loading: docs/performance.md, "The kernels as machine code").
///
/// # Errors
/// The module cannot be loaded (no machine code or PTX the driver can run on this GPU, an
/// unreadable `STRATA_CUDA_PTX`) or has no such kernel.
fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    static LOADED: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let at = match loaded.iter().position(|l| l.ordinal == ctx.ordinal()) {
        Some(i) => i,
        None => {
            let module = ctx.load_module(kernel_image()?).w()?;
            loaded.push(Loaded { ordinal: ctx.ordinal(), module, functions: HashMap::new() });
            loaded.len() - 1
        }
    };
    let l = &mut loaded[at];
    if let Some(f) = l.functions.get(name) {
        return Ok(f.clone());
    }
    let f = l.module.load_function(name).w()?;
    l.functions.insert(name.to_string(), f.clone());
    Ok(f)
}

/// Positions of the shortest context a captured decode graph serves (its bucket; graph.rs).
pub const ATTN_CHUNK: usize = 256;
/// Fewest positions one attention block takes (split-K chunk, FlashDecoding): short enough that
/// a short context still spreads over many blocks — a block's warps walk their positions one
/// dependent load at a time, so a 256-position chunk left a decode step's attention on 8 blocks
/// (Qwen3-30B-A3B's 4 kv heads) and the step's time growing with the context (measured in
/// docs/performance.md: 16 and 8 equal, 32 3.8% and 256 15% slower on the 30B's decode step).
const ATTN_CHUNK_MIN: usize = 16;
/// Most chunks one query row's attention is split into by default (longer contexts take longer
/// chunks).
const ATTN_SPLITS_MAX: usize = 128;
/// The largest split count `attn_combine` takes (`ATT_SPLITS_MAX` in decode.cu).
const ATTN_SPLITS_LIMIT: usize = 512;

/// Positions per attention block for a context of `last` positions: [`ATTN_CHUNK_MIN`], or more
/// so that at most [`ATTN_SPLITS_MAX`] chunks cover it. Measurement overrides:
/// `STRATA_GPU_ATTN_CHUNK=n` the minimum (256: the chunking before), `STRATA_GPU_ATTN_SPLITS=n`
/// the most chunks (at most [`ATTN_SPLITS_LIMIT`]). A row's result does not depend on them
/// beyond f32 summation order.
fn attn_chunk(last: usize) -> usize {
    static MIN: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    let (min, splits) = *MIN.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok());
        (
            var("STRATA_GPU_ATTN_CHUNK").filter(|&c| c > 0).unwrap_or(ATTN_CHUNK_MIN),
            var("STRATA_GPU_ATTN_SPLITS").unwrap_or(ATTN_SPLITS_MAX).clamp(1, ATTN_SPLITS_LIMIT),
        )
    });
    last.div_ceil(splits).max(min)
}
/// Threads of an attention block (`ATT_THREADS` in decode.cu).
const ATTN_THREADS: u32 = 128;
/// Query heads one attention block takes (`REP` in decode.cu).
const ATTN_REP: usize = 4;
/// Most experts per token the routing kernel keeps (`ROUTE_MAX_K`).
pub const ROUTE_MAX_K: usize = 32;

fn cuda_device(t: &Tensor) -> Result<&CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d),
        _ => bail!("strata cuda kernel: tensor is not on a CUDA device"),
    }
}

/// A device allocation of `n` elements wrapped as a tensor of `shape` (contents undefined until a
/// kernel writes them).
fn alloc<T: CudaDType + DeviceRepr>(dev: &CudaDevice, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    // SAFETY: every element is written by the kernel the caller launches next, on the same stream.
    let slice = unsafe { dev.alloc::<T>(shape.elem_count().max(1)) }?;
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
}

/// The device address of a contiguous f32, f16 or u32 tensor's first element. Kernel arguments are
/// passed as these addresses (a u64 each; 0 for an absent optional buffer); the tensors stay
/// borrowed by the caller until the launch is queued, and everything runs on the one stream.
fn addr(t: &Tensor) -> Result<u64> {
    if !t.is_contiguous() {
        bail!("strata cuda kernel: tensor of shape {:?} is not contiguous", t.dims());
    }
    let dev = cuda_device(t)?;
    let stream = dev.cuda_stream();
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else { bail!("strata cuda kernel: tensor not on CUDA") };
    let (base, size) = match t.dtype() {
        DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0, 4),
        DType::U32 => (cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0, 4),
        DType::F16 => (cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0, 2),
        DType::U8 => (cs.as_cuda_slice::<u8>()?.device_ptr(&stream).0, 1),
        d => bail!("strata cuda kernel: {d:?} tensor (f32, f16, u32 or u8 expected)"),
    };
    Ok(base + (l.start_offset() * size) as u64)
}

/// A kernel's pointer argument for an optional tensor: its address ([`addr`]) or null.
fn addr_or_null(t: Option<&Tensor>) -> Result<Arg> {
    Ok(Arg::Ptr(t.map(addr).transpose()?.unwrap_or(0)))
}

/// Queues `name` with `cfg` over `args` (device addresses and scalars, in the kernel's order).
///
/// # Safety
/// `args` must match the kernel's parameter list, and every address must be valid for what the
/// kernel reads and writes at `cfg`.
unsafe fn launch(dev: &CudaDevice, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
    let f = function(dev, name)?;
    if pdl() {
        // SAFETY: the caller's contract; every kernel of decode.cu waits for its predecessor
        // (PDL_ENTER) before touching global memory.
        return unsafe { launch_pdl(dev, &f, cfg, args) };
    }
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in args {
        match a {
            Arg::Ptr(p) => b.arg(p),
            Arg::I32(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    // SAFETY: the caller's contract.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Whether our kernels are launched with programmatic dependent launch (Hopper and later,
/// CUDA's programmatic stream serialization): a kernel may be scheduled while the one before it on
/// the stream drains, and waits for it in `PDL_ENTER` (decode.cu) before touching memory — the
/// launch latency of each dependent kernel hidden behind its predecessor (in captured graphs
/// too: the edges become programmatic). On unless `STRATA_GPU_PDL=0`.
fn pdl() -> bool {
    static PDL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PDL.get_or_init(|| std::env::var("STRATA_GPU_PDL").map_or(true, |v| v != "0"))
}

/// [`launch`] through `cuLaunchKernelEx` with the programmatic-stream-serialization attribute.
///
/// # Safety
/// As [`launch`]; the kernel must wait for its predecessor (`griddepcontrol.wait`) before it
/// reads or writes global memory, in every thread.
unsafe fn launch_pdl(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    // The kernel's parameters: a pointer to each argument's value (alive for the call).
    let mut params: Vec<*mut std::ffi::c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(p) => p as *const u64 as *mut std::ffi::c_void,
            Arg::I32(v) => v as *const i32 as *mut std::ffi::c_void,
            Arg::F32(v) => v as *const f32 as *mut std::ffi::c_void,
        })
        .collect();
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // SAFETY: a plain-data union; zero is a valid bit pattern for every field.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `params` points at `args`' values, in the kernel's order (the caller's contract);
    // `config` and `attr` outlive the call.
    unsafe {
        sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut())
    }
    .result()
    .w()?;
    Ok(())
}

/// A kernel argument.
enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

fn i32s(v: &[usize]) -> impl Iterator<Item = Arg> + '_ {
    v.iter().map(|&x| Arg::I32(x as i32))
}

/// Writes `value` into a u32 `[1]` tensor on the device, queued on candle's stream (a captured
/// CUDA graph's inputs are updated this way before each replay).
pub fn write_u32(t: &Tensor, value: u32) -> Result<()> {
    if t.elem_count() != 1 {
        bail!("write_u32: expected one u32, got {:?} {:?}", t.dtype(), t.dims());
    }
    write_u32s(t, &[value])
}

/// Writes `values` into the first `values.len()` elements of a contiguous u32 tensor on the
/// device, queued on candle's stream (a captured graph's tokens before a replay).
///
/// Errors: not u32, not contiguous, fewer elements than values, not on a CUDA device.
pub fn write_u32s(t: &Tensor, values: &[u32]) -> Result<()> {
    if t.dtype() != DType::U32 || !t.is_contiguous() || t.elem_count() < values.len() {
        bail!("write_u32s: {} values into {:?} {:?}", values.len(), t.dtype(), t.dims());
    }
    if values.is_empty() {
        return Ok(());
    }
    let dev = cuda_device(t)?;
    let dst = addr(t)?;
    let stream = dev.cuda_stream();
    // SAFETY: `dst` holds at least `values.len()` u32s (checked); the source is copied to a
    // staging buffer before the call returns (pageable memory), and the copy is ordered on the
    // stream with every kernel.
    unsafe { result::memcpy_htod_async(dst, values, stream.cu_stream()) }.w()?;
    Ok(())
}

fn check_f32(t: &Tensor, what: &str) -> Result<()> {
    if t.dtype() != DType::F32 {
        bail!("strata cuda kernel: {what} is {:?}, expected f32", t.dtype());
    }
    Ok(())
}

/// How a router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

/// Where a routing kernel also writes its result: a pass's record of every MoE layer's routing
/// (`ids` u32 and `weights` f32, each `[layers · n · keep]`), at element `offset`.
pub struct RoutingRecord<'a> {
    pub ids: &'a Tensor,
    pub weights: &'a Tensor,
    pub offset: usize,
}

/// Experts already chosen for a routing kernel's rows: `ids` u32 holds, from element `offset`,
/// `[n, k]` — each row's `k` distinct experts (a synthetic model's routing process, run on the
/// host: `strata_models::synthetic_routing`).
pub struct ChosenExperts<'a> {
    pub ids: &'a Tensor,
    pub offset: usize,
}

/// Top-k routing on the device: router `logits: [n, E]` f32 → `(ids [n, keep] u32, weights
/// [n, keep] f32)`. Scores are the softmax over experts (in f32) or the sigmoid of each logit; the
/// `k` best are chosen, highest first, ties to the lower id; with `norm_topk` their weights are
/// divided by their sum; `keep < k` keeps the `keep` best rescaled to the top-k's total weight
/// (`--moe-top-k`). The same function as `strata_models::Router::select` (reference:
/// transformers `Qwen2MoeTopKRouter`), up to float summation order. With `chosen`, only each
/// row's chosen experts compete (scores still over all `E`): `Router::weigh` of them, as the
/// host's synthetic routing weighs its choice.
///
/// Errors: `k` or `keep` is 0 or above `min(E, 32)`, `keep > k`, `chosen` or `record` holds too
/// few entries, or a tensor is off the device or of the wrong type.
pub fn route_topk(
    logits: &Tensor,
    k: usize,
    keep: usize,
    scoring: Scoring,
    norm_topk: bool,
    record: Option<RoutingRecord<'_>>,
    chosen: Option<ChosenExperts<'_>>,
) -> Result<(Tensor, Tensor)> {
    check_f32(logits, "router logits")?;
    let (n, e) = logits.dims2()?;
    if k == 0 || k > e.min(ROUTE_MAX_K) || keep == 0 || keep > k {
        bail!("route_topk: top-k {k} (keep {keep}) over {e} experts");
    }
    let chosen_addr = match &chosen {
        Some(c) => {
            if c.ids.dtype() != DType::U32 || c.ids.elem_count() < c.offset + n * k {
                bail!(
                    "route_topk: chosen experts hold {} u32 of {} entries",
                    c.ids.elem_count(),
                    c.offset + n * k
                );
            }
            addr(c.ids)? + (c.offset * 4) as u64
        }
        None => 0,
    };
    let dev = cuda_device(logits)?;
    let ids = alloc::<u32>(dev, (n, keep))?;
    let weights = alloc::<f32>(dev, (n, keep))?;
    if n == 0 {
        return Ok((ids, weights));
    }
    if let Some(r) = &record {
        let need = r.offset + n * keep;
        if r.ids.elem_count() < need || r.weights.elem_count() < need {
            bail!("route_topk: routing record holds {} of {need} entries", r.ids.elem_count());
        }
    }
    // One warp per token (moe_route_topk works in one warp, no block barriers).
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: (e * 4) as u32,
    };
    let (rec_ids, rec_w, off) = match &record {
        Some(r) => (addr(r.ids)?, addr(r.weights)?, r.offset),
        None => (0, 0, 0),
    };
    let mut args = vec![
        Arg::Ptr(addr(logits)?),
        Arg::Ptr(addr(&ids)?),
        Arg::Ptr(addr(&weights)?),
        Arg::Ptr(rec_ids),
        Arg::Ptr(rec_w),
    ];
    args.extend(i32s(&[off]));
    args.push(Arg::Ptr(chosen_addr));
    let flags = [e, k, keep, matches!(scoring, Scoring::Sigmoid) as usize, norm_topk as usize];
    args.extend(i32s(&flags));
    // SAFETY: arguments in `moe_route_topk`'s order; sizes checked above (the record holds
    // `offset + n · keep` entries, `chosen` `offset + n · k`).
    unsafe { launch(dev, "moe_route_topk", cfg, &args) }?;
    Ok((ids, weights))
}

/// SwiGLU's `silu(gate) · up` in one pass: two f32 tensors of one shape → that shape. For
/// `[n, K]` inputs of the rows [`q8_beside`] takes (a decode step's dense MLP), the output's q8
/// rounding is written in the same launch and kept as its twin, so the down projection's mat-vec
/// skips its `quantize_q8` (`STRATA_GPU_SILU_Q8=0`: not written).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_f32(gate, "gate")?;
    check_f32(up, "up")?;
    if gate.dims() != up.dims() {
        bail!("silu_mul: gate {:?} and up {:?} differ", gate.dims(), up.dims());
    }
    let dev = cuda_device(gate)?;
    let n = gate.elem_count();
    let out = alloc::<f32>(dev, gate.shape().clone())?;
    if n == 0 {
        return Ok(out);
    }
    let q8 = match gate.dims2() {
        Ok((rows, k)) if silu_q8() => Q8Outputs::new(dev, rows, k)?,
        _ => Q8Outputs::none(),
    };
    let (oq, od) = q8.addrs()?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(addr(gate)?),
        Arg::Ptr(addr(up)?),
        Arg::Ptr(addr(&out)?),
        Arg::Ptr(oq),
        Arg::Ptr(od),
        Arg::I32(n as i32),
    ];
    // SAFETY: arguments in `silu_mul`'s order; all three f32 tensors hold n elements; the q8
    // outputs (when given: [rows, K] with K % 32 == 0 by `q8_beside`) n bytes and n / 32 f32.
    unsafe { launch(dev, "silu_mul", cfg, &args) }?;
    q8.keep_for(&out);
    Ok(out)
}

/// Fewest tokens of a pass for [`moe_q4k_as`] to put the pairs on the grid's first dimension
/// ([`moe_pairs_first`]). H200, the synthetic 30B (docs/performance.md, twentieth session): 16
/// sequences faster with it (ncu: gate_up 80.6 → 78.4 µs, down 51.4 → 49.4 µs; engine +1.3–1.8%;
/// server 4.02× against 3.90×), 8 sequences 2.7% slower in the engine (within its runs' spread);
/// 9–15 not measured — 12 is the midpoint.
pub const MOE_PAIRS_FIRST_ROWS_MIN: usize = 12;

/// Whether [`moe_q4k_as`] launches a pass of [`MOE_PAIRS_FIRST_ROWS_MIN`] or more tokens with the
/// pairs (tokens) on the grid's first dimension, so that pairs sharing an expert read its rows
/// next to each other: on unless `STRATA_GPU_MOE_PAIRS_FIRST=0` (the same values either way).
fn moe_pairs_first() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_GPU_MOE_PAIRS_FIRST").map_or(true, |v| v != "0"))
}

/// Weight rows each warp of [`moe_q4k_as`]'s q8 gate/up kernel takes for a pass of `n` tokens:
/// 4 from [`MOE_PAIRS_FIRST_ROWS_MIN`] tokens (`moe_gate_up_q4k_q8_r4`; ncu, a 16-token step of
/// the synthetic 30B on an H200: 72.9 µs against 78.4 with one row, docs/performance.md), else 1;
/// `STRATA_GPU_MOE_ROWS=1` keeps one row for every pass. The values are the same either way (a
/// row's operations and their order do not depend on the warp's other rows; tested).
fn moe_gate_up_rows_per_warp(n: usize) -> usize {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let one = *ONE.get_or_init(|| std::env::var("STRATA_GPU_MOE_ROWS").is_ok_and(|v| v == "1"));
    if !one && n >= MOE_PAIRS_FIRST_ROWS_MIN {
        4
    } else {
        1
    }
}

/// Whether [`silu_mul`] writes its output's q8 twin: on unless `STRATA_GPU_SILU_Q8=0`.
fn silu_q8() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_GPU_SILU_Q8").map_or(true, |v| v != "0"))
}

/// The MoE block's weighted sum over the top-k: `y: [n, k, H]`, `weights: [n, k]` → `[n, H]`,
/// `out[t] = Σⱼ weights[t, j] · y[t, j]`.
pub fn moe_combine(y: &Tensor, weights: &Tensor) -> Result<Tensor> {
    check_f32(y, "expert outputs")?;
    check_f32(weights, "routing weights")?;
    let (n, k, h) = y.dims3()?;
    if weights.dims() != [n, k] {
        bail!("moe_combine: weights {:?} for outputs {:?}", weights.dims(), y.dims());
    }
    let dev = cuda_device(y)?;
    let out = alloc::<f32>(dev, (n, h))?;
    if n == 0 || h == 0 {
        return Ok(out);
    }
    let cfg = LaunchConfig {
        grid_dim: (h.div_ceil(256) as u32, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = vec![Arg::Ptr(addr(y)?), Arg::Ptr(addr(weights)?), Arg::Ptr(addr(&out)?)];
    args.extend(i32s(&[k, h]));
    // SAFETY: arguments in `moe_combine`'s order; shapes checked above.
    unsafe { launch(dev, "moe_combine", cfg, &args) }?;
    Ok(out)
}

/// Threads of an `argmax_rows` block (`ARGMAX_THREADS` in decode.cu).
const ARGMAX_THREADS: u32 = 1024;

/// The greedy pick of every row of `logits: [n, vocab]` f32 on the device: u32 `[n]`, the index
/// of each row's largest value — the first on ties, NaN never picked unless the row's first value
/// is NaN (then 0): the same index as the host's greedy scan (`strata_kernels::pick::argmax`)
/// over the same values, so a batch's greedy tokens need not bring its logits to the host
/// (16 rows of a 152k vocabulary are 9.7 MB). One block per row.
///
/// Errors: `logits` not a contiguous f32 `[n, vocab]` CUDA tensor, or a launch failure.
pub fn argmax_rows(logits: &Tensor) -> Result<Tensor> {
    check_f32(logits, "logits")?;
    let (n, vocab) = logits.dims2()?;
    let dev = cuda_device(logits)?;
    let out = alloc::<u32>(dev, n)?;
    if n == 0 {
        return Ok(out);
    }
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (ARGMAX_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [Arg::Ptr(addr(logits)?), Arg::Ptr(addr(&out)?), Arg::I32(vocab as i32)];
    // SAFETY: arguments in `argmax_rows`' order; `out` holds one u32 per row of `logits`.
    unsafe { launch(dev, "argmax_rows", cfg, &args) }?;
    Ok(out)
}

/// Threads of a [`KvSpanTable`] copy block.
const KV_SPAN_THREADS: u32 = 256;

/// Whether [`KvSpanTable`] takes these caches: CUDA, one shape and element type, and a
/// position's row of a head (`head_dim` elements) a multiple of 16 bytes (f16 caches: `head_dim`
/// a multiple of 8; f32: of 4).
pub fn kv_span_supports(layers: &[LayerKv<'_>]) -> bool {
    let Some(first) = layers.first() else { return false };
    let sig = first.signature();
    first.k.device().is_cuda()
        && layers.iter().all(|l| l.check().is_ok() && l.signature() == sig)
        && (sig.0[3] * sig.1.size_in_bytes()).is_multiple_of(16)
}

/// Every attention layer's KV cache of one sequence, for copying a run of positions of all of
/// them to or from one contiguous block in one launch (the prefix cache's entries): the caches'
/// addresses uploaded once (u32 `[4 · layers]`: [`LayerKv::address_words`] in order, read by
/// the kernel as `2 · layers` u64). It keeps the caches' tensors (candle tensors share their
/// storage), so the addresses stay valid while it lives.
#[derive(Debug)]
pub struct KvSpanTable {
    table: Tensor,
    /// k and v of each layer, in the table's order.
    caches: Vec<Tensor>,
    kv_heads: usize,
    capacity: usize,
    head_dim: usize,
    dtype: DType,
}

impl KvSpanTable {
    /// `layers`: each `[1, kv_heads, capacity, head_dim]`, one shape and type.
    ///
    /// Errors: caches [`kv_span_supports`] refuses.
    pub fn new(layers: &[LayerKv<'_>]) -> Result<Self> {
        if !kv_span_supports(layers) {
            bail!("kv span copy: {} layer caches of different shapes or unsupported", layers.len());
        }
        let (dims, dtype) = layers[0].signature();
        let mut words = Vec::with_capacity(4 * layers.len());
        for l in layers {
            words.extend_from_slice(&l.address_words()?);
        }
        Ok(Self {
            table: Tensor::from_slice(&words, words.len(), layers[0].k.device())?,
            caches: layers.iter().flat_map(|l| [l.k.clone(), l.v.clone()]).collect(),
            kv_heads: dims[1],
            capacity: dims[2],
            head_dim: dims[3],
            dtype,
        })
    }

    /// Positions `start..start + len` of every layer's k and v copied into one new block
    /// `[2 · layers, kv_heads, len, head_dim]` (layer 0's k, its v, layer 1's k, ...) in one
    /// launch: the same bytes as narrowing each cache and making it contiguous (tested).
    ///
    /// Errors: `start + len` past the capacity.
    pub fn export(&self, start: usize, len: usize) -> Result<Tensor> {
        self.check_range(start, len)?;
        let dev = cuda_device(&self.table)?;
        let shape = (self.caches.len(), self.kv_heads, len, self.head_dim);
        let block = match self.dtype {
            DType::F16 => alloc::<half::f16>(dev, shape)?,
            _ => alloc::<f32>(dev, shape)?,
        };
        // SAFETY: the table holds the addresses of `caches` (alive in self), each [kv_heads,
        // capacity, head_dim]; `block` holds caches · kv_heads · len rows; the range is checked.
        unsafe { self.launch(&block, start, len, true) }?;
        Ok(block)
    }

    /// The inverse of [`Self::export`]: `block` `[2 · layers, kv_heads, len, head_dim]` written
    /// into positions `start..start + len` of every layer's k and v, in one launch.
    ///
    /// Errors: a block of another shape or type; `start + len` past the capacity.
    pub fn import(&self, block: &Tensor, start: usize) -> Result<()> {
        let (t, h, len, hd) = block.dims4()?;
        if (t, h, hd) != (self.caches.len(), self.kv_heads, self.head_dim)
            || block.dtype() != self.dtype
        {
            bail!(
                "kv span copy: a block {:?} {:?} for {} caches [1, {}, {}, {}] of {:?}",
                block.dtype(),
                block.dims(),
                self.caches.len(),
                self.kv_heads,
                self.capacity,
                self.head_dim,
                self.dtype
            );
        }
        self.check_range(start, len)?;
        // SAFETY: as export, the block's shape checked above.
        unsafe { self.launch(block, start, len, false) }
    }

    fn check_range(&self, start: usize, len: usize) -> Result<()> {
        if start + len > self.capacity {
            bail!(
                "kv span copy: positions {start}..{} past a capacity of {}",
                start + len,
                self.capacity
            );
        }
        Ok(())
    }

    /// # Safety
    /// `block` is `[caches, kv_heads, len, head_dim]` of the caches' type, `start + len` within
    /// the capacity.
    unsafe fn launch(
        &self,
        block: &Tensor,
        start: usize,
        len: usize,
        to_block: bool,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let dev = cuda_device(block)?;
        let cfg = LaunchConfig {
            grid_dim: (self.kv_heads as u32, self.caches.len() as u32, 1),
            block_dim: (KV_SPAN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let row16 = self.head_dim * self.dtype.size_in_bytes() / 16;
        let mut args = vec![Arg::Ptr(addr(&self.table)?), Arg::Ptr(addr(block)?)];
        args.extend(i32s(&[self.kv_heads, self.capacity, start, len, row16, to_block as usize]));
        // SAFETY: arguments in `kv_span_copy`'s order; the caller's contract.
        unsafe { launch(dev, "kv_span_copy", cfg, &args) }
    }
}

/// Rotary embedding style: pairs `(i, i + d/2)` (NeoX, candle's `rope`) or `(2i, 2i + 1)`
/// (GPT-J, candle's `rope_i`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Neox,
    Interleaved,
}

/// Where a pass's first position comes from.
#[derive(Debug, Clone, Copy)]
pub enum Position<'a> {
    /// Known on the host when the kernels are launched.
    Host(usize),
    /// Read by the kernels from `pos` (u32 `[1]` on the device), which holds at most `max`: the
    /// launches can be captured once in a CUDA graph and replayed at every position up to `max`.
    Device { pos: &'a Tensor, max: usize },
    /// A batched pass over several sequences: row `i`'s position and its sequence's cache are
    /// row `i` of the uploaded [`RowTable`]. Every cache in it has the shape of the [`LayerKv`]
    /// given with it (checked).
    Rows(&'a Rows),
}

/// The rows of a batched pass over several sequences' KV caches ([`Position::Rows`]): per row,
/// its position and the device addresses of its sequence's layer cache.
#[derive(Debug, Default)]
pub struct RowTable {
    words: Vec<u32>,
    max: usize,
    shape: Option<(Vec<usize>, DType)>,
}

/// A [`RowTable`] on the device: u32 `[rows, 5]` (position, then the cache k and v addresses,
/// low word first), the largest position and the caches' shape and element type.
#[derive(Debug)]
pub struct Rows {
    table: Tensor,
    max: usize,
    shape: (Vec<usize>, DType),
}

impl RowTable {
    /// Adds `rows` rows of one sequence at positions `first..first + rows`, over `cache`.
    ///
    /// Errors: a cache not [`LayerKv::check`]ed, or of another shape or element type than the
    /// caches already in the table; a cache tensor not contiguous on a CUDA device.
    pub fn push(&mut self, first: usize, rows: usize, cache: LayerKv<'_>) -> Result<()> {
        let words = cache.address_words()?;
        // SAFETY: `words` are `cache`'s own addresses, taken just now from its live tensors.
        unsafe { self.push_words(first, rows, cache, words) }
    }

    /// [`Self::push`] with the cache's address words already taken (a batched step's tables are
    /// rewritten at every step, and a cache's addresses do not change: the entries of a
    /// 16-sequence step of a 48-layer model took 0.3-0.5 ms with the addresses taken afresh,
    /// 0.17-0.18 ms with them kept, H200 host).
    ///
    /// # Safety
    /// `words` must be [`LayerKv::address_words`] of `cache` (kernels reading the table write
    /// and read the cache at those addresses), taken while its tensors are alive.
    pub unsafe fn push_words(
        &mut self,
        first: usize,
        rows: usize,
        cache: LayerKv<'_>,
        words: [u32; 4],
    ) -> Result<()> {
        cache.check()?;
        match &self.shape {
            Some(shape) if shape.0.as_slice() != cache.k.dims() || shape.1 != cache.k.dtype() => {
                bail!("row table: cache {:?} after {shape:?}", cache.signature())
            }
            Some(_) => {}
            None => self.shape = Some(cache.signature()),
        }
        let [k_lo, k_hi, v_lo, v_hi] = words;
        for p in first..first + rows {
            self.words.extend([p as u32, k_lo, k_hi, v_lo, v_hi]);
            self.max = self.max.max(p);
        }
        Ok(())
    }

    /// The table's words: per row its position, then the cache k and v addresses (low word
    /// first) — u32 `[rows, 5]` row-major, what [`Rows::in_buffer`] expects.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// The table on `device` (one host-to-device copy), for [`Position::Rows`].
    pub fn upload(&self, device: &Device) -> Result<Rows> {
        let rows = self.words.len() / 5;
        Ok(Rows {
            table: Tensor::from_slice(&self.words, (rows, 5), device)?,
            max: self.max,
            shape: self.shape.clone().unwrap_or((Vec::new(), DType::F32)),
        })
    }
}

/// A [`RowTable`] on the device with its sequences ([`RowTable::upload_segments`]), for a
/// batched prompt pass's attention ([`attend_prefill_rows`]): the rows ([`Self::rows`], for
/// [`Position::Rows`]) and u32 `[sequences, 3]` — each run of rows over one cache at
/// consecutive positions: its first row, row count and first position — taken from one table,
/// so they always agree.
#[derive(Debug)]
pub struct SegmentedRows {
    rows: Rows,
    segments: Tensor,
    longest: usize,
}

impl SegmentedRows {
    /// The row table, for the pass's other kernels ([`rope_kv_append`]).
    pub fn rows(&self) -> &Rows {
        &self.rows
    }
}

impl RowTable {
    /// The table and its sequences on `device` (two host-to-device copies): a sequence is a run
    /// of rows over one cache at consecutive positions (what one [`Self::push`] adds; taken from
    /// the rows here, so that the batched decode steps' pushes keep no more than the rows).
    ///
    /// Errors: an empty table, a device error.
    pub fn upload_segments(&self, device: &Device) -> Result<SegmentedRows> {
        // [first row, rows, first position] per run.
        let mut runs: Vec<[u32; 3]> = Vec::new();
        let rows: Vec<&[u32]> = self.words.chunks_exact(5).collect();
        for (i, row) in rows.iter().enumerate() {
            let continues = i > 0 && rows[i - 1][1..] == row[1..] && rows[i - 1][0] + 1 == row[0];
            match runs.last_mut() {
                Some(run) if continues => run[1] += 1,
                _ => runs.push([i as u32, 1, row[0]]),
            }
        }
        if runs.is_empty() {
            bail!("row table: no rows");
        }
        let flat: Vec<u32> = runs.iter().flatten().copied().collect();
        Ok(SegmentedRows {
            rows: self.upload(device)?,
            segments: Tensor::from_slice(&flat, (runs.len(), 3), device)?,
            longest: runs.iter().map(|s| s[1] as usize).max().unwrap_or(0),
        })
    }
}

impl Rows {
    /// A row table the caller keeps on the device and rewrites before each launch (a captured
    /// CUDA graph's: its positions and caches change from step to step, the launches stay):
    /// `table` u32 `[rows, 5]` contiguous as [`RowTable::words`] lays it out, every position in
    /// it at most `max` (the launches' split counts cover positions `0..=max`), every cache of
    /// the shape and element type of `like` (`[1, n_kv_heads, capacity, head_dim]`).
    ///
    /// Errors: `table` not u32 `[rows, 5]` or not contiguous, `like` not [`LayerKv::check`]ed.
    pub fn in_buffer(table: Tensor, max: usize, like: LayerKv<'_>) -> Result<Rows> {
        like.check()?;
        if table.dtype() != DType::U32 || table.dims2()?.1 != 5 || !table.is_contiguous() {
            bail!(
                "row table: expected contiguous u32 [rows, 5], got {:?} {:?}",
                table.dtype(),
                table.dims()
            );
        }
        Ok(Rows { table, max, shape: like.signature() })
    }
}

impl Position<'_> {
    /// One past the largest position a launch over `seq` rows may write or read.
    fn end(&self, seq: usize) -> usize {
        match *self {
            Position::Host(p) => p + seq,
            Position::Device { max, .. } => max + seq,
            Position::Rows(r) => r.max + 1,
        }
    }

    fn host(&self) -> i32 {
        match *self {
            Position::Host(p) => p as i32,
            Position::Device { .. } | Position::Rows(_) => 0,
        }
    }

    /// The device address of the position (0: a host position or a row table).
    fn device_addr(&self) -> Result<u64> {
        match self {
            Position::Device { pos, .. } => addr(pos),
            Position::Host(_) | Position::Rows(_) => Ok(0),
        }
    }

    /// The device address of the row table (0: none).
    fn rows_addr(&self) -> Result<u64> {
        match self {
            Position::Rows(r) => addr(&r.table),
            Position::Host(_) | Position::Device { .. } => Ok(0),
        }
    }

    /// Checks the position for a launch over `seq` rows and `cache`.
    fn check(&self, seq: usize, cache: &LayerKv<'_>) -> Result<()> {
        match self {
            Position::Device { pos, .. } if pos.dtype() != DType::U32 || pos.elem_count() != 1 => {
                bail!("device position: expected one u32, got {:?} {:?}", pos.dtype(), pos.dims())
            }
            Position::Rows(r) if r.table.dims() != [seq, 5] || r.shape != cache.signature() => {
                bail!(
                    "row table: {:?} rows of caches {:?}, for {seq} rows of caches {:?}",
                    r.table.dims(),
                    r.shape,
                    cache.signature()
                )
            }
            _ => Ok(()),
        }
    }
}

/// One layer's KV cache on the device: `k`, `v: [1, n_kv_heads, capacity, head_dim]`, f32 or
/// f16 (both alike), contiguous, written in place. The kernels compute in f32 whatever the
/// storage; an f16 cache rounds each written key and value to nearest (`--kv-cache-dtype`).
/// Two references: copied freely (the RoPE launch and the attention launch take the same one).
#[derive(Clone, Copy)]
pub struct LayerKv<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
}

impl LayerKv<'_> {
    /// Errors: k and v of different shapes or element types, or not f32 / f16.
    fn check(&self) -> Result<()> {
        let (k, v) = (self.k, self.v);
        if k.dims() != v.dims() || k.dtype() != v.dtype() || k.rank() != 4 {
            bail!("KV cache: k {:?} {:?}, v {:?} {:?}", k.dtype(), k.dims(), v.dtype(), v.dims());
        }
        if !matches!(k.dtype(), DType::F32 | DType::F16) {
            bail!("KV cache: {:?} values, expected f32 or f16", k.dtype());
        }
        Ok(())
    }

    /// The k and v tensors' device addresses as a row table entry's last four words (k low, k
    /// high, v low, v high), for [`RowTable::push_words`].
    ///
    /// Errors: as [`RowTable::push`].
    pub fn address_words(&self) -> Result<[u32; 4]> {
        self.check()?;
        let (k, v) = (addr(self.k)?, addr(self.v)?);
        Ok([k as u32, (k >> 32) as u32, v as u32, (v >> 32) as u32])
    }

    /// The caches' shape and element type.
    fn signature(&self) -> (Vec<usize>, DType) {
        (self.k.dims().to_vec(), self.k.dtype())
    }

    /// The suffix of the kernels that take this cache's element type.
    fn kernel_suffix(&self) -> &'static str {
        if self.k.dtype() == DType::F16 {
            "_f16"
        } else {
            ""
        }
    }
}

/// RoPE and the KV-cache write of `seq` tokens at positions `pos..pos + seq` (`pos` on the host
/// or on the device, [`Position`]): `q: [seq, nh, hd]`,
/// `k`, `v: [seq, nkv, hd]`; `cos`, `sin: [max_positions, rope_dim / 2]` (the model's tables,
/// attention factor included). Rotates the first `rope_dim` dimensions of every head of q and k
/// (RoFormer, Su et al. 2021), writes the rotated k and v into `cache` at those positions and
/// returns the rotated q `[seq, nh, hd]`. With `norms`, every head of q and k is first
/// RMSNorm-ed with its weight (Qwen3's per-head q/k norm), in the same launch.
///
/// Errors: shapes disagree, `rope_dim` is odd or above `hd`, positions past the cache or the
/// tables, norm weights not contiguous f32 `[hd]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_kv_append(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    style: RopeStyle,
    pos: Position<'_>,
    cache: LayerKv<'_>,
    norms: Option<HeadNorms<'_>>,
) -> Result<Tensor> {
    pos.check(q.dim(0)?, &cache)?;
    for (t, w) in [(q, "q"), (k, "k"), (v, "v"), (cos, "cos"), (sin, "sin")] {
        check_f32(t, w)?;
    }
    cache.check()?;
    let (seq, nh, hd) = q.dims3()?;
    let (_, nkv, cap, chd) = cache.k.dims4()?;
    let (max_pos, half) = cos.dims2()?;
    let rd = 2 * half;
    if k.dims() != [seq, nkv, hd] || v.dims() != [seq, nkv, hd] || chd != hd {
        bail!(
            "rope_kv_append: q {:?}, k {:?}, v {:?}, cache {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            cache.k.dims()
        );
    }
    if sin.dims() != cos.dims() {
        bail!("rope_kv_append: table shapes differ");
    }
    let last = pos.end(seq);
    if rd > hd || !hd.is_multiple_of(2) || last > cap || last > max_pos {
        bail!(
            "rope_kv_append: rope dims {rd}, head dim {hd}, positions up to {last} \
             (cache {cap}, table {max_pos})"
        );
    }
    if let Some(n) = &norms {
        check_f32(n.q, "q norm")?;
        check_f32(n.k, "k norm")?;
        if n.q.dims() != [hd] || n.k.dims() != [hd] || hd > 2048 {
            bail!("rope_kv_append: norms {:?} {:?} for head dim {hd}", n.q.dims(), n.k.dims());
        }
    }
    let dev = cuda_device(q)?;
    let q_out = alloc::<f32>(dev, (seq, nh, hd))?;
    if seq == 0 {
        return Ok(q_out);
    }
    let cfg = LaunchConfig {
        grid_dim: (seq as u32, (nh + nkv) as u32, 1),
        block_dim: ((hd / 2).max(32).next_multiple_of(32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args: Vec<Arg> = [q, k, v, cos, sin, &q_out, cache.k, cache.v]
        .iter()
        .map(|t| addr(t).map(Arg::Ptr))
        .collect::<Result<_>>()?;
    let interleaved = matches!(style, RopeStyle::Interleaved) as usize;
    args.extend(i32s(&[nh, nkv, hd, rd, interleaved]));
    args.push(Arg::I32(pos.host()));
    args.push(Arg::I32(cap as i32));
    args.push(Arg::Ptr(pos.device_addr()?));
    args.push(Arg::Ptr(pos.rows_addr()?));
    let norm_w = |t: Option<&Tensor>| t.map(addr).transpose();
    args.push(Arg::Ptr(norm_w(norms.as_ref().map(|n| n.q))?.unwrap_or(0)));
    args.push(Arg::Ptr(norm_w(norms.as_ref().map(|n| n.k))?.unwrap_or(0)));
    args.push(Arg::F32(norms.as_ref().map_or(0.0, |n| n.eps)));
    // SAFETY: arguments in `rope_kv_append*`'s order; shapes, element type and positions
    // checked above (a row table's caches by its builder and caller: contiguous caches of this
    // shape and element type). The caches are written in place: their tensors belong to
    // KvCaches used by one pass at a time on this stream.
    let name = format!("rope_kv_append{}", cache.kernel_suffix());
    unsafe { launch(dev, &name, cfg, &args) }?;
    Ok(q_out)
}

/// Per-head RMSNorm weights of q and k (`[hd]` f32 each, Qwen3's `q_norm` / `k_norm`) and their
/// epsilon, applied by [`rope_kv_append`] before the rotation.
pub struct HeadNorms<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f32,
}

/// Whether [`attend_decode`] takes a head dimension (a multiple of 32, at most 256).
pub fn attend_supports(head_dim: usize) -> bool {
    head_dim.is_multiple_of(32) && matches!(head_dim / 32, 1..=4 | 8)
}

/// The shapes of an attention launch: `q: [seq, nh, hd]` f32 over `cache` up to position `last`
/// (exclusive), `supports(hd)` the head dimensions of the kernel and `f16_only` whether it takes
/// only an f16 cache → `(seq, nh, hd, nkv, cap)`. Errors name `what` and the shapes.
fn check_attention(
    what: &str,
    q: &Tensor,
    cache: &LayerKv<'_>,
    last: impl Fn(usize) -> usize,
    supports: fn(usize) -> bool,
    f16_only: bool,
) -> Result<(usize, usize, usize, usize, usize)> {
    check_f32(q, "q")?;
    cache.check()?;
    let (seq, nh, hd) = q.dims3()?;
    let (_, nkv, cap, chd) = cache.k.dims4()?;
    let last = last(seq);
    if (f16_only && cache.k.dtype() != DType::F16)
        || chd != hd
        || !supports(hd)
        || nkv == 0
        || !nh.is_multiple_of(nkv)
        || last > cap
    {
        bail!(
            "{what}: q {:?}, {:?} cache {:?}, positions up to {last}",
            q.dims(),
            cache.k.dtype(),
            cache.k.dims()
        );
    }
    Ok((seq, nh, hd, nkv, cap))
}

/// Attention of `seq` query rows over one layer's KV cache: `q: [seq, nh, hd]` (rotated), row `i`
/// attends positions `0..=pos + i` of `cache` (the rows' own keys already written) → `[seq, nh ·
/// hd]`. Query head `h` reads kv head `h / (nh / nkv)` (GQA). Softmax in f32 with an online
/// maximum, split over chunks of 16 or more positions (at most 128 chunks by default) merged in a second launch
/// (FlashDecoding, Dao et al. 2023) when the context (the longest `pos` may be, [`Position`])
/// spans more than one chunk. Where [`q8_beside`] says so, the output's q8 rounding is written
/// by the same launches and kept as its twin (the o projection's input).
///
/// Errors: `hd` not [`attend_supports`]ed, `nh` not a multiple of `nkv`, positions past the cache.
pub fn attend_decode(
    q: &Tensor,
    pos: Position<'_>,
    scale: f32,
    cache: LayerKv<'_>,
) -> Result<Tensor> {
    pos.check(q.dim(0)?, &cache)?;
    let (seq, nh, hd, nkv, cap) =
        check_attention("attend_decode", q, &cache, |s| pos.end(s), attend_supports, false)?;
    let last = pos.end(seq);
    let dev = cuda_device(q)?;
    let out = alloc::<f32>(dev, (seq, nh * hd))?;
    if seq == 0 {
        return Ok(out);
    }
    let chunk = attn_chunk(last);
    let splits = last.div_ceil(chunk);
    if splits > ATTN_SPLITS_LIMIT {
        bail!("attend_decode: {splits} splits, attn_combine takes {ATTN_SPLITS_LIMIT}");
    }
    let groups = (nh / nkv).div_ceil(ATTN_REP);
    let cfg = LaunchConfig {
        grid_dim: ((nkv * groups) as u32, splits as u32, seq as u32),
        block_dim: (ATTN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let part =
        if splits > 1 { Some(alloc::<f32>(dev, seq * nh * splits * (hd + 2))?) } else { None };
    // hd is a multiple of 32 (`attend_supports`): every 32-value block lies in one head.
    let q8 = Q8Outputs::new(dev, seq, nh * hd)?;
    let (oq, od) = q8.addrs()?;
    let mut args = vec![
        Arg::Ptr(addr(q)?),
        Arg::Ptr(addr(cache.k)?),
        Arg::Ptr(addr(cache.v)?),
        Arg::Ptr(addr(&out)?),
        Arg::Ptr(part.as_ref().map(addr).transpose()?.unwrap_or(0)),
    ];
    args.extend(i32s(&[nh, nkv, cap]));
    args.push(Arg::I32(pos.host()));
    args.push(Arg::I32(chunk as i32));
    args.push(Arg::F32(scale));
    args.push(Arg::Ptr(pos.device_addr()?));
    args.push(Arg::Ptr(pos.rows_addr()?));
    // The q8 outputs are written by the launch that writes `out`.
    let (dq, dd) = if splits > 1 { (0, 0) } else { (oq, od) };
    args.extend([Arg::Ptr(dq), Arg::Ptr(dd)]);
    // SAFETY: arguments in `attn_decode*_hd*`'s order; shapes and the caches' element type
    // (the kernel's) checked above; `part` holds `seq · nh · splits · (hd + 2)` values when there
    // are several splits; the q8 outputs (when given) `[seq, nh · hd]` bytes and
    // `[seq, nh · hd / 32]` f32.
    let name = format!("attn_decode{}_hd{}", cache.kernel_suffix(), hd / 32);
    unsafe { launch(dev, &name, cfg, &args) }?;
    if let Some(p) = &part {
        attn_combine(dev, p, &out, (oq, od), [seq, nh, hd, splits])?;
    }
    q8.keep_for(&out);
    Ok(out)
}

/// Merges split-K partials `part: [seq, nh, splits, hd + 2]` into `out: [seq, nh · hd]` and its
/// q8 rounding (`q8`: the addresses of `Q8Outputs`, or zeros).
fn attn_combine(
    dev: &CudaDevice,
    part: &Tensor,
    out: &Tensor,
    (oq, od): (u64, u64),
    [seq, nh, hd, splits]: [usize; 4],
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (nh as u32, seq as u32, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = vec![Arg::Ptr(addr(part)?), Arg::Ptr(addr(out)?), Arg::Ptr(oq), Arg::Ptr(od)];
    args.extend(i32s(&[nh, hd, splits]));
    // SAFETY: arguments in `attn_combine`'s order; `part` and `out` of the shapes above (the
    // callers allocate them so), the q8 outputs `[seq, nh · hd]` bytes and `[seq, nh · hd / 32]`
    // f32 when given; hd <= 1024 threads, splits <= ATTN_SPLITS_LIMIT (checked by the callers).
    unsafe { launch(dev, "attn_combine", cfg, &args) }
}

/// [`attend_decode`] on tensor cores for an f16 cache (`attn_decode_tc_f16_hd*`, attn_tc.cuh):
/// the kernel shape of [`attend_prefill`] — a kv head's query heads and rows as the rows of
/// `mma` tiles, no cross-lane reduction per position — split over chunks of positions (a
/// multiple of 64, at most [`ATTN_SPLITS_MAX`] of them) and merged by `attn_combine`
/// (FlashDecoding, Dao et al. 2023). `q: [seq, nh, hd]` (rotated), row `i` attends positions
/// `0..=pos + i` → `[seq, nh · hd]`. Positions from the host, the device ([`Position::Device`]:
/// capturable) or a batched pass's row table ([`Position::Rows`]: a block column per row, over
/// its own sequence's cache). q and the softmax weights are rounded to f16, sums are f32 (the
/// accuracy class of [`attend_prefill`]); a row's result does not depend on the other rows of its
/// pass, nor on whether they are of its sequence.
///
/// Errors: as [`attend_prefill`].
pub fn attend_decode_tc(
    q: &Tensor,
    pos: Position<'_>,
    scale: f32,
    cache: LayerKv<'_>,
) -> Result<Tensor> {
    pos.check(q.dim(0)?, &cache)?;
    let supports = attend_prefill_supports;
    let (seq, nh, hd, nkv, cap) =
        check_attention("attend_decode_tc", q, &cache, |s| pos.end(s), supports, true)?;
    let last = pos.end(seq);
    let dev = cuda_device(q)?;
    let out = alloc::<f32>(dev, (seq, nh * hd))?;
    if seq == 0 {
        return Ok(out);
    }
    let chunk = attn_chunk(last).next_multiple_of(TC_KEY_TILE);
    let splits = last.div_ceil(chunk);
    if splits > ATTN_SPLITS_LIMIT {
        bail!("attend_decode_tc: {splits} splits, attn_combine takes {ATTN_SPLITS_LIMIT}");
    }
    let part = alloc::<f32>(dev, seq * nh * splits * (hd + 2))?;
    // A row table: a block column per row (its own sequence); else tiles of 64 query rows.
    let tiles = match pos {
        Position::Rows(_) => seq,
        _ => (nh / nkv * seq).div_ceil(PREFILL_BM),
    };
    let (cfg, mut args) = attn_tc_launch(q, &cache, &part, [tiles, nkv, splits])?;
    args.extend(i32s(&[nh, nkv, cap]));
    args.push(Arg::I32(pos.host()));
    args.push(Arg::I32(seq as i32));
    args.push(Arg::F32(scale));
    args.push(Arg::I32(chunk as i32));
    args.push(Arg::Ptr(pos.device_addr()?));
    args.push(Arg::Ptr(pos.rows_addr()?));
    // SAFETY: arguments in `attn_decode_tc_f16_hd*`'s order; q and the f16 caches checked above
    // (a row table's caches have their shape and type: `pos.check`), positions below
    // `last <= cap`; `part` holds `seq · nh · splits · (hd + 2)` values, every one written (each
    // split writes its rows' partials, empty ones included).
    unsafe { launch(dev, &format!("attn_decode_tc_f16_hd{hd}"), cfg, &args) }?;
    // hd is a multiple of 32: every 32-value block of the q8 rounding lies in one head.
    let q8 = Q8Outputs::new(dev, seq, nh * hd)?;
    attn_combine(dev, &part, &out, q8.addrs()?, [seq, nh, hd, splits])?;
    q8.keep_for(&out);
    Ok(out)
}

/// Query rows (`FA_BM`) and threads (`FA_THREADS`) of an [`attend_prefill`] block (attn_tc.cuh).
const PREFILL_BM: usize = 64;
const PREFILL_THREADS: u32 = 128;
/// A multiple of every attn_tc.cuh kernel's key/value tile (64 positions, 32 at head dimension
/// 256): [`attend_decode_tc`]'s chunks are multiples of it, so no tile crosses two splits.
const TC_KEY_TILE: usize = 64;

/// The grid `[query-row tiles, kv heads, splits]` of an attn_tc.cuh launch and its first four
/// arguments: q, the cache's k and v, and the output (or partials) `dst`.
fn attn_tc_launch(
    q: &Tensor,
    cache: &LayerKv<'_>,
    dst: &Tensor,
    [tiles, nkv, splits]: [usize; 3],
) -> Result<(LaunchConfig, Vec<Arg>)> {
    let cfg = LaunchConfig {
        grid_dim: (tiles as u32, nkv as u32, splits as u32),
        block_dim: (PREFILL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let args: Result<Vec<Arg>> =
        [q, cache.k, cache.v, dst].iter().map(|t| addr(t).map(Arg::Ptr)).collect();
    Ok((cfg, args?))
}

/// Head dimensions [`attend_prefill`] has kernels for.
pub fn attend_prefill_supports(head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128 | 256)
}

/// Prompt-pass attention on tensor cores over an f16 KV cache (FlashAttention-2: Dao 2023,
/// Algorithm 1; the kernel is attn_tc.cuh): `q: [seq, nh, hd]` f32 (rotated), row `i` attends
/// positions `0..=pos + i` of `cache` (f16, this pass's keys and values already written, e.g. by
/// [`rope_kv_append`]) → `[seq, nh · hd]` f32. Query head `h` reads kv head `h / (nh / nkv)`.
/// One launch; no `[heads, rows, positions]` score tensor. q and the softmax weights are rounded
/// to f16 for the tensor cores (the cache already is), products and sums are f32: the accuracy
/// class of `--kv-cache-dtype f16`, stated with its test in crates/strata-models/tests/cuda_kernels.rs.
///
/// Errors: a cache that is not f16, a head dimension without a kernel
/// ([`attend_prefill_supports`]), `nh` not a multiple of the kv heads, positions past the cache.
pub fn attend_prefill(q: &Tensor, pos: usize, scale: f32, cache: LayerKv<'_>) -> Result<Tensor> {
    let supports = attend_prefill_supports;
    let (seq, nh, hd, nkv, cap) =
        check_attention("attend_prefill", q, &cache, |s| pos + s, supports, true)?;
    let dev = cuda_device(q)?;
    let out = alloc::<f32>(dev, (seq, nh * hd))?;
    if seq == 0 {
        return Ok(out);
    }
    let tiles = (nh / nkv * seq).div_ceil(PREFILL_BM);
    let (cfg, mut args) = attn_tc_launch(q, &cache, &out, [tiles, nkv, 1])?;
    args.extend(i32s(&[nh, nkv, cap, pos, seq]));
    args.push(Arg::F32(scale));
    // SAFETY: arguments in `attn_prefill_f16_hd*`'s order; q `[seq, nh, hd]` f32 and the f16
    // caches `[1, nkv, cap, hd]` checked above (contiguous: `addr`), pos + seq <= cap; `out`
    // holds `seq · nh · hd` values.
    unsafe { launch(dev, &format!("attn_prefill_f16_hd{hd}"), cfg, &args) }?;
    Ok(out)
}

/// [`attend_prefill`] for a batched prompt pass over several sequences in one launch: `q:
/// [rows, nh, hd]` f32 (rotated) holds every sequence's rows in the order they were pushed to
/// the [`RowTable`] that gave `table` ([`RowTable::upload_segments`]); each
/// sequence's rows attend over its own f16 cache (the table's), row `i` of a sequence from
/// position `p` seeing positions `0..=p + i` → `[rows, nh · hd]`. Each sequence's tiles and
/// arithmetic are those of [`attend_prefill`] over it alone, so its rows are the same bits
/// (tested); one launch instead of one per sequence (16 sequences of a 48-layer model's prompt
/// pass: 768 launches of a few blocks each).
///
/// Errors: as [`attend_prefill`]; a table of another row count than `q`, or whose caches
/// differ from `cache`.
pub fn attend_prefill_rows(
    q: &Tensor,
    table: &SegmentedRows,
    scale: f32,
    cache: LayerKv<'_>,
) -> Result<Tensor> {
    let pos = Position::Rows(&table.rows);
    pos.check(q.dim(0)?, &cache)?;
    let supports = attend_prefill_supports;
    let (seq, nh, hd, nkv, cap) =
        check_attention("attend_prefill_rows", q, &cache, |s| pos.end(s), supports, true)?;
    let dev = cuda_device(q)?;
    let out = alloc::<f32>(dev, (seq, nh * hd))?;
    if seq == 0 {
        return Ok(out);
    }
    let tiles = (nh / nkv * table.longest).div_ceil(PREFILL_BM);
    let n = table.segments.dim(0)?;
    let (cfg, mut args) = attn_tc_launch(q, &cache, &out, [tiles, nkv, n])?;
    args.extend(i32s(&[nh, nkv, cap]));
    args.push(Arg::F32(scale));
    args.push(Arg::Ptr(pos.rows_addr()?));
    args.push(Arg::Ptr(addr(&table.segments)?));
    // SAFETY: arguments in `attn_prefill_rows_f16_hd*`'s order; q `[seq, nh, hd]` f32 and the
    // f16 caches of the table's shape checked above; the segments are runs of the same table's
    // rows (consecutive positions over one cache each, every position at most `max < cap`) and
    // cover its `seq` rows; `out` holds `seq · nh · hd` values.
    unsafe { launch(dev, &format!("attn_prefill_rows_f16_hd{hd}"), cfg, &args) }?;
    Ok(out)
}

/// Shapes of a MoE call over Q4_K experts.
struct MoeDims {
    n: usize,
    h: usize,
    e: usize,
    i: usize,
    k: usize,
}

/// Checks `x: [n, H]` f32, `gate`, `up: [E, I, H]`, `down: [E, H, I]` Q4_K (H, I multiples of
/// 256), `ids: [n, k]` u32, `weights: [n, k]` f32 and `n ≤ max_rows`.
fn check_moe(
    x: &Tensor,
    [gate, up, down]: [&QTensor; 3],
    ids: &Tensor,
    weights: &Tensor,
    max_rows: usize,
) -> Result<MoeDims> {
    check_f32(x, "x")?;
    check_f32(weights, "routing weights")?;
    let (n, h) = x.dims2()?;
    let (e, i, gh) = gate.shape().dims3()?;
    let (_, k) = ids.dims2()?;
    let q4k = [gate, up, down].iter().all(|t| t.dtype() == GgmlDType::Q4K);
    if !q4k
        || up.shape().dims() != [e, i, gh]
        || down.shape().dims() != [e, h, i]
        || gh != h
        || !h.is_multiple_of(256)
        || !i.is_multiple_of(256)
        || ids.dims() != [n, k]
        || ids.dtype() != DType::U32
        || weights.dims() != [n, k]
        || n > max_rows
    {
        bail!(
            "moe_q4k: x {:?}, gate {:?} {:?}, down {:?}, ids {:?}",
            x.dims(),
            gate.dtype(),
            gate.shape().dims(),
            down.shape().dims(),
            ids.dims()
        );
    }
    Ok(MoeDims { n, h, e, i, k })
}

/// Tokens a pass may have for [`moe_q4k_grouped`].
pub const MOE_GROUPED_ROWS_MAX: usize = 64;

/// Most experts per layer [`moe_q4k_grouped`] takes (`GROUPED_MAX_E` in moe_q4k.cuh).
pub const MOE_GROUPED_MAX_EXPERTS: usize = 1024;

/// Super-blocks per row (row length ÷ 256) the grouped kernels are built for
/// (`moe_rows_q4k_grouped_nb*`).
const NB_SUPPORTED: [usize; 8] = [1, 2, 3, 4, 6, 8, 12, 16];

/// Whether [`moe_q4k_grouped`] takes experts of hidden size `h` and intermediate size `i`.
pub fn moe_grouped_supports(h: usize, i: usize) -> bool {
    [h, i].iter().all(|&n| n.is_multiple_of(256) && NB_SUPPORTED.contains(&(n / 256)))
}

/// [`moe_q4k`] grouped by expert, for batched passes (several sequences' decode tokens, short
/// verify passes): one block per (distinct selected expert, 4 weight rows) dequantizes those
/// rows once into registers and runs them over every (token, slot) pair routed to that expert,
/// so each selected expert's weights are read and dequantized once per pass instead of once per
/// pair. Five launches: gate, up, [`silu_mul`], down, [`moe_combine`]; no residual. f32
/// activations like [`moe_q4k`] (the f32 reference's result up to summation order).
///
/// `ids` must be below `E` (as a router's are): a pair with another id is skipped by the
/// kernels and its output row is undefined.
///
/// Errors: as [`moe_q4k`], with `n` up to [`MOE_GROUPED_ROWS_MAX`], `E` up to
/// [`MOE_GROUPED_MAX_EXPERTS`] and sizes [`moe_grouped_supports`] takes.
pub fn moe_q4k_grouped(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    ids: &Tensor,
    weights: &Tensor,
) -> Result<Tensor> {
    let MoeDims { n, h, e, i, k } =
        check_moe(x, [gate, up, down], ids, weights, MOE_GROUPED_ROWS_MAX)?;
    if e > MOE_GROUPED_MAX_EXPERTS || !moe_grouped_supports(h, i) {
        bail!("moe_q4k_grouped: {e} experts of {h} × {i} (see moe_grouped_supports)");
    }
    let dev = cuda_device(x)?;
    let pairs = n * k;
    if pairs == 0 {
        return alloc::<f32>(dev, (n, h))?.zeros_like();
    }
    let grouped = |src: &Tensor, w: &QTensor, rows: usize, per_token: bool| {
        let shape = RowsShape { rows, len: w.shape().dims()[2], experts: e, k, per_token, pairs };
        rows_q4k(dev, src, w, Some(ids), shape)
    };
    let g = grouped(x, gate, i, true)?;
    let u = grouped(x, up, i, true)?;
    let a = silu_mul(&g, &u)?;
    let y = grouped(&a, down, h, false)?;
    moe_combine(&y.reshape((n, k, h))?, &weights.contiguous()?)
}

/// A launch of `moe_rows_q4k_grouped_nb*` (moe_q4k.cuh): `out[p, r] = W_e[r] · src[s(p)]` for
/// every pair `p < pairs` of expert `e` (its id in `ids`, or expert 0 for all pairs when `ids` is
/// `None`: a dense matrix), `s(p) = p / k` when `per_token` else `p`.
struct RowsShape {
    /// Weight rows per expert.
    rows: usize,
    /// Values per weight row (a size [`moe_grouped_supports`] takes).
    len: usize,
    experts: usize,
    k: usize,
    per_token: bool,
    pairs: usize,
}

/// Runs [`RowsShape`]'s product over the Q4_K tensor `w: [experts, rows, len]` (or `[rows, len]`
/// with one expert) → `out: [pairs, rows]`.
///
/// The caller checks the shapes; ids ≥ `experts` are skipped by the kernel (their rows of `out`
/// are left undefined: a router's ids are < E).
fn rows_q4k(
    dev: &CudaDevice,
    src: &Tensor,
    w: &QTensor,
    ids: Option<&Tensor>,
    s: RowsShape,
) -> Result<Tensor> {
    let out = alloc::<f32>(dev, (s.pairs, s.rows))?;
    let cfg = LaunchConfig {
        grid_dim: (s.rows.div_ceil(4) as u32, s.pairs.min(s.experts) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = vec![
        Arg::Ptr(addr(src)?),
        Arg::Ptr(w.device_ptr()? as u64),
        Arg::Ptr(ids.map(addr).transpose()?.unwrap_or(0)),
        Arg::Ptr(addr(&out)?),
    ];
    args.extend(i32s(&[s.rows, s.k, s.per_token as usize, s.pairs, s.experts]));
    // SAFETY: arguments in `moe_rows_q4k_grouped_nb*`'s order; the caller checked that `w` is
    // [experts, rows, len] Q4_K, src holds a `len`-value row per token (per_token) or per pair,
    // and ids (if any) hold `pairs` u32.
    unsafe { launch(dev, &format!("moe_rows_q4k_grouped_nb{}", s.len / 256), cfg, &args) }?;
    Ok(out)
}

/// Rows a product may have for [`matmul_q4k`] (a batch's decode rows, a verify pass; longer
/// passes are faster dequantized once to f32 for cuBLAS).
pub const MATMUL_ROWS_MAX: usize = 16;

/// `x: [n, K]` f32 times a Q4_K matrix `w: [R, K]` → `[n, R]` (`y = x · wᵀ`), for a few rows
/// (decode steps of a batch, short verify passes): each warp dequantizes one weight row into
/// registers once (ggml's `dequantize_row_q4_K` values) and takes every row of `x` with it, in
/// f32 (`moe_rows_q4k_grouped_nb*` with every pair on one "expert"). A row's result does not
/// depend on the other rows of `x`, so a batch's rows equal the same rows passed alone (tested).
///
/// Errors: `w` not Q4_K `[R, K]` with `K` a size [`moe_grouped_supports`] takes, `x` not f32
/// `[n, K]` contiguous on the same device, `n` above [`MATMUL_ROWS_MAX`].
pub fn matmul_q4k(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    check_f32(x, "x")?;
    let (n, kx) = x.dims2()?;
    let (r, k) = w.shape().dims2()?;
    if w.dtype() != GgmlDType::Q4K || k != kx || !moe_grouped_supports(k, k) || n > MATMUL_ROWS_MAX
    {
        bail!("matmul_q4k: x {:?}, w {:?} {:?}", x.dims(), w.dtype(), w.shape().dims());
    }
    let dev = cuda_device(x)?;
    if n == 0 || r == 0 {
        return alloc::<f32>(dev, (n, r));
    }
    // Every row of x is a "pair" of the one expert.
    let shape = RowsShape { rows: r, len: k, experts: 1, k: 1, per_token: true, pairs: n };
    rows_q4k(dev, x, w, None, shape)
}

/// `t` itself when its first element is 16-byte aligned (the 16-byte loads of `mv_q4k_r*`,
/// `moe_gate_up_q4k`, `moe_down_q4k`), else a copy in a new allocation (aligned). A misaligned
/// 16-byte load is a sticky CUDA error that leaves the context unusable, so this is never skipped.
fn aligned16(t: &Tensor) -> Result<Tensor> {
    if addr(t)?.is_multiple_of(16) {
        Ok(t.clone())
    } else {
        // `Tensor::copy` keeps the storage's start offset; this allocates afresh.
        t.force_contiguous()
    }
}

/// `x: [n, K]` f32 times a quantized matrix `w: [R, K]` → `[n, R]` (`y = x · wᵀ`), the mat-vec of
/// a decode step: [`matvec_quant_many`] with one matrix.
pub fn matvec_quant(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    Ok(matvec_quant_many(x, &[w])?.remove(0))
}

/// Whether [`matvec_quant_many_as`] takes `K`-column matrices of `dtype` with inputs `act`:
/// Q4_K (`K` a multiple of 256; f32 or q8 inputs), Q4_1 and Q8_0 (`K` a multiple of 32; q8
/// inputs only).
pub fn matvec_supports(dtype: GgmlDType, k: usize, act: Activations) -> bool {
    match dtype {
        GgmlDType::Q4K => k.is_multiple_of(256),
        GgmlDType::Q4_1 | GgmlDType::Q8_0 => k.is_multiple_of(32) && act == Activations::Q8,
        _ => false,
    }
}

/// `x: [n, K]` f32 times one to three matrices `w_m: [R_m, K]` of one quantized format (a
/// layer's q, k and v projections; an MLP's gate and up) → `[n, R_m]` each, in one launch.
/// Q4_K (`mv_q4k_r*`): a warp per 1, 2 or 4 weight rows ([`mv_rows`]) reading their quants in
/// 16-byte loads, 8 lanes per super-block, each lane's inputs loaded once for the warp's rows,
/// ggml's `dequantize_row_q4_K` values; the inputs taken as [`activations`] says: by default
/// rounded to 8 bits as llama.cpp's MMVQ rounds x to Q8_1, or f32, the f32 reference's result up
/// to summation order. Q4_1 and Q8_0 (`mv_q4_1_q8_r*`, `mv_q8_0_q8_r*`, q8 inputs): four lanes
/// per 32-value block, llama.cpp's `vec_dot_q4_1_q8_1` / `vec_dot_q8_0_q8_1` integer sums. Rows
/// of `x` go four to a warp when there are several ([`mv_tokens`]: each weight load serves four
/// tokens): meant for one to a few rows (a decode step, a short verify pass). A row's result does
/// not depend on the other rows of `x` nor on the other matrices passed with it (bit for bit,
/// tested), so a short pass's rows equal the one-row products of decode steps.
///
/// Errors: no matrix or more than three, matrices of different formats or one that
/// [`matvec_supports`] refuses, `x` not f32 `[n, K]` contiguous on the same CUDA device.
pub fn matvec_quant_many(x: &Tensor, ws: &[&QTensor]) -> Result<Vec<Tensor>> {
    matvec_quant_many_as(x, ws, activations())
}

/// [`matvec_quant_many`] with the inputs taken as `act` says ([`Activations::Q8`]: one more
/// launch, [`quantize_q8`], unless a kept twin serves, then integer dot products; each row still
/// independent of the others and of the launch's shape, bit for bit).
pub fn matvec_quant_many_as(x: &Tensor, ws: &[&QTensor], act: Activations) -> Result<Vec<Tensor>> {
    check_f32(x, "x")?;
    let (n, k) = x.dims2()?;
    let mut rows = [0usize; 3];
    let dtype = ws.first().map(|w| w.dtype());
    if ws.is_empty() || ws.len() > 3 || n > 65535 {
        bail!("matvec_quant: x {:?} with {} matrices", x.dims(), ws.len());
    }
    for (m, w) in ws.iter().enumerate() {
        let (r, wk) = w.shape().dims2()?;
        if Some(w.dtype()) != dtype || wk != k || !matvec_supports(w.dtype(), k, act) {
            bail!(
                "matvec_quant: x {:?}, w {:?} {:?} ({act:?})",
                x.dims(),
                w.dtype(),
                w.shape().dims()
            );
        }
        rows[m] = r;
    }
    let prefix = match dtype {
        Some(GgmlDType::Q4_1) => "mv_q4_1",
        Some(GgmlDType::Q8_0) => "mv_q8_0",
        _ => "mv_q4k",
    };
    let dev = cuda_device(x)?;
    let ys = (0..ws.len()).map(|m| alloc::<f32>(dev, (n, rows[m]))).collect::<Result<Vec<_>>>()?;
    let total: usize = rows.iter().sum();
    if n == 0 || total == 0 {
        return Ok(ys);
    }
    let tokens = mv_tokens(n);
    let per_warp = mv_rows(total, tokens);
    let (_xs, mut args, suffix) = kernel_inputs(x, act)?;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(4 * per_warp) as u32, n.div_ceil(tokens) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    for m in 0..3 {
        let p = ws.get(m).map(|w| w.device_ptr()).transpose()?;
        args.push(Arg::Ptr(p.map_or(0, |p| p as u64)));
    }
    for m in 0..3 {
        args.push(addr_or_null(ys.get(m))?);
    }
    args.extend(i32s(&[rows[0], rows[1], rows[2], k, n]));
    let name = match tokens {
        1 => format!("{prefix}{suffix}_r{per_warp}"),
        t => format!("{prefix}{suffix}_r{per_warp}t{t}"),
    };
    // SAFETY: arguments in the order of `mv_q4k_r*` / `mv_q4k_q8_r*` / `mv_q4_1_q8_r*` /
    // `mv_q8_0_q8_r*`; each w_m is [R_m, K] of the kernel's format (absent ones have 0 rows and
    // are never read), x [n, K] f32 16-byte aligned (or its q8 rounding: q [n, K] bytes from a
    // fresh allocation, d [n, K / 32]), y_m [n, R_m].
    unsafe { launch(dev, &name, cfg, &args) }?;
    Ok(ys)
}

/// Tokens per warp of a [`matvec_quant_many`] launch over `n` rows of `x`: one for a decode step,
/// four for a short pass (each super-block's weights loaded once for four tokens). A
/// measurement override: `STRATA_GPU_MV_TOKENS=1|4`. A token's result does not depend on it.
fn mv_tokens(n: usize) -> usize {
    static TOKENS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = TOKENS.get_or_init(|| {
        std::env::var("STRATA_GPU_MV_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|t| [1, 4].contains(t))
    });
    if n <= 1 {
        return 1;
    }
    forced.unwrap_or(4)
}

/// Weight rows per warp of a [`matvec_quant_many`] launch of `total` rows and `tokens` tokens per
/// warp (`mv_q4k_r1|2|4`, `mv_q4k_r1|2|4t4`): more rows per warp read each input once for more
/// rows (the kernel is bound by those L1 reads, ncu), as long as the launch keeps ~2 blocks of 128
/// threads per SM of an H100 (132 SMs); with several tokens per warp, one row (the warp's work
/// is already four rows' worth, and more warps hide more latency). A measurement override:
/// `STRATA_GPU_MV_ROWS=1|2|4`. A row's result does not depend on the choice.
fn mv_rows(total: usize, tokens: usize) -> usize {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced = ROWS.get_or_init(|| {
        std::env::var("STRATA_GPU_MV_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|r| [1, 2, 4].contains(r))
    });
    forced.unwrap_or(match total {
        _ if tokens > 1 => 1,
        t if t >= 4 * 4 * 264 => 4,
        t if t >= 2 * 4 * 264 => 2,
        _ => 1,
    })
}

/// `x: [n, K]` times an f32 matrix `w: [R, K]` → `[n, R]` (`mv_f32`: a block of 128 threads per
/// row and token, 16-byte loads; a MoE router's logits or a shared expert's gate in a decode step,
/// one launch instead of cuBLAS's two). Summation order differs from cuBLAS (f32 rounding); each
/// output is independent of `n`. `STRATA_GPU_MV_F32=warp` launches the kernel before it (a warp per
/// row: one block for a one-row gate), a measurement switch.
///
/// Errors: not f32, `K` not a multiple of 4, shapes that disagree, not on one CUDA device.
pub fn matvec_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check_f32(x, "x")?;
    check_f32(w, "w")?;
    let (n, k) = x.dims2()?;
    let (r, wk) = w.dims2()?;
    if wk != k || !k.is_multiple_of(4) || n > 65535 {
        bail!("matvec_f32: x {:?}, w {:?}", x.dims(), w.dims());
    }
    let dev = cuda_device(x)?;
    let y = alloc::<f32>(dev, (n, r))?;
    if n == 0 || r == 0 {
        return Ok(y);
    }
    let (x, w) = (aligned16(x)?, aligned16(&w.contiguous()?)?);
    static WARP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let warp = *WARP.get_or_init(|| std::env::var("STRATA_GPU_MV_F32").is_ok_and(|v| v == "warp"));
    let (name, blocks) = if warp { ("mv_f32_warp", r.div_ceil(4)) } else { ("mv_f32", r) };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, n as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(addr(&x)?),
        Arg::Ptr(addr(&w)?),
        Arg::Ptr(addr(&y)?),
        Arg::I32(r as i32),
        Arg::I32(k as i32),
    ];
    // SAFETY: arguments in `mv_f32`'s order (`mv_f32_warp` takes the same); x [n, K], w [R, K]
    // f32 16-byte aligned, K % 4 == 0; the grid covers R rows as each kernel expects.
    unsafe { launch(dev, name, cfg, &args) }?;
    Ok(y)
}

/// Outputs per row up to which [`matmul_f32_rows`] is meant to serve (routers and gates: its
/// tiles are plain shared-memory FMA tiles, far below cuBLAS on a large matrix).
pub const MATMUL_F32_ROWS_MAX_OUT: usize = 1024;

/// Values of `K` a chunk of [`matmul_f32_rows`] sums (its chunks depend on `K` alone).
const F32_ROWS_CHUNK: usize = 128;

/// `x: [n, K]` times an f32 matrix `w: [R, K]` → `[n, R]` for many rows (a MoE router's logits
/// in a prompt pass): `gemm_f32_rows_part` sums each output over fixed chunks of
/// [`F32_ROWS_CHUNK`] values of K (tiles of 32 × 32 in shared memory, one `fmaf` per k in
/// order), `gemm_f32_rows_sum` adds the chunks in order — so a row's result does not depend on
/// `n` or on the rows beside it, as cuBLAS's (its kernel and split-K chosen by the shape) did not
/// guarantee: a prompt's router logits changed with the other prompts of its pass. f32
/// rounding differs from [`matvec_f32`]'s (decode steps).
///
/// Errors: not f32, shapes that disagree, not on one CUDA device.
pub fn matmul_f32_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check_f32(x, "x")?;
    check_f32(w, "w")?;
    let (n, k) = x.dims2()?;
    let (r, wk) = w.dims2()?;
    if wk != k || n.div_ceil(32) > 65535 {
        bail!("matmul_f32_rows: x {:?}, w {:?}", x.dims(), w.dims());
    }
    let dev = cuda_device(x)?;
    let y = alloc::<f32>(dev, (n, r))?;
    if n == 0 || r == 0 {
        return Ok(y);
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let splits = k.div_ceil(F32_ROWS_CHUNK).max(1);
    let part = alloc::<f32>(dev, (splits, n, r))?;
    let cfg = LaunchConfig {
        grid_dim: (r.div_ceil(32) as u32, n.div_ceil(32) as u32, splits as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = vec![Arg::Ptr(addr(&x)?), Arg::Ptr(addr(&w)?), Arg::Ptr(addr(&part)?)];
    args.extend(i32s(&[n, r, k, F32_ROWS_CHUNK]));
    // SAFETY: arguments in `gemm_f32_rows_part`'s order; x [n, K], w [R, K] contiguous f32,
    // part [splits, n, R] with splits · chunk ≥ K; the kernel bounds every access by n, R, K.
    unsafe { launch(dev, "gemm_f32_rows_part", cfg, &args) }?;
    let total = n * r;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(addr(&part)?),
        Arg::Ptr(addr(&y)?),
        Arg::I32(total as i32),
        Arg::I32(splits as i32),
    ];
    // SAFETY: arguments in `gemm_f32_rows_sum`'s order; part holds splits · total values, y total.
    unsafe { launch(dev, "gemm_f32_rows_sum", cfg, &args) }?;
    Ok(y)
}

/// A shared expert's gated sum: `routed[t] + shared[t] · σ(x[t] · gate)` → `[n, H]`, with
/// `x, shared, routed: [n, H]`, `gate: [1, H]` (qwen2_moe's and Qwen3.5's `shared_expert_gate`),
/// f32, `H` a multiple of 4 — one launch (`shared_gate_add`) with the same bits as
/// [`matvec_f32`], candle's sigmoid, mul and add.
///
/// Errors: not f32, shapes that disagree, `H` not a multiple of 4, not on one CUDA device.
pub fn shared_gate_add(
    routed: &Tensor,
    shared: &Tensor,
    x: &Tensor,
    gate: &Tensor,
) -> Result<Tensor> {
    for (t, what) in [(routed, "routed"), (shared, "shared"), (x, "x"), (gate, "gate")] {
        check_f32(t, what)?;
    }
    let (n, h) = routed.dims2()?;
    if shared.dims() != [n, h]
        || x.dims() != [n, h]
        || gate.dims() != [1, h]
        || !h.is_multiple_of(4)
        || n > i32::MAX as usize
    {
        bail!(
            "shared_gate_add: routed {:?}, shared {:?}, x {:?}, gate {:?}",
            routed.dims(),
            shared.dims(),
            x.dims(),
            gate.dims()
        );
    }
    let dev = cuda_device(routed)?;
    let y = alloc::<f32>(dev, (n, h))?;
    if n == 0 {
        return Ok(y);
    }
    let (x, gate) = (aligned16(&x.contiguous()?)?, aligned16(&gate.contiguous()?)?);
    let (shared, routed) = (shared.contiguous()?, routed.contiguous()?);
    let cfg =
        LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let args = [
        Arg::Ptr(addr(&x)?),
        Arg::Ptr(addr(&gate)?),
        Arg::Ptr(addr(&shared)?),
        Arg::Ptr(addr(&routed)?),
        Arg::Ptr(addr(&y)?),
        Arg::I32(h as i32),
    ];
    // SAFETY: arguments in `shared_gate_add`'s order; x, shared, routed, y [n, H], gate [1, H]
    // f32 on this device, x and gate 16-byte aligned, H % 4 == 0 (checked above).
    unsafe { launch(dev, "shared_gate_add", cfg, &args) }?;
    Ok(y)
}

/// The residual add and the next RMSNorm in one launch (`add_rms_norm`): `a, b: [n, H]` f32,
/// `w: [H]` → `(a + b, rms_norm(a + b) · w)` with `rms_norm(s) = s / sqrt(mean(s²) + eps)`
/// (Zhang & Sennrich 2019), as candle's add then `rms_norm` up to summation order. Where
/// [`q8_beside`] says so, the normed output's q8 rounding is written in the same pass and kept
/// as its twin (the q/k/v or MoE input of a decode step: no `quantize_q8` launch for it).
///
/// Errors: not f32, shapes that disagree, not on one CUDA device.
pub fn add_rms_norm(a: &Tensor, b: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    for (t, what) in [(a, "a"), (b, "b"), (w, "norm weight")] {
        check_f32(t, what)?;
    }
    let (n, h) = a.dims2()?;
    if b.dims() != [n, h] || w.dims() != [h] {
        bail!("add_rms_norm: a {:?}, b {:?}, w {:?}", a.dims(), b.dims(), w.dims());
    }
    let dev = cuda_device(a)?;
    let sum = alloc::<f32>(dev, (n, h))?;
    let out = alloc::<f32>(dev, (n, h))?;
    if n == 0 || h == 0 {
        return Ok((sum, out));
    }
    let (a, b, w) = (a.contiguous()?, b.contiguous()?, w.contiguous()?);
    let q8 = Q8Outputs::new(dev, n, h)?;
    let (oq, od) = q8.addrs()?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (add_norm_threads(n), 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(addr(&a)?),
        Arg::Ptr(addr(&b)?),
        Arg::Ptr(addr(&w)?),
        Arg::Ptr(addr(&sum)?),
        Arg::Ptr(addr(&out)?),
        Arg::Ptr(oq),
        Arg::Ptr(od),
        Arg::I32(h as i32),
        Arg::F32(eps),
    ];
    // SAFETY: arguments in `add_rms_norm`'s order; a, b, sum, out [n, H], w [H], f32 contiguous;
    // the q8 outputs (when given, H % 32 == 0 by `q8_beside`) [n, H] bytes and [n, H / 32] f32.
    unsafe { launch(dev, "add_rms_norm", cfg, &args) }?;
    q8.keep_for(&out);
    Ok((sum, out))
}

/// Threads of an `add_rms_norm` block (one block per row) for a pass of `rows` rows: 1024 for
/// passes of up to [`MOE_ROWS_MAX`] rows (decode steps, verify passes, batches), so that a row is
/// spread over a whole block — at 256, the two passes over 2,048–3,072 values took 7.6–10.7 µs
/// under ncu against llama.cpp's 4.4–5.0 µs norms, and 1024 decoded the synthetic 30B 8–11%
/// faster (tg128, H100, docs/performance.md); 256 for prompt passes, where 1024-thread blocks
/// measured 9–14% slower (pp512). Every pass of a given row count takes the same block, so rows
/// of a batch or a verify pass equal a decode step's bit for bit. A measurement override for
/// every pass: `STRATA_GPU_NORM_THREADS=n` (a multiple of 32, 32–1024).
fn add_norm_threads(rows: usize) -> u32 {
    static THREADS: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let forced = *THREADS.get_or_init(|| {
        std::env::var("STRATA_GPU_NORM_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&t: &u32| (32..=1024).contains(&t) && t % 32 == 0)
    });
    forced.unwrap_or(if rows <= MOE_ROWS_MAX { 1024 } else { 256 })
}

/// Tokens a pass may have for [`moe_q4k`] (decode and speculative verification; longer passes
/// read every expert once per token, so prefill keeps candle's kernels).
pub const MOE_ROWS_MAX: usize = 16;

/// The routed-expert part of a MoE block for `n` tokens over Q4_K experts, in two launches:
/// `x: [n, H]` f32, `gate`, `up: [E, I, H]` and `down: [E, H, I]` Q4_K (GGUF's `ffn_*_exps`),
/// `ids: [n, k]` u32 rows of those tensors, `weights: [n, k]` f32, optional `residual: [n, H]` →
/// `[n, H]` = `residual + Σⱼ weights[t, j] · down(silu(gate · x) ⊙ (up · x))` of expert
/// `ids[t, j]`. Each token's result is what it would be alone (bit for bit, tested): a verify
/// pass's rows equal decode steps. Quants are read in 16-byte loads, ggml's
/// `dequantize_row_q4_K` values applied as `d·scale·Σ q·x − dmin·min·Σ x` per 16 weights; the
/// inputs are taken as [`activations`] says (by default rounded to 8 bits, as candle's
/// `indexed_moe_forward` and llama.cpp round them to Q8_1; [`Activations::F32`]: the f32
/// reference's result up to summation order).
///
/// Errors: a format other than Q4_K, `H` or `I` not a multiple of 256, shapes that disagree,
/// `n` above [`MOE_ROWS_MAX`].
#[allow(clippy::too_many_arguments)]
pub fn moe_q4k(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    ids: &Tensor,
    weights: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    moe_q4k_as(x, gate, up, down, ids, weights, residual, activations(), None)
}

/// The kernels' weight arguments for projections `k` of `w`: the tensors' addresses, or with a
/// table its parts (and `indirect` 1).
fn moe_weight_args(w: [&QTensor; 3], table: Option<ExpertTable>) -> Result<([u64; 3], i32)> {
    Ok(match table {
        Some(t) => ([t.part(0), t.part(1), t.part(2)], 1),
        None => {
            ([w[0].device_ptr()? as u64, w[1].device_ptr()? as u64, w[2].device_ptr()? as u64], 0)
        }
    })
}

/// [`moe_q4k`] with the inputs of gate/up (x) and of down (the SiLU·up activations) taken as
/// `act` says ([`Activations::Q8`]: each rounded to 8 bits per 32 values first, two more launches,
/// integer dot products — llama.cpp's MMVQ arithmetic for its MoE mat-vecs). With `table`, the
/// experts' weights are read at the addresses it holds (ids below `table.experts`) instead of
/// rows of the tensors, which then give only the shapes.
#[allow(clippy::too_many_arguments)]
pub fn moe_q4k_as(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    ids: &Tensor,
    weights: &Tensor,
    residual: Option<&Tensor>,
    act: Activations,
    table: Option<ExpertTable>,
) -> Result<Tensor> {
    let MoeDims { n, h, i, k, .. } = check_moe(x, [gate, up, down], ids, weights, MOE_ROWS_MAX)?;
    if residual.is_some_and(|r| r.dims() != [n, h]) {
        bail!("moe_q4k: residual {:?} for x {:?}", residual.map(|r| r.dims()), x.dims());
    }
    let dev = cuda_device(x)?;
    let a = alloc::<f32>(dev, (n, k, i))?;
    let out = alloc::<f32>(dev, (n, h))?;
    if n == 0 || k == 0 {
        return out.zeros_like();
    }
    // The inputs of gate/up: x itself (f32) or its q8 rounding (two tensors).
    let (_xs, mut args, suffix) = kernel_inputs(x, act)?;
    // Many tokens: the pairs (tokens, for down) on the grid's x, so those routed to one expert
    // read its rows next to each other, from L2 (`moe_block` in moe_q4k.cuh).
    let pairs_first = n >= MOE_PAIRS_FIRST_ROWS_MIN && moe_pairs_first();
    // Rows per warp of gate/up (1, or 4: the q8 kernel's `_r4`): the same values, fewer and
    // longer warps; down always takes one output per warp.
    let r = if act == Activations::Q8 { moe_gate_up_rows_per_warp(n) } else { 1 };
    let rs = if r == 4 { "_r4" } else { "" };
    let grid = |rows: usize, pairs: usize, r: usize| match pairs_first {
        true => (pairs as u32, rows.div_ceil(4 * r) as u32, 1),
        false => (rows.div_ceil(4 * r) as u32, pairs as u32, 1),
    };
    let cfg =
        LaunchConfig { grid_dim: grid(i, n * k, r), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let ([gp, upp, dp], indirect) = moe_weight_args([gate, up, down], table)?;
    args.extend([Arg::Ptr(gp), Arg::Ptr(upp), Arg::Ptr(addr(ids)?), Arg::Ptr(addr(&a)?)]);
    args.extend(i32s(&[h, i, k]));
    args.extend([Arg::I32(indirect), Arg::I32(pairs_first as i32)]);
    // SAFETY: arguments in `moe_gate_up_q4k`'s order; the ids index rows of [E, I, H] tensors
    // (the caller's routing: ids < E), shapes checked above.
    unsafe { launch(dev, &format!("moe_gate_up_q4k{suffix}{rs}"), cfg, &args) }?;
    // The inputs of down: a (f32) or its q8 rounding, rows of I values per (token, slot).
    let (_a_in, mut args, _) = kernel_inputs(&a.reshape((n * k, i))?, act)?;
    let cfg = LaunchConfig { grid_dim: grid(h, n, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    args.extend([
        Arg::Ptr(dp),
        Arg::Ptr(addr(ids)?),
        Arg::Ptr(addr(weights)?),
        addr_or_null(residual)?,
        Arg::Ptr(addr(&out)?),
    ]);
    args.extend(i32s(&[h, i, k]));
    args.extend([Arg::I32(indirect), Arg::I32(pairs_first as i32)]);
    // SAFETY: arguments in `moe_down_q4k`'s (`_q8`'s) order; shapes checked above (a table holds
    // the addresses of every expert's [I, H] / [H, I] matrices: its owner's contract).
    unsafe { launch(dev, &format!("moe_down_q4k{suffix}"), cfg, &args) }?;
    Ok(out)
}

/// `scores: [R, total]` f32 attention logits (contiguous) → `softmax(scale · scores)` per row
/// under the causal mask, in place: row `r` is query `i = r % seq` of a pass of `seq` rows after
/// `past` cached positions and sees keys `0..=past + i` (the rest become 0) — the rows of
/// `[heads, seq, total]` scores. One launch instead of candle's scale, broadcast mask add and
/// softmax (and no mask tensor). Returns `scores`.
///
/// Errors: not f32 `[R, total]` contiguous on a CUDA device, `seq` 0, `total` below `past + seq`.
pub fn causal_softmax(scores: Tensor, seq: usize, past: usize, scale: f32) -> Result<Tensor> {
    check_f32(&scores, "scores")?;
    let (r, total) = scores.dims2()?;
    if seq == 0 || total < past + seq || !r.is_multiple_of(seq) {
        bail!("causal_softmax: scores {:?} for {seq} rows after {past}", scores.dims());
    }
    let dev = cuda_device(&scores)?;
    let cfg =
        LaunchConfig { grid_dim: (r as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let args = [
        Arg::Ptr(addr(&scores)?),
        Arg::I32(total as i32),
        Arg::I32(seq as i32),
        Arg::I32(past as i32),
        Arg::F32(scale),
    ];
    // SAFETY: arguments in `causal_softmax`'s order; scores hold R rows of `total` values.
    unsafe { launch(dev, "causal_softmax", cfg, &args) }?;
    Ok(scores)
}

/// Rows (tokens) from which prompt passes take the tensor-core kernels ([`moe_q4k_tc`],
/// [`matmul_q4k_tc`]); shorter passes keep the decode kernels.
pub const TC_ROWS_MIN: usize = 16;

/// Pairs a tensor-core tile takes (`TC_TM` in moe_tc.cuh).
const TC_TM: usize = 64;
/// Weight rows a tensor-core block takes (`TC_TN`; half of them from each matrix with SwiGLU).
const TC_TN: usize = 128;
/// Threads of a tensor-core block (`TC_THREADS`).
const TC_THREADS: u32 = 256;

/// The routed-expert part of a MoE block over Q4_K experts for a prompt pass, on tensor cores:
/// shapes as [`moe_q4k`] (`x: [n, H]`, `gate`, `up: [E, I, H]`, `down: [E, H, I]`, `ids`,
/// `weights: [n, k]`) → `[n, H]`. The (token, slot) pairs are sorted by expert on the device
/// (`moe_tc_sort`, no host round trip); `x` is rounded to f16 once; one launch of `q4k_mm_tc`
/// computes `silu(gate · x) ⊙ (up · x)` (f16) over tiles of up to 64 pairs of one expert × 64
/// rows of each matrix, one more the down projection (f32), then [`moe_combine`]. Weights are
/// dequantized to f16 in the kernel (ggml's `dequantize_row_q4_K` values, rounded), products
/// accumulate in f32 (WMMA). A pair's result does not depend on the other pairs of the pass.
///
/// `ids` must be below `E` (as a router's are): a pair with another id is never computed and
/// its output row is undefined.
///
/// Errors: as [`moe_q4k`] (any `n`), `E` up to [`MOE_GROUPED_MAX_EXPERTS`].
pub fn moe_q4k_tc(
    x: &Tensor,
    gate: &QTensor,
    up: &QTensor,
    down: &QTensor,
    ids: &Tensor,
    weights: &Tensor,
    table: Option<ExpertTable>,
) -> Result<Tensor> {
    let shape = GroupedShape { max_rows: usize::MAX, tile: TC_TM, name: "moe_q4k_tc" };
    let (MoeDims { n, h, i, k, .. }, dev, sorted) =
        match grouped_start(x, [gate, up, down], ids, weights, table, shape)? {
            Ok(started) => started,
            Err(empty) => return Ok(empty),
        };
    let pairs = n * k;
    let xh = f16_of(dev, x)?;
    let a = alloc::<half::f16>(dev, (pairs, i))?;
    let at = |p: usize| table.map(|t| t.part(p));
    let glu = TcLaunch {
        src: &xh,
        w: gate,
        w2: Some(up),
        sorted: Some(&sorted),
        pairs,
        k,
        table: at(0).zip(at(1)),
    };
    mm_tc(dev, glu, &a)?;
    let y = alloc::<f32>(dev, (pairs, h))?;
    let down_at = at(2).map(|d| (d, 0));
    let proj =
        TcLaunch { src: &a, w: down, w2: None, sorted: Some(&sorted), pairs, k: 1, table: down_at };
    mm_tc(dev, proj, &y)?;
    moe_combine(&y.reshape((n, k, h))?, &weights.contiguous()?)
}

/// `x: [n, K]` f32 times a Q4_K matrix `w: [R, K]` → `[n, R]` (`y = x · wᵀ`) on tensor cores, for
/// prompt passes: `x` rounded to f16, then `q4k_mm_tc` with every row a pair of one expert
/// (weights dequantized to f16, f32 accumulation; a row's result does not depend on the other
/// rows).
///
/// Errors: `w` not Q4_K `[R, K]` with `K` a multiple of 256, `x` not f32 `[n, K]` on the same
/// device.
pub fn matmul_q4k_tc(x: &Tensor, w: &QTensor) -> Result<Tensor> {
    let (n, r, _) = check_dense_q4k(x, w, "matmul_q4k_tc")?;
    let dev = cuda_device(x)?;
    let out = alloc::<f32>(dev, (n, r))?;
    if n == 0 || r == 0 {
        return Ok(out);
    }
    let xh = f16_of(dev, x)?;
    mm_tc(
        dev,
        TcLaunch { src: &xh, w, w2: None, sorted: None, pairs: n, k: 1, table: None },
        &out,
    )?;
    Ok(out)
}

/// Checks a dense product `x: [n, K]` f32 times a Q4_K `w: [R, K]` (`K` a multiple of 256) for
/// `name`'s errors → `(n, R, K)`.
fn check_dense_q4k(x: &Tensor, w: &QTensor, name: &str) -> Result<(usize, usize, usize)> {
    check_f32(x, "x")?;
    let (n, kx) = x.dims2()?;
    let (r, k) = w.shape().dims2()?;
    if w.dtype() != GgmlDType::Q4K || k != kx || !k.is_multiple_of(256) {
        bail!("{name}: x {:?}, w {:?} {:?}", x.dims(), w.dtype(), w.shape().dims());
    }
    Ok((n, r, k))
}

/// `x` (f32, contiguous) rounded to f16 by our `to_f16` kernel (a fresh, aligned buffer).
fn f16_of(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    let n = x.elem_count();
    let y = alloc::<half::f16>(dev, x.shape().clone())?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [Arg::Ptr(addr(&x)?), Arg::Ptr(addr(&y)?), Arg::I32(n as i32)];
    // SAFETY: `to_f16(x, y, n)`: both hold n elements.
    unsafe { launch(dev, "to_f16", cfg, &args) }?;
    Ok(y)
}

/// A pass's (token, slot) pairs grouped by expert on the device (`moe_tc_sort`): `order`
/// `[pairs]` (pair indices, ascending expert), `tiles` `[3 · max_tiles]` (expert, first position
/// in `order`, count ≤ the tile size) and `ntiles` `[1]` (how many of them are used).
struct SortedPairs {
    order: Tensor,
    tiles: Tensor,
    ntiles: Tensor,
    /// Tiles a launch must cover (a bound: each expert's pairs in ceil(count / tm) tiles).
    max_tiles: usize,
}

/// The limits of a grouped MoE launch ([`grouped_start`]).
struct GroupedShape {
    /// Most tokens the launch takes.
    max_rows: usize,
    /// Pairs per tile of the sort.
    tile: usize,
    /// The caller, for errors.
    name: &'static str,
}

/// The start of a MoE block grouped by expert ([`moe_q4k_tc`], `moe_q4k_mma`): the shapes checked
/// ([`check_moe`], `n` up to `shape.max_rows`, the experts — `table`'s where given — up to
/// [`MOE_GROUPED_MAX_EXPERTS`]) and the pairs sorted into tiles of `shape.tile`; `Err` holds the
/// `[n, H]` zeros of a pass without pairs (nothing to launch).
fn grouped_start<'a>(
    x: &'a Tensor,
    w: [&QTensor; 3],
    ids: &Tensor,
    weights: &Tensor,
    table: Option<ExpertTable>,
    shape: GroupedShape,
) -> Result<std::result::Result<(MoeDims, &'a CudaDevice, SortedPairs), Tensor>> {
    let dims = check_moe(x, w, ids, weights, shape.max_rows)?;
    let e = table.map_or(dims.e, |t| t.experts);
    if e > MOE_GROUPED_MAX_EXPERTS {
        bail!("{}: {e} experts (at most {MOE_GROUPED_MAX_EXPERTS})", shape.name);
    }
    let dev = cuda_device(x)?;
    if dims.n * dims.k == 0 {
        return Ok(Err(alloc::<f32>(dev, (dims.n, dims.h))?.zeros_like()?));
    }
    let sorted = sort_pairs(dev, ids, e, shape.tile)?;
    Ok(Ok((dims, dev, sorted)))
}

/// Sorts `ids: [n, k]` (u32, < `experts` ≤ [`MOE_GROUPED_MAX_EXPERTS`]; others are dropped) into
/// tiles of up to `tm` pairs of one expert: one launch of `moe_tc_sort`, no host round trip.
fn sort_pairs(dev: &CudaDevice, ids: &Tensor, experts: usize, tm: usize) -> Result<SortedPairs> {
    let ids = ids.contiguous()?;
    let pairs = ids.elem_count();
    let max_tiles = pairs.div_ceil(tm) + experts.min(pairs);
    let order = alloc::<u32>(dev, pairs)?;
    let tiles = alloc::<u32>(dev, 3 * max_tiles)?;
    let ntiles = alloc::<u32>(dev, 1)?;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    let args = [
        Arg::Ptr(addr(&ids)?),
        Arg::I32(pairs as i32),
        Arg::I32(experts as i32),
        Arg::I32(tm as i32),
        Arg::Ptr(addr(&order)?),
        Arg::Ptr(addr(&tiles)?),
        Arg::Ptr(addr(&ntiles)?),
    ];
    // SAFETY: arguments in `moe_tc_sort`'s order; ids hold `pairs` u32, order `pairs`, tiles
    // room for every tile (each expert's pairs in ceil(count / tm) tiles ≤ max_tiles).
    unsafe { launch(dev, "moe_tc_sort", cfg, &args) }?;
    Ok(SortedPairs { order, tiles, ntiles, max_tiles })
}

/// One launch of `q4k_mm_tc` (moe_tc.cuh): over `sorted`'s tiles of the Q4_K tensors
/// `w` (and `w2`): `[E, R, K]`, or, `sorted` `None`, a dense product over `w: [R, K]`.
struct TcLaunch<'a> {
    /// f16 rows: one per token (`k` > 1: pair `p` reads row `p / k`) or one per pair (`k` = 1).
    src: &'a Tensor,
    w: &'a QTensor,
    /// SwiGLU's up beside gate `w`: the output is `silu(w · x) ⊙ (w2 · x)` in f16.
    w2: Option<&'a QTensor>,
    sorted: Option<&'a SortedPairs>,
    pairs: usize,
    k: usize,
    /// Table addresses of `w`'s and `w2`'s parts ([`ExpertTable::part`]; 0 without `w2`) in
    /// place of the tensors' (the tensors then give only the shapes).
    table: Option<(u64, u64)>,
}

/// Runs `l` into `out: [pairs, R]` (f32; f16 with `w2`). The caller checks the shapes.
fn mm_tc(dev: &CudaDevice, l: TcLaunch<'_>, out: &Tensor) -> Result<()> {
    let dims = l.w.shape().dims();
    let (r, kk) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let rows_per_block = if l.w2.is_some() { TC_TN / 2 } else { TC_TN };
    let blocks_x = l.sorted.map_or(l.pairs.div_ceil(TC_TM), |s| s.max_tiles);
    let cfg = LaunchConfig {
        grid_dim: (blocks_x as u32, r.div_ceil(rows_per_block) as u32, 1),
        block_dim: (TC_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (f32_out, f16_out) = if l.w2.is_some() { (None, Some(out)) } else { (Some(out), None) };
    let (w, w2) = match l.table {
        Some(t) => t,
        None => (
            l.w.device_ptr()? as u64,
            l.w2.map(|w| w.device_ptr()).transpose()?.map_or(0, |p| p as u64),
        ),
    };
    let mut args = vec![
        Arg::Ptr(addr(l.src)?),
        Arg::Ptr(w),
        Arg::Ptr(w2),
        addr_or_null(l.sorted.map(|s| &s.order))?,
        addr_or_null(l.sorted.map(|s| &s.tiles))?,
        addr_or_null(l.sorted.map(|s| &s.ntiles))?,
        addr_or_null(f32_out)?,
        addr_or_null(f16_out)?,
    ];
    args.extend(i32s(&[l.pairs, r, kk, l.k, (l.k > 1) as usize]));
    args.push(Arg::I32(l.table.is_some() as i32));
    // SAFETY: arguments in `q4k_mm_tc`'s order; the caller checked that `w` (and `w2`) are Q4_K
    // [E, R, K] (or [R, K] without `sorted`), that src holds a K-value f16 row per token (k > 1)
    // or per pair, that out holds [pairs, R], and `sorted` came from `moe_tc_sort` over ids < E.
    unsafe { launch(dev, "q4k_mm_tc", cfg, &args) }?;
    Ok(())
}
