//! Eviction policies of the expert cache. Each cached expert keeps its last two use times and a use
//! count (uses are counted in ticks of a logical clock); the entry with the lowest score goes first.
//! - `lru`: least recently used.
//! - `lru2`: LRU-2 (O'Neil, O'Neil & Weikum 1993, "The LRU-K page replacement algorithm"): by the
//!   second most recent use, so an expert used once is evicted before one used twice — a
//!   frequency-aware LRU that resists one-off scans such as a prefill chunk's union of experts.
//! - `lfu`: least frequently used (ties: least recent).

use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    #[default]
    Lru,
    Lru2,
    Lfu,
}

impl FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "lru2" | "lru-2" => Ok(Self::Lru2),
            "lfu" => Ok(Self::Lfu),
            _ => Err(format!("unknown eviction policy `{s}` (lru, lru2, lfu)")),
        }
    }
}

impl EvictionPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Lru2 => "lru2",
            Self::Lfu => "lfu",
        }
    }

    /// Lower scores are evicted first.
    pub fn score(self, u: &Usage) -> (u64, u64) {
        match self {
            Self::Lru => (u.last, 0),
            Self::Lru2 => (u.prev, u.last),
            Self::Lfu => (u.count, u.last),
        }
    }
}

/// Use history of one cached expert.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub last: u64,
    /// The use before `last` (0 when used once).
    pub prev: u64,
    pub count: u64,
}

impl Usage {
    pub fn touch(&mut self, tick: u64) {
        self.prev = self.last;
        self.last = tick;
        self.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_order_victims() {
        let mut once_recent = Usage::default();
        once_recent.touch(10);
        let mut twice_old = Usage::default();
        twice_old.touch(2);
        twice_old.touch(3);
        // LRU evicts the older one, LRU-2 and LFU the one used once.
        assert!(EvictionPolicy::Lru.score(&twice_old) < EvictionPolicy::Lru.score(&once_recent));
        assert!(EvictionPolicy::Lru2.score(&once_recent) < EvictionPolicy::Lru2.score(&twice_old));
        assert!(EvictionPolicy::Lfu.score(&once_recent) < EvictionPolicy::Lfu.score(&twice_old));
    }
}
