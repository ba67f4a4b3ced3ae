//! Recurrent state of Gated DeltaNet layers (hybrid models) and its checkpoint / restore for
//! speculative decoding.
//!
//! Unlike a KV cache, a recurrent state cannot be truncated: after a verify pass it holds the
//! rejected draft tokens too. [`RecurrentCache::checkpoint`] copies every layer's state once and
//! from then on logs, per token, the few vectors the state update consumed (k, v, decay, beta and
//! the conv input row: `(conv_dim + k_dim·k_heads + v_dim·v_heads + 2·v_heads)` floats per token and
//! layer). [`RecurrentCache::rollback`] to any position after the checkpoint restores the copy and
//! replays the logged updates (the delta rule without its readout). Storing a full state per
//! verified position instead would cost `state_bytes` per token (4 MiB per layer for
//! Qwen3.5-122B); the replay costs `4·k_dim·v_dim` FLOPs per value head and token.

use strata_formats::{HeadOrder, LinearAttnConfig};

#[cfg(feature = "cuda")]
pub mod device;

/// Dimensions of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub kernel: usize,
    pub order: HeadOrder,
}

impl GdnDims {
    pub fn new(c: &LinearAttnConfig) -> Self {
        Self {
            k_heads: c.num_k_heads,
            v_heads: c.num_v_heads,
            k_dim: c.head_k_dim,
            v_dim: c.head_v_dim,
            kernel: c.conv_kernel,
            order: c.head_order,
        }
    }

    /// q (or k) channels: `k_heads · k_dim`.
    pub fn key_width(&self) -> usize {
        self.k_heads * self.k_dim
    }

    /// v channels: `v_heads · v_dim`.
    pub fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// conv1d channels: q, k, v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// The kernels' view of these dimensions (`cuda` build).
    #[cfg(feature = "cuda")]
    pub fn gpu_shape(&self) -> strata_kernels::cuda::GdnShape {
        strata_kernels::cuda::GdnShape {
            k_heads: self.k_heads,
            v_heads: self.v_heads,
            k_dim: self.k_dim,
            v_dim: self.v_dim,
            kernel: self.kernel,
            grouped: matches!(self.order, HeadOrder::Grouped),
        }
    }

    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.order {
            HeadOrder::Grouped => h / (self.v_heads / self.k_heads),
            HeadOrder::Tiled => h % self.k_heads,
        }
    }
}

/// One layer's state: the conv window and the delta-rule state.
#[derive(Debug, Clone)]
pub struct LinearState {
    /// The last `kernel − 1` conv input rows, oldest first: `[kernel − 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// `S` per value head: `[v_heads, k_dim, v_dim]`.
    pub ssm: Vec<f32>,
}

impl LinearState {
    fn zeros(d: &GdnDims) -> Self {
        Self {
            conv: vec![0.0; (d.kernel - 1) * d.conv_dim()],
            ssm: vec![0.0; d.v_heads * d.k_dim * d.v_dim],
        }
    }

    /// Shifts the conv window by one input row `raw: [conv_dim]`.
    pub fn push_conv_row(&mut self, raw: &[f32]) {
        let c = raw.len();
        if self.conv.is_empty() {
            return;
        }
        self.conv.copy_within(c.., 0);
        let n = self.conv.len();
        self.conv[n - c..].copy_from_slice(raw);
    }
}

/// The gated delta rule's state update for one value head (Yang et al. 2024, eq. 10; transformers
/// `torch_recurrent_gated_delta_rule`): `S ← decay·S; S ← S + k ⊗ β(v − Sᵀk)`.
/// `s: [k_dim, v_dim]`, `k: [k_dim]` (L2-normalised), `v: [v_dim]`; `mem: [v_dim]` scratch.
pub fn delta_update(s: &mut [f32], k: &[f32], v: &[f32], decay: f32, beta: f32, mem: &mut [f32]) {
    let dv = v.len();
    mem.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (m, x) in mem.iter_mut().zip(row.iter_mut()) {
            *x *= decay;
            *m += *x * ki;
        }
    }
    for (m, &vj) in mem.iter_mut().zip(v) {
        *m = (vj - *m) * beta;
    }
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, &d) in row.iter_mut().zip(mem.iter()) {
            *x += ki * d;
        }
    }
}

