//! [`StreamingExperts`]: an [`ExpertProvider`] that reads routed experts from the model file(s) on
//! demand into a byte-budgeted cache of slab slots.
//!
//! Flow per MoE layer: the block routes its tokens and calls `will_need(layer, ids)`; every missing
//! expert gets a slot (evicting by the policy; experts of the current request are protected) and
//! the reads of all of them are queued on the I/O engine at once. `expert(layer, e)` then returns a
//! cached expert, or waits for its read (stall time) and builds it in place: formats our kernels run
//! (Q4_1, Q8_0, Q4_K) use the slot's bytes directly; others are decoded into candle tensors beside the
//! slot. An expert leaves the cache on eviction; its slot returns to the free list when the last
//! forward pass using it drops it.
//!
//! Prefetch (`prefetch(layer, ids)`, predictions for the next MoE layer): reads join the I/O
//! engine's low-priority queue and only take room that is free or held by experts neither the
//! current routing nor the predicted layer uses; a prediction the layer then needs is promoted to
//! the demand queue. A finished read nobody asked for is evictable like a cached expert.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;
use strata_formats::{ExpertDims, ExpertEncoding, ExpertExtent, ModelConfig, ModelFiles};
use strata_kernels::{QuantMatrix, WeightBytes};
use strata_models::layers::{expert_kernel_format, Linear};
use strata_models::mlp::Mlp;
use strata_models::{Expert, ExpertProvider, ExpertStats, ModelError, PrefetchMode};

use crate::io::{DirectIo, IoEngine, Priority, ReadJob, Ticket, DIRECT_ALIGN};
use crate::policy::{EvictionPolicy, Usage};
use crate::prefetch_gate::PrefetchGate;
use crate::protect::Protected;
use crate::slab::{Slab, Slot};
use strata_plan::budget::{cache_entries, cache_room, host_reserve, CacheBudget};
use strata_plan::system::available_memory;

/// Options of `--stream-experts`.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// `--expert-cache`.
    pub budget: CacheBudget,
    /// `--direct-io`: `O_DIRECT` reads that bypass the page cache (`auto`: where supported).
    pub direct_io: DirectIo,
    /// Reader threads = reads in flight at once (`--io-threads`).
    pub io_threads: usize,
    pub policy: EvictionPolicy,
    /// `--prefetch`: which prediction of the next MoE layer's experts is read ahead.
    pub prefetch: PrefetchMode,
    /// `--prefetch-min-precision`: predictions are read only while their measured precision on
    /// uncached experts is at least this ([`crate::prefetch_gate`]); 0 reads them always.
    pub prefetch_min_precision: f64,
    /// `--read-chunk`: reads longer than this are split into concurrent pieces (bytes; 0: never),
    /// so that even one missed expert keeps several reads in flight.
    pub read_chunk: usize,
    /// `--gpu-expert-cache`: the VRAM expert cache above the host cache on a CUDA device
    /// ([`crate::gpu_tier`]; `auto`: free VRAM minus the dense weights and a reserve).
    pub gpu_expert_cache: CacheBudget,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            budget: CacheBudget::Auto,
            direct_io: DirectIo::Auto,
            io_threads: 16,
            policy: EvictionPolicy::Lru,
            prefetch: PrefetchMode::default(),
            prefetch_min_precision: DEFAULT_PREFETCH_MIN_PRECISION,
            read_chunk: DEFAULT_READ_CHUNK,
            gpu_expert_cache: CacheBudget::Auto,
        }
    }
}

/// Opens the routed-expert provider of `--stream-experts` on `device`: on a CUDA device (a build
/// with the `cuda` feature) the GPU tier ([`crate::gpu_tier::GpuExperts`]) over the host cache,
/// elsewhere the host cache alone. Returns it with the model's routed-expert bytes (stored).
///
/// Errors: those of [`StreamingExperts::open`] (and CUDA driver errors).
pub fn open_streaming(
    files: &ModelFiles,
    cfg: &ModelConfig,
    device: &Device,
    opts: &StreamOptions,
) -> Result<(Arc<dyn ExpertProvider>, u64), ModelError> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let tier = crate::gpu_tier::GpuExperts::open(files, cfg, device, opts)?;
        let total = tier.host().expert_bytes_total();
        return Ok((Arc::new(tier), total));
    }
    let host = StreamingExperts::open(files, cfg, device, opts)?;
    let total = host.expert_bytes_total();
    Ok((Arc::new(host), total))
}

/// Default `--read-chunk` (bytes): 0, reads are not split. Splitting a 2.65 MB expert into
/// 512 KiB or 256 KiB pieces was measured slower on the 2-core VM's drive (docs/performance.md,
/// "Prefetch and bundled layout": 0.59 vs 0.77 GB/s while reading); it is there for drives that
/// need queue depth.
pub const DEFAULT_READ_CHUNK: usize = 0;

