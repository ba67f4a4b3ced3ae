//! Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks",
//! arXiv 2412.06464) as Qwen3-Next and Qwen3.5 use it. Reference: transformers
//! `models/qwen3_next/modeling_qwen3_next.py` (`Qwen3NextGatedDeltaNet`,
//! `torch_recurrent_gated_delta_rule`, `Qwen3NextRMSNormGated`) and
//! `models/qwen3_5_moe/modeling_qwen3_5_moe.py`; llama.cpp `src/models/qwen3next.cpp` for the GGUF
//! tensor layout.
//!
//! Per token: in-projections → `qkv` (conv input), `z` (output gate), `b`, `a` → causal depthwise
//! conv1d (`kernel` taps, its own rolling state) + SiLU over `qkv` → L2-normalised q, k per key head
//! (q scaled by `1/√k_dim`) → per value head `β = σ(b)`, `decay = exp(−exp(A_log)·softplus(a + dt_bias))`
//! and the delta rule ([`delta_update`]) on a `[k_dim, v_dim]` state, read out with q → RMSNorm
//! per head times `silu(z)` → out-projection.
//!
//! Prefill and decode both run the recurrent form token by token.

use candle_core::Tensor;
use strata_formats::{LinearAttnConfig, ModelConfig, ModelFiles};

use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::layers::{Linear, WeightLoader};
use crate::recurrent::{delta_readout, delta_update, GdnDims};

