//! Routing statistics of a decode trace, comparable with published measurements of trained MoE
//! models (the calibration targets of `strata synth --routing realistic`, docs/performance.md,
//! "Routing"): previous-token reuse per layer, a Zipf fit of expert popularity, the share of the
//! most popular expert and of the experts that take 90% of the routing, the LRU hit curve
//! simulated on the trace (per layer, as llama.cpp PRs 27861/28545 measure it, and one cache shared
//! by all layers, as Strata's expert cache is), and the prefetch predictors' precision and recall.

use serde::Serialize;
use strata_models::{LayerRouting, PredictorStats, PrefetchStats};

/// Fractions of each layer's experts the LRU hit curve is simulated at.
pub const LRU_FRACTIONS: [f64; 5] = [0.05, 0.10, 0.125, 0.25, 0.50];

/// The experts every MoE layer chose for each decoded token, in order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RoutingTrace {
    pub experts: usize,
    pub top_k: usize,
    /// Layer index of each MoE layer.
    pub layers: Vec<usize>,
    /// `[token][moe layer][top_k]`.
    pub tokens: Vec<Vec<Vec<u32>>>,
}

impl RoutingTrace {
    pub fn new(experts: usize) -> Self {
        Self { experts, ..Self::default() }
    }

    /// Appends the tokens of one forward pass (`routing`: every MoE layer's routing of the pass,
    /// in layer order, as [`strata_models::ForwardOutput::routing`] returns it).
    pub fn push(&mut self, routing: &[LayerRouting]) {
        let Some(first) = routing.first() else { return };
        if self.layers.is_empty() {
            self.layers = routing.iter().map(|r| r.layer).collect();
            self.top_k = first.top_k;
        }
        for t in 0..first.num_tokens() {
            self.tokens.push(routing.iter().map(|r| r.token(t).0.to_vec()).collect());
        }
    }
}

/// Mean, minimum and maximum of a per-layer figure.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        Self {
            mean,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }
}

/// One point of an LRU hit curve.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LruPoint {
    /// Fraction of the experts cached.
    pub fraction: f64,
    /// Cache capacity in experts (per layer, or in all for the shared cache).
    pub capacity: usize,
    /// Lookups that found the expert cached (each token's experts are looked up, then inserted).
    pub hit_rate: f64,
}

/// A predictor's precision and recall.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PredictorFigures {
    pub precision: f64,
    pub recall: f64,
}

impl From<&PredictorStats> for PredictorFigures {
    fn from(s: &PredictorStats) -> Self {
        Self { precision: s.precision(), recall: s.recall() }
    }
}

/// What [`report`] measures on a trace.
#[derive(Debug, Clone, Serialize)]
pub struct RoutingReport {
    pub tokens: usize,
    pub moe_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Share of a token's experts that the previous token also used, per layer (chance: k/E).
    pub reuse: Spread,
    pub reuse_per_layer: Vec<f64>,
    pub reuse_chance: f64,
    /// Zipf exponent fitted per layer (least squares of ln count on ln rank, experts used ≥ once).
    pub zipf: Spread,
    /// Share of a layer's routing the most used expert takes (mean over layers; uniform: 1/E).
    pub top_expert_share: f64,
    /// Fraction of a layer's experts that take 90% of its routing (mean over layers).
    pub experts_for_90_percent: f64,
    /// LRU per layer at [`LRU_FRACTIONS`] of each layer's experts.
    pub lru_per_layer: Vec<LruPoint>,
    /// One LRU cache for every layer's experts at [`LRU_FRACTIONS`] of all experts.
    pub lru_shared: Vec<LruPoint>,
    /// Prefetch predictors scored during the trace (pre-gating, previous token, union).
    pub predictors: Option<[(String, PredictorFigures); 3]>,
}

