//! Where the routed experts of an MoE layer live in each format, and reading one expert.
//!
//! Layouts (expert `e` of layer `L`, `E` experts, hidden `H`, expert intermediate `I`):
//! - GGUF (llama.cpp's converter): 3-D tensors `blk.L.ffn_{gate,up}_exps.weight` `[E, I, H]` and
//!   `blk.L.ffn_down_exps.weight` `[E, H, I]`; expert `e` is one contiguous slice of each.
//! - GGUF per expert (`strata repack`'s bundled layout; also llama.cpp's legacy Mixtral naming):
//!   `blk.L.ffn_{gate,up}.e.weight` `[I, H]` and `blk.L.ffn_down.e.weight` `[H, I]`. `strata repack`
//!   writes each expert's three back to back from a 4 KiB-aligned offset: one read per expert.
//! - HF per expert (under `model.layers.` or, for image-text checkpoints,
//!   `model.language_model.layers.`): `model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight` (Qwen-MoE, OLMoE) or
//!   `model.layers.L.block_sparse_moe.experts.e.{w1,w3,w2}.weight` (Mixtral).
//! - HF fused (transformers 5's in-memory layout): `model.layers.L.mlp.experts.gate_up_proj`
//!   `[E, 2I, H]` (gate rows first, then up) and `model.layers.L.mlp.experts.down_proj` `[E, H, I]`.
//!
//! Every shape is checked when the layout is resolved, so a file whose expert tensors disagree fails
//! at load with the tensor named, never mid-token.

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};

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
    /// GGUF 2-D tensors per expert: `blk.{layer}.ffn_{gate,up,down}.{e}.weight`.
    GgufPerExpert { layer: usize },
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
                if !g.tensors.contains_key(&gate)
                    && g.tensors.contains_key(&per_expert_name(layer, "gate", 0))
                {
                    for x in 0..e {
                        for (p, shape) in [("gate", [i, h]), ("up", [i, h]), ("down", [h, i])] {
                            let name = per_expert_name(layer, p, x);
                            self.check_shape(
                                &name,
                                g.tensors.get(name.as_str()).map(|t| t.shape.clone()),
                                &shape,
                            )?;
                        }
                    }
                    return Ok(ExpertLayout::GgufPerExpert { layer });
                }
                for (name, shape) in [(&gate, [e, i, h]), (&up, [e, i, h]), (&down, [e, h, i])] {
                    self.check_shape(
                        name,
                        g.tensors.get(name.as_str()).map(|t| t.shape.clone()),
                        &shape,
                    )?;
                }
                Ok(ExpertLayout::Gguf { gate, up, down })
            }
            ModelFiles::Hf(hf) => {
                let has = |n: &str| hf.weights.info(n).is_some();
                // Image-text checkpoints (qwen3_5_moe) nest the language model.
                let nested = format!("model.language_model.layers.{layer}.mlp.");
                let root = if hf.weights.tensors.keys().any(|k| k.starts_with(&nested)) {
                    "model.language_model.layers"
                } else {
                    "model.layers"
                };
                let (gu, d) = hf
                    .arch
                    .and_then(|a| a.spec().hf_fused_experts())
                    .unwrap_or(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"));
                let fused = format!("{root}.{layer}.{gu}");
                if has(&fused) {
                    let down = format!("{root}.{layer}.{d}");
                    self.check_shape(
                        &fused,
                        hf.weights.info(&fused).map(|t| t.shape.clone()),
                        &[e, 2 * i, h],
                    )?;
                    self.check_shape(
                        &down,
                        hf.weights.info(&down).map(|t| t.shape.clone()),
                        &[e, h, i],
                    )?;
                    return Ok(ExpertLayout::HfFused { gate_up: fused, down });
                }
                let mixtral = format!("{root}.{layer}.block_sparse_moe.experts");
                let layout = if has(&format!("{mixtral}.0.w1.weight")) {
                    ExpertLayout::HfPerExpert { prefix: mixtral, projections: ["w1", "w3", "w2"] }
                } else {
                    ExpertLayout::HfPerExpert {
                        prefix: format!("{root}.{layer}.mlp.experts"),
                        projections: ["gate_proj", "up_proj", "down_proj"],
                    }
                };
                if let ExpertLayout::HfPerExpert { prefix, projections } = &layout {
                    for x in 0..e {
                        for (p, shape) in projections.iter().zip([[i, h], [i, h], [h, i]]) {
                            let name = format!("{prefix}.{x}.{p}.weight");
                            self.check_shape(
                                &name,
                                hf.weights.info(&name).map(|t| t.shape.clone()),
                                &shape,
                            )?;
                        }
                    }
                }
                Ok(layout)
            }
        }
    }

    /// `MissingTensor` when `actual` is `None`, `ShapeMismatch` when it differs from `expected`.
    pub(crate) fn check_shape(
        &self,
        name: &str,
        actual: Option<Vec<usize>>,
        expected: &[usize],
    ) -> Result<()> {
        let path = self.path().to_path_buf();
        let actual = actual.ok_or_else(|| FormatError::MissingTensor {
            path: path.clone(),
            tensor: name.to_string(),
        })?;
        if actual != expected {
            return Err(FormatError::ShapeMismatch {
                path,
                tensor: name.to_string(),
                expected: expected.to_vec(),
                actual,
            });
        }
        Ok(())
    }

    /// Reads expert `expert` of a layer whose layout was resolved by [`Self::expert_layout`]
    /// (reading only that expert's bytes).
    pub fn load_expert(
        &self,
        layout: &ExpertLayout,
        expert: usize,
        device: &Device,
    ) -> Result<ExpertTensors> {
        match (self, layout) {
            (ModelFiles::Gguf(g), ExpertLayout::Gguf { gate, up, down }) => {
                let q = |n: &str| g.read_qtensor_index(n, expert, device).map(Weight::Quantized);
                Ok(ExpertTensors { gate: q(gate)?, up: q(up)?, down: q(down)? })
            }
            (ModelFiles::Gguf(g), ExpertLayout::GgufPerExpert { layer }) => {
                let q = |p: &str| {
                    g.read_qtensor(&per_expert_name(*layer, p, expert), device)
                        .map(Weight::Quantized)
                };
                Ok(ExpertTensors { gate: q("gate")?, up: q("up")?, down: q("down")? })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfPerExpert { prefix, projections: [g, u, d] }) => {
                let t = |p: &str| {
                    hf.weights
                        .load_f32(&format!("{prefix}.{expert}.{p}.weight"), device)
                        .map(Weight::Dense)
                };
                Ok(ExpertTensors { gate: t(g)?, up: t(u)?, down: t(d)? })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfFused { gate_up, down }) => {
                let gu = hf.weights.load_f32_index(gate_up, expert, device)?;
                let i = gu.dim(0).map_err(|e| FormatError::candle(self.path(), e))? / 2;
                let half = |start: usize| {
                    gu.narrow(0, start, i)
                        .and_then(|t| t.contiguous())
                        .map_err(|e| FormatError::candle(self.path(), e))
                };
                Ok(ExpertTensors {
                    gate: Weight::Dense(half(0)?),
                    up: Weight::Dense(half(i)?),
                    down: Weight::Dense(hf.weights.load_f32_index(down, expert, device)?),
                })
            }
            _ => Err(FormatError::invalid(
                self.path(),
                format!("expert layout {layout:?} does not belong to this file"),
            )),
        }
    }
}

