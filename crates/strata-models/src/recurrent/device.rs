//! The recurrent state of Gated DeltaNet layers kept on the GPU (`cuda` build), with the
//! checkpoint / rollback of speculative decoding done there too: the state never visits the host.
//!
//! Same contract as the host state ([`super::RecurrentCache`]): a checkpoint copies every layer's
//! state (device copies) and from then on logs each pass's inputs; a rollback restores the copy
//! and replays the logged tokens through the same kernels without their readout
//! (`strata_kernels::cuda::gdn_conv` with no weight moves the conv window, `gdn_delta` without
//! readout updates the state). The log keeps each pass's own tensors (the gathered in-projection
//! rows `[T, rw]` and the conv output `[T, cd]`, which nothing writes after the pass), so logging
//! copies nothing.
//!
//! The state's buffers are allocated once and only ever written in place (clear, restore and
//! rollback copy into them), so a decode step captured as a CUDA graph stays valid.
//!
//! Device operations can fail (out of memory) where the host's cannot; a failure inside an
//! infallible call (`clear`, `checkpoint`, `restore`) marks the state lost, and the next pass
//! through a Gated DeltaNet layer reports it.

use candle_core::{DType, Device, Tensor};
use strata_kernels::cuda::{gdn_conv, gdn_delta, GdnShape, GdnState, GdnStates};

/// One layer's state on the device.
#[derive(Debug)]
pub struct DeviceLinearState {
    /// `[kernel − 1, conv_dim]`, oldest row first.
    pub conv: Tensor,
    /// `[v_heads, v_dim, k_dim]`: each head's `[k_dim, v_dim]` state transposed
    /// (`strata_kernels::cuda::gdn_delta`'s layout).
    pub ssm: Tensor,
}

impl DeviceLinearState {
    fn zeros(s: &GdnShape, dev: &Device) -> candle_core::Result<Self> {
        Ok(Self {
            conv: Tensor::zeros((s.kernel - 1, s.conv_dim()), DType::F32, dev)?,
            ssm: Tensor::zeros((s.v_heads, s.v_dim, s.k_dim), DType::F32, dev)?,
        })
    }

    /// A device copy.
    fn duplicate(&self) -> candle_core::Result<Self> {
        Ok(Self { conv: self.conv.copy()?, ssm: self.ssm.copy()? })
    }

    /// Sets this state to `src`'s in place (its buffers keep their addresses, which a captured
    /// decode graph holds).
    fn set_from(&self, src: &Self) -> candle_core::Result<()> {
        self.conv.slice_set(&src.conv, 0, 0)?;
        self.ssm.slice_set(&src.ssm, 0, 0)
    }

    /// Zeroes this state in place.
    fn zero(&self) -> candle_core::Result<()> {
        self.conv.slice_set(&self.conv.zeros_like()?, 0, 0)?;
        self.ssm.slice_set(&self.ssm.zeros_like()?, 0, 0)
    }

    fn bytes(&self) -> usize {
        4 * (self.conv.elem_count() + self.ssm.elem_count())
    }
}

/// Layer `layer`'s state table over `states` (one sequence each, in order; a batched pass's
/// rows), uploaded to `device` in one copy, for `strata_kernels::cuda::gdn_conv_seqs` /
/// `gdn_delta_seqs`. `None` when a sequence has no state for that layer. Errors: a state lost, the
/// same state twice, the copy.
///
/// # Safety
/// Every state must stay alive until the launches over the returned table complete (they are
/// queued on the device's stream: dropping a state after them is stream-ordered).
pub unsafe fn state_table(
    states: &[&DeviceRecurrent],
    layer: usize,
    device: &Device,
) -> candle_core::Result<Option<GdnStates>> {
    let Some(first) = states.first() else { return Ok(None) };
    let mut words = Vec::with_capacity(5 * states.len());
    for d in states {
        let Some(row) = d.table_row(layer, 0)? else { return Ok(None) };
        if words.chunks_exact(5).any(|w: &[u32]| w[1..] == row[1..]) {
            candle_core::bail!("a state table holds one sequence's state twice");
        }
        words.extend(row);
    }
    let table = Tensor::from_vec(words, (states.len(), 5), device)?;
    // SAFETY: every row holds `table_row` of a distinct live state of this model's shape
    // (each `DeviceRecurrent` allocates its states with `first.shape`'s dimensions: one model),
    // kept alive through the launches by the caller's contract.
    unsafe { GdnStates::in_buffer(table, first.shape) }.map(Some)
}

