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
//! Passes of more than `EXACT_ROWS_MAX` tokens (prefill) run the chunked parallel form
//! ([`chunked_delta_rule`]); shorter ones (decode, speculative verification) the recurrent form.
//!
//! On a CUDA device whose sequence keeps its recurrent state there
//! ([`crate::recurrent::RecurrentCache::on_device`]) the layer runs on our kernels
//! (`strata_kernels::cuda::gdn_*`, `GatedDeltaNet::mix_gpu`): nothing goes to the host. There
//! too, passes of more than `EXACT_ROWS_MAX` tokens take the chunked form (`gdn_delta_chunked`,
//! key heads of up to 128) and shorter ones the recurrent form (a warp per state column).

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
    /// The same weights on the device (`cuda` build, a CUDA model).
    #[cfg(feature = "cuda")]
    gpu: Option<GpuWeights>,
}

/// A layer's small weights on the device, and the gather of its projections' outputs.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
struct GpuWeights {
    /// `[conv_dim, kernel]`.
    conv_w: Tensor,
    /// `−exp(A_log)`, `[v_heads]`.
    a_neg: Tensor,
    /// `[v_heads]`.
    dt_bias: Tensor,
    /// `[v_dim]`.
    norm_w: Tensor,
    /// [`Gather::Index`] as u32 channel indices `[conv_dim + value_width + 2·v_heads]`.
    index: Option<Tensor>,
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
    let part = |off: usize, width: usize| {
        (0..d.k_heads).flat_map(move |g| (0..width).map(move |i| g * group + off + i))
    };
    part(0, d.k_dim)
        .chain(part(d.k_dim, d.k_dim))
        .chain(part(2 * d.k_dim, rv))
        .chain(part(2 * d.k_dim + rv, rv))
        .collect()
}

