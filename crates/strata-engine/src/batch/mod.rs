//! Continuous batching (Orca, Yu et al. OSDI 2022; chunked prefill as in Sarathi-Serve, Agrawal
//! et al. OSDI 2024 and vLLM's scheduler): every step runs one forward pass over every active
//! sequence — one decode token per running sequence, plus prefill chunks of new ones under a
//! per-step token budget — so the weights (and, with MoE, the union of the batch's experts) are
//! read once per step for all of them. Sequences join and leave between steps.
//!
//! KV caches are per slot, preallocated (`slots × ctx_size` tokens): our attention kernels read a
//! sequence's keys contiguously, the plan can count the memory up front, and a slot never
//! waits for blocks mid-generation. Sharing comes from the [`PrefixCache`], whose blocks are
//! copied into a slot (a copy of a 2,000-token prefix costs far less than its prefill).
//!
//! Scheduling: running sequences always get their decode token (a decode never waits behind
//! prompts); prefill chunks go first-come first-served, at least one per step, so a stream of
//! long prompts cannot starve a waiting one. A sequence's prompt is cut into the same chunks
//! (`prefill_chunk` tokens) whatever else is in the batch, so where rows are independent of each
//! other (see [`strata_models::BatchSeq`]) a batched sequence's tokens equal its tokens alone.
//!
//! Speculative decoding is not run here: [`Batcher::new`] refuses an engine with speculation on
//! (the server then runs one generation per slot, `serve --help`).

pub mod prefix_cache;

use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use strata_models::{BatchOptions, BatchSeq, ExpertStats, KvCache, Logits, RecurrentSnapshot};

pub use prefix_cache::{PrefixCache, PrefixHit, PrefixStats};

use crate::engine::{
    Engine, EngineError, FinishReason, GenerateRequest, Generation, Result, Timings, TokenEvent,
};
use crate::output::SequenceOutput;

/// Settings of a [`Batcher`].
#[derive(Debug, Clone)]
pub struct BatchConfig {
    /// Sequences generating at once (KV caches allocated).
    pub slots: usize,
    /// Tokens per slot's KV cache.
    pub ctx_size: usize,
    /// Prompt tokens per prefill chunk of one sequence.
    pub prefill_chunk: usize,
    /// Rows (tokens) one step runs at most, beyond one prefill chunk (a step always takes its
    /// decode tokens and at least one chunk).
    pub step_tokens: usize,
    /// Bytes of the prefix cache (0: none).
    pub prefix_cache_bytes: usize,
    /// Tokens per prefix-cache block.
    pub prefix_block: usize,
}

impl BatchConfig {
    pub fn new(slots: usize, ctx_size: usize) -> Self {
        Self {
            slots: slots.max(1),
            ctx_size,
            prefill_chunk: 512,
            step_tokens: 512,
            prefix_cache_bytes: 0,
            prefix_block: 64,
        }
    }
}

/// What a sequence reports to its submitter.
pub enum SeqEvent<'a> {
    Token(&'a TokenEvent),
    /// The generation ended (finish reason `stop`, `length`, or `cancelled`).
    Done(Box<Generation>),
    Failed(EngineError),
}