/// `out = Sᵀq`: `s: [k_dim, v_dim]`, `q: [k_dim]`, `out: [v_dim]`.
pub fn delta_readout(s: &[f32], q: &[f32], out: &mut [f32]) {
    let dv = out.len();
    out.fill(0.0);
    for (row, &qi) in s.chunks_exact(dv).zip(q) {
        for (o, &x) in out.iter_mut().zip(row) {
            *o += x * qi;
        }
    }
}

/// What one token's update consumed, per layer, since the checkpoint.
#[derive(Debug, Clone, Default)]
pub struct StepLog {
    raw: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    decay: Vec<f32>,
    beta: Vec<f32>,
    tokens: usize,
}

impl StepLog {
    pub fn push(&mut self, raw: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: &[f32]) {
        self.raw.extend_from_slice(raw);
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.decay.extend_from_slice(decay);
        self.beta.extend_from_slice(beta);
        self.tokens += 1;
    }

    fn clear(&mut self) {
        self.raw.clear();
        self.k.clear();
        self.v.clear();
        self.decay.clear();
        self.beta.clear();
        self.tokens = 0;
    }

    fn truncate(&mut self, d: &GdnDims, n: usize) {
        self.raw.truncate(n * d.conv_dim());
        self.k.truncate(n * d.key_width());
        self.v.truncate(n * d.value_width());
        self.decay.truncate(n * d.v_heads);
        self.beta.truncate(n * d.v_heads);
        self.tokens = n;
    }

    /// Applies the first `n` logged tokens to `state`.
    fn replay(&self, d: &GdnDims, state: &mut LinearState, n: usize) {
        let (kw, vw, cd) = (d.key_width(), d.value_width(), d.conv_dim());
        let mut mem = vec![0f32; d.v_dim];
        let head = d.k_dim * d.v_dim;
        for t in 0..n {
            state.push_conv_row(&self.raw[t * cd..(t + 1) * cd]);
            let k = &self.k[t * kw..(t + 1) * kw];
            let v = &self.v[t * vw..(t + 1) * vw];
            for h in 0..d.v_heads {
                let kh = d.key_head(h);
                delta_update(
                    &mut state.ssm[h * head..(h + 1) * head],
                    &k[kh * d.k_dim..(kh + 1) * d.k_dim],
                    &v[h * d.v_dim..(h + 1) * d.v_dim],
                    self.decay[t * d.v_heads + h],
                    self.beta[t * d.v_heads + h],
                    &mut mem,
                );
            }
        }
    }
}

/// A checkpoint of layer states `S` (host [`LinearState`] or, on a GPU, the device's) with a log
/// `L` of the updates since, per layer (`None` for attention layers).
#[derive(Debug)]
struct Checkpoint<S = LinearState, L = StepLog> {
    /// Sequence length at the checkpoint.
    len: usize,
    states: Vec<Option<S>>,
    logs: Vec<Option<L>>,
    /// False once released: the buffers stay for the next checkpoint, nothing is logged.
    active: bool,
}

impl<S, L> Checkpoint<S, L> {
    /// Layer `layer`'s log while the checkpoint is active.
    fn log_mut(&mut self, layer: usize) -> Option<&mut L> {
        self.logs.get_mut(layer).filter(|_| self.active)?.as_mut()
    }
}

/// A copy of a sequence's recurrent state ([`RecurrentCache::snapshot`]).
#[derive(Debug)]
pub struct RecurrentSnapshot(Snap);

#[derive(Debug)]
enum Snap {
    Host(Vec<Option<LinearState>>),
    #[cfg(feature = "cuda")]
    Device(device::DeviceSnapshot),
}

