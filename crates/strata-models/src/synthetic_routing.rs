//! The routing process of synthetic benchmark models (`strata synth --routing`; the metadata and
//! its guard are [`strata_formats::synthetic`]). The router computes its logits as usual and this
//! process chooses the experts; weights come from the router's scores of the chosen experts.
//!
//! - `uniform`: each token's top-k drawn independently and uniformly (the worst case).
//! - `realistic`: each of the previous token's experts is kept with probability `reuse`; the rest
//!   are drawn from the layer's popularity, excluding the previous token's experts (so the measured
//!   previous-token reuse is `reuse`); popularity is Zipf(`zipf`) over a random order of the
//!   experts per layer, each expert's log-weight drifting by a Gaussian of deviation `drift` per
//!   `drift_period` tokens (linearly interpolated knots: segment locality). Calibration targets —
//!   published decode statistics of trained models — are listed in docs/performance.md, "Routing".
//! - pre-gating ([`SyntheticRouter::predict`]): the next layer's actual experts, each kept with
//!   probability `pregate_recall` and otherwise replaced by a popularity draw, so the pre-gating
//!   predictor's recall is `pregate_recall`.
//!
//! Every draw of a choice is a hash of (seed, layer, position, the sequence's token at the
//! position before, purpose, counter) — a pre-gating prediction's hashes the position's own token —
//! and each token's choice depends on the same layer's choice at the previous position of its
//! sequence (both kept per sequence in a [`RoutingHistory`]). A sequence therefore
//! routes identically in one prefill pass or token by token, resident or streamed, on any device,
//! and in a speculative verify pass. Since a position's choice does not depend on its own token, a
//! decode step's choice can be drawn while the step before it runs ([`RoutingHistory::take_ahead`]):
//! a trained model's router runs on the device at no host cost, and this process, which stands in
//! for one, then costs a batched GPU step no host time before its launch either.

use std::sync::{Arc, Mutex};

use strata_formats::{RoutingMode, SyntheticRouting};

/// Experts each MoE layer chose at every position of one sequence (the state a synthetic router
/// keeps beside the KV cache). Positions are written in order; a rollback needs no action, since
/// later passes overwrite the positions after the sequence's new length.
#[derive(Debug, Clone, Default)]
pub struct RoutingHistory {
    top_k: usize,
    /// `ids[layer]`: `[positions · top_k]`.
    ids: Vec<Vec<u32>>,
    /// `[positions]`: the token routed at each position (the next position's draws hash it).
    tokens: Vec<u32>,
    /// A position whose choice every layer holds already, drawn ahead of its pass
    /// ([`Self::take_ahead`]); cleared by every pass recorded ([`Self::record_tokens`]).
    ahead: Option<usize>,
}

/// A run of positions of a [`RoutingHistory`] (a prefix-cache block's part of it).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingRows {
    /// `ids[layer]`: `[len · top_k]` (zeros where not recorded).
    pub ids: Vec<Vec<u32>>,
    /// `[len]`: the tokens routed there (zeros where not recorded).
    pub tokens: Vec<u32>,
}

impl RoutingRows {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.ids.iter().map(Vec::len).sum::<usize>() + self.tokens.len()) * 4
    }
}

impl RoutingHistory {
    pub fn new(num_layers: usize, top_k: usize) -> Self {
        Self { top_k, ids: vec![Vec::new(); num_layers], tokens: Vec::new(), ahead: None }
    }

    /// The token routed at `position` (`None` if not recorded): what the draws at `position + 1`
    /// hash.
    pub fn token(&self, position: usize) -> Option<u32> {
        self.tokens.get(position).copied()
    }

    /// For a pass of `tokens` at positions `start..`: the token before each row (this history's
    /// at `start − 1` for the first, `None` at the sequence's start; then the pass's own) — what
    /// each row's draws hash ([`crate::Router::synthetic_choice_in`]'s `before`).
    pub fn befores(&self, start: usize, tokens: &[u32]) -> Vec<Option<u32>> {
        let first = start.checked_sub(1).and_then(|p| self.token(p));
        std::iter::once(first).chain(tokens.iter().map(|&t| Some(t))).take(tokens.len()).collect()
    }

