//! Sparse Mixture-of-Experts block (Shazeer et al. 2017, "Outrageously Large Neural Networks";
//! Mixtral: Jiang et al. 2024). Reference: transformers `models/qwen2_moe/modeling_qwen2_moe.py`
//! (`Qwen2MoeTopKRouter`, `Qwen2MoeSparseMoeBlock`), `models/mixtral/modeling_mixtral.py`,
//! `models/olmoe/modeling_olmoe.py`.
//!
//! `router logits = x Wᵣᵀ` → scores (softmax over experts, in f32, or sigmoid) → top-k → optional
//! renormalisation → `Σₖ wₖ · expertₖ(x)`, plus `sigmoid(x W_gᵀ) · shared(x)` when there is a shared
//! expert. Experts are read through an [`ExpertProvider`].

use std::collections::BTreeMap;

use candle_core::Tensor;
use strata_formats::{ModelConfig, MoeConfig, RouterScoring};

use crate::error::Result;
use crate::experts::{ExpertProvider, FusedCall};
use crate::layers::{Linear, WeightLoader};
use crate::mlp::Mlp;
use crate::synthetic_routing::{LayerHistory, RoutingHistory, SyntheticRouter};

/// The routing decision of one MoE layer for a batch of tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRouting {
    pub layer: usize,
    pub top_k: usize,
    /// `[seq · top_k]`: token `t`'s experts are `expert_ids[t·k..(t+1)·k]`, highest score first.
    pub expert_ids: Vec<u32>,
    /// `[seq · top_k]`: the weights applied to those experts' outputs.
    pub weights: Vec<f32>,
}

impl LayerRouting {
    pub fn num_tokens(&self) -> usize {
        self.expert_ids.len() / self.top_k.max(1)
    }

    /// Expert ids and weights of token `t`.
    pub fn token(&self, t: usize) -> (&[u32], &[f32]) {
        let r = t * self.top_k..(t + 1) * self.top_k;
        (&self.expert_ids[r.clone()], &self.weights[r])
    }

    /// Distinct experts this batch touches, ascending.
    pub fn distinct_experts(&self) -> Vec<u32> {
        let mut v = self.expert_ids.clone();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// A routed expert that could not be had in a pass that tolerates it
/// ([`SparseMoe::forward_routed`]).
#[derive(Debug)]
pub struct ExpertFailure {
    /// Rows of the pass routed to the expert.
    pub tokens: Vec<u32>,
    pub error: crate::error::ModelError,
}

/// The top-k router: `gate: [E, H]`.
#[derive(Debug, Clone)]
pub struct Router {
    gate: Linear,
    top_k: usize,
    norm_topk_prob: bool,
    scoring: RouterScoring,
    /// Runtime override (`--moe-top-k`): keep the `k` best of the router's top-k.
    top_k_override: Option<usize>,
    /// A synthetic model's routing process: chooses the experts of passes routed with a
    /// [`SeqRoute`] (the scores still come from `gate`).
    synthetic: Option<Box<SyntheticRouter>>,
}

/// Where a pass's tokens sit in their sequence, for a router whose choice depends on it (a
/// synthetic model's routing process, [`crate::synthetic_routing`]).
#[derive(Debug)]
pub struct SeqRoute<'a> {
    /// Position of the pass's first token.
    pub start: usize,
    /// `[seq]`: the pass's token ids.
    pub tokens: &'a [u32],
    /// The sequence's earlier choices (read at `start − 1`, written at `start..`).
    pub history: &'a mut RoutingHistory,
}

impl Router {
    /// `gate: [E, H]` router weights.
    pub fn new(gate: Linear, top_k: usize, norm_topk_prob: bool, scoring: RouterScoring) -> Self {
        Self { gate, top_k, norm_topk_prob, scoring, top_k_override: None, synthetic: None }
    }