/// A request for the batcher: the generation, where its events go, and its cancellation flag.
pub struct Submission {
    pub req: GenerateRequest,
    /// Receives every token, then exactly one `Done` or `Failed`. `Break` on a token cancels the
    /// sequence (it then ends with `Done`, finish reason `cancelled`).
    pub sink: Box<dyn FnMut(SeqEvent<'_>) -> ControlFlow<()> + Send>,
    /// Set by the submitter to cancel; checked before every step.
    pub cancel: Arc<AtomicBool>,
}

/// A hybrid model's recurrent state after position `.0`.
type Snapshot = Option<(usize, RecurrentSnapshot)>;

enum Phase {
    /// Prompt positions `done..` still to run.
    Prefill { done: usize },
    /// `next` was emitted and runs in the next step.
    Decode { next: u32 },
}

struct Seq {
    sub: Submission,
    slot: usize,
    phase: Phase,
    out: SequenceOutput,
    admitted: Instant,
    first_token: Option<Instant>,
    experts0: Option<ExpertStats>,
    experts_prefilled: Option<ExpertStats>,
    /// Hybrids: the recurrent state at the last block boundary inside the prompt.
    snapshot: Snapshot,
    /// Hybrids: where that boundary is (0: none).
    snapshot_at: usize,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Sequences in the pass.
    pub sequences: usize,
    /// Rows (tokens) in the pass.
    pub rows: usize,
    /// Of those, decode tokens.
    pub decode_rows: usize,
    /// Tokens emitted to clients.
    pub generated: usize,
    /// Distinct experts per MoE layer, averaged over layers (0 for dense models).
    pub distinct_experts_per_layer: f64,
    /// Expert bytes read from the drive during the step.
    pub expert_bytes_read: u64,
    /// Milliseconds the pass took.
    pub pass_ms: f64,
}

/// The continuous-batching scheduler over one [`Engine`]. Drive it with [`Self::submit`] and
/// [`Self::step`] from one thread (the server's batch thread; tests call it directly).
pub struct Batcher {
    engine: Arc<Engine>,
    cfg: BatchConfig,
    caches: Vec<KvCache>,
    /// Whether each slot's cache belongs to a running sequence.
    busy: Vec<bool>,
    waiting: VecDeque<Submission>,
    running: Vec<Seq>,
    prefix: Option<PrefixCache>,
    hybrid: bool,
}

impl Batcher {
    /// Allocates `cfg.slots` KV caches. Errors: the engine has speculative decoding on, or a
    /// cache cannot be allocated.
    pub fn new(engine: Arc<Engine>, cfg: BatchConfig) -> Result<Self> {
        if engine.spec.is_some() {
            return Err(EngineError::Spec(
                "continuous batching runs without speculative decoding".into(),
            ));
        }
        let caches =
            (0..cfg.slots).map(|_| engine.new_cache(cfg.ctx_size)).collect::<Result<Vec<_>>>()?;
        let busy = vec![false; caches.len()];
        let hybrid = engine.model.config().linear_attn.is_some();
        let prefix = (cfg.prefix_cache_bytes > 0)
            .then(|| PrefixCache::new(cfg.prefix_block, cfg.prefix_cache_bytes));
        Ok(Self {
            engine,
            cfg,
            caches,
            busy,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix,
            hybrid,
        })
    }

    /// Queues a request; it joins the batch when a slot is free.
    pub fn submit(&mut self, s: Submission) {
        self.waiting.push_back(s);
    }

