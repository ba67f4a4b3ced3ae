//! Speculative decoding: a draft proposes tokens, the target verifies them in one batched forward
//! pass, and the output is lossless — identical tokens under greedy decoding, the target's exact
//! distribution under sampling ([`accept`]).
//!
//! A round starts with the last emitted token `t` (not yet in the target's KV cache):
//! 1. the draft source proposes `d₁..d_N` ([`DraftSource`]: a draft model, n-gram lookup, the
//!    target's own first layers, or a DFlash block drafter), with `N` chosen by the
//!    [`policy::DraftPolicy`];
//! 2. the target runs `[t, d₁..d_N]` in one forward (logits at every position);
//! 3. `d_i` is checked against the target's distribution after `t, d₁..d_{i−1}`; the first rejection
//!    emits a corrected token and ends the round; if all pass, a bonus token is drawn;
//! 4. the target's sequence state is rolled back to `t` + the accepted drafts
//!    ([`Transformer::rollback`]: the KV cache's length; recurrent state in hybrid models).
//!
//! `N = 0` is exactly a plain decode step (same logits, same RNG use), so a policy that turns
//! drafting off gives plain decoding. Verification widths stay within
//! [`strata_models::EXACT_ROWS_MAX`], where the target's multi-token logits are bit-identical to
//! one-token decoding, so greedy speculation reproduces plain greedy decoding token for token.
//!
//! A sequence whose sampling changes the logits (`logit_bias`, a grammar's token mask) passes a
//! [`LogitsConstraint`]: drafts are cut to the prefix the grammar accepts (a later draft could
//! only be rejected), and every verified position's distribution is taken from the changed logits,
//! with the grammar advanced by the drafts accepted before it — the distributions plain decoding
//! samples from, so speculation stays lossless under a mask.

pub mod accept;
pub mod ngram;
pub mod policy;
pub mod stats;

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use strata_models::{DFlashDraft, ForwardOutput, KvCache, Logits, Transformer};

use crate::engine::{EngineError, Result};
use crate::sampling::Sampler;
pub use accept::{DraftDist, Verdict};
pub use ngram::NgramParams;
pub use policy::{DraftPolicy, FanoutModel};
pub use stats::SpecStats;

/// A sequence's changes to the target's logits before sampling (`logit_bias`, a grammar's token
/// mask), applied by verification at every position it checks.
pub trait LogitsConstraint {
    /// Changes `logits` `[vocab]` for the next position (after the tokens advanced so far).
    fn constrain(&mut self, logits: &mut [f32]) -> Result<()>;
    /// How many of `drafts`, in order, the constraint can take (a draft past it is never accepted).
    fn valid_prefix(&mut self, drafts: &[u32]) -> Result<usize>;
    /// Advances by an accepted draft, tentatively, until [`Self::undo`].
    fn advance(&mut self, token: u32) -> Result<()>;
    /// Undoes every [`Self::advance`] since the last `undo` (the tokens are emitted afterwards and
    /// advance the sequence's state as any token does).
    fn undo(&mut self) -> Result<()>;
}

/// The target's sampling distribution at one verified position: `sampler`'s transforms over
/// `logits` `[vocab]`, after `rules` (if any) changed them.
fn target_distribution<'a>(
    sampler: &Sampler,
    logits: &[f32],
    ctx: &[u32],
    rules: Option<&mut (dyn LogitsConstraint + 'a)>,
) -> Result<accept::Dist> {
    Ok(match rules {
        None => sampler.distribution(logits, ctx),
        Some(r) => {
            let mut l = logits.to_vec();
            r.constrain(&mut l)?;
            sampler.distribution(&l, ctx)
        }
    })
}

/// Where draft tokens come from.
#[derive(Debug, Clone)]
pub enum DraftSource {
    /// A separate model with the target's vocabulary (`--draft-model PATH`).
    Model(Arc<Transformer>),
    /// Prompt lookup decoding (`--spec ngram`).
    Ngram(NgramParams),
    /// The target's first `layers` decoder layers + final norm + lm_head (`--spec self
    /// --draft-layers L`), sharing the target's weights and KV cache.
    SelfDraft { layers: usize },
    /// DFlash block diffusion (`--dflash --draft-model PATH`): one draft forward proposes a whole
    /// block of `block_size − 1` tokens from the target's hidden states ([`DFlashDraft`]).
    DFlash { draft: Arc<DFlashDraft>, block_size: usize },
}