impl RecurrentSnapshot {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.0 {
            Snap::Host(s) => s.iter().flatten().map(|s| 4 * (s.conv.len() + s.ssm.len())).sum(),
            #[cfg(feature = "cuda")]
            Snap::Device(d) => d.bytes(),
        }
    }
}

/// The recurrent state of every Gated DeltaNet layer of one sequence (`None` for attention layers).
#[derive(Debug)]
pub struct RecurrentCache {
    dims: Option<GdnDims>,
    states: Vec<Option<LinearState>>,
    checkpoint: Option<Checkpoint>,
    /// The state on the GPU instead (`states` is then empty): a CUDA model whose Gated DeltaNet
    /// layers run on our kernels ([`Self::on_device`]).
    #[cfg(feature = "cuda")]
    device: Option<device::DeviceRecurrent>,
}

impl RecurrentCache {
    /// [`Self::new`], the state on `device` when it is a CUDA device, the kernels take the
    /// layers' shape and `STRATA_GPU_DELTANET` is not `0` (then the Gated DeltaNet layers run on
    /// the GPU; otherwise on the host, their projections copied there every pass).
    pub fn on_device(
        cfg: Option<&LinearAttnConfig>,
        device: &candle_core::Device,
    ) -> candle_core::Result<Self> {
        #[cfg(feature = "cuda")]
        if let Some(c) = cfg.filter(|_| device.is_cuda()) {
            let shape = GdnDims::new(c).gpu_shape();
            if shape.supported() && crate::gpu::enabled(crate::gpu::GpuPath::DeltaNet) {
                let d = device::DeviceRecurrent::new(shape, &c.recurrent_layers, device)?;
                return Ok(Self {
                    dims: None,
                    states: Vec::new(),
                    checkpoint: None,
                    device: Some(d),
                });
            }
        }
        let _ = device;
        Ok(Self::new(cfg))
    }

    /// The device state (`cuda` build), when it lives there.
    #[cfg(feature = "cuda")]
    pub fn device(&self) -> Option<&device::DeviceRecurrent> {
        self.device.as_ref()
    }

    /// The device state (`cuda` build), when it lives there.
    #[cfg(feature = "cuda")]
    pub fn device_mut(&mut self) -> Option<&mut device::DeviceRecurrent> {
        self.device.as_mut()
    }