/// Splits the read `(offset, len, need, slot offset)` into pieces of at most `chunk` bytes
/// (`chunk` 0: one piece). Each piece's `need` is the part of the original `need` it covers.
fn pieces(
    offset: u64,
    len: usize,
    need: usize,
    at: usize,
    chunk: usize,
) -> Vec<(u64, usize, usize, usize)> {
    if chunk == 0 || len <= chunk {
        return vec![(offset, len, need, at)];
    }
    (0..len)
        .step_by(chunk)
        .map(|s| {
            let l = chunk.min(len - s);
            (offset + s as u64, l, need.saturating_sub(s).min(l), at + s)
        })
        .collect()
}

/// Default `--prefetch-min-precision` (see [`crate::prefetch_gate`]).
pub const DEFAULT_PREFETCH_MIN_PRECISION: f64 = 0.5;

/// How one expert is read into its slot: jobs (file, offset, len, need, slot offset) and the moves
/// that put the data in place afterwards (src, dst, len), in ascending `dst`. After them gate, up
/// and down lie at slot offsets 0, G and G+U.
#[derive(Debug, Clone, Default)]
struct ReadPlan {
    jobs: Vec<(usize, u64, usize, usize, usize)>,
    moves: Vec<(usize, usize, usize)>,
    /// Moves can run in place (every `src >= dst`); otherwise they copy from a snapshot.
    in_place: bool,
    /// Slot bytes the plan uses.
    span: usize,
}

/// Parts of one expert at most this far apart in a file are read as one range (the gap is read
/// and dropped): one request instead of two (`strata repack`'s alignment padding, safetensors'
/// headers between tensors).
const MAX_GAP: u64 = 4096;

impl ReadPlan {
    /// Parts in the same file, taken in file order (safetensors stores `down_proj` before
    /// `gate_proj` and `up_proj`) and at most [`MAX_GAP`] apart, become one read; with `direct`,
    /// every read is widened to [`DIRECT_ALIGN`] in offset and length.
    fn new(extent: &ExpertExtent, direct: bool) -> Self {
        struct Run {
            file: usize,
            start: u64,
            end: u64,
            /// (file offset, len, final slot offset)
            parts: Vec<(u64, usize, usize)>,
        }
        let mut parts: Vec<(usize, u64, usize, usize)> = Vec::new(); // file, offset, len, final slot offset
        let mut dst = 0usize;
        for p in &extent.parts {
            parts.push((p.file, p.offset, p.len as usize, dst));
            dst += p.len as usize;
        }
        parts.sort_by_key(|p| (p.0, p.1));
        let mut runs: Vec<Run> = Vec::new();
        for (file, offset, len, at) in parts {
            match runs.last_mut() {
                Some(r) if r.file == file && offset >= r.end && offset - r.end <= MAX_GAP => {
                    r.end = offset + len as u64;
                    r.parts.push((offset, len, at));
                }
                _ => runs.push(Run {
                    file,
                    start: offset,
                    end: offset + len as u64,
                    parts: vec![(offset, len, at)],
                }),
            }
        }
        let mut plan = ReadPlan::default();
        let mut cursor = 0usize;
        for r in runs {
            let start =
                if direct { r.start / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64 } else { r.start };
            let need = (r.end - start) as usize;
            let len = if direct { need.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN } else { need };
            plan.jobs.push((r.file, start, len, need, cursor));
            for (offset, plen, at) in r.parts {
                let src = cursor + (offset - start) as usize;
                if src != at {
                    plan.moves.push((src, at, plen));
                }
            }
            cursor += len;
        }
        // In ascending `dst` with every `src >= dst`, a move never overwrites a later move's source
        // (destinations are disjoint and each lies below the next one's).
        plan.moves.sort_by_key(|m| m.1);
        plan.in_place = plan.moves.iter().all(|m| m.0 >= m.1);
        plan.span = cursor.max(dst);
        plan
    }

    /// Applies the moves to a slot whose reads completed.
    fn place(&self, slot: &mut Slot) {
        if self.in_place {
            for &(src, dst, len) in &self.moves {
                slot.copy_within(src, dst, len);
            }
        } else {
            let snapshot = slot.as_ref()[..self.span].to_vec();
            for &(src, dst, len) in &self.moves {
                slot.write(dst, &snapshot[src..src + len]);
            }
        }
    }
}

enum State {
    /// Reads in flight into `slot`.
    Pending { slot: Slot, ticket: Arc<Ticket> },
    /// The expert's bytes in place in `slot`; `expert` is built on first use through
    /// [`ExpertProvider::expert`] (a GPU tier reading the bytes never builds it on the host).
    Ready { slot: Arc<Slot>, expert: Option<Arc<Expert>> },
}