impl GatedDeltaNet {
    /// Loads `blk.{layer}.*`: GGUF `attn_qkv`/`attn_gate` + `ssm_ba` (qwen3next) or
    /// `ssm_beta`/`ssm_alpha` (qwen35moe), or HF `in_proj_qkvz` + `in_proj_ba` (Qwen3-Next) or
    /// `in_proj_qkv`/`z`/`b`/`a` (Qwen3.5); conv1d `[conv_dim, kernel]` (GGUF) or
    /// `[conv_dim, 1, kernel]` (HF); `ssm_a = −exp(A_log)` (GGUF) or `A_log` (HF).
    pub fn load(
        l: &WeightLoader,
        cfg: &ModelConfig,
        la: &LinearAttnConfig,
        layer: usize,
    ) -> Result<Self> {
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
        // One matrix (one activation quantization, one dispatch) when the format allows: the
        // concatenated outputs are the same.
        let in_proj = match Linear::fuse(&in_proj.iter().collect::<Vec<_>>())? {
            Some(f) => vec![f],
            None => in_proj,
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
        let dt_bias = host(l, &p("ssm_dt.bias"), &[nv])?;
        let norm_w = host(l, &p("ssm_norm.weight"), &[d.v_dim])?;
        #[cfg(feature = "cuda")]
        let gpu = if l.device.is_cuda() {
            let dev = &l.device;
            let t = |v: &[f32], shape: &[usize]| Tensor::from_slice(v, shape, dev);
            let index = match &gather {
                Gather::Identity => None,
                Gather::Index(ix) => {
                    let ix: Vec<u32> = ix.iter().map(|&i| i as u32).collect();
                    Some(Tensor::from_vec(ix, cd + vw + 2 * nv, dev)?)
                }
            };
            Some(GpuWeights {
                conv_w: t(&conv_w, &[cd, d.kernel])?,
                a_neg: t(&a, &[nv])?,
                dt_bias: t(&dt_bias, &[nv])?,
                norm_w: t(&norm_w, &[d.v_dim])?,
                index,
            })
        } else {
            None
        };
        Ok(Self {
            in_proj,
            gather,
            conv_w,
            a,
            dt_bias,
            norm_w,
            eps: cfg.rms_norm_eps as f32,
            out_proj: l.linear(&p("ssm_out"), h, vw, false)?,
            dims: d,
            #[cfg(feature = "cuda")]
            gpu,
        })
    }

    /// Whether this layer runs on our kernels when its sequence keeps the state on the device
    /// (weights on a CUDA device, a shape the kernels take).
    #[cfg(feature = "cuda")]
    pub(crate) fn gpu_ready(&self) -> bool {
        self.gpu.is_some() && self.dims.gpu_shape().supported()
    }

    /// [`Self::mix`] on the device: the in-projections' outputs gathered into `[T, qkv | z | b |
    /// a]` rows, then `gdn_conv` → `gdn_delta` → `gdn_gated_norm` on the sequence's device state.
    /// `None` when this sequence's state is on the host (or the weights are not on the device).
    #[cfg(feature = "cuda")]
    fn mix_gpu(
        &self,
        parts: &[Tensor],
        layer: usize,
        cache: &mut KvCache,
    ) -> Option<Result<Tensor>> {
        let w = self.gpu.as_ref()?;
        let dev = cache.recurrent_device_mut()?;
        let mut run = || -> Result<Tensor> {
            use strata_kernels::cuda::{gdn_conv, gdn_delta, gdn_delta_chunked, gdn_gated_norm};
            let s = *dev.shape();
            let row = gather_rows(parts, w)?;
            let (state, log) = dev.layer_mut(layer)?.ok_or_else(|| {
                candle_core::Error::Msg(format!("layer {layer} has no recurrent state"))
            })?;
            let qkv = gdn_conv(&s, &row, &state.conv, Some(&w.conv_w))?
                .ok_or_else(|| candle_core::Error::msg("gdn_conv gave no output"))?;
            let q_scale = 1.0 / (self.dims.k_dim as f32).sqrt();
            let (a, dt, ssm) = (&w.a_neg, &w.dt_bias, &state.ssm);
            let o = if row.dim(0)? > crate::attention::EXACT_ROWS_MAX && s.takes_chunked() {
                gdn_delta_chunked(&s, &qkv, &row, a, dt, ssm, q_scale)?
            } else {
                gdn_delta(&s, &qkv, &row, a, dt, ssm, q_scale, true)?
                    .ok_or_else(|| candle_core::Error::msg("gdn_delta gave no output"))?
            };
            if let Some(log) = log {
                log.push(&row, &qkv, &w.a_neg, &w.dt_bias);
            }
            Ok(gdn_gated_norm(&s, o, &row, &w.norm_w, self.eps)?)
        };
        Some(run())
    }

    /// A batched decode step on the device (`cuda` build): `x: [n, hidden]`, row `i` one token of
    /// the sequence whose state for this layer is `states`' row `i` → `[n, hidden]`, each state
    /// advanced by its token. The projections over every row at once, then the conv and the
    /// delta rule in one launch each over the state table (`gdn_conv_seqs`, `gdn_delta_seqs`:
    /// the kernels of [`Self::mix`] on the device, so each row equals its sequence's own step bit
    /// for bit) — what a captured batched step of a hybrid runs (`transformer::batch_graph`).
    ///
    /// Errors: weights not on the device, a table of another shape or row count, kernel errors.
    #[cfg(feature = "cuda")]
    pub(crate) fn forward_seqs(
        &self,
        x: &Tensor,
        states: &strata_kernels::cuda::GdnStates,
    ) -> Result<Tensor> {
        self.project_out(&self.mix_seqs(&self.project_in(x)?, states)?)
    }

    /// [`Self::mix`] of `n` sequences one token each (`cuda` build): `parts` ([`Self::project_in`]'s
    /// outputs for their `n` rows, in the table's order) → `[n, v_heads · v_dim]`, each state of
    /// `states` advanced by its token — [`Self::forward_seqs`] without the projections (an
    /// op-by-op batched pass's decode rows, `transformer::batch`).
    ///
    /// Errors: as [`Self::forward_seqs`].
    #[cfg(feature = "cuda")]
    pub(crate) fn mix_seqs(
        &self,
        parts: &[Tensor],
        states: &strata_kernels::cuda::GdnStates,
    ) -> Result<Tensor> {
        use strata_kernels::cuda::{gdn_conv_seqs, gdn_delta_seqs, gdn_gated_norm};
        let w = self.gpu.as_ref().ok_or_else(|| {
            candle_core::Error::msg("a Gated DeltaNet layer's weights are not on the device")
        })?;
        let s = self.dims.gpu_shape();
        let row = gather_rows(parts, w)?;
        let qkv = gdn_conv_seqs(&s, &row, states, &w.conv_w)?;
        let q_scale = 1.0 / (self.dims.k_dim as f32).sqrt();
        let o = gdn_delta_seqs(&s, &qkv, &row, &w.a_neg, &w.dt_bias, states, q_scale)?;
        Ok(gdn_gated_norm(&s, o, &row, &w.norm_w, self.eps)?)
    }

    /// `x: [seq, hidden]` → `[seq, hidden]`, advancing `layer`'s recurrent state in `cache` by
    /// `seq` tokens (logged while a checkpoint is held): [`Self::project_in`], [`Self::mix`],
    /// [`Self::project_out`].
    pub fn forward(&self, x: &Tensor, layer: usize, cache: &mut KvCache) -> Result<Tensor> {
        let parts = self.project_in(x)?;
        self.project_out(&self.mix(&parts, layer, cache)?)
    }

    /// The in-projections of `x: [rows, hidden]`: one `[rows, width]` tensor per projection (a
    /// batched pass projects every sequence's rows at once, each weight read once; a row's
    /// result is its result alone where the products are row-independent — on a GPU, a hybrid's
    /// batched passes keep the one-row kernels' bits, [`crate::gpu::rows_exact_scope`]).
    pub fn project_in(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        Ok(self.in_proj.iter().map(|p| p.forward(x)).collect::<candle_core::Result<_>>()?)
    }

    /// The out-projection of [`Self::mix`]'s outputs `[rows, v_heads · v_dim]` → `[rows, hidden]`.
    pub fn project_out(&self, y: &Tensor) -> Result<Tensor> {
        Ok(self.out_proj.forward(y)?)
    }

    /// One sequence's token mixing: `parts` ([`Self::project_in`]'s outputs for its `seq` rows, in
    /// order) → `[seq, v_heads · v_dim]` (the gated, normed delta-rule readout), advancing
    /// `layer`'s recurrent state in `cache` by `seq` tokens (logged while a checkpoint is held).
    /// The causal conv and the gated delta rule as in transformers' `Qwen3NextGatedDeltaNet`
    /// (`modeling_qwen3_next.py`; Yang et al. 2024, "Gated Delta Networks").
    pub fn mix(&self, parts: &[Tensor], layer: usize, cache: &mut KvCache) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(out) = self.mix_gpu(parts, layer, cache) {
            return out;
        }
        let seq = parts.first().map_or(Ok(0), |p| p.dim(0))?;
        let device = parts.first().map(|p| p.device().clone()).unwrap_or(candle_core::Device::Cpu);
        if !device.is_cpu() {
            crate::gpu::note_host_reads(self.in_proj.len() as u64);
        }
        let d = self.dims;
        let (kw, vw, cd, nv) = (d.key_width(), d.value_width(), d.conv_dim(), d.v_heads);
        let parts = parts
            .iter()
            .map(|y| y.flatten_all().and_then(|y| y.to_vec1::<f32>()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let widths: Vec<usize> = self.in_proj.iter().map(Linear::out_dim).collect();
        let total: usize = widths.iter().sum();
        let (state, mut log) = cache.recurrent_mut(layer).ok_or_else(|| {
            candle_core::Error::Msg(format!("layer {layer} has no recurrent state"))
        })?;

        let mut cat = vec![0f32; total];
        let mut row = vec![0f32; cd + vw + 2 * nv];
        let mut conv = vec![0f32; cd];
        // Per token: q, k (normalised), v, log-decay g, β, and the output gate z.
        let (mut q_all, mut k_all, mut v_all) =
            (vec![0f32; seq * kw], vec![0f32; seq * kw], vec![0f32; seq * vw]);
        let (mut g_all, mut beta_all, mut z_all) =
            (vec![0f32; seq * nv], vec![0f32; seq * nv], vec![0f32; seq * vw]);
        let mut decay = vec![0f32; nv];
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
                for (j, &wj) in w[..taps - 1].iter().enumerate() {
                    acc += wj * state.conv[j * cd + c];
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
            let (g, beta) = (&mut g_all[t * nv..(t + 1) * nv], &mut beta_all[t * nv..(t + 1) * nv]);
            for hh in 0..nv {
                g[hh] = self.a[hh] * softplus(a[hh] + self.dt_bias[hh]);
                decay[hh] = g[hh].exp();
                beta[hh] = sigmoid(b[hh]);
            }
            if let Some(l) = log.as_deref_mut() {
                l.push(raw, k, v, &decay, beta);
            }
            q_all[t * kw..(t + 1) * kw].copy_from_slice(q);
            k_all[t * kw..(t + 1) * kw].copy_from_slice(k);
            v_all[t * vw..(t + 1) * vw].copy_from_slice(v);
            z_all[t * vw..(t + 1) * vw].copy_from_slice(z);
        }
        // The delta rule per value head over the whole pass: recurrent for short passes (decode and
        // speculative verification: bit-identical however the tokens are batched), chunked for prefill.
        let mut out = vec![0f32; seq * vw];
        let head = d.k_dim * d.v_dim;
        let (dk, dv) = (d.k_dim, d.v_dim);
        let (ssm, outp) = (SendPtr(state.ssm.as_mut_ptr()), SendPtr(out.as_mut_ptr()));
        // Value heads are independent: split them over candle's barrier pool (the calling thread
        // works too). Each head's arithmetic is the same whichever thread runs it.
        candle_core::utils::barrier_pool().execute_chunked(nv, |heads| {
            let (ssm, outp) = (ssm, outp);
            let mut mem = vec![0f32; dv];
            let (mut hq, mut hk) = (vec![0f32; seq * dk], vec![0f32; seq * dk]);
            let (mut hv, mut ho) = (vec![0f32; seq * dv], vec![0f32; seq * dv]);
            for hh in heads {
                let kh = d.key_head(hh);
                // SAFETY: head hh's state slice is touched by this task only.
                let s = unsafe { std::slice::from_raw_parts_mut(ssm.0.add(hh * head), head) };
                for t in 0..seq {
                    hq[t * dk..(t + 1) * dk]
                        .copy_from_slice(&q_all[t * kw + kh * dk..t * kw + (kh + 1) * dk]);
                    hk[t * dk..(t + 1) * dk]
                        .copy_from_slice(&k_all[t * kw + kh * dk..t * kw + (kh + 1) * dk]);
                    hv[t * dv..(t + 1) * dv]
                        .copy_from_slice(&v_all[t * vw + hh * dv..t * vw + (hh + 1) * dv]);
                }
                let g: Vec<f32> = (0..seq).map(|t| g_all[t * nv + hh]).collect();
                let beta: Vec<f32> = (0..seq).map(|t| beta_all[t * nv + hh]).collect();
                if seq > crate::attention::EXACT_ROWS_MAX {
                    chunked_delta_rule(s, &hq, &hk, &hv, &g, &beta, CHUNK, &mut ho);
                } else {
                    for t in 0..seq {
                        delta_update(
                            s,
                            &hk[t * dk..(t + 1) * dk],
                            &hv[t * dv..(t + 1) * dv],
                            g[t].exp(),
                            beta[t],
                            &mut mem,
                        );
                        delta_readout(s, &hq[t * dk..(t + 1) * dk], &mut ho[t * dv..(t + 1) * dv]);
                    }
                }
                for t in 0..seq {
                    // SAFETY: columns hh·dv..(hh+1)·dv of every row are written by this task only.
                    let o =
                        unsafe { std::slice::from_raw_parts_mut(outp.0.add(t * vw + hh * dv), dv) };
                    o.copy_from_slice(&ho[t * dv..(t + 1) * dv]);
                    gated_rms_norm(
                        o,
                        &z_all[t * vw + hh * dv..t * vw + (hh + 1) * dv],
                        &self.norm_w,
                        self.eps,
                    );
                }
            }
        });
        Ok(Tensor::from_vec(out, (seq, vw), &device)?)
    }
}

/// The in-projections' outputs `parts` (each `[rows, width]`) as the device kernels' input rows
/// `[rows, qkv | z | b | a]`: concatenated, then gathered where the format groups them.
#[cfg(feature = "cuda")]
fn gather_rows(parts: &[Tensor], w: &GpuWeights) -> candle_core::Result<Tensor> {
    let cat = match parts {
        [one] => one.clone(),
        _ => Tensor::cat(parts, 1)?,
    };
    match &w.index {
        None => cat.contiguous(),
        Some(ix) => cat.index_select(ix, 1),
    }
}

/// A raw pointer shared by the head tasks, each writing disjoint ranges.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint ranges (see the call sites) and the pool joins before the owner is used.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

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

/// Chunk length of [`chunked_delta_rule`] (fla's and transformers' default).
pub const CHUNK: usize = 64;

/// The gated delta rule over a whole sequence for one value head, chunk by chunk (the WY / UT
/// transform form of Yang et al. 2024, §3.3; transformers `torch_chunk_gated_delta_rule`): inside a
/// chunk the intra-chunk dependencies are solved with a lower-triangular system, across chunks the
/// state is carried. Equal to [`delta_update`] + [`delta_readout`] token by token up to rounding.
///
/// `s: [k_dim, v_dim]` (updated in place), `q, k: [T, k_dim]` (normalised, q scaled),
/// `v: [T, v_dim]`, `g: [T]` log-decays (≤ 0), `beta: [T]`, `out: [T, v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn chunked_delta_rule(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    chunk: usize,
    out: &mut [f32],
) {
    let t_len = g.len();
    let dk = k.len() / t_len.max(1);
    let dv = v.len() / t_len.max(1);
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let mut a = vec![0f32; chunk * chunk];
    let mut u = vec![0f32; chunk * dv];
    let mut w = vec![0f32; chunk * dk];
    let mut cum = vec![0f32; chunk];
    let mut row = vec![0f32; chunk];
    for c0 in (0..t_len).step_by(chunk) {
        let n = chunk.min(t_len - c0);
        let kt = |i: usize| &k[(c0 + i) * dk..(c0 + i + 1) * dk];
        let qt = |i: usize| &q[(c0 + i) * dk..(c0 + i + 1) * dk];
        let vt = |i: usize| &v[(c0 + i) * dv..(c0 + i + 1) * dv];
        let mut acc = 0f32;
        for i in 0..n {
            acc += g[c0 + i];
            cum[i] = acc;
        }
        // A[i][j] = −β_i (k_i·k_j) e^{G_i − G_j} for j < i, then (I − A)⁻¹ by forward substitution.
        a[..n * chunk].fill(0.0);
        for i in 1..n {
            for j in 0..i {
                a[i * chunk + j] = -beta[c0 + i] * dot(kt(i), kt(j)) * (cum[i] - cum[j]).exp();
            }
        }
        for i in 1..n {
            row[..i].copy_from_slice(&a[i * chunk..i * chunk + i]);
            for j in 0..i {
                let mut x = row[j];
                for m in j + 1..i {
                    x += row[m] * a[m * chunk + j];
                }
                a[i * chunk + j] = x;
            }
        }
        // T = A + I; U = T·(β v); W = T·(β k e^{G}).
        for i in 0..n {
            let (ui, wi) = (&mut u[i * dv..(i + 1) * dv], &mut w[i * dk..(i + 1) * dk]);
            ui.fill(0.0);
            wi.fill(0.0);
            for j in 0..=i {
                let tij = if j == i { 1.0 } else { a[i * chunk + j] };
                let bj = beta[c0 + j];
                let ej = cum[j].exp();
                for (x, &y) in ui.iter_mut().zip(vt(j)) {
                    *x += tij * bj * y;
                }
                for (x, &y) in wi.iter_mut().zip(kt(j)) {
                    *x += tij * bj * ej * y;
                }
            }
        }
        // v_new = U − W·S (stored in u).
        for i in 0..n {
            for (r, &wk) in w[i * dk..(i + 1) * dk].iter().enumerate() {
                let srow = &s[r * dv..(r + 1) * dv];
                for (x, &sv) in u[i * dv..(i + 1) * dv].iter_mut().zip(srow) {
                    *x -= wk * sv;
                }
            }
        }
        // out_i = (q_i e^{G_i})·S + Σ_{j≤i} (q_i·k_j) e^{G_i − G_j} v_new_j.
        for i in 0..n {
            let o = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
            o.fill(0.0);
            let ei = cum[i].exp();
            for (r, &qr) in qt(i).iter().enumerate() {
                let f = qr * ei;
                for (x, &sv) in o.iter_mut().zip(&s[r * dv..(r + 1) * dv]) {
                    *x += f * sv;
                }
            }
            for j in 0..=i {
                let f = dot(qt(i), kt(j)) * (cum[i] - cum[j]).exp();
                for (x, &y) in o.iter_mut().zip(&u[j * dv..(j + 1) * dv]) {
                    *x += f * y;
                }
            }
        }
        // S ← S e^{G_last} + Σ_j (k_j e^{G_last − G_j}) ⊗ v_new_j.
        let last = cum[n - 1];
        let el = last.exp();
        s.iter_mut().for_each(|x| *x *= el);
        for j in 0..n {
            let f = (last - cum[j]).exp();
            for (r, &kr) in kt(j).iter().enumerate() {
                let kf = kr * f;
                for (x, &y) in s[r * dv..(r + 1) * dv].iter_mut().zip(&u[j * dv..(j + 1) * dv]) {
                    *x += kf * y;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked form equals the recurrent form (outputs and final state) over several chunks,
    /// a partial last chunk included, from a non-zero initial state.
    #[test]
    fn chunked_equals_recurrent() {
        let (t_len, dk, dv) = (150, 16, 8);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut q: Vec<f32> = (0..t_len * dk).map(|_| rnd()).collect();
        let mut k: Vec<f32> = (0..t_len * dk).map(|_| rnd()).collect();
        q.chunks_exact_mut(dk).for_each(|h| {
            l2_normalize(h);
            h.iter_mut().for_each(|a| *a /= (dk as f32).sqrt());
        });
        k.chunks_exact_mut(dk).for_each(l2_normalize);
        let v: Vec<f32> = (0..t_len * dv).map(|_| rnd()).collect();
        let g: Vec<f32> = (0..t_len).map(|_| -0.3 * (rnd() + 1.0)).collect();
        let beta: Vec<f32> = (0..t_len).map(|_| sigmoid(2.0 * rnd())).collect();
        let s0: Vec<f32> = (0..dk * dv).map(|_| 0.5 * rnd()).collect();

        let (mut s_rec, mut out_rec, mut mem) =
            (s0.clone(), vec![0f32; t_len * dv], vec![0f32; dv]);
        for t in 0..t_len {
            delta_update(
                &mut s_rec,
                &k[t * dk..(t + 1) * dk],
                &v[t * dv..(t + 1) * dv],
                g[t].exp(),
                beta[t],
                &mut mem,
            );
            delta_readout(&s_rec, &q[t * dk..(t + 1) * dk], &mut out_rec[t * dv..(t + 1) * dv]);
        }
        let (mut s_chk, mut out_chk) = (s0, vec![0f32; t_len * dv]);
        chunked_delta_rule(&mut s_chk, &q, &k, &v, &g, &beta, CHUNK, &mut out_chk);
        let diff =
            |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff(&out_rec, &out_chk) < 1e-5, "outputs differ by {}", diff(&out_rec, &out_chk));
        assert!(diff(&s_rec, &s_chk) < 1e-5, "states differ by {}", diff(&s_rec, &s_chk));
    }
}
