//! Short passes as CUDA graphs (`cuda` build): a pass of one to [`GRAPH_ROWS_MAX`] tokens of one
//! sequence (a decode step, a speculative verify pass) of a model whose every layer runs on the
//! device without the host — attention on our kernels reading the position from device memory,
//! MoE layers routed on the device into resident fused experts, dense MLPs — is captured once per
//! (tokens, logits wanted, context bucket) and replayed, so a pass costs one graph launch instead
//! of ~11 launches per layer and their CPU-side cost (what bounds candle's decode on a fast GPU).
//!
//! Per sequence ([`KvCache`]), buckets serve positions up to 256·2ʲ − 1 (the attention kernel's
//! split count is fixed at capture; chunks past a row's length add nothing). A one-token pass's
//! first step in a bucket runs eagerly (its result is that step's output) and is then captured; a
//! pass of several tokens is captured the second time its shape comes (a one-off prompt chunk
//! never is). Later passes write the tokens and the position into device memory and replay. Graph
//! memory is instantiated with auto-free-on-launch, so the outputs (logits, routing record) live
//! until the next replay: the logits are copied out, the routing read back, after each launch.
//! A graph's launches are the op-by-op pass's (`forward_batch` for one sequence), so its logits
//! are the same bits.
//!
//! A synthetic model's routing process runs on the host before each pass and its choice is
//! written beside the tokens (`device_routing::synthetic_choices`).
//!
//! A hybrid's Gated DeltaNet layers are captured too when the sequence keeps its recurrent state on
//! the device (whose buffers are only written in place): the eager pass before a capture is undone
//! for that state (a snapshot put back), since the graph's first launch repeats the pass.
//!
//! Not taken (the op-by-op path runs instead): several sequences, more tokens, hidden-state taps,
//! a partial layer count, a prefetcher, a hybrid's recurrent state on the host or under a
//! speculative checkpoint (its passes are logged), a layer our kernels lack, cudarc event tracking
//! on, or `STRATA_GPU_GRAPHS=0`. A capture that fails turns the path off for that sequence (logged
//! once).

use std::collections::{HashMap, HashSet};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Tensor};

use super::device_routing::{choose_ahead, synthetic_choices, DeviceRouting};
use super::{residual_scaled, FeedForward, ForwardOutput, Logits, Mixer, Transformer};
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;

/// Most tokens in a pass taken by the graph path: speculative verify passes (the attention
/// kernels' [`crate::attention::GPU_ATTEND_ROWS_MAX`]).
pub const GRAPH_ROWS_MAX: usize = crate::attention::GPU_ATTEND_ROWS_MAX;

/// What a captured pass serves: its tokens, whether only the last one's logits are wanted, and
/// the largest position its last token may take (the bucket).
type Key = (usize, bool, usize);

/// A sequence's captured passes.
#[derive(Debug)]
pub struct DecodeGraphs {
    /// u32 `[GRAPH_ROWS_MAX]`: the pass's tokens (the first `rows`), read by the embedding lookup.
    tokens: Tensor,
    /// u32 `[1]`: the pass's first position, read by the attention kernels.
    pos: Tensor,
    /// A synthetic model's choice of experts (`device_routing::synthetic_choices`), u32
    /// `[moe_layers · GRAPH_ROWS_MAX · model_top_k]`: the pass's first `moe_layers · rows ·
    /// model_top_k` written before each pass, read by the routing kernels.
    chosen: Option<Tensor>,
    graphs: HashMap<Key, Captured>,
    /// Shapes of several tokens run once op by op: captured when they come again.
    seen: HashSet<Key>,
    /// A capture failed: this sequence runs op by op.
    failed: bool,
    /// Replays timed under `STRATA_GPU_GRAPH_STATS=1`.
    timed: ReplayStats,
}

/// Replays timed under `STRATA_GPU_GRAPH_STATS=1`: their count and summed GPU and host ms, and
/// (batched steps) the host's ms before the launch: all of it, and the synthetic routing
/// choice's part.
#[derive(Debug, Default)]
pub(super) struct ReplayStats {
    n: usize,
    gpu_ms: f64,
    host_ms: f64,
    /// From the launch to the wait for the graph's end (the host's work while it runs), and
    /// from that wait's end to the outputs read.
    during_ms: f64,
    after_ms: f64,
    prep_ms: f64,
    choice_ms: f64,
    /// The row tables: entries, their copy to the device, the per-layer views.
    tables_ms: [f64; 3],
}