/// One cached expert's stored bytes, for a tier above the host cache (the GPU tier copies them to
/// device memory): gate, up and down lie at `ranges` of `slot`, in `encodings` with `shapes`
/// (`[rows, cols]`: gate and up `[I, H]`, down `[H, I]`). Holding it keeps the slot from reuse.
pub struct ExpertBytes {
    pub slot: Arc<Slot>,
    pub ranges: [std::ops::Range<usize>; 3],
    pub encodings: [ExpertEncoding; 3],
    pub shapes: [[usize; 2]; 3],
    /// Stored bytes of the three parts.
    pub bytes: usize,
}

impl ExpertBytes {
    /// Part `k` (0 gate, 1 up, 2 down) decoded into a candle tensor on `device` (formats our CPU
    /// kernels do not run from the slot, float weights widened to f32); `name` names it in errors.
    pub fn decoded(&self, k: usize, name: &str, device: &Device) -> Result<Linear, ModelError> {
        let bytes = &AsRef::<[u8]>::as_ref(self.slot.as_ref())[self.ranges[k].clone()];
        let w = strata_formats::weight_from_bytes(
            self.encodings[k],
            self.shapes[k],
            bytes,
            name,
            device,
        )?;
        Linear::for_expert(w).map_err(|e| ModelError::Tensor { name: name.to_string(), source: e })
    }
}

struct Entry {
    state: State,
    usage: Usage,
    /// Read by a prefetch and not asked for yet.
    prefetched: bool,
    /// Read on demand (not in the cache when its layer routed) and not asked for yet: its first
    /// lookup is a miss even if the read has finished by then.
    demand_read: bool,
}

impl Entry {
    /// Ready, or pending with every read finished (its slot can be dropped).
    fn evictable(&self) -> bool {
        match &self.state {
            State::Ready { .. } => true,
            State::Pending { ticket, .. } => ticket.is_done(),
        }
    }
}

/// Why reads are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// `expert()`: wait for a slot if none is free.
    Wait,
    /// `will_need`: skip what there is no room for (`expert()` retries).
    Skip,
    /// A prediction for `layer`: only free room or unneeded experts of other layers.
    Prefetch { layer: usize },
}

struct CacheState {
    map: HashMap<(usize, usize), Entry>,
    tick: u64,
    /// Experts of the most recent `will_need`: evicted only when nothing else can be.
    /// Experts each thread's current pass needs.
    protected: Protected<(usize, usize)>,
    /// Per layer: the predicted experts the cache lacked at the last prediction (read or not).
    candidates: HashMap<usize, Vec<usize>>,
    gate: PrefetchGate,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    stall_ns: AtomicU64,
    touched_bytes: AtomicU64,
    prefetch_reads: AtomicU64,
    prefetch_used: AtomicU64,
    prefetch_candidates: AtomicU64,
    prefetch_candidates_used: AtomicU64,
}

/// Routed experts streamed from the model file(s). See the module docs.
pub struct StreamingExperts {
    io: IoEngine,
    slab: Slab,
    /// `extents[layer][expert]` (empty for dense layers).
    extents: Vec<Vec<ExpertExtent>>,
    dims: ExpertDims,
    device: Device,
    policy: EvictionPolicy,
    /// Experts the cache holds at most.
    capacity: usize,
    /// Memory one cached expert costs (slot + decoded tensors), bytes.
    entry_bytes: u64,
    /// Experts one prefetch may start at most.
    prefetch_limit: usize,
    /// Reads are split into pieces of at most this many bytes (0: not split).
    read_chunk: usize,
    expert_bytes_total: u64,
    state: Mutex<CacheState>,
    counters: Counters,
}

impl std::fmt::Debug for StreamingExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StreamingExperts({} experts cached at most, {:?}, {:?})",
            self.capacity, self.slab, self.io
        )
    }
}

/// Time to wait for a slot held by another forward pass before failing the request.
const SLOT_WAIT: Duration = Duration::from_secs(60);

