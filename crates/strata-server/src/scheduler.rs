//! Sequence slots and the wait queue. Requests wait in a bounded FIFO, and a full queue is
//! answered at once (503) instead of piling up. Generation is blocking CPU work, kept off the
//! async runtime on threads of its own:
//! - by default one batch thread runs every active request in shared forward passes
//!   (continuous batching, [`crate::batch_loop`]);
//! - with speculative decoding, `--parallel` worker threads run one generation each
//!   ([`crate::slots`]).
//!
//! Every request ends with an event that says how: `Done` (finish reason `stop` or `length`), or
//! `Failed` with an error — `server_shutting_down` when a shutdown cut it short, during prefill
//! included (the engine polls the shutdown flag between layers). A request whose client went away
//! is logged and counted (`strata_requests_cancelled_by_client`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use strata_engine::{Engine, GenerateRequest, Generation, TokenEvent};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::{BatchMetrics, Cancellations};
use crate::ServerConfig;

/// What a worker reports to the request handler.
#[derive(Debug)]
pub enum GenEvent {
    /// A token of choice `.0`.
    Token(usize, TokenEvent),
    /// Choice `.0` ended. Boxed: the finished generation is large and sent once.
    Done(usize, Box<Generation>),
    /// The request failed (no more events follow).
    Failed(ApiError),
}

pub(crate) struct Job {
    pub id: String,
    pub req: GenerateRequest,
    /// Choices (OpenAI `n`; 1 with speculative decoding).
    pub n: usize,
    pub events: UnboundedSender<GenEvent>,
    pub cancel: Arc<AtomicBool>,
}

/// Handle to submit work; cheap to clone.
#[derive(Clone)]
pub struct Scheduler {
    tx: SyncSender<Job>,
    pub(crate) queued: Arc<AtomicUsize>,
    pub(crate) active: Arc<AtomicUsize>,
    queue_size: usize,
    shutdown: Arc<AtomicBool>,
    pub(crate) cancellations: Cancellations,
    /// Whether requests share forward passes (false with speculative decoding).
    batched: bool,
}

impl Scheduler {
    /// Starts the batch thread (or, with speculative decoding, `config.parallel` workers) with
    /// `config.parallel` KV caches of `config.ctx_size` tokens and a queue of
    /// `config.queue_size`. `panic_trigger`: a prompt that makes generation panic (the
    /// `test-hooks` feature's tests only; `None` otherwise).
    pub fn start(
        engine: Arc<Engine>,
        config: &ServerConfig,
        cancellations: Cancellations,
        batch_metrics: BatchMetrics,
        panic_trigger: Option<Vec<u32>>,
    ) -> Result<Self, String> {
        let (tx, rx) = sync_channel::<Job>(config.queue_size);
        let batched = engine.spec.is_none();
        let s = Scheduler {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            active: Arc::new(AtomicUsize::new(0)),
            queue_size: config.queue_size,
            shutdown: Arc::new(AtomicBool::new(false)),
            cancellations,
            batched,
        };
        if batched {
            crate::batch_loop::start(engine, config, rx, &s, batch_metrics, panic_trigger)?;
        } else {
            let rx = Arc::new(Mutex::new(rx));
            crate::slots::start(&engine, config.parallel, config.ctx_size, rx, &s, panic_trigger)?;
        }
        Ok(s)
    }

    /// Whether requests share forward passes (continuous batching).
    pub fn is_batched(&self) -> bool {
        self.batched
    }

    /// Queues a request (`id` names it in logs); `Err` (503) when the queue is full or the server
    /// is shutting down. Returns the cancellation flag.
    pub fn submit(
        &self,
        req: GenerateRequest,
        n: usize,
        events: UnboundedSender<GenEvent>,
        id: String,
    ) -> Result<Arc<AtomicBool>, ApiError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        let cancel = Arc::new(AtomicBool::new(false));
        self.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { id, req, n, events, cancel: cancel.clone() }) {
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

    pub(crate) fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}
