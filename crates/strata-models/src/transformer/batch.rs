//! The forward pass over a batch of sequences (continuous batching): every sequence's tokens are
//! stacked into one `[rows, hidden]` matrix, so each dense weight and each routed expert is read
//! once per pass for all of them — with streamed experts, a batch's experts are the union of its
//! tokens' experts, fetched once. Token mixers (attention over a sequence's own KV cache, Gated
//! DeltaNet over its own recurrent state) run per sequence; norms, projections (a Gated DeltaNet
//! layer's too), the MLP and the MoE block run over all rows. A one-sequence batch is [`Transformer::forward`].
//!
//! Each row's arithmetic does not depend on the other rows where the weights run on our kernels
//! (tile kernels are bit-identical per token, [`crate::layers::Linear::forward`]) or where the
//! batch has at most [`crate::EXACT_ROWS_MAX`] rows: a sequence's logits then equal running it
//! alone. Batches of more rows through candle's GEMM (formats other than Q4_1 / Q8_0 for dense
//! weights) may differ from single-sequence passes by float rounding.

use std::ops::Range;

use candle_core::Tensor;

use super::{residual_scaled, FeedForward, ForwardOutput, Logits, Mixer, Transformer};
use crate::attention::SeqPart;
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::moe::{ExpertFailure, LayerRouting, SeqRoute, SparseMoe};
use crate::prefetch::Prefetcher;

/// One sequence's part of a batched forward pass.
pub struct BatchSeq<'a> {
    /// Tokens to run at positions `cache.len()..` (a decode token, or a prefill chunk).
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
    /// Which of its positions get logits.
    pub logits: Logits,
}

/// Options of a batched pass shared by every sequence.
#[derive(Clone, Copy, Default)]
pub struct BatchOptions<'a> {
    /// Output hidden states of these layers ([`ForwardOutput::hidden_states`]).
    pub hidden_layers: &'a [usize],
    /// Run only the first `n` decoder layers (`None`: all; the self-speculative draft).
    pub n_layers: Option<usize>,
    /// Polled before every layer: `true` ends the pass with [`ModelError::Interrupted`].
    pub stop: Option<&'a dyn Fn() -> bool>,
    /// A sequence whose routed expert cannot be read fails alone (its result is the error), the
    /// others go on. Without it the whole pass fails.
    pub isolate_expert_errors: bool,
    /// A pass whose first sequences are one-token decode rows and whose others are prompt chunks
    /// runs as two passes, the decode rows' then the chunks' ([`Transformer::splits_mixed`]).
    /// `None`: where the model's device and experts make it pay (a GPU with every expert
    /// resident).
    pub split_mixed: Option<bool>,
    /// Host work to run while the pass runs on the device: called at most once, after the
    /// pass's launch and before its outputs are read, by the paths that launch it whole (a
    /// batched or one-sequence decode step replayed from a CUDA graph); the other paths do not
    /// call it (the caller runs it after the pass then).
    pub while_running: Option<&'a dyn Fn()>,
}