    /// Records a pass of `tokens` at positions `start..` ([`Self::record_tokens`]) and returns
    /// the token before each of its rows ([`Self::befores`], read before the recording).
    pub fn record_pass(&mut self, start: usize, tokens: &[u32]) -> Vec<Option<u32>> {
        let before = self.befores(start, tokens);
        self.record_tokens(start, tokens);
        before
    }

    /// Records `tokens` as routed at positions `start..` (a pass's rows, before its choice), and
    /// forgets any choice drawn ahead: a pass can rewrite the positions an ahead choice was drawn
    /// from.
    pub fn record_tokens(&mut self, start: usize, tokens: &[u32]) {
        self.ahead = None;
        if self.tokens.len() < start + tokens.len() {
            self.tokens.resize(start + tokens.len(), 0);
        }
        self.tokens[start..start + tokens.len()].copy_from_slice(tokens);
    }

    /// Marks `position`'s choice as drawn ahead in every layer (written there with
    /// [`Self::layers_mut`] from the choice and the token at `position − 1`, before any pass
    /// routes `position`).
    pub fn set_ahead(&mut self, position: usize) {
        self.ahead = Some(position);
    }

    /// Whether a pass of `rows` rows at `start` finds its choice drawn ahead (one row at the
    /// position [`Self::set_ahead`] marked, no pass recorded since): then every layer's choice at
    /// `start` is what routing it now would draw, since a choice depends only on the history
    /// before its position. The mark is used up either way.
    pub fn take_ahead(&mut self, start: usize, rows: usize) -> bool {
        let ahead = self.ahead.take();
        rows == 1 && ahead == Some(start)
    }

    /// The experts `layer` chose at `position` (`None` if not recorded).
    pub fn get(&self, layer: usize, position: usize) -> Option<&[u32]> {
        let r = position * self.top_k..(position + 1) * self.top_k;
        self.ids.get(layer).and_then(|v| v.get(r))
    }

    /// Records `ids` (`top_k` of them) as `layer`'s choice at `position` (nothing past the layers
    /// the history was made for).
    pub fn set(&mut self, layer: usize, position: usize, ids: &[u32]) {
        if let Some(mut h) = self.layer_mut(layer) {
            h.set(position, ids);
        }
    }

    /// `layer`'s part of the history, writable apart from the other layers' (`None` past the
    /// layers the history was made for).
    pub fn layer_mut(&mut self, layer: usize) -> Option<LayerHistory<'_>> {
        let top_k = self.top_k;
        self.ids.get_mut(layer).map(|ids| LayerHistory { top_k, ids })
    }

    /// Every layer's part, in layer order (each writable on its own thread).
    pub fn layers_mut(&mut self) -> Vec<LayerHistory<'_>> {
        let top_k = self.top_k;
        self.ids.iter_mut().map(|ids| LayerHistory { top_k, ids }).collect()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.ids.iter().map(|v| v.capacity() * 4).sum::<usize>() + self.tokens.capacity() * 4
    }

    /// Every layer's choices and the tokens at positions `start..start + len` (zeros where not
    /// recorded).
    pub fn rows(&self, start: usize, len: usize) -> RoutingRows {
        let copy = |v: &[u32], k: usize| {
            let mut out = vec![0; len * k];
            let have = v.len().saturating_sub(start * k).min(len * k);
            if have > 0 {
                out[..have].copy_from_slice(&v[start * k..start * k + have]);
            }
            out
        };
        RoutingRows {
            ids: self.ids.iter().map(|v| copy(v, self.top_k)).collect(),
            tokens: copy(&self.tokens, 1),
        }
    }

    /// Writes [`Self::rows`]' output back at `start` (a pass's recording: see
    /// [`Self::record_tokens`]).
    pub fn set_rows(&mut self, start: usize, rows: &RoutingRows) {
        let k = self.top_k.max(1);
        for (layer, r) in rows.ids.iter().enumerate() {
            for (i, ids) in r.chunks_exact(k).enumerate() {
                self.set(layer, start + i, ids);
            }
        }
        self.record_tokens(start, &rows.tokens);
    }
}

/// splitmix64's finaliser (Steele, Lea, Flood 2014).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hash(parts: &[u64]) -> u64 {
    parts.iter().fold(0x243F_6A88_85A3_08D3, |h, &p| hash_more(h, p))
}