impl ReplayStats {
    /// The host's time before a batched step's launch: `prep_ms` in all, of it `choice_ms` the
    /// synthetic routing choice and `tables_ms` the row tables (added to the next replay's).
    pub(super) fn add_prep(&mut self, prep_ms: f64, choice_ms: f64, tables_ms: [f64; 3]) {
        self.prep_ms += prep_ms;
        self.choice_ms += choice_ms;
        for (a, b) in self.tables_ms.iter_mut().zip(tables_ms) {
            *a += b;
        }
    }

    /// Adds one replay (`split`: the host's ms while the graph ran and after its end, when the
    /// read waited for it); every 64 replays prints the means on stderr.
    pub(super) fn add(&mut self, gpu_ms: f64, host_ms: f64, split: Option<[f64; 2]>) {
        self.n += 1;
        self.gpu_ms += gpu_ms;
        self.host_ms += host_ms;
        if let Some([during, after]) = split {
            self.during_ms += during;
            self.after_ms += after;
        }
        if self.n.is_multiple_of(64) {
            let n = self.n as f64;
            // The split before the launch is recorded for batched steps only.
            let prep = if self.prep_ms > 0.0 {
                format!(
                    ", before the launch {:.3} ms (routing choice {:.3} ms, row tables {:.3} + \
                     {:.3} + {:.3} ms: entries, copy, views)",
                    self.prep_ms / n,
                    self.choice_ms / n,
                    self.tables_ms[0] / n,
                    self.tables_ms[1] / n,
                    self.tables_ms[2] / n
                )
            } else {
                String::new()
            };
            eprintln!(
                "strata: graph replays: {}, GPU {:.3} ms per pass, host {:.3} ms per pass \
                 (positions written to outputs read: {:.3} ms until the wait for the graph's \
                 end, {:.3} ms after it){prep}",
                self.n,
                self.gpu_ms / n,
                self.host_ms / n,
                self.during_ms / n,
                self.after_ms / n
            );
        }
    }
}

/// One captured step and the graph-owned outputs it rewrites at every replay.
pub(super) struct Captured {
    pub(super) graph: SendGraph,
    pub(super) logits: Tensor,
    /// Every row's greedy pick `[rows]` (u32), made inside the graph (batched steps with
    /// [`crate::gpu::GpuPath::Argmax`] on).
    pub(super) picks: Option<Tensor>,
    pub(super) routing: Option<DeviceRouting>,
}

/// Where a captured pass's attention layers find their positions and KV caches.
pub(super) enum PassKv<'a> {
    /// One sequence whose position lives on the device ([`KvCache::set_device_position`]).
    One(&'a mut KvCache),
    /// A batch of sequences (`super::batch_graph`): each layer's table on the device
    /// (`tables[layer]`), and one of the batch's caches, whose layer caches have the shape of
    /// every cache in the tables.
    Rows { tables: &'a [LayerRows], like: &'a KvCache },
}

/// One layer's table of a batched step (`super::batch_graph`): per row (one token of each
/// sequence) where that layer's state of the sequence lives.
pub(super) enum LayerRows {
    /// An attention layer: each row's position and KV cache.
    Kv(strata_kernels::cuda::Rows),
    /// A Gated DeltaNet layer: each row's conv window and delta-rule state.
    States(strata_kernels::cuda::GdnStates),
}

impl std::fmt::Debug for Captured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Captured")
    }
}

/// A CUDA graph that may move between threads with its sequence.
pub(super) struct SendGraph(pub(super) CudaGraph);
// SAFETY: the graph is launched only through `&mut KvCache` (one thread at a time), and cudarc
// binds the context to the launching thread.
unsafe impl Send for SendGraph {}
unsafe impl Sync for SendGraph {}

/// Positions `0..=max` one graph serves, for a step at `pos` in a cache of `capacity` tokens.
pub(super) fn bucket(pos: usize, capacity: usize) -> usize {
    let mut max = strata_kernels::cuda::ATTN_CHUNK;
    while max <= pos {
        max *= 2;
    }
    (max - 1).min(capacity.saturating_sub(1))
}

