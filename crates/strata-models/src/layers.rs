//! Building blocks shared by the model definitions: linear layers over quantized or dense weights,
//! RMSNorm, and the weight loader that checks shapes.

use candle_core::quantized::QMatMul;
use candle_core::{Device, Module, Tensor};
use strata_formats::{ModelFiles, Weight};

use crate::error::{ModelError, Result};

/// Loads tensors by GGUF name from a [`ModelFiles`], checking shapes.
pub struct WeightLoader<'a> {
    pub files: &'a ModelFiles,
    pub device: Device,
}

impl<'a> WeightLoader<'a> {
    pub fn new(files: &'a ModelFiles, device: Device) -> Self {
        Self { files, device }
    }

    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        Ok(self.files.load(name, shape, &self.device)?)
    }

    /// A dense f32 tensor (norm weights, biases).
    pub fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let w = self.weight(name, shape)?;
        w.dequantize(&self.device).map_err(|e| ModelError::tensor(name, e))
    }

    pub fn has(&self, name: &str) -> bool {
        self.files.has_tensor(name)
    }

    /// A linear layer `y = x Wᵀ (+ b)` with `W: [out, in]`.
    pub fn linear(&self, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
        let w = self.weight(&format!("{name}.weight"), &[out_dim, in_dim])?;
        let b = if bias { Some(self.dense(&format!("{name}.bias"), &[out_dim])?) } else { None };
        Linear::new(w, b).map_err(|e| ModelError::tensor(name, e))
    }
}

/// `y = x Wᵀ + b`. Quantized GGUF weights use candle's quantized matmul (activations quantized to
/// the weight's vec-dot type, as ggml does); dense weights use f32 GEMM.
#[derive(Debug, Clone)]
pub struct Linear {
    w: QMatMul,
    b: Option<Tensor>,
    out_dim: usize,
}

impl Linear {
    pub fn new(w: Weight, b: Option<Tensor>) -> candle_core::Result<Self> {
        let out_dim = w.shape()[0];
        let w = match w {
            Weight::Quantized(q) => QMatMul::from_qtensor(q)?,
            Weight::Dense(t) => QMatMul::Tensor(t),
        };
        Ok(Self { w, b, out_dim })
    }

    pub fn from_qmatmul(w: QMatMul, out_dim: usize) -> Self {
        Self { w, b: None, out_dim }
    }

    pub fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// `x: [.., in] → [.., out]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.w.forward(x)?;
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x²) + eps) * w` over the last dim.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    w: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn load(l: &WeightLoader, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self { w: l.dense(name, &[dim])?, eps: eps as f32 })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if x.is_contiguous() { x.clone() } else { x.contiguous()? };
        candle_nn::ops::rms_norm(&x, &self.w, self.eps)
    }
}
