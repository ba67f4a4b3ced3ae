//! Mapped experts: the GPU expert tier without a host round trip per layer.
//!
//! When the host tier holds every expert (`--expert-cache` at 100%) in page-locked memory and VRAM
//! holds them as a pool, the tier keeps a table on the device, per MoE layer `3 × E` addresses
//! ([`strata_kernels::ExpertTable`]): each expert's gate, up and down matrices in their VRAM slot
//! when cached, else in the page-locked host slab, which is mapped into the device's address
//! space (`cuMemHostRegister` with `DEVICEMAP`). The fused MoE kernels read each routed expert
//! where its entry points (`indirect`), so a layer routes on the device and runs at once: no
//! lookup, no copy and no synchronisation inside a pass, and decode steps take the CUDA graph
//! path. A miss costs its bytes over the bus, read by the kernel itself.
//!
//! The host learns the routing once per pass (the routing record the pass reads back anyway,
//! [`strata_models::ExpertProvider::observe_routing`]): it counts VRAM hits and misses, updates
//! the eviction policy's history and promotes up to a limit of the missed experts into VRAM
//! slots for the next passes, asynchronously. The host keeps a mirror of the table and copies
//! it to the device, whole, on the compute stream whenever it changed (one copy per pass at
//! most; the stream is idle then, since the pass's routing record was just read):
//!
//! 1. experts whose copies have completed point at their slots from now on;
//! 2. evicted experts point back at their host bytes (kernels queued before still read the slot,
//!    kernels after read the host);
//! 3. after that table copy and every kernel queued so far (an event), the copy stream copies
//!    the newly promoted experts into their slots and records the event they complete with;
//!    they are published at a later pass's step 1, once it has completed.
//!
//! A slot is thus never rewritten while an entry points at it, and an entry never points at a
//! slot whose copy has not completed. An expert is evicted only after its copy completed. The
//! pool starts filled (the first experts of every layer in turn), the host slab with every expert
//! (read from the drive at open, with the reads of a layer in flight together).
//!
//! The same idea as UVA zero-copy reads of host memory by kernels (CUDA C programming guide,
//! "Mapped memory"); the policy side is this crate's expert cache.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaEvent};
use strata_models::moe::LayerRouting;
use strata_models::{ExpertProvider, ModelError};

use super::{assert_pool_rows, pool_row, GpuExperts, TierEntry, TierState, Vram};
use crate::cache::Key;
use crate::provider::{ExpertBytes, StreamingExperts};

/// Experts promoted into VRAM after one pass at most, by default per MoE layer (`top_k / 2`; the
/// `STRATA_GPU_TIER_PROMOTE` override gives the total per pass).
const PROMOTE_PER_LAYER_DEN: usize = 2;

/// The device table and every expert's host bytes. See the module docs.
pub(super) struct Mapped {
    /// Device address of the table: `[layers][3][experts]` u64 (dense layers' rows unused).
    table: sys::CUdeviceptr,
    experts: usize,
    /// Every expert's bytes in the host slab, `[layers][experts]` (dense layers empty), held for
    /// the tier's life.
    bytes: Vec<Vec<ExpertBytes>>,
    /// Device address of the host slab's first byte, and its host address.
    slab_device: u64,
    slab_host: usize,
    /// Experts promoted after one pass at most.
    promote_limit: usize,
    state: Mutex<MirrorState>,
}

/// The host's side of the table (locked after the tier's state).
struct MirrorState {
    /// What the device table holds, or will hold after the next upload.
    mirror: Vec<u64>,
    /// Promoted experts whose entries still point at the host: their slots and copy events.
    pending: HashMap<Key, (usize, Arc<CudaEvent>)>,
}

