//! [`StreamingExperts`]: an [`ExpertProvider`] that reads routed experts from the model file(s) on
//! demand into a byte-budgeted cache of slab slots.
//!
//! Flow per MoE layer: the block routes its tokens and calls `fetch_routed(layer, ids)`; every missing
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
use std::time::Duration;

use candle_core::Device;
use strata_formats::{ExpertDims, ExpertEncoding, ExpertExtent, ModelConfig, ModelFiles};
use strata_models::{Expert, ExpertProvider, ExpertStats, ModelError, PrefetchMode};

mod build;
mod fetch;
mod read_plan;
#[cfg(test)]
mod tests;

use build::decoded_bytes;
pub use build::ExpertBytes;
use fetch::{CacheState, Entry, Need, State};
use read_plan::ReadPlan;

use crate::cache::ExpertCache;
use crate::io::{DirectIo, IoEngine, DIRECT_ALIGN};
use crate::policy::EvictionPolicy;
use crate::prefetch_gate::PrefetchGate;
use crate::slab::Slab;
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

/// Default `--prefetch-min-precision` (see [`crate::prefetch_gate`]).
pub const DEFAULT_PREFETCH_MIN_PRECISION: f64 = 0.5;

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

/// How long a read waiting for a slot waits for one to be released before it evicts an entry
/// whose reads have finished.
const SLOT_RETRY: Duration = Duration::from_millis(5);

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
            capacity,
            entry_bytes,
            prefetch_limit: prefetch_limit(capacity, moe.experts_per_token),
            // O_DIRECT pieces must stay aligned.
            read_chunk: opts.read_chunk.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN,
            expert_bytes_total: total,
            state: Mutex::new(CacheState {
                map: ExpertCache::new(capacity, opts.policy),
                candidates: HashMap::new(),
                gate: PrefetchGate::new(opts.prefetch_min_precision),
            }),
            counters: Counters::default(),
        })
    }

    /// Experts the cache holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
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

    /// The slab holding the cache's slots: `(base address, bytes)` (a GPU tier page-locks it so
    /// that copies to the device run at the bus's speed).
    pub fn slab_memory(&self) -> (*mut u8, usize) {
        self.slab.memory()
    }
}

/// Experts one prefetch may start: two layers' worth of top-k (the union of two predictors), at
/// most a quarter of the cache so that predictions never crowd out the working set (at least one).
pub(crate) fn prefetch_limit(capacity: usize, top_k: usize) -> usize {
    (2 * top_k).min(capacity / 4).max(1)
}

impl ExpertProvider for StreamingExperts {
    fn expert(&self, layer: usize, expert: usize) -> strata_models::Result<Arc<Expert>> {
        let (_, x) = self.fetch(layer, expert, true)?;
        Ok(x.expect("fetch(build = true) builds the expert"))
    }

    fn ready(&self, layer: usize, expert: usize) -> bool {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.map.get(&(layer, expert)).is_some_and(|e| e.evictable())
    }

    fn fetch_routed(&self, layer: usize, experts: &[u32]) {
        let mut keys: Vec<(usize, usize)> = experts.iter().map(|&e| (layer, e as usize)).collect();
        keys.sort_unstable();
        keys.dedup();
        {
            let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let st = &mut *guard;
            st.map.protect_for_current_thread(&keys);
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
            let missing = st.map.missing(layer, experts, self.prefetch_limit);
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
