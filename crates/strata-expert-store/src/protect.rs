//! Experts a forward pass is about to use, which eviction must spare: one set per calling thread
//! (each server slot decodes its own sequence on its own thread), so that one sequence's routing
//! never unprotects another's.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::thread::ThreadId;

/// Protected keys per thread.
#[derive(Debug)]
pub struct Protected<K> {
    sets: HashMap<ThreadId, HashSet<K>>,
}

impl<K> Default for Protected<K> {
    fn default() -> Self {
        Self { sets: HashMap::new() }
    }
}

impl<K: Hash + Eq + Copy> Protected<K> {
    /// The calling thread's pass now needs `keys` (its previous set is released).
    pub fn set_for_current_thread(&mut self, keys: &[K]) {
        self.sets.insert(std::thread::current().id(), keys.iter().copied().collect());
    }

    /// Whether any thread's pass needs `key`.
    pub fn contains(&self, key: &K) -> bool {
        self.sets.values().any(|s| s.contains(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_threads_routing_does_not_unprotect_anothers() {
        let p = std::sync::Mutex::new(Protected::default());
        p.lock().unwrap().set_for_current_thread(&[(0, 1), (0, 2)]);
        std::thread::scope(|s| {
            s.spawn(|| p.lock().unwrap().set_for_current_thread(&[(0, 3)]));
        });
        let p = p.into_inner().unwrap();
        assert!(p.contains(&(0, 1)) && p.contains(&(0, 2)) && p.contains(&(0, 3)));
        assert!(!p.contains(&(0, 4)));
    }
}