impl Transformer {
    /// Whether this model's one-token passes can be captured: every layer an attention layer our
    /// kernels take, every MoE layer resident fused experts routed on the device.
    pub(super) fn graph_decodable(&self) -> bool {
        let Device::Cuda(dev) = &self.device else { return false };
        if !crate::gpu::enabled(crate::gpu::GpuPath::Graphs)
            || !crate::gpu::enabled(crate::gpu::GpuPath::Routing)
            || !crate::gpu::enabled(crate::gpu::GpuPath::Attention)
            || dev.is_event_tracking()
            || self.prefetcher.is_some()
        {
            return false;
        }
        self.layers.iter().enumerate().all(|(i, l)| {
            let mixer = match &l.mixer {
                Mixer::Attention(a) => a.gpu_decodable(),
                Mixer::GatedDeltaNet(g) => g.gpu_ready(),
            };
            let ffn = match &l.ffn {
                FeedForward::Dense(_) => true,
                FeedForward::Moe(_) => {
                    self.experts.routes_on_device()
                        && matches!(self.experts.fused(i, &[]), Some(Ok(c)) if c.rows.is_none())
                }
            };
            mixer && ffn
        })
    }

    /// A pass of `tokens` (one to [`GRAPH_ROWS_MAX`]) at `cache.len()..` through a captured
    /// graph; `None` when the sequence cannot take the graph path (the caller runs the op-by-op
    /// pass). The cache advances by `tokens.len()` on success. `while_running` runs after a
    /// replay's launch ([`super::BatchOptions::while_running`]).
    pub(super) fn decode_graphed(
        &self,
        tokens: &[u32],
        logits: Logits,
        cache: &mut KvCache,
        while_running: Option<&dyn Fn()>,
    ) -> Result<Option<ForwardOutput>> {
        if tokens.is_empty() || tokens.len() > GRAPH_ROWS_MAX {
            return Ok(None);
        }
        // A hybrid's Gated DeltaNet layers capture only with their state on the device, and not
        // while a speculative checkpoint logs each pass (the log is host bookkeeping a replay
        // would skip): verify passes then run op by op.
        if self.has_recurrent_layers()
            && (cache.checkpoint_len().is_some() || cache.recurrent_device_mut().is_none())
        {
            return Ok(None);
        }
        let mut g = match cache.take_graphs() {
            Some(g) => g,
            None => Box::new(DecodeGraphs {
                tokens: Tensor::zeros(GRAPH_ROWS_MAX, DType::U32, &self.device)?,
                pos: Tensor::zeros(1, DType::U32, &self.device)?,
                chosen: None,
                graphs: HashMap::new(),
                seen: HashSet::new(),
                failed: false,
                timed: ReplayStats::default(),
            }),
        };
        let out = match g.failed {
            true => Ok(None),
            false => self.graph_pass(tokens, logits, cache, &mut g, while_running),
        };
        cache.set_device_position(None);
        cache.put_graphs(g);
        let out = out?;
        if out.is_some() {
            cache.advance(tokens.len());
        }
        Ok(out)
    }