/// An LRU set of `capacity` keys: `hit` looks up, `touch` inserts or refreshes.
struct Lru {
    capacity: usize,
    /// `(key, last use)`.
    entries: Vec<(u64, u64)>,
    clock: u64,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self { capacity, entries: Vec::with_capacity(capacity + 1), clock: 0 }
    }

    fn hit(&self, key: u64) -> bool {
        self.entries.iter().any(|e| e.0 == key)
    }

    fn touch(&mut self, key: u64) {
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.0 == key) {
            e.1 = self.clock;
            return;
        }
        if self.entries.len() == self.capacity {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].1).unwrap_or(0);
            self.entries.swap_remove(oldest);
        }
        if self.capacity > 0 {
            self.entries.push((key, self.clock));
        }
    }
}

fn lru_per_layer(trace: &RoutingTrace, fraction: f64) -> LruPoint {
    let capacity = ((fraction * trace.experts as f64).round() as usize).max(1);
    let (mut hits, mut lookups) = (0u64, 0u64);
    for l in 0..trace.layers.len() {
        let mut cache = Lru::new(capacity);
        for tok in &trace.tokens {
            let ids = &tok[l];
            hits += ids.iter().filter(|&&e| cache.hit(e as u64)).count() as u64;
            lookups += ids.len() as u64;
            ids.iter().for_each(|&e| cache.touch(e as u64));
        }
    }
    LruPoint { fraction, capacity, hit_rate: hits as f64 / lookups.max(1) as f64 }
}

fn lru_shared(trace: &RoutingTrace, fraction: f64) -> LruPoint {
    let capacity =
        ((fraction * (trace.experts * trace.layers.len()) as f64).round() as usize).max(1);
    let mut cache = Lru::new(capacity);
    let (mut hits, mut lookups) = (0u64, 0u64);
    for tok in &trace.tokens {
        for (l, ids) in tok.iter().enumerate() {
            let key = |e: u32| (l as u64) << 32 | e as u64;
            hits += ids.iter().filter(|&&e| cache.hit(key(e))).count() as u64;
            lookups += ids.len() as u64;
            ids.iter().for_each(|&e| cache.touch(key(e)));
        }
    }
    LruPoint { fraction, capacity, hit_rate: hits as f64 / lookups.max(1) as f64 }
}

/// Least-squares slope of ln(count) on ln(rank), negated, over the experts used at least once.
fn zipf_fit(mut counts: Vec<u64>) -> f64 {
    counts.sort_unstable_by(|a, b| b.cmp(a));
    let pts: Vec<(f64, f64)> = counts
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(r, &c)| (((r + 1) as f64).ln(), (c as f64).ln()))
        .collect();
    if pts.len() < 2 {
        return 0.0;
    }
    let n = pts.len() as f64;
    let (mx, my) =
        (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    -sxy / sxx.max(1e-12)
}