impl StreamingExperts {
    /// Resolves every MoE layer's expert extents (shapes checked, nothing read), sizes the cache
    /// from `opts.budget` and starts the I/O engine.
    ///
    /// Errors: the model has no MoE layers, a bad expert tensor (named), a file that cannot be
    /// opened (with `O_DIRECT` on a filesystem without it).
    pub fn open(
        files: &ModelFiles,
        cfg: &ModelConfig,
        device: &Device,
        opts: &StreamOptions,
    ) -> Result<Self, ModelError> {
        let err = |message: String| ModelError::ExpertRead { layer: 0, expert: 0, message };
        let moe = cfg.moe.as_ref().ok_or_else(|| {
            err(format!("{}: --stream-experts needs an MoE model", files.path().display()))
        })?;
        let dims = ExpertDims {
            num_experts: moe.num_experts,
            hidden: cfg.hidden_size,
            intermediate: moe.expert_intermediate_size,
        };
        let mut extents = vec![Vec::new(); cfg.num_layers];
        let (mut slot_bytes, mut extra, mut total) = (0usize, 0u64, 0u64);
        let direct = opts.direct_io.resolve(&files.weight_files());
        for (layer, ext) in extents.iter_mut().enumerate() {
            if !cfg.is_moe_layer(layer) {
                continue;
            }
            let layout = files.expert_layout(layer, dims)?;
            for e in 0..moe.num_experts {
                let x = files.expert_extent(&layout, e)?;
                slot_bytes = slot_bytes.max(ReadPlan::new(&x, direct).span);
                extra = extra.max(decoded_bytes(&x, dims));
                total += x.bytes();
                ext.push(x);
            }
        }
        let slot_bytes = slot_bytes.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let entry_bytes = slot_bytes as u64 + extra;
        let dense = files.total_tensor_bytes().saturating_sub(total);
        // Without a plan (library users, tests) `auto` takes what the plan's rule would leave
        // after the dense weights; the plan passes bytes.
        let available = available_memory().unwrap_or(8 << 30);
        let room = cache_room(available, dense, host_reserve(available));
        let budget_bytes = opts.budget.resolve(total, room);
        let all = extents.iter().map(Vec::len).sum::<usize>();
        // Memory per entry: the slot plus decoded tensors.
        let capacity = cache_entries(opts.budget, all, moe.experts_per_token, entry_bytes, room);
        if (capacity as u64) * entry_bytes > budget_bytes {
            tracing::warn!("expert cache raised to {capacity} experts ({} bytes): a decode step needs top-k + 1", capacity as u64 * entry_bytes);
        }
        // Slack for slots still held by forward passes after their expert was evicted.
        let slab = Slab::new(capacity + 2 * moe.experts_per_token + 2, slot_bytes).map_err(err)?;
        let io = IoEngine::open(&files.weight_files(), opts.io_threads, direct).map_err(err)?;
        Ok(Self {
            io,
            slab,
            extents,
            dims,
            device: device.clone(),
            policy: opts.policy,
            capacity,
            entry_bytes,
            prefetch_limit: prefetch_limit(capacity, moe.experts_per_token),
            // O_DIRECT pieces must stay aligned.
            read_chunk: opts.read_chunk.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN,
            expert_bytes_total: total,
            state: Mutex::new(CacheState {
                map: HashMap::new(),
                tick: 0,
                protected: Protected::default(),
                candidates: HashMap::new(),
                gate: PrefetchGate::new(opts.prefetch_min_precision),
            }),
            counters: Counters::default(),
        })
    }

    /// Bytes the cache may use (slots and decoded tensors of `capacity` experts).
    pub fn cache_bytes(&self) -> u64 {
        self.capacity as u64 * self.entry_bytes
    }

    /// The encodings of gate, up and down when every routed expert of every layer shares them.
    pub fn uniform_encodings(&self) -> Option<[ExpertEncoding; 3]> {
        let mut all = self.extents.iter().flatten().map(|x| x.encodings);
        let first = all.next()?;
        all.all(|e| e == first).then_some(first)
    }

    /// The expert dimensions (hidden, expert intermediate size, experts per layer).
    pub fn dims(&self) -> ExpertDims {
        self.dims
    }

    /// Stored bytes of all routed experts.
    pub fn expert_bytes_total(&self) -> u64 {
        self.expert_bytes_total
    }

    fn extent(&self, layer: usize, expert: usize) -> Result<&ExpertExtent, ModelError> {
        self.extents.get(layer).and_then(|l| l.get(expert)).ok_or_else(|| ModelError::ExpertRead {
            layer,
            expert,
            message: "no such expert".into(),
        })
    }

    /// Evicts one expert by the policy: unprotected evictable entries first, then protected ones.
    /// A prefetch for `layer` evicts neither protected experts nor `layer`'s nor `keep`. Returns
    /// false when nothing can be evicted.
    fn evict_one(&self, st: &mut CacheState, need: Need, keep: &[(usize, usize)]) -> bool {
        let victim = |protect: bool| {
            st.map
                .iter()
                .filter(|(k, e)| e.evictable() && (protect || !st.protected.contains(k)))
                .filter(|(k, _)| match need {
                    Need::Prefetch { layer } => k.0 != layer && !keep.contains(k),
                    _ => true,
                })
                .min_by_key(|(_, e)| self.policy.score(&e.usage))
                .map(|(k, _)| *k)
        };
        let found = match need {
            Need::Prefetch { .. } => victim(false),
            _ => victim(false).or_else(|| victim(true)),
        };
        match found {
            Some(k) => {
                st.map.remove(&k);
                true
            }
            None => false,
        }
    }