    /// Zero state for the layers where `recurrent[i]`; empty when `cfg` is `None`.
    pub fn new(cfg: Option<&LinearAttnConfig>) -> Self {
        let dims = cfg.map(GdnDims::new);
        let states = match (cfg, &dims) {
            (Some(c), Some(d)) => {
                c.recurrent_layers.iter().map(|&r| r.then(|| LinearState::zeros(d))).collect()
            }
            _ => Vec::new(),
        };
        Self {
            dims,
            states,
            checkpoint: None,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// Whether the model has recurrent layers.
    pub fn is_active(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return true;
        }
        self.states.iter().any(Option::is_some)
    }

    /// Layer `layer`'s state and, while a checkpoint is held, its log.
    pub fn layer_mut(&mut self, layer: usize) -> Option<(&mut LinearState, Option<&mut StepLog>)> {
        let state = self.states.get_mut(layer)?.as_mut()?;
        let log = self.checkpoint.as_mut().and_then(|c| c.log_mut(layer));
        Some((state, log))
    }

    /// Copies every state at sequence length `len` and starts logging updates.
    pub fn checkpoint(&mut self, len: usize) {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_mut() {
            return d.checkpoint(len);
        }
        if !self.is_active() {
            return;
        }
        let (states, logs) = match self.checkpoint.take() {
            // Reuse the previous copy's and logs' buffers.
            Some(mut c) => {
                for (dst, src) in c.states.iter_mut().zip(&self.states) {
                    if let (Some(d), Some(s)) = (dst.as_mut(), src.as_ref()) {
                        d.conv.copy_from_slice(&s.conv);
                        d.ssm.copy_from_slice(&s.ssm);
                    }
                }
                for log in c.logs.iter_mut().flatten() {
                    log.clear();
                }
                (c.states, c.logs)
            }
            None => (
                self.states.clone(),
                self.states.iter().map(|s| s.as_ref().map(|_| StepLog::default())).collect(),
            ),
        };
        self.checkpoint = Some(Checkpoint { len, states, logs, active: true });
    }

    /// Stops logging (the end of a speculative round): later tokens cost nothing and rollback is
    /// refused until the next [`Self::checkpoint`].
    pub fn release(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_mut() {
            return d.release();
        }
        if let Some(c) = self.checkpoint.as_mut() {
            c.active = false;
            for log in c.logs.iter_mut().flatten() {
                log.clear();
            }
        }
    }

    /// Sequence length of the checkpoint held, if any.
    pub fn checkpoint_len(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_ref() {
            return d.checkpoint_len();
        }
        self.checkpoint.as_ref().filter(|c| c.active).map(|c| c.len)
    }

    /// Restores the state of sequence length `len` (from `current`). `Err(checkpoint)` when `len`
    /// is before the checkpoint (or there is none and `len < current`): the state is then unchanged.
    pub fn rollback(&mut self, len: usize, current: usize) -> Result<(), Option<usize>> {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_mut() {
            return d.rollback(len, current);
        }
        if !self.is_active() || len >= current {
            return Ok(());
        }
        let Some(c) = self.checkpoint.as_mut().filter(|c| c.active) else { return Err(None) };
        if len < c.len {
            return Err(Some(c.len));
        }
        let d = self.dims.expect("active recurrent cache has dims");
        let n = len - c.len;
        for ((state, saved), log) in self.states.iter_mut().zip(&c.states).zip(c.logs.iter_mut()) {
            if let (Some(s), Some(saved), Some(log)) =
                (state.as_mut(), saved.as_ref(), log.as_mut())
            {
                s.conv.copy_from_slice(&saved.conv);
                s.ssm.copy_from_slice(&saved.ssm);
                log.replay(&d, s, n);
                log.truncate(&d, n);
            }
        }
        Ok(())
    }

    /// A copy of every layer's state (`None` without recurrent layers): a prefix cache keeps it
    /// with the prefix's last block.
    pub fn snapshot(&self) -> Option<RecurrentSnapshot> {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_ref() {
            return d.snapshot().map(|s| RecurrentSnapshot(Snap::Device(s)));
        }
        self.is_active().then(|| RecurrentSnapshot(Snap::Host(self.states.clone())))
    }

    /// Sets every state to `snap`'s (made by [`Self::snapshot`] on the same model) and drops the
    /// checkpoint.
    pub fn restore(&mut self, snap: &RecurrentSnapshot) {
        #[cfg(feature = "cuda")]
        if let Snap::Device(s) = &snap.0 {
            if let Some(d) = self.device.as_mut() {
                d.restore(s);
            }
            return;
        }
        #[allow(irrefutable_let_patterns)]
        let Snap::Host(host) = &snap.0
        else {
            return;
        };
        for (dst, src) in self.states.iter_mut().zip(host) {
            if let (Some(d), Some(s)) = (dst.as_mut(), src.as_ref()) {
                d.conv.copy_from_slice(&s.conv);
                d.ssm.copy_from_slice(&s.ssm);
            }
        }
        self.checkpoint = None;
    }

    /// Zeroes every state and drops the checkpoint (a new sequence).
    pub fn clear(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_mut() {
            return d.clear();
        }
        for s in self.states.iter_mut().flatten() {
            s.conv.fill(0.0);
            s.ssm.fill(0.0);
        }
        self.checkpoint = None;
    }

    /// Bytes held: states, the checkpoint copy and its logs.
    pub fn bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device.as_ref() {
            return d.bytes();
        }
        let state = |s: &LinearState| 4 * (s.conv.len() + s.ssm.len());
        let live: usize = self.states.iter().flatten().map(state).sum();
        let saved: usize = self.checkpoint.as_ref().map_or(0, |c| {
            c.states.iter().flatten().map(state).sum::<usize>()
                + c.logs
                    .iter()
                    .flatten()
                    .map(|l| {
                        4 * (l.raw.len() + l.k.len() + l.v.len() + l.decay.len() + l.beta.len())
                    })
                    .sum::<usize>()
        });
        live + saved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delta rule against its definition written with explicit sums.
    #[test]
    fn delta_update_matches_definition() {
        let (dk, dv) = (3, 2);
        let mut s: Vec<f32> = (0..dk * dv).map(|i| 0.1 * i as f32 - 0.2).collect();
        let k = [0.6f32, -0.8, 0.0];
        let v = [1.0f32, -0.5];
        let (decay, beta) = (0.9f32, 0.7f32);
        let mut want = s.clone();
        for x in want.iter_mut() {
            *x *= decay;
        }
        for j in 0..dv {
            let mem: f32 = (0..dk).map(|i| want[i * dv + j] * k[i]).sum();
            let delta = (v[j] - mem) * beta;
            for i in 0..dk {
                want[i * dv + j] += k[i] * delta;
            }
        }
        let mut mem = vec![0f32; dv];
        delta_update(&mut s, &k, &v, decay, beta, &mut mem);
        for (a, b) in s.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{s:?} vs {want:?}");
        }
        let mut out = vec![0f32; dv];
        delta_readout(&s, &k, &mut out);
        let want0: f32 = (0..dk).map(|i| want[i * dv] * k[i]).sum();
        assert!((out[0] - want0).abs() < 1e-6);
    }

