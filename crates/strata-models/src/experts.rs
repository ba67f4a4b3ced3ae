//! The expert provider: the one interface through which MoE blocks read routed experts' weights.
//!
//! Model code asks "expert `e` of layer `l`" and never knows where the bytes come from. The resident
//! provider ([`ResidentExperts`]) holds every expert in memory; the expert-streaming provider (a later
//! crate) fetches experts from disk into a byte-budgeted cache behind the same trait.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use strata_formats::{ExpertDims, ExpertLayout, ExpertTensors, ModelConfig, ModelFiles};

use crate::error::{ModelError, Result};
use crate::layers::Linear;
use crate::mlp::Mlp;

/// One routed expert ready to run: a SwiGLU over `gate`/`up` `[I, H]` and `down` `[H, I]`.
#[derive(Debug, Clone)]
pub struct Expert {
    pub mlp: Mlp,
    /// Bytes of its weights as stored (what reading it from disk costs).
    pub bytes: usize,
}

impl Expert {
    /// Builds an expert from its three tensors (quantized GGUF slices or dense f32).
    pub fn from_tensors(t: ExpertTensors, name: &str) -> Result<Self> {
        let lin = |w| Linear::for_expert(w).map_err(|e| ModelError::tensor(name, e));
        let mlp = Mlp::new(lin(t.gate)?, lin(t.up)?, lin(t.down)?)?;
        Ok(Self { bytes: mlp.weight_bytes(), mlp })
    }

    /// An expert over weights already built (a streamed expert: `bytes` is its stored size).
    pub fn new(mlp: Mlp, bytes: usize) -> Self {
        Self { mlp, bytes }
    }
}

/// A layer's routed experts as three 3-D quantized tensors on a GPU (gate and up `[E, I, H]`, down
/// `[E, H, I]`, as GGUF stores `ffn_*_exps`): all of a batch's selected experts run in one launch
/// per projection (candle's `indexed_moe_forward`, which quantizes activations to Q8_1 like
/// llama.cpp's CUDA MoE kernels) instead of one per expert and projection.
#[derive(Debug)]
pub struct FusedExperts {
    gate: QTensor,
    up: QTensor,
    down: QTensor,
}

impl FusedExperts {
    /// Formats used fused: Q4_K, the one checked on the H100 (docs/performance.md, "CUDA": logits
    /// within 6.9e-3 of the f32 reference, the size of Q8_1 activation rounding). candle's Q8_0
    /// kernel was also tried and moved logits by 39% with half the argmaxes wrong: left out, as are
    /// the K-quants not yet checked (their layers keep one launch per expert).
    pub fn supports(dtype: GgmlDType) -> bool {
        dtype == GgmlDType::Q4K
    }

    /// Over three 3-D tensors: gate and up `[E, I, H]`, down `[E, H, I]`, each in a format
    /// [`Self::supports`] (a VRAM pool whose rows are cache slots, say).
    pub fn new(gate: QTensor, up: QTensor, down: QTensor) -> Self {
        Self { gate, up, down }
    }

    /// `x: [seq, H]`, `ids: [seq, k]` u32 (on the device) → each selected expert's output
    /// `[seq, k, H]` (unweighted).
    pub fn forward(&self, x: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (seq, h) = x.dims2()?;
        // The kernels read their input from the start of its buffer: give them packed tensors.
        let packed = |t: Tensor| {
            if t.is_contiguous() && t.layout().start_offset() == 0 {
                Ok(t)
            } else {
                t.affine(1.0, 0.0)
            }
        };
        let x3 = packed(x.reshape((seq, 1, h))?)?;
        let g = self.gate.indexed_moe_forward(&x3, ids)?;
        let u = self.up.indexed_moe_forward(&x3, ids)?;
        let a = packed(silu_mul(&g, &u)?)?;
        self.down.indexed_moe_forward(&a, ids)
    }