    /// Makes room and queues the reads of `keys` not yet cached or pending (see [`Need`]).
    fn start_reads(&self, keys: &[(usize, usize)], need: Need) -> Result<(), ModelError> {
        let mut jobs = Vec::new();
        let mut files_checked = false;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &(layer, expert) in keys {
            if st.map.contains_key(&(layer, expert)) {
                continue;
            }
            let extent = self.extent(layer, expert)?;
            // Once per batch, before its first read.
            if !files_checked {
                self.io.check_files().map_err(|message| ModelError::ExpertRead {
                    layer,
                    expert,
                    message,
                })?;
                files_checked = true;
            }
            while st.map.len() >= self.capacity {
                if !self.evict_one(&mut st, need, keys) {
                    break;
                }
            }
            let prefetch = matches!(need, Need::Prefetch { .. });
            if prefetch && st.map.len() >= self.capacity {
                return Ok(()); // no room a prediction may take
            }
            let slot = match self.slab.try_acquire() {
                Some(s) => s,
                None if need == Need::Wait => {
                    drop(st);
                    let s = self.slab.acquire_timeout(SLOT_WAIT).ok_or_else(|| {
                        ModelError::ExpertRead {
                            layer,
                            expert,
                            message: format!(
                                "expert cache exhausted: all {} slots held for {SLOT_WAIT:?}",
                                self.slab.slots()
                            ),
                        }
                    })?;
                    st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                    if st.map.contains_key(&(layer, expert)) {
                        continue; // another thread started it meanwhile; `s` goes back
                    }
                    s
                }
                None if prefetch => return Ok(()),
                None => continue,
            };
            let plan = ReadPlan::new(extent, self.io.direct());
            let base = slot.as_mut_ptr();
            let first = jobs.len();
            for &(file, offset, len, need, at) in &plan.jobs {
                for (offset, len, need, at) in pieces(offset, len, need, at, self.read_chunk) {
                    // SAFETY: `at + len <= span <= slot.len()`, checked when the slab was sized.
                    jobs.push(ReadJob { file, offset, len, need, dst: unsafe { base.add(at) } });
                }
            }
            let ticket = self.io.submit(
                jobs.split_off(first),
                if prefetch { Priority::Prefetch } else { Priority::Demand },
            );
            if prefetch {
                self.counters.prefetch_reads.fetch_add(1, Ordering::Relaxed);
            }
            st.map.insert(
                (layer, expert),
                Entry {
                    state: State::Pending { slot, ticket },
                    usage: Usage::default(),
                    prefetched: prefetch,
                    demand_read: !prefetch,
                },
            );
        }
        Ok(())
    }

    /// Puts the bytes of a slot whose reads completed in place (gate, up, down back to back).
    fn place(&self, layer: usize, expert: usize, mut slot: Slot) -> Result<Arc<Slot>, ModelError> {
        ReadPlan::new(self.extent(layer, expert)?, self.io.direct()).place(&mut slot);
        Ok(Arc::new(slot))
    }

    /// Where gate, up and down lie in a placed slot, with their encodings and shapes.
    fn layout_of(
        &self,
        layer: usize,
        expert: usize,
        slot: &Arc<Slot>,
    ) -> Result<ExpertBytes, ModelError> {
        let extent = self.extent(layer, expert)?;
        let (h, i) = (self.dims.hidden, self.dims.intermediate);
        let lens = extent.parts.map(|p| p.len as usize);
        let offs = [0, lens[0], lens[0] + lens[1]];
        Ok(ExpertBytes {
            slot: slot.clone(),
            ranges: [0, 1, 2].map(|k| offs[k]..offs[k] + lens[k]),
            encodings: extent.encodings,
            shapes: [[i, h], [i, h], [h, i]],
            bytes: extent.bytes() as usize,
        })
    }

    /// Builds a ready expert over a placed slot.
    fn build(&self, layer: usize, expert: usize, slot: &Arc<Slot>) -> Result<Expert, ModelError> {
        let b = self.layout_of(layer, expert, slot)?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = slot.clone();
        let name = format!("blk.{layer}.ffn_exps[{expert}]");
        let kernel = |enc: ExpertEncoding| match enc {
            ExpertEncoding::Ggml(dt) if self.device.is_cpu() => expert_kernel_format(dt),
            _ => None,
        };
        let bad = |e: String| ModelError::ExpertRead { layer, expert, message: e };
        let on_kernel =
            |format, range: std::ops::Range<usize>, rows, cols| -> Result<Linear, ModelError> {
                let bytes = WeightBytes::new(owner.clone(), range).map_err(bad)?;
                Ok(Linear::from_kernel(QuantMatrix::new(format, bytes, rows, cols).map_err(bad)?))
            };
        let part = |k: usize| -> Result<Linear, ModelError> {
            match kernel(b.encodings[k]) {
                Some(f) => on_kernel(f, b.ranges[k].clone(), b.shapes[k][0], b.shapes[k][1]),
                None => b.decoded(k, &name, &self.device),
            }
        };
        let mlp = match kernel(b.encodings[0]) {
            // gate and up are adjacent in the slot: one [2I, H] matrix, as the resident path fuses them.
            Some(f) if b.encodings[1] == b.encodings[0] => Mlp::from_fused(
                on_kernel(
                    f,
                    b.ranges[0].start..b.ranges[1].end,
                    2 * b.shapes[0][0],
                    b.shapes[0][1],
                )?,
                part(2)?,
            ),
            _ => Mlp::new(part(0)?, part(1)?, part(2)?)?,
        };
        Ok(Expert::new(mlp, b.bytes))
    }
}