    fn graph_pass(
        &self,
        tokens: &[u32],
        logits: Logits,
        cache: &mut KvCache,
        g: &mut DecodeGraphs,
        while_running: Option<&dyn Fn()>,
    ) -> Result<Option<ForwardOutput>> {
        let Device::Cuda(dev) = &self.device else { return Ok(None) };
        let (pos, rows) = (cache.len(), tokens.len());
        let last_only = rows > 1 && matches!(logits, Logits::Last | Logits::Greedy);
        // The bucket holds the pass's last position; the kernels take the largest first one.
        let last = bucket(pos + rows - 1, cache.capacity());
        let key = (rows, last_only, last);
        strata_kernels::cuda::write_u32s(&g.tokens, tokens)?;
        strata_kernels::cuda::write_u32(&g.pos, pos as u32)?;
        let chosen = self.write_synthetic_choice(cache, tokens, g)?;
        let synthetic = chosen.is_some();
        cache.set_device_position(Some((g.pos.clone(), last + 1 - rows)));
        let ids = g.tokens.narrow(0, 0, rows)?;
        if !g.graphs.contains_key(&key) {
            // A pass of several tokens runs op by op the first time its shape comes.
            let capture = rows == 1 || !g.seen.insert(key);
            // Run it (candle's parameter uploads cached for the capture, kernels' modules
            // loaded), then capture the same launches for the next passes of this shape.
            let _htod = dev.enable_cuda_graph_htod_cache();
            // The graph is launched right after its capture, repeating this pass: writing the same
            // KV entries again is harmless, advancing a recurrent state twice is not, so a
            // hybrid's state is put back before the capture.
            let before = match capture && self.has_recurrent_layers() {
                true => Some(cache.snapshot_recurrent().ok_or_else(|| {
                    candle_core::Error::msg("could not copy the recurrent state for a capture")
                })?),
                false => None,
            };
            let (logits, routing) =
                self.decode_body(&mut PassKv::One(cache), &ids, last_only, chosen.clone())?;
            let routing = routing
                .as_ref()
                .map(|d| d.read(self.experts.as_ref()))
                .transpose()?
                .unwrap_or_default();
            let eager = ForwardOutput { logits, greedy: None, hidden_states: Vec::new(), routing };
            if !capture {
                return Ok(Some(eager));
            }
            let after = match &before {
                Some(b) => {
                    let after = cache.snapshot_recurrent();
                    cache.restore_recurrent(b);
                    after
                }
                None => None,
            };
            match self.capture(dev, &mut PassKv::One(cache), &ids, last_only, chosen, false) {
                Ok(c) => {
                    g.graphs.insert(key, c);
                }
                Err(e) => {
                    // The eager pass's result stands: its state too.
                    if let Some(a) = &after {
                        cache.restore_recurrent(a);
                    }
                    g.failed = true;
                    eprintln!("strata: CUDA graph capture failed, decoding op by op: {e}");
                    return Ok(Some(eager));
                }
            }
            // A new graph is launched at once and its outputs returned: the memory its capture
            // allocated exists only once it has run, and freeing its outputs unlaunched (a
            // sequence that ends right after a capture) failed later calls with
            // CUDA_ERROR_INVALID_VALUE. The launch repeats the eager pass over the same inputs:
            // the same cache entries again.
        }
        let c = g.graphs.get(&key).expect("captured above");
        replay(dev, c, &mut g.timed, |c, wait| {
            // While the pass runs: the next token's routing choice drawn (synthetic models).
            if synthetic {
                let _ = choose_ahead(self, &mut [&mut *cache], &[pos + rows]);
            }
            if let Some(work) = while_running {
                work();
            }
            wait();
            let logits = c.logits.copy()?;
            let routing = c.routing.as_ref().map(|d| d.read(self.experts.as_ref())).transpose()?;
            let routing = routing.unwrap_or_default();
            Ok(Some(ForwardOutput { logits, greedy: None, hidden_states: Vec::new(), routing }))
        })
    }

    /// A synthetic model's choice for this pass ([`synthetic_choices`]), recorded in the
    /// sequence's history and written into the graphs' `chosen` buffer (allocated at the first
    /// pass): that buffer's first entries, `None` for other models.
    fn write_synthetic_choice(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        g: &mut DecodeGraphs,
    ) -> Result<Option<Tensor>> {
        let start = cache.len();
        let mut caches = [cache];
        let pass = [(start, tokens)];
        let Some(ids) = synthetic_choices(self, &mut caches, &pass, self.layers.len(), None) else {
            return Ok(None);
        };
        self.write_choice(&mut g.chosen, &ids, tokens.len()).map(Some)
    }

    /// Writes a pass's synthetic choice `ids` (`rows` rows' worth) into `buf`, allocated at the
    /// first pass for [`GRAPH_ROWS_MAX`] rows: a view of its first `ids.len()` entries, what the
    /// routing kernels read (the graphs' launches keep reading the same buffer).
    pub(super) fn write_choice(
        &self,
        buf: &mut Option<Tensor>,
        ids: &[u32],
        rows: usize,
    ) -> Result<Tensor> {
        if buf.is_none() {
            let n = ids.len() / rows * GRAPH_ROWS_MAX;
            *buf = Some(Tensor::zeros(n, DType::U32, &self.device)?);
        }
        let buf = buf.as_ref().expect("allocated above");
        strata_kernels::cuda::write_u32s(buf, ids)?;
        Ok(buf.narrow(0, 0, ids.len())?)
    }