    /// Lets `synthetic` choose the experts of passes routed with a [`SeqRoute`].
    pub fn with_synthetic(mut self, synthetic: Option<SyntheticRouter>) -> Self {
        self.synthetic = synthetic.map(Box::new);
        self
    }

    /// Whether a synthetic routing process chooses this router's experts.
    pub fn is_synthetic(&self) -> bool {
        self.synthetic.is_some()
    }

    /// Uses only the `k` best of the router's top-k choices (`None`: the model's top-k). Their
    /// weights are rescaled to the top-k's total weight, so outputs keep their scale (SwiftLM's
    /// `SWIFTLM_TOP_K`). `k` at or above the model's top-k changes nothing.
    pub fn set_top_k_override(&mut self, k: Option<usize>) {
        self.top_k_override = k.map(|k| k.max(1)).filter(|&k| k < self.top_k);
    }

    /// Experts used per token.
    pub fn top_k(&self) -> usize {
        self.top_k_override.unwrap_or(self.top_k)
    }

    /// Routes `x: [seq, hidden]`; `layer` is recorded in the result.
    pub fn route(&self, x: &Tensor, layer: usize) -> Result<LayerRouting> {
        self.route_seq(x, layer, None, false)
    }

    /// Routes `x: [seq, hidden]` whose tokens sit in a sequence as `seq` says. A synthetic
    /// routing process chooses the experts when the router has one and `seq` is given (and then
    /// records them in its history, unless `predict`); otherwise the logits' top-k. With
    /// `predict`, the result is pre-gating's prediction for this layer (synthetic: of the
    /// configured recall; otherwise the plain routing).
    pub fn route_seq(
        &self,
        x: &Tensor,
        layer: usize,
        seq: Option<SeqRoute<'_>>,
        predict: bool,
    ) -> Result<LayerRouting> {
        if !x.device().is_cpu() {
            crate::gpu::note_host_reads(1);
        }
        let logits = self.gate.forward(x)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        let mut routing = LayerRouting {
            layer,
            top_k: self.top_k(),
            expert_ids: Vec::new(),
            weights: Vec::new(),
        };
        match (&self.synthetic, seq) {
            (Some(s), Some(seq)) => {
                if seq.tokens.len() != logits.len() {
                    return Err(candle_core::Error::Msg(format!(
                        "{} rows routed with {} token positions",
                        logits.len(),
                        seq.tokens.len()
                    ))
                    .into());
                }
                let before = match predict {
                    true => seq.history.befores(seq.start, seq.tokens),
                    false => seq.history.record_pass(seq.start, seq.tokens),
                };
                let history = seq.history.layer_mut(layer);
                let actual = synthetic_chain(s, seq.start, &before, history, !predict);
                for (i, (row, actual)) in logits.iter().zip(actual).enumerate() {
                    let (pos, token) = (seq.start + i, seq.tokens[i]);
                    let chosen = if predict { s.predict(pos, token, &actual) } else { actual };
                    let (ids, w) = self.weigh(&self.scores(row), chosen);
                    routing.expert_ids.extend(ids);
                    routing.weights.extend(w);
                }
            }
            _ => {
                for row in &logits {
                    let (ids, w) = self.select(row);
                    routing.expert_ids.extend(ids);
                    routing.weights.extend(w);
                }
            }
        }
        Ok(routing)
    }

    /// The synthetic routing process's choice for a pass's rows (`seq`), recorded in the
    /// sequence's history: `[seq, k]` expert ids (`k` = the model's top-k), each row's experts
    /// distinct — what [`Self::route_seq`] chooses (without `predict`) before weighing them by the
    /// router's scores. The device weighs them the same way ([`Self::route_on_device`] with
    /// `chosen`). `None` when this router has no synthetic process.
    pub fn synthetic_choice(&self, layer: usize, seq: SeqRoute<'_>) -> Option<Vec<u32>> {
        let before = seq.history.record_pass(seq.start, seq.tokens);
        self.synthetic_choice_in(seq.start, &before, seq.history.layer_mut(layer)?)
    }