/// One logged pass of one layer: what the replay needs.
#[derive(Debug)]
struct LoggedPass {
    /// `[T, rw]`: the conv inputs and the gates' `b`, `a`.
    row: Tensor,
    /// `[T, conv_dim]`: the conv's output (q, k, v before normalisation).
    qkv: Tensor,
    /// The layer's `−exp(A_log)` and `dt_bias` (`[v_heads]`, shared with the layer).
    a_neg: Tensor,
    dt_bias: Tensor,
}

/// One layer's passes since the checkpoint.
#[derive(Debug, Default)]
pub struct DeviceLog {
    passes: Vec<LoggedPass>,
}

impl DeviceLog {
    /// Logs a pass: `row: [T, rw]`, `qkv: [T, conv_dim]`, the layer's `a_neg`, `dt_bias`.
    pub fn push(&mut self, row: &Tensor, qkv: &Tensor, a_neg: &Tensor, dt_bias: &Tensor) {
        self.passes.push(LoggedPass {
            row: row.clone(),
            qkv: qkv.clone(),
            a_neg: a_neg.clone(),
            dt_bias: dt_bias.clone(),
        });
    }

    fn clear(&mut self) {
        self.passes.clear();
    }

    fn bytes(&self) -> usize {
        self.passes.iter().map(|p| 4 * (p.row.elem_count() + p.qkv.elem_count())).sum()
    }

    /// Applies the first `n` logged tokens to `state` (no readout) and keeps only them.
    fn replay(
        &mut self,
        s: &GdnShape,
        state: &DeviceLinearState,
        n: usize,
    ) -> candle_core::Result<()> {
        let mut left = n;
        let mut kept = 0;
        for p in &mut self.passes {
            if left == 0 {
                break;
            }
            let t = p.row.dim(0)?;
            if t > left {
                p.row = p.row.narrow(0, 0, left)?;
                p.qkv = p.qkv.narrow(0, 0, left)?;
            }
            let t = t.min(left);
            gdn_conv(s, &p.row, &state.conv, None)?;
            gdn_delta(s, &p.qkv, &p.row, &p.a_neg, &p.dt_bias, &state.ssm, 1.0, false)?;
            left -= t;
            kept += 1;
        }
        self.passes.truncate(kept);
        Ok(())
    }
}

type DeviceCheckpoint = super::Checkpoint<DeviceLinearState, DeviceLog>;

/// A copy of every layer's device state (a prefix cache's snapshot).
#[derive(Debug)]
pub struct DeviceSnapshot(Vec<Option<DeviceLinearState>>);

impl DeviceSnapshot {
    pub fn bytes(&self) -> usize {
        self.0.iter().flatten().map(DeviceLinearState::bytes).sum()
    }
}

/// Every Gated DeltaNet layer's state of one sequence on the device (`None` for attention layers).
#[derive(Debug)]
pub struct DeviceRecurrent {
    shape: GdnShape,
    states: Vec<Option<DeviceLinearState>>,
    /// Each state's address words (`GdnState::address_words`), taken once: the buffers never
    /// move.
    words: Vec<Option<[u32; 4]>>,
    checkpoint: Option<DeviceCheckpoint>,
    /// Why the state is no longer valid (a device operation failed).
    lost: Option<String>,
}

