//! Grouped-query self-attention (Ainslie et al. 2023) with RoPE, optional q/k RMSNorm (Qwen3 per head,
//! OLMoE over the whole projection), optional q/k/v clipping (OLMoE), q/k/v bias (Qwen2) and
//! sigmoid output gate (Qwen3-Next), reading and writing the preallocated [`KvCache`].
//! Reference: transformers `models/llama/modeling_llama.py`, `models/qwen3/modeling_qwen3.py`.

use candle_core::Tensor;
use strata_formats::{ModelConfig, QkNorm};

use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, WeightLoader};
use crate::rope::RotaryEmbedding;

mod cpu_batch;

/// The q, k and v projections: stacked into one matrix (one activation quantization, one dispatch)
/// when the format allows, the separate copies then dropped.
#[derive(Debug, Clone)]
enum Qkv {
    Fused(Linear),
    Separate { q: Linear, k: Linear, v: Linear },
}

#[derive(Debug, Clone)]
pub struct Attention {
    qkv: Qkv,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// Where q/k norms apply (per head, or over the whole projection).
    qk_norm: QkNorm,
    clip_qkv: Option<f64>,
    /// The q projection also computes a per-head output gate (Qwen3-Next gated attention).
    output_gate: bool,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl Attention {
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{layer}.{s}");
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, k_dim) = match cfg.qk_norm {
            QkNorm::Full => (cfg.num_heads * hd, cfg.num_kv_heads * hd),
            _ => (hd, hd),
        };
        let (q_norm, k_norm) = if cfg.qk_norm == QkNorm::None {
            (None, None)
        } else {
            (
                Some(RmsNorm::load(l, &p("attn_q_norm.weight"), q_dim, cfg.rms_norm_eps)?),
                Some(RmsNorm::load(l, &p("attn_k_norm.weight"), k_dim, cfg.rms_norm_eps)?),
            )
        };
        let gate = if cfg.attn_output_gate { 2 } else { 1 };
        let q = l.linear(&p("attn_q"), gate * cfg.num_heads * hd, h, cfg.attention_bias)?;
        let k = l.linear(&p("attn_k"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?;
        let v = l.linear(&p("attn_v"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?;
        let qkv = match Linear::fuse(&[&q, &k, &v])? {
            Some(f) => Qkv::Fused(f),
            None => Qkv::Separate { q, k, v },
        };
        Ok(Self {
            qkv,
            o: l.linear(&p("attn_output"), h, cfg.num_heads * hd, false)?,
            q_norm,
            k_norm,
            qk_norm: cfg.qk_norm,
            clip_qkv: cfg.clip_qkv,
            output_gate: cfg.attn_output_gate,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            scale: cfg.scales.attention.unwrap_or(1.0 / (hd as f64).sqrt()),
        })
    }

    /// `x: [seq, hidden]` at positions `cache.len()..+seq` → `[seq, hidden]`: a batch of one
    /// sequence ([`Self::forward_batch`]).
    pub fn forward(
        &self,
        x: &Tensor,
        layer: usize,
        cache: &mut KvCache,
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        let seq = x.dim(0)?;
        let mask = SeqPart::mask_for(seq, cache.len(), x.device())?;
        self.forward_batch(x, layer, &mut [SeqPart { rows: 0..seq, cache, mask }], rope)
    }

    /// Batched attention: `x: [rows, hidden]` holds several sequences' tokens, sequence `s` in
    /// rows `parts[s].rows` at positions `parts[s].cache.len()..` of its own cache →
    /// `[rows, hidden]`.
    /// The q/k/v and output projections run once over all rows (each row's result does not
    /// depend on the others, [`Linear::forward`]); RoPE, the KV-cache write and the attention run
    /// per sequence, so every sequence's output equals running it alone.
    pub fn forward_batch(
        &self,
        x: &Tensor,
        layer: usize,
        parts: &mut [SeqPart<'_>],
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        let (q, k, v, gate) = self.project(x)?;
        #[cfg(feature = "cuda")]
        let batched = self.attend_batch_gpu(&q, &k, &v, layer, parts, rope)?;
        #[cfg(not(feature = "cuda"))]
        let batched: Option<Tensor> = None;
        let batched = match batched {
            Some(out) => Some(out),
            None => self.attend_short_cpu(&q, &k, &v, layer, parts, rope)?,
        };
        let mut outs = Vec::with_capacity(parts.len());
        match batched {
            Some(out) => outs.push(out),
            None => {
                for p in parts.iter_mut() {
                    let (start, n) = (p.rows.start, p.rows.len());
                    let pick = |t: &Tensor| t.narrow(0, start, n);
                    let (q, k, v) = (pick(&q)?, pick(&k)?, pick(&v)?);
                    outs.push(self.attend(&q, &k, &v, layer, p.cache, rope, p.mask.as_ref())?);
                }
            }
        }
        let out = if outs.len() == 1 { outs.pop().unwrap_or(q) } else { Tensor::cat(&outs, 0)? };
        self.output(out, gate.as_ref())
    }

    /// [`Self::forward_batch`] with every row's position and cache in `rows`, a row table the
    /// caller wrote on the device (a captured CUDA graph of a batched decode step:
    /// `crate::transformer::batch_graph`): `x: [rows, hidden]` → `[rows, hidden]`. `cache` is
    /// one of the table's caches for this layer (its shape checked; the kernels take each row's
    /// own from the table).
    ///
    /// Errors: the attention cannot run on our kernels ([`Self::gpu_decodable`]), the table's
    /// rows or caches disagree with `x` and `cache`, a kernel error.
    #[cfg(feature = "cuda")]
    pub(crate) fn forward_rows(
        &self,
        x: &Tensor,
        rows: &strata_kernels::cuda::Rows,
        cache: strata_kernels::cuda::LayerKv<'_>,
        rope: &RotaryEmbedding,
    ) -> Result<Tensor> {
        let (q, k, v, gate) = self.project(x)?;
        let pos = strata_kernels::cuda::Position::Rows(rows);
        let out = self.rope_attend_gpu(&q, &k, &v, rope, pos, cache)?;
        self.output(out, gate.as_ref())
    }

    /// The q/k/v projections of `x: [rows, hidden]` over all rows: `q: [rows, nh·hd]`,
    /// `k, v: [rows, nkv·hd]`, and the output gate's `[rows, nh·hd]` of gated attention.
    #[allow(clippy::type_complexity)]
    fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let rows = x.dim(0)?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qw = if self.output_gate { 2 * nh * hd } else { nh * hd };
        let (q, k, v) = match &self.qkv {
            Qkv::Fused(qkv) => {
                let y = qkv.forward(x)?;
                (
                    y.narrow(1, 0, qw)?,
                    y.narrow(1, qw, nkv * hd)?,
                    y.narrow(1, qw + nkv * hd, nkv * hd)?,
                )
            }
            Qkv::Separate { q, k, v } => {
                #[cfg(feature = "cuda")]
                let fused = crate::layers::matvec_quant_fused(&[q, k, v], x).transpose()?;
                #[cfg(not(feature = "cuda"))]
                let fused: Option<Vec<Tensor>> = None;
                match fused.map(<[Tensor; 3]>::try_from) {
                    Some(Ok([q, k, v])) => (q, k, v),
                    _ => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
                }
            }
        };
        // Gated attention: each head's projection is [query, gate] (transformers
        // `Qwen3NextAttention`: `torch.chunk(q_proj(x).view(.., heads, 2·head_dim), 2, -1)`).
        let (q, gate) = if self.output_gate {
            let qg = q.reshape((rows, nh, 2 * hd))?;
            (
                qg.narrow(2, 0, hd)?.reshape((rows, nh * hd))?,
                Some(qg.narrow(2, hd, hd)?.reshape((rows, nh * hd))?),
            )
        } else {
            (q, None)
        };
        Ok((q, k, v, gate))
    }

    /// The attention's output `out: [rows, nh·hd]` through the output gate (when there is one)
    /// and the output projection → `[rows, hidden]`.
    fn output(&self, out: Tensor, gate: Option<&Tensor>) -> Result<Tensor> {
        let out = match gate {
            Some(g) => (out * candle_nn::ops::sigmoid(g)?)?,
            None => out,
        };
        Ok(self.o.forward(&out)?)
    }

    /// One sequence's attention: projections `q: [seq, nh·hd]`, `k, v: [seq, nkv·hd]` of tokens
    /// at positions `cache.len()..+seq` → `[seq, nh·hd]` (before the output projection), the keys
    /// and values written to `cache`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layer: usize,
        cache: &mut KvCache,
        rope: &RotaryEmbedding,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(out) = self.attend_gpu(q, k, v, layer, cache, rope)? {
            return Ok(out);
        }
        let seq = q.dim(0)?;
        if seq <= EXACT_ROWS_MAX {
            // CPU decode and verify passes: the batch path with this one sequence.
            let mut one = [SeqPart { rows: 0..seq, cache: &mut *cache, mask: None }];
            if let Some(out) = self.attend_short_cpu(q, k, v, layer, &mut one, rope)? {
                return Ok(out);
            }
        }
        let pos = cache.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        // [1, heads, seq, hd] for candle's RoPE and matmuls.
        let heads = |t: &Tensor, n: usize, norm: &Option<RmsNorm>| -> candle_core::Result<Tensor> {
            self.split_heads(t, n, norm)?.transpose(0, 1)?.unsqueeze(0)?.contiguous()
        };
        let q = heads(q, nh, &self.q_norm)?;
        let k = heads(k, nkv, &self.k_norm)?;
        let v = heads(v, nkv, &None)?;
        let q = rope.apply(&q, pos)?;
        let k = rope.apply(&k, pos)?;
        if q.device().is_cpu() {
            cache.write(layer, &k, &v)?;
            // Prefill straight over the cache storage: the blocked causal kernel, no seq × seq
            // tensors. (Up to EXACT_ROWS_MAX rows took `attend_short_cpu` above: one query row at
            // a time over its causal prefix with the decode kernel, so the logits of a short
            // multi-token pass — speculative verification — are bit-identical to decoding the
            // same tokens one by one and greedy speculation reproduces plain decoding exactly.)
            let qv = q.flatten_all()?.to_vec1::<f32>()?; // [nh, seq, hd]
            let mut rows = vec![0f32; seq * nh * hd]; // [seq, nh, hd]
            for i in 0..seq {
                for h in 0..nh {
                    rows[(i * nh + h) * hd..(i * nh + h + 1) * hd]
                        .copy_from_slice(&qv[(h * seq + i) * hd..(h * seq + i + 1) * hd]);
                }
            }
            let out = cache
                .attend_prefill(layer, &rows, seq, nh, self.scale as f32, pos + 1)?
                .ok_or_else(|| candle_core::Error::Msg("the KV cache is not on the CPU".into()))?;
            return Ok(Tensor::from_vec(out, (seq, nh * hd), q.device())?);
        }
        let (k_all, v_all) = cache.append(layer, &k, &v)?;
        // Group the query heads that share a kv head: [1, nkv, n_rep·seq, hd].
        let n_rep = nh / nkv;
        let q = q.reshape((1, nkv, n_rep * seq, hd))?;
        let att = self.causal_probs(q.matmul(&k_all.t()?)?, mask, seq, pos)?;
        let out = att.matmul(&v_all)?; // [1, nkv, n_rep·seq, hd]
        Ok(out.reshape((nh, seq, hd))?.transpose(0, 1)?.reshape((seq, nh * hd))?)
    }
}

impl Attention {
    /// `softmax(scale · scores)` under the causal mask for `scores: [1, nkv, n_rep·seq, total]` of
    /// a pass of `seq` rows after `past` cached positions: one launch of our kernel on a GPU with
    /// our attention kernels on (`strata_kernels::cuda::causal_softmax`, no mask tensor), else
    /// candle's scale, additive `mask` (`[seq, total]`, when given) and softmax.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `past`: the kernel's
    fn causal_probs(
        &self,
        scores: Tensor,
        mask: Option<&Tensor>,
        seq: usize,
        past: usize,
    ) -> candle_core::Result<Tensor> {
        let (_, nkv, rows, total) = scores.dims4()?;
        #[cfg(feature = "cuda")]
        if scores.device().is_cuda() && crate::gpu::enabled(crate::gpu::GpuPath::Attention) {
            let flat = scores.reshape((nkv * rows, total))?;
            let probs = strata_kernels::cuda::causal_softmax(flat, seq, past, self.scale as f32)?;
            return probs.reshape((1, nkv, rows, total));
        }
        let att = (scores * self.scale)?;
        let att = match mask {
            Some(m) => att
                .reshape((1, nkv, rows / seq, seq, total))?
                .broadcast_add(m)?
                .reshape((1, nkv, rows, total))?,
            None => att,
        };
        candle_nn::ops::softmax_last_dim(&att)
    }

    /// A projection `t: [seq, n · hd]` → `[seq, n, hd]` with its norm and clipping, in
    /// transformers' order: norm over the whole projection (OLMoE) → clip → split heads → norm
    /// per head (Qwen3).
    fn split_heads(
        &self,
        t: &Tensor,
        n: usize,
        norm: &Option<RmsNorm>,
    ) -> candle_core::Result<Tensor> {
        let per_head = self.qk_norm == QkNorm::PerHead;
        let t = t.contiguous()?;
        let t = match norm {
            Some(nm) if !per_head => nm.forward(&t)?,
            _ => t,
        };
        let t = match self.clip_qkv {
            Some(c) => t.clamp(-c, c)?,
            None => t,
        };
        let t = t.reshape((t.dim(0)?, n, self.head_dim))?;
        match norm {
            Some(nm) if per_head => nm.forward(&t),
            _ => Ok(t),
        }
    }

    /// Whether one-token passes of this layer run on our kernels ([`Self::attend_gpu`]) on a GPU.
    #[cfg(feature = "cuda")]
    pub fn gpu_decodable(&self) -> bool {
        self.clip_qkv.is_none() && strata_kernels::cuda::attend_supports(self.head_dim)
    }

    /// GPU path of [`Self::attend`] for passes of at most [`GPU_ATTEND_ROWS_MAX`] tokens (decode,
    /// speculative verification): q/k norms through candle on `[seq, heads, head_dim]`, then two
    /// launches of our kernels — RoPE with the KV-cache write (`rope_kv_append`) and split-K
    /// attention over the cache (`attend_decode`) — in place of candle's transposes, RoPE, cache
    /// copies, matmuls and softmax. `None`: not on a CUDA device, a longer pass, q/k/v clipping,
    /// a head dimension the kernel lacks, or `STRATA_GPU_ATTENTION=0`.
    #[cfg(feature = "cuda")]
    fn attend_gpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layer: usize,
        cache: &mut KvCache,
        rope: &RotaryEmbedding,
    ) -> Result<Option<Tensor>> {
        use strata_kernels::cuda as gpu;
        let rows = q.dim(0)?;
        let (ck, cv) = cache.layer_kv(layer)?;
        let kv = gpu::LayerKv { k: ck, v: cv };
        if self.gpu_attends(q, rows) {
            let pos = match cache.device_position() {
                Some((pos, max)) => gpu::Position::Device { pos, max },
                None => gpu::Position::Host(cache.len()),
            };
            return self.rope_attend_gpu(q, k, v, rope, pos, kv).map(Some);
        }
        if self.gpu_prefills(q, rows, ck.dtype()) {
            // Prompt passes are never captured in a CUDA graph: the host's length is the position
            // (as for candle's path), also where a graph keeps a copy of it on the device.
            let at = cache.len();
            let q = self.rope_append_gpu(q, k, v, rope, gpu::Position::Host(at), kv)?;
            return Ok(Some(gpu::attend_prefill(&q, at, self.scale as f32, kv)?));
        }
        Ok(None)
    }

    /// Whether attention over a KV cache of `dtype` values can run on the tensor-core kernels
    /// (strata-kernels' attn_tc.cuh): an f16 cache and a head dimension they have. Each caller
    /// adds its own switch (`STRATA_GPU_ATTN_TC`, `STRATA_GPU_ATTN_TC_DECODE`).
    #[cfg(feature = "cuda")]
    fn tensor_core_cache(&self, dtype: candle_core::DType) -> bool {
        dtype == candle_core::DType::F16
            && strata_kernels::cuda::attend_prefill_supports(self.head_dim)
    }

    /// Whether a prompt pass of `rows` tokens (more than [`GPU_ATTEND_ROWS_MAX`]) attends on
    /// tensor cores ([`strata_kernels::cuda::attend_prefill`]): the conditions of
    /// [`Self::gpu_attends`] but the row count, a `cache` of f16 values (`--kv-cache-dtype f16`:
    /// the kernel's inputs are f16; an f32 cache keeps the exact f32 path through candle), a
    /// head dimension the kernel has, `STRATA_GPU_ATTN_TC` not `0`.
    #[cfg(feature = "cuda")]
    fn gpu_prefills(&self, q: &Tensor, rows: usize, cache: candle_core::DType) -> bool {
        q.device().is_cuda()
            && rows > GPU_ATTEND_ROWS_MAX
            && self.tensor_core_cache(cache)
            && self.gpu_decodable()
            && crate::gpu::enabled(crate::gpu::GpuPath::Attention)
            && crate::gpu::enabled(crate::gpu::GpuPath::AttnTc)
    }

    /// Whether a pass of `rows` tokens (`q` on its device) attends on our kernels: a CUDA
    /// device, at most [`GPU_ATTEND_ROWS_MAX`] rows, no q/k/v clipping, a head dimension the
    /// kernel has, `STRATA_GPU_ATTENTION` not `0`.
    #[cfg(feature = "cuda")]
    fn gpu_attends(&self, q: &Tensor, rows: usize) -> bool {
        q.device().is_cuda()
            && rows <= GPU_ATTEND_ROWS_MAX
            && self.gpu_decodable()
            && crate::gpu::enabled(crate::gpu::GpuPath::Attention)
    }

    /// The kernels' part of [`Self::attend_gpu`] and [`Self::attend_batch_gpu`]: RoPE with the
    /// KV-cache write ([`Self::rope_append_gpu`]), then split-K attention at `pos` over `cache`
    /// → `[rows, nh·hd]`: on tensor cores for an f16 cache (`attend_decode_tc`, unless
    /// `STRATA_GPU_ATTN_TC_DECODE=0`), else `attend_decode`.
    #[cfg(feature = "cuda")]
    fn rope_attend_gpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &RotaryEmbedding,
        pos: strata_kernels::cuda::Position<'_>,
        cache: strata_kernels::cuda::LayerKv<'_>,
    ) -> Result<Tensor> {
        use strata_kernels::cuda as gpu;
        let q = self.rope_append_gpu(q, k, v, rope, pos, cache)?;
        // An f16 cache: the tensor-core split-K kernel (row tables too, so that a batched row
        // is the same bits as the sequence alone).
        if self.tensor_core_cache(cache.k.dtype())
            && crate::gpu::enabled(crate::gpu::GpuPath::AttnTcDecode)
        {
            return Ok(gpu::attend_decode_tc(&q, pos, self.scale as f32, cache)?);
        }
        Ok(gpu::attend_decode(&q, pos, self.scale as f32, cache)?)
    }

