//! The expert cache's bookkeeping, one implementation for the host cache
//! ([`crate::StreamingExperts`]) and the VRAM tier (`gpu_tier`): entries keyed by
//! `(layer, expert)`, each entry's use history, the capacity in experts, the eviction policy
//! ([`EvictionPolicy`]) and the experts each thread's current pass needs ([`Protected`]), which
//! eviction spares while anything else can go. What an entry holds (a host slot and its reads, a
//! VRAM row or device tensors) is the tier's own `V`.

use std::collections::HashMap;

use crate::policy::{EvictionPolicy, Usage};
use crate::protect::Protected;

/// `(layer, expert)`.
pub type Key = (usize, usize);

struct Cached<V> {
    value: V,
    usage: Usage,
}

/// Cached experts of one tier.
pub struct ExpertCache<V> {
    entries: HashMap<Key, Cached<V>>,
    tick: u64,
    capacity: usize,
    policy: EvictionPolicy,
    protected: Protected<Key>,
}

impl<V> ExpertCache<V> {
    /// An empty cache of `capacity` experts evicting by `policy`.
    pub fn new(capacity: usize, policy: EvictionPolicy) -> Self {
        Self { entries: HashMap::new(), tick: 0, capacity, policy, protected: Protected::default() }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether one more entry needs an eviction first.
    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.capacity
    }

    pub fn contains(&self, k: &Key) -> bool {
        self.entries.contains_key(k)
    }

    pub fn get(&self, k: &Key) -> Option<&V> {
        self.entries.get(k).map(|c| &c.value)
    }

    /// The entry without recording a use.
    pub fn get_mut(&mut self, k: &Key) -> Option<&mut V> {
        self.entries.get_mut(k).map(|c| &mut c.value)
    }

    /// The next tick of the cache's logical clock (uses are ordered by it).
    pub fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Records a use of `k` at `tick` ([`Self::next_tick`]) and returns the entry.
    pub fn touch_at(&mut self, k: &Key, tick: u64) -> Option<&mut V> {
        let c = self.entries.get_mut(k)?;
        c.usage.touch(tick);
        Some(&mut c.value)
    }

    /// Records a use of `k` now and returns the entry.
    pub fn touch(&mut self, k: &Key) -> Option<&mut V> {
        let tick = self.next_tick();
        self.touch_at(k, tick)
    }

    /// Adds `k` with no use yet (a read or copy started ahead of its first lookup).
    pub fn insert(&mut self, k: Key, value: V) {
        self.entries.insert(k, Cached { value, usage: Usage::default() });
    }

    /// Removes `k`, returning its value and use history (put back with [`Self::put_back`]).
    pub fn take(&mut self, k: &Key) -> Option<(V, Usage)> {
        self.entries.remove(k).map(|c| (c.value, c.usage))
    }

    /// Re-inserts an entry [`Self::take`] removed, with its use history.
    pub fn put_back(&mut self, k: Key, value: V, usage: Usage) {
        self.entries.insert(k, Cached { value, usage });
    }

    pub fn remove(&mut self, k: &Key) -> Option<V> {
        self.entries.remove(k).map(|c| c.value)
    }

    /// The first `limit` of `predicted` experts of `layer` that the cache lacks (what a prefetch
    /// would read or copy).
    pub fn missing(&self, layer: usize, predicted: &[u32], limit: usize) -> Vec<usize> {
        predicted
            .iter()
            .take(limit)
            .map(|&e| e as usize)
            .filter(|&e| !self.contains(&(layer, e)))
            .collect()
    }

    /// The calling thread's pass now needs `keys` (its previous set is released).
    pub fn protect_for_current_thread(&mut self, keys: &[Key]) {
        self.protected.set_for_current_thread(keys);
    }

    /// The entry eviction takes next among those `may_go` admits: the policy's lowest score among
    /// entries no pass needs, else — when `take_protected` — among the protected ones too.
    /// `None`: nothing may go.
    pub fn victim(&self, may_go: impl Fn(&Key, &V) -> bool, take_protected: bool) -> Option<Key> {
        let pick = |protected_too: bool| {
            self.entries
                .iter()
                .filter(|(k, c)| may_go(k, &c.value))
                .filter(|(k, _)| protected_too || !self.protected.contains(k))
                .min_by_key(|(_, c)| self.policy.score(&c.usage))
                .map(|(k, _)| *k)
        };
        pick(false).or_else(|| if take_protected { pick(true) } else { None })
    }
}

impl<V> ExpertCache<V> {
    /// The `n` entries eviction takes next among those `may_go` admits, in the order
    /// [`Self::victim`] would take them one by one (protected entries ignored): one pass over the
    /// entries for a whole batch of evictions (the GPU tier's promotions after a pass).
    pub fn victims(&self, n: usize, may_go: impl Fn(&Key, &V) -> bool) -> Vec<Key> {
        let mut all: Vec<((u64, u64), Key)> = self
            .entries
            .iter()
            .filter(|(k, c)| may_go(k, &c.value))
            .map(|(k, c)| (self.policy.score(&c.usage), *k))
            .collect();
        if n < all.len() {
            all.select_nth_unstable(n);
            all.truncate(n);
        }
        all.sort_unstable();
        all.into_iter().map(|(_, k)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn victims_follow_the_policy_and_spare_protected_entries() {
        let mut c = ExpertCache::new(3, EvictionPolicy::Lru);
        for e in 0..3 {
            c.insert((0, e), e);
        }
        c.touch(&(0, 0));
        c.touch(&(0, 1));
        c.touch(&(0, 2));
        c.touch(&(0, 0));
        assert!(c.is_full());
        assert_eq!(c.victim(|_, _| true, true), Some((0, 1)), "least recently used");
        c.protect_for_current_thread(&[(0, 1)]);
        assert_eq!(c.victim(|_, _| true, true), Some((0, 2)), "protected entries go last");
        assert_eq!(c.victim(|k, _| *k == (0, 1), false), None, "a prefetch never takes them");
        assert_eq!(c.victim(|k, _| *k == (0, 1), true), Some((0, 1)));
        let (v, u) = c.take(&(0, 2)).unwrap();
        c.put_back((0, 2), v, u);
        assert_eq!(c.victim(|_, _| true, true), Some((0, 2)), "take/put_back keep the history");
        assert_eq!(c.missing(0, &[5, 1, 6, 7], 3), vec![5, 6], "only the first 3 predictions");
    }

    #[test]
    fn a_batch_of_victims_is_the_one_by_one_order() {
        let build = || {
            let mut c = ExpertCache::new(6, EvictionPolicy::Lru);
            for e in 0..6 {
                c.insert((0, e), e);
            }
            for e in [3, 0, 5, 1, 4, 2, 0] {
                c.touch(&(0, e));
            }
            c
        };
        let (c, mut one) = (build(), build());
        // One by one, removing each victim: the reference order.
        let may_go = |k: &Key, _: &usize| k.1 != 4;
        let mut want = Vec::new();
        while let Some(k) = one.victim(may_go, true) {
            one.remove(&k);
            want.push(k);
        }
        assert_eq!(want, vec![(0, 3), (0, 5), (0, 1), (0, 2), (0, 0)]);
        for n in 0..=6 {
            assert_eq!(c.victims(n, may_go), want[..n.min(want.len())], "n = {n}");
        }
    }
}
