//! Which of the GPU decode paths (our own CUDA kernels, `strata_kernels::cuda`) are on, read once
//! from the environment. On by default in a `cuda` build, each can be turned off for a
//! before/after measurement or to rule it out: `STRATA_GPU_ROUTING=0` (router top-k on the host,
//! one synchronisation per MoE layer), `STRATA_GPU_ATTENTION=0` (decode attention through
//! candle's matmul + softmax), `STRATA_GPU_GRAPHS=0` (decode steps launched op by op instead of
//! replayed from a captured CUDA graph). Off by default: `STRATA_GPU_MOE=1` runs the Q4_K
//! experts of short passes on our f32-activation kernels instead of candle's
//! `indexed_moe_forward` (Q8_1 activations, as llama.cpp's): exact to the f32 reference, but
//! measured slower on the H100 (docs/performance.md, "GPU decode step").

use std::sync::OnceLock;

/// A GPU path that can be turned off.
#[derive(Debug, Clone, Copy)]
pub enum GpuPath {
    /// MoE routing on the device ([`crate::SparseMoe`]): ids and weights never reach the host
    /// during the pass.
    Routing,
    /// RoPE + KV write + split-K attention kernels for passes of at most
    /// [`crate::attention::GPU_ATTEND_ROWS_MAX`] tokens.
    Attention,
    /// Our Q4_K MoE kernels for passes of a few tokens ([`crate::FusedExperts`]); off unless
    /// asked for.
    Moe,
    /// The decode step captured once per context bucket as a CUDA graph and replayed
    /// (`Transformer`'s graph path).
    Graphs,
}

/// Whether `path` is on: its variable is not `0` ([`GpuPath::Moe`]: is `1`).
pub fn enabled(path: GpuPath) -> bool {
    static ROUTING: OnceLock<bool> = OnceLock::new();
    static ATTENTION: OnceLock<bool> = OnceLock::new();
    static GRAPHS: OnceLock<bool> = OnceLock::new();
    static MOE: OnceLock<bool> = OnceLock::new();
    let (cell, var) = match path {
        GpuPath::Routing => (&ROUTING, "STRATA_GPU_ROUTING"),
        GpuPath::Attention => (&ATTENTION, "STRATA_GPU_ATTENTION"),
        GpuPath::Graphs => (&GRAPHS, "STRATA_GPU_GRAPHS"),
        GpuPath::Moe => (&MOE, "STRATA_GPU_MOE"),
    };
    *cell.get_or_init(|| match (path, std::env::var(var)) {
        (GpuPath::Moe, v) => v.is_ok_and(|v| v == "1"),
        (_, v) => !v.is_ok_and(|v| v == "0"),
    })
}