/// Experts one prefetch may start: two layers' worth of top-k (the union of two predictors), at
/// most a quarter of the cache so that predictions never crowd out the working set (at least one).
pub(crate) fn prefetch_limit(capacity: usize, top_k: usize) -> usize {
    (2 * top_k).min(capacity / 4).max(1)
}

/// Bytes of the tensors decoded beside the slot for parts our kernels do not run.
fn decoded_bytes(x: &ExpertExtent, dims: ExpertDims) -> u64 {
    let elems = (dims.hidden * dims.intermediate) as u64;
    x.encodings
        .iter()
        .zip(&x.parts)
        .map(|(enc, p)| match enc {
            ExpertEncoding::Ggml(dt) if expert_kernel_format(*dt).is_some() => 0,
            ExpertEncoding::Ggml(_) => p.len,
            ExpertEncoding::Float(_) => elems * 4,
        })
        .sum()
}

impl StreamingExperts {
    /// Expert `expert` of `layer` from the cache, waiting for its read (and starting it when no
    /// `will_need` did): its placed slot, and the expert built on it when `build`.
    fn fetch(
        &self,
        layer: usize,
        expert: usize,
        build: bool,
    ) -> Result<(Arc<Slot>, Option<Arc<Expert>>), ModelError> {
        let key = (layer, expert);
        let bytes = self.extent(layer, expert)?.bytes();
        self.counters.touched_bytes.fetch_add(bytes, Ordering::Relaxed);
        let mut counted = false; // this call was counted as a hit or a miss
        loop {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.tick += 1;
            let tick = st.tick;
            let ticket = match st.map.get_mut(&key) {
                Some(Entry {
                    state: State::Ready { slot, expert: x },
                    usage,
                    prefetched,
                    demand_read,
                }) => {
                    usage.touch(tick);
                    if std::mem::take(prefetched) {
                        self.counters.prefetch_used.fetch_add(1, Ordering::Relaxed);
                    }
                    // A demand read that finished before this lookup is still a miss: the expert
                    // was not in the cache when its layer routed.
                    let missed = std::mem::take(demand_read);
                    if !counted {
                        let counter =
                            if missed { &self.counters.misses } else { &self.counters.hits };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    if build && x.is_none() {
                        *x = Some(Arc::new(self.build(layer, expert, slot)?));
                    }
                    return Ok((slot.clone(), x.clone()));
                }
                Some(Entry {
                    state: State::Pending { ticket, .. },
                    prefetched,
                    demand_read,
                    ..
                }) => {
                    // A prediction read in time counts as a hit: the expert was in memory when asked.
                    if *prefetched && ticket.is_done() && !counted {
                        self.counters.hits.fetch_add(1, Ordering::Relaxed);
                        counted = true;
                    }
                    // Counted as a miss below if not already: the Ready branch must not count it again.
                    *demand_read = false;
                    ticket.clone()
                }
                None => {
                    drop(st);
                    self.start_reads(&[key], Need::Wait)?;
                    if !counted {
                        self.counters.misses.fetch_add(1, Ordering::Relaxed);
                        counted = true;
                    }
                    continue;
                }
            };
            drop(st);
            if !counted {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                counted = true;
            }
            let t0 = Instant::now();
            let result = ticket.wait();
            self.counters.stall_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            // Another caller may have built it (or, after an error, removed it) meanwhile.
            let mine = matches!(st.map.get(&key), Some(Entry { state: State::Pending { ticket: t, .. }, .. }) if Arc::ptr_eq(t, &ticket));
            if !mine {
                result.map_err(|message| ModelError::ExpertRead { layer, expert, message })?;
                continue;
            }
            let Some(Entry { state: State::Pending { slot, .. }, mut usage, prefetched, .. }) =
                st.map.remove(&key)
            else {
                unreachable!("checked above")
            };
            result.map_err(|message| ModelError::ExpertRead { layer, expert, message })?;
            let slot = self.place(layer, expert, slot)?;
            let x = if build { Some(Arc::new(self.build(layer, expert, &slot)?)) } else { None };
            usage.touch(tick);
            if prefetched {
                self.counters.prefetch_used.fetch_add(1, Ordering::Relaxed);
            }
            st.map.insert(
                key,
                Entry {
                    state: State::Ready { slot: slot.clone(), expert: x.clone() },
                    usage,
                    prefetched: false,
                    demand_read: false,
                },
            );
            return Ok((slot, x));
        }
    }

    /// The stored bytes of expert `expert` of `layer`, waiting for its read like
    /// [`ExpertProvider::expert`] (counted the same way) but without building it: what a GPU tier
    /// copies to device memory.
    ///
    /// Errors: the read failed (I/O, truncated file), no such expert.
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> Result<ExpertBytes, ModelError> {
        let (slot, _) = self.fetch(layer, expert, false)?;
        self.layout_of(layer, expert, &slot)
    }

    /// [`Self::expert_bytes`] only when the expert's reads have finished: never waits, counts
    /// nothing, starts no read (a prefetch into a GPU tier takes what the host already holds).
    pub fn ready_bytes(&self, layer: usize, expert: usize) -> Option<ExpertBytes> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let placed = match st.map.remove(&(layer, expert))? {
            Entry { state: State::Pending { slot, ticket }, usage, prefetched, demand_read }
                if ticket.is_done() && ticket.wait().is_ok() =>
            {
                let slot = self.place(layer, expert, slot).ok()?;
                Entry { state: State::Ready { slot, expert: None }, usage, prefetched, demand_read }
            }
            other => other,
        };
        let slot = match &placed.state {
            State::Ready { slot, .. } => Some(slot.clone()),
            State::Pending { .. } => None,
        };
        st.map.insert((layer, expert), placed);
        drop(st);
        self.layout_of(layer, expert, &slot?).ok()
    }

