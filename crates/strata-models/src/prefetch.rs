//! Expert prefetch: predicting the next MoE layer's experts before its router runs, so that a
//! streaming [`ExpertProvider`] can start their reads while the current layer computes.
//!
//! Predictors (issue 6):
//! - **pre-gating**: the next MoE layer's router applied to the current residual stream, normed by
//!   that layer's `ffn_norm` (the residual changes little from layer to layer). Pre-gated MoE
//!   (Hwang et al. 2024, arXiv 2308.12066) trains a gate for this; we reuse the model's own router
//!   as AdapMoE / HOBBIT do without training.
//! - **previous**: the experts the same layer used at the previous forward pass (the previous
//!   token in decode): SwiftLM's heuristic, temporal locality of routing.
//! - **union** of both, pre-gating's choices first, within the provider's byte budget.
//!
//! The predictions for MoE layer `j` are made right after the routing of the MoE layer before it
//! (at the start of the forward pass for the first one, from the token embeddings), and scored when
//! layer `j` routes: every predictor is scored on every pass, whichever one issues the reads, so one
//! run measures all three.

use std::str::FromStr;
use std::sync::Mutex;

use crate::moe::LayerRouting;

/// Which prediction `--prefetch` issues as reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefetchMode {
    /// No prefetch: reads start when a layer's routing is known.
    Off,
    /// The default: the best precision on uncached experts measured (docs/performance.md).
    #[default]
    PreGate,
    Previous,
    Union,
}

impl FromStr for PrefetchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(Self::Off),
            "pregate" | "pre-gate" | "pre-gating" | "on" => Ok(Self::PreGate),
            "previous" | "prev" => Ok(Self::Previous),
            "union" => Ok(Self::Union),
            _ => Err(format!("unknown prefetch predictor `{s}` (off, pregate, previous, union)")),
        }
    }
}

impl PrefetchMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::PreGate => "pregate",
            Self::Previous => "previous",
            Self::Union => "union",
        }
    }
}

/// Precision and recall counters of one predictor, over the MoE layers it predicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PredictorStats {
    /// Experts predicted (after the budget cut).
    pub predicted: u64,
    /// Predicted experts the layer then used.
    pub correct: u64,
    /// Distinct experts the predicted layers used.
    pub actual: u64,
}

impl PredictorStats {
    /// `correct / predicted` (1.0 when nothing was predicted).
    pub fn precision(&self) -> f64 {
        if self.predicted == 0 {
            1.0
        } else {
            self.correct as f64 / self.predicted as f64
        }
    }

    /// `correct / actual` (0.0 when no layer was predicted).
    pub fn recall(&self) -> f64 {
        if self.actual == 0 {
            0.0
        } else {
            self.correct as f64 / self.actual as f64
        }
    }

    fn since(&self, e: &Self) -> Self {
        Self {
            predicted: self.predicted - e.predicted,
            correct: self.correct - e.correct,
            actual: self.actual - e.actual,
        }
    }

    fn score(&mut self, predicted: &[u32], actual: &[u32]) {
        self.predicted += predicted.len() as u64;
        self.actual += actual.len() as u64;
        self.correct += predicted.iter().filter(|e| actual.binary_search(e).is_ok()).count() as u64;
    }
}

/// Cumulative prefetch-predictor counters (subtract snapshots with [`Self::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefetchStats {
    pub pregate: PredictorStats,
    pub previous: PredictorStats,
    pub union: PredictorStats,
}

impl PrefetchStats {
    pub fn since(&self, e: &Self) -> Self {
        Self {
            pregate: self.pregate.since(&e.pregate),
            previous: self.previous.since(&e.previous),
            union: self.union.since(&e.union),
        }
    }

    /// The counters of the predictor `mode` issues (`None` for `Off`).
    pub fn of(&self, mode: PrefetchMode) -> Option<&PredictorStats> {
        match mode {
            PrefetchMode::Off => None,
            PrefetchMode::PreGate => Some(&self.pregate),
            PrefetchMode::Previous => Some(&self.previous),
            PrefetchMode::Union => Some(&self.union),
        }
    }
}

/// The three predictions for one layer, each ranked (most likely first) and cut to the budget.
#[derive(Debug, Clone, Default)]
struct Predictions {
    pregate: Vec<u32>,
    previous: Vec<u32>,
    union: Vec<u32>,
}

#[derive(Debug, Default)]
struct State {
    /// `last[layer]`: distinct experts of that layer's last routing, ascending.
    last: Vec<Vec<u32>>,
    /// `pending[layer]`: predictions made for that layer, scored when it routes.
    pending: Vec<Option<Predictions>>,
    stats: PrefetchStats,
}

/// Predictor state shared by the sequences of one model (the previous-token heuristic does not
/// distinguish sequences; predictions are hints, never correctness).
#[derive(Debug)]
pub struct Prefetcher {
    mode: PrefetchMode,
    /// Experts predicted per layer at most.
    max_experts: usize,
    state: Mutex<State>,
}

