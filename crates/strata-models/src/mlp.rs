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
    /// gate and up stacked when the format allows.
    gate_up: Option<Linear>,
}

impl Mlp {
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{layer}.{s}");
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = l.linear(&p("ffn_gate"), i, h, false)?;
        let up = l.linear(&p("ffn_up"), i, h, false)?;
        let gate_up = Linear::fuse(&[&gate, &up])?;
        Ok(Self { gate, up, down: l.linear(&p("ffn_down"), h, i, false)?, gate_up })
    }

    /// `x: [seq, hidden] → [seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (g, u) = match &self.gate_up {
            Some(gu) => {
                let y = gu.forward(x)?;
                let i = self.gate.out_dim();
                (y.narrow(1, 0, i)?, y.narrow(1, i, i)?)
            }
            None => (self.gate.forward(x)?, self.up.forward(x)?),
        };
        let g = candle_nn::ops::silu(&g.contiguous()?)?;
        self.down.forward(&(g * u)?)
    }
}