    /// q/k norms and head splits of the projections `q: [rows, nh·hd]`, `k, v: [rows, nkv·hd]`,
    /// then one launch of RoPE with the KV-cache write at `pos` (`rope_kv_append`) → the rotated
    /// `q: [rows, nh, hd]`.
    #[cfg(feature = "cuda")]
    fn rope_append_gpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &RotaryEmbedding,
        pos: strata_kernels::cuda::Position<'_>,
        cache: strata_kernels::cuda::LayerKv<'_>,
    ) -> Result<Tensor> {
        use strata_kernels::cuda as gpu;
        // Per-head q/k norms inside the RoPE kernel (Qwen3), unless STRATA_GPU_FUSE=0.
        let norms = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn))
                if self.qk_norm == QkNorm::PerHead
                    && crate::gpu::enabled(crate::gpu::GpuPath::Fuse) =>
            {
                let ((qw, eps), (kw, _)) = (qn.weight_eps(), kn.weight_eps());
                Some(gpu::HeadNorms { q: qw, k: kw, eps })
            }
            _ => None,
        };
        let (qn, kn) = if norms.is_some() { (&None, &None) } else { (&self.q_norm, &self.k_norm) };
        let q = self.split_heads(q, self.num_heads, qn)?;
        let k = self.split_heads(k, self.num_kv_heads, kn)?;
        let v = self.split_heads(v, self.num_kv_heads, &None)?;
        let (cos, sin, style) = rope.tables();
        let style = gpu_rope_style(style);
        Ok(gpu::rope_kv_append(&q, &k, &v, cos, sin, style, pos, cache, norms)?)
    }

    /// [`Self::attend_gpu`] for a batched pass over several sequences, in two launches for all of
    /// them: the q/k norms and head splits once over the batch's rows, then RoPE with the
    /// KV-cache writes and split-K attention with each row's position and cache read from a row
    /// table ([`strata_kernels::cuda::RowTable`], one small host-to-device copy per layer). A
    /// batched prompt pass whose every sequence has more than [`GPU_ATTEND_ROWS_MAX`] tokens
    /// (requests that arrive together) takes the prompt-pass kernel over the same table
    /// ([`strata_kernels::cuda::attend_prefill_rows`]: each sequence the same bits as its
    /// [`Self::attend_gpu`] alone). `None` where the per-sequence path must run: the conditions
    /// of [`Self::attend_gpu`], a single sequence, a mix of short and long parts, caches of
    /// different capacities, or a cache whose position lives on the device (a captured CUDA
    /// graph).
    #[cfg(feature = "cuda")]
    fn attend_batch_gpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layer: usize,
        parts: &[SeqPart<'_>],
        rope: &RotaryEmbedding,
    ) -> Result<Option<Tensor>> {
        use strata_kernels::cuda as gpu;
        let cap = parts.first().map(|p| p.cache.capacity());
        let longest = parts.iter().map(|p| p.rows.len()).max().unwrap_or(0);
        let shortest = parts.iter().map(|p| p.rows.len()).min().unwrap_or(0);
        let Some(first) = parts.first() else { return Ok(None) };
        let (ck, cv) = first.cache.layer_kv(layer)?;
        let cache = gpu::LayerKv { k: ck, v: cv };
        // Every part a prompt chunk that alone would take `attend_prefill`.
        let prompts = shortest > GPU_ATTEND_ROWS_MAX
            && self.gpu_prefills(q, longest, ck.dtype())
            && crate::gpu::enabled(crate::gpu::GpuPath::AttnTcRows);
        if parts.len() < 2
            || !(prompts || self.gpu_attends(q, longest))
            || parts
                .iter()
                .any(|p| Some(p.cache.capacity()) != cap || p.cache.device_position().is_some())
        {
            return Ok(None);
        }
        // One table row per batch row: the parts' rows, in order (forward_batch's layout).
        let mut table = gpu::RowTable::default();
        let mut next = 0;
        for p in parts.iter() {
            if p.rows.start != next {
                return Ok(None);
            }
            next = p.rows.end;
            let (ck, cv) = p.cache.layer_kv(layer)?;
            table.push(p.cache.len(), p.rows.len(), gpu::LayerKv { k: ck, v: cv })?;
        }
        if prompts {
            let table = table.upload_segments(q.device())?;
            let at = gpu::Position::Rows(table.rows());
            let q = self.rope_append_gpu(q, k, v, rope, at, cache)?;
            return Ok(Some(gpu::attend_prefill_rows(&q, &table, self.scale as f32, cache)?));
        }
        let rows = table.upload(q.device())?;
        self.rope_attend_gpu(q, k, v, rope, gpu::Position::Rows(&rows), cache).map(Some)
    }
}