impl Transformer {
    /// Runs every sequence's tokens in one pass and commits them to its cache.
    ///
    /// Returns one result per sequence, in order: its logits (`[1 or tokens, vocab]`; on the host
    /// when several sequences ran on a GPU, read in one copy), hidden states and routing, or its
    /// own error — the cache is full, a token is outside the vocabulary, or (with
    /// [`BatchOptions::isolate_expert_errors`]) one of its experts could not be read; such a sequence's cache is left as it was in length, but may hold partial entries
    /// (clear it, or roll back, before reuse). The outer error fails the whole batch (a kernel
    /// error, [`ModelError::Interrupted`]): every cache's length is unchanged then, but layers
    /// already run have written their entries and recurrent state.
    pub fn forward_batch(
        &self,
        seqs: &mut [BatchSeq<'_>],
        opts: BatchOptions<'_>,
    ) -> Result<Vec<Result<ForwardOutput>>> {
        if let Some(d) = self.mixed_split(seqs, &opts) {
            return self.forward_split(seqs, d, opts);
        }
        #[cfg(feature = "cuda")]
        if let Some(mut out) = self.try_decode_graphed(seqs, &opts)? {
            let rows = 0..out.logits.dim(0)?;
            let one = std::slice::from_ref(&rows);
            let [(logits, greedy)]: [_; 1] =
                super::pick::split_logits(&out.logits, None, one, &[seqs[0].logits])?
                    .try_into()
                    .expect("one sequence");
            (out.logits, out.greedy) = (logits, greedy);
            return Ok(vec![Ok(out)]);
        }
        // A hybrid's batched steps keep the one-row kernels' bits (`gpu::rows_exact_scope`), in
        // a captured step as op by op.
        #[cfg(feature = "cuda")]
        if let Some(outs) = match self.has_recurrent_layers() {
            true => crate::gpu::rows_exact_scope(|| self.try_batch_graphed(seqs, &opts)),
            false => self.try_batch_graphed(seqs, &opts),
        }? {
            return Ok(outs);
        }
        let mut results: Vec<Option<Result<ForwardOutput>>> = Vec::with_capacity(seqs.len());
        let mut live = Vec::new(); // indices of sequences that run
        for (i, s) in seqs.iter().enumerate() {
            let bad = s.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size);
            let err = if s.tokens.is_empty() {
                Some(ModelError::Candle(candle_core::Error::msg("a batch entry has no tokens")))
            } else if let Some(&id) = bad {
                Some(ModelError::BadToken { id, vocab: self.cfg.vocab_size })
            } else {
                s.cache.check_room(s.tokens.len()).err()
            };
            results.push(err.map(Err));
            if results[i].is_none() {
                live.push(i);
            }
        }
        if !live.is_empty() {
            let outs = match self.has_recurrent_layers() {
                true => crate::gpu::rows_exact_scope(|| self.run_batch(seqs, &live, opts)),
                false => self.run_batch(seqs, &live, opts),
            };
            // The pass's q8 twins (`cuda` build) are not needed past it.
            #[cfg(feature = "cuda")]
            strata_kernels::cuda::release_q8_twins();
            let outs = outs?;
            for (i, out) in live.into_iter().zip(outs) {
                results[i] = Some(out);
            }
        }
        Ok(results.into_iter().map(|r| r.expect("every sequence has a result")).collect())
    }

