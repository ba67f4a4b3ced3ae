//! The GPU expert tier (`--device cuda` with `--stream-experts`): a VRAM expert cache with its own
//! budget (`--gpu-expert-cache`) above the host expert cache ([`StreamingExperts`], itself fed by
//! the drive). Three tiers: VRAM ← page-locked host RAM ← SSD.
//!
//! - The host cache's slab is page-locked (`cuMemHostRegister`), so host-to-device copies are DMA
//!   at the bus's speed (pinned 52.5 GB/s vs pageable 15.2 GB/s measured on the H100,
//!   docs/performance.md "CUDA"); when the driver refuses, copies stay correct at pageable speed.
//! - Copies run on a stream of their own. A miss allocates the expert's device tensors on the
//!   compute stream, the copy stream waits for that allocation (an event), copies, and records a
//!   "copied" event; the compute stream waits for it (`cuStreamWaitEvent`, no host
//!   synchronisation) before the expert's kernels. The host slot stays held until its copy's event
//!   completes. candle runs on one stream, so cudarc's per-slice event tracking is turned off.
//! - `fetch_routed(layer, ids)` starts the host reads of the experts VRAM lacks and, for those the
//!   host already holds, queues their copies at once: copies of a layer's misses overlap its
//!   first experts' compute.
//! - `prefetch(layer, ids)` (the streaming issue's predictor) also starts host reads, and copies
//!   predictions the host holds into VRAM while the current layer computes — taking only room
//!   that neither the current routing nor the predicted layer uses, and only while the predictor's
//!   measured precision on experts VRAM lacked is above the gate
//!   ([`crate::prefetch_gate`], the same `--prefetch-min-precision`).
//!
//! VRAM storage: when every expert is in a format candle's fused MoE kernels take (Q4_K; see
//! [`FusedExperts::supports`]), the VRAM cache is a pool: one 3-D tensor per projection whose rows
//! are cache slots, and a layer's routed experts run in one launch per projection with their
//! expert ids mapped to slot rows ([`ExpertProvider::fused`]). A reused slot is written only after
//! the compute stream's work queued so far (an event), so kernels still reading its previous
//! expert finish first. Other formats (and `STRATA_FUSED_MOE=0`) get device tensors per expert
//! (one launch per expert and projection); float (HF) experts are copied synchronously through
//! candle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaEvent, CudaStream};
use candle_core::cuda_backend::CudaDevice;
use candle_core::quantized::{cuda::QCudaStorage, GgmlDType, QStorage, QTensor};
use candle_core::Device;
use strata_formats::{ExpertEncoding, ModelConfig, ModelFiles};
use strata_models::{Expert, FusedExperts, ModelError};

mod copy;
mod mapped;
mod provider;

use crate::cache::{ExpertCache, Key};
use crate::prefetch_gate::PrefetchGate;
use crate::provider::{ExpertBytes, StreamOptions, StreamingExperts};
use crate::slab::Slot;
use strata_plan::budget::{cache_entries, cache_room, VRAM_RESERVE};

/// Device memory one expert may take beyond its stored bytes in per-expert storage: candle pads
/// each quantized tensor's rows (`MATRIX_ROW_PADDING`), and the pool rounds allocations.
const PER_EXPERT_SLACK: u64 = 3 * 64 * 1024;

/// What a lookup gives a launch: the expert's device tensors (per-expert storage), its pool row,
/// and the event its copy completes with (`None`: already complete or synchronous).
type Lookup = (Option<Arc<Expert>>, usize, Option<Arc<CudaEvent>>);

/// How VRAM holds the cached experts.
// One value per tier: the pool's size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Vram {
    /// Device tensors per expert, allocated at each copy and freed at eviction.
    PerExpert,
    /// One 3-D tensor per projection with a row per cache slot.
    Pool {
        fused: FusedExperts,
        /// Device address of each projection's row 0, and bytes per row.
        base: [sys::CUdeviceptr; 3],
        row_bytes: [usize; 3],
    },
}