    #[test]
    fn rollback_replays_logged_updates() {
        let cfg = LinearAttnConfig {
            num_k_heads: 1,
            num_v_heads: 2,
            head_k_dim: 2,
            head_v_dim: 2,
            conv_kernel: 3,
            recurrent_layers: vec![true],
            head_order: HeadOrder::Grouped,
        };
        let d = GdnDims::new(&cfg);
        let mut c = RecurrentCache::new(Some(&cfg));
        let step = |c: &mut RecurrentCache, t: usize| {
            let raw: Vec<f32> = (0..d.conv_dim()).map(|i| (t * 7 + i) as f32 * 0.01).collect();
            let k = [0.6f32, 0.8];
            let v = [t as f32, 1.0, -1.0, 0.5];
            let (decay, beta) = ([0.9f32, 0.8], [0.5f32, 0.25]);
            let (s, log) = c.layer_mut(0).unwrap();
            s.push_conv_row(&raw);
            let mut mem = [0f32; 2];
            for h in 0..2 {
                delta_update(
                    &mut s.ssm[h * 4..(h + 1) * 4],
                    &k,
                    &v[h * 2..h * 2 + 2],
                    decay[h],
                    beta[h],
                    &mut mem,
                );
            }
            if let Some(l) = log {
                l.push(&raw, &k, &v, &decay, &beta);
            }
        };
        step(&mut c, 0);
        c.checkpoint(1);
        let mut snapshots = vec![c.states[0].clone().unwrap()];
        for t in 1..5 {
            step(&mut c, t);
            snapshots.push(c.states[0].clone().unwrap());
        }
        assert_eq!(c.rollback(3, 5), Ok(()));
        let s = c.states[0].as_ref().unwrap();
        assert_eq!((&s.conv, &s.ssm), (&snapshots[2].conv, &snapshots[2].ssm));
        assert_eq!(c.rollback(0, 3), Err(Some(1)), "before the checkpoint");
        // Rolling back again after new tokens still reaches every position since the checkpoint.
        step(&mut c, 3);
        assert_eq!(c.rollback(2, 4), Ok(()));
        let s = c.states[0].as_ref().unwrap();
        assert_eq!((&s.conv, &s.ssm), (&snapshots[1].conv, &snapshots[1].ssm));
        // Released: nothing is logged any more and rollback is refused.
        c.release();
        step(&mut c, 2);
        assert!(c.layer_mut(0).unwrap().1.is_none());
        assert_eq!(c.rollback(2, 3), Err(None));
        assert_eq!(c.checkpoint_len(), None);
    }
}
