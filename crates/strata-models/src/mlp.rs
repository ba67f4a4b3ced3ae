//! SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): `down(silu(gate(x)) * up(x))`.
//! Used for dense layers, routed experts and shared experts alike.

use candle_core::Tensor;

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
    /// `gate`, `up`: `[inter, hidden]`; `down`: `[hidden, inter]`.
    pub fn new(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        let gate_up = Linear::fuse(&[&gate, &up])?;
        Ok(Self { gate, up, down, gate_up })
    }

    /// Loads `{prefix}_gate`, `{prefix}_up`, `{prefix}_down` (GGUF names, e.g. `blk.3.ffn` or
    /// `blk.3.ffn` + `_shexp` suffix handled by the caller through `suffix`).
    pub fn load(l: &WeightLoader, layer: usize, suffix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let n = |p: &str| format!("blk.{layer}.ffn_{p}{suffix}");
        Self::new(l.linear(&n("gate"), inter, hidden, false)?, l.linear(&n("up"), inter, hidden, false)?, l.linear(&n("down"), hidden, inter, false)?)
    }

    /// Bytes of the three weight matrices as stored.
    pub fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes() + self.up.weight_bytes() + self.down.weight_bytes()
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