    /// The slab holding the cache's slots: `(base address, bytes)` (a GPU tier page-locks it so
    /// that copies to the device run at the bus's speed).
    pub fn slab_memory(&self) -> (*mut u8, usize) {
        self.slab.memory()
    }
}

impl ExpertProvider for StreamingExperts {
    fn expert(&self, layer: usize, expert: usize) -> strata_models::Result<Arc<Expert>> {
        let (_, x) = self.fetch(layer, expert, true)?;
        Ok(x.expect("fetch(build = true) builds the expert"))
    }

    fn will_need(&self, layer: usize, experts: &[u32]) {
        let mut keys: Vec<(usize, usize)> = experts.iter().map(|&e| (layer, e as usize)).collect();
        keys.sort_unstable();
        keys.dedup();
        {
            let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let st = &mut *guard;
            st.protected.set_for_current_thread(&keys);
            // Score the last prediction for this layer on what the cache lacked.
            let (candidates, used) = st.gate.resolve(&mut st.candidates, layer, &keys);
            self.counters.prefetch_candidates.fetch_add(candidates, Ordering::Relaxed);
            self.counters.prefetch_candidates_used.fetch_add(used, Ordering::Relaxed);
            // Predictions this layer needs: their queued reads go first now.
            for k in &keys {
                if let Some(Entry {
                    state: State::Pending { ticket, .. }, prefetched: true, ..
                }) = st.map.get(k)
                {
                    self.io.promote(ticket);
                }
            }
        }
        // Errors surface from `expert()`, which retries the read.
        if let Err(e) = self.start_reads(&keys, Need::Skip) {
            tracing::debug!("expert reads not started: {e}");
        }
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let keys: Vec<(usize, usize)> = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let missing: Vec<usize> = experts
                .iter()
                .take(self.prefetch_limit)
                .map(|&e| e as usize)
                .filter(|&e| !st.map.contains_key(&(layer, e)))
                .collect();
            let open = st.gate.open();
            st.candidates.insert(layer, missing.clone());
            if !open {
                return; // measured in the shadow only
            }
            missing.into_iter().map(|e| (layer, e)).collect()
        };
        if let Err(e) = self.start_reads(&keys, Need::Prefetch { layer }) {
            tracing::debug!("prefetch not started: {e}");
        }
    }

    fn prefetch_limit(&self) -> usize {
        self.prefetch_limit
    }

    fn memory_bytes(&self) -> u64 {
        self.cache_bytes()
    }

    fn direct_io(&self) -> Option<bool> {
        Some(self.io.direct())
    }

    fn stats(&self) -> Option<ExpertStats> {
        let io = self.io.counters();
        Some(ExpertStats {
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            bytes_read: io.bytes.load(Ordering::Relaxed),
            reads: io.reads.load(Ordering::Relaxed),
            stall_ns: self.counters.stall_ns.load(Ordering::Relaxed),
            io_busy_ns: io.busy_ns.load(Ordering::Relaxed),
            touched_bytes: self.counters.touched_bytes.load(Ordering::Relaxed),
            prefetch_reads: self.counters.prefetch_reads.load(Ordering::Relaxed),
            prefetch_used: self.counters.prefetch_used.load(Ordering::Relaxed),
            prefetch_candidates: self.counters.prefetch_candidates.load(Ordering::Relaxed),
            prefetch_candidates_used: self
                .counters
                .prefetch_candidates_used
                .load(Ordering::Relaxed),
            uploads: 0,
            upload_bytes: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_formats::ByteRange;

    fn extent(parts: [(usize, u64, u64); 3]) -> ExpertExtent {
        ExpertExtent {
            parts: parts.map(|(file, offset, len)| ByteRange { file, offset, len }),
            encodings: [ExpertEncoding::Float(candle_core::DType::F32); 3],
        }
    }

    #[test]
    fn buffered_plan_coalesces_close_ranges() {
        // Adjacent: one read, nothing moves.
        let p = ReadPlan::new(&extent([(0, 100, 10), (0, 110, 10), (0, 120, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 27, 27, 0)]);
        assert!(p.moves.is_empty());
        assert_eq!(p.span, 27);
        // Small gaps are read and compacted away.
        let p = ReadPlan::new(&extent([(0, 100, 10), (0, 120, 10), (0, 500, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 407, 407, 0)]);
        assert_eq!(p.moves, vec![(20, 10, 10), (400, 20, 7)]);
        assert_eq!(p.span, 407);
        // Another file, a range behind the previous one, or a gap over MAX_GAP: separate reads.
        let p = ReadPlan::new(&extent([(0, 100, 10), (1, 110, 10), (1, 120, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 10, 10, 0), (1, 110, 17, 17, 10)]);
        // Parts are read in file order; far apart, they stay separate reads.
        let p =
            ReadPlan::new(&extent([(0, 9000, 10), (0, 100, 10), (0, 110 + MAX_GAP + 1, 7)]), false);
        assert_eq!(
            p.jobs,
            vec![(0, 100, 10, 10, 0), (0, 110 + MAX_GAP + 1, 7, 7, 10), (0, 9000, 10, 10, 17)]
        );
        assert_eq!(p.moves, vec![(17, 0, 10), (0, 10, 10), (10, 20, 7)]);
        assert!(!p.in_place);
    }

    #[test]
    fn safetensors_order_is_one_read_placed_through_a_snapshot() {
        // HF per-expert tensors: down_proj, gate_proj, up_proj back to back.
        let x = extent([(0, 1000, 100), (0, 1100, 100), (0, 900, 100)]);
        let p = ReadPlan::new(&x, false);
        assert_eq!(p.jobs, vec![(0, 900, 300, 300, 0)]);
        assert_eq!(p.moves, vec![(100, 0, 100), (200, 100, 100), (0, 200, 100)]);
        assert!(!p.in_place);
        let slab = Slab::new(1, 4096).unwrap();
        let mut slot = slab.try_acquire().unwrap();
        let file: Vec<u8> = (0..300).map(|i| (i / 100) as u8).collect(); // down=0, gate=1, up=2
        slot.write(0, &file);
        p.place(&mut slot);
        let want: Vec<u8> = [1u8, 2, 0].iter().flat_map(|&b| std::iter::repeat_n(b, 100)).collect();
        assert_eq!(&slot.as_ref()[..300], want.as_slice());
    }

    #[test]
    fn long_reads_split_into_pieces_that_cover_them() {
        assert_eq!(pieces(100, 10, 10, 0, 0), vec![(100, 10, 10, 0)]);
        assert_eq!(pieces(100, 10, 10, 0, 16), vec![(100, 10, 10, 0)]);
        assert_eq!(
            pieces(100, 10, 10, 5, 4),
            vec![(100, 4, 4, 5), (104, 4, 4, 9), (108, 2, 2, 13)]
        );
        // An aligned superset past the end of the file: the last pieces need less, or nothing.
        assert_eq!(
            pieces(0, 12288, 5000, 0, 4096),
            vec![(0, 4096, 4096, 0), (4096, 4096, 904, 4096), (8192, 4096, 0, 8192)]
        );
    }

    #[test]
    fn direct_plan_reads_aligned_supersets_and_compacts() {
        let p = ReadPlan::new(&extent([(0, 5000, 3000), (0, 20000, 100), (0, 8192, 4096)]), true);
        // 5000..8000 and 8192..12288 are 192 bytes apart: one aligned read 4096..12288.
        assert_eq!(p.jobs, vec![(0, 4096, 8192, 8192, 0), (0, 16384, 4096, 3716, 8192)]);
        assert_eq!(p.moves, vec![(904, 0, 3000), (8192 + 3616, 3000, 100), (4096, 3100, 4096)]);
        assert!(p.in_place);
        for (off, len, _, _, at) in p.jobs.iter().map(|j| (j.1, j.2, j.3, j.0, j.4)) {
            assert_eq!((off % 4096, len % 4096, at % 4096), (0, 0, 0));
        }
    }
}