    /// `x: [seq, H]`, `ids: [seq, k]`, `weights: [seq, k]` (on the device) → the weighted sum of
    /// the selected experts' outputs `[seq, H]` by our Q4_K kernels on a GPU: batched steps and
    /// verify passes of 8–16 tokens on int8 tensor cores (`strata_kernels::cuda::moe_q4k_mma`,
    /// `crate::gpu::moe_mma_rows`); passes of more than `MOE_ROWS_MAX` tokens (prompts, large
    /// batches) on f16 tensor cores, grouped by expert
    /// (`strata_kernels::cuda::moe_q4k_tc`: f16 inputs, f32 sums; `STRATA_GPU_MOE_TC=0` turns it
    /// off); of the rest (f32 activations), with `STRATA_GPU_MOE_GROUPED=1`, passes of 2 to `MOE_GROUPED_ROWS_MAX` tokens (batched
    /// decode, verify) grouped by expert (`strata_kernels::cuda::moe_q4k_grouped`: each selected
    /// expert's weights read once for all of its tokens); passes of up to `MOE_ROWS_MAX` tokens
    /// (decode, verify) by `strata_kernels::cuda::moe_q4k` (two launches, f32 activations) unless
    /// `STRATA_GPU_MOE=0`. `None`: another device, format or
    /// length, or the kernels turned off (then [`Self::forward`] and a weighted sum).
    ///
    /// With `table` (the GPU expert tier's mapped experts, [`FusedCall::table`]) `ids` are expert
    /// ids whose weights the table addresses: `moe_q4k_mma` for the passes it takes, else up to
    /// `MOE_ROWS_MAX` tokens by `moe_q4k`, longer passes on tensor cores, whatever the other
    /// switches say (the tensors hold no expert by id).
    #[cfg(feature = "cuda")]
    pub fn forward_combined(
        &self,
        x: &Tensor,
        ids: &Tensor,
        weights: &Tensor,
        table: Option<strata_kernels::ExpertTable>,
    ) -> Option<candle_core::Result<Tensor>> {
        use crate::gpu::{enabled, GpuPath};
        use strata_kernels::cuda::{self as k, MOE_GROUPED_MAX_EXPERTS, MOE_GROUPED_ROWS_MAX};
        let seq = x.dim(0).ok()?;
        let (g, u, d) = (&self.gate, &self.up, &self.down);
        if let Some(t) = table {
            let x = match x.contiguous() {
                Ok(x) => x,
                Err(e) => return Some(Err(e)),
            };
            return Some(
                if crate::gpu::moe_mma_rows(seq) && t.experts <= MOE_GROUPED_MAX_EXPERTS {
                    k::moe_q4k_mma(&x, g, u, d, ids, weights, Some(t))
                } else if seq <= k::MOE_ROWS_MAX {
                    k::moe_q4k_as(&x, g, u, d, ids, weights, None, k::activations(), Some(t))
                } else {
                    k::moe_q4k_tc(&x, g, u, d, ids, weights, Some(t))
                },
            );
        }
        if !x.device().is_cuda() || self.gate.dtype() != GgmlDType::Q4K {
            return None;
        }
        let (experts, inter, hidden) = self.gate.shape().dims3().ok()?;
        // Batched steps and verify passes of 8–16 tokens on int8 tensor cores, each selected
        // expert read once for all of its tokens (`gpu::moe_mma_rows`).
        if crate::gpu::moe_mma_rows(seq) && experts <= MOE_GROUPED_MAX_EXPERTS {
            return Some(
                x.contiguous().and_then(|x| k::moe_q4k_mma(&x, g, u, d, ids, weights, None)),
            );
        }
        // Tensor cores past what the decode kernel takes: a batch of 16 rows spreads its 128
        // pairs over ~70 experts, too few per expert for 64-pair tiles (16 sequences of the
        // 30B: 508 tok/s on tensor cores, 584 on `moe_q4k`).
        let tc_rows = seq >= k::TC_ROWS_MIN && (seq > k::MOE_ROWS_MAX || !enabled(GpuPath::Moe));
        if tc_rows && experts <= MOE_GROUPED_MAX_EXPERTS && enabled(GpuPath::MoeTc) {
            return Some(
                x.contiguous().and_then(|x| k::moe_q4k_tc(&x, g, u, d, ids, weights, None)),
            );
        }
        if (2..=MOE_GROUPED_ROWS_MAX).contains(&seq)
            && experts <= MOE_GROUPED_MAX_EXPERTS
            && k::moe_grouped_supports(hidden, inter)
            && enabled(GpuPath::MoeGrouped)
        {
            return Some(
                x.contiguous().and_then(|x| k::moe_q4k_grouped(&x, g, u, d, ids, weights)),
            );
        }
        if seq > k::MOE_ROWS_MAX || !enabled(GpuPath::Moe) {
            return None;
        }
        Some(x.contiguous().and_then(|x| k::moe_q4k(&x, g, u, d, ids, weights, None)))
    }