    /// Sequences generating now.
    pub fn active(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Free slots.
    pub fn free_slots(&self) -> usize {
        self.busy.iter().filter(|b| !**b).count()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Prefix-cache counters (`None` without one).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(PrefixCache::stats)
    }

    /// Ends every running and waiting sequence with `error()` (a server shutdown).
    pub fn fail_all(&mut self, error: &dyn Fn() -> EngineError) {
        for mut s in std::mem::take(&mut self.running) {
            let _ = (s.sub.sink)(SeqEvent::Failed(error()));
            self.release(s.slot, None);
        }
        for mut w in std::mem::take(&mut self.waiting) {
            let _ = (w.sink)(SeqEvent::Failed(error()));
        }
    }

    /// Admits waiting requests into free slots, runs one forward pass over every active sequence,
    /// and emits what it decided. `stop` is polled between layers: when it says so the pass ends
    /// with `EngineError::Model(Interrupted)` and every sequence is left as it was (call
    /// [`Self::fail_all`]).
    pub fn step(&mut self, stop: &dyn Fn() -> bool) -> Result<StepStats> {
        self.drop_cancelled();
        self.admit();
        if self.running.is_empty() {
            return Ok(StepStats::default());
        }
        // Decode tokens first, then prefill chunks first-come first-served under the budget.
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::new(); // (running index, tokens)
        let mut rows = 0;
        for (i, s) in self.running.iter().enumerate() {
            if let Phase::Decode { next } = s.phase {
                plan.push((i, vec![next]));
                rows += 1;
            }
        }
        let decode_rows = rows;
        let mut took_prefill = false;
        for (i, s) in self.running.iter().enumerate() {
            let Phase::Prefill { done } = s.phase else { continue };
            let prompt = &s.sub.req.prompt;
            let mut end = (done + self.cfg.prefill_chunk.max(1)).min(prompt.len());
            if s.snapshot_at > done && s.snapshot_at < end {
                end = s.snapshot_at; // hybrids: stop at the boundary to snapshot the state
            }
            let n = end - done;
            if took_prefill && rows + n > self.cfg.step_tokens + decode_rows {
                break;
            }
            plan.push((i, prompt[done..end].to_vec()));
            rows += n;
            took_prefill = true;
        }
        let before = self.engine.model.experts().stats();
        let t = Instant::now();
        let results = {
            let mut slots: Vec<Option<&mut KvCache>> = self.caches.iter_mut().map(Some).collect();
            let mut batch: Vec<BatchSeq<'_>> = Vec::with_capacity(plan.len());
            for (i, tokens) in &plan {
                let cache = slots[self.running[*i].slot].take().expect("a sequence's slot");
                batch.push(BatchSeq { tokens, cache, logits: Logits::Last });
            }
            let opts = BatchOptions {
                stop: Some(stop),
                isolate_expert_errors: true,
                ..Default::default()
            };
            self.engine.model.forward_batch(&mut batch, opts)?
        };
        let pass_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut stats =
            StepStats { sequences: plan.len(), rows, decode_rows, pass_ms, ..Default::default() };
        if let (Some(a), Some(b)) = (self.engine.model.experts().stats(), before) {
            stats.expert_bytes_read = a.since(&b).bytes_read;
        }
        let mut finished: Vec<(usize, std::result::Result<FinishReason, EngineError>)> = Vec::new();
        let mut moe_layers = 0;
        let mut distinct = 0;
        let mut seen: Vec<Vec<u32>> = Vec::new();
        for ((i, tokens), res) in plan.iter().zip(results) {
            let out = match res {
                Ok(o) => o,
                Err(e) => {
                    finished.push((*i, Err(e.into())));
                    continue;
                }
            };
            for (l, r) in out.routing.iter().enumerate() {
                if seen.len() <= l {
                    seen.push(Vec::new());
                }
                seen[l].extend_from_slice(&r.expert_ids);
            }
            match self.advance(*i, tokens.len(), &out.logits) {
                Ok(Some(f)) => finished.push((*i, Ok(f))),
                Ok(None) => {}
                Err(e) => finished.push((*i, Err(e))),
            }
            if matches!(self.running[*i].phase, Phase::Decode { .. }) {
                stats.generated += 1;
            }
        }
        for mut ids in seen {
            ids.sort_unstable();
            ids.dedup();
            moe_layers += 1;
            distinct += ids.len();
        }
        if moe_layers > 0 {
            stats.distinct_experts_per_layer = distinct as f64 / moe_layers as f64;
        }
        // Finish from the highest index down so that indices stay valid.
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, outcome) in finished {
            let s = self.running.remove(i);
            self.finish(s, outcome);
        }
        Ok(stats)
    }

    /// Takes a pass's logits `[1, vocab]` for sequence `i`, which ran `n` tokens: samples and emits
    /// the next token when the prompt is done. Returns how the sequence ends, if it does.
    fn advance(
        &mut self,
        i: usize,
        n: usize,
        logits: &candle_core::Tensor,
    ) -> Result<Option<FinishReason>> {
        let engine = self.engine.clone();
        let cap = self.cfg.ctx_size;
        let s = &mut self.running[i];
        if let Phase::Prefill { done } = s.phase {
            let done = done + n;
            if s.snapshot_at > 0 && done == s.snapshot_at {
                s.snapshot = self.caches[s.slot].snapshot_recurrent().map(|r| (done, r));
            }
            if done < s.sub.req.prompt.len() {
                s.phase = Phase::Prefill { done };
                return Ok(None);
            }
            s.experts_prefilled = engine.model.experts().stats();
        }
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let id = s.out.sample(&logits);
        if s.first_token.is_none() {
            s.first_token = Some(Instant::now());
        }
        let sink = &mut s.sub.sink;
        let finish = s.out.emit(&engine, id, &logits, &mut |ev| sink(SeqEvent::Token(ev)))?;
        let len = self.caches[s.slot].len();
        s.phase = Phase::Decode { next: id };
        Ok(finish.or((len + 1 > cap).then_some(FinishReason::Length)))
    }

