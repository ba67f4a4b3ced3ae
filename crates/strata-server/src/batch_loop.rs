//! The batch thread: takes queued requests into free sequence slots and runs every active request
//! in shared forward passes ([`strata_engine::batch::Batcher`]: continuous batching, prefix
//! cache). A panic inside a step fails the requests of that step; the thread keeps serving.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_engine::batch::{BatchConfig, Batcher, SeqEvent, StepStats, Submission};
use strata_engine::{Engine, EngineError, FinishReason};

use crate::error::ApiError;
use crate::metrics::BatchMetrics;
use crate::scheduler::{panic_message, GenEvent, Job, Scheduler};
use crate::ServerConfig;

/// Allocates the slots' KV caches and starts the batch thread.
pub fn start(
    engine: Arc<Engine>,
    config: &ServerConfig,
    rx: Receiver<Job>,
    s: &Scheduler,
    metrics: BatchMetrics,
    trigger: Option<Vec<u32>>,
) -> Result<(), String> {
    let mut bc = BatchConfig::new(config.parallel, config.ctx_size);
    bc.prefill_chunk = config.prefill_chunk.max(1);
    let gpu = engine.model.device().is_cuda();
    bc.step_tokens =
        config.batch_tokens.unwrap_or(if gpu { GPU_BATCH_TOKENS } else { CPU_BATCH_TOKENS }).max(1);
    bc.prefix_cache_bytes = config.prefix_cache_bytes;
    bc.split_mixed = config.split_mixed;
    bc.defer_emission = config.defer_emission;
    let window = config.batch_window.unwrap_or(if engine.model.experts().stats().is_some() {
        STREAMED_BATCH_WINDOW
    } else {
        Duration::ZERO
    });
    let mut batcher = Batcher::new(engine, bc).map_err(|e| format!("starting the batch: {e}"))?;
    if config.warm_up {
        let w = batcher.warm_up().map_err(|e| format!("warming up: {e}"))?;
        let sizes = match w.batch_sizes {
            0 => String::new(),
            n => format!("; batched steps of 2 to {} sequences captured", n + 1),
        };
        tracing::info!(
            "warm-up: {:.0} ms (two short requests{}{sizes}; --no-warmup skips it)",
            w.ms,
            if w.prefix_hit { ", the second a prefix hit" } else { "" }
        );
    }
    let s = s.clone();
    std::thread::Builder::new()
        .name("strata-batch".into())
        .spawn(move || run(batcher, rx, s, metrics, trigger, window))
        .map_err(|e| format!("spawning the batch thread: {e}"))?;
    Ok(())
}

/// `--batch-tokens auto` on the CPU (the budget every device had before the thirty-fourth
/// session): a step's pass stays short, so running requests' tokens keep coming while prompts
/// enter.
pub const CPU_BATCH_TOKENS: usize = 512;

/// `--batch-tokens auto` on a GPU: requests arriving together have their prompts in one pass, each
/// weight read once for all of them. H200, the synthetic 30B, 16 clients' prompts of ~57 tokens:
/// 16 clients against 1, 5.73× / 5.70× with 2048 against 4.90× / 5.56× with 512, which split them
/// over two passes (docs/performance.md, thirty-fourth session, call 4).
pub const GPU_BATCH_TOKENS: usize = 2048;

/// `--batch-window auto` where experts stream: how long a new request waits for others before its
/// prompt pass (ms against a streamed 30B's prompt pass of 4–7 s, which reads nearly every expert).
pub const STREAMED_BATCH_WINDOW: Duration = Duration::from_millis(50);