/// Device addresses of pool row `slot` of each projection (`base`: row 0's, `row_bytes` apart).
fn pool_row(
    base: &[sys::CUdeviceptr; 3],
    row_bytes: &[usize; 3],
    slot: usize,
) -> [sys::CUdeviceptr; 3] {
    [0, 1, 2].map(|k| base[k] + (slot * row_bytes[k]) as sys::CUdeviceptr)
}

/// Panics unless expert `key`'s stored parts `b` have the pool's row sizes.
fn assert_pool_rows(key: Key, b: &ExpertBytes, row_bytes: &[usize; 3]) {
    for (k, (range, &row)) in b.ranges.iter().zip(row_bytes).enumerate() {
        assert_eq!(
            range.len(),
            row,
            "expert {key:?} part {k}: stored size differs from the pool's rows"
        );
    }
}

struct TierEntry {
    /// Per-expert storage: the expert's device tensors.
    expert: Option<Arc<Expert>>,
    /// Pool storage: the row holding it.
    slot: usize,
    /// Recorded on the copy stream after the expert's copies (`None`: copied synchronously).
    copied: Option<Arc<CudaEvent>>,
    /// Copied by a prefetch and not asked for yet.
    prefetched: bool,
    /// Copied by `fetch_routed` ahead of its first use, which counts as the miss.
    fresh: bool,
    bytes: usize,
}

/// Why an expert was copied to VRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A lookup missed (counted there).
    Demand,
    /// `fetch_routed`: routed, copied ahead of its first use.
    Routed,
    /// A prediction.
    Prefetch,
}

struct TierState {
    /// The cached experts, their use history and the experts each pass needs.
    map: ExpertCache<TierEntry>,
    /// Pool rows not holding an expert.
    free: Vec<usize>,
    /// Per layer: predicted experts VRAM lacked at the last prediction (copied or not).
    candidates: HashMap<usize, Vec<usize>>,
    gate: PrefetchGate,
    /// Host slots whose copies may still be in flight, released once their event completes.
    inflight: Vec<(Arc<CudaEvent>, Arc<Slot>)>,
}

#[derive(Default)]
struct TierCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    stall_ns: AtomicU64,
    touched_bytes: AtomicU64,
    uploads: AtomicU64,
    upload_bytes: AtomicU64,
    prefetch_uploads: AtomicU64,
    prefetch_used: AtomicU64,
    prefetch_candidates: AtomicU64,
    prefetch_candidates_used: AtomicU64,
}

/// Routed experts in a VRAM cache above a host expert cache. See the module docs.
pub struct GpuExperts {
    host: StreamingExperts,
    dev: CudaDevice,
    device: Device,
    copy: Arc<CudaStream>,
    vram: Vram,
    /// The host slab, when page-locked: `(address, bytes)`, unregistered on drop.
    pinned: Option<(usize, usize)>,
    /// Experts VRAM holds at most.
    capacity: usize,
    /// Device memory one expert costs at most, bytes.
    entry_bytes: u64,
    prefetch_limit: usize,
    /// Experts addressed through a device table (host tier complete and pooled VRAM; see
    /// `mapped`): `None` routes on the host and copies misses before each launch.
    mapped: Option<mapped::Mapped>,
    state: Mutex<TierState>,
    counters: TierCounters,
}

impl std::fmt::Debug for GpuExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuExperts({} experts in VRAM at most, pooled: {}, pinned host: {}, mapped: {}, host: {:?})",
            self.capacity,
            self.pooled(),
            self.pinned.is_some(),
            self.mapped.is_some(),
            self.host
        )
    }
}

fn cuda_err(layer: usize, expert: usize) -> impl Fn(String) -> ModelError {
    move |e| ModelError::ExpertRead { layer, expert, message: format!("cuda: {e}") }
}

