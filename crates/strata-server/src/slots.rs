//! Per-slot generation, used when speculative decoding is on (continuous batching runs without
//! it, [`strata_engine::batch`]): `--parallel N` worker threads each own a KV cache and run one
//! generation at a time with the engine's own loop (`Engine::generate_with`), speculation
//! included. A panic inside one generation is caught: that request fails, the slot keeps serving.

use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};

use strata_engine::{Engine, FinishReason};

use crate::error::ApiError;
use crate::scheduler::{panic_message, GenEvent, Job, Scheduler};

/// Starts `parallel` worker threads over the queue `rx`.
pub fn start(
    engine: &Arc<Engine>,
    parallel: usize,
    ctx_size: usize,
    rx: Arc<Mutex<Receiver<Job>>>,
    s: &Scheduler,
    trigger: Option<Vec<u32>>,
) -> Result<(), String> {
    for i in 0..parallel.max(1) {
        let cache =
            engine.new_cache(ctx_size).map_err(|e| format!("allocating the KV cache: {e}"))?;
        let (engine, rx, s2, trigger) = (engine.clone(), rx.clone(), s.clone(), trigger.clone());
        std::thread::Builder::new()
            .name(format!("strata-slot-{i}"))
            .spawn(move || worker(engine, cache, rx, s2, trigger))
            .map_err(|e| format!("spawning a worker thread: {e}"))?;
    }
    Ok(())
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
                    if events.send(GenEvent::Token(0, ev.clone())).is_err() {
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
                GenEvent::Done(0, Box::new(g))
            }
            Ok(Ok(g)) => GenEvent::Done(0, Box::new(g)),
            Ok(Err(e)) => GenEvent::Failed(ApiError::internal(format!("generation failed: {e}"))),
            Err(p) => {
                let msg = panic_message(p.as_ref());
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
