//! SwiGLU feed-forward (Shazeer 2020): `down(silu(gate(x)) * up(x))`.

use candle_core::Tensor;
use strata_formats::ModelConfig;

use crate::error::Result;
use crate::layers::{Linear, WeightLoader};

#[derive(Debug, Clone)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{layer}.{s}");
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self { gate: l.linear(&p("ffn_gate"), i, h, false)?, up: l.linear(&p("ffn_up"), i, h, false)?, down: l.linear(&p("ffn_down"), h, i, false)? })
    }

    /// `x: [seq, hidden] → [seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = candle_nn::ops::silu(&self.gate.forward(x)?)?;
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}