fn run(
    mut b: Batcher,
    rx: Receiver<Job>,
    s: Scheduler,
    metrics: BatchMetrics,
    trigger: Option<Vec<u32>>,
    window: Duration,
) {
    let mut log = StepLog::default();
    loop {
        // Block while idle; otherwise take what the free slots can start this step.
        let mut admitted = false;
        if !b.has_work() {
            match rx.recv() {
                Ok(job) => admit(&mut b, job, &s, trigger.as_ref()),
                Err(_) => return,
            }
            admitted = true;
        }
        while b.free_slots() > b.waiting() {
            match rx.try_recv() {
                Ok(job) => admit(&mut b, job, &s, trigger.as_ref()),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) if b.has_work() => break,
                Err(TryRecvError::Disconnected) => return,
            }
            admitted = true;
        }
        if admitted && !window.is_zero() {
            gather(&mut b, &rx, &s, trigger.as_ref(), window);
        }
        if s.is_shut_down() {
            b.fail_all(&|| EngineError::Model(strata_models::ModelError::Interrupted));
            continue;
        }
        let stop = || s.is_shut_down();
        let started = Instant::now();
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| b.step(&stop)));
        match step {
            Ok(Ok(stats)) => {
                metrics.observe(&stats, b.prefix_stats());
                log.add(&stats, started);
                if !b.has_work() {
                    log.flush(); // the end of a busy period
                }
            }
            Ok(Err(e)) => {
                let msg = e.to_string();
                b.fail_all(&|| match &e {
                    EngineError::Model(strata_models::ModelError::Interrupted) => {
                        EngineError::Model(strata_models::ModelError::Interrupted)
                    }
                    _ => EngineError::Internal(msg.clone()),
                });
            }
            Err(p) => {
                let msg = panic_message(p.as_ref());
                tracing::error!("generation panicked: {msg}");
                let msg = format!("internal error during generation: {msg}");
                b.fail_all(&|| EngineError::Internal(msg.clone()));
            }
        }
    }
}

/// After new requests were taken: waits up to `window` for more while slots are free, so that
/// requests arriving together share their prompt passes instead of one pass each (a streamed
/// MoE's prompt pass reads nearly every expert from the drive; vLLM's `--scheduler-delay-factor`
/// holds prompts back for the same reason). Returns early when the slots are full.
fn gather(
    b: &mut Batcher,
    rx: &Receiver<Job>,
    s: &Scheduler,
    trigger: Option<&Vec<u32>>,
    window: Duration,
) {
    let deadline = Instant::now() + window;
    while b.free_slots() > b.waiting() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(job) => admit(b, job, s, trigger),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Takes a job off the queue into the batcher (or answers it at once: shutdown, client gone).
fn admit(b: &mut Batcher, job: Job, s: &Scheduler, trigger: Option<&Vec<u32>>) {
    s.queued.fetch_sub(1, Ordering::SeqCst);
    if s.is_shut_down() {
        s.cancellations.by_shutdown.inc();
        tracing::info!(id = job.id, "request refused: the server is shutting down");
        let _ = job.events.send(GenEvent::Failed(ApiError::shutting_down()));
        return;
    }
    if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
        s.cancellations.by_client.inc();
        tracing::info!(id = job.id, "request cancelled by the client before it started");
        return;
    }
    // The test hook panics inside the step, on the request's first token (once).
    let panic_once = Arc::new(AtomicBool::new(trigger == Some(&job.req.prompt)));
    let (id, events, s_end) = (job.id, job.events, s.clone());
    // A request counts as active from here until its last event is sent: `/health` never shows
    // a request the client has seen end as still active.
    s.active.fetch_add(1, Ordering::SeqCst);
    let mut choices_left = job.n.max(1);
    let mut ended = false;
    let mut end = move |last: bool| {
        if !ended && last {
            ended = true;
            s_end.active.fetch_sub(1, Ordering::SeqCst);
        }
    };
    let s2 = s.clone();
    let sink = move |ev: SeqEvent<'_>| -> ControlFlow<()> {
        if let SeqEvent::Done { .. } = ev {
            choices_left = choices_left.saturating_sub(1);
            end(choices_left == 0);
        } else if let SeqEvent::Failed(_) = ev {
            end(true);
        }
        match ev {
            SeqEvent::Token { choice, event } => {
                if panic_once.swap(false, Ordering::SeqCst) {
                    panic!("test panic trigger");
                }
                if events.send(GenEvent::Token(choice, event.clone())).is_err() {
                    return ControlFlow::Break(());
                }
            }
            SeqEvent::Done { choice, generation: g }
                if g.finish_reason == FinishReason::Cancelled =>
            {
                let (generated, prompt_tokens) = (g.tokens.len(), g.prompt_tokens);
                if s2.is_shut_down() {
                    s2.cancellations.by_shutdown.inc();
                    tracing::info!(
                        id,
                        generated,
                        prompt_tokens,
                        "request cut short by the shutdown"
                    );
                    let _ = events.send(GenEvent::Failed(ApiError::shutting_down()));
                } else {
                    s2.cancellations.by_client.inc();
                    tracing::info!(id, generated, prompt_tokens, "request cancelled by the client");
                    let _ = events.send(GenEvent::Done(choice, g));
                }
            }
            SeqEvent::Done { choice, generation } => {
                let _ = events.send(GenEvent::Done(choice, generation));
            }
            SeqEvent::Failed(e) => {
                let err = match e {
                    EngineError::Model(strata_models::ModelError::Interrupted) => {
                        s2.cancellations.by_shutdown.inc();
                        tracing::info!(id, "request cut short by the shutdown");
                        ApiError::shutting_down()
                    }
                    EngineError::PromptTooLong { prompt, ctx } => ApiError::context_length(
                        None,
                        format!(
                            "This model's context is {ctx} tokens; the prompt has {prompt} tokens"
                        ),
                    ),
                    e => ApiError::internal(format!("generation failed: {e}")),
                };
                let _ = events.send(GenEvent::Failed(err));
            }
        }
        ControlFlow::Continue(())
    };
    b.submit(Submission { req: job.req, n: job.n, sink: Box::new(sink), cancel: job.cancel });
}