/// The statistics of `trace` (and of the prefetch predictors' counters over it, if scored).
pub fn report(trace: &RoutingTrace, predictors: Option<&PrefetchStats>) -> RoutingReport {
    let (n_layers, k, e) = (trace.layers.len(), trace.top_k.max(1), trace.experts.max(1));
    let mut reuse_per_layer = Vec::with_capacity(n_layers);
    let (mut zipf, mut top, mut ninety) = (Vec::new(), Vec::new(), Vec::new());
    for l in 0..n_layers {
        let kept: usize = trace
            .tokens
            .windows(2)
            .map(|w| w[1][l].iter().filter(|x| w[0][l].contains(x)).count())
            .sum();
        reuse_per_layer
            .push(kept as f64 / (trace.tokens.len().saturating_sub(1) * k).max(1) as f64);
        let mut counts = vec![0u64; e];
        trace.tokens.iter().flat_map(|t| &t[l]).for_each(|&x| counts[x as usize % e] += 1);
        let total = counts.iter().sum::<u64>().max(1) as f64;
        zipf.push(zipf_fit(counts.clone()));
        counts.sort_unstable_by(|a, b| b.cmp(a));
        top.push(counts[0] as f64 / total);
        let mut acc = 0.0;
        let needed = counts.iter().take_while(|&&c| {
            let before = acc;
            acc += c as f64;
            before < 0.9 * total
        });
        ninety.push(needed.count() as f64 / e as f64);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    RoutingReport {
        tokens: trace.tokens.len(),
        moe_layers: n_layers,
        experts: trace.experts,
        top_k: trace.top_k,
        reuse: Spread::of(&reuse_per_layer),
        reuse_chance: k as f64 / e as f64,
        zipf: Spread::of(&zipf),
        top_expert_share: mean(&top),
        experts_for_90_percent: mean(&ninety),
        lru_per_layer: LRU_FRACTIONS.iter().map(|&f| lru_per_layer(trace, f)).collect(),
        lru_shared: LRU_FRACTIONS.iter().map(|&f| lru_shared(trace, f)).collect(),
        predictors: predictors.map(|p| {
            [
                ("pregate".into(), (&p.pregate).into()),
                ("previous".into(), (&p.previous).into()),
                ("union".into(), (&p.union).into()),
            ]
        }),
        reuse_per_layer,
    }
}

impl RoutingReport {
    /// Hit rate of the per-layer LRU at `fraction` (one of [`LRU_FRACTIONS`]).
    pub fn lru_at(&self, fraction: f64) -> Option<f64> {
        self.lru_per_layer.iter().find(|p| (p.fraction - fraction).abs() < 1e-9).map(|p| p.hit_rate)
    }

    /// The report as Markdown lines (what `strata bench --routing` prints).
    pub fn markdown(&self) -> String {
        let pct = |x: f64| format!("{:.1}%", 100.0 * x);
        let mut s = format!(
            "routing over {} decoded tokens, {} MoE layers, top-{} of {} experts\n\n| figure | measured | published (trained models) |\n|---|---|---|\n",
            self.tokens, self.moe_layers, self.top_k, self.experts
        );
        s += &format!(
            "| previous-token reuse per layer | {} (layers {}–{}; chance {}) | 25–47% OLMoE, 25.7% GLM-4.7-Flash |\n",
            pct(self.reuse.mean),
            pct(self.reuse.min),
            pct(self.reuse.max),
            pct(self.reuse_chance)
        );
        s += &format!(
            "| Zipf exponent per layer | {:.2} ({:.2}–{:.2}) | 0.45–0.84 OLMoE |\n",
            self.zipf.mean, self.zipf.min, self.zipf.max
        );
        s += &format!(
            "| most used expert's share | {} | 4–6% Qwen3-30B-A3B |\n",
            pct(self.top_expert_share)
        );
        s += &format!(
            "| experts for 90% of the routing | {} | ~50% Qwen3-30B-A3B |\n",
            pct(self.experts_for_90_percent)
        );
        for (p, q) in self.lru_per_layer.iter().zip(&self.lru_shared) {
            let published = match (p.fraction * 1000.0).round() as u32 {
                125 => "~67% (512 experts)",
                250 => "~81% (512 experts); 40–60% Mixtral at 2–4 of 8",
                _ => "",
            };
            s += &format!(
                "| LRU hits, {} of the experts cached | {} per layer ({} each), {} shared ({} in all) | {published} |\n",
                pct(p.fraction),
                pct(p.hit_rate),
                p.capacity,
                pct(q.hit_rate),
                q.capacity
            );
        }
        if let Some(ps) = &self.predictors {
            for (name, f) in ps {
                let published = if name == "pregate" {
                    "recall 80–90% one layer ahead (Mixtral)"
                } else {
                    ""
                };
                s += &format!("| prefetch predictor `{name}` precision / recall | {:.2} / {:.2} | {published} |\n", f.precision, f.recall);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(tokens: &[&[u32]]) -> RoutingTrace {
        let mut t = RoutingTrace::new(8);
        for ids in tokens {
            t.push(&[LayerRouting {
                layer: 2,
                top_k: 2,
                expert_ids: ids.to_vec(),
                weights: vec![0.5; ids.len()],
            }]);
        }
        t
    }

    #[test]
    fn reuse_and_lru_count_what_they_say() {
        let t = trace(&[&[0, 1], &[1, 2], &[1, 2], &[3, 4]]);
        let r = report(&t, None);
        assert_eq!((r.tokens, r.moe_layers, r.top_k), (4, 1, 2));
        // Reuse: 1 of 2, 2 of 2, 0 of 2.
        assert!((r.reuse.mean - 0.5).abs() < 1e-12, "{r:?}");
        // Per-layer LRU of 4 experts (50%): hits 0, 1, 2, 0 of 8 lookups.
        assert_eq!(r.lru_at(0.5), Some(3.0 / 8.0));
        // 1 expert (12.5%): the previous token's last expert stays (expert 1 at token 1, expert 2
        // at token 2).
        assert_eq!(r.lru_at(0.125), Some(2.0 / 8.0));
        // Expert 1 takes 3 of 8 routings.
        assert!((r.top_expert_share - 3.0 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn zipf_fit_recovers_the_exponent() {
        let counts: Vec<u64> = (1..=64).map(|r| (1e6 * (r as f64).powf(-0.7)) as u64).collect();
        assert!((zipf_fit(counts) - 0.7).abs() < 0.01);
    }

    /// The routing process alone (no weights) at Qwen3-30B-A3B's shape: 48 MoE layers, top-8 of
    /// 128, 256 decoded tokens.
    fn synthetic_30b(cfg: strata_formats::SyntheticRouting) -> RoutingReport {
        let routers: Vec<_> =
            (0..48).map(|l| strata_models::SyntheticRouter::new(cfg, l, 128, 8)).collect();
        let mut t = RoutingTrace::new(128);
        let mut prev: Vec<Option<Vec<u32>>> = vec![None; 48];
        for pos in 40..296 {
            let token = (pos as u32).wrapping_mul(2_654_435_761) % 151_936;
            let routing: Vec<LayerRouting> = routers
                .iter()
                .enumerate()
                .map(|(l, r)| {
                    let ids = r.route(pos, Some(token), prev[l].as_deref());
                    prev[l] = Some(ids.clone());
                    LayerRouting { layer: l, top_k: 8, expert_ids: ids, weights: vec![0.125; 8] }
                })
                .collect();
            t.push(&routing);
        }
        report(&t, None)
    }

    #[test]
    fn synthetic_30b_routing_meets_the_published_ranges() {
        let r = synthetic_30b(strata_formats::SyntheticRouting::realistic(1234));
        eprintln!("{}", r.markdown());
        assert!((0.25..=0.45).contains(&r.reuse.mean), "reuse {:?}", r.reuse);
        let (at10, at25) = (r.lru_at(0.10).unwrap(), r.lru_at(0.25).unwrap());
        assert!((0.40..=0.85).contains(&at25), "LRU at 25%: {at25}");
        assert!((0.15..=0.70).contains(&at10), "LRU at 10%: {at10}");
        assert!((0.45..=0.84).contains(&r.zipf.mean), "Zipf {:?}", r.zipf);
        let u = synthetic_30b(strata_formats::SyntheticRouting::uniform(1234));
        assert!(u.lru_at(0.10).unwrap() <= 0.15, "uniform LRU at 10%: {:?}", u.lru_per_layer);
        assert!(u.reuse.mean < 0.1, "uniform reuse {:?}", u.reuse);
    }

    #[test]
    fn a_pass_of_several_tokens_is_split_per_token() {
        let mut t = RoutingTrace::new(8);
        t.push(&[LayerRouting {
            layer: 0,
            top_k: 2,
            expert_ids: vec![1, 2, 3, 4],
            weights: vec![0.5; 4],
        }]);
        assert_eq!(t.tokens, vec![vec![vec![1, 2]], vec![vec![3, 4]]]);
    }
}
