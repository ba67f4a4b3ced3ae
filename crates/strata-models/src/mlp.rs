//! SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): `down(silu(gate(x)) * up(x))`.
//! Used for dense layers, routed experts and shared experts alike.

use candle_core::Tensor;

use crate::error::Result;
use crate::layers::{Linear, WeightLoader};

/// The gate and up projections: stacked into one `[2I, H]` matrix when the format allows (one
/// activation quantization, one parallel region), else two.
#[derive(Debug, Clone)]
enum GateUp {
    Fused { gate_up: Linear, inter: usize },
    Separate { gate: Linear, up: Linear },
}

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_up: GateUp,
    down: Linear,
}

impl Mlp {
    /// `gate`, `up`: `[inter, hidden]`; `down`: `[hidden, inter]`. Stacks gate and up when both run
    /// on our kernels (the separate copies are then dropped).
    pub fn new(gate: Linear, up: Linear, down: Linear) -> Result<Self> {
        let gate_up = match Linear::fuse(&[&gate, &up])? {
            Some(gate_up) => GateUp::Fused { gate_up, inter: gate.out_dim() },
            None => GateUp::Separate { gate, up },
        };
        Ok(Self { gate_up, down })
    }

    /// From gate and up already stacked: `gate_up: [2·inter, hidden]` (gate rows first), `down:
    /// [hidden, inter]`.
    pub fn from_fused(gate_up: Linear, down: Linear) -> Self {
        let inter = gate_up.out_dim() / 2;
        Self { gate_up: GateUp::Fused { gate_up, inter }, down }
    }