    /// Ends sequence `s`: flushes its text, reports it, keeps its prefix, frees its slot.
    fn finish(&mut self, mut s: Seq, outcome: std::result::Result<FinishReason, EngineError>) {
        let finish = match outcome {
            Ok(f) => f,
            Err(e) => {
                let _ = (s.sub.sink)(SeqEvent::Failed(e));
                self.release(s.slot, None);
                return;
            }
        };
        let engine = self.engine.clone();
        let sink = &mut s.sub.sink;
        if let Err(e) = s.out.flush(&engine, &mut |ev| sink(SeqEvent::Token(ev))) {
            let _ = (s.sub.sink)(SeqEvent::Failed(e));
            self.release(s.slot, None);
            return;
        }
        let end = Instant::now();
        let first = s.first_token.unwrap_or(end);
        let prefill_ms = (first - s.admitted).as_secs_f64() * 1e3;
        let experts_end = engine.model.experts().stats();
        let delta = |from: Option<ExpertStats>| match (experts_end, from) {
            (Some(now), Some(before)) => Some(now.since(&before)),
            _ => None,
        };
        let gen = Generation {
            prompt_tokens: s.sub.req.prompt.len(),
            tokens: std::mem::take(&mut s.out.tokens),
            text: std::mem::take(&mut s.out.text),
            finish_reason: finish,
            timings: Timings {
                prefill_ms,
                decode_ms: (end - first).as_secs_f64() * 1e3,
                ttft_ms: prefill_ms,
            },
            experts: delta(s.experts0),
            experts_decode: delta(s.experts_prefilled),
            prefetch_decode: None,
            spec: None,
            routing: None,
        };
        let _ = (s.sub.sink)(SeqEvent::Done(Box::new(gen)));
        // A cancelled sequence's entries are as good as a finished one's.
        self.release(s.slot, Some((s.out.history, s.snapshot)));
    }

    /// Returns slot `slot`'s cache to the pool, keeping its prefix (`history`: the sequence's
    /// tokens, of which the cache holds the first `len()`) when a prefix cache is on.
    fn release(&mut self, slot: usize, keep: Option<(Vec<u32>, Snapshot)>) {
        let cache = &mut self.caches[slot];
        if let (Some(p), Some((history, snap))) = (self.prefix.as_mut(), keep) {
            if let Err(e) = p.insert(&history, cache, snap) {
                tracing::warn!("prefix cache: could not keep a prefix: {e}");
            }
        }
        cache.clear();
        self.busy[slot] = false;
    }

    /// Ends sequences whose submitter cancelled (finish reason `cancelled`).
    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].sub.cancel.load(Ordering::SeqCst) {
                let s = self.running.remove(i);
                self.finish(s, Ok(FinishReason::Cancelled));
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|w| !w.cancel.load(Ordering::SeqCst));
    }

    /// Moves waiting requests into free slots, starting each from its longest cached prefix.
    fn admit(&mut self) {
        while let Some(slot) = self.busy.iter().position(|b| !b) {
            let Some(mut sub) = self.waiting.pop_front() else { return };
            if let Err(e) = self.check(&sub.req) {
                let _ = (sub.sink)(SeqEvent::Failed(e));
                continue;
            }
            let cache = &mut self.caches[slot];
            let mut done = 0;
            if let Some(hit) =
                self.prefix.as_mut().and_then(|p| p.lookup(&sub.req.prompt, self.hybrid))
            {
                match hit.import(cache) {
                    Ok(()) => done = hit.tokens,
                    Err(e) => {
                        tracing::warn!("prefix cache: import failed, prefilling all: {e}");
                        cache.clear();
                    }
                }
            }
            let block = self.cfg.prefix_block.max(1);
            let snapshot_at = if self.hybrid && self.prefix.is_some() {
                (sub.req.prompt.len() - 1) / block * block
            } else {
                0
            };
            let out = SequenceOutput::new(&sub.req);
            let experts0 = self.engine.model.experts().stats();
            self.running.push(Seq {
                sub,
                slot,
                phase: Phase::Prefill { done },
                out,
                admitted: Instant::now(),
                first_token: None,
                experts0,
                experts_prefilled: None,
                snapshot: None,
                snapshot_at: if snapshot_at > done { snapshot_at } else { 0 },
            });
            self.busy[slot] = true;
        }
    }

    fn check(&self, req: &GenerateRequest) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.prompt.len() >= self.cfg.ctx_size {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                ctx: self.cfg.ctx_size,
            });
        }
        Ok(())
    }
}
