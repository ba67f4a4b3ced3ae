//! MoE routing kept on the GPU for a whole forward pass (`cuda` build): each MoE layer's router
//! top-k runs as our kernel and feeds the fused experts on the device, so the pass issues its
//! launches without waiting for the host (candle's path copied every layer's router logits to
//! the host to pick the top-k: one synchronisation per MoE layer). The ids and weights also go to
//! one record on the device, read back once when the pass ends, so [`ForwardOutput::routing`]
//! stays what the host path gives.
//!
//! A synthetic model's routing process (`strata synth --routing realistic|uniform`) chooses its
//! experts from the token ids, positions and the sequence's history alone, never from the hidden
//! states: the host runs it for every MoE layer before the pass ([`synthetic_choices`]), one copy
//! takes the choice to the device, and the kernel weighs the chosen experts by the router's
//! scores — so such models route on the device too (and take the graph path), like the trained
//! models they stand in for.
//!
//! [`ForwardOutput::routing`]: super::ForwardOutput

use candle_core::{DType, Tensor};

use super::{FeedForward, Transformer};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::moe::{LayerRouting, SparseMoe};
use crate::synthetic_routing::LayerHistory;
use crate::ExpertProvider;

/// One pass's device routing: the record `[moe_layers · rows · top_k]` and which layer wrote
/// which slot of it.
pub(super) struct DeviceRouting {
    ids: Tensor,
    weights: Tensor,
    rows: usize,
    top_k: usize,
    /// A synthetic model's choice: `[moe_layers · rows · model_top_k]` u32 (layers in order).
    chosen: Option<(Tensor, usize)>,
    /// `(layer, slot)` in the order the layers ran.
    written: Vec<usize>,
}

/// The MoE layers among `0..end` when a pass through them can route on the device: a CUDA
/// model, `STRATA_GPU_ROUTING` not `0`, no prefetcher (it reads each layer's routing on the host)
/// and a provider whose fused experts take expert ids as they are
/// ([`crate::ExpertProvider::routes_on_device`]); `None` otherwise or without MoE layers.
pub(super) fn device_routed_layers(model: &Transformer, end: usize) -> Option<Vec<&SparseMoe>> {
    if !model.device.is_cuda()
        || !crate::gpu::enabled(crate::gpu::GpuPath::Routing)
        || model.prefetcher.is_some()
        || !model.experts.routes_on_device()
    {
        return None;
    }
    let moe: Vec<&SparseMoe> = model.layers[..end]
        .iter()
        .filter_map(|l| match &l.ffn {
            FeedForward::Moe(m) => Some(m),
            FeedForward::Dense(_) => None,
        })
        .collect();
    (!moe.is_empty()).then_some(moe)
}

/// A synthetic model's choice for a pass: for every MoE layer among `0..end` (in order), every
/// sequence's rows (`seqs`: its first position and tokens, in the pass's row order), the
/// `model_top_k` experts its routing process picks — `[moe_layers · rows · model_top_k]`,
/// recorded in each sequence's history as the host path records it. A sequence whose one row's
/// choice was drawn ahead ([`choose_ahead`], while the step before ran) takes it from its history
/// instead of drawing it again; when every sequence's was, `ahead` ([`choose_ahead`]'s output
/// for these caches at these positions, in this order, if the caller kept it) is the choice as
/// it stands. `None` when not every sequence carries a routing history (no synthetic process,
/// or a mixed batch) or the pass cannot route on the device.
pub(super) fn synthetic_choices(
    model: &Transformer,
    caches: &mut [&mut KvCache],
    seqs: &[(usize, &[u32])],
    end: usize,
    ahead: Option<Vec<u32>>,
) -> Option<Vec<u32>> {
    if caches.is_empty() || !caches.iter().all(|c| c.has_routing_history()) {
        return None;
    }
    let layers = device_routed_layers(model, end)?;
    let mut rows = Vec::with_capacity(seqs.len());
    for (c, &(start, tokens)) in caches.iter_mut().zip(seqs) {
        let h = c.routing_history_mut()?;
        let drawn = h.take_ahead(start, tokens.len());
        // A row drawn ahead reads its choice from the history, not the token before it.
        let before = match drawn {
            true => {
                h.record_tokens(start, tokens);
                Vec::new()
            }
            false => h.record_pass(start, tokens),
        };
        rows.push(Rows { start, before, drawn });
    }
    // (`choose` would gather the same ids from the histories.)
    match ahead {
        Some(ids) if end == model.layers.len() && rows.iter().all(|r| r.drawn) => Some(ids),
        _ => choose(&layers, caches, &rows),
    }
}

