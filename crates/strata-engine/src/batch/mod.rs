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
mod seq;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::DType;
use strata_models::{BatchOptions, BatchSeq, KvCache, Logits};

pub use prefix_cache::{PrefixCache, PrefixHit, PrefixStats};

use crate::engine::{
    Engine, EngineError, FinishReason, GenerateRequest, Generation, Result, TokenEvent,
};
use crate::output::SequenceOutput;
use seq::{Group, Phase, Seq, Snapshot};

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
    /// A step of decode rows and prompt chunks as two forward passes (`Some(true)`), one
    /// (`Some(false)`), or as the model's device decides (`None`:
    /// [`strata_models::Transformer::splits_mixed`]; `serve --mixed-steps`).
    pub split_mixed: Option<bool>,
    /// A decode step's token (of a sequence without a grammar or log-probabilities) is published
    /// — detokenized, checked against stop strings, sent — while the next step runs on the
    /// device (`Some(true)`), or before its launch (`Some(false)`). `None`: where the model's
    /// device runs a step without the host (CUDA). See [`Batcher::step`].
    pub defer_emission: Option<bool>,
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
            split_mixed: None,
            defer_emission: None,
        }
    }
}

/// What a request's sequences report to its submitter.
pub enum SeqEvent<'a> {
    /// A token of choice `choice` (0..n).
    Token { choice: usize, event: &'a TokenEvent },
    /// Choice `choice` ended (finish reason `stop`, `length`, or `cancelled`).
    Done { choice: usize, generation: Box<Generation> },
    /// The request failed; no further event follows for any of its choices.
    Failed(EngineError),
}

