//! MoE routing kept on the GPU for a whole forward pass (`cuda` build): each MoE layer's router
//! top-k runs as our kernel and feeds the fused experts on the device, so the pass issues its
//! launches without waiting for the host (candle's path copied every layer's router logits to
//! the host to pick the top-k: one synchronisation per MoE layer). The ids and weights also go to
//! one record on the device, read back once when the pass ends, so [`ForwardOutput::routing`]
//! stays what the host path gives.
//!
//! [`ForwardOutput::routing`]: super::ForwardOutput

use candle_core::{DType, Tensor};

use super::{FeedForward, Transformer};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::moe::{LayerRouting, SparseMoe};

/// One pass's device routing: the record `[moe_layers · rows · top_k]` and which layer wrote
/// which slot of it.
pub(super) struct DeviceRouting {
    ids: Tensor,
    weights: Tensor,
    rows: usize,
    top_k: usize,
    /// `(layer, slot)` in the order the layers ran.
    written: Vec<usize>,
}

impl DeviceRouting {
    /// `Some` when this pass of `rows` rows through layers `0..end` can route on the device: a
    /// CUDA model, `STRATA_GPU_ROUTING` not `0`, no prefetcher (it reads each layer's routing on
    /// the host), a provider whose fused experts take expert ids as they are
    /// ([`crate::ExpertProvider::routes_on_device`]), and no sequence routed by a synthetic
    /// model's routing process (it chooses on the host).
    pub(super) fn for_pass(
        model: &Transformer,
        caches: &[&mut KvCache],
        rows: usize,
        end: usize,
    ) -> Result<Option<Self>> {
        if !model.device.is_cuda()
            || !crate::gpu::enabled(crate::gpu::GpuPath::Routing)
            || model.prefetcher.is_some()
            || !model.experts.routes_on_device()
            || caches.iter().any(|c| c.has_routing_history())
        {
            return Ok(None);
        }
        let moe: Vec<&SparseMoe> = model.layers[..end]
            .iter()
            .filter_map(|l| match &l.ffn {
                FeedForward::Moe(m) => Some(m),
                FeedForward::Dense(_) => None,
            })
            .collect();
        let Some(first) = moe.first() else { return Ok(None) };
        let top_k = first.router().top_k();
        let n = moe.len() * rows * top_k;
        Ok(Some(Self {
            ids: Tensor::zeros(n, DType::U32, &model.device)?,
            weights: Tensor::zeros(n, DType::F32, &model.device)?,
            rows,
            top_k,
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
        let out = moe.forward_device_routed(xn, model.experts.as_ref(), Some(record))?;
        if out.is_ok() {
            self.written.push(layer);
        }
        Some(out)
    }

    /// The routing of every layer that ran here, read back from the device (one copy of ids and
    /// one of weights for the whole pass; after a graph replay, that replay's routing).
    pub(super) fn read(&self) -> Result<Vec<LayerRouting>> {
        if self.written.is_empty() {
            return Ok(Vec::new());
        }
        let per = self.rows * self.top_k;
        let n = self.written.len() * per;
        let ids = self.ids.narrow(0, 0, n)?.to_vec1::<u32>()?;
        let weights = self.weights.narrow(0, 0, n)?.to_vec1::<f32>()?;
        Ok(self
            .written
            .iter()
            .enumerate()
            .map(|(slot, &layer)| LayerRouting {
                layer,
                top_k: self.top_k,
                expert_ids: ids[slot * per..(slot + 1) * per].to_vec(),
                weights: weights[slot * per..(slot + 1) * per].to_vec(),
            })
            .collect())
    }
}