/// While a decode step runs on the device: a synthetic model's choice for the next step of each
/// sequence in `caches` at its position `next` (the position after this step's rows), drawn now
/// and written into its history there ([`RoutingHistory::set_ahead`]), so that the
/// next step's [`synthetic_choices`] finds it there instead of drawing 768 routes (16 sequences,
/// 48 layers) before its launch — ~0.33 ms of a 16-sequence step's host time on an H200 host
/// (docs/performance.md, thirty-fifth session). A position's choice depends only on the
/// sequence's token and choice at the position before (synthetic_routing.rs), both recorded by
/// this step's choice. Returns the choice (`[moe_layers · sequences · model_top_k]`, what
/// [`synthetic_choices`] returns for the next step when every sequence's choice was drawn
/// here); `None` for other models, or when the model cannot route on the device.
///
/// [`RoutingHistory::set_ahead`]: crate::RoutingHistory::set_ahead
pub(super) fn choose_ahead(
    model: &Transformer,
    caches: &mut [&mut KvCache],
    next: &[usize],
) -> Option<Vec<u32>> {
    if caches.is_empty() || !caches.iter().all(|c| c.has_routing_history()) {
        return None;
    }
    let layers = device_routed_layers(model, model.layers.len())?;
    let mut rows = Vec::with_capacity(caches.len());
    for (c, &next) in caches.iter_mut().zip(next) {
        let h = c.routing_history_mut()?;
        rows.push(Rows { start: next, before: vec![h.token(next - 1)], drawn: false });
    }
    let ids = choose(&layers, caches, &rows)?;
    for (c, r) in caches.iter_mut().zip(&rows) {
        if let Some(h) = c.routing_history_mut() {
            h.set_ahead(r.start);
        }
    }
    Some(ids)
}

/// One sequence's rows in a choice: the first row's position, the token before each row (empty
/// when drawn), and whether the (one) row's choice is in the history already.
struct Rows {
    start: usize,
    before: Vec<Option<u32>>,
    drawn: bool,
}