    /// [`Self::synthetic_choice`] for rows at positions `start..` recorded in one layer's part of
    /// a history (this router's layer; histories of different layers can be written on
    /// different threads). `before[i]`: the sequence's token at position `start + i − 1` (what
    /// row `i`'s draws hash; [`RoutingHistory::befores`]), one per row. The caller records the
    /// pass's tokens in the history ([`RoutingHistory::record_pass`]).
    pub fn synthetic_choice_in(
        &self,
        start: usize,
        before: &[Option<u32>],
        history: LayerHistory<'_>,
    ) -> Option<Vec<u32>> {
        let s = self.synthetic.as_ref()?;
        Some(synthetic_chain(s, start, before, Some(history), true).concat())
    }

    /// [`Self::route`] on the device: `x: [seq, hidden]` → expert ids `[seq, k]` (u32) and weights
    /// `[seq, k]` (f32), computed by our top-k kernel from the router's logits (the same function
    /// as [`Self::select`], up to float summation order; tested against it on the device). With
    /// `chosen` (a synthetic model's choice, [`Self::synthetic_choice`]) only those experts are
    /// weighed, as [`Self::route_seq`] weighs them on the host. `record` also receives both.
    #[cfg(feature = "cuda")]
    pub fn route_on_device(
        &self,
        x: &Tensor,
        record: Option<strata_kernels::cuda::RoutingRecord<'_>>,
        chosen: Option<strata_kernels::cuda::ChosenExperts<'_>>,
    ) -> Result<(Tensor, Tensor)> {
        use strata_kernels::cuda::{route_topk, Scoring};
        let logits = self.gate.forward(x)?.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let scoring = match self.scoring {
            RouterScoring::Softmax => Scoring::Softmax,
            RouterScoring::Sigmoid => Scoring::Sigmoid,
        };
        let k = self.top_k;
        Ok(route_topk(&logits, k, self.top_k(), scoring, self.norm_topk_prob, record, chosen)?)
    }

    /// The model's top-k (before any `--moe-top-k` override): experts a synthetic process
    /// chooses per token.
    pub fn model_top_k(&self) -> usize {
        self.top_k
    }

    /// Scores, top-k (ties to the lower expert id), renormalisation for one token's logits `[E]`.
    pub fn select(&self, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let scores = self.scores(logits);
        let mut order: Vec<u32> = (0..scores.len() as u32).collect();
        order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
        order.truncate(self.top_k);
        self.weigh(&scores, order)
    }

    /// Softmax (in f32) or sigmoid scores of one token's logits `[E]`.
    fn scores(&self, logits: &[f32]) -> Vec<f32> {
        match self.scoring {
            RouterScoring::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
                let sum: f32 = exp.iter().sum();
                exp.iter().map(|e| e / sum).collect()
            }
            RouterScoring::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        }
    }

    /// The chosen experts `ids` (the top-k) highest score first (ties to the lower id), their
    /// weights renormalised if the model says so, cut to the `--moe-top-k` override.
    fn weigh(&self, scores: &[f32], mut order: Vec<u32>) -> (Vec<u32>, Vec<f32>) {
        order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
        let mut w: Vec<f32> = order.iter().map(|&e| scores[e as usize]).collect();
        if self.norm_topk_prob {
            let s: f32 = w.iter().sum();
            w.iter_mut().for_each(|x| *x /= s);
        }
        if let Some(k) = self.top_k_override {
            let mass: f32 = w.iter().sum();
            order.truncate(k);
            w.truncate(k);
            let kept: f32 = w.iter().sum();
            w.iter_mut().for_each(|x| *x *= mass / kept);
        }
        (order, w)
    }
}

