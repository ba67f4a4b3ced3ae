//! Sequence slots and the wait queue. `--parallel N` worker threads each own a KV cache and run one
//! generation at a time (generation is blocking CPU work, kept off the async runtime); requests
//! wait in a bounded FIFO, and a full queue is answered at once (503) instead of piling up.
//! A panic inside one generation is caught: that request fails, the slot keeps serving.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::ops::ControlFlow;

use strata_engine::{Engine, GenerateRequest, Generation, TokenEvent};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;

/// What a worker reports to the request handler.
#[derive(Debug)]
pub enum GenEvent {
    Token(TokenEvent),
    Done(Generation),
    Failed(ApiError),
}

struct Job {
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
}

impl Scheduler {
    /// Starts `parallel` workers with a cache of `ctx_size` tokens each and a queue of `queue_size`.
    /// `panic_trigger`: a prompt token sequence that makes a worker panic (tests only).
    pub fn start(engine: Arc<Engine>, parallel: usize, ctx_size: usize, queue_size: usize, panic_trigger: Option<Vec<u32>>) -> Result<Self, String> {
        let (tx, rx) = sync_channel::<Job>(queue_size);
        let rx = Arc::new(Mutex::new(rx));
        let s = Scheduler {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            active: Arc::new(AtomicUsize::new(0)),
            queue_size,
            shutdown: Arc::new(AtomicBool::new(false)),
        };
        for i in 0..parallel.max(1) {
            let cache = engine.new_cache(ctx_size).map_err(|e| format!("allocating the KV cache: {e}"))?;
            let (engine, rx, s2, trigger) = (engine.clone(), rx.clone(), s.clone(), panic_trigger.clone());
            std::thread::Builder::new()
                .name(format!("strata-slot-{i}"))
                .spawn(move || worker(engine, cache, rx, s2, trigger))
                .map_err(|e| format!("spawning a worker thread: {e}"))?;
        }
        Ok(s)
    }

    /// Queues a request; `Err` (503) when the queue is full. Returns the cancellation flag.
    pub fn submit(&self, req: GenerateRequest, events: UnboundedSender<GenEvent>) -> Result<Arc<AtomicBool>, ApiError> {
        let cancel = Arc::new(AtomicBool::new(false));
        self.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(Job { req, events, cancel: cancel.clone() }) {
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

    /// Stops all generations at their next token (server shutdown).
    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }
}

fn worker(engine: Arc<Engine>, mut cache: strata_models::KvCache, rx: Arc<Mutex<Receiver<Job>>>, s: Scheduler, trigger: Option<Vec<u32>>) {
    loop {
        let job = {
            let Ok(rx) = rx.lock() else { return };
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        s.queued.fetch_sub(1, Ordering::SeqCst);
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            continue;
        }
        s.active.fetch_add(1, Ordering::SeqCst);
        let events = job.events.clone();
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if trigger.as_ref() == Some(&job.req.prompt) {
                panic!("test panic trigger");
            }
            engine.generate(&mut cache, &job.req, &mut |ev| {
                if s.shutdown.load(Ordering::SeqCst) || job.cancel.load(Ordering::SeqCst) || events.send(GenEvent::Token(ev.clone())).is_err() {
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            })
        }));
        s.active.fetch_sub(1, Ordering::SeqCst);
        let ev = match result {
            Ok(Ok(g)) => GenEvent::Done(g),
            Ok(Err(e)) => GenEvent::Failed(ApiError::internal(format!("generation failed: {e}"))),
            Err(p) => {
                let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
                tracing::error!("generation panicked: {msg}");
                cache.clear();
                GenEvent::Failed(ApiError::internal(format!("internal error during generation: {msg}")))
            }
        };
        let _ = job.events.send(ev);
    }
}