    /// Loads `blk.{layer}.ffn_{gate,up,down}{suffix}` (GGUF names): `suffix` is `""` for a dense
    /// layer, `"_shexp"` for a shared expert.
    pub fn load(
        l: &WeightLoader,
        layer: usize,
        suffix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Self> {
        let n = |p: &str| format!("blk.{layer}.ffn_{p}{suffix}");
        Self::new(
            l.linear(&n("gate"), inter, hidden, false)?,
            l.linear(&n("up"), inter, hidden, false)?,
            l.linear(&n("down"), hidden, inter, false)?,
        )
    }

    /// Bytes of the weight matrices as held.
    pub fn weight_bytes(&self) -> usize {
        let gu = match &self.gate_up {
            GateUp::Fused { gate_up, .. } => gate_up.weight_bytes(),
            GateUp::Separate { gate, up } => gate.weight_bytes() + up.weight_bytes(),
        };
        gu + self.down.weight_bytes()
    }

    /// `(gate_up [2I, H], down [H, I])` when gate and up are stacked and all run on our kernels (the
    /// CPU MoE path then runs a layer's experts together, `strata_kernels::moe`).
    pub fn kernel_parts(
        &self,
    ) -> Option<(&strata_kernels::QuantMatrix, &strata_kernels::QuantMatrix)> {
        match &self.gate_up {
            GateUp::Fused { gate_up, .. } => Some((gate_up.kernel()?, self.down.kernel()?)),
            GateUp::Separate { .. } => None,
        }
    }

    /// gate and up through candle's fused kernel (one activation quantization, one parallel region)
    /// when both are candle-quantized and the kernel supports the format; `None` otherwise.
    fn fused_candle_gate_up(
        gate: &Linear,
        up: &Linear,
        x: &Tensor,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        let (Some(g), Some(u)) = (gate.candle_qtensor(), up.candle_qtensor()) else {
            return Ok(None);
        };
        if !x.device().is_cpu() {
            return Ok(None);
        }
        let x = x.contiguous()?;
        Ok(candle_core::quantized::QTensor::gemv_fused_shared_lhs(&[g.as_ref(), u.as_ref()], &x)?
            .and_then(|mut v| {
                let u = v.pop()?;
                Some((v.pop()?, u))
            }))
    }

    /// `x: [seq, hidden] → [seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if let Some(y) = self.forward_host(x)? {
            return Ok(y);
        }
        let (g, u) = match &self.gate_up {
            GateUp::Fused { gate_up, inter } => {
                let y = gate_up.forward(x)?;
                (y.narrow(1, 0, *inter)?, y.narrow(1, *inter, *inter)?)
            }
            GateUp::Separate { gate, up } => {
                // On a GPU: gate and up in one mat-vec launch where the kernel takes them.
                #[cfg(feature = "cuda")]
                if let Some(gu) = crate::layers::matvec_quant_fused(&[gate, up], x) {
                    let [g, u]: [Tensor; 2] = gu?.try_into().expect("two products");
                    return self.down.forward(&crate::experts::silu_mul(&g, &u)?);
                }
                match Self::fused_candle_gate_up(gate, up, x)? {
                    Some(gu) => gu,
                    None => (gate.forward(x)?, up.forward(x)?),
                }
            }
        };
        // On the CPU the shared SwiGLU helper (the same bits as candle's ops, off rayon's pool);
        // on a GPU candle's ops, as before.
        if x.device().is_cpu() {
            return self.down.forward(&crate::experts::silu_mul(&g, &u)?);
        }
        let g = candle_nn::ops::silu(&g.contiguous()?)?;
        self.down.forward(&(g * u)?)
    }

    /// [`Self::forward`] on the CPU when gate/up are stacked and both products run on our
    /// kernels: the input read in place, gate/up's `[seq, 2·inter]` product, SwiGLU from its two
    /// halves and the down product in host buffers — the same kernels and arithmetic as the
    /// tensor path (the same bits), without its copies of the halves and of each product's input.
    /// `None`: another device or layout (the tensor path then).
    fn forward_host(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let GateUp::Fused { gate_up, inter } = &self.gate_up else { return Ok(None) };
        let (Some(gu), Some(down)) = (gate_up.kernel(), self.down.kernel()) else {
            return Ok(None);
        };
        if !x.device().is_cpu() || x.dim(x.rank().saturating_sub(1))? != gu.cols() {
            return Ok(None);
        }
        let m = x.elem_count() / gu.cols();
        let y = crate::layers::with_host_f32(x, |xs| gu.matmul_vec(xs, m))?;
        let mut h = vec![0f32; m * inter];
        strata_kernels::f32::silu_mul_halves(&y, *inter, &mut h);
        drop(y);
        let out = down.matmul_vec(&h, m);
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = down.rows();
        }
        Tensor::from_vec(out, dims, x.device()).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::{GateUp, Mlp};
    use crate::layers::Linear;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn q4_1(rows: usize, cols: usize, seed: usize) -> Linear {
        let v: Vec<f32> =
            (0..rows * cols).map(|i| (((i * 31 + seed * 7) % 113) as f32 - 56.0) * 0.01).collect();
        let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q4_1).unwrap();
        Linear::from_shared(std::sync::Arc::new(q)).unwrap()
    }

    /// The CPU host path (gate/up into a buffer, SwiGLU from its halves, down) gives the bits of
    /// the tensor ops it replaces: the stacked product, the narrowed halves' `silu_mul`, down.
    #[test]
    fn host_path_equals_the_tensor_ops() {
        let (hidden, inter) = (64, 96);
        let mlp = Mlp::new(q4_1(inter, hidden, 1), q4_1(inter, hidden, 2), q4_1(hidden, inter, 3))
            .unwrap();
        let GateUp::Fused { gate_up, inter: i } = &mlp.gate_up else {
            panic!("Q4_1 gate and up are stacked on our kernels")
        };
        for m in [1, 3, 8] {
            let x: Vec<f32> = (0..m * hidden).map(|j| (j as f32 * 0.77).sin()).collect();
            let x = Tensor::from_vec(x, (m, hidden), &Device::Cpu).unwrap();
            let got = mlp.forward_host(&x).unwrap().expect("the host path runs on the CPU");
            let y = gate_up.forward(&x).unwrap();
            let (g, u) = (y.narrow(1, 0, *i).unwrap(), y.narrow(1, *i, *i).unwrap());
            let want = mlp.down.forward(&crate::experts::silu_mul(&g, &u).unwrap()).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert_eq!(got.to_vec2::<f32>().unwrap(), want.to_vec2::<f32>().unwrap(), "{m} rows");
            assert_eq!(
                mlp.forward(&x).unwrap().to_vec2::<f32>().unwrap(),
                got.to_vec2::<f32>().unwrap()
            );
        }
    }
}