/// The experts synthetic process `s` chooses for rows at positions `start..` of its layer
/// (`before[i]`: the token at row `i`'s previous position, [`RoutingHistory::befores`]), each
/// row's choice depending on the previous position's (read from the layer's `history`, and
/// written there when `record`; `None`: a layer the history does not hold, nothing read or
/// written).
fn synthetic_chain(
    s: &SyntheticRouter,
    start: usize,
    before: &[Option<u32>],
    mut history: Option<LayerHistory<'_>>,
    record: bool,
) -> Vec<Vec<u32>> {
    let mut prev: Option<Vec<u32>> =
        start.checked_sub(1).and_then(|p| history.as_ref()?.get(p)).map(<[u32]>::to_vec);
    let mut rows = Vec::with_capacity(before.len());
    for (i, &token) in before.iter().enumerate() {
        let actual = s.route(start + i, token, prev.as_deref());
        if let (true, Some(h)) = (record, history.as_mut()) {
            h.set(start + i, &actual);
        }
        prev = Some(actual.clone());
        rows.push(actual);
    }
    rows
}

/// `Σⱼ w[t, j] · y[t, j]` for expert outputs `y: [seq, k, H]` and weights `w: [seq, k]`: one
/// launch of our kernel for f32 tensors on a GPU (`cuda` build), candle's two ops otherwise.
fn weighted_sum(y: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() && y.dtype() == candle_core::DType::F32 {
        return strata_kernels::cuda::moe_combine(y, w);
    }
    y.broadcast_mul(&w.unsqueeze(2)?)?.sum(1)
}

/// An always-active shared expert scaled by `sigmoid(x W_gᵀ)` (qwen2_moe).
#[derive(Debug, Clone)]
struct SharedExpert {
    mlp: Mlp,
    /// `[1, H]`.
    gate: Linear,
}

/// The sparse MoE feed-forward block of one layer.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    layer: usize,
    router: Router,
    shared: Option<SharedExpert>,
}

impl SparseMoe {
    /// A block without a shared expert (benchmarks, tests).
    pub fn new(layer: usize, router: Router) -> Self {
        Self { layer, router, shared: None }
    }

