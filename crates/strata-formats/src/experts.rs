//! Where the routed experts of an MoE layer live in each format, and reading one expert.
//!
//! Layouts (expert `e` of layer `L`, `E` experts, hidden `H`, expert intermediate `I`):
//! - GGUF (llama.cpp's converter): 3-D tensors `blk.L.ffn_{gate,up}_exps.weight` `[E, I, H]` and
//!   `blk.L.ffn_down_exps.weight` `[E, H, I]`; expert `e` is one contiguous slice of each.
//! - HF per expert: `model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight` (Qwen-MoE, OLMoE) or
//!   `model.layers.L.block_sparse_moe.experts.e.{w1,w3,w2}.weight` (Mixtral).
//! - HF fused (transformers 5's in-memory layout): `model.layers.L.mlp.experts.gate_up_proj`
//!   `[E, 2I, H]` (gate rows first, then up) and `model.layers.L.mlp.experts.down_proj` `[E, H, I]`.
//!
//! Every shape is checked when the layout is resolved, so a file whose expert tensors disagree fails
//! at load with the tensor named, never mid-token.

use candle_core::Device;

use crate::error::{FormatError, Result};
use crate::model_files::{ModelFiles, Weight};

/// One expert's SwiGLU weights: `gate`, `up` `[I, H]` and `down` `[H, I]`.
#[derive(Debug)]
pub struct ExpertTensors {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

/// The resolved storage of one MoE layer's routed experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertLayout {
    /// GGUF 3-D tensors, names of (gate, up, down).
    Gguf { gate: String, up: String, down: String },
    /// One HF tensor per expert and projection: `{prefix}.{e}.{proj}.weight` for proj in
    /// (gate, up, down) order.
    HfPerExpert { prefix: String, projections: [&'static str; 3] },
    /// HF fused tensors.
    HfFused { gate_up: String, down: String },
}

/// Dimensions an MoE layer's experts must have.
#[derive(Debug, Clone, Copy)]
pub struct ExpertDims {
    pub num_experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
}

impl ModelFiles {
    /// Finds the experts of `layer` and checks every shape against `dims`.
    ///
    /// Errors: no expert tensors (`MissingTensor` naming the GGUF or HF name expected), a tensor whose
    /// shape disagrees (`ShapeMismatch` naming it).
    pub fn expert_layout(&self, layer: usize, dims: ExpertDims) -> Result<ExpertLayout> {
        let ExpertDims { num_experts: e, hidden: h, intermediate: i } = dims;
        match self {
            ModelFiles::Gguf(g) => {
                let n = |p: &str| format!("blk.{layer}.ffn_{p}_exps.weight");
                let (gate, up, down) = (n("gate"), n("up"), n("down"));
                for (name, shape) in [(&gate, [e, i, h]), (&up, [e, i, h]), (&down, [e, h, i])] {
                    self.check_shape(name, g.tensors.get(name.as_str()).map(|t| t.shape.clone()), &shape)?;
                }
                Ok(ExpertLayout::Gguf { gate, up, down })
            }
            ModelFiles::Hf(hf) => {
                let has = |n: &str| hf.weights.info(n).is_some();
                let fused = format!("model.layers.{layer}.mlp.experts.gate_up_proj");
                if has(&fused) {
                    let down = format!("model.layers.{layer}.mlp.experts.down_proj");
                    self.check_shape(&fused, hf.weights.info(&fused).map(|t| t.shape.clone()), &[e, 2 * i, h])?;
                    self.check_shape(&down, hf.weights.info(&down).map(|t| t.shape.clone()), &[e, h, i])?;
                    return Ok(ExpertLayout::HfFused { gate_up: fused, down });
                }
                let mixtral = format!("model.layers.{layer}.block_sparse_moe.experts");
                let layout = if has(&format!("{mixtral}.0.w1.weight")) {
                    ExpertLayout::HfPerExpert { prefix: mixtral, projections: ["w1", "w3", "w2"] }
                } else {
                    ExpertLayout::HfPerExpert {
                        prefix: format!("model.layers.{layer}.mlp.experts"),
                        projections: ["gate_proj", "up_proj", "down_proj"],
                    }
                };
                if let ExpertLayout::HfPerExpert { prefix, projections } = &layout {
                    for x in 0..e {
                        for (p, shape) in projections.iter().zip([[i, h], [i, h], [h, i]]) {
                            let name = format!("{prefix}.{x}.{p}.weight");
                            self.check_shape(&name, hf.weights.info(&name).map(|t| t.shape.clone()), &shape)?;
                        }
                    }
                }
                Ok(layout)
            }
        }
    }

    /// `MissingTensor` when `actual` is `None`, `ShapeMismatch` when it differs from `expected`.
    pub(crate) fn check_shape(&self, name: &str, actual: Option<Vec<usize>>, expected: &[usize]) -> Result<()> {
        let path = self.path().to_path_buf();
        let actual = actual.ok_or_else(|| FormatError::MissingTensor { path: path.clone(), tensor: name.to_string() })?;
        if actual != expected {
            return Err(FormatError::ShapeMismatch { path, tensor: name.to_string(), expected: expected.to_vec(), actual });
        }
        Ok(())
    }

    /// Reads expert `expert` of a layer whose layout was resolved by [`Self::expert_layout`]
    /// (reading only that expert's bytes).
    pub fn load_expert(&self, layout: &ExpertLayout, expert: usize, device: &Device) -> Result<ExpertTensors> {
        match (self, layout) {
            (ModelFiles::Gguf(g), ExpertLayout::Gguf { gate, up, down }) => {
                let q = |n: &str| g.read_qtensor_index(n, expert, device).map(Weight::Quantized);
                Ok(ExpertTensors { gate: q(gate)?, up: q(up)?, down: q(down)? })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfPerExpert { prefix, projections: [g, u, d] }) => {
                let t = |p: &str| hf.weights.load_f32(&format!("{prefix}.{expert}.{p}.weight"), device).map(Weight::Dense);
                Ok(ExpertTensors { gate: t(g)?, up: t(u)?, down: t(d)? })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfFused { gate_up, down }) => {
                let gu = hf.weights.load_f32_index(gate_up, expert, device)?;
                let i = gu.dim(0).map_err(|e| FormatError::candle(self.path(), e))? / 2;
                let half = |start: usize| gu.narrow(0, start, i).and_then(|t| t.contiguous()).map_err(|e| FormatError::candle(self.path(), e));
                Ok(ExpertTensors {
                    gate: Weight::Dense(half(0)?),
                    up: Weight::Dense(half(i)?),
                    down: Weight::Dense(hf.weights.load_f32_index(down, expert, device)?),
                })
            }
            _ => Err(FormatError::invalid(self.path(), format!("expert layout {layout:?} does not belong to this file"))),
        }
    }
}