/// How the in-projection outputs, concatenated, map onto `[qkv | z | b | a]`.
#[derive(Debug, Clone)]
enum Gather {
    /// Already in that order (separate projections: GGUF `attn_qkv`, `attn_gate`, `ssm_beta`,
    /// `ssm_alpha`; HF Qwen3.5 `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
    Identity,
    /// Index of each output channel in the concatenated projections (Qwen3-Next's per-key-head
    /// grouped `in_proj_qkvz` and `in_proj_ba` / GGUF `ssm_ba`).
    Index(Vec<usize>),
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    in_proj: Vec<Linear>,
    gather: Gather,
    /// `[conv_dim, kernel]`.
    conv_w: Vec<f32>,
    /// `−exp(A_log)` per value head.
    a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[v_dim]` (plain `w`, not `1 + w`).
    norm_w: Vec<f32>,
    eps: f32,
    out_proj: Linear,
    dims: GdnDims,
}

fn host(l: &WeightLoader, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = l.dense(name, shape)?;
    t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| ModelError::tensor(name, e))
}

/// Channels of Qwen3-Next's grouped `b, a` projection (`[k_heads, 2·(v_heads/k_heads)]`: per key
/// head its value heads' b then a) in `[b | a]` order.
fn grouped_ba(d: &GdnDims, base: usize) -> Vec<usize> {
    let r = d.v_heads / d.k_heads;
    let b = (0..d.v_heads).map(|h| base + (h / r) * 2 * r + h % r);
    let a = (0..d.v_heads).map(|h| base + (h / r) * 2 * r + r + h % r);
    b.chain(a).collect()
}

/// Channels of Qwen3-Next's grouped `in_proj_qkvz` (`[k_heads, 2·k_dim + 2·r·v_dim]`: per key head
/// q, k, its value heads' v, then z) in `[q | k | v | z]` order.
fn grouped_qkvz(d: &GdnDims) -> Vec<usize> {
    let rv = d.value_width() / d.k_heads;
    let group = 2 * d.k_dim + 2 * rv;
    let part = |off: usize, width: usize| (0..d.k_heads).flat_map(move |g| (0..width).map(move |i| g * group + off + i));
    part(0, d.k_dim).chain(part(d.k_dim, d.k_dim)).chain(part(2 * d.k_dim, rv)).chain(part(2 * d.k_dim + rv, rv)).collect()
}

impl GatedDeltaNet {
    /// Loads `blk.{layer}.*`: GGUF `attn_qkv`/`attn_gate` + `ssm_ba` (qwen3next) or
    /// `ssm_beta`/`ssm_alpha` (qwen35moe), or HF `in_proj_qkvz` + `in_proj_ba` (Qwen3-Next) or
    /// `in_proj_qkv`/`z`/`b`/`a` (Qwen3.5); conv1d `[conv_dim, kernel]` (GGUF) or
    /// `[conv_dim, 1, kernel]` (HF); `ssm_a = −exp(A_log)` (GGUF) or `A_log` (HF).
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, la: &LinearAttnConfig, layer: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{layer}.{s}");
        let d = GdnDims::new(la);
        let h = cfg.hidden_size;
        let (vw, cd, nv) = (d.value_width(), d.conv_dim(), d.v_heads);
        let (in_proj, gather) = if l.has(&p("attn_qkv.weight")) {
            let qkv = l.linear(&p("attn_qkv"), cd, h, false)?;
            let z = l.linear(&p("attn_gate"), vw, h, false)?;
            if l.has(&p("ssm_ba.weight")) {
                let ba = l.linear(&p("ssm_ba"), 2 * nv, h, false)?;
                let index = (0..cd + vw).chain(grouped_ba(&d, cd + vw)).collect();
                (vec![qkv, z, ba], Gather::Index(index))
            } else {
                let b = l.linear(&p("ssm_beta"), nv, h, false)?;
                let a = l.linear(&p("ssm_alpha"), nv, h, false)?;
                (vec![qkv, z, b, a], Gather::Identity)
            }
        } else {
            let qkvz = l.linear(&p("ssm_in"), cd + vw, h, false)?;
            let ba = l.linear(&p("ssm_ba"), 2 * nv, h, false)?;
            let index = grouped_qkvz(&d).into_iter().chain(grouped_ba(&d, cd + vw)).collect();
            (vec![qkvz, ba], Gather::Index(index))
        };
        let conv_name = p("ssm_conv1d.weight");
        let conv_w = match l.files.tensor_shape(&conv_name).map(|s| s.len()) {
            Some(3) => host(l, &conv_name, &[cd, 1, d.kernel])?,
            _ => host(l, &conv_name, &[cd, d.kernel])?,
        };
        let a_raw = host(l, &p("ssm_a"), &[nv])?;
        let a = match l.files {
            ModelFiles::Hf(_) => a_raw.iter().map(|x| -x.exp()).collect(),
            ModelFiles::Gguf(_) => a_raw,
        };
        Ok(Self {
            in_proj,
            gather,
            conv_w,
            a,
            dt_bias: host(l, &p("ssm_dt.bias"), &[nv])?,
            norm_w: host(l, &p("ssm_norm.weight"), &[d.v_dim])?,
            eps: cfg.rms_norm_eps as f32,
            out_proj: l.linear(&p("ssm_out"), h, vw, false)?,
            dims: d,
        })
    }

    /// `x: [seq, hidden]` → `[seq, hidden]`, advancing `layer`'s recurrent state in `cache` by
    /// `seq` tokens (logged while a checkpoint is held).
    pub fn forward(&self, x: &Tensor, layer: usize, cache: &mut KvCache) -> Result<Tensor> {
        let seq = x.dim(0)?;
        let d = self.dims;
        let (kw, vw, cd, nv) = (d.key_width(), d.value_width(), d.conv_dim(), d.v_heads);
        let parts = self
            .in_proj
            .iter()
            .map(|p| p.forward(x).and_then(|y| y.flatten_all()).and_then(|y| y.to_vec1::<f32>()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let widths: Vec<usize> = self.in_proj.iter().map(Linear::out_dim).collect();
        let total: usize = widths.iter().sum();
        let (state, mut log) = cache.recurrent_mut(layer).ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} has no recurrent state")))?;

        let mut cat = vec![0f32; total];
        let mut row = vec![0f32; cd + vw + 2 * nv];
        let mut conv = vec![0f32; cd];
        let (mut decay, mut beta) = (vec![0f32; nv], vec![0f32; nv]);
        let mut mem = vec![0f32; d.v_dim];
        let mut out = vec![0f32; seq * vw];
        let head = d.k_dim * d.v_dim;
        let q_scale = 1.0 / (d.k_dim as f32).sqrt();
        for t in 0..seq {
            let mut off = 0;
            for (p, &w) in parts.iter().zip(&widths) {
                cat[off..off + w].copy_from_slice(&p[t * w..(t + 1) * w]);
                off += w;
            }
            match &self.gather {
                Gather::Identity => row.copy_from_slice(&cat),
                Gather::Index(ix) => row.iter_mut().zip(ix).for_each(|(r, &i)| *r = cat[i]),
            }
            let (raw, rest) = row.split_at(cd);
            let (z, ba) = rest.split_at(vw);
            let (b, a) = ba.split_at(nv);
            // Causal depthwise conv over [window (kernel − 1 rows), this row], then SiLU.
            let taps = d.kernel;
            for c in 0..cd {
                let w = &self.conv_w[c * taps..(c + 1) * taps];
                let mut acc = w[taps - 1] * raw[c];
                for j in 0..taps - 1 {
                    acc += w[j] * state.conv[j * cd + c];
                }
                conv[c] = silu(acc);
            }
            state.push_conv_row(raw);
            let (q, kv) = conv.split_at_mut(kw);
            let (k, v) = kv.split_at_mut(kw);
            for hd in q.chunks_exact_mut(d.k_dim) {
                l2_normalize(hd);
                hd.iter_mut().for_each(|x| *x *= q_scale);
            }
            for hd in k.chunks_exact_mut(d.k_dim) {
                l2_normalize(hd);
            }
            for hh in 0..nv {
                decay[hh] = (self.a[hh] * softplus(a[hh] + self.dt_bias[hh])).exp();
                beta[hh] = sigmoid(b[hh]);
            }
            let o_tok = &mut out[t * vw..(t + 1) * vw];
            for hh in 0..nv {
                let kh = d.key_head(hh);
                let s = &mut state.ssm[hh * head..(hh + 1) * head];
                let (kk, qq) = (&k[kh * d.k_dim..(kh + 1) * d.k_dim], &q[kh * d.k_dim..(kh + 1) * d.k_dim]);
                delta_update(s, kk, &v[hh * d.v_dim..(hh + 1) * d.v_dim], decay[hh], beta[hh], &mut mem);
                let o = &mut o_tok[hh * d.v_dim..(hh + 1) * d.v_dim];
                delta_readout(s, qq, o);
                gated_rms_norm(o, &z[hh * d.v_dim..(hh + 1) * d.v_dim], &self.norm_w, self.eps);
            }
            if let Some(l) = log.as_deref_mut() {
                l.push(raw, k, v, &decay, &beta);
            }
        }
        let out = Tensor::from_vec(out, (seq, vw), x.device())?;
        Ok(self.out_proj.forward(&out)?)
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `torch.nn.functional.softplus` (β = 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x · rsqrt(Σx² + 1e-6)` (fla / transformers `l2norm`).
fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|a| a * a).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|a| *a *= inv);
}

/// `Qwen3NextRMSNormGated`: `x · rsqrt(mean(x²) + eps) · w · silu(z)`.
fn gated_rms_norm(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let ms: f32 = x.iter().map(|a| a * a).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((a, &g), &zz) in x.iter_mut().zip(w).zip(z) {
        *a = *a * inv * g * silu(zz);
    }
}
