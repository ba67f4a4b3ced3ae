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

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;
use strata_formats::{ExpertDims, ExpertEncoding, ExpertExtent, ModelConfig, ModelFiles};
use strata_kernels::{QuantMatrix, WeightBytes};
use strata_models::layers::{expert_kernel_format, Linear};
use strata_models::mlp::Mlp;
use strata_models::{Expert, ExpertProvider, ExpertStats, ModelError};

use crate::budget::{available_memory, CacheBudget};
use crate::io::{IoEngine, ReadJob, Ticket, DIRECT_ALIGN};
use crate::policy::{EvictionPolicy, Usage};
use crate::slab::{Slab, Slot};

/// Options of `--stream-experts`.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// `--expert-cache`.
    pub budget: CacheBudget,
    /// `--direct-io`: `O_DIRECT` reads that bypass the page cache.
    pub direct_io: bool,
    /// Reader threads = reads in flight at once (`--io-threads`).
    pub io_threads: usize,
    pub policy: EvictionPolicy,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self { budget: CacheBudget::Auto, direct_io: false, io_threads: 16, policy: EvictionPolicy::Lru }
    }
}

/// How one expert is read into its slot: jobs (file, offset, len, need, slot offset) and, for
/// aligned `O_DIRECT` supersets, the moves that compact the data afterwards (src, dst, len). After
/// them gate, up and down lie at slot offsets 0, G and G+U.
#[derive(Debug, Clone, Default)]
struct ReadPlan {
    jobs: Vec<(usize, u64, usize, usize, usize)>,
    moves: Vec<(usize, usize, usize)>,
    /// Slot bytes the plan uses.
    span: usize,
}

impl ReadPlan {
    /// Ranges adjacent in the same file are coalesced into one read.
    fn new(extent: &ExpertExtent, direct: bool) -> Self {
        let mut ranges: Vec<(usize, u64, usize, usize)> = Vec::new(); // file, offset, len, final slot offset
        let mut dst = 0usize;
        for p in &extent.parts {
            let len = p.len as usize;
            match ranges.last_mut() {
                Some(r) if r.0 == p.file && r.1 + r.2 as u64 == p.offset => r.2 += len,
                _ => ranges.push((p.file, p.offset, len, dst)),
            }
            dst += len;
        }
        let mut plan = ReadPlan::default();
        if !direct {
            for (file, offset, len, at) in ranges {
                plan.jobs.push((file, offset, len, len, at));
            }
            plan.span = dst;
            return plan;
        }
        let a = DIRECT_ALIGN as u64;
        let mut cursor = 0usize;
        for (file, offset, len, at) in ranges {
            let start = offset / a * a;
            let delta = (offset - start) as usize;
            let alen = (delta + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            plan.jobs.push((file, start, alen, delta + len, cursor));
            plan.moves.push((cursor + delta, at, len));
            cursor += alen;
        }
        plan.span = cursor;
        plan
    }
}

enum State {
    /// Reads in flight into `slot`.
    Pending { slot: Slot, ticket: Arc<Ticket> },
    Ready(Arc<Expert>),
}

struct Entry {
    state: State,
    usage: Usage,
}

#[derive(Default)]
struct CacheState {
    map: HashMap<(usize, usize), Entry>,
    tick: u64,
    /// Experts of the most recent `will_need`: evicted only when nothing else can be.
    protected: HashSet<(usize, usize)>,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    stall_ns: AtomicU64,
    touched_bytes: AtomicU64,
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
    expert_bytes_total: u64,
    state: Mutex<CacheState>,
    counters: Counters,
}

impl std::fmt::Debug for StreamingExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamingExperts({} experts cached at most, {:?}, {:?})", self.capacity, self.slab, self.io)
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
    pub fn open(files: &ModelFiles, cfg: &ModelConfig, device: &Device, opts: &StreamOptions) -> Result<Self, ModelError> {
        let err = |message: String| ModelError::ExpertRead { layer: 0, expert: 0, message };
        let moe = cfg.moe.as_ref().ok_or_else(|| err(format!("{}: --stream-experts needs an MoE model", files.path().display())))?;
        let dims = ExpertDims { num_experts: moe.num_experts, hidden: cfg.hidden_size, intermediate: moe.expert_intermediate_size };
        let mut extents = vec![Vec::new(); cfg.num_layers];
        let (mut slot_bytes, mut extra, mut total) = (0usize, 0u64, 0u64);
        for (layer, ext) in extents.iter_mut().enumerate() {
            if !cfg.is_moe_layer(layer) {
                continue;
            }
            let layout = files.expert_layout(layer, dims)?;
            for e in 0..moe.num_experts {
                let x = files.expert_extent(&layout, e)?;
                slot_bytes = slot_bytes.max(ReadPlan::new(&x, opts.direct_io).span);
                extra = extra.max(decoded_bytes(&x, dims));
                total += x.bytes();
                ext.push(x);
            }
        }
        let slot_bytes = slot_bytes.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let entry_bytes = slot_bytes as u64 + extra;
        let dense = files.total_tensor_bytes().saturating_sub(total);
        let budget_bytes = opts.budget.resolve(total, dense, available_memory().unwrap_or(8 << 30));
        let all = extents.iter().map(Vec::len).sum::<usize>();
        let wanted = match opts.budget {
            // A share of the experts (their stored bytes); what they cost in memory is reported.
            CacheBudget::Percent(p) => (all as f64 * p / 100.0).ceil() as usize,
            // Memory: slots plus decoded tensors.
            _ => (budget_bytes / entry_bytes.max(1)) as usize,
        };
        // A decode step needs top-k experts of one layer at once, plus one to evict into.
        let min_entries = moe.experts_per_token + 1;
        let capacity = wanted.clamp(min_entries.min(all), all.max(1));
        if (capacity as u64) * entry_bytes > budget_bytes {
            tracing::warn!("expert cache raised to {capacity} experts ({} bytes): a decode step needs top-k + 1", capacity as u64 * entry_bytes);
        }
        // Slack for slots still held by forward passes after their expert was evicted.
        let slab = Slab::new(capacity + 2 * moe.experts_per_token + 2, slot_bytes).map_err(err)?;
        let io = IoEngine::open(&files.weight_files(), opts.io_threads, opts.direct_io).map_err(err)?;
        Ok(Self {
            io,
            slab,
            extents,
            dims,
            device: device.clone(),
            policy: opts.policy,
            capacity,
            entry_bytes,
            expert_bytes_total: total,
            state: Mutex::new(CacheState::default()),
            counters: Counters::default(),
        })
    }

