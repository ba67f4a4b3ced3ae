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

    /// Loads `blk.{layer}.ffn_{gate,up,down}{suffix}` (GGUF names): `suffix` is `""` for a dense
    /// layer, `"_shexp"` for a shared expert.
    pub fn load(l: &WeightLoader, layer: usize, suffix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let n = |p: &str| format!("blk.{layer}.ffn_{p}{suffix}");
        Self::new(l.linear(&n("gate"), inter, hidden, false)?, l.linear(&n("up"), inter, hidden, false)?, l.linear(&n("down"), hidden, inter, false)?)
    }

    /// Bytes of the three weight matrices as stored.
    pub fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes() + self.up.weight_bytes() + self.down.weight_bytes()
    }

    /// gate and up through candle's fused kernel (one activation quantization, one parallel region)
    /// when both are candle-quantized and the kernel supports the format; `None` otherwise.
    fn fused_candle_gate_up(&self, x: &Tensor) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        let (Some(g), Some(u)) = (self.gate.candle_qtensor(), self.up.candle_qtensor()) else { return Ok(None) };
        if !x.device().is_cpu() {
            return Ok(None);
        }
        let x = x.contiguous()?;
        Ok(candle_core::quantized::QTensor::gemv_fused_shared_lhs(&[g.as_ref(), u.as_ref()], &x)?.and_then(|mut v| {
            let u = v.pop()?;
            Some((v.pop()?, u))
        }))
    }

    /// `x: [seq, hidden] → [seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (g, u) = match &self.gate_up {
            Some(gu) => {
                let y = gu.forward(x)?;
                let i = self.gate.out_dim();
                (y.narrow(1, 0, i)?, y.narrow(1, i, i)?)
            }
            None => match self.fused_candle_gate_up(x)? {
                Some(gu) => gu,
                None => (self.gate.forward(x)?, self.up.forward(x)?),
            },
        };
        let g = candle_nn::ops::silu(&g.contiguous()?)?;
        self.down.forward(&(g * u)?)
    }
}