/// The kernels' name for a model's RoPE style.
#[cfg(feature = "cuda")]
fn gpu_rope_style(style: strata_formats::RopeStyle) -> strata_kernels::cuda::RopeStyle {
    match style {
        strata_formats::RopeStyle::Neox => strata_kernels::cuda::RopeStyle::Neox,
        strata_formats::RopeStyle::Interleaved => strata_kernels::cuda::RopeStyle::Interleaved,
    }
}

/// Passes of at most this many tokens attend with our CUDA kernels on a GPU (decode and
/// speculative verification); longer ones (prefill) through candle's matmuls.
pub const GPU_ATTEND_ROWS_MAX: usize = 16;

/// One sequence's rows in a batched pass.
pub struct SeqPart<'a> {
    /// Its rows of the batch's `[rows, hidden]` input.
    pub rows: std::ops::Range<usize>,
    /// Its KV cache; the rows sit at positions `cache.len()..`.
    pub cache: &'a mut KvCache,
    /// Additive causal mask `[rows, cache.len() + rows]` for GPU passes attended by GEMM
    /// ([`SeqPart::mask_for`]).
    pub mask: Option<Tensor>,
}

impl SeqPart<'_> {
    /// The mask a pass of `seq` tokens after `past` cached ones needs: `None` where attention
    /// runs over the cache storage without one (one token, or any CPU pass) or masks in its
    /// kernel (a GPU pass with our attention kernels on).
    pub fn mask_for(
        seq: usize,
        past: usize,
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<Tensor>> {
        if seq <= 1 || device.is_cpu() {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if crate::gpu::enabled(crate::gpu::GpuPath::Attention) {
            return Ok(None); // `strata_kernels::cuda::causal_softmax` masks as it goes
        }
        causal_mask(seq, past, device).map(Some)
    }
}

/// Passes of at most this many tokens attend row by row with the decode kernel (CPU), which makes
/// their logits bit-identical to token-by-token decoding (speculative verification widths).
pub const EXACT_ROWS_MAX: usize = 32;

/// Additive causal mask `[seq, past + seq]`: query i may see keys `0..=past + i`.
pub fn causal_mask(
    seq: usize,
    past: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let total = past + seq;
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| (0..total).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (seq, total), device)
}