    /// Bytes the cache may use (slots and decoded tensors of `capacity` experts).
    pub fn cache_bytes(&self) -> u64 {
        self.capacity as u64 * self.entry_bytes
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

    /// Evicts one expert by the policy: unprotected ready entries first, then protected ones.
    /// Returns false when nothing can be evicted (all pending).
    fn evict_one(&self, st: &mut CacheState) -> bool {
        let victim = |protect: bool| {
            st.map
                .iter()
                .filter(|(k, e)| matches!(e.state, State::Ready(_)) && (protect || !st.protected.contains(k)))
                .min_by_key(|(_, e)| self.policy.score(&e.usage))
                .map(|(k, _)| *k)
        };
        match victim(false).or_else(|| victim(true)) {
            Some(k) => {
                st.map.remove(&k);
                true
            }
            None => false,
        }
    }

    /// Makes room and queues the reads of `keys` not yet cached or pending. With `must`, waits for
    /// a slot when none is free; otherwise skips experts it has no room for.
    fn start_reads(&self, keys: &[(usize, usize)], must: bool) -> Result<(), ModelError> {
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
                self.io.check_files().map_err(|message| ModelError::ExpertRead { layer, expert, message })?;
                files_checked = true;
            }
            while st.map.len() >= self.capacity {
                if !self.evict_one(&mut st) {
                    break;
                }
            }
            let slot = match self.slab.try_acquire() {
                Some(s) => s,
                None if must => {
                    drop(st);
                    let s = self.slab.acquire_timeout(SLOT_WAIT).ok_or_else(|| ModelError::ExpertRead {
                        layer,
                        expert,
                        message: format!("expert cache exhausted: all {} slots held for {SLOT_WAIT:?}", self.slab.slots()),
                    })?;
                    st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                    if st.map.contains_key(&(layer, expert)) {
                        continue; // another thread started it meanwhile; `s` goes back
                    }
                    s
                }
                None => continue,
            };
            let plan = ReadPlan::new(extent, self.io.direct());
            let base = slot.as_mut_ptr();
            let first = jobs.len();
            for &(file, offset, len, need, at) in &plan.jobs {
                // SAFETY: `at + len <= span <= slot.len()`, checked when the slab was sized.
                jobs.push(ReadJob { file, offset, len, need, dst: unsafe { base.add(at) } });
            }
            let ticket = self.io.submit(jobs.split_off(first));
            st.map.insert((layer, expert), Entry { state: State::Pending { slot, ticket }, usage: Usage::default() });
        }
        Ok(())
    }

    /// Builds a ready expert from a slot whose reads completed.
    fn build(&self, layer: usize, expert: usize, mut slot: Slot) -> Result<Expert, ModelError> {
        let extent = self.extent(layer, expert)?;
        for (src, dst, len) in ReadPlan::new(extent, self.io.direct()).moves {
            slot.copy_within(src, dst, len);
        }
        let (h, i) = (self.dims.hidden, self.dims.intermediate);
        let lens = extent.parts.map(|p| p.len as usize);
        let offs = [0, lens[0], lens[0] + lens[1]];
        let shapes = [[i, h], [i, h], [h, i]];
        let slot = Arc::new(slot);
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = slot.clone();
        let name = format!("blk.{layer}.ffn_exps[{expert}]");
        let kernel = |enc: ExpertEncoding| match enc {
            ExpertEncoding::Ggml(dt) if self.device.is_cpu() => expert_kernel_format(dt),
            _ => None,
        };
        let bad = |e: String| ModelError::ExpertRead { layer, expert, message: e };
        let on_kernel = |format, off: usize, len: usize, rows, cols| -> Result<Linear, ModelError> {
            let bytes = WeightBytes::new(owner.clone(), off..off + len).map_err(bad)?;
            Ok(Linear::from_kernel(QuantMatrix::new(format, bytes, rows, cols).map_err(bad)?))
        };
        let part = |k: usize| -> Result<Linear, ModelError> {
            match kernel(extent.encodings[k]) {
                Some(f) => on_kernel(f, offs[k], lens[k], shapes[k][0], shapes[k][1]),
                None => {
                    let bytes = &(*slot).as_ref()[offs[k]..offs[k] + lens[k]];
                    let w = strata_formats::weight_from_bytes(extent.encodings[k], shapes[k], bytes, &name, &self.device)?;
                    Linear::for_expert(w).map_err(|e| ModelError::Tensor { name: name.clone(), source: e })
                }
            }
        };
        let mlp = match kernel(extent.encodings[0]) {
            // gate and up are adjacent in the slot: one [2I, H] matrix, as the resident path fuses them.
            Some(f) if extent.encodings[1] == extent.encodings[0] => Mlp::from_fused(on_kernel(f, 0, lens[0] + lens[1], 2 * i, h)?, part(2)?),
            _ => Mlp::new(part(0)?, part(1)?, part(2)?)?,
        };
        Ok(Expert::new(mlp, extent.bytes() as usize))
    }
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