/// `hash(parts ++ [p])` from `h = hash(parts)`: draws that share all parts but the last hash
/// their common parts once.
fn hash_more(h: u64, p: u64) -> u64 {
    mix(h ^ p)
}

/// Uniform in [0, 1).
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

// Purposes of the hashed draws.
const RANK: u64 = 1;
const KNOT: u64 = 2;
const KEEP: u64 = 3;
const DRAW: u64 = 4;
const PREGATE_KEEP: u64 = 5;
const PREGATE_DRAW: u64 = 6;

/// One layer's part of a [`RoutingHistory`]: its choices at every position (`[positions ·
/// top_k]`).
#[derive(Debug)]
pub struct LayerHistory<'a> {
    top_k: usize,
    ids: &'a mut Vec<u32>,
}

impl LayerHistory<'_> {
    /// The experts chosen at `position` (`None` if not recorded).
    pub fn get(&self, position: usize) -> Option<&[u32]> {
        self.ids.get(position * self.top_k..(position + 1) * self.top_k)
    }

    /// Records `ids` (`top_k` of them) as the choice at `position`.
    pub fn set(&mut self, position: usize, ids: &[u32]) {
        let k = self.top_k;
        if self.ids.len() < (position + 1) * k {
            self.ids.resize((position + 1) * k, 0);
        }
        self.ids[position * k..(position + 1) * k].copy_from_slice(&ids[..k]);
    }
}

/// The routing process of one MoE layer of a synthetic model.
#[derive(Debug, Clone)]
pub struct SyntheticRouter {
    cfg: SyntheticRouting,
    layer: u64,
    top_k: usize,
    /// `[experts]`: `-zipf · ln(rank)` of each expert (ranks a random permutation per layer).
    base: Vec<f64>,
    /// The drift knots of the segments used last (`knot(e, i)` for every expert `e`, by `i`):
    /// each costs two hashes, a logarithm and a cosine per expert, and a segment serves
    /// `drift_period` positions. At most [`KNOTS_KEPT`]; the same values as computed afresh.
    knots: Arc<Mutex<KeptKnots>>,
    /// The popularity at the positions asked for last (`(position, popularity(position))`): a
    /// batched step draws every sequence's experts at its own position, and sequences that
    /// started together share positions, so each such position's 128 exponentials are taken
    /// once per layer instead of once per sequence (they were ~40% of a draw's ~4 µs). At most
    /// [`POPULARITY_KEPT`]; the same values as computed afresh.
    popular: Arc<Mutex<KeptPopularity>>,
    /// `uniform`'s weights (all 1).
    flat: Arc<Weights>,
}

/// Unnormalised weights of every expert `[experts]` and their running sums (`cum[e]` = `w[0] +
/// … + w[e]`, added in order), which a draw searches.
#[derive(Debug, PartialEq)]
struct Weights {
    w: Box<[f64]>,
    cum: Box<[f64]>,
}

impl Weights {
    fn new(w: Vec<f64>) -> Self {
        let cum = w
            .iter()
            .scan(0.0, |acc, &x| {
                *acc += x;
                Some(*acc)
            })
            .collect();
        Self { w: w.into(), cum }
    }
}

/// Drift knots by segment: `(i, [knot(e, i) for every expert e])`.
type KeptKnots = Vec<(u64, Arc<[f64]>)>;

/// Popularity by position: `(position, [weight of every expert])`, and the entry the next
/// position overwrites once [`POPULARITY_KEPT`] are kept (a ring).
type KeptPopularity = (Vec<(usize, Arc<Weights>)>, usize);

/// Segments whose drift knots a [`SyntheticRouter`] keeps.
const KNOTS_KEPT: usize = 4;

/// Draws over all experts before [`SyntheticRouter::draw`] walks the experts left: rejections are
/// rare unless nearly all of the weight is excluded (a top-k near the expert count).
const REJECTIONS_MAX: usize = 32;

/// Positions whose popularity a [`SyntheticRouter`] keeps (a batched step's sequences, and a
/// verify pass's rows, each at a position or two).
const POPULARITY_KEPT: usize = 32;