/// GGUF name of one expert's projection in the per-expert layout: `blk.{layer}.ffn_{proj}.{e}.weight`.
pub fn per_expert_name(layer: usize, proj: &str, expert: usize) -> String {
    format!("blk.{layer}.ffn_{proj}.{expert}.weight")
}

/// Whether `name` is a GGUF per-expert projection (`blk.L.ffn_{gate,up,down}.E.weight`).
pub fn is_per_expert_name(name: &str) -> bool {
    let mut it = name.split('.');
    matches!(
        (
            it.next(),
            it.next().map(|l| l.parse::<usize>().is_ok()),
            it.next(),
            it.next().map(|e| e.parse::<usize>().is_ok()),
            it.next(),
            it.next()
        ),
        (
            Some("blk"),
            Some(true),
            Some("ffn_gate" | "ffn_up" | "ffn_down"),
            Some(true),
            Some("weight"),
            None
        )
    )
}

/// A byte range in one of the model's weight files ([`ModelFiles::weight_files`] index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

/// How an expert's projection bytes encode weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertEncoding {
    /// ggml blocks (GGUF).
    Ggml(GgmlDType),
    /// Dense little-endian floats (safetensors F32, F16 or BF16).
    Float(DType),
}

/// Where expert `e` of one layer lies on disk: gate `[I, H]`, up `[I, H]`, down `[H, I]` byte
/// ranges (for GGUF, slices of the 3-D tensors; for HF fused, gate and up are adjacent halves of
/// one `gate_up_proj` slice), each with its encoding (mixed quantizations such as Q4_K_M store
/// `down` in another type than `gate`/`up`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertExtent {
    pub parts: [ByteRange; 3],
    pub encodings: [ExpertEncoding; 3],
}

impl ExpertExtent {
    /// Bytes of the three projections as stored.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.len).sum()
    }
}

fn float_dtype(path: &std::path::Path, name: &str, dtype: &str) -> Result<DType> {
    match dtype {
        "F32" => Ok(DType::F32),
        "F16" => Ok(DType::F16),
        "BF16" => Ok(DType::BF16),
        other => Err(FormatError::UnsupportedTensorType {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype: other.to_string(),
        }),
    }
}

impl ModelFiles {
    /// The files byte ranges point into: the GGUF file, or the safetensors shards in index order.
    pub fn weight_files(&self) -> Vec<PathBuf> {
        match self {
            ModelFiles::Gguf(g) => vec![g.path.clone()],
            ModelFiles::Hf(hf) => hf.weights.files.clone(),
        }
    }