impl Prefetcher {
    /// `max_experts`: the most experts one prediction may name (the byte budget of a prefetch
    /// divided by the bytes of one expert).
    pub fn new(mode: PrefetchMode, num_layers: usize, max_experts: usize) -> Self {
        let state = State {
            last: vec![Vec::new(); num_layers],
            pending: vec![None; num_layers],
            stats: PrefetchStats::default(),
        };
        Self { mode, max_experts: max_experts.max(1), state: Mutex::new(state) }
    }

    pub fn mode(&self) -> PrefetchMode {
        self.mode
    }

    pub fn stats(&self) -> PrefetchStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the predictions for `layer` from pre-gating's routing of the current residual
    /// (`None` when it was not computed) and the layer's last routing. Returns the experts to read
    /// ahead by the mode (empty for `Off`).
    pub fn predict(&self, layer: usize, pregate: Option<&LayerRouting>) -> Vec<u32> {
        let mut st = self.lock();
        let pregate = pregate.map(ranked).unwrap_or_default();
        let previous = st.last.get(layer).cloned().unwrap_or_default();
        let mut union = pregate.clone();
        union.extend(previous.iter().filter(|e| !pregate.contains(e)));
        let cut = |mut v: Vec<u32>| {
            v.truncate(self.max_experts);
            v
        };
        let p = Predictions { pregate: cut(pregate), previous: cut(previous), union: cut(union) };
        let issue = match self.mode {
            PrefetchMode::Off => Vec::new(),
            PrefetchMode::PreGate => p.pregate.clone(),
            PrefetchMode::Previous => p.previous.clone(),
            PrefetchMode::Union => p.union.clone(),
        };
        if let Some(slot) = st.pending.get_mut(layer) {
            *slot = Some(p);
        }
        issue
    }

    /// `layer` routed: scores the predictions made for it and remembers its experts for the next
    /// pass.
    pub fn observe(&self, routing: &LayerRouting) {
        let actual = routing.distinct_experts();
        let mut st = self.lock();
        let layer = routing.layer;
        if let Some(p) = st.pending.get_mut(layer).and_then(Option::take) {
            st.stats.pregate.score(&p.pregate, &actual);
            st.stats.previous.score(&p.previous, &actual);
            st.stats.union.score(&p.union, &actual);
        }
        if let Some(l) = st.last.get_mut(layer) {
            *l = actual;
        }
    }
}

/// Distinct experts of `r`, most-chosen first (summed weight breaks ties, then the lower id).
fn ranked(r: &LayerRouting) -> Vec<u32> {
    let mut acc: Vec<(u32, usize, f32)> = Vec::new();
    for (&e, &w) in r.expert_ids.iter().zip(&r.weights) {
        match acc.iter_mut().find(|a| a.0 == e) {
            Some(a) => {
                a.1 += 1;
                a.2 += w;
            }
            None => acc.push((e, 1, w)),
        }
    }
    acc.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(a.0.cmp(&b.0)));
    acc.into_iter().map(|a| a.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(layer: usize, ids: &[u32]) -> LayerRouting {
        LayerRouting {
            layer,
            top_k: 2,
            expert_ids: ids.to_vec(),
            weights: ids.iter().map(|&e| 1.0 / (1.0 + e as f32)).collect(),
        }
    }

    #[test]
    fn ranked_orders_by_count_then_weight() {
        assert_eq!(ranked(&routing(0, &[5, 3, 3, 9, 1, 5])), vec![3, 5, 1, 9]);
    }

    #[test]
    fn predictors_are_scored_when_the_layer_routes() {
        let p = Prefetcher::new(PrefetchMode::Union, 2, 3);
        // No previous routing yet: union = pre-gating.
        assert_eq!(p.predict(1, Some(&routing(1, &[4, 2]))), vec![2, 4]);
        p.observe(&routing(1, &[2, 7]));
        let s = p.stats();
        assert_eq!(s.pregate, PredictorStats { predicted: 2, correct: 1, actual: 2 });
        assert_eq!(s.previous, PredictorStats { predicted: 0, correct: 0, actual: 2 });
        // Next pass: previous = {2, 7}; union = pre-gating's {4, 5} then 2, cut to 3.
        assert_eq!(p.predict(1, Some(&routing(1, &[4, 5]))), vec![4, 5, 2]);
        p.observe(&routing(1, &[7, 2]));
        let s = p.stats();
        assert_eq!(s.previous, PredictorStats { predicted: 2, correct: 2, actual: 4 });
        assert_eq!(s.union, PredictorStats { predicted: 5, correct: 2, actual: 4 });
        assert_eq!((s.previous.precision(), s.previous.recall()), (1.0, 0.5));
        // A layer routed without a prediction is not scored.
        p.observe(&routing(0, &[1, 2]));
        assert_eq!(p.stats(), s);
    }

    #[test]
    fn off_issues_nothing_but_still_measures() {
        let p = Prefetcher::new(PrefetchMode::Off, 1, 8);
        assert!(p.predict(0, Some(&routing(0, &[1, 2]))).is_empty());
        p.observe(&routing(0, &[1, 3]));
        assert_eq!(p.stats().pregate.correct, 1);
    }
}