    pub(super) fn capture(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
        kv: &mut PassKv<'_>,
        tokens: &Tensor,
        last_only: bool,
        chosen: Option<Tensor>,
        picks: bool,
    ) -> Result<Captured> {
        // q8 twins held from before must not be dropped inside the capture (a free of memory the
        // graph did not allocate); the eager pass before released them already.
        strata_kernels::cuda::release_q8_twins();
        let stream = dev.cuda_stream();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).w()?;
        let body = self.decode_body(kv, tokens, last_only, chosen).and_then(|(logits, routing)| {
            let picks = match picks {
                true => Some(strata_kernels::cuda::argmax_rows(&logits)?),
                false => None,
            };
            Ok((logits, picks, routing))
        });
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
        let graph = stream.end_capture(flags).w();
        let (logits, picks, routing) = body?;
        let graph = graph?.ok_or_else(|| {
            ModelError::Candle(candle_core::Error::msg("the captured pass is empty"))
        })?;
        graph.upload().w()?;
        if stats_on() {
            eprintln!(
                "strata: captured a pass of {} tokens: graph nodes {}",
                tokens.dim(0)?,
                node_counts(&graph)?
            );
        }
        Ok(Captured { graph: SendGraph(graph), logits, picks, routing })
    }

    /// The launches of one pass of `tokens: [rows]` (everything on the device; the op-by-op pass
    /// of `forward_batch` restricted to one sequence, or to a batch of one-token decode steps
    /// whose positions and caches are in row tables, [`PassKv`]): logits `[rows, vocab]`, or `[1, vocab]`
    /// for the last row with `last_only`, and the pass's device routing record. The q8 twins the
    /// pass's kernels kept are released at its end (inside a capture: before it ends).
    pub(super) fn decode_body(
        &self,
        kv: &mut PassKv<'_>,
        tokens: &Tensor,
        last_only: bool,
        chosen: Option<Tensor>,
    ) -> Result<(Tensor, Option<DeviceRouting>)> {
        let out = self.decode_launches(kv, tokens, last_only, chosen);
        strata_kernels::cuda::release_q8_twins();
        out
    }

    fn decode_launches(
        &self,
        kv: &mut PassKv<'_>,
        tokens: &Tensor,
        last_only: bool,
        chosen: Option<Tensor>,
    ) -> Result<(Tensor, Option<DeviceRouting>)> {
        let scales = self.cfg.scales;
        let rows = tokens.dim(0)?;
        let mut x = self.embed.0.embedding(tokens)?; // [rows, hidden]
        if scales.embedding != 1.0 {
            x = (x * scales.embedding)?;
        }
        let mut routing = DeviceRouting::for_pass(self, &[], rows, self.layers.len(), chosen)?;
        // As `forward_batch`: the next layer's attention norm comes with the residual add.
        let mut next_xn: Option<Tensor> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let xn = match next_xn.take() {
                Some(xn) => xn,
                None => layer.attn_norm.forward(&x)?,
            };
            let h = match (&layer.mixer, &mut *kv) {
                (Mixer::Attention(a), PassKv::One(cache)) => {
                    a.forward(&xn, i, cache, &self.rope)?
                }
                (Mixer::GatedDeltaNet(g), PassKv::One(cache)) => g.forward(&xn, i, cache)?,
                (Mixer::GatedDeltaNet(g), PassKv::Rows { tables, .. }) => match &tables[i] {
                    LayerRows::States(states) => g.forward_seqs(&xn, states)?,
                    LayerRows::Kv(_) => {
                        return Err(not_graphable("a KV table for a recurrent layer"))
                    }
                },
                (Mixer::Attention(a), PassKv::Rows { tables, like }) => match &tables[i] {
                    LayerRows::Kv(rows) => {
                        let (k, v) = like.layer_kv(i)?;
                        let cache = strata_kernels::cuda::LayerKv { k, v };
                        a.forward_rows(&xn, rows, cache, &self.rope)?
                    }
                    LayerRows::States(_) => {
                        return Err(not_graphable("a state table for an attention layer"))
                    }
                },
            };
            // The residual add and the FFN norm: one launch on a GPU.
            let (sum, xn) =
                layer.ffn_norm.add_forward(&x, &residual_scaled(h, scales.residual)?)?;
            x = sum;
            let h = match (&layer.ffn, routing.as_mut()) {
                (FeedForward::Dense(m), _) => m.forward(&xn)?,
                (FeedForward::Moe(moe), Some(r)) => r
                    .forward(moe, i, &xn, self)
                    .ok_or_else(|| not_graphable("a MoE layer without fused experts"))??,
                (FeedForward::Moe(_), None) => return Err(not_graphable("host routing")),
            };
            (x, next_xn) = self.end_layer(i, self.layers.len(), &x, h)?;
        }
        // As `forward_batch`: the lm_head runs on the rows whose logits are wanted.
        if last_only {
            x = x.narrow(0, rows - 1, 1)?;
        }
        let mut logits = self.lm_head.forward(&self.norm.forward(&x)?)?;
        if scales.logits != 1.0 {
            logits = (logits * scales.logits)?;
        }
        Ok((logits, routing))
    }
}