    /// Bytes of the three tensors as stored.
    pub fn bytes(&self) -> usize {
        [&self.gate, &self.up, &self.down].iter().map(|t| t.storage_size_in_bytes()).sum()
    }
}

/// SwiGLU's `silu(g) ⊙ u` for `g`, `u: [rows, inter]`: one launch of our kernel for f32 tensors
/// on a GPU (`cuda` build); for f32 on the CPU one pass over the barrier pool
/// ([`strata_kernels::f32::silu_mul`]: candle's arithmetic, the same bits, without its rayon
/// wake-ups); candle's two ops otherwise.
pub(crate) fn silu_mul(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if g.device().is_cuda() && g.dtype() == candle_core::DType::F32 {
        return strata_kernels::cuda::silu_mul(g, u);
    }
    if g.device().is_cpu() && g.dtype() == candle_core::DType::F32 {
        let (gv, uv) = (g.flatten_all()?.to_vec1::<f32>()?, u.flatten_all()?.to_vec1::<f32>()?);
        let mut out = vec![0f32; gv.len()];
        strata_kernels::f32::silu_mul(&gv, &uv, &mut out);
        return Tensor::from_vec(out, g.shape(), g.device());
    }
    candle_nn::ops::silu(g)? * u
}

/// Experts for one fused launch: the 3-D tensors, and which of their rows holds each routed expert.
pub struct FusedCall<'a> {
    pub experts: &'a FusedExperts,
    /// `rows[i]` is the row holding the `i`-th routed expert; `None`: the expert ids themselves.
    pub rows: Option<Vec<u32>>,
    /// The GPU expert tier's mapped experts: the kernels read each expert (by id; `rows` is
    /// `None`) at the address this layer's table holds, in VRAM or in page-locked host memory;
    /// `experts` then gives only the shapes.
    pub table: Option<strata_kernels::ExpertTable>,
}

/// Source of routed experts' weights for the MoE blocks.
///
/// Implementations must be cheap to call for resident experts (an `Arc` clone): MoE blocks call
/// [`ExpertProvider::expert`] once per selected expert per forward pass.
pub trait ExpertProvider: Send + Sync + std::fmt::Debug {
    /// Expert `expert` of layer `layer` (a layer with an MoE block).
    ///
    /// Errors: a streaming provider's read failed (I/O, truncated file).
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<Expert>>;

    /// Whether [`Self::expert`] would return at once (the expert is in memory, or its read has
    /// finished), without counting a use. MoE blocks compute the ready experts while the others are
    /// read. The default (resident experts): always.
    fn ready(&self, _layer: usize, _expert: usize) -> bool {
        true
    }

    /// Routing for `layer` is known: `experts` (ids, possibly repeated) will be asked for next. A
    /// streaming provider may start reading them all concurrently. The default does nothing.
    fn fetch_routed(&self, _layer: usize, _experts: &[u32]) {}

    /// A prediction: `experts` (distinct, most likely first) may be asked for when `layer` routes.
    /// A streaming provider starts reads for those it has room for without evicting the experts
    /// of the current routing or of `layer`. The default does nothing.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Experts one [`Self::prefetch`] may name at most (0: prefetch is pointless, as for resident
    /// experts).
    fn prefetch_limit(&self) -> usize {
        0
    }