/// Logs the batch's figures every few seconds while it works, and when it runs out of work:
/// per step the forward pass (`pass_ms`), the whole step with sampling and the tokens' emission
/// (`step_ms`), and the time from one step's start to the next with the admission of new
/// requests (`loop_ms`); of the step beside the pass, the admission and plan before it
/// (`admit_ms`), sampling and emission after it (`emit_ms`) and the ending of sequences
/// (`finish_ms`: prefixes kept, slots freed); `tok_s` over the busy time since the last line.
#[derive(Default)]
struct StepLog {
    /// When the first step counted here started.
    since: Option<Instant>,
    /// When the last step ended.
    last_end: Option<Instant>,
    steps: u64,
    sequences: u64,
    rows: u64,
    generated: u64,
    distinct: f64,
    bytes: u64,
    pass_ms: f64,
    admit_ms: f64,
    emit_ms: f64,
    finish_ms: f64,
    step_ms: f64,
}

impl StepLog {
    /// Counts a step that began at `started` and ended now.
    fn add(&mut self, st: &StepStats, started: Instant) {
        if st.sequences == 0 {
            return;
        }
        let now = Instant::now();
        tracing::debug!(
            sequences = st.sequences,
            rows = st.rows,
            decode_rows = st.decode_rows,
            generated = st.generated,
            pass_ms = format!("{:.2}", st.pass_ms),
            step_ms = format!("{:.2}", now.duration_since(started).as_secs_f64() * 1e3),
            gap_ms = format!(
                "{:.2}",
                self.last_end.map_or(0.0, |e| started.duration_since(e).as_secs_f64() * 1e3)
            ),
            "step"
        );
        self.since.get_or_insert(started);
        self.last_end = Some(now);
        self.steps += 1;
        self.sequences += st.sequences as u64;
        self.rows += st.rows as u64;
        self.generated += st.generated as u64;
        self.distinct += st.distinct_experts_per_layer;
        self.bytes += st.expert_bytes_read;
        self.pass_ms += st.pass_ms;
        self.admit_ms += st.admit_ms;
        self.emit_ms += st.emit_ms;
        self.finish_ms += st.finish_ms;
        self.step_ms += now.duration_since(started).as_secs_f64() * 1e3;
        if self.since.is_some_and(|s| s.elapsed() >= Duration::from_secs(5)) {
            self.flush();
        }
    }

    /// Logs what was counted since the last line, if anything.
    fn flush(&mut self) {
        let (Some(since), Some(end)) = (self.since, self.last_end) else { return };
        let busy = end.duration_since(since).as_secs_f64().max(1e-9);
        let n = self.steps.max(1) as f64;
        tracing::info!(
            steps = self.steps,
            batch_size = format!("{:.2}", self.sequences as f64 / n),
            rows_per_step = format!("{:.1}", self.rows as f64 / n),
            tok_s = format!("{:.1}", self.generated as f64 / busy),
            pass_ms = format!("{:.2}", self.pass_ms / n),
            admit_ms = format!("{:.3}", self.admit_ms / n),
            emit_ms = format!("{:.3}", self.emit_ms / n),
            finish_ms = format!("{:.3}", self.finish_ms / n),
            step_ms = format!("{:.2}", self.step_ms / n),
            loop_ms = format!("{:.2}", busy * 1e3 / n),
            distinct_experts_per_layer = format!("{:.1}", self.distinct / n),
            expert_bytes_per_token = self.bytes / self.generated.max(1),
            "batch"
        );
        *self = Self::default();
    }
}