impl ExpertProvider for StreamingExperts {
    fn expert(&self, layer: usize, expert: usize) -> strata_models::Result<Arc<Expert>> {
        let key = (layer, expert);
        let bytes = self.extent(layer, expert)?.bytes();
        self.counters.touched_bytes.fetch_add(bytes, Ordering::Relaxed);
        let mut counted_miss = false;
        loop {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.tick += 1;
            let tick = st.tick;
            let ticket = match st.map.get_mut(&key) {
                Some(Entry { state: State::Ready(x), usage }) => {
                    usage.touch(tick);
                    if !counted_miss {
                        self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(x.clone());
                }
                Some(Entry { state: State::Pending { ticket, .. }, .. }) => ticket.clone(),
                None => {
                    drop(st);
                    self.start_reads(&[key], true)?;
                    if !counted_miss {
                        self.counters.misses.fetch_add(1, Ordering::Relaxed);
                        counted_miss = true;
                    }
                    continue;
                }
            };
            drop(st);
            if !counted_miss {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                counted_miss = true;
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
            let Some(Entry { state: State::Pending { slot, .. }, mut usage }) = st.map.remove(&key) else { unreachable!("checked above") };
            result.map_err(|message| ModelError::ExpertRead { layer, expert, message })?;
            let x = Arc::new(self.build(layer, expert, slot)?);
            usage.touch(tick);
            st.map.insert(key, Entry { state: State::Ready(x.clone()), usage });
            return Ok(x);
        }
    }

    fn will_need(&self, layer: usize, experts: &[u32]) {
        let mut keys: Vec<(usize, usize)> = experts.iter().map(|&e| (layer, e as usize)).collect();
        keys.sort_unstable();
        keys.dedup();
        self.state.lock().unwrap_or_else(|e| e.into_inner()).protected = keys.iter().copied().collect();
        // Errors surface from `expert()`, which retries the read.
        if let Err(e) = self.start_reads(&keys, false) {
            tracing::debug!("prefetch failed: {e}");
        }
    }

    fn memory_bytes(&self) -> u64 {
        self.cache_bytes()
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
    fn buffered_plan_coalesces_adjacent_ranges() {
        let p = ReadPlan::new(&extent([(0, 100, 10), (0, 110, 10), (0, 500, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 20, 20, 0), (0, 500, 7, 7, 20)]);
        assert!(p.moves.is_empty());
        assert_eq!(p.span, 27);
        let p = ReadPlan::new(&extent([(0, 100, 10), (1, 110, 10), (1, 120, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 10, 10, 0), (1, 110, 17, 17, 10)]);
    }

    #[test]
    fn direct_plan_reads_aligned_supersets_and_compacts() {
        let p = ReadPlan::new(&extent([(0, 5000, 3000), (0, 20000, 100), (0, 8192, 4096)]), true);
        assert_eq!(p.jobs, vec![(0, 4096, 4096, 3904, 0), (0, 16384, 4096, 3716, 4096), (0, 8192, 4096, 4096, 8192)]);
        assert_eq!(p.moves, vec![(904, 0, 3000), (4096 + 3616, 3000, 100), (8192, 3100, 4096)]);
        for (off, len, _, _, at) in p.jobs.iter().map(|j| (j.1, j.2, j.3, j.0, j.4)) {
            assert_eq!((off % 4096, len % 4096, at % 4096), (0, 0, 0));
        }
    }
}