    /// Where a mixed pass splits ([`BatchOptions::split_mixed`]): the number of leading one-token
    /// sequences, when some sequences follow them and the split is on.
    fn mixed_split(&self, seqs: &[BatchSeq<'_>], opts: &BatchOptions<'_>) -> Option<usize> {
        let d = seqs.iter().take_while(|s| s.tokens.len() == 1).count();
        let on = opts.split_mixed.unwrap_or_else(|| self.splits_mixed());
        (on && d > 0 && d < seqs.len()).then_some(d)
    }

    /// Whether a pass mixing decode rows with prompt chunks runs as two passes by default: on a
    /// GPU with every expert resident (`cuda` build, unless `STRATA_GPU_SPLIT_MIXED=0`). There
    /// the decode rows then run as a batched decode step — on the decode kernels (captured as a
    /// CUDA graph, `super::batch_graph`), so each row is what a decode step
    /// without the chunks computes — instead of as extra rows of the chunks' prompt kernels (f16
    /// tensor-core products, attention sequence by sequence), which made a running request's
    /// tokens depend on whether another request's prompt arrived beside them. Reading the weights twice costs
    /// little when they are in VRAM; where experts stream (drive, or host memory over the bus),
    /// a merged pass reads the union of both groups' experts once, so it stays merged. The CPU's
    /// decode rows keep the decode kernels in a merged pass ([`crate::prefill_scope`]).
    pub fn splits_mixed(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device.is_cuda()
                && crate::gpu::enabled(crate::gpu::GpuPath::SplitMixed)
                && self.experts.stats().is_none()
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// The most sequences a batched decode step may have to be captured and replayed as a CUDA
    /// graph (`super::batch_graph`; each batch size is captured the second time it comes), or
    /// `None` where batched steps run op by op: no `cuda` build, another device, graphs off
    /// (`STRATA_GPU_GRAPHS=0`, `STRATA_GPU_BATCH_GRAPHS=0`) or a model the graph path refuses.
    pub fn batched_graph_rows(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if crate::gpu::enabled(crate::gpu::GpuPath::BatchGraphs) && self.graph_decodable() {
            return Some(super::graph::GRAPH_ROWS_MAX);
        }
        None
    }

    /// The fewest rows a pass needs to take the prompt kernels on a GPU (`cuda` build: f16 tensor
    /// cores past `strata_kernels::cuda::MOE_MMA_ROWS_MAX` rows, which the int8 tiles take), or
    /// `None` elsewhere: a server's warm-up runs such a pass so that the first long prompt does
    /// not load their modules.
    pub fn prompt_kernel_rows(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            return Some(strata_kernels::cuda::MOE_MMA_ROWS_MAX + 1);
        }
        None
    }

    /// A mixed pass as two: `seqs[..d]` (one token each) then `seqs[d..]`, results in order. If
    /// the second fails as a whole, the first's caches go back to their lengths before the pass
    /// (so the outer error leaves every cache's length unchanged, and a hybrid's recurrent state
    /// written, as [`Self::forward_batch`] says).
    fn forward_split(
        &self,
        seqs: &mut [BatchSeq<'_>],
        d: usize,
        opts: BatchOptions<'_>,
    ) -> Result<Vec<Result<ForwardOutput>>> {
        let (decode, chunks) = seqs.split_at_mut(d);
        let inner = BatchOptions { split_mixed: Some(false), ..opts };
        let before: Vec<usize> = decode.iter().map(|s| s.cache.len()).collect();
        let mut outs = crate::prefill_scope(d, d, || self.forward_batch(decode, inner))?;
        let rows = chunks.iter().map(|s| s.tokens.len()).sum();
        match crate::prefill_scope(rows, 0, || self.forward_batch(chunks, inner)) {
            Ok(more) => {
                outs.extend(more);
                Ok(outs)
            }
            Err(e) => {
                for (s, (len, out)) in decode.iter_mut().zip(before.into_iter().zip(&outs)) {
                    if out.is_ok() {
                        s.cache.truncate(len);
                    }
                }
                Err(e)
            }
        }
    }

    /// A short pass of one sequence (a decode step, a verify pass: up to
    /// [`super::graph::GRAPH_ROWS_MAX`] tokens) through its captured CUDA graph
    /// ([`super::graph`]), when the pass asks for nothing the graph lacks; `None`: run the pass
    /// op by op.
    #[cfg(feature = "cuda")]
    fn try_decode_graphed(
        &self,
        seqs: &mut [BatchSeq<'_>],
        opts: &BatchOptions<'_>,
    ) -> Result<Option<ForwardOutput>> {
        let [s] = seqs else { return Ok(None) };
        let n = s.tokens.len();
        let plain = opts.hidden_layers.is_empty()
            && opts.n_layers.is_none_or(|n| n >= self.layers.len())
            && s.tokens.iter().all(|&t| (t as usize) < self.cfg.vocab_size)
            && s.cache.check_room(n).is_ok();
        if !plain || !self.graph_decodable() {
            return Ok(None);
        }
        if opts.stop.is_some_and(|stop| stop()) {
            return Err(ModelError::Interrupted);
        }
        self.decode_graphed(s.tokens, s.logits, s.cache, opts.while_running)
    }

    fn run_batch(
        &self,
        seqs: &mut [BatchSeq<'_>],
        live: &[usize],
        opts: BatchOptions<'_>,
    ) -> Result<Vec<Result<ForwardOutput>>> {
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(live.len());
        let mut tokens: Vec<u32> = Vec::new();
        let mut starts = Vec::with_capacity(live.len());
        for &i in live {
            let t = seqs[i].tokens;
            ranges.push(tokens.len()..tokens.len() + t.len());
            tokens.extend_from_slice(t);
            starts.push(seqs[i].cache.len());
        }
        let ids = Tensor::new(tokens.as_slice(), &self.device)?;
        let mut x = self.embed.0.embedding(&ids)?; // [rows, hidden]
        let scales = self.cfg.scales;
        if scales.embedding != 1.0 {
            x = (x * scales.embedding)?;
        }
        let mut masks = Vec::with_capacity(live.len());
        for (k, r) in ranges.iter().enumerate() {
            masks.push(SeqPart::mask_for(r.len(), starts[k], &self.device)?);
        }
        let mut hidden_states: Vec<Vec<Tensor>> = vec![Vec::new(); live.len()];
        let mut routing = Vec::new();
        let mut failed: Vec<Option<ModelError>> = (0..live.len()).map(|_| None).collect();
        let mut failures = Vec::new();
        let end = opts.n_layers.unwrap_or(self.layers.len()).clamp(1, self.layers.len());
        let modes: Vec<Logits> = live.iter().map(|&i| seqs[i].logits).collect();
        let mut caches: Vec<&mut KvCache> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| live.contains(i))
            .map(|(_, s)| &mut *s.cache)
            .collect();
        let ctx = RouteCtx { ranges: &ranges, starts: &starts, tokens: &tokens };
        #[cfg(feature = "cuda")]
        let mut on_device = {
            use super::device_routing::{synthetic_choices, DeviceRouting};
            let seqs: Vec<(usize, &[u32])> =
                ranges.iter().zip(&starts).map(|(r, &s)| (s, &tokens[r.clone()])).collect();
            let chosen = synthetic_choices(self, &mut caches, &seqs, end, None)
                .map(|ids| Tensor::new(ids, &self.device))
                .transpose()?;
            DeviceRouting::for_pass(self, &caches, tokens.len(), end, chosen)?
        };
        if let (Some(p), Some(j)) = (&self.prefetcher, self.next_moe_layer(0, end)) {
            self.prefetch_batch(p, j, &x, &ctx, &mut caches)?;
        }
        // The next layer's attention norm, computed with the residual add that ends a layer.
        let mut next_xn: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().take(end).enumerate() {
            if opts.stop.is_some_and(|s| s()) {
                return Err(ModelError::Interrupted);
            }
            let xn = match next_xn.take() {
                Some(xn) => xn,
                None => layer.attn_norm.forward(&x)?,
            };
            let h = match &layer.mixer {
                Mixer::Attention(a) => {
                    let mut parts: Vec<SeqPart<'_>> = caches
                        .iter_mut()
                        .zip(&ranges)
                        .zip(&masks)
                        .map(|((c, r), m)| SeqPart { rows: r.clone(), cache: c, mask: m.clone() })
                        .collect();
                    a.forward_batch(&xn, i, &mut parts, &self.rope)?
                }
                Mixer::GatedDeltaNet(g) => {
                    // The projections over every sequence's rows at once; the recurrence per
                    // sequence over its own state — the leading one-token sequences' (decode
                    // rows) on the device in one launch per kernel over a state table.
                    let parts = g.project_in(&xn)?;
                    let mut outs = Vec::with_capacity(ranges.len());
                    #[cfg(feature = "cuda")]
                    let first = match self.leading_state_table(g, &caches, &ranges, i)? {
                        Some((n, states)) => {
                            let rows = parts
                                .iter()
                                .map(|p| p.narrow(0, 0, n))
                                .collect::<candle_core::Result<Vec<_>>>()?;
                            outs.push(g.mix_seqs(&rows, &states)?);
                            n
                        }
                        None => 0,
                    };
                    #[cfg(not(feature = "cuda"))]
                    let first = 0;
                    for (c, r) in caches.iter_mut().zip(&ranges).skip(first) {
                        let rows = parts
                            .iter()
                            .map(|p| p.narrow(0, r.start, r.len()))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        outs.push(g.mix(&rows, i, c)?);
                    }
                    g.project_out(&cat_rows(outs)?)?
                }
            };
            // The residual add and the FFN norm: one launch on a GPU.
            let (sum, xn) =
                layer.ffn_norm.add_forward(&x, &residual_scaled(h, scales.residual)?)?;
            x = sum;
            // With device routing (`cuda` build) a fused MoE layer runs without the host.
            #[cfg(feature = "cuda")]
            let on_gpu = match (&layer.ffn, on_device.as_mut()) {
                (FeedForward::Moe(moe), Some(d)) => d.forward(moe, i, &xn, self).transpose()?,
                _ => None,
            };
            #[cfg(not(feature = "cuda"))]
            let on_gpu: Option<Tensor> = None;
            let h = match (&layer.ffn, on_gpu) {
                (_, Some(h)) => h,
                (FeedForward::Dense(m), None) => m.forward(&xn)?,
                (FeedForward::Moe(moe), None) => {
                    let r = route_batch(moe, &xn, &ctx, &mut caches, false)?;
                    self.experts.fetch_routed(i, &r.expert_ids);
                    if let Some(p) = &self.prefetcher {
                        p.observe(&r);
                        // Reads for the next MoE layer overlap this layer's experts and the next
                        // layer's token mixer.
                        if let Some(j) = self.next_moe_layer(i + 1, end) {
                            self.prefetch_batch(p, j, &x, &ctx, &mut caches)?;
                        }
                    }
                    let sink = opts.isolate_expert_errors.then_some(&mut failures);
                    let h = moe.forward_routed(&xn, &r, self.experts.as_ref(), sink)?;
                    for f in failures.drain(..) {
                        fail_rows(&mut failed, &ranges, f);
                    }
                    routing.push(r);
                    h
                }
            };
            // The residual add and the next attention norm: one launch on a GPU.
            (x, next_xn) = self.end_layer(i, end, &x, h)?;
            if opts.hidden_layers.contains(&i) {
                for (k, r) in ranges.iter().enumerate() {
                    hidden_states[k].push(x.narrow(0, r.start, r.len())?);
                }
            }
        }
        // Logits for the rows each sequence asked for, in one lm_head pass.
        let mut rows: Vec<u32> = Vec::new();
        let mut picked: Vec<Range<usize>> = Vec::with_capacity(live.len());
        for (r, mode) in ranges.iter().zip(&modes) {
            let from = rows.len();
            match mode {
                Logits::Last | Logits::Greedy => rows.push(r.end as u32 - 1),
                Logits::All => rows.extend(r.start as u32..r.end as u32),
            }
            picked.push(from..rows.len());
        }
        let x = if rows.len() == x.dim(0)? {
            x
        } else {
            x.index_select(&Tensor::new(rows.as_slice(), &self.device)?, 0)?
        };
        let mut logits = self.lm_head.forward(&self.norm.forward(&x)?)?;
        if scales.logits != 1.0 {
            logits = (logits * scales.logits)?;
        }
        // Greedy picks on the device; several sequences' other logits to the host in one copy.
        let split = super::pick::split_logits(&logits, None, &picked, &modes)?;
        // Device routing is read back after the lm_head's launch: the one wait of the pass.
        #[cfg(feature = "cuda")]
        if let Some(d) = on_device {
            routing.extend(d.read(self.experts.as_ref())?);
            routing.sort_by_key(|r: &LayerRouting| r.layer);
        }
        let mut out = Vec::with_capacity(live.len());
        let each = failed.into_iter().zip(hidden_states).zip(split);
        for (k, ((failure, states), (logits, greedy))) in each.enumerate() {
            if let Some(e) = failure {
                out.push(Err(e));
                continue;
            }
            let r = &ranges[k];
            caches[k].advance(r.len());
            let routing = routing.iter().map(|lr| slice_routing(lr, r)).collect();
            out.push(Ok(ForwardOutput { logits, greedy, hidden_states: states, routing }));
        }
        Ok(out)
    }

    /// The leading sequences of a pass through Gated DeltaNet layer `layer` that run one token
    /// each with their state on the device (at least two; [`crate::gpu::GpuPath::GdnTables`]):
    /// their count and layer `layer`'s state table over them (rows `0..count` of the pass).
    #[cfg(feature = "cuda")]
    fn leading_state_table(
        &self,
        g: &crate::gated_delta_net::GatedDeltaNet,
        caches: &[&mut KvCache],
        ranges: &[Range<usize>],
        layer: usize,
    ) -> Result<Option<(usize, strata_kernels::cuda::GdnStates)>> {
        if !g.gpu_ready() || !crate::gpu::enabled(crate::gpu::GpuPath::GdnTables) {
            return Ok(None);
        }
        let lead: Vec<&crate::recurrent::device::DeviceRecurrent> = caches
            .iter()
            .zip(ranges)
            .map_while(|(c, r)| {
                (r.len() == 1).then(|| c.recurrent_device().filter(|d| d.steppable())).flatten()
            })
            .collect();
        if lead.len() < 2 {
            return Ok(None);
        }
        // SAFETY: the states belong to this pass's caches, which outlive its launches.
        let table = unsafe { crate::recurrent::device::state_table(&lead, layer, &self.device) }?;
        Ok(table.map(|t| (lead.len(), t)))
    }

    /// Predicts MoE layer `j`'s experts for every row of `x: [rows, hidden]` (pre-gating: layer
    /// `j`'s ffn_norm and router on `x`) and the layer's last routing, and hands the prediction
    /// (the batch's union) to the provider.
    fn prefetch_batch(
        &self,
        p: &Prefetcher,
        j: usize,
        x: &Tensor,
        ctx: &RouteCtx<'_>,
        caches: &mut [&mut KvCache],
    ) -> Result<()> {
        let FeedForward::Moe(moe) = &self.layers[j].ffn else { return Ok(()) };
        let xn = self.layers[j].ffn_norm.forward(x)?;
        let pregate = route_batch(moe, &xn, ctx, caches, true)?;
        let ids = p.predict(j, Some(&pregate));
        if !ids.is_empty() {
            self.experts.prefetch(j, &ids);
        }
        Ok(())
    }
}

/// Where each sequence's rows sit in the batch and in its sequence.
struct RouteCtx<'a> {
    ranges: &'a [Range<usize>],
    /// Position of each sequence's first row.
    starts: &'a [usize],
    /// `[rows]`: the batch's token ids.
    tokens: &'a [u32],
}

/// Routes every row of `xn: [rows, hidden]`. A synthetic model's routers choose per sequence
/// (their choice depends on the sequence's history); every other router routes all rows at once.
fn route_batch(
    moe: &SparseMoe,
    xn: &Tensor,
    ctx: &RouteCtx<'_>,
    caches: &mut [&mut KvCache],
    predict: bool,
) -> Result<LayerRouting> {
    if !caches.iter_mut().any(|c| c.routing_history_mut().is_some()) {
        return moe.route_seq(xn, None, predict);
    }
    let mut all: Option<LayerRouting> = None;
    for (k, c) in caches.iter_mut().enumerate() {
        let r = &ctx.ranges[k];
        let seq = c.routing_history_mut().map(|history| SeqRoute {
            start: ctx.starts[k],
            tokens: &ctx.tokens[r.clone()],
            history,
        });
        let part = moe.route_seq(&xn.narrow(0, r.start, r.len())?, seq, predict)?;
        match all.as_mut() {
            None => all = Some(part),
            Some(a) => {
                a.expert_ids.extend(part.expert_ids);
                a.weights.extend(part.weights);
            }
        }
    }
    all.ok_or_else(|| ModelError::Candle(candle_core::Error::msg("routing an empty batch")))
}

/// Marks the sequences owning `f`'s rows as failed (the first error of each is kept).
fn fail_rows(failed: &mut [Option<ModelError>], ranges: &[Range<usize>], f: ExpertFailure) {
    for (k, r) in ranges.iter().enumerate() {
        if failed[k].is_none() && f.tokens.iter().any(|&t| r.contains(&(t as usize))) {
            failed[k] = Some(duplicate(&f.error));
        }
    }
}

/// A copy of an expert error for each sequence it fails (`ModelError` is not `Clone`).
fn duplicate(e: &ModelError) -> ModelError {
    match e {
        ModelError::ExpertRead { layer, expert, message } => {
            ModelError::ExpertRead { layer: *layer, expert: *expert, message: message.clone() }
        }
        other => ModelError::Candle(candle_core::Error::msg(other.to_string())),
    }
}

/// The rows `r` of a batch's routing.
pub(super) fn slice_routing(lr: &LayerRouting, r: &Range<usize>) -> LayerRouting {
    let k = lr.top_k;
    LayerRouting {
        layer: lr.layer,
        top_k: k,
        expert_ids: lr.expert_ids[r.start * k..r.end * k].to_vec(),
        weights: lr.weights[r.start * k..r.end * k].to_vec(),
    }
}

fn cat_rows(mut parts: Vec<Tensor>) -> candle_core::Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.pop().expect("one part"));
    }
    Tensor::cat(&parts, 0)
}