impl DraftSource {
    pub fn name(&self) -> &'static str {
        match self {
            DraftSource::Model(_) => "draft-model",
            DraftSource::Ngram(_) => "ngram",
            DraftSource::SelfDraft { .. } => "self",
            DraftSource::DFlash { .. } => "dflash",
        }
    }
}

/// Speculative decoding settings of an engine.
#[derive(Debug, Clone)]
pub struct SpecConfig {
    pub source: DraftSource,
    /// Most draft tokens per round (`--num-draft-tokens`, default 4); at most
    /// `EXACT_ROWS_MAX − 1`.
    pub max_draft: usize,
    /// `Some(n)`: draft `n` tokens every round (`--draft-policy fixed`); `None`: adaptive.
    pub fixed: Option<usize>,
}

impl SpecConfig {
    /// Checks the settings against the target: the draft model's vocabulary size must equal the
    /// target's; self-draft needs `1 ≤ layers < target layers`.
    pub fn validate(&self, target: &Transformer) -> Result<()> {
        let max_width = strata_models::EXACT_ROWS_MAX - 1;
        if self.max_draft == 0 || self.max_draft > max_width {
            return Err(EngineError::Spec(format!(
                "--num-draft-tokens must be in 1..={max_width}, got {}",
                self.max_draft
            )));
        }
        match &self.source {
            DraftSource::Model(d) => {
                let (dv, tv) = (d.config().vocab_size, target.config().vocab_size);
                if dv != tv {
                    return Err(EngineError::Spec(format!("the draft model's vocabulary has {dv} tokens but the target's has {tv}: a draft model must share the target's tokenizer")));
                }
            }
            DraftSource::SelfDraft { layers } => {
                let n = target.num_layers();
                if *layers == 0 || *layers >= n {
                    return Err(EngineError::Spec(format!("--draft-layers must be in 1..{n} (the target has {n} layers), got {layers}")));
                }
            }
            DraftSource::DFlash { block_size, .. } => {
                if *block_size < 2 || *block_size > strata_models::EXACT_ROWS_MAX {
                    return Err(EngineError::Spec(format!(
                        "--dflash-block-size must be in 2..={}, got {block_size}",
                        strata_models::EXACT_ROWS_MAX
                    )));
                }
                if self.max_draft > block_size - 1 {
                    return Err(EngineError::Spec(format!(
                        "a DFlash block of {block_size} drafts at most {} tokens, not {}",
                        block_size - 1,
                        self.max_draft
                    )));
                }
            }
            DraftSource::Ngram(p) => {
                if p.min == 0 || p.min > p.max {
                    return Err(EngineError::Spec(format!(
                        "n-gram sizes need 1 ≤ --ngram-min ≤ --ngram-max, got {}..{}",
                        p.min, p.max
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A token emitted by a round and the target logits it was chosen from (for logprobs).
pub type Emitted = (u32, Vec<f32>);

/// One round as it happened (for tests and debugging; see [`Speculator::trace`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RoundTrace {
    /// Target cache length at the start of the round (the position of the round's first token).
    pub start: usize,
    /// Draft tokens verified.
    pub drafts: Vec<u32>,
    /// DFlash: the argmax of every block position's draft logits (also those not verified).
    pub block_argmax: Vec<u32>,
    pub accepted: usize,
    /// Tokens the round emitted (accepted drafts, then the correction or bonus token).
    pub emitted: Vec<u32>,
    /// DFlash: the draft logits `[B − 1][vocab]` of the block.
    pub draft_logits: Vec<Vec<f32>>,
}

/// DFlash per-sequence state: the draft's context cache and the raw (hidden_states, not yet projected)
/// features of committed positions not yet in it.
struct DFlashState {
    cache: KvCache,
    pending: Vec<Tensor>,
}

/// The speculative decoder of one sequence: draft state, the draft-length policy and counters.
pub struct Speculator<'a> {
    cfg: &'a SpecConfig,
    target: &'a Transformer,
    /// Draft model: its KV cache and the tokens in it.
    draft_cache: Option<KvCache>,
    draft_tokens: Vec<u32>,
    dflash: Option<DFlashState>,
    policy: DraftPolicy,
    prefill_chunk: usize,
    pub stats: SpecStats,
    /// `Some`: every round is recorded here.
    pub trace: Option<Vec<RoundTrace>>,
    /// DFlash, while tracing: the last block's argmax tokens and draft logits.
    last_block: Option<(Vec<u32>, Vec<Vec<f32>>)>,
}

impl<'a> Speculator<'a> {
    /// `capacity`: the target cache's capacity (the draft model's cache gets the same).
    /// `streaming`: routed experts are streamed (the policy then models verify fan-out).
    pub fn new(
        target: &'a Transformer,
        cfg: &'a SpecConfig,
        capacity: usize,
        streaming: bool,
        prefill_chunk: usize,
    ) -> Result<Self> {
        let draft_cache = match &cfg.source {
            DraftSource::Model(d) => Some(d.new_cache(capacity)?),
            _ => None,
        };
        let dflash = match &cfg.source {
            DraftSource::DFlash { draft, block_size } => Some(DFlashState {
                cache: draft.new_cache(capacity + block_size, target.device())?,
                pending: Vec::new(),
            }),
            _ => None,
        };
        let fanout = target
            .config()
            .moe
            .as_ref()
            .filter(|_| streaming)
            .map(|m| FanoutModel { experts: m.num_experts, top_k: m.experts_per_token });
        let mut policy = DraftPolicy::new(cfg.max_draft, cfg.fixed, fanout);
        if dflash.is_some() {
            policy = policy.with_block_draft();
        }
        Ok(Self {
            cfg,
            target,
            draft_cache,
            draft_tokens: Vec::new(),
            dflash,
            policy,
            prefill_chunk: prefill_chunk.max(1),
            stats: SpecStats::new(cfg.source.name(), cfg.max_draft),
            trace: None,
            last_block: None,
        })
    }

    /// Target layers whose hidden states every target forward of this sequence must return
    /// (DFlash's context features; empty for the other sources).
    pub fn target_layers(&self) -> &[usize] {
        match &self.cfg.source {
            DraftSource::DFlash { draft, .. } => draft.hidden_layers(),
            _ => &[],
        }
    }

    /// Prefills `prompt` into the empty `cache` in chunks, keeping what the draft needs from it
    /// (DFlash: the prompt's context features). Returns the last position's logits `[vocab]`.
    /// `stop` is polled between layers (`ModelError::Interrupted` when it says so).
    pub fn prefill(
        &mut self,
        cache: &mut KvCache,
        prompt: &[u32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        let hidden_layers = self.target_layers().to_vec();
        let mut logits = None;
        for part in prompt.chunks(self.prefill_chunk) {
            let out = strata_models::prefill_scope(part.len(), 0, || {
                self.target.forward_interruptible(part, cache, Logits::Last, &hidden_layers, stop)
            })?;
            self.observe_hidden_states(&out.hidden_states, part.len())?;
            logits = Some(out.logits);
        }
        Ok(logits.ok_or(EngineError::EmptyPrompt)?.flatten_all()?.to_vec1()?)
    }

    /// DFlash: keeps the context features of the first `rows` positions of a target forward.
    fn observe_hidden_states(&mut self, hidden_states: &[Tensor], rows: usize) -> Result<()> {
        let (DraftSource::DFlash { draft, .. }, Some(st)) =
            (&self.cfg.source, self.dflash.as_mut())
        else {
            return Ok(());
        };
        let hidden_states = hidden_states
            .iter()
            .map(|t| t.narrow(0, 0, rows))
            .collect::<candle_core::Result<Vec<_>>>()?;
        st.pending.push(draft.target_features(self.target, &hidden_states)?);
        Ok(())
    }

    /// One round. `history` is the whole sequence so far and ends with the last emitted token,
    /// which is not yet in `cache` (`cache.len() == history.len() − 1`). `wanted`: tokens still to
    /// generate (≥ 1). Returns ≥ 1 tokens; `cache` then holds the history plus every returned token
    /// but the last. `rules`: the sequence's logit changes (`logit_bias`, grammar), `None` if it
    /// has none.
    pub fn round(
        &mut self,
        cache: &mut KvCache,
        history: &[u32],
        sampler: &mut Sampler,
        wanted: usize,
        mut rules: Option<&mut dyn LogitsConstraint>,
    ) -> Result<Vec<Emitted>> {
        let last = *history.last().ok_or(EngineError::EmptyPrompt)?;
        let len0 = cache.len();
        // Room for the verify pass [last, d₁..d_N] and no drafting past what is wanted.
        let limit = wanted
            .saturating_sub(1)
            .min(cache.capacity().saturating_sub(len0 + 1))
            .min(self.cfg.max_draft);
        let t0 = Instant::now();
        let (mut drafts, mut dists) = match &self.cfg.source {
            DraftSource::Ngram(p) => {
                let proposal = ngram::propose(history, limit, *p);
                let n = self.policy.choose(proposal.len());
                (proposal[..n].to_vec(), vec![DraftDist::Point; n])
            }
            DraftSource::Model(d) => {
                let n = self.policy.choose(limit);
                let d = d.clone();
                self.draft_with_model(&d, history, n, sampler)?
            }
            DraftSource::SelfDraft { layers } => {
                let n = self.policy.choose(limit);
                self.self_draft(*layers, cache, history, n, sampler)?
            }
            DraftSource::DFlash { draft, block_size } => {
                let n = self.policy.choose(limit);
                let draft = draft.clone();
                self.draft_dflash(&draft, *block_size, len0, history, n, sampler)?
            }
        };
        if let Some(r) = rules.as_deref_mut() {
            let n = r.valid_prefix(&drafts)?;
            drafts.truncate(n);
            dists.truncate(n);
        }
        let draft_ms = t0.elapsed().as_secs_f64() * 1e3;

        let t1 = Instant::now();
        // Every rollback of this round returns to len0 or later: checkpoint there (self-draft already
        // did, before drafting). A round without drafts needs none (hybrid models: no state copy).
        if !drafts.is_empty() && cache.checkpoint_len() != Some(len0) {
            self.target.checkpoint(cache);
        }
        let mut input = Vec::with_capacity(drafts.len() + 1);
        input.push(last);
        input.extend_from_slice(&drafts);
        let hidden_layers = self.target_layers().to_vec();
        let out = self.target.forward(
            &input,
            cache,
            if drafts.is_empty() { Logits::Last } else { Logits::All },
            &hidden_layers,
        )?;
        let fanout = fanout(&out);
        let rows: Vec<Vec<f32>> = out.logits.to_dtype(candle_core::DType::F32)?.to_vec2()?;
        let mut ctx = history.to_vec();
        let mut emitted: Vec<Emitted> = Vec::with_capacity(rows.len());
        let mut rows = rows.into_iter();
        let mut accepted = 0;
        for (&d, q) in drafts.iter().zip(&dists) {
            let logits = rows.next().expect("one logits row per verified token");
            let p = target_distribution(sampler, &logits, &ctx, rules.as_deref_mut())?;
            match accept::verify_token(&p, d, q, sampler) {
                Verdict::Accept => {
                    if let Some(r) = rules.as_deref_mut() {
                        r.advance(d)?;
                    }
                    emitted.push((d, logits));
                    ctx.push(d);
                    accepted += 1;
                }
                Verdict::Reject(t) => {
                    emitted.push((t, logits));
                    break;
                }
            }
        }
        if accepted == drafts.len() {
            // Every draft accepted (or none drafted): the bonus token from the last row.
            let logits = rows.next().expect("bonus logits row");
            let p = target_distribution(sampler, &logits, &ctx, rules.as_deref_mut())?;
            emitted.push((sampler.draw(&p), logits));
        }
        if let Some(r) = rules {
            r.undo()?;
        }
        self.target.rollback(cache, len0 + 1 + accepted)?;
        self.target.release_checkpoint(cache);
        // DFlash: the committed positions' features condition the next block.
        self.observe_hidden_states(&out.hidden_states, 1 + accepted)?;
        let verify_ms = t1.elapsed().as_secs_f64() * 1e3;
        if let Some(t) = self.trace.as_mut() {
            let (block_argmax, draft_logits) = self.last_block.take().unwrap_or_default();
            t.push(RoundTrace {
                start: len0,
                drafts: drafts.clone(),
                block_argmax,
                accepted,
                emitted: emitted.iter().map(|e| e.0).collect(),
                draft_logits,
            });
        }
        self.policy.observe(drafts.len(), accepted, draft_ms, verify_ms, fanout);
        self.stats.record(drafts.len(), accepted, draft_ms, verify_ms, fanout);
        Ok(emitted)
    }

    /// Draws one draft token from draft logits: the argmax under greedy decoding (a point
    /// proposal), otherwise a sample from the draft's own sampling distribution `q`.
    fn pick(sampler: &mut Sampler, logits: &[f32], ctx: &[u32]) -> (u32, DraftDist) {
        let q = sampler.distribution(logits, ctx);
        if sampler.params.is_greedy() {
            (q[0].0, DraftDist::Point)
        } else {
            (sampler.draw(&q), DraftDist::Sampled(q))
        }
    }

    /// `n` tokens from the draft model. Its cache keeps the longest prefix it shares with `history`;
    /// the rest of the history is fed in prefill chunks.
    fn draft_with_model(
        &mut self,
        model: &Transformer,
        history: &[u32],
        n: usize,
        sampler: &mut Sampler,
    ) -> Result<(Vec<u32>, Vec<DraftDist>)> {
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let cache = self.draft_cache.as_mut().expect("draft model has a cache");
        let mut common = self
            .draft_tokens
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        if model.rollback(cache, common).is_err() {
            // A hybrid draft model cannot go back before its checkpoint: start it over.
            cache.clear();
            common = 0;
        }
        self.draft_tokens.truncate(common);
        let mut logits = Vec::new();
        for part in history[common..].chunks(self.prefill_chunk) {
            logits =
                model.forward(part, cache, Logits::Last, &[])?.logits.flatten_all()?.to_vec1()?;
        }
        self.draft_tokens.extend_from_slice(&history[common..]);
        // The next round keeps at least this history: its drafts are rolled back to here.
        model.checkpoint(cache);
        let mut ctx = history.to_vec();
        let (mut drafts, mut dists) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n {
            let (d, q) = Self::pick(sampler, &logits, &ctx);
            drafts.push(d);
            dists.push(q);
            ctx.push(d);
            if i + 1 == n || cache.len() + 1 > cache.capacity() {
                break;
            }
            logits =
                model.forward(&[d], cache, Logits::Last, &[])?.logits.flatten_all()?.to_vec1()?;
            self.draft_tokens.push(d);
        }
        Ok((drafts, dists))
    }

    /// DFlash: one draft pass over the block `[last, mask × (B − 1)]` at positions `len0..len0 + B`
    /// with every pending context feature; the first `n` positions' tokens are the drafts (argmax
    /// under greedy decoding, otherwise sampled from the draft's distribution, as z-lab's
    /// `dflash_generate`). The draft pass always covers the whole block: its attention inside the
    /// block is bidirectional, so the proposals do not depend on how many of them are verified.
    fn draft_dflash(
        &mut self,
        draft: &DFlashDraft,
        block_size: usize,
        len0: usize,
        history: &[u32],
        n: usize,
        sampler: &mut Sampler,
    ) -> Result<(Vec<u32>, Vec<DraftDist>)> {
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let st = self.dflash.as_mut().expect("DFlash state");
        let ctx = match st.pending.len() {
            0 => None,
            1 => Some(draft.project(&st.pending[0])?),
            _ => Some(draft.project(&Tensor::cat(&st.pending, 0)?)?),
        };
        let mut block = vec![draft.mask_token_id(); block_size];
        block[0] = *history.last().ok_or(EngineError::EmptyPrompt)?;
        let logits = draft.draft_block(self.target, &mut st.cache, ctx.as_ref(), len0, &block)?;
        st.pending.clear();
        let rows: Vec<Vec<f32>> = logits.to_dtype(candle_core::DType::F32)?.to_vec2()?;
        let mut ctx = history.to_vec();
        let (mut drafts, mut dists) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for row in rows.iter().take(n) {
            let (d, q) = Self::pick(sampler, row, &ctx);
            drafts.push(d);
            dists.push(q);
            ctx.push(d);
        }
        if self.trace.is_some() {
            self.last_block =
                Some((rows.iter().map(|r| crate::sampling::argmax(r)).collect(), rows));
        }
        Ok((drafts, dists))
    }

    /// `n` tokens from the target's first `layers` layers, written into the target's own cache at
    /// the positions the verify pass then overwrites (rolled back before returning).
    fn self_draft(
        &mut self,
        layers: usize,
        cache: &mut KvCache,
        history: &[u32],
        n: usize,
        sampler: &mut Sampler,
    ) -> Result<(Vec<u32>, Vec<DraftDist>)> {
        let len0 = cache.len();
        if n > 0 {
            self.target.checkpoint(cache);
        }
        let mut ctx = history.to_vec();
        let mut tok = *history.last().ok_or(EngineError::EmptyPrompt)?;
        let (mut drafts, mut dists) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for _ in 0..n {
            if cache.len() + 1 > cache.capacity() {
                break;
            }
            let logits: Vec<f32> = self
                .target
                .forward_layers(&[tok], cache, Logits::Last, &[], layers)?
                .logits
                .flatten_all()?
                .to_vec1()?;
            let (d, q) = Self::pick(sampler, &logits, &ctx);
            drafts.push(d);
            dists.push(q);
            ctx.push(d);
            tok = d;
        }
        self.target.rollback(cache, len0)?;
        Ok((drafts, dists))
    }
}

/// Mean distinct experts per MoE layer of a verify pass (`None` for dense models).
fn fanout(out: &ForwardOutput) -> Option<f64> {
    if out.routing.is_empty() {
        return None;
    }
    let total: usize = out.routing.iter().map(|r| r.distinct_experts().len()).sum();
    Some(total as f64 / out.routing.len() as f64)
}