/// Receives a request's events.
pub type Sink = Box<dyn FnMut(SeqEvent<'_>) -> ControlFlow<()> + Send>;

/// A request for the batcher: the generation, how many choices to sample from its one prefill,
/// where its events go, and its cancellation flag.
pub struct Submission {
    pub req: GenerateRequest,
    /// Choices (OpenAI `n`): the prompt is prefilled once, then its KV cache is copied into
    /// `n − 1` more slots and each choice samples on its own (choice `i` seeded `seed + i`).
    pub n: usize,
    /// Receives every token, then exactly one `Done` per choice, or one `Failed`. `Break` on a
    /// token cancels that choice (it then ends with `Done`, finish reason `cancelled`).
    pub sink: Sink,
    /// Set by the submitter to cancel every choice; checked before every step.
    pub cancel: Arc<AtomicBool>,
}

impl Submission {
    /// One choice.
    pub fn new(req: GenerateRequest, sink: Sink, cancel: Arc<AtomicBool>) -> Self {
        Self { req, n: 1, sink, cancel }
    }
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
    /// Milliseconds before the pass: cancelled sequences dropped, waiting requests admitted
    /// (prefix-cache lookups and copies), the step planned.
    pub admit_ms: f64,
    /// Milliseconds after the pass until the sequences that ended are handled: sampling, the
    /// tokens' detokenization, stop checks and emission, the routing tally.
    pub emit_ms: f64,
    /// Milliseconds spent ending sequences: held-back text flushed, prefixes kept in the prefix
    /// cache, slots freed.
    pub finish_ms: f64,
}

/// What [`Batcher::warm_up`] did.
#[derive(Debug, Clone, Copy)]
pub struct WarmUp {
    /// Milliseconds it took.
    pub ms: f64,
    /// Whether the second request found the first's prefix in the prefix cache.
    pub prefix_hit: bool,
    /// Batched decode step sizes run twice (2 up to the slots): captured as CUDA graphs where the
    /// model's batched steps are (0 elsewhere).
    pub batch_sizes: usize,
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
    next_id: u64,
    /// [`BatchConfig::defer_emission`] decided.
    defer: bool,
    /// Decode tokens recorded and not yet published: `(sequence id, token)`.
    pending: Vec<(u64, u32)>,
}

/// How a sequence ended in a step.
type Outcome = std::result::Result<FinishReason, EngineError>;

/// What a sequence's next token is decided from.
enum Pick<'a> {
    /// Its logits `[vocab]` on the host: the sampler draws.
    Logits(&'a [f32]),
    /// The greedy pick the device made ([`Logits::Greedy`]).
    Token(u32),
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
        let defer = cfg.defer_emission.unwrap_or(engine.model.device().is_cuda());
        Ok(Self {
            engine,
            cfg,
            caches,
            busy,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix,
            hybrid,
            next_id: 0,
            defer,
            pending: Vec::new(),
        })
    }

    /// Queues a request; it joins the batch when `n` slots are free.
    pub fn submit(&mut self, s: Submission) {
        self.waiting.push_back(s);
    }

    /// Sequences generating now.
    pub fn active(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for slots.
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

    /// Runs a greedy request through the batch twice — the second time on the first's cached
    /// prefix when there is a prefix cache; one prefix block long, or on a GPU long enough for the
    /// prompt kernels ([`strata_models::Transformer::prompt_kernel_rows`]) — then empties the
    /// prefix cache, so that a server's first user requests pay none of the process's first-use
    /// costs (on a GPU: the driver compiling each kernel module's PTX when it is first used, ours
    /// and candle's, and the decode graphs' capture). On a fresh H200 with the synthetic 30B,
    /// without it, the first request took 13.0 s to its first token and the next one, with the
    /// same prompt (a prefix hit), 3.7 s (docs/performance.md). llama-server also warms up at
    /// start. Where batched decode steps are captured as CUDA graphs
    /// ([`strata_models::Transformer::batched_graph_rows`]), it then runs every batch size from 2
    /// up to the slots twice (requests of 4-token prompts and 3 tokens, submitted together), so
    /// that a burst of requests finds its steps captured, as vLLM captures its batch sizes' graphs
    /// at start (`cudagraph_capture_sizes`).
    ///
    /// Errors: as [`Self::step`]; `Internal` when requests are running or waiting, or the context
    /// is too short for the warm-up prompt (4 tokens at least).
    pub fn warm_up(&mut self) -> Result<WarmUp> {
        if self.has_work() {
            return Err(EngineError::Internal("warm-up while requests are running".into()));
        }
        let started = Instant::now();
        let vocab = self.engine.model.config().vocab_size.max(1) as u32;
        // Whole prefix blocks and one token more (a hit then prefills one token), within the
        // context with room for the two generated tokens: one block, or on a GPU enough to take
        // the prompt kernels (their modules load on first use: a 16-client burst's first pass on
        // kernels the warm-up had not run took 210 ms against ~60, docs/performance.md).
        let block = self.cfg.prefix_block.max(1);
        let min_rows = self.engine.model.prompt_kernel_rows().unwrap_or(1);
        let len = (min_rows.div_ceil(block) * block + 1).min(self.cfg.ctx_size.saturating_sub(3));
        if len < 4 {
            return Err(EngineError::Internal(format!(
                "a context of {} tokens is too short for the warm-up",
                self.cfg.ctx_size
            )));
        }
        let prompt: Vec<u32> = (0..len as u32).map(|i| (i + 1) % vocab).collect();
        for _ in 0..2 {
            self.run_warm_up(vec![prompt.clone()], 2)?;
        }
        // Batched decode steps of every size up to the slots (and the graph path's limit), so
        // that a burst of requests never waits for its step's first op-by-op run and capture:
        // each size twice (a size is captured the second time it comes), from 4-token prompts of
        // their own (no prefix hits).
        let mut sizes = 0;
        if let Some(max) = self.engine.model.batched_graph_rows() {
            for n in 2..=max.min(self.caches.len()) {
                let prompts = (0..n as u32)
                    .map(|s| (0..4).map(|i| (7 + 31 * s + i) % vocab).collect())
                    .collect();
                self.run_warm_up(prompts, 3)?;
                sizes += 1;
            }
        }
        let hit = self.prefix_stats().is_some_and(|st| st.hits > 0);
        if self.prefix.is_some() {
            self.prefix =
                Some(PrefixCache::new(self.cfg.prefix_block, self.cfg.prefix_cache_bytes));
        }
        Ok(WarmUp { ms: ms_since(started), prefix_hit: hit, batch_sizes: sizes })
    }

    /// Runs greedy requests for `prompts` (`max_tokens` each, all submitted at once) to their
    /// end. Errors: a step's, or the first request failure.
    fn run_warm_up(&mut self, prompts: Vec<Vec<u32>>, max_tokens: usize) -> Result<()> {
        let failed: Arc<std::sync::Mutex<Option<EngineError>>> = Default::default();
        for prompt in prompts {
            let f = failed.clone();
            let sink: Sink = Box::new(move |ev| {
                if let SeqEvent::Failed(e) = ev {
                    *f.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
                ControlFlow::Continue(())
            });
            let mut req = GenerateRequest::new(prompt, max_tokens, crate::SamplingParams::greedy());
            req.ignore_eos = true;
            self.submit(Submission::new(req, sink, Arc::new(AtomicBool::new(false))));
        }
        while self.has_work() {
            self.step(&|| false)?;
        }
        let err = failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Ends every running and waiting request with `error()` (a server shutdown).
    pub fn fail_all(&mut self, error: &dyn Fn() -> EngineError) {
        self.pending.clear();
        for s in std::mem::take(&mut self.running) {
            s.group.fail(error());
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
    ///
    /// With deferred emission ([`BatchConfig::defer_emission`]), a decode step's token of a
    /// sequence without a grammar or log-probabilities that cannot end it by itself (not EOS,
    /// not the last `max_tokens` allows, room left in the context) is recorded at once and runs
    /// in the next step, and its publication (text, stop strings, the event) happens while that
    /// step runs on the device ([`BatchOptions::while_running`]; after the pass where the pass
    /// does not call it) — the host's part of vLLM's asynchronous scheduling that overlaps the
    /// GPU. A sequence that a stop string (or its client) ends then has run one token more than
    /// it emits: that row's result is dropped, and its events are the same as without deferral,
    /// one step later.
    pub fn step(&mut self, stop: &dyn Fn() -> bool) -> Result<StepStats> {
        let started = Instant::now();
        self.drop_cancelled();
        self.admit();
        if self.running.is_empty() {
            return Ok(StepStats::default());
        }
        let (plan, rows, decode_rows) = self.plan();
        let admit_ms = ms_since(started);
        let before = self.engine.model.experts().stats();
        let ids: Vec<u64> = plan.iter().map(|(i, _)| self.running[*i].id).collect();
        let mut published: Vec<(u64, Outcome)> = Vec::new();
        let t = Instant::now();
        let results = {
            let mut slots: Vec<Option<&mut KvCache>> = self.caches.iter_mut().map(Some).collect();
            let mut batch: Vec<BatchSeq<'_>> = Vec::with_capacity(plan.len());
            for (i, tokens) in &plan {
                let s = &self.running[*i];
                let cache = slots[s.slot].take().expect("a sequence's slot");
                // A decode step whose sampler takes the raw logits' argmax asks for the greedy
                // pick alone: on a GPU it is made there and the logits stay on the device.
                let greedy = matches!(s.phase, Phase::Decode { .. }) && s.out.greedy_only();
                let logits = if greedy { Logits::Greedy } else { Logits::Last };
                batch.push(BatchSeq { tokens, cache, logits });
            }
            // The previous step's deferred tokens, published while this pass runs.
            let engine = self.engine.clone();
            let publishing = RefCell::new((&mut self.running, &mut self.pending, &mut published));
            let publish = || {
                let mut guard = publishing.borrow_mut();
                let (running, pending, ended) = &mut *guard;
                publish_pending(&engine, running, pending, ended);
            };
            let opts = BatchOptions {
                stop: Some(stop),
                isolate_expert_errors: true,
                split_mixed: self.cfg.split_mixed,
                while_running: Some(&publish),
                ..Default::default()
            };
            // Decode rows come first in the pass; the prompt chunks' rows after them.
            let results = strata_models::prefill_scope(rows, decode_rows, || {
                self.engine.model.forward_batch(&mut batch, opts)
            });
            publish(); // when the pass did not (nothing is left to publish if it did)
            results?
        };
        let pass_ms = ms_since(t);
        let emitting = Instant::now();
        let mut stats = StepStats {
            sequences: plan.len(),
            rows,
            decode_rows,
            pass_ms,
            admit_ms,
            ..Default::default()
        };
        if let (Some(a), Some(b)) = (self.engine.model.experts().stats(), before) {
            stats.expert_bytes_read = a.since(&b).bytes_read;
        }
        // Sequences their deferred token ended (a stop string, the client gone): this pass's row
        // for them is dropped.
        let mut finished: Vec<(u64, Outcome)> = published;
        let mut seen: Vec<Vec<u64>> = Vec::new();
        for ((id, (_, tokens)), res) in ids.iter().zip(&plan).zip(results) {
            if finished.iter().any(|(f, _)| f == id) {
                continue;
            }
            let out = match res {
                Ok(o) => o,
                Err(e) => {
                    finished.push((*id, Err(e.into())));
                    continue;
                }
            };
            mark_experts(&mut seen, &out.routing);
            stats.generated +=
                self.advance(*id, tokens.len(), &out.logits, out.greedy, &mut finished);
        }
        if !seen.is_empty() {
            stats.distinct_experts_per_layer = distinct_per_layer(&seen);
        }
        stats.emit_ms = ms_since(emitting);
        let finishing = Instant::now();
        for (id, outcome) in finished {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(i);
                self.finish(s, outcome);
            }
        }
        stats.finish_ms = ms_since(finishing);
        Ok(stats)
    }

    /// This step's rows: every decode token, then prefill chunks first-come first-served under
    /// the budget (at least one). Returns `[(running index, tokens)]`, rows, decode rows.
    #[allow(clippy::type_complexity)]
    fn plan(&self) -> (Vec<(usize, Vec<u32>)>, usize, usize) {
        let mut plan = Vec::new();
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
            let prompt = &s.group.req.prompt;
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
        (plan, rows, decode_rows)
    }

    /// Takes a pass's logits `[1, vocab]` for sequence `id`, which ran `n` tokens: samples and
    /// emits the next token when the prompt is done (and forks the request's other choices from
    /// it). `greedy`: the pick the device made for a [`Logits::Greedy`] decode step (its logits
    /// are then empty). Pushes sequences that end onto `finished`; returns the tokens emitted.
    fn advance(
        &mut self,
        id: u64,
        n: usize,
        logits: &candle_core::Tensor,
        greedy: Option<u32>,
        finished: &mut Vec<(u64, Outcome)>,
    ) -> usize {
        let Some(i) = self.running.iter().position(|s| s.id == id) else { return 0 };
        if let Some(token) = greedy {
            // Only decode steps ask for it: no prompt ends here, no choices fork.
            self.sample_into(i, Pick::Token(token), finished);
            return 1;
        }
        let s = &mut self.running[i];
        let mut forks = false;
        if let Phase::Prefill { done } = s.phase {
            let done = done + n;
            if s.snapshot_at > 0 && done == s.snapshot_at {
                s.snapshot = self.caches[s.slot].snapshot_recurrent().map(|r| (done, r));
            }
            if done < s.group.req.prompt.len() {
                s.phase = Phase::Prefill { done };
                return 0;
            }
            s.experts_prefilled = self.engine.model.experts().stats();
            forks = true;
        }
        // On the host already (a batch's logits come in one copy): each sequence's row is
        // borrowed, not copied.
        let copied;
        let guard = logits.storage_and_layout();
        let host: candle_core::Result<&[f32]> = match (&*guard.0, guard.1.contiguous_offsets()) {
            (candle_core::Storage::Cpu(c), Some((a, b))) if logits.dtype() == DType::F32 => {
                c.as_slice::<f32>().map(|v| &v[a..b])
            }
            _ => match logits.flatten_all().and_then(|l| l.to_dtype(DType::F32)?.to_vec1()) {
                Ok(l) => {
                    copied = l;
                    Ok(copied.as_slice())
                }
                Err(e) => Err(e),
            },
        };
        let logits = match host {
            Ok(l) => l,
            Err(e) => {
                finished.push((id, Err(e.into())));
                return 0;
            }
        };
        let mut emitted = 1;
        self.sample_into(i, Pick::Logits(logits), finished);
        if forks {
            // The request's other choices copy this prompt's cache and sample from its logits.
            let group = self.running[i].group.clone();
            let from = self.running[i].slot;
            let followers: Vec<usize> = (0..self.running.len())
                .filter(|&j| {
                    let f = &self.running[j];
                    Arc::ptr_eq(&f.group, &group) && matches!(f.phase, Phase::Fork)
                })
                .collect();
            for j in followers {
                let to = self.running[j].slot;
                if let Err(e) = copy_cache(&mut self.caches, from, to) {
                    finished.push((self.running[j].id, Err(e.into())));
                    continue;
                }
                self.running[j].experts_prefilled = self.running[i].experts_prefilled;
                self.sample_into(j, Pick::Logits(logits), finished);
                emitted += 1;
            }
        }
        emitted
    }

    /// Samples running sequence `i`'s next token (or takes the device's greedy pick) and emits
    /// it; records its end.
    fn sample_into(&mut self, i: usize, pick: Pick<'_>, finished: &mut Vec<(u64, Outcome)>) {
        let id = self.running[i].id;
        match self.sample_and_emit(i, pick) {
            Ok(None) => {}
            Ok(Some(f)) => finished.push((id, Ok(f))),
            Err(e) => finished.push((id, Err(e))),
        }
    }

    fn sample_and_emit(&mut self, i: usize, pick: Pick<'_>) -> Result<Option<FinishReason>> {
        let engine = self.engine.clone();
        let cap = self.cfg.ctx_size;
        let s = &mut self.running[i];
        // A device pick comes only for a sequence without log-probabilities (`greedy_only`):
        // `emit` reads no logits then.
        let (id, logits) = match pick {
            Pick::Logits(l) => (s.out.sample(l)?, l),
            Pick::Token(t) => (t, &[][..]),
        };
        if s.first_token.is_none() {
            s.first_token = Some(Instant::now());
        }
        let len = self.caches[s.slot].len();
        if self.defer
            && matches!(s.phase, Phase::Decode { .. })
            && s.out.defers()
            && !s.out.ends_with(&engine, id)
            && len < cap
        {
            // Published during the next step ([`Self::step`]): without a grammar or
            // log-probabilities nothing but the text is left to decide.
            s.out.record(&engine, id)?;
            s.phase = Phase::Decode { next: id };
            self.pending.push((s.id, id));
            return Ok(None);
        }
        let (group, choice) = (s.group.clone(), s.choice);
        let finish = s.out.emit(&engine, id, logits, &mut |event| {
            group.send(SeqEvent::Token { choice, event })
        })?;
        s.phase = Phase::Decode { next: id };
        Ok(finish.or((len + 1 > cap).then_some(FinishReason::Length)))
    }

    /// Ends sequence `s`: flushes its text, reports it, keeps its prefix, frees its slot. A
    /// failure fails the whole request: its other choices end too.
    fn finish(&mut self, mut s: Seq, outcome: Outcome) {
        // A deferred token goes out before the end (a cancelled sequence's, at the next step).
        if let Some(k) = self.pending.iter().position(|(id, _)| *id == s.id) {
            let (_, token) = self.pending.remove(k);
            let _ = publish(&self.engine, &mut s, token);
        }
        let finish = match outcome {
            Ok(f) => f,
            Err(e) => return self.fail_group(s, e),
        };
        let engine = self.engine.clone();
        let (group, choice) = (s.group.clone(), s.choice);
        if let Err(e) =
            s.out.flush(&engine, &mut |event| group.send(SeqEvent::Token { choice, event }))
        {
            return self.fail_group(s, e);
        }
        let gen = s.generation(finish, engine.model.experts().stats());
        if !s.group.has_failed() {
            let _ = s.group.send(SeqEvent::Done { choice, generation: Box::new(gen) });
        }
        // A cancelled sequence's entries are as good as a finished one's.
        self.release(s.slot, Some((std::mem::take(&mut s.out.history), s.snapshot.take())));
    }

    /// Fails `s`'s request with `e` and ends its other choices.
    fn fail_group(&mut self, s: Seq, e: EngineError) {
        self.pending.retain(|(id, _)| *id != s.id);
        s.group.fail(e);
        self.release(s.slot, None);
        let group = s.group;
        while let Some(i) = self.running.iter().position(|o| Arc::ptr_eq(&o.group, &group)) {
            let o = self.running.remove(i);
            self.release(o.slot, None);
        }
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
            if self.running[i].group.cancel.load(Ordering::SeqCst) {
                let s = self.running.remove(i);
                self.finish(s, Ok(FinishReason::Cancelled));
            } else {
                i += 1;
            }
        }
        self.waiting.retain(|w| !w.cancel.load(Ordering::SeqCst));
    }

    /// Moves waiting requests into free slots (`n` each, first come first served), starting each
    /// from its longest cached prefix.
    fn admit(&mut self) {
        while let Some(front) = self.waiting.front() {
            let n = front.n.max(1);
            if n <= self.caches.len() && self.free_slots() < n {
                return; // waits for slots; later requests wait behind it
            }
            let Some(sub) = self.waiting.pop_front() else { return };
            self.admit_one(sub);
        }
    }

    fn admit_one(&mut self, mut sub: Submission) {
        let n = sub.n.max(1);
        let check = if n > self.caches.len() {
            Err(EngineError::Internal(format!(
                "{n} choices need {n} sequence slots; the server has {}",
                self.caches.len()
            )))
        } else {
            self.check(&sub.req)
        };
        // Every choice's output state first: a grammar that does not compile fails the request.
        let outs = check.and_then(|()| {
            (0..n)
                .map(|c| {
                    let mut req = sub.req.clone();
                    req.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(c as u64));
                    SequenceOutput::new(&self.engine, &req)
                })
                .collect::<Result<Vec<_>>>()
        });
        let outs = match outs {
            Ok(o) => o,
            Err(e) => {
                let _ = (sub.sink)(SeqEvent::Failed(e));
                return;
            }
        };
        let group = Group::new(sub.req, sub.sink, sub.cancel);
        let block = self.cfg.prefix_block.max(1);
        let snapshot_at = if self.hybrid && self.prefix.is_some() {
            (group.req.prompt.len() - 1) / block * block
        } else {
            0
        };
        let experts0 = self.engine.model.experts().stats();
        for (choice, out) in outs.into_iter().enumerate() {
            let slot = self.busy.iter().position(|b| !b).expect("free slots were counted");
            self.busy[slot] = true;
            let mut done = 0;
            if choice == 0 {
                let cache = &mut self.caches[slot];
                if let Some(hit) =
                    self.prefix.as_mut().and_then(|p| p.lookup(&group.req.prompt, self.hybrid))
                {
                    match hit.import(cache) {
                        Ok(()) => done = hit.tokens,
                        Err(e) => {
                            tracing::warn!("prefix cache: import failed, prefilling all: {e}");
                            cache.clear();
                        }
                    }
                }
            }
            self.next_id += 1;
            self.running.push(Seq {
                id: self.next_id,
                group: group.clone(),
                choice,
                slot,
                phase: if choice == 0 { Phase::Prefill { done } } else { Phase::Fork },
                out,
                admitted: Instant::now(),
                first_token: None,
                experts0,
                experts_prefilled: None,
                snapshot: None,
                snapshot_at: if choice == 0 && snapshot_at > done { snapshot_at } else { 0 },
            });
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

/// Copies slot `from`'s cache (every position, recurrent state, routing history) into slot `to`.
fn copy_cache(caches: &mut [KvCache], from: usize, to: usize) -> strata_models::Result<()> {
    let src = &caches[from];
    let block = src.export_block(0, src.len())?;
    let state = src.snapshot_recurrent();
    caches[to].import_prefix(&[&block], state.as_ref())
}

/// Publishes every deferred token ([`Batcher::step`]) of `running`'s sequences, in the order they
/// were recorded; sequences whose token ends them go to `ended` (a stop string, the client gone,
/// an error).
fn publish_pending(
    engine: &Engine,
    running: &mut [Seq],
    pending: &mut Vec<(u64, u32)>,
    ended: &mut Vec<(u64, Outcome)>,
) {
    for (id, token) in pending.drain(..) {
        let Some(s) = running.iter_mut().find(|s| s.id == id) else { continue };
        match publish(engine, s, token) {
            Ok(None) => {}
            Ok(Some(f)) => ended.push((id, Ok(f))),
            Err(e) => ended.push((id, Err(e))),
        }
    }
}

/// Publishes `s`'s deferred `token` to its request ([`crate::output::SequenceOutput::publish`]);
/// how the sequence ends with it, if it does.
fn publish(engine: &Engine, s: &mut Seq, token: u32) -> Result<Option<FinishReason>> {
    let (group, choice) = (s.group.clone(), s.choice);
    s.out.publish(engine, token, None, false, &mut |event| {
        group.send(SeqEvent::Token { choice, event })
    })
}

/// Marks the experts of `routing` (one sequence's pass, by MoE layer) in `seen`: per layer a bit
/// per expert id (words added as ids need them).
fn mark_experts(seen: &mut Vec<Vec<u64>>, routing: &[strata_models::LayerRouting]) {
    for (l, r) in routing.iter().enumerate() {
        if seen.len() <= l {
            seen.push(Vec::new());
        }
        for &e in &r.expert_ids {
            let (word, bit) = (e as usize / 64, e % 64);
            if seen[l].len() <= word {
                seen[l].resize(word + 1, 0);
            }
            seen[l][word] |= 1 << bit;
        }
    }
}

/// The mean over layers of the distinct experts [`mark_experts`] marked.
fn distinct_per_layer(seen: &[Vec<u64>]) -> f64 {
    let distinct: u32 = seen.iter().flatten().map(|w| w.count_ones()).sum();
    distinct as f64 / seen.len().max(1) as f64
}

/// Milliseconds since `t`.
fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_models::LayerRouting;

    #[test]
    fn distinct_experts_are_the_union_of_the_sequences_choices() {
        // Two layers; three sequences' passes (one of two tokens), ids past 64 and repeats.
        let pass = |ids: [&[u32]; 2]| -> Vec<LayerRouting> {
            (0..2)
                .map(|l| LayerRouting {
                    layer: l,
                    top_k: 2,
                    expert_ids: ids[l].to_vec(),
                    weights: vec![0.5; ids[l].len()],
                })
                .collect()
        };
        let passes = [
            pass([&[3, 70], &[0, 1]]),
            pass([&[70, 127, 3, 5], &[1, 64, 64, 2]]),
            pass([&[5, 6], &[127, 0]]),
        ];
        let mut seen = Vec::new();
        passes.iter().for_each(|p| mark_experts(&mut seen, p));
        // The reference: each layer's ids sorted, duplicates removed.
        let reference: f64 = (0..2)
            .map(|l| {
                let mut ids: Vec<u32> =
                    passes.iter().flat_map(|p| p[l].expert_ids.clone()).collect();
                ids.sort_unstable();
                ids.dedup();
                ids.len() as f64
            })
            .sum::<f64>()
            / 2.0;
        assert_eq!(distinct_per_layer(&seen), reference);
        assert_eq!(reference, 5.0); // {3, 5, 6, 70, 127} and {0, 1, 2, 64, 127}
    }
}