impl Mapped {
    /// Reads every expert into the host tier (each MoE layer's reads in flight together) and
    /// builds the table with every entry at the host bytes. `slab`: the host slab's `(host
    /// address, device address)` as registered.
    ///
    /// Errors: a read failed, a CUDA driver error.
    pub(super) fn open(
        host: &StreamingExperts,
        layers: usize,
        moe_layers: &[usize],
        top_k: usize,
        slab: (usize, u64),
    ) -> Result<Self, ModelError> {
        let err = |message: String| ModelError::ExpertRead { layer: 0, expert: 0, message };
        let experts = host.dims().num_experts;
        let t0 = Instant::now();
        let mut bytes: Vec<Vec<ExpertBytes>> = (0..layers).map(|_| Vec::new()).collect();
        let all: Vec<u32> = (0..experts as u32).collect();
        for &layer in moe_layers {
            host.fetch_routed(layer, &all);
            bytes[layer] =
                (0..experts).map(|e| host.expert_bytes(layer, e)).collect::<Result<_, _>>()?;
        }
        let total: usize = bytes.iter().flatten().map(|b| b.bytes).sum();
        tracing::info!(
            "GPU expert tier: every expert ({} MB) read into page-locked host memory in {:.1} s",
            total / 1_000_000,
            t0.elapsed().as_secs_f64()
        );
        let len = layers * 3 * experts;
        // SAFETY: a plain allocation, freed in Drop.
        let table = unsafe { result::malloc_sync(len * 8) }
            .map_err(|e| err(format!("cuda: expert table: {e}")))?;
        let promote_limit = std::env::var("STRATA_GPU_TIER_PROMOTE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or((top_k / PROMOTE_PER_LAYER_DEN).max(1) * moe_layers.len());
        let mut m = Self {
            table,
            experts,
            bytes,
            slab_device: slab.1,
            slab_host: slab.0,
            promote_limit,
            state: Mutex::new(MirrorState { mirror: Vec::new(), pending: HashMap::new() }),
        };
        let mut mirror = vec![0u64; len];
        for &layer in moe_layers {
            for e in 0..experts {
                for (k, a) in m.host_addrs((layer, e)).into_iter().enumerate() {
                    mirror[m.index(layer, k, e)] = a;
                }
            }
        }
        // SAFETY: `table` holds `len` u64.
        unsafe { result::memcpy_htod_sync(m.table, &mirror) }
            .map_err(|e| err(format!("cuda: expert table: {e}")))?;
        m.state.get_mut().unwrap_or_else(|e| e.into_inner()).mirror = mirror;
        Ok(m)
    }

    fn index(&self, layer: usize, k: usize, e: usize) -> usize {
        (layer * 3 + k) * self.experts + e
    }

    /// Layer `layer`'s table for the kernels.
    pub(super) fn table(&self, layer: usize) -> strata_kernels::ExpertTable {
        strata_kernels::ExpertTable {
            addr: self.table + (self.index(layer, 0, 0) * 8) as u64,
            experts: self.experts,
        }
    }

    pub(super) fn bytes(&self, key: Key) -> &ExpertBytes {
        &self.bytes[key.0][key.1]
    }

    /// Device addresses of `key`'s three matrices in the mapped host slab.
    fn host_addrs(&self, key: Key) -> [u64; 3] {
        let b = self.bytes(key);
        let slot = b.slot.as_mut_ptr() as usize - self.slab_host;
        [0, 1, 2].map(|k| self.slab_device + (slot + b.ranges[k].start) as u64)
    }

    /// Points `key`'s three entries of `mirror` at `addrs`.
    fn set(&self, mirror: &mut [u64], key: Key, addrs: [u64; 3]) {
        for (k, a) in addrs.into_iter().enumerate() {
            mirror[self.index(key.0, k, key.1)] = a;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MirrorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: allocated in `open`; the owner synchronised the copy stream, and candle's stream
        // is idle when the model is dropped.
        unsafe {
            let _ = result::free_sync(self.table);
        }
    }
}

impl GpuExperts {
    fn mapped_state(&self) -> Option<(&Mapped, [sys::CUdeviceptr; 3], [usize; 3])> {
        match (&self.mapped, &self.vram) {
            (Some(m), Vram::Pool { base, row_bytes, .. }) => Some((m, *base, *row_bytes)),
            _ => None,
        }
    }

    /// Fills the empty pool with the first experts of every layer in turn (`moe_layers`).
    pub(super) fn fill_mapped(&self, moe_layers: &[usize]) -> Result<(), ModelError> {
        let Some((m, _, _)) = self.mapped_state() else { return Ok(()) };
        let mut keys = Vec::with_capacity(self.capacity);
        'fill: for e in 0..m.experts {
            for &l in moe_layers {
                if keys.len() == self.capacity {
                    break 'fill;
                }
                keys.push((l, e));
            }
        }
        let mut st = self.lock();
        self.promote(&mut st, &keys, &HashSet::new())?;
        self.copy.synchronize().map_err(|e| super::cuda_err(0, 0)(e.to_string()))?;
        // Published (step 1) at once, so that the first pass reads them from VRAM.
        self.promote(&mut st, &[], &HashSet::new())?;
        Ok(())
    }

    /// Publishes completed copies, then copies `keys` (those not cached) into VRAM slots,
    /// evicting by the policy (never `keep`, never an entry whose copy is still in flight); stops
    /// early when nothing may go. See the module docs for the order of the steps. Returns the
    /// experts promoted.
    fn promote(
        &self,
        st: &mut TierState,
        keys: &[Key],
        keep: &HashSet<Key>,
    ) -> Result<usize, ModelError> {
        let Some((m, base, row_bytes)) = self.mapped_state() else { return Ok(0) };
        let cerr = |key: Key| {
            move |e: String| ModelError::ExpertRead {
                layer: key.0,
                expert: key.1,
                message: format!("cuda: {e}"),
            }
        };
        let compute = self.dev.cuda_stream();
        let mut guard = m.lock();
        let ms = &mut *guard;
        // 1. Completed copies are published.
        let done: Vec<(Key, usize)> = ms
            .pending
            .iter()
            .filter(|(_, (_, ev))| ev.is_complete())
            .map(|(k, (slot, _))| (*k, *slot))
            .collect();
        let mut dirty = !done.is_empty();
        for (key, slot) in done {
            ms.pending.remove(&key);
            m.set(&mut ms.mirror, key, pool_row(&base, &row_bytes, slot));
        }
        // 2. Room: evicted experts point at the host again (the victims chosen in one pass over
        //    the cache, as one by one).
        let keys: Vec<Key> = keys.iter().copied().filter(|k| !st.map.contains(k)).collect();
        let evict = keys.len().saturating_sub(st.free.len());
        let victims = st.map.victims(evict, |k, e: &TierEntry| {
            !keep.contains(k) && e.copied.as_ref().is_none_or(|ev| ev.is_complete())
        });
        for v in victims {
            let gone = st.map.remove(&v).expect("victim is in the map");
            ms.pending.remove(&v); // (complete and published above, or never: not pending)
            m.set(&mut ms.mirror, v, m.host_addrs(v));
            st.free.push(gone.slot);
            dirty = true;
        }
        if dirty {
            // A pageable source: staged before the call returns, so the mirror may change after.
            // SAFETY: the table holds the mirror's length.
            unsafe { result::memcpy_htod_async(m.table, &ms.mirror, compute.cu_stream()) }
                .map_err(|e| cerr((0, 0))(e.to_string()))?;
        }
        let mut placed: Vec<(Key, usize)> = Vec::with_capacity(keys.len());
        for &key in &keys {
            let Some(slot) = st.free.pop() else { break };
            placed.push((key, slot));
        }
        if placed.is_empty() {
            return Ok(0);
        }
        // 3. The copies, on the copy stream after that table copy and after every kernel queued
        //    so far (which may still read a slot about to be rewritten).
        let first = placed[0].0;
        self.copy_after_compute(first.0, first.1)?;
        for &(key, slot) in &placed {
            let b = m.bytes(key);
            assert_pool_rows(key, b, &row_bytes);
            // (the source is held for the tier's life)
            self.queue_copies(key.0, key.1, b, pool_row(&base, &row_bytes, slot))?;
        }
        let copied: Arc<CudaEvent> =
            Arc::new(self.copy.record_event(None).map_err(|e| cerr(first)(e.to_string()))?);
        for &(key, slot) in &placed {
            let entry = TierEntry {
                expert: None,
                slot,
                copied: Some(copied.clone()),
                prefetched: false,
                fresh: false,
                bytes: m.bytes(key).bytes,
            };
            st.map.insert(key, entry);
            st.map.touch(&key);
            ms.pending.insert(key, (slot, copied.clone()));
        }
        Ok(placed.len())
    }

    /// [`strata_models::ExpertProvider::observe_routing`] for mapped experts: counts each layer's
    /// distinct experts as VRAM hits (cached, copy complete) or misses (read over the bus), then
    /// promotes misses up to the limit.
    pub(super) fn observe_mapped(&self, routing: &[LayerRouting]) {
        let Some((m, _, _)) = self.mapped_state() else { return };
        let mut st = self.lock();
        let mut seen: HashSet<Key> = HashSet::new();
        let mut missed = Vec::new();
        let ms = m.lock();
        for r in routing {
            for &e in &r.expert_ids {
                let key = (r.layer, e as usize);
                if !seen.insert(key) {
                    continue;
                }
                let bytes = m.bytes(key).bytes as u64;
                self.counters.touched_bytes.fetch_add(bytes, Ordering::Relaxed);
                // A hit: the pass read it from VRAM (cached and published).
                let hit = match st.map.touch(&key) {
                    Some(_) => !ms.pending.contains_key(&key),
                    None => {
                        missed.push(key);
                        false
                    }
                };
                let counter = if hit { &self.counters.hits } else { &self.counters.misses };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(ms);
        missed.truncate(m.promote_limit);
        if let Err(e) = self.promote(&mut st, &missed, &seen) {
            tracing::warn!("GPU expert tier: promotion stopped: {e}");
        }
    }
}