    /// Layer `layer`'s routed experts `ids` (the routing's expert ids, `[tokens × top-k]`) for one
    /// launch per projection, when the provider holds them as [`FusedExperts`] (resident quantized
    /// GGUF experts on a GPU, or the GPU expert tier's VRAM pool, which makes them resident first).
    /// `None`: the MoE block runs them one by one through [`Self::expert`].
    ///
    /// Errors: a streaming provider's read or copy failed.
    fn fused(&self, _layer: usize, _ids: &[u32]) -> Option<Result<FusedCall<'_>>> {
        None
    }

    /// Whether [`Self::fused`] ignores its ids (every expert of a fused layer resident, addressed
    /// by expert id): a MoE block may then route on the device and hand the ids to the fused
    /// kernels without the host seeing them. The default: no.
    fn routes_on_device(&self) -> bool {
        false
    }

    /// A pass's routing through fused calls that carried a [`FusedCall::table`] (every layer it
    /// ran, read back from the device once the pass ended; or one layer routed on the host): the
    /// GPU expert tier counts its hits and misses here and moves experts between VRAM and host
    /// memory for the next passes, without ever stalling one. The default does nothing.
    fn observe_routing(&self, _routing: &[crate::moe::LayerRouting]) {}

    /// Cumulative streaming counters (`None` for resident experts).
    fn stats(&self) -> Option<ExpertStats> {
        None
    }

    /// Bytes of memory the provider holds at most (all experts when resident; the expert cache when
    /// streaming).
    fn memory_bytes(&self) -> u64;

    /// Bytes of device memory a GPU expert tier may hold (0: none).
    fn device_cache_bytes(&self) -> u64 {
        0
    }

    /// Whether experts are read with `O_DIRECT` (`None`: nothing is read, experts are resident).
    fn direct_io(&self) -> Option<bool> {
        None
    }
}

/// Cumulative counters of a streaming provider. Subtract two snapshots ([`Self::since`]) for one
/// generation's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertStats {
    /// `expert()` calls for experts that were in the cache when their layer routed (or that a
    /// prefetch had finished reading by the time they were asked for).
    pub hits: u64,
    /// `expert()` calls for experts that were not: read on demand (counted even when the read
    /// finished before the call) or still being read by a prefetch.
    pub misses: u64,
    /// Bytes read from the model files.
    pub bytes_read: u64,
    /// Read requests issued.
    pub reads: u64,
    /// Nanoseconds `expert()` callers spent waiting for reads.
    pub stall_ns: u64,
    /// Nanoseconds during which at least one read was in flight.
    pub io_busy_ns: u64,
    /// Stored bytes of every expert used (hits and misses): what a token touches.
    pub touched_bytes: u64,
    /// Experts whose reads a prefetch started.
    pub prefetch_reads: u64,
    /// Of those, experts a forward pass then asked for (the rest were wasted reads).
    pub prefetch_used: u64,
    /// Predicted experts the cache lacked when predicted (read or, with the prefetch gate closed,
    /// not): what a prefetch could have read.
    pub prefetch_candidates: u64,
    /// Of those, experts the layer then routed to: `prefetch_candidates_used / prefetch_candidates`
    /// is the predictor's precision where it matters.
    pub prefetch_candidates_used: u64,
    /// GPU tier: experts copied from host memory to device memory (misses and prefetches).
    pub uploads: u64,
    /// GPU tier: bytes of those copies.
    pub upload_bytes: u64,
}

impl ExpertStats {
    /// The counters accumulated since `earlier`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            reads: self.reads - earlier.reads,
            stall_ns: self.stall_ns - earlier.stall_ns,
            io_busy_ns: self.io_busy_ns - earlier.io_busy_ns,
            touched_bytes: self.touched_bytes - earlier.touched_bytes,
            prefetch_reads: self.prefetch_reads - earlier.prefetch_reads,
            prefetch_used: self.prefetch_used - earlier.prefetch_used,
            prefetch_candidates: self.prefetch_candidates - earlier.prefetch_candidates,
            prefetch_candidates_used: self.prefetch_candidates_used
                - earlier.prefetch_candidates_used,
            uploads: self.uploads - earlier.uploads,
            upload_bytes: self.upload_bytes - earlier.upload_bytes,
        }
    }

    /// Fraction of expert lookups served from the cache (1.0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            1.0
        } else {
            self.hits as f64 / n as f64
        }
    }

    /// Achieved read bandwidth while reads were in flight, GB/s (10⁹ bytes per second).
    pub fn read_gbps(&self) -> f64 {
        if self.io_busy_ns == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.io_busy_ns as f64
        }
    }
}