impl SyntheticRouter {
    /// The process of MoE layer `layer` with `experts` experts, `top_k` per token.
    pub fn new(cfg: SyntheticRouting, layer: usize, experts: usize, top_k: usize) -> Self {
        let mut rank: Vec<usize> = (1..=experts).collect();
        for j in (1..experts).rev() {
            let i = (hash(&[cfg.seed, RANK, layer as u64, j as u64]) % (j as u64 + 1)) as usize;
            rank.swap(i, j);
        }
        let base = rank.iter().map(|&r| -cfg.zipf * (r as f64).ln()).collect();
        Self {
            cfg,
            layer: layer as u64,
            top_k: top_k.min(experts),
            base,
            knots: Arc::new(Mutex::new(Vec::new())),
            popular: Arc::new(Mutex::new((Vec::new(), 0))),
            flat: Arc::new(Weights::new(vec![1.0; experts])),
        }
    }

    pub fn config(&self) -> &SyntheticRouting {
        &self.cfg
    }

    fn experts(&self) -> usize {
        self.base.len()
    }

    /// A standard normal per (expert, knot) (Box–Muller).
    fn knot(&self, e: usize, i: u64) -> f64 {
        let h = |n| unit(hash(&[self.cfg.seed, KNOT, self.layer, e as u64, i, n]));
        let (u1, u2) = (1.0 - h(0), h(1));
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `knot(e, i)` for every expert, from the kept segments or computed (and kept).
    fn knots(&self, i: u64) -> Arc<[f64]> {
        let mut kept = self.knots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = kept.iter().find(|(j, _)| *j == i) {
            return k.clone();
        }
        let k: Arc<[f64]> = (0..self.experts()).map(|e| self.knot(e, i)).collect();
        if kept.len() == KNOTS_KEPT {
            kept.remove(0);
        }
        kept.push((i, k.clone()));
        k
    }

    /// Unnormalised popularity of every expert at `position`: kept, or computed (and kept).
    fn popularity(&self, position: usize) -> Arc<Weights> {
        let mut guard = self.popular.lock().unwrap_or_else(|e| e.into_inner());
        let (kept, next) = &mut *guard;
        if let Some((_, w)) = kept.iter().find(|(p, _)| *p == position) {
            return w.clone();
        }
        let w = Arc::new(Weights::new(self.popularity_at(position)));
        if kept.len() < POPULARITY_KEPT {
            kept.push((position, w.clone()));
        } else {
            kept[*next] = (position, w.clone());
            *next = (*next + 1) % POPULARITY_KEPT;
        }
        w
    }

    /// [`Self::popularity`] computed afresh.
    fn popularity_at(&self, position: usize) -> Vec<f64> {
        if self.cfg.drift == 0.0 {
            return self.base.iter().map(|b| b.exp()).collect();
        }
        let s = position as f64 / self.cfg.drift_period as f64;
        let (i, f) = (s.floor() as u64, s.fract());
        let (a, b) = (self.knots(i), self.knots(i + 1));
        (0..self.experts())
            .map(|e| (self.base[e] + self.cfg.drift * ((1.0 - f) * a[e] + f * b[e])).exp())
            .collect()
    }

    /// Draws from `weights` among experts not `excluded`, or `None` if none is left: a draw `u`
    /// over all experts (the first whose running sum exceeds `u` · total, a binary search),
    /// drawn again with the next `u` while it lands on an excluded expert — rejection sampling,
    /// so expert `e` comes with probability `w[e] / Σ_{not excluded} w`, as a draw over the
    /// experts left would give. After [`REJECTIONS_MAX`] rejections, one walk over the experts
    /// left. `u` gives a fresh uniform number in [0, 1) at each call.
    fn draw(weights: &Weights, excluded: &[bool], u: &mut impl FnMut() -> f64) -> Option<u32> {
        let total = weights.cum.last().copied().unwrap_or(0.0);
        if total > 0.0 {
            for _ in 0..REJECTIONS_MAX {
                let target = u() * total;
                let e = weights.cum.partition_point(|&c| c <= target).min(weights.w.len() - 1);
                if !excluded[e] && weights.w[e] > 0.0 {
                    return Some(e as u32);
                }
            }
        }
        let left = |(_, (w, x)): &(usize, (&f64, &bool))| !**x && **w > 0.0;
        let total: f64 =
            weights.w.iter().zip(excluded).enumerate().filter(left).map(|(_, (w, _))| w).sum();
        if total <= 0.0 {
            return None;
        }
        let mut target = u() * total;
        let mut last = None;
        for (e, (&w, _)) in weights.w.iter().zip(excluded).enumerate().filter(left) {
            last = Some(e as u32);
            if target < w {
                return last;
            }
            target -= w;
        }
        last
    }

    /// Fills `chosen` up to top-k with draws from `weights` (uniform weights for `uniform`),
    /// never an expert in `excluded`, then, if the exclusions left too few, not one in `chosen`.
    fn fill(&self, chosen: &mut Vec<u32>, excluded: &mut [bool], weights: &Weights, key: [u64; 4]) {
        let mut n = 0u64;
        let common = hash(&[self.cfg.seed, key[0], self.layer, key[1], key[2], key[3]]);
        let mut u = || {
            n += 1;
            unit(hash_more(common, n - 1))
        };
        while chosen.len() < self.top_k {
            match Self::draw(weights, excluded, &mut u) {
                Some(e) => {
                    excluded[e as usize] = true;
                    chosen.push(e);
                }
                None => {
                    excluded.iter_mut().for_each(|x| *x = false);
                    chosen.iter().for_each(|&e| excluded[e as usize] = true);
                }
            }
        }
    }

    /// The top-k experts (unordered) at `position` of a sequence whose token at `position − 1`
    /// is `before` and whose experts there, in this layer, are `prev` (both `None` at its
    /// start). The token at `position` itself plays no part, so the choice can be drawn before
    /// that token is known.
    pub fn route(&self, position: usize, before: Option<u32>, prev: Option<&[u32]>) -> Vec<u32> {
        let e = self.experts();
        let token = before.map_or(u64::MAX, u64::from);
        let mut chosen = Vec::with_capacity(self.top_k);
        let mut excluded = vec![false; e];
        let weights = match self.cfg.mode {
            RoutingMode::Uniform => self.flat.clone(),
            RoutingMode::Realistic => {
                let common = hash(&[self.cfg.seed, KEEP, self.layer, position as u64, token]);
                for &x in prev.unwrap_or_default() {
                    let keep = unit(hash_more(common, x as u64)) < self.cfg.reuse;
                    if let Some(slot) = excluded.get_mut(x as usize) {
                        *slot = true;
                        if keep && chosen.len() < self.top_k {
                            chosen.push(x);
                        }
                    }
                }
                self.popularity(position)
            }
        };
        self.fill(&mut chosen, &mut excluded, &weights, [DRAW, position as u64, token, 0]);
        chosen
    }

    /// Pre-gating's prediction of this layer's experts for `token` at `position` whose routing is
    /// `actual`: each actual expert with probability `pregate_recall`, the others replaced by
    /// popularity draws (uniform for `uniform`).
    pub fn predict(&self, position: usize, token: u32, actual: &[u32]) -> Vec<u32> {
        let e = self.experts();
        let mut excluded = vec![false; e];
        actual.iter().for_each(|&x| excluded[x as usize] = true);
        let common =
            hash(&[self.cfg.seed, PREGATE_KEEP, self.layer, position as u64, token as u64]);
        let mut chosen: Vec<u32> = actual
            .iter()
            .copied()
            .filter(|&x| unit(hash_more(common, x as u64)) < self.cfg.pregate_recall)
            .collect();
        let weights = match self.cfg.mode {
            RoutingMode::Uniform => self.flat.clone(),
            RoutingMode::Realistic => self.popularity(position),
        };
        self.fill(
            &mut chosen,
            &mut excluded,
            &weights,
            [PREGATE_DRAW, position as u64, token as u64, 0],
        );
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(cfg: SyntheticRouting, experts: usize, k: usize, tokens: usize) -> Vec<Vec<u32>> {
        let r = SyntheticRouter::new(cfg, 3, experts, k);
        let mut prev: Option<Vec<u32>> = None;
        (0..tokens)
            .map(|p| {
                let ids = r.route(p, Some((p as u32 * 7919) % 1000), prev.as_deref());
                prev = Some(ids.clone());
                ids
            })
            .collect()
    }

    fn distinct(ids: &[u32]) -> bool {
        let mut v = ids.to_vec();
        v.sort_unstable();
        v.dedup();
        v.len() == ids.len()
    }

    #[test]
    fn kept_drift_knots_and_popularity_give_the_fresh_popularity() {
        let r = SyntheticRouter::new(SyntheticRouting::realistic(9), 2, 64, 8);
        let fresh = |p: usize| {
            let s = p as f64 / r.cfg.drift_period as f64;
            let (i, f) = (s.floor() as u64, s.fract());
            (0..64)
                .map(|e| {
                    (r.base[e] + r.cfg.drift * ((1.0 - f) * r.knot(e, i) + f * r.knot(e, i + 1)))
                        .exp()
                })
                .collect::<Vec<f64>>()
        };
        // Forward, far ahead (evicting knots), back to an evicted segment, positions asked
        // again (kept popularity), then more positions than are kept and the first ones again.
        let many = (1000..1000 + 2 * POPULARITY_KEPT).chain([0, 1, 255]);
        for p in
            [0, 1, 255, 256, 700, 5000, 9000, 20_000, 3, 300, 3, 0, 20_000].into_iter().chain(many)
        {
            assert_eq!(*r.popularity(p), Weights::new(fresh(p)), "position {p}");
        }
        assert!(r.knots.lock().unwrap().len() <= KNOTS_KEPT);
        assert!(r.popular.lock().unwrap().0.len() <= POPULARITY_KEPT);
    }

    #[test]
    fn a_draw_follows_the_weights_of_the_experts_left() {
        // Zipf-like weights with the heaviest excluded (as a realistic draw excludes the previous
        // token's popular experts), and the same with all but two excluded (mostly rejections,
        // then the walk): each expert's share of the draws against w / Σ over the experts left.
        let w: Vec<f64> = (1..=16).map(|r| (r as f64).powf(-1.2)).collect();
        let weights = Weights::new(w.clone());
        for excluded_ids in [vec![0usize, 1, 2, 5], (0..14).collect()] {
            let mut excluded = vec![false; 16];
            excluded_ids.iter().for_each(|&e| excluded[e] = true);
            let left: f64 = w.iter().zip(&excluded).filter(|(_, &x)| !x).map(|(w, _)| w).sum();
            let mut n = 0u64;
            let mut u = || {
                n += 1;
                unit(hash(&[7, n]))
            };
            let draws = 200_000;
            let mut count = [0usize; 16];
            for _ in 0..draws {
                count[SyntheticRouter::draw(&weights, &excluded, &mut u).unwrap() as usize] += 1;
            }
            for e in 0..16 {
                let expected = if excluded[e] { 0.0 } else { w[e] / left };
                let got = count[e] as f64 / draws as f64;
                assert!((got - expected).abs() < 0.005, "expert {e}: {got} against {expected}");
            }
        }
        let all = vec![true; 16];
        assert_eq!(SyntheticRouter::draw(&weights, &all, &mut || 0.5), None);
    }

    #[test]
    fn every_choice_is_top_k_distinct_and_reproducible() {
        for cfg in [
            SyntheticRouting::realistic(5),
            SyntheticRouting::uniform(5),
            SyntheticRouting { reuse: 1.0, ..SyntheticRouting::realistic(5) },
        ] {
            for (e, k) in [(128, 8), (16, 4), (8, 4), (4, 4)] {
                let t = trace(cfg, e, k, 200);
                assert!(
                    t.iter().all(|ids| ids.len() == k
                        && distinct(ids)
                        && ids.iter().all(|&x| (x as usize) < e)),
                    "{cfg:?} {e}/{k}"
                );
                assert_eq!(t, trace(cfg, e, k, 200));
            }
        }
    }

    #[test]
    fn measured_reuse_is_the_parameter_and_uniform_has_chance_reuse() {
        let reuse = |t: &[Vec<u32>], k: usize| {
            let n: usize =
                t.windows(2).map(|w| w[1].iter().filter(|e| w[0].contains(e)).count()).sum();
            n as f64 / ((t.len() - 1) * k) as f64
        };
        let r = reuse(&trace(SyntheticRouting::realistic(1), 128, 8, 4000), 8);
        assert!((0.33..0.37).contains(&r), "realistic reuse {r}");
        let u = reuse(&trace(SyntheticRouting::uniform(1), 128, 8, 4000), 8);
        assert!((0.04..0.09).contains(&u), "uniform reuse {u} (chance 8/128)");
    }

    #[test]
    fn pregate_prediction_has_the_configured_recall() {
        let cfg = SyntheticRouting::realistic(9);
        let r = SyntheticRouter::new(cfg, 0, 128, 8);
        let (mut hit, mut n) = (0, 0);
        let mut prev: Option<Vec<u32>> = None;
        for p in 0..2000 {
            let actual = r.route(p, Some(11), prev.as_deref());
            let pred = r.predict(p, 11, &actual);
            assert!(pred.len() == 8 && distinct(&pred));
            hit += pred.iter().filter(|e| actual.contains(e)).count();
            n += 8;
            prev = Some(actual);
        }
        let recall = hit as f64 / n as f64;
        assert!((0.77..0.83).contains(&recall), "{recall}");
    }

    /// A choice drawn ahead is taken once, by a one-row pass at its position, and forgotten
    /// by any pass recorded before it is taken (which may rewrite what it was drawn from).
    #[test]
    fn a_choice_drawn_ahead_is_taken_once_and_forgotten_by_any_pass() {
        let mut h = RoutingHistory::new(2, 2);
        h.record_tokens(0, &[5, 6, 7]);
        h.set_ahead(3);
        assert!(!h.take_ahead(3, 2), "a verify pass draws its rows");
        assert!(!h.take_ahead(3, 1), "used up");
        h.set_ahead(3);
        assert!(!h.take_ahead(2, 1), "another position");
        assert!(!h.take_ahead(3, 1));
        h.set_ahead(3);
        h.record_tokens(2, &[9]);
        assert!(!h.take_ahead(3, 1), "a pass rewrote position 2");
        h.set_ahead(3);
        h.set_rows(0, &h.rows(0, 1));
        assert!(!h.take_ahead(3, 1), "a prefix restored");
        h.set_ahead(3);
        assert!(h.take_ahead(3, 1));
        assert!(!h.take_ahead(3, 1), "taken once");
    }

    /// A pass's rows hash the token before each: the history's before the pass's first row
    /// (none at the sequence's start), then the pass's own; recording the pass keeps its tokens
    /// for the next one and forgets a choice drawn ahead.
    #[test]
    fn a_pass_records_its_tokens_and_returns_the_ones_before_its_rows() {
        let mut h = RoutingHistory::new(2, 2);
        assert_eq!(h.record_pass(0, &[5, 6, 7]), [None, Some(5), Some(6)]);
        assert_eq!(h.befores(3, &[8, 9]), [Some(7), Some(8)]);
        assert_eq!(h.token(3), None, "befores records nothing");
        h.set_ahead(3);
        assert_eq!(h.record_pass(3, &[8]), [Some(7)]);
        assert_eq!((h.token(3), h.take_ahead(3, 1)), (Some(8), false));
        assert_eq!(h.record_pass(1, &[4]), [Some(5)], "a rewrite reads the position before");
        assert_eq!(h.token(1), Some(4));
    }

    /// A block's rows carry the tokens with the choices (a restored prefix's next position
    /// hashes its last token).
    #[test]
    fn rows_carry_choices_and_tokens() {
        let mut h = RoutingHistory::new(2, 2);
        h.record_tokens(0, &[5, 6, 7]);
        for p in 0..3 {
            h.set(0, p, &[p as u32, 9]);
            h.set(1, p, &[9, p as u32]);
        }
        let rows = h.rows(1, 3);
        assert_eq!(rows.tokens, vec![6, 7, 0]);
        assert_eq!(rows.ids[1], vec![9, 1, 9, 2, 0, 0]);
        let mut g = RoutingHistory::new(2, 2);
        g.set_rows(1, &h.rows(1, 2));
        assert_eq!((g.token(1), g.token(2), g.token(0)), (Some(6), Some(7), Some(0)));
        assert_eq!((g.get(0, 2), g.get(1, 1)), (Some(&[2, 9][..]), Some(&[9, 1][..])));
    }

    #[test]
    fn history_round_trips_and_overwrites() {
        let mut h = RoutingHistory::new(2, 2);
        assert_eq!(h.get(1, 0), None);
        h.set(1, 0, &[3, 4]);
        h.set(1, 1, &[5, 6]);
        h.set(1, 0, &[7, 8]);
        assert_eq!(h.get(1, 0), Some(&[7, 8][..]));
        assert_eq!(h.get(1, 1), Some(&[5, 6][..]));
        assert_eq!(h.get(0, 0), None);
    }
}