impl DeviceRecurrent {
    /// Zero state on `device` for the layers where `recurrent[i]`.
    pub fn new(shape: GdnShape, recurrent: &[bool], device: &Device) -> candle_core::Result<Self> {
        let states = recurrent
            .iter()
            .map(|&r| r.then(|| DeviceLinearState::zeros(&shape, device)).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let words = states
            .iter()
            .map(|s| {
                s.as_ref()
                    .map(|s| GdnState { conv: &s.conv, ssm: &s.ssm }.address_words(&shape))
                    .transpose()
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { shape, states, words, checkpoint: None, lost: None })
    }

    /// Layer `layer`'s state as a row of a batched step's state table
    /// (`strata_kernels::cuda::GdnStates`): the position word `pos`, then its conv window's and
    /// delta-rule state's address words, kept from the start (the buffers are only written in
    /// place). `None` for a layer without state. Errors when an earlier device operation lost
    /// the state.
    pub fn table_row(&self, layer: usize, pos: u32) -> candle_core::Result<Option<[u32; 5]>> {
        if let Some(why) = &self.lost {
            candle_core::bail!("the recurrent state on the device was lost: {why}");
        }
        Ok(self.words.get(layer).copied().flatten().map(|[a, b, c, d]| [pos, a, b, c, d]))
    }

    /// Whether the state is valid (no device operation lost it) and no checkpoint logs passes:
    /// a batched decode step over a state table may advance it.
    pub fn steppable(&self) -> bool {
        self.lost.is_none() && self.checkpoint_len().is_none()
    }

    pub fn shape(&self) -> &GdnShape {
        &self.shape
    }

    /// Layer `layer`'s state and, while a checkpoint is held, its log; `None` for a layer without
    /// state. Errors when an earlier device operation lost the state.
    pub fn layer_mut(
        &mut self,
        layer: usize,
    ) -> candle_core::Result<Option<(&DeviceLinearState, Option<&mut DeviceLog>)>> {
        if let Some(why) = &self.lost {
            candle_core::bail!("the recurrent state on the device was lost: {why}");
        }
        let Some(state) = self.states.get(layer).and_then(Option::as_ref) else { return Ok(None) };
        let log = self.checkpoint.as_mut().and_then(|c| c.log_mut(layer));
        Ok(Some((state, log)))
    }

    fn lose(&mut self, e: candle_core::Error) {
        self.lost.get_or_insert_with(|| e.to_string());
    }

    fn copies(&self) -> candle_core::Result<Vec<Option<DeviceLinearState>>> {
        self.states
            .iter()
            .map(|s| s.as_ref().map(DeviceLinearState::duplicate).transpose())
            .collect()
    }

    /// Copies every state at sequence length `len` and starts logging passes.
    pub fn checkpoint(&mut self, len: usize) {
        match self.copies() {
            Ok(saved) => {
                let logs = self.states.iter().map(|s| s.as_ref().map(|_| DeviceLog::default()));
                self.checkpoint = Some(DeviceCheckpoint {
                    len,
                    states: saved,
                    logs: logs.collect(),
                    active: true,
                });
            }
            Err(e) => {
                self.checkpoint = None;
                self.lose(e);
            }
        }
    }

    /// Stops logging; rollback is refused until the next checkpoint.
    pub fn release(&mut self) {
        if let Some(c) = self.checkpoint.as_mut() {
            c.active = false;
            c.logs.iter_mut().flatten().for_each(DeviceLog::clear);
        }
    }

    pub fn checkpoint_len(&self) -> Option<usize> {
        self.checkpoint.as_ref().filter(|c| c.active).map(|c| c.len)
    }

    /// Restores the state of sequence length `len` (from `current`): the checkpoint's copy, then
    /// its logged tokens up to `len` replayed. `Err(checkpoint)` when `len` is before the
    /// checkpoint (or there is none); a device failure marks the state lost (the next pass errors).
    pub fn rollback(&mut self, len: usize, current: usize) -> Result<(), Option<usize>> {
        if len >= current {
            return Ok(());
        }
        let Some(c) = self.checkpoint.as_mut().filter(|c| c.active) else { return Err(None) };
        if len < c.len {
            return Err(Some(c.len));
        }
        let n = len - c.len;
        let shape = self.shape;
        let mut run = || -> candle_core::Result<()> {
            for ((state, saved), log) in self.states.iter().zip(&c.states).zip(&mut c.logs) {
                if let (Some(s), Some(saved), Some(log)) =
                    (state.as_ref(), saved.as_ref(), log.as_mut())
                {
                    s.set_from(saved)?;
                    log.replay(&shape, s, n)?;
                }
            }
            Ok(())
        };
        if let Err(e) = run() {
            self.lose(e);
        }
        Ok(())
    }

    /// A copy of every layer's state; `None` when a copy fails.
    pub fn snapshot(&self) -> Option<DeviceSnapshot> {
        self.copies().ok().map(DeviceSnapshot)
    }

    /// Sets every state to `snap`'s (in place) and drops the checkpoint.
    pub fn restore(&mut self, snap: &DeviceSnapshot) {
        self.checkpoint = None;
        if snap.0.len() != self.states.len() {
            return self.lose(candle_core::Error::msg("a snapshot of another model"));
        }
        let copied: candle_core::Result<()> =
            self.states.iter().zip(&snap.0).try_for_each(|(dst, src)| match (dst, src) {
                (Some(d), Some(s)) => d.set_from(s),
                _ => Ok(()),
            });
        match copied {
            Ok(()) => self.lost = None,
            Err(e) => self.lose(e),
        }
    }

    /// Zeroes every state (in place) and drops the checkpoint (a new sequence).
    pub fn clear(&mut self) {
        self.checkpoint = None;
        match self.states.iter().flatten().try_for_each(DeviceLinearState::zero) {
            Ok(()) => self.lost = None,
            Err(e) => self.lose(e),
        }
    }

    /// Bytes held on the device: states, the checkpoint copy and the logged passes.
    pub fn bytes(&self) -> usize {
        let live: usize = self.states.iter().flatten().map(DeviceLinearState::bytes).sum();
        live + self.checkpoint.as_ref().map_or(0, |c| {
            c.states.iter().flatten().map(DeviceLinearState::bytes).sum::<usize>()
                + c.logs.iter().flatten().map(DeviceLog::bytes).sum::<usize>()
        })
    }
}