impl GpuExperts {
    /// Opens the host tier ([`StreamingExperts::open`] with `opts`, on the CPU), page-locks its slab
    /// and sizes the VRAM tier from `opts.gpu_expert_cache` (`auto`: free VRAM minus the dense
    /// weights and a 2 GiB reserve); a pool is allocated at once.
    ///
    /// Errors: `device` is not a CUDA device, the host tier's errors, a CUDA driver error (the
    /// pool does not fit in VRAM).
    pub fn open(
        files: &ModelFiles,
        cfg: &ModelConfig,
        device: &Device,
        opts: &StreamOptions,
    ) -> Result<Self, ModelError> {
        let err = |message: String| ModelError::ExpertRead { layer: 0, expert: 0, message };
        let Device::Cuda(dev) = device else {
            return Err(err("the GPU expert tier needs a CUDA device".into()));
        };
        let moe =
            cfg.moe.as_ref().ok_or_else(|| err("--stream-experts needs an MoE model".into()))?;
        let host = StreamingExperts::open(files, cfg, &Device::Cpu, opts)?;
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| err(format!("cuda: {e}")))?;
        // SAFETY: candle issues all its work on one stream; the only other stream is ours, and we
        // order it against candle's with events ourselves (see the module docs).
        unsafe { dev.disable_event_tracking() };
        let copy = ctx
            .new_stream()
            .map_err(|e| err(format!("cuda: cannot create the copy stream: {e}")))?;

        let experts =
            (0..cfg.num_layers).filter(|&l| cfg.is_moe_layer(l)).count() * moe.num_experts;
        let total = host.expert_bytes_total();
        let pool_dtypes = match host.uniform_encodings() {
            Some(enc) if !std::env::var("STRATA_FUSED_MOE").is_ok_and(|v| v == "0") => {
                let d: Vec<GgmlDType> = enc
                    .iter()
                    .filter_map(|e| match e {
                        ExpertEncoding::Ggml(dt) if FusedExperts::supports(*dt) => Some(*dt),
                        _ => None,
                    })
                    .collect();
                (d.len() == 3).then(|| [d[0], d[1], d[2]])
            }
            _ => None,
        };
        let per_expert = total.div_ceil(experts.max(1) as u64);
        let entry_bytes =
            if pool_dtypes.is_some() { per_expert } else { per_expert + PER_EXPERT_SLACK };
        let dense = files.total_tensor_bytes().saturating_sub(total);
        let free = result::mem_get_info().map(|(free, _)| free as u64).unwrap_or(0);
        let capacity = cache_entries(
            opts.gpu_expert_cache,
            experts,
            moe.experts_per_token,
            entry_bytes,
            cache_room(free, dense, VRAM_RESERVE),
        );
        let vram = match pool_dtypes {
            Some(dtypes) => {
                let d = host.dims();
                let shapes = [
                    [d.intermediate, d.hidden],
                    [d.intermediate, d.hidden],
                    [d.hidden, d.intermediate],
                ];
                let tensor = |e: candle_core::Error| {
                    err(format!("VRAM expert pool of {capacity} experts: {e}"))
                };
                let mut t = Vec::with_capacity(3);
                let (mut base, mut row_bytes) = ([0; 3], [0; 3]);
                for k in 0..3 {
                    let [rows, cols] = shapes[k];
                    let storage = QCudaStorage::zeros(dev, capacity * rows * cols, dtypes[k])
                        .map_err(tensor)?;
                    let q = QTensor::new(QStorage::Cuda(storage), (capacity, rows, cols))
                        .map_err(tensor)?;
                    base[k] = q.device_ptr().map_err(tensor)? as sys::CUdeviceptr;
                    row_bytes[k] = rows * cols / dtypes[k].block_size() * dtypes[k].type_size();
                    t.push(q);
                }
                // The pool was zeroed on this thread's stream; forward passes may run on another.
                ctx.synchronize().map_err(|e| err(format!("cuda: {e}")))?;
                let mut t = t.into_iter();
                let fused =
                    FusedExperts::new(t.next().unwrap(), t.next().unwrap(), t.next().unwrap());
                Vram::Pool { fused, base, row_bytes }
            }
            None => Vram::PerExpert,
        };

