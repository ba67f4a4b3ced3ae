//! The host cache's entries and reads: eviction, queuing reads on the I/O engine, waiting for
//! them, hit/miss accounting.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use strata_models::{Expert, ModelError};

use super::build::ExpertBytes;
use super::read_plan::{pieces, ReadPlan};
use super::{StreamingExperts, SLOT_RETRY, SLOT_WAIT};
use crate::cache::ExpertCache;
use crate::io::{Priority, ReadJob, Ticket};
use crate::prefetch_gate::PrefetchGate;
use crate::slab::Slot;

pub(super) enum State {
    /// Reads in flight into `slot`.
    Pending { slot: Slot, ticket: Arc<Ticket> },
    /// The expert's bytes in place in `slot`; `expert` is built on first use through
    /// [`ExpertProvider::expert`] (a GPU tier reading the bytes never builds it on the host).
    Ready { slot: Arc<Slot>, expert: Option<Arc<Expert>> },
}

pub(super) struct Entry {
    pub(super) state: State,
    /// Read by a prefetch and not asked for yet.
    pub(super) prefetched: bool,
    /// Read on demand (not in the cache when its layer routed) and not asked for yet: its first
    /// lookup is a miss even if the read has finished by then.
    pub(super) demand_read: bool,
}

impl Entry {
    /// Ready, or pending with every read finished (its slot can be dropped).
    pub(super) fn evictable(&self) -> bool {
        match &self.state {
            State::Ready { .. } => true,
            State::Pending { ticket, .. } => ticket.is_done(),
        }
    }
}

/// Why reads are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    /// `expert()`: wait for a slot if none is free.
    Wait,
    /// `fetch_routed`: skip what there is no room for (`expert()` retries).
    Skip,
    /// A prediction for `layer`: only free room or unneeded experts of other layers.
    Prefetch { layer: usize },
}

pub(super) struct CacheState {
    /// The cached experts, their use history and the experts each pass needs.
    pub(super) map: ExpertCache<Entry>,
    /// Per layer: the predicted experts the cache lacked at the last prediction (read or not).
    pub(super) candidates: HashMap<usize, Vec<usize>>,
    pub(super) gate: PrefetchGate,
}

impl StreamingExperts {
    /// Evicts one expert by the policy: unprotected evictable entries first, then protected ones.
    /// A prefetch for `layer` evicts neither protected experts nor `layer`'s nor `keep`. Returns
    /// false when nothing can be evicted.
    fn evict_one(&self, st: &mut CacheState, need: Need, keep: &[(usize, usize)]) -> bool {
        let prefetch_layer = match need {
            Need::Prefetch { layer } => Some(layer),
            _ => None,
        };
        let found = st.map.victim(
            |k, e| e.evictable() && prefetch_layer.is_none_or(|l| k.0 != l && !keep.contains(k)),
            prefetch_layer.is_none(),
        );
        match found {
            Some(k) => {
                st.map.remove(&k);
                true
            }
            None => false,
        }
    }

    /// A free slot for a read that `expert()` waits on, with the state locked again. Slots come
    /// back when a pass drops an evicted expert it still held, or when an entry is evicted; the
    /// entries filling the slab may all have been reads in flight when the caller looked, so every
    /// [`SLOT_RETRY`] without a slot one evictable entry (its reads finished meanwhile) goes, by
    /// the policy. Errors when none comes within [`SLOT_WAIT`].
    fn wait_for_slot(
        &self,
        layer: usize,
        expert: usize,
    ) -> Result<(Slot, MutexGuard<'_, CacheState>), ModelError> {
        let deadline = Instant::now() + SLOT_WAIT;
        loop {
            if let Some(s) = self.slab.acquire_timeout(SLOT_RETRY) {
                return Ok((s, self.state.lock().unwrap_or_else(|e| e.into_inner())));
            }
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if self.evict_one(&mut st, Need::Wait, &[]) {
                if let Some(s) = self.slab.try_acquire() {
                    return Ok((s, st));
                }
            }
            if Instant::now() >= deadline {
                return Err(ModelError::ExpertRead {
                    layer,
                    expert,
                    message: format!(
                        "expert cache exhausted: all {} slots held for {SLOT_WAIT:?}",
                        self.slab.slots()
                    ),
                });
            }
        }
    }

    /// Makes room and queues the reads of `keys` not yet cached or pending (see [`Need`]).
    pub(super) fn start_reads(
        &self,
        keys: &[(usize, usize)],
        need: Need,
    ) -> Result<(), ModelError> {
        let mut jobs = Vec::new();
        let mut files_checked = false;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &(layer, expert) in keys {
            if st.map.contains(&(layer, expert)) {
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
            while st.map.is_full() {
                if !self.evict_one(&mut st, need, keys) {
                    break;
                }
            }
            let prefetch = matches!(need, Need::Prefetch { .. });
            if prefetch && st.map.is_full() {
                return Ok(()); // no room a prediction may take
            }
            let slot = match self.slab.try_acquire() {
                Some(s) => s,
                None if need == Need::Wait => {
                    drop(st);
                    let s;
                    (s, st) = self.wait_for_slot(layer, expert)?;
                    if st.map.contains(&(layer, expert)) {
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
                    prefetched: prefetch,
                    demand_read: !prefetch,
                },
            );
        }
        Ok(())
    }

    /// Expert `expert` of `layer` from the cache, waiting for its read (and starting it when no
    /// `fetch_routed` did): its placed slot, and the expert built on it when `build`.
    pub(super) fn fetch(
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
            let tick = st.map.next_tick();
            // Only a ready expert's lookup is a use now; a pending one's is recorded when ready.
            let ready = matches!(st.map.get(&key), Some(Entry { state: State::Ready { .. }, .. }));
            let entry = if ready { st.map.touch_at(&key, tick) } else { st.map.get_mut(&key) };
            let ticket = match entry {
                Some(Entry {
                    state: State::Ready { slot, expert: x },
                    prefetched,
                    demand_read,
                }) => {
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
            let Some((Entry { state: State::Pending { slot, .. }, prefetched, .. }, mut usage)) =
                st.map.take(&key)
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
            st.map.put_back(
                key,
                Entry {
                    state: State::Ready { slot: slot.clone(), expert: x.clone() },
                    prefetched: false,
                    demand_read: false,
                },
                usage,
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
        let (entry, usage) = st.map.take(&(layer, expert))?;
        let placed = match entry {
            Entry { state: State::Pending { slot, ticket }, prefetched, demand_read }
                if ticket.is_done() && ticket.wait().is_ok() =>
            {
                let slot = self.place(layer, expert, slot).ok()?;
                Entry { state: State::Ready { slot, expert: None }, prefetched, demand_read }
            }
            other => other,
        };
        let slot = match &placed.state {
            State::Ready { slot, .. } => Some(slot.clone()),
            State::Pending { .. } => None,
        };
        st.map.put_back((layer, expert), placed, usage);
        drop(st);
        self.layout_of(layer, expert, &slot?).ok()
    }
}
