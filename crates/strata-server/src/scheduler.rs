//! Sequence slots and the wait queue. `--parallel N` worker threads each own a KV cache and run one
//! generation at a time (generation is blocking CPU work, kept off the async runtime); requests
//! wait in a bounded FIFO, and a full queue is answered at once (503) instead of piling up.
//! A panic inside one generation is caught: that request fails, the slot keeps serving.
//!
//! Every request ends with an event that says how: `Done` (finish reason `stop` or `length`), or
//! `Failed` with an error — `server_shutting_down` when a shutdown cut it short, during prefill
//! included (the engine polls the shutdown flag between layers). A request whose client went away
//! is logged and counted (`strata_requests_cancelled_by_client`).

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use strata_engine::{Engine, FinishReason, GenerateRequest, Generation, TokenEvent};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Cancellations;
use crate::ServerConfig;

/// What a worker reports to the request handler.
#[derive(Debug)]
pub enum GenEvent {
    Token(TokenEvent),
    /// Boxed: the finished generation is large and sent once.
    Done(Box<Generation>),
    Failed(ApiError),
}

struct Job {
    id: String,
    req: GenerateRequest,
    events: UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
}

/// Handle to submit work; cheap to clone.
#[derive(Clone)]
pub struct Scheduler {
    tx: SyncSender<Job>,
    queued: Arc<AtomicUsize>,
    active: Arc<AtomicUsize>,
    queue_size: usize,
    shutdown: Arc<AtomicBool>,
    cancellations: Cancellations,
}

impl Scheduler {
    /// Starts `config.parallel` workers with a cache of `config.ctx_size` tokens each and a queue
    /// of `config.queue_size`. `panic_trigger`: a prompt that makes a worker panic (the
    /// `test-hooks` feature's tests only; `None` otherwise).
    pub fn start(
        engine: Arc<Engine>,
        config: &ServerConfig,
        cancellations: Cancellations,
        panic_trigger: Option<Vec<u32>>,
    ) -> Result<Self, String> {
        let (tx, rx) = sync_channel::<Job>(config.queue_size);
        let rx = Arc::new(Mutex::new(rx));
        let s = Scheduler {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            active: Arc::new(AtomicUsize::new(0)),
            queue_size: config.queue_size,
            shutdown: Arc::new(AtomicBool::new(false)),
            cancellations,
        };
        for i in 0..config.parallel.max(1) {
            let cache = engine
                .new_cache(config.ctx_size)
                .map_err(|e| format!("allocating the KV cache: {e}"))?;
            let (engine, rx, s2, trigger) =
                (engine.clone(), rx.clone(), s.clone(), panic_trigger.clone());
            std::thread::Builder::new()
                .name(format!("strata-slot-{i}"))
                .spawn(move || worker(engine, cache, rx, s2, trigger))
                .map_err(|e| format!("spawning a worker thread: {e}"))?;
        }
        Ok(s)
    }

    /// Queues a request (`id` names it in logs); `Err` (503) when the queue is full or the server
    /// is shutting down. Returns the cancellation flag.
    pub fn submit(
        &self,
        req: GenerateRequest,
        events: UnboundedSender<GenEvent>,
        id: String,
    ) -> Result<Arc<AtomicBool>, ApiError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        let cancel = Arc::new(AtomicBool::new(false));
        self.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { id, req, events, cancel: cancel.clone() }) {
            Ok(()) => Ok(cancel),
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(1, Ordering::SeqCst);
                Err(ApiError::overloaded(self.queue_size))
            }
        }
    }

    /// Requests waiting for a slot.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Requests generating now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Ends every generation between two layers (or two tokens) and fails queued requests, each
    /// with a `server_shutting_down` error (server shutdown).
    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }

    fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }
}

fn worker(
    engine: Arc<Engine>,
    mut cache: strata_models::KvCache,
    rx: Arc<Mutex<Receiver<Job>>>,
    s: Scheduler,
    trigger: Option<Vec<u32>>,
) {
    loop {
        let job = {
            let Ok(rx) = rx.lock() else { return };
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        s.queued.fetch_sub(1, Ordering::SeqCst);
        if s.is_shut_down() {
            s.cancellations.by_shutdown.inc();
            tracing::info!(id = job.id, "request refused: the server is shutting down");
            let _ = job.events.send(GenEvent::Failed(ApiError::shutting_down()));
            continue;
        }
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            s.cancellations.by_client.inc();
            tracing::info!(id = job.id, "request cancelled by the client before it started");
            continue;
        }
        s.active.fetch_add(1, Ordering::SeqCst);
        let events = job.events.clone();
        let stop = || s.is_shut_down() || job.cancel.load(Ordering::SeqCst);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if trigger.as_ref() == Some(&job.req.prompt) {
                panic!("test panic trigger");
            }
            engine.generate_with(
                &mut cache,
                &job.req,
                &mut |ev| {
                    if events.send(GenEvent::Token(ev.clone())).is_err() {
                        return ControlFlow::Break(());
                    }
                    ControlFlow::Continue(())
                },
                &stop,
            )
        }));
        s.active.fetch_sub(1, Ordering::SeqCst);
        let ev = match result {
            Ok(Ok(g)) if g.finish_reason == FinishReason::Cancelled && s.is_shut_down() => {
                s.cancellations.by_shutdown.inc();
                tracing::info!(
                    id = job.id,
                    generated = g.tokens.len(),
                    prompt_tokens = g.prompt_tokens,
                    "request cut short by the shutdown"
                );
                GenEvent::Failed(ApiError::shutting_down())
            }
            Ok(Ok(g)) if g.finish_reason == FinishReason::Cancelled => {
                s.cancellations.by_client.inc();
                tracing::info!(
                    id = job.id,
                    generated = g.tokens.len(),
                    prompt_tokens = g.prompt_tokens,
                    "request cancelled by the client"
                );
                GenEvent::Done(Box::new(g))
            }
            Ok(Ok(g)) => GenEvent::Done(Box::new(g)),
            Ok(Err(e)) => GenEvent::Failed(ApiError::internal(format!("generation failed: {e}"))),
            Err(p) => {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(id = job.id, "generation panicked: {msg}");
                cache.clear();
                GenEvent::Failed(ApiError::internal(format!(
                    "internal error during generation: {msg}"
                )))
            }
        };
        let _ = job.events.send(ev);
    }
}