        let (base, len) = host.slab_memory();
        // SAFETY: the slab's allocation is page-aligned, lives as long as `host` (unregistered in
        // our Drop before `host` is dropped) and is only read by the copies and, mapped, by
        // kernels.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(
                base as *mut std::ffi::c_void,
                len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        };
        let pinned = if rc == sys::CUresult::CUDA_SUCCESS {
            Some((base as usize, len))
        } else {
            tracing::warn!("cannot page-lock the host expert cache ({len} bytes): {rc:?}; copies to the GPU run at pageable speed");
            None
        };
        let moe_layers: Vec<usize> = (0..cfg.num_layers).filter(|&l| cfg.is_moe_layer(l)).collect();
        let mapped = match (&vram, pinned) {
            (Vram::Pool { .. }, Some(_))
                if host.capacity() >= experts
                    && !std::env::var("STRATA_GPU_TIER_MAPPED").is_ok_and(|v| v == "0") =>
            {
                let mut dbase: sys::CUdeviceptr = 0;
                // SAFETY: `base` was registered above with DEVICEMAP.
                let rc = unsafe {
                    sys::cuMemHostGetDevicePointer_v2(&mut dbase, base as *mut std::ffi::c_void, 0)
                };
                if rc != sys::CUresult::CUDA_SUCCESS {
                    return Err(err(format!("cuda: device address of the host experts: {rc:?}")));
                }
                let slab = (base as usize, dbase);
                let top_k = moe.experts_per_token;
                Some(mapped::Mapped::open(&host, cfg.num_layers, &moe_layers, top_k, slab)?)
            }
            _ => None,
        };
        let prefetch_limit = match mapped {
            Some(_) => 0,
            None => crate::provider::prefetch_limit(capacity, moe.experts_per_token),
        };
        let tier = Self {
            host,
            dev: dev.clone(),
            device: device.clone(),
            copy,
            vram,
            pinned,
            capacity,
            entry_bytes,
            prefetch_limit,
            mapped,
            state: Mutex::new(TierState {
                map: ExpertCache::new(capacity, opts.policy),
                free: (0..capacity).rev().collect(),
                candidates: HashMap::new(),
                gate: PrefetchGate::new(opts.prefetch_min_precision),
                inflight: Vec::new(),
            }),
            counters: TierCounters::default(),
        };
        tier.fill_mapped(&moe_layers)?;
        Ok(tier)
    }

    /// Whether experts are mapped: addressed through a device table, VRAM slots or page-locked
    /// host memory read by the kernels (see `mapped`).
    pub fn mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// Experts VRAM holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Device memory the VRAM tier may use, bytes.
    pub fn vram_bytes(&self) -> u64 {
        self.capacity as u64 * self.entry_bytes
    }

    /// Whether the host cache is page-locked.
    pub fn pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// Whether VRAM holds the experts as a pool run in one launch per projection.
    pub fn pooled(&self) -> bool {
        matches!(self.vram, Vram::Pool { .. })
    }

    /// The host tier (its own hit rate and drive reads).
    pub fn host(&self) -> &StreamingExperts {
        &self.host
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TierState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Evicts by the policy (`--expert-cache-policy`, as the host cache) until one more fits:
    /// never `keep`, never protected ones for a prefetch (`prefetch_layer`: nor that layer's).
    /// Returns false when nothing may go.
    fn make_room(&self, st: &mut TierState, keep: &[Key], prefetch_layer: Option<usize>) -> bool {
        while st.map.is_full() {
            let found = st.map.victim(
                |k, _| !keep.contains(k) && prefetch_layer.is_none_or(|l| k.0 != l),
                prefetch_layer.is_none(),
            );
            let Some(k) = found else { return false };
            let gone = st.map.remove(&k).expect("victim is in the map");
            match self.vram {
                // The row is rewritten only after the compute stream's queued work (`copy_parts`).
                Vram::Pool { .. } => st.free.push(gone.slot),
                // Its memory is freed on the compute stream: order that after its copy.
                Vram::PerExpert => {
                    if let Err(e) = self.wait_copied(&gone.copied) {
                        tracing::warn!("evicting {k:?}: {e}");
                    }
                }
            }
        }
        true
    }

    /// Makes `key` resident in VRAM from its host bytes `b` (state locked), evicting for it (not
    /// `keep`). Returns false when a prefetch finds no room it may take.
    fn fill(
        &self,
        st: &mut TierState,
        key: Key,
        b: &ExpertBytes,
        origin: Origin,
        keep: &[Key],
    ) -> Result<bool, ModelError> {
        if st.map.contains(&key) {
            return Ok(true); // another caller copied it meanwhile
        }
        let prefetch_layer = (origin == Origin::Prefetch).then_some(key.0);
        if !self.make_room(st, keep, prefetch_layer) {
            return Ok(false);
        }
        let (expert, slot, copied) = match &self.vram {
            Vram::PerExpert => {
                let (x, ev) = self.upload_tensors(st, key.0, key.1, b)?;
                (Some(x), 0, ev)
            }
            Vram::Pool { base, row_bytes, .. } => {
                assert_pool_rows(key, b, row_bytes);
                let slot = st.free.pop().expect("make_room leaves a free row");
                let dst = pool_row(base, row_bytes, slot);
                match self.copy_parts(st, key.0, key.1, b, dst) {
                    Ok(ev) => (None, slot, Some(ev)),
                    Err(e) => {
                        st.free.push(slot);
                        return Err(e);
                    }
                }
            }
        };
        let entry = TierEntry {
            expert,
            slot,
            copied,
            prefetched: origin == Origin::Prefetch,
            fresh: origin == Origin::Routed,
            bytes: b.bytes,
        };
        st.map.insert(key, entry);
        st.map.touch(&key); // a copy counts as a use
        if origin == Origin::Prefetch {
            self.counters.prefetch_uploads.fetch_add(1, Ordering::Relaxed);
        }
        Ok(true)
    }

    /// A lookup of `key`: counts it and returns its entry's expert, row and copy event, making it
    /// resident first on a miss (reading the host tier, which may wait for the drive).
    fn lookup(&self, key: Key, keep: &[Key]) -> Result<Lookup, ModelError> {
        fn found(st: &mut TierState, key: Key) -> Option<&mut TierEntry> {
            st.map.touch(&key)
        }
        {
            let mut st = self.lock();
            if let Some(e) = found(&mut st, key) {
                self.counters.touched_bytes.fetch_add(e.bytes as u64, Ordering::Relaxed);
                let counter = if std::mem::take(&mut e.fresh) {
                    &self.counters.misses
                } else {
                    &self.counters.hits
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if std::mem::take(&mut e.prefetched) {
                    self.counters.prefetch_used.fetch_add(1, Ordering::Relaxed);
                }
                return Ok((e.expert.clone(), e.slot, e.copied.clone()));
            }
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let b = self.host.expert_bytes(key.0, key.1)?;
        let mut st = self.lock();
        if !self.fill(&mut st, key, &b, Origin::Demand, keep)? {
            // Only when everything cached is in `keep`, which callers keep below the capacity.
            return Err(ModelError::ExpertRead {
                layer: key.0,
                expert: key.1,
                message: format!(
                    "VRAM expert cache full ({} experts) with experts this launch needs",
                    self.capacity
                ),
            });
        }
        self.counters.stall_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.counters.touched_bytes.fetch_add(b.bytes as u64, Ordering::Relaxed);
        let e = found(&mut st, key).expect("filled above");
        Ok((e.expert.clone(), e.slot, e.copied.clone()))
    }
}

impl Drop for GpuExperts {
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
        // Kernels may still read the mapped host memory or the table.
        let _ = self.dev.cuda_stream().synchronize();
        if let Some((base, _)) = self.pinned {
            // SAFETY: registered in `open`; no copy is in flight any more.
            unsafe { sys::cuMemHostUnregister(base as *mut std::ffi::c_void) };
        }
    }
}
