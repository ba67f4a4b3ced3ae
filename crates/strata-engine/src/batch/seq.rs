//! One running sequence of the batcher and the request (group of choices) it belongs to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use strata_models::{ExpertStats, RecurrentSnapshot};

use super::{SeqEvent, Sink};
use crate::engine::{EngineError, FinishReason, GenerateRequest, Generation, Timings};
use crate::output::SequenceOutput;

/// A hybrid model's recurrent state after position `.0`.
pub(super) type Snapshot = Option<(usize, RecurrentSnapshot)>;

/// A request: its choices share the prompt, the sink and the cancellation flag.
pub(super) struct Group {
    pub req: GenerateRequest,
    sink: Mutex<Sink>,
    pub cancel: Arc<AtomicBool>,
    /// Set once the request failed (its `Failed` event sent).
    failed: AtomicBool,
}

impl Group {
    pub fn new(req: GenerateRequest, sink: Sink, cancel: Arc<AtomicBool>) -> Arc<Self> {
        Arc::new(Self { req, sink: Mutex::new(sink), cancel, failed: AtomicBool::new(false) })
    }

    pub fn send(&self, ev: SeqEvent<'_>) -> std::ops::ControlFlow<()> {
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        sink(ev)
    }

    /// Sends `Failed` once; later calls do nothing. Returns whether this call sent it.
    pub fn fail(&self, e: EngineError) -> bool {
        if self.failed.swap(true, Ordering::SeqCst) {
            return false;
        }
        let _ = self.send(SeqEvent::Failed(e));
        true
    }

    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }
}

pub(super) enum Phase {
    /// Prompt positions `done..` still to run.
    Prefill { done: usize },
    /// A choice after the first: waits for the first choice's prefill, then copies its cache.
    Fork,
    /// `next` was emitted and runs in the next step.
    Decode { next: u32 },
}

pub(super) struct Seq {
    /// Unique among running sequences.
    pub id: u64,
    pub group: Arc<Group>,
    /// Choice index within the group.
    pub choice: usize,
    pub slot: usize,
    pub phase: Phase,
    pub out: SequenceOutput,
    pub admitted: Instant,
    pub first_token: Option<Instant>,
    pub experts0: Option<ExpertStats>,
    pub experts_prefilled: Option<ExpertStats>,
    /// Hybrids: the recurrent state at the last block boundary inside the prompt.
    pub snapshot: Snapshot,
    /// Hybrids: where that boundary is (0: none).
    pub snapshot_at: usize,
}

impl Seq {
    /// The finished generation of this choice.
    pub fn generation(
        &mut self,
        finish: FinishReason,
        experts_end: Option<ExpertStats>,
    ) -> Generation {
        let end = Instant::now();
        let first = self.first_token.unwrap_or(end);
        let prefill_ms = (first - self.admitted).as_secs_f64() * 1e3;
        let delta = |from: Option<ExpertStats>| match (experts_end, from) {
            (Some(now), Some(before)) => Some(now.since(&before)),
            _ => None,
        };
        Generation {
            prompt_tokens: self.group.req.prompt.len(),
            tokens: std::mem::take(&mut self.out.tokens),
            text: std::mem::take(&mut self.out.text),
            finish_reason: finish,
            timings: Timings {
                prefill_ms,
                decode_ms: (end - first).as_secs_f64() * 1e3,
                ttft_ms: prefill_ms,
            },
            experts: delta(self.experts0),
            experts_decode: delta(self.experts_prefilled),
            prefetch_decode: None,
            spec: None,
            routing: None,
            mask: self.out.mask_stats(),
        }
    }
}
