//! The expert-cache hit rate the plan expects at a cache share `f` (cached experts ÷ all):
//! typical decode routing of trained MoE models, not the uniform floor `f`.
//!
//! The curve is the per-layer LRU hit curve of `strata synth --routing realistic` at Qwen3-30B-A3B's
//! shape (previous-token reuse 0.35, Zipf 0.6 popularity; `strata bench --routing`, docs/
//! performance.md, "Realistic routing"), which sits inside the published measurements of trained
//! models (previous-token reuse 25–47% on OLMoE; LRU hits ~67% at 12.5% and ~81% at 25% cached on a
//! 512-expert model, 40–60% on Mixtral at 2–4 of 8) at their low end: a conservative typical case.
//! The engine's own cache measured 42.6% at 15% and 52.4% at 25% on that routing.

/// `(cache share, hit rate)` points, linearly interpolated.
const TYPICAL: [(f64, f64); 7] = [
    (0.0, 0.0),
    (0.05, 0.262),
    (0.10, 0.399),
    (0.125, 0.428),
    (0.25, 0.556),
    (0.50, 0.743),
    (1.0, 1.0),
];

/// Hit rate of typical decode routing with `f` of the experts cached (never below `f`).
pub fn typical_hit_rate(f: f64) -> f64 {
    let f = f.clamp(0.0, 1.0);
    let i = TYPICAL.iter().position(|&(x, _)| x >= f).unwrap_or(TYPICAL.len() - 1).max(1);
    let ((x0, y0), (x1, y1)) = (TYPICAL[i - 1], TYPICAL[i]);
    let y = y0 + (y1 - y0) * (f - x0) / (x1 - x0).max(1e-12);
    y.max(f)
}

/// Miss rate at cache share `f` given a measured miss rate `miss0` at share `f0`: the typical
/// curve's shape scaled through the measurement.
pub fn scaled_miss_rate(miss0: f64, f0: f64, f: f64) -> f64 {
    let typical = |x: f64| 1.0 - typical_hit_rate(x);
    let base = typical(f0);
    if base <= 1e-9 {
        return typical(f);
    }
    (miss0 * typical(f) / base).clamp(0.0, 1.0 - f.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curve_interpolates_and_bounds() {
        assert_eq!(typical_hit_rate(0.0), 0.0);
        assert!((typical_hit_rate(0.25) - 0.556).abs() < 1e-12);
        assert!((typical_hit_rate(0.375) - (0.556 + 0.743) / 2.0).abs() < 1e-12);
        assert_eq!(typical_hit_rate(1.0), 1.0);
        assert!((0.0..1.0).all_between(|f| typical_hit_rate(f) >= f));
        // A measurement at 25% with 40% misses predicts proportionally more at 10%.
        let m = scaled_miss_rate(0.40, 0.25, 0.10);
        assert!((m - 0.40 * (1.0 - 0.399) / (1.0 - 0.556)).abs() < 1e-12);
    }

    trait AllBetween {
        fn all_between(self, f: impl Fn(f64) -> bool) -> bool;
    }
    impl AllBetween for std::ops::Range<f64> {
        fn all_between(self, f: impl Fn(f64) -> bool) -> bool {
            (0..=100).map(|i| self.start + (self.end - self.start) * i as f64 / 100.0).all(f)
        }
    }
}
