//! The expert provider: the one interface through which MoE blocks read routed experts' weights.
//!
//! Model code asks "expert `e` of layer `l`" and never knows where the bytes come from. The resident
//! provider ([`ResidentExperts`]) holds every expert in memory; the expert-streaming provider (a later
//! crate) fetches experts from disk into a byte-budgeted cache behind the same trait.

use std::sync::Arc;

use candle_core::Device;
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
        let lin = |w| Linear::new(w, None).map_err(|e| ModelError::tensor(name, e));
        let mlp = Mlp::new(lin(t.gate)?, lin(t.up)?, lin(t.down)?)?;
        Ok(Self { bytes: mlp.weight_bytes(), mlp })
    }
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

    /// Routing for `layer` is known: `experts` (ids, possibly repeated) will be asked for next. A
    /// streaming provider may start reading them all concurrently. The default does nothing.
    fn will_need(&self, _layer: usize, _experts: &[u32]) {}
}

/// Every expert of every MoE layer held in memory.
#[derive(Debug, Default)]
pub struct ResidentExperts {
    /// `layers[l]` is empty for dense layers.
    layers: Vec<Vec<Arc<Expert>>>,
}

impl ResidentExperts {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: vec![Vec::new(); num_layers] }
    }

    /// From experts already built: `layers[l]` holds layer `l`'s experts (empty for dense layers).
    pub fn from_layers(layers: Vec<Vec<Arc<Expert>>>) -> Self {
        Self { layers }
    }

    /// Resolves and checks layer `layer`'s expert tensors, then reads all of them.
    pub fn load_layer(&mut self, files: &ModelFiles, cfg: &ModelConfig, layer: usize, device: &Device) -> Result<()> {
        let Some(m) = &cfg.moe else { return Ok(()) };
        let dims = ExpertDims { num_experts: m.num_experts, hidden: cfg.hidden_size, intermediate: m.expert_intermediate_size };
        let layout = files.expert_layout(layer, dims)?;
        let name = |e: usize| match &layout {
            ExpertLayout::Gguf { gate, .. } => format!("{gate}[{e}]"),
            ExpertLayout::HfPerExpert { prefix, .. } => format!("{prefix}.{e}"),
            ExpertLayout::HfFused { gate_up, .. } => format!("{gate_up}[{e}]"),
        };
        self.layers[layer] = (0..m.num_experts)
            .map(|e| Expert::from_tensors(files.load_expert(&layout, e, device)?, &name(e)).map(Arc::new))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Total bytes of all experts held.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|e| e.bytes).sum()
    }
}

impl ExpertProvider for ResidentExperts {
    fn expert(&self, layer: usize, expert: usize) -> Result<Arc<Expert>> {
        self.layers
            .get(layer)
            .and_then(|l| l.get(expert))
            .cloned()
            .ok_or_else(|| ModelError::Candle(candle_core::Error::msg(format!("layer {layer} has no expert {expert}"))))
    }
}
