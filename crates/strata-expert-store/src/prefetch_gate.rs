//! Whether predictions are worth reading: the precision of the predictor on experts that were not
//! cached, measured in the shadow (whether or not their reads were issued) and compared with a
//! break-even precision.
//!
//! A prefetch of an expert already cached costs nothing and saves nothing; what matters is, of the
//! predicted experts the cache lacks ("candidates"), the share the layer then uses. A wasted
//! candidate costs a read (drive time, and with buffered I/O a copy on the CPU); a used one saves
//! the stall of its demand read. On the 2-core VM of docs/performance.md ("Prefetch and bundled
//! layout") one wasted read cost ~0.46 ms and one used read saved ~0.62 ms, a break-even precision
//! of ~0.43; the default `--prefetch-min-precision` 0.5 leaves a margin.

/// Candidates to observe before the gate may open.
const WARMUP: f64 = 16.0;

/// Weight of older observations per candidate observed: the estimate covers about the last 50
/// candidates (a couple of decode tokens), so the prompt's predictions (many, and precise: a new
/// prompt lacks everything) stop counting soon after decode starts.
const DECAY: f64 = 0.98;

/// Decaying precision of predictions on uncached experts.
#[derive(Debug, Clone)]
pub struct PrefetchGate {
    min_precision: f64,
    used: f64,
    total: f64,
}

impl PrefetchGate {
    /// `min_precision` ≤ 0: always open.
    pub fn new(min_precision: f64) -> Self {
        Self { min_precision, used: 0.0, total: 0.0 }
    }

    /// One layer's prediction resolved: `candidates` predicted experts were not cached, `used` of
    /// them were then routed to.
    pub fn observe(&mut self, candidates: usize, used: usize) {
        if candidates == 0 {
            return;
        }
        let d = DECAY.powi(candidates as i32);
        self.used = self.used * d + used as f64;
        self.total = self.total * d + candidates as f64;
    }

    /// Resolves the prediction made for `layer` (its candidates, taken out of `pending`) against
    /// the experts the layer then routed to (`routed`: `(layer, expert)`, sorted) and observes it.
    /// Returns `(candidates, used)` for the caller's counters (zeros when there was none).
    pub fn resolve(
        &mut self,
        pending: &mut std::collections::HashMap<usize, Vec<usize>>,
        layer: usize,
        routed: &[(usize, usize)],
    ) -> (u64, u64) {
        let Some(c) = pending.remove(&layer) else { return (0, 0) };
        let used = c.iter().filter(|&&e| routed.binary_search(&(layer, e)).is_ok()).count();
        self.observe(c.len(), used);
        (c.len() as u64, used as u64)
    }

    /// The measured precision, once there is enough evidence.
    pub fn precision(&self) -> Option<f64> {
        (self.total >= WARMUP).then(|| self.used / self.total)
    }

    /// Whether predictions should be read now.
    pub fn open(&self) -> bool {
        self.min_precision <= 0.0 || self.precision().is_some_and(|p| p >= self.min_precision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_only_on_enough_precise_evidence() {
        let mut g = PrefetchGate::new(0.5);
        assert!(!g.open(), "no evidence yet");
        for _ in 0..4 {
            g.observe(4, 3);
        }
        assert!(!g.open(), "16 candidates, decayed, is under the warm-up");
        g.observe(4, 3);
        assert!(g.open() && (g.precision().unwrap() - 0.75).abs() < 1e-9);
        // Predictions turn bad: the gate closes, and reopens when they recover.
        for _ in 0..200 {
            g.observe(4, 1);
        }
        assert!(!g.open() && g.precision().unwrap() < 0.3);
        for _ in 0..400 {
            g.observe(4, 4);
        }
        assert!(g.open());
        // Layers with nothing to read change nothing.
        let before = g.precision();
        g.observe(0, 0);
        assert_eq!(g.precision(), before);
        assert!(PrefetchGate::new(0.0).open());
    }

    #[test]
    fn a_prediction_is_resolved_once_against_the_layer_routing() {
        let mut g = PrefetchGate::new(0.5);
        let mut pending = std::collections::HashMap::from([(3, vec![1, 5, 9]), (4, vec![2])]);
        // Layer 3 routed to experts 5 and 7 (sorted keys): one of the three candidates was used.
        assert_eq!(g.resolve(&mut pending, 3, &[(3, 5), (3, 7)]), (3, 1));
        assert!(!pending.contains_key(&3) && pending.contains_key(&4));
        assert_eq!(g.resolve(&mut pending, 3, &[(3, 5)]), (0, 0), "already resolved");
        // Another layer's key with the same expert id does not count.
        assert_eq!(g.resolve(&mut pending, 4, &[(3, 2)]), (1, 0));
    }
}
