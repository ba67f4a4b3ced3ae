//! [`ExpertProvider`] for the VRAM tier: lookups, fused launches over the pool, routed and
//! predicted copies.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_models::{Expert, ExpertProvider, ExpertStats, FusedCall};

use super::{GpuExperts, Origin, Vram};
use crate::cache::Key;

impl ExpertProvider for GpuExperts {
    fn expert(&self, layer: usize, expert: usize) -> strata_models::Result<Arc<Expert>> {
        let key = (layer, expert);
        if self.pooled() {
            // MoE blocks take pooled experts through `fused`; anything else gets its own copy.
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            let b = self.host.expert_bytes(layer, expert)?;
            let (x, ev) = self.upload_tensors(&mut self.lock(), layer, expert, &b)?;
            self.wait_copied(&ev)?;
            return Ok(x);
        }
        let (x, _, ev) = self.lookup(key, &[key])?;
        self.wait_copied(&ev)?;
        Ok(x.expect("per-expert storage holds experts"))
    }

    fn fused(&self, layer: usize, ids: &[u32]) -> Option<strata_models::Result<FusedCall<'_>>> {
        let Vram::Pool { fused, .. } = &self.vram else { return None };
        if let Some(m) = &self.mapped {
            return Some(Ok(FusedCall { experts: fused, rows: None, table: Some(m.table(layer)) }));
        }
        let mut keys: Vec<Key> = ids.iter().map(|&e| (layer, e as usize)).collect();
        keys.sort_unstable();
        keys.dedup();
        if keys.len() > self.capacity {
            // A prefill chunk routing more experts than VRAM holds: one expert at a time through
            // `expert` (copies not cached), never evicting an expert this launch reads.
            return None;
        }
        let run = || -> strata_models::Result<FusedCall<'_>> {
            let mut row = HashMap::with_capacity(keys.len());
            for &key in &keys {
                let (_, slot, ev) = self.lookup(key, &keys)?;
                self.wait_copied(&ev)?;
                row.insert(key.1 as u32, slot as u32);
            }
            Ok(FusedCall {
                experts: fused,
                rows: Some(ids.iter().map(|e| row[e]).collect()),
                table: None,
            })
        };
        Some(run())
    }

    fn routes_on_device(&self) -> bool {
        self.mapped.is_some()
    }

    fn observe_routing(&self, routing: &[strata_models::moe::LayerRouting]) {
        self.observe_mapped(routing);
    }

    fn fetch_routed(&self, layer: usize, experts: &[u32]) {
        if self.mapped.is_some() {
            return; // every expert is addressable where it is
        }
        let mut keys: Vec<Key> = experts.iter().map(|&e| (layer, e as usize)).collect();
        keys.sort_unstable();
        keys.dedup();
        let missing: Vec<Key> = {
            let mut guard = self.lock();
            let st = &mut *guard;
            st.map.protect_for_current_thread(&keys);
            let (candidates, used) = st.gate.resolve(&mut st.candidates, layer, &keys);
            self.counters.prefetch_candidates.fetch_add(candidates, Ordering::Relaxed);
            self.counters.prefetch_candidates_used.fetch_add(used, Ordering::Relaxed);
            keys.iter().copied().filter(|k| !st.map.contains(k)).collect()
        };
        if missing.is_empty() {
            return;
        }
        let ids: Vec<u32> = missing.iter().map(|k| k.1 as u32).collect();
        self.host.fetch_routed(layer, &ids);
        // Copies of what the host already holds start now; the rest at the lookup.
        for &key in &missing {
            let Some(b) = self.host.ready_bytes(key.0, key.1) else { continue };
            if let Err(e) = self.fill(&mut self.lock(), key, &b, Origin::Routed, &keys) {
                tracing::debug!("copy of expert {key:?} not started: {e}");
            }
        }
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if self.mapped.is_some() {
            return;
        }
        self.host.prefetch(layer, experts);
        let missing: Vec<usize> = {
            let mut st = self.lock();
            let missing = st.map.missing(layer, experts, self.prefetch_limit);
            st.candidates.insert(layer, missing.clone());
            if !st.gate.open() {
                return; // measured in the shadow only
            }
            missing
        };
        let keep: Vec<Key> = missing.iter().map(|&e| (layer, e)).collect();
        for &key in &keep {
            let Some(b) = self.host.ready_bytes(key.0, key.1) else { continue };
            match self.fill(&mut self.lock(), key, &b, Origin::Prefetch, &keep) {
                Ok(true) => {}
                Ok(false) => return, // no room a prediction may take
                Err(e) => tracing::debug!("prefetch copy of expert {key:?} not started: {e}"),
            }
        }
    }

    fn prefetch_limit(&self) -> usize {
        self.prefetch_limit
    }

    fn memory_bytes(&self) -> u64 {
        self.host.cache_bytes()
    }

    fn device_cache_bytes(&self) -> u64 {
        self.vram_bytes()
    }

    fn direct_io(&self) -> Option<bool> {
        self.host.direct_io()
    }

    fn stats(&self) -> Option<ExpertStats> {
        let host = self.host.stats()?;
        let c = &self.counters;
        Some(ExpertStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            stall_ns: c.stall_ns.load(Ordering::Relaxed),
            touched_bytes: c.touched_bytes.load(Ordering::Relaxed),
            prefetch_reads: c.prefetch_uploads.load(Ordering::Relaxed),
            prefetch_used: c.prefetch_used.load(Ordering::Relaxed),
            prefetch_candidates: c.prefetch_candidates.load(Ordering::Relaxed),
            prefetch_candidates_used: c.prefetch_candidates_used.load(Ordering::Relaxed),
            uploads: c.uploads.load(Ordering::Relaxed),
            upload_bytes: c.upload_bytes.load(Ordering::Relaxed),
            ..host
        })
    }
}