    /// The byte ranges of expert `expert` of a layer whose layout was resolved (and shapes checked)
    /// by [`Self::expert_layout`]. Reads nothing.
    pub fn expert_extent(&self, layout: &ExpertLayout, expert: usize) -> Result<ExpertExtent> {
        let path = self.path();
        match (self, layout) {
            (ModelFiles::Gguf(g), ExpertLayout::Gguf { gate, up, down }) => {
                let r = |n: &str| -> Result<ByteRange> {
                    let (offset, len) = g.index_range(n, expert)?;
                    Ok(ByteRange { file: 0, offset, len })
                };
                let e = |n: &str| -> Result<ExpertEncoding> {
                    Ok(ExpertEncoding::Ggml(g.tensor_info(n)?.dtype))
                };
                Ok(ExpertExtent {
                    parts: [r(gate)?, r(up)?, r(down)?],
                    encodings: [e(gate)?, e(up)?, e(down)?],
                })
            }
            (ModelFiles::Gguf(g), ExpertLayout::GgufPerExpert { layer }) => {
                let mut parts = [ByteRange { file: 0, offset: 0, len: 0 }; 3];
                let mut encodings = [ExpertEncoding::Float(DType::F32); 3];
                for ((part, enc), p) in
                    parts.iter_mut().zip(&mut encodings).zip(["gate", "up", "down"])
                {
                    let info = g.tensor_info(&per_expert_name(*layer, p, expert))?;
                    *part = ByteRange { file: 0, offset: info.offset, len: info.size };
                    *enc = ExpertEncoding::Ggml(info.dtype);
                }
                Ok(ExpertExtent { parts, encodings })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfPerExpert { prefix, projections }) => {
                let mut parts = [ByteRange { file: 0, offset: 0, len: 0 }; 3];
                let mut encodings = [ExpertEncoding::Float(DType::F32); 3];
                for ((part, enc), p) in parts.iter_mut().zip(&mut encodings).zip(projections) {
                    let name = format!("{prefix}.{expert}.{p}.weight");
                    let info =
                        hf.weights.info(&name).ok_or_else(|| FormatError::MissingTensor {
                            path: path.to_path_buf(),
                            tensor: name.clone(),
                        })?;
                    *enc = ExpertEncoding::Float(float_dtype(
                        &hf.weights.files[info.file],
                        &name,
                        &info.dtype,
                    )?);
                    *part = ByteRange { file: info.file, offset: info.offset, len: info.size };
                }
                Ok(ExpertExtent { parts, encodings })
            }
            (ModelFiles::Hf(hf), ExpertLayout::HfFused { gate_up, down }) => {
                let slice = |name: &str| -> Result<(ByteRange, DType)> {
                    let info = hf.weights.info(name).ok_or_else(|| FormatError::MissingTensor {
                        path: path.to_path_buf(),
                        tensor: name.to_string(),
                    })?;
                    let n = info.shape.first().copied().unwrap_or(0) as u64;
                    if expert as u64 >= n {
                        return Err(FormatError::invalid(
                            path,
                            format!("tensor `{name}`: expert {expert} out of {n}"),
                        ));
                    }
                    let per = info.size / n;
                    let d = float_dtype(&hf.weights.files[info.file], name, &info.dtype)?;
                    Ok((
                        ByteRange {
                            file: info.file,
                            offset: info.offset + per * expert as u64,
                            len: per,
                        },
                        d,
                    ))
                };
                let (gu, d) = slice(gate_up)?;
                let (dn, d2) = slice(down)?;
                let half = gu.len / 2;
                let gate = ByteRange { len: half, ..gu };
                let up = ByteRange { offset: gu.offset + half, len: half, ..gu };
                let (e, e2) = (ExpertEncoding::Float(d), ExpertEncoding::Float(d2));
                Ok(ExpertExtent { parts: [gate, up, dn], encodings: [e, e, e2] })
            }
            _ => Err(FormatError::invalid(
                path,
                format!("expert layout {layout:?} does not belong to this file"),
            )),
        }
    }
}

/// Builds one projection's weight `[rows, cols]` from its bytes as read from disk. Dense floats
/// become f32 tensors; ggml blocks stay quantized. `name` is used in errors.
///
/// Errors: a byte count that does not match the shape.
pub fn weight_from_bytes(
    encoding: ExpertEncoding,
    shape: [usize; 2],
    bytes: &[u8],
    name: &str,
    device: &Device,
) -> Result<Weight> {
    let path = std::path::Path::new(name);
    match encoding {
        ExpertEncoding::Ggml(dtype) => {
            crate::gguf::qtensor_from_bytes(path, name, dtype, &shape, bytes, device)
                .map(Weight::Quantized)
        }
        ExpertEncoding::Float(dtype) => Tensor::from_raw_buffer(bytes, dtype, &shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_device(device))
            .map(Weight::Dense)
            .map_err(|e| FormatError::candle(path, e)),
    }
}