/// Every MoE layer's choice (`layers`, in order) for every sequence's `rows`, recorded in its
/// history: `[layers · rows · model_top_k]`. `None` when a history lacks a layer.
fn choose(layers: &[&SparseMoe], caches: &mut [&mut KvCache], rows: &[Rows]) -> Option<Vec<u32>> {
    // Each sequence's history split by layer, so that layers can be chosen on different threads.
    let mut split: Vec<Vec<Option<LayerHistory<'_>>>> = caches
        .iter_mut()
        .map(|c| c.routing_history_mut().map(|h| h.layers_mut().into_iter().map(Some).collect()))
        .collect::<Option<_>>()?;
    let mut work: Vec<(&SparseMoe, Vec<LayerHistory<'_>>)> = Vec::with_capacity(layers.len());
    for &moe in layers {
        let hs = split.iter_mut().map(|h| h.get_mut(moe.layer())?.take()).collect::<Option<_>>()?;
        work.push((moe, hs));
    }
    let choose = |(moe, hs): (&SparseMoe, Vec<LayerHistory<'_>>)| -> Option<Vec<u32>> {
        let mut out = Vec::new();
        for (h, r) in hs.into_iter().zip(rows) {
            match r.drawn {
                true => out.extend_from_slice(h.get(r.start)?),
                false => out.extend(moe.router().synthetic_choice_in(r.start, &r.before, h)?),
            }
        }
        Some(out)
    };
    let draws: usize = rows.iter().filter(|r| !r.drawn).map(|r| r.before.len()).sum();
    let per_layer: Vec<Option<Vec<u32>>> = if one_thread() || draws * work.len() <= ONE_THREAD_DRAWS
    {
        work.into_iter().map(choose).collect()
    } else {
        // One task per layer on rayon's pool, joined in layer order (an indexed collect).
        use rayon::prelude::*;
        work.into_par_iter().map(choose).collect()
    };
    Some(per_layer.into_iter().collect::<Option<Vec<_>>>()?.concat())
}

/// Choices of at most this many (row, layer) draws run on the calling thread: a pass of one to
/// four decode rows through a 48-layer model, whose ~0.4 µs draws (synthetic_routing.rs) take
/// less than waking the pool's threads.
const ONE_THREAD_DRAWS: usize = 256;

/// Whether a synthetic model's choice runs on the calling thread alone
/// (`STRATA_ROUTING_THREADS=1`, a measurement override); otherwise, above [`ONE_THREAD_DRAWS`],
/// its layers are tasks on rayon's pool (all of the host's cores). A decode step draws once per
/// MoE layer and row (768 draws for 16 sequences through 48 layers; before the step could launch
/// until graph-replayed steps drew the next step's while they ran, [`choose_ahead`]): with draws
/// of ~4-5 µs, on one thread 3.9 ms of a 13.3 ms step, on the eight scoped threads started per
/// step before 1.2 ms, on rayon's pool (with the popularity kept per position,
/// synthetic_routing.rs) 0.41-0.50 ms; with draws by rejection over running sums, 0.52 ms on one
/// thread and 0.33-0.35 ms on the pool (H200 host, 16 cores; docs/performance.md, thirty-fifth
/// session). The choice is the same bits either way: each layer's draws read and write only that
/// layer's history.
fn one_thread() -> bool {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONE.get_or_init(|| std::env::var("STRATA_ROUTING_THREADS").is_ok_and(|v| v == "1"))
}

impl DeviceRouting {
    /// `Some` when this pass of `rows` rows through layers `0..end` can route on the device
    /// ([`device_routed_layers`]), and every sequence routed by a synthetic model's routing
    /// process comes with its choice (`chosen`: [`synthetic_choices`]' output on the device).
    pub(super) fn for_pass(
        model: &Transformer,
        caches: &[&mut KvCache],
        rows: usize,
        end: usize,
        chosen: Option<Tensor>,
    ) -> Result<Option<Self>> {
        let Some(moe) = device_routed_layers(model, end) else { return Ok(None) };
        if chosen.is_none() && caches.iter().any(|c| c.has_routing_history()) {
            return Ok(None);
        }
        let router = moe[0].router();
        let top_k = router.top_k();
        let n = moe.len() * rows * top_k;
        if let Some(c) = &chosen {
            let need = moe.len() * rows * router.model_top_k();
            if c.elem_count() != need {
                return Err(candle_core::Error::msg(format!(
                    "device routing: {} chosen experts for a pass needing {need}",
                    c.elem_count()
                ))
                .into());
            }
        }
        Ok(Some(Self {
            ids: Tensor::zeros(n, DType::U32, &model.device)?,
            weights: Tensor::zeros(n, DType::F32, &model.device)?,
            rows,
            top_k,
            chosen: chosen.map(|c| (c, router.model_top_k())),
            written: Vec::new(),
        }))
    }

    /// Runs MoE layer `layer` with routing on the device; `None` when that layer's experts are
    /// not fused (the caller routes it on the host).
    pub(super) fn forward(
        &mut self,
        moe: &SparseMoe,
        layer: usize,
        xn: &Tensor,
        model: &Transformer,
    ) -> Option<Result<Tensor>> {
        let slot = self.written.len();
        let record = strata_kernels::cuda::RoutingRecord {
            ids: &self.ids,
            weights: &self.weights,
            offset: slot * self.rows * self.top_k,
        };
        let chosen = self.chosen.as_ref().map(|(ids, k)| strata_kernels::cuda::ChosenExperts {
            ids,
            offset: slot * self.rows * k,
        });
        let out = moe.forward_device_routed(xn, model.experts.as_ref(), Some(record), chosen)?;
        if out.is_ok() {
            self.written.push(layer);
        }
        Some(out)
    }

    /// The routing of every layer that ran here, read back from the device (one copy of ids and
    /// one of weights for the whole pass; after a graph replay, that replay's routing), also
    /// handed to `experts` ([`crate::ExpertProvider::observe_routing`]).
    pub(super) fn read(&self, experts: &dyn ExpertProvider) -> Result<Vec<LayerRouting>> {
        if self.written.is_empty() {
            return Ok(Vec::new());
        }
        let per = self.rows * self.top_k;
        let n = self.written.len() * per;
        crate::gpu::note_host_reads(1);
        let ids = self.ids.narrow(0, 0, n)?.to_vec1::<u32>()?;
        let weights = self.weights.narrow(0, 0, n)?.to_vec1::<f32>()?;
        let routing: Vec<LayerRouting> = self
            .written
            .iter()
            .enumerate()
            .map(|(slot, &layer)| LayerRouting {
                layer,
                top_k: self.top_k,
                expert_ids: ids[slot * per..(slot + 1) * per].to_vec(),
                weights: weights[slot * per..(slot + 1) * per].to_vec(),
            })
            .collect();
        experts.observe_routing(&routing);
        Ok(routing)
    }
}