/// Launches `c`'s graph and takes its outputs with `read` (they live until the graph's next
/// launch); under `STRATA_GPU_GRAPH_STATS=1` the replay is timed into `timed`.
pub(super) fn replay<T>(
    dev: &candle_core::cuda_backend::CudaDevice,
    c: &Captured,
    timed: &mut ReplayStats,
    read: impl FnOnce(&Captured, &dyn Fn()) -> Result<T>,
) -> Result<T> {
    let t0 = std::time::Instant::now();
    let stream = dev.cuda_stream();
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stats_on().then(|| stream.record_event(flags)).transpose().w()?;
    c.graph.0.launch().w()?;
    let end = stats_on().then(|| stream.record_event(flags)).transpose().w()?;
    // `read` calls this once its work beside the graph is done, before reading its outputs:
    // timed, the host waits there for the graph's end, which splits its time.
    let waited = std::cell::Cell::new(None);
    let wait = || {
        if let Some(e) = &end {
            let before = t0.elapsed().as_secs_f64() * 1e3;
            if e.synchronize().is_ok() {
                waited.set(Some((before, std::time::Instant::now())));
            }
        }
    };
    let out = read(c, &wait)?;
    if let (Some(a), Some(b)) = (start, end) {
        let split = waited.get().map(|(before, t)| [before, t.elapsed().as_secs_f64() * 1e3]);
        timed.add(a.elapsed_ms(&b).w()? as f64, t0.elapsed().as_secs_f64() * 1e3, split);
    }
    Ok(out)
}

/// `STRATA_GPU_GRAPH_STATS=1`: each capture's nodes by type, and every 64 replays the mean GPU
/// time of a replay (CUDA events around the launch) beside the host's time per pass (from the
/// positions written to the outputs read), on stderr — where a decode step's time goes.
pub(super) fn stats_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_GPU_GRAPH_STATS").is_ok_and(|v| v == "1"))
}

/// A captured graph's nodes counted by type ("kernel 700, mem_alloc 300, …").
fn node_counts(graph: &CudaGraph) -> Result<String> {
    let mut n = 0usize;
    // SAFETY: a null array asks for the count; then an array of that many nodes is filled.
    unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n) }.result().w()?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries.
    unsafe { sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut n) }.result().w()?;
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for &node in &nodes[..n] {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to the graph, which outlives the call.
        unsafe { sys::cuGraphNodeGetType(node, &mut t) }.result().w()?;
        let name = format!("{t:?}").trim_start_matches("CU_GRAPH_NODE_TYPE_").to_lowercase();
        *counts.entry(name).or_default() += 1;
    }
    let parts: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
    Ok(format!("{n} ({})", parts.join(", ")))
}

fn not_graphable(what: &str) -> ModelError {
    ModelError::Candle(candle_core::Error::msg(format!("decode graph: {what}")))
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_double_from_one_attention_chunk() {
        assert_eq!(bucket(0, 4096), 255);
        assert_eq!(bucket(255, 4096), 255);
        assert_eq!(bucket(256, 4096), 511);
        assert_eq!(bucket(1000, 4096), 1023);
        assert_eq!(bucket(3000, 4096), 4095);
        assert_eq!(bucket(100, 128), 127);
    }
}