    /// Loads the router (`blk.L.ffn_gate_inp`) and the shared expert (`*_shexp`) if the config has
    /// one. Routed experts are not loaded here: they come from the [`ExpertProvider`].
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, m: &MoeConfig, layer: usize) -> Result<Self> {
        let h = cfg.hidden_size;
        // A router bias (`ffn_gate_inp.bias`) is optional: synthetic models plant routing skew there.
        let name = format!("blk.{layer}.ffn_gate_inp");
        let gate = l.linear(&name, m.num_experts, h, l.has(&format!("{name}.bias")))?;
        let synthetic = m
            .synthetic_routing
            .map(|r| SyntheticRouter::new(r, layer, m.num_experts, m.experts_per_token));
        let router = Router::new(gate, m.experts_per_token, m.norm_topk_prob, m.scoring)
            .with_synthetic(synthetic);
        let shared = match m.shared_expert_intermediate_size {
            Some(i) => Some(SharedExpert {
                mlp: Mlp::load(l, layer, "_shexp", h, i)?,
                gate: l.linear(&format!("blk.{layer}.ffn_gate_inp_shexp"), 1, h, false)?,
            }),
            None => None,
        };
        Ok(Self { layer, router, shared })
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The model layer this block belongs to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    pub fn router_mut(&mut self) -> &mut Router {
        &mut self.router
    }

    /// `x: [seq, hidden] → [seq, hidden]` and the routing it used.
    ///
    /// Tokens are grouped by expert, so each selected expert runs once on all its tokens (one matmul
    /// per expert for prefill, one matvec per selected expert for decode).
    pub fn forward(
        &self,
        x: &Tensor,
        experts: &dyn ExpertProvider,
    ) -> Result<(Tensor, LayerRouting)> {
        let routing = self.route(x)?;
        experts.fetch_routed(self.layer, &routing.expert_ids);
        Ok((self.forward_routed(x, &routing, experts, None)?, routing))
    }

    /// The router's decision for `x: [seq, hidden]`.
    pub fn route(&self, x: &Tensor) -> Result<LayerRouting> {
        self.router.route(x, self.layer)
    }

    /// The router's decision for `x: [seq, hidden]` at the sequence positions `seq` gives (see
    /// [`Router::route_seq`]; `predict`: pre-gating's prediction, nothing recorded).
    pub fn route_seq(
        &self,
        x: &Tensor,
        seq: Option<SeqRoute<'_>>,
        predict: bool,
    ) -> Result<LayerRouting> {
        self.router.route_seq(x, self.layer, seq, predict)
    }

    /// [`Self::forward`] with the routing already made (the caller has told the provider what it
    /// will need, and may have started prefetches meanwhile).
    ///
    /// `failures`: where an expert cannot be had (a streamed read failed), `None` fails the
    /// whole call; `Some` records the expert's tokens and error there and goes on without that
    /// expert (those tokens' outputs are then wrong: a batched pass fails only the sequences
    /// they belong to). CPU path only; the device paths always fail the whole call.
    pub fn forward_routed(
        &self,
        x: &Tensor,
        routing: &LayerRouting,
        experts: &dyn ExpertProvider,
        failures: Option<&mut Vec<ExpertFailure>>,
    ) -> Result<Tensor> {
        let (seq, h) = x.dims2()?;
        if let Some(call) = experts.fused(self.layer, &routing.expert_ids) {
            return self.forward_fused(x, routing, call?, experts);
        }
        let mut by_expert: BTreeMap<u32, Vec<(u32, f32)>> = BTreeMap::new();
        for t in 0..seq {
            let (ids, ws) = routing.token(t);
            for (&e, &w) in ids.iter().zip(ws) {
                by_expert.entry(e).or_default().push((t as u32, w));
            }
        }
        if !x.device().is_cpu() {
            return self.combine_on_device(x, by_expert, experts);
        }
        let entries: Vec<(u32, Vec<(u32, f32)>)> = by_expert.into_iter().collect();
        let outputs = self.expert_outputs_cpu(x, &entries, experts, failures)?;
        // Weighted sum in ascending expert order, whichever experts were computed together.
        let mut out = vec![0f32; seq * h];
        for ((_, tokens), y) in entries.iter().zip(&outputs) {
            let Some(y) = y else { continue };
            for (r, &(t, w)) in tokens.iter().enumerate() {
                let dst = &mut out[t as usize * h..(t as usize + 1) * h];
                for (d, &v) in dst.iter_mut().zip(&y[r * h..(r + 1) * h]) {
                    *d += v * w;
                }
            }
        }
        if let Some(s) = &self.shared {
            let y = s.mlp.forward(x)?.flatten_all()?.to_vec1::<f32>()?;
            let g = s.gate.forward(x)?.flatten_all()?.to_vec1::<f32>()?; // [seq]
            for t in 0..seq {
                let gate = 1.0 / (1.0 + (-g[t]).exp());
                for (d, &v) in out[t * h..(t + 1) * h].iter_mut().zip(&y[t * h..(t + 1) * h]) {
                    *d += gate * v;
                }
            }
        }
        Ok(Tensor::from_vec(out, (seq, h), x.device())?)
    }

    /// CPU: each routed expert's unweighted output `[n_e, H]` for its tokens (`entries`: expert id
    /// and `(token, weight)` pairs, ascending ids); `None` where the expert could not be had and
    /// `failures` took the error. Experts whose reads have finished go first, all of them in one
    /// pair of parallel regions when they run on our kernels ([`strata_kernels::moe`]); then the
    /// provider is waited on for the next one, and so on, so compute overlaps streamed reads.
    fn expert_outputs_cpu(
        &self,
        x: &Tensor,
        entries: &[(u32, Vec<(u32, f32)>)],
        experts: &dyn ExpertProvider,
        mut failures: Option<&mut Vec<ExpertFailure>>,
    ) -> Result<Vec<Option<Vec<f32>>>> {
        let seq = x.dim(0)?;
        let xv = x.flatten_all()?.to_vec1::<f32>()?;
        let mut outputs: Vec<Option<Vec<f32>>> = vec![None; entries.len()];
        let mut left: Vec<usize> = (0..entries.len()).collect();
        while !left.is_empty() {
            let mut take: Vec<usize> = left
                .iter()
                .copied()
                .filter(|&i| experts.ready(self.layer, entries[i].0 as usize))
                .collect();
            if take.is_empty() {
                take.push(left[0]); // wait for the lowest id's read
            }
            left.retain(|i| !take.contains(i));
            let mut group = Vec::with_capacity(take.len());
            for i in take {
                let (e, tokens) = &entries[i];
                match (experts.expert(self.layer, *e as usize), failures.as_deref_mut()) {
                    (Ok(x), _) => group.push((i, x)),
                    (Err(error), Some(f)) => f.push(ExpertFailure {
                        tokens: tokens.iter().map(|&(t, _)| t).collect(),
                        error,
                    }),
                    (Err(e), None) => return Err(e),
                }
            }
            let ids: Vec<Vec<u32>> = group
                .iter()
                .map(|(i, _)| entries[*i].1.iter().map(|&(t, _)| t).collect())
                .collect();
            let fused: Option<Vec<strata_kernels::moe::RoutedExpert>> = group
                .iter()
                .zip(&ids)
                .map(|((_, ex), tokens)| {
                    let (gate_up, down) = ex.mlp.kernel_parts()?;
                    Some(strata_kernels::moe::RoutedExpert { gate_up, down, tokens })
                })
                .collect();
            if let Some(routed) = fused {
                let ys = strata_kernels::moe::expert_outputs(&xv, seq, &routed);
                for ((i, _), y) in group.iter().zip(ys) {
                    outputs[*i] = Some(y);
                }
                continue;
            }
            for ((i, ex), tokens) in group.iter().zip(&ids) {
                let xs = if tokens.len() == seq {
                    x.clone() // every token (always the case for decode): no gather
                } else {
                    x.index_select(&Tensor::new(tokens.as_slice(), x.device())?, 0)?
                };
                outputs[*i] = Some(ex.mlp.forward(&xs)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        Ok(outputs)
    }

    /// [`Self::forward`] over [`FusedExperts`]: one launch per projection for every selected
    /// expert, weighted sum over the top-k on the device.
    fn forward_fused(
        &self,
        x: &Tensor,
        routing: &LayerRouting,
        call: FusedCall<'_>,
        experts: &dyn ExpertProvider,
    ) -> Result<Tensor> {
        let (seq, _) = x.dims2()?;
        let (dev, k) = (x.device(), routing.top_k);
        let rows = call.rows.as_deref().unwrap_or(&routing.expert_ids);
        let ids = Tensor::from_slice(rows, (seq, k), dev)?;
        let w = Tensor::from_vec(routing.weights.clone(), (seq, k), dev)?.to_dtype(x.dtype())?;
        let out = self.fused_output(x, &call, &ids, &w)?;
        if call.table.is_some() {
            experts.observe_routing(std::slice::from_ref(routing));
        }
        Ok(out)
    }

    /// The block's output over `call`'s [`FusedExperts`] for `x: [seq, H]` routed to rows `ids:
    /// [seq, k]` (u32; expert ids with a table) with weights `w: [seq, k]`, all on the device: the
    /// experts, their weighted sum (one kernel of ours in a `cuda` build), the shared expert.
    fn fused_output(
        &self,
        x: &Tensor,
        call: &FusedCall<'_>,
        ids: &Tensor,
        w: &Tensor,
    ) -> Result<Tensor> {
        let experts = call.experts;
        #[cfg(feature = "cuda")]
        let combined = experts.forward_combined(x, ids, w, call.table).transpose()?;
        #[cfg(not(feature = "cuda"))]
        let combined: Option<Tensor> = None;
        let mut out = match combined {
            Some(out) => out,
            None if call.table.is_some() => {
                return Err(candle_core::Error::msg(
                    "mapped GPU experts need the cuda build's MoE kernels",
                )
                .into())
            }
            None => weighted_sum(&experts.forward(x, ids)?, w)?,
        };
        if let Some(s) = &self.shared {
            let y = s.mlp.forward(x)?;
            #[cfg(feature = "cuda")]
            if let Some(g) = s.gate.dense_f32().filter(|_| shared_gate_fused(x)) {
                return Ok(strata_kernels::cuda::shared_gate_add(&out, &y, x, g)?);
            }
            let g = candle_nn::ops::sigmoid(&s.gate.forward(x)?)?;
            out = (out + y.broadcast_mul(&g)?)?;
        }
        Ok(out)
    }

    /// [`Self::forward`] with the routing made on the device (`cuda` build): the router's top-k
    /// kernel (`strata_kernels::cuda::route_topk`) feeds the fused experts directly, so the pass
    /// never waits for the host here. `record` also receives the ids and weights (the pass's
    /// routing, read back once at its end). `None`: this layer's experts are not resident
    /// [`FusedExperts`] addressed by expert id (the caller routes on the host instead).
    ///
    /// Only for providers whose [`ExpertProvider::routes_on_device`] is true. A synthetic model's
    /// routing process runs on the host before the pass: its choice comes as `chosen`
    /// ([`Router::synthetic_choice`]), and only the weighing runs here.
    #[cfg(feature = "cuda")]
    pub fn forward_device_routed(
        &self,
        x: &Tensor,
        experts: &dyn ExpertProvider,
        record: Option<strata_kernels::cuda::RoutingRecord<'_>>,
        chosen: Option<strata_kernels::cuda::ChosenExperts<'_>>,
    ) -> Option<Result<Tensor>> {
        let call = match experts.fused(self.layer, &[])? {
            Ok(c) if c.rows.is_none() => c,
            Ok(_) => return None,
            Err(e) => return Some(Err(e)),
        };
        let run = || {
            let (ids, w) = self.router.route_on_device(x, record, chosen)?;
            self.fused_output(x, &call, &ids, &w.to_dtype(x.dtype())?)
        };
        Some(run())
    }

    /// GPU path of [`Self::forward`]: expert outputs weighted and summed on the device (no copy
    /// to the host per expert; the router's top-k is the only host round trip per layer).
    fn combine_on_device(
        &self,
        x: &Tensor,
        by_expert: BTreeMap<u32, Vec<(u32, f32)>>,
        experts: &dyn ExpertProvider,
    ) -> Result<Tensor> {
        let (seq, h) = x.dims2()?;
        let dev = x.device();
        let mut acc = Tensor::zeros((seq, h), x.dtype(), dev)?;
        for (e, tokens) in by_expert {
            let expert = experts.expert(self.layer, e as usize)?;
            let w = Tensor::new(tokens.iter().map(|&(_, w)| w).collect::<Vec<f32>>(), dev)?
                .to_dtype(x.dtype())?
                .unsqueeze(1)?;
            if tokens.len() == seq {
                acc = (acc + expert.mlp.forward(x)?.broadcast_mul(&w)?)?;
            } else {
                let idx = Tensor::new(tokens.iter().map(|&(t, _)| t).collect::<Vec<u32>>(), dev)?;
                let y = expert.mlp.forward(&x.index_select(&idx, 0)?)?.broadcast_mul(&w)?;
                acc = acc.index_add(&idx, &y, 0)?;
            }
        }
        if let Some(s) = &self.shared {
            let g = candle_nn::ops::sigmoid(&s.gate.forward(x)?)?; // [seq, 1]
            acc = (acc + s.mlp.forward(x)?.broadcast_mul(&g)?)?;
        }
        Ok(acc)
    }
}

/// Whether a shared expert's gate, sigmoid, product and sum run as one kernel
/// (`strata_kernels::cuda::shared_gate_add`, the same bits): `x` f32 on a CUDA device, a width
/// that is a multiple of 4, and not `STRATA_GPU_SHARED_GATE=0` (a measurement switch).
#[cfg(feature = "cuda")]
fn shared_gate_fused(x: &Tensor) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    x.device().is_cuda()
        && x.dtype() == candle_core::DType::F32
        && x.rank() == 2
        && x.dims()[1].is_multiple_of(4)
        && *ON.get_or_init(|| std::env::var("STRATA_GPU_SHARED_GATE").map_or(true, |v| v != "0"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use strata_formats::SyntheticRouting;
    use strata_formats::Weight;

    /// A router of `experts` experts over a 16-wide hidden state with a synthetic process.
    fn router(cfg: SyntheticRouting, layer: usize, experts: usize, k: usize) -> Router {
        let w: Vec<f32> =
            (0..experts * 16).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let w = Tensor::from_vec(w, (experts, 16), &Device::Cpu).unwrap();
        Router::new(Linear::new(Weight::Dense(w), None).unwrap(), k, true, RouterScoring::Softmax)
            .with_synthetic(Some(SyntheticRouter::new(cfg, layer, experts, k)))
    }

    fn x(rows: usize) -> Tensor {
        let v: Vec<f32> = (0..rows * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        Tensor::from_vec(v, (rows, 16), &Device::Cpu).unwrap()
    }

    /// A position's choice drawn ahead (from the history alone, before its token is known, as a
    /// GPU step draws the next step's) is what routing that position with any token gives, in a
    /// pass of its own or inside a longer one; a pass's tokens are kept for the next position.
    #[test]
    fn a_choice_drawn_ahead_is_the_choice_of_its_step() {
        let layer = 2;
        for cfg in [SyntheticRouting::realistic(5), SyntheticRouting::uniform(6)] {
            let r = router(cfg, layer, 32, 4);
            let prompt = [7u32, 900, 31, 31, 4];
            let mut h = RoutingHistory::new(4, 4);
            let seq = SeqRoute { start: 0, tokens: &prompt, history: &mut h };
            r.route_seq(&x(5), layer, Some(seq), false).unwrap();
            assert_eq!(h.token(4), Some(4));
            // Drawn ahead at position 5 from the history.
            let mut ahead = h.clone();
            let before = [ahead.token(4)];
            let drawn = r.synthetic_choice_in(5, &before, ahead.layer_mut(layer).unwrap()).unwrap();
            // Routed with two different tokens at position 5, and a 7-token pass from the start.
            for t in [11u32, 12_000] {
                let mut step = h.clone();
                let seq = SeqRoute { start: 5, tokens: &[t], history: &mut step };
                r.route_seq(&x(1), layer, Some(seq), false).unwrap();
                assert_eq!(step.get(layer, 5), Some(&drawn[..]), "{:?} token {t}", cfg.mode);
                let mut whole = RoutingHistory::new(4, 4);
                let all = [7u32, 900, 31, 31, 4, t, 3];
                let seq = SeqRoute { start: 0, tokens: &all, history: &mut whole };
                r.route_seq(&x(7), layer, Some(seq), false).unwrap();
                for p in 0..6 {
                    assert_eq!(whole.get(layer, p), step.get(layer, p), "position {p}");
                }
            }
            // Another token at position 4 changes position 5's draws (sequences diverge).
            let mut other = RoutingHistory::new(4, 4);
            let seq = SeqRoute { start: 0, tokens: &[7, 900, 31, 31, 5, 1], history: &mut other };
            r.route_seq(&x(6), layer, Some(seq), false).unwrap();
            assert_eq!(other.get(layer, 4), h.get(layer, 4));
            assert_ne!(other.get(layer, 5), Some(&drawn[..]), "{:?}", cfg.mode);
        }
    }
}