/// Every expert of every MoE layer held in memory.
#[derive(Debug, Default)]
pub struct ResidentExperts {
    /// `layers[l]` is empty for dense layers and layers held as `fused`.
    layers: Vec<Vec<Arc<Expert>>>,
    fused: Vec<Option<FusedExperts>>,
}

impl ResidentExperts {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![Vec::new(); num_layers],
            fused: (0..num_layers).map(|_| None).collect(),
        }
    }

    /// From experts already built: `layers[l]` holds layer `l`'s experts (empty for dense layers).
    pub fn from_layers(layers: Vec<Vec<Arc<Expert>>>) -> Self {
        let fused = (0..layers.len()).map(|_| None).collect();
        Self { layers, fused }
    }

    /// Resolves and checks layer `layer`'s expert tensors, then reads all of them.
    pub fn load_layer(
        &mut self,
        files: &ModelFiles,
        cfg: &ModelConfig,
        layer: usize,
        device: &Device,
    ) -> Result<()> {
        let Some(m) = &cfg.moe else { return Ok(()) };
        let dims = ExpertDims {
            num_experts: m.num_experts,
            hidden: cfg.hidden_size,
            intermediate: m.expert_intermediate_size,
        };
        let layout = files.expert_layout(layer, dims)?;
        // On a GPU, GGUF experts in a format candle's fused MoE kernels take are held as the three
        // 3-D tensors (STRATA_FUSED_MOE=0: one tensor per expert, as on the CPU).
        if let (false, ModelFiles::Gguf(g), ExpertLayout::Gguf { gate, up, down }) =
            (device.is_cpu(), files, &layout)
        {
            let all = [gate, up, down]
                .iter()
                .all(|n| g.tensor_info(n).is_ok_and(|t| FusedExperts::supports(t.dtype)));
            if all && !std::env::var("STRATA_FUSED_MOE").is_ok_and(|v| v == "0") {
                let q = |n: &str| g.read_qtensor(n, device);
                self.fused[layer] =
                    Some(FusedExperts { gate: q(gate)?, up: q(up)?, down: q(down)? });
                return Ok(());
            }
        }
        let name = |e: usize| match &layout {
            ExpertLayout::Gguf { gate, .. } => format!("{gate}[{e}]"),
            ExpertLayout::GgufPerExpert { layer } => format!("blk.{layer}.ffn_*.{e}"),
            ExpertLayout::HfPerExpert { prefix, .. } => format!("{prefix}.{e}"),
            ExpertLayout::HfFused { gate_up, .. } => format!("{gate_up}[{e}]"),
        };
        self.layers[layer] = (0..m.num_experts)
            .map(|e| {
                Expert::from_tensors(files.load_expert(&layout, e, device)?, &name(e)).map(Arc::new)
            })
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Total bytes of all experts held.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|e| e.bytes).sum::<usize>()
            + self.fused.iter().flatten().map(FusedExperts::bytes).sum::<usize>()
    }
}

impl ExpertProvider for ResidentExperts {
    fn memory_bytes(&self) -> u64 {
        self.bytes() as u64
    }

    fn fused(&self, layer: usize, _ids: &[u32]) -> Option<Result<FusedCall<'_>>> {
        self.fused
            .get(layer)?
            .as_ref()
            .map(|experts| Ok(FusedCall { experts, rows: None, table: None }))
    }

    fn routes_on_device(&self) -> bool {
        true
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<Expert>> {
        self.layers.get(layer).and_then(|l| l.get(expert)).cloned().ok_or_else(|| {
            ModelError::Candle(candle_core::Error::msg(format!(
                "layer {layer} has no expert {expert}"
            )))
        })
    }
}
