//! Adaptive draft length: each round picks the number of draft tokens `N ∈ [0, max]` that maximises
//! the expected tokens per second, from online measurements:
//!
//! - acceptance per draft position: `α_i` = P(draft token i accepted | tokens before it accepted), an
//!   exponential moving average over rounds; expected tokens of a round drafting `N` is
//!   `E(N) = 1 + Σ_{j=1..N} Π_{i≤j} α_i` (with one α for every position this is the closed form
//!   `(1 − α^(N+1)) / (1 − α)` of Leviathan et al. 2023, §3.1);
//! - verify time per width `N + 1` (EMA of measured ms per `N`). With streamed experts a verify pass
//!   reads the union of its tokens' experts, so its cost grows with that fan-out; unmeasured widths
//!   are estimated from the nearest measured one scaled by the expected number of distinct experts
//!   per layer (`U(N) = E · (1 − (1 − k/E)^(N+1))` under uniform routing, replaced by the measured
//!   fan-out where there is one) for streaming, by a small per-token slope when resident;
//! - draft time per drafted token (EMA).
//!
//! `N = 0` is plain decoding and is always a candidate, so a source that does not pay is turned
//! down to 0. Widths other than the best are re-measured now and then (exploration with back-off:
//! the interval doubles each time exploring does not change the choice), which keeps the estimates
//! current as acceptance and cache hit rates change. Exploration has a budget: what probes lose
//! against the best choice (measured time minus their tokens at the best choice's ms per token) is
//! kept under [`EXPLORE_BUDGET`] of the time spent, so an expensive probe (a 16-token block whose
//! streamed experts must all be read) waits until the run is long enough to afford it.

/// Fan-out model for streamed experts: experts per layer `E` and experts per token `k`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FanoutModel {
    pub experts: usize,
    pub top_k: usize,
}

impl FanoutModel {
    /// Expected distinct experts per layer for `tokens` tokens under uniform routing.
    pub fn expected_union(&self, tokens: usize) -> f64 {
        let (e, k) = (self.experts as f64, self.top_k as f64);
        e * (1.0 - (1.0 - k / e).powi(tokens as i32))
    }
}

const EMA: f64 = 0.15;
/// Most of the decode time exploration may lose against the best choice.
pub const EXPLORE_BUDGET: f64 = 0.03;
/// Prior acceptance per position before anything is measured.
const ALPHA_PRIOR: f64 = 0.5;
/// Resident verify cost grows by this fraction of a one-token pass per extra token (prior).
const RESIDENT_SLOPE: f64 = 0.08;

/// The adaptive (or fixed) draft-length policy of one sequence.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    max: usize,
    fixed: Option<usize>,
    fanout: Option<FanoutModel>,
    alpha: Vec<f64>,
    /// Whether position `i` was ever decided (drafted with every earlier position accepted).
    alpha_seen: Vec<bool>,
    /// EMA of verify ms and of measured distinct experts per layer, per draft length N.
    verify_ms: Vec<Option<f64>>,
    /// Samples behind each `verify_ms` (early samples are averaged, not EMA'd).
    verify_n: Vec<u32>,
    union: Vec<Option<f64>>,
    draft_ms_per_token: Option<f64>,
    /// Block drafters (DFlash): one draft pass per round whatever `N`, timed per round.
    block_draft: bool,
    draft_ms_per_round: Option<f64>,
    rounds: u64,
    rounds_observed: u64,
    next_explore: u64,
    explore_every: u64,
    last_best: usize,
    /// Counts exploration probes: they go above the best, below it, and to plain decoding in turn
    /// (so that a stale baseline, e.g. plain decoding timed on a cold expert cache, is re-measured).
    probes: u64,
    /// ms of every observed round, and what probes lost against the best choice (≥ 0).
    spent_ms: f64,
    explore_loss_ms: f64,
    /// The best width when the current round is a probe (its loss is measured against it).
    probing: Option<usize>,
}

impl DraftPolicy {
    /// `max`: most draft tokens per round. `fixed`: always draft `min(fixed, max)` (no adaptation).
    /// `fanout`: set when routed experts are streamed.
    pub fn new(max: usize, fixed: Option<usize>, fanout: Option<FanoutModel>) -> Self {
        Self {
            max,
            fixed,
            fanout,
            alpha: vec![ALPHA_PRIOR; max + 1],
            alpha_seen: vec![false; max + 1],
            verify_ms: vec![None; max + 1],
            verify_n: vec![0; max + 1],
            union: vec![None; max + 1],
            draft_ms_per_token: None,
            block_draft: false,
            draft_ms_per_round: None,
            rounds: 0,
            rounds_observed: 0,
            next_explore: 4,
            explore_every: 4,
            last_best: 0,
            probes: 0,
            spent_ms: 0.0,
            explore_loss_ms: 0.0,
            probing: None,
        }
    }

    /// A draft source whose cost does not depend on `N` (one pass proposes a whole block, DFlash):
    /// drafting costs the measured ms per round when `N > 0`, nothing when `N = 0`.
    pub fn with_block_draft(mut self) -> Self {
        self.block_draft = true;
        self
    }

    /// Expected tokens emitted by a round that drafts `n`.
    pub fn expected_tokens(&self, n: usize) -> f64 {
        let mut e = 1.0;
        let mut run = 1.0;
        for i in 1..=n.min(self.max) {
            run *= self.alpha_at(i);
            e += run;
        }
        e
    }

    /// Acceptance at draft position `i`: its own estimate once measured, else the nearest measured
    /// position before it (the prior at position 1). A source that is mostly drafted short (its
    /// longer widths only probed now and then) would otherwise keep the prior at the later
    /// positions and never find out that longer drafts pay; for n-gram and model drafts the
    /// conditional acceptance of a later position is rarely below an earlier one's.
    fn alpha_at(&self, i: usize) -> f64 {
        (1..=i).rev().find(|&j| self.alpha_seen[j]).map_or(self.alpha[i], |j| self.alpha[j])
    }

    fn union_at(&self, n: usize) -> f64 {
        match (self.union[n], self.fanout) {
            (Some(u), _) => u,
            (None, Some(f)) => f.expected_union(n + 1),
            (None, None) => 1.0,
        }
    }

    /// Estimated verify ms for `n` draft tokens (`None` before any pass was measured).
    pub fn verify_estimate(&self, n: usize) -> Option<f64> {
        if let Some(v) = self.verify_ms[n] {
            return Some(v);
        }
        // Nearest measured width.
        let (m, vm) = (0..=self.max)
            .filter_map(|m| self.verify_ms[m].map(|v| (m, v)))
            .min_by_key(|&(m, _)| m.abs_diff(n))?;
        Some(match self.fanout {
            Some(_) => vm * self.union_at(n) / self.union_at(m),
            None => vm * (1.0 + RESIDENT_SLOPE * n as f64) / (1.0 + RESIDENT_SLOPE * m as f64),
        })
    }

    /// Estimated ms of a round drafting `n` (draft + verify).
    pub fn round_estimate(&self, n: usize) -> Option<f64> {
        let draft = match (self.block_draft, n) {
            (_, 0) => 0.0,
            (true, _) => self.draft_ms_per_round.unwrap_or(0.0),
            (false, _) => self.draft_ms_per_token.unwrap_or(0.0) * n as f64,
        };
        Some(self.verify_estimate(n)? + draft)
    }

    /// Expected tokens per ms when drafting `n`.
    pub fn rate(&self, n: usize) -> Option<f64> {
        Some(self.expected_tokens(n) / self.round_estimate(n)?.max(1e-6))
    }

    /// ms a round of `ms` that emitted `tokens` lost against rounds of width `best`.
    fn loss(&self, ms: f64, tokens: f64, best: usize) -> f64 {
        ms - tokens / self.rate(best).unwrap_or(f64::INFINITY)
    }

    /// The draft length for the next round, at most `available` (what the source can propose, the
    /// tokens left to generate, the room in the context).
    pub fn choose(&mut self, available: usize) -> usize {
        let cap = available.min(self.max);
        if let Some(f) = self.fixed {
            return f.min(cap);
        }
        self.rounds += 1;
        if self.verify_ms[0].is_none() {
            return 0; // measure plain decoding first
        }
        let best = (0..=cap)
            .max_by(|&a, &b| self.rate(a).unwrap_or(0.0).total_cmp(&self.rate(b).unwrap_or(0.0)))
            .unwrap_or(0);
        if best != self.last_best && available >= self.max {
            // The choice moved: explore around it again soon.
            self.last_best = best;
            self.explore_every = 4;
        }
        if self.rounds >= self.next_explore && cap > 0 {
            // Re-measure a neighbour of the best (its estimate may be stale or a prior) above, below,
            // and plain decoding, in turn.
            let probe = match ((self.probes + 1) % 3, best) {
                // A block drafter pays the same pass for any N: probing the whole block measures
                // acceptance at every position at once.
                (_, 0) if self.block_draft => cap,
                (_, 0) => 1,
                (0, _) => 0,
                (1, b) if b < cap => b + 1,
                (_, b) => b - 1,
            };
            let cost = self.round_estimate(probe).unwrap_or(0.0);
            let loss = self.loss(cost, self.expected_tokens(probe), best).max(0.0);
            if self.explore_loss_ms + loss > EXPLORE_BUDGET * (self.spent_ms + cost) {
                return best; // not affordable yet: the budget grows with the time spent
            }
            self.probes += 1;
            self.probing = Some(best);
            self.next_explore = self.rounds + self.explore_every;
            self.explore_every = (self.explore_every * 2).min(256);
            return probe;
        }
        best
    }

    /// Records a round: `n` drafted, `accepted` of them accepted, timings, and (MoE models) the
    /// measured distinct experts per layer of the verify pass, which estimates use only when
    /// experts are streamed (a fan-out model was given).
    pub fn observe(
        &mut self,
        n: usize,
        accepted: usize,
        draft_ms: f64,
        verify_ms: f64,
        union: Option<f64>,
    ) {
        let ema = |old: Option<f64>, x: f64| Some(old.map_or(x, |o| o + EMA * (x - o)));
        let n = n.min(self.max);
        self.spent_ms += draft_ms + verify_ms;
        if let Some(best) = self.probing.take() {
            let loss = self.loss(draft_ms + verify_ms, (accepted + 1) as f64, best);
            self.explore_loss_ms = (self.explore_loss_ms + loss).max(0.0);
        }
        // The first round runs on a cold expert cache: it says nothing about later rounds.
        self.rounds_observed += 1;
        if self.rounds_observed == 1 && self.fanout.is_some() {
            return;
        }
        // A measurement off by more than 2× from the estimate means the regime changed (the expert
        // cache warmed up, the machine got busy): restart that width's mean from it.
        if self.verify_ms[n].is_some_and(|o| verify_ms > 2.0 * o || verify_ms < 0.5 * o) {
            self.verify_n[n] = 0;
        }
        // A plain mean over the first samples, then an EMA: one slow early sample must not make a
        // width look expensive (or another cheap) for long.
        self.verify_n[n] += 1;
        let w = (1.0 / self.verify_n[n] as f64).max(EMA);
        self.verify_ms[n] = Some(self.verify_ms[n].map_or(verify_ms, |o| o + w * (verify_ms - o)));
        if let Some(u) = union {
            self.union[n] = ema(self.union[n], u);
        }
        if n > 0 {
            self.draft_ms_per_token = ema(self.draft_ms_per_token, draft_ms / n as f64);
            self.draft_ms_per_round = ema(self.draft_ms_per_round, draft_ms);
        }
        // Positions 1..=min(accepted + 1, n) were decided this round.
        for i in 1..=(accepted + 1).min(n) {
            let hit = if i <= accepted { 1.0 } else { 0.0 };
            if !self.alpha_seen[i] {
                // First measurement: start from the estimate this position had been using.
                self.alpha[i] = self.alpha_at(i);
                self.alpha_seen[i] = true;
            }
            self.alpha[i] += EMA * (hit - self.alpha[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_matches_closed_form() {
        let mut p = DraftPolicy::new(6, None, None);
        p.alpha = vec![0.7; 7];
        p.alpha_seen = vec![true; 7];
        for n in 0..=6 {
            let closed = (1.0 - 0.7f64.powi(n as i32 + 1)) / (1.0 - 0.7);
            assert!((p.expected_tokens(n) - closed).abs() < 1e-12);
        }
    }

    /// Cheap verification and high acceptance → long drafts; expensive streamed fan-out and low
    /// acceptance → plain decoding.
    #[test]
    fn picks_long_drafts_when_they_pay_and_none_when_they_do_not() {
        let mut p = DraftPolicy::new(8, None, None);
        assert_eq!(p.choose(8), 0, "first measures plain decoding");
        p.observe(0, 0, 0.0, 10.0, None);
        for _ in 0..40 {
            p.observe(8, 8, 0.0, 12.0, None);
        }
        p.next_explore = u64::MAX;
        assert_eq!(p.choose(8), 8);

        let mut s = DraftPolicy::new(8, None, Some(FanoutModel { experts: 128, top_k: 8 }));
        s.observe(0, 0, 0.0, 5000.0, Some(8.0)); // cold first round: ignored
        s.observe(0, 0, 0.0, 100.0, Some(8.0));
        for _ in 0..40 {
            s.observe(4, 0, 1.0, 330.0, Some(30.0));
        }
        s.next_explore = u64::MAX;
        assert_eq!(s.choose(8), 0);
        assert_eq!(s.choose(0), 0);
    }

    /// Resident: a source drafted one token at a time, always accepted, with a verify cost that
    /// grows slowly with width: the untried longer widths inherit position 1's acceptance, so
    /// the policy moves to long drafts instead of staying at the prior (0.5) for positions 2+.
    #[test]
    fn untried_positions_inherit_the_measured_acceptance() {
        let mut p = DraftPolicy::new(4, None, None);
        p.observe(0, 0, 0.0, 10.0, None);
        for _ in 0..40 {
            p.observe(1, 1, 0.0, 12.0, None);
        }
        p.observe(4, 4, 0.0, 16.0, None);
        p.next_explore = u64::MAX;
        assert!(p.expected_tokens(4) > 4.0, "E(4) = {}", p.expected_tokens(4));
        assert_eq!(p.choose(4), 4);
    }

    /// Streaming: plain decoding measured while the expert cache was cold (300 ms) must not keep a
    /// never-accepted draft of one token going once every width costs the same (100 ms).
    #[test]
    fn a_stale_cold_measurement_of_plain_decoding_is_remeasured() {
        let mut p = DraftPolicy::new(4, None, Some(FanoutModel { experts: 128, top_k: 8 }));
        let mut chosen = Vec::new();
        for round in 0..200 {
            let n = p.choose(4);
            let ms = if round < 6 { 300.0 } else { 100.0 };
            p.observe(n, 0, 2.0 * n as f64, ms, Some(8.0 + n as f64));
            chosen.push(n);
        }
        let plain = chosen[100..].iter().filter(|&&n| n == 0).count();
        assert!(plain >= 90, "plain decoding chosen in {plain} of the last 100 rounds: {chosen:?}");
    }

    /// A block drafter's cost is per round: a 30 ms pass that proposed 7 tokens still costs 30 ms
    /// when only 1 of them is verified (a per-token drafter's estimate would be 30/7 ms).
    #[test]
    fn block_draft_cost_is_per_round() {
        let observed = |p: DraftPolicy| {
            let mut p = p;
            p.observe(0, 0, 0.0, 10.0, None);
            for _ in 0..40 {
                p.observe(7, 1, 30.0, 12.0, None);
            }
            p
        };
        let (block, per_token) = (
            observed(DraftPolicy::new(7, None, None).with_block_draft()),
            observed(DraftPolicy::new(7, None, None)),
        );
        let (e1, v1) = (block.expected_tokens(1), block.verify_estimate(1).unwrap());
        assert!((block.rate(1).unwrap() - e1 / (v1 + 30.0)).abs() < 1e-9);
        assert!((per_token.rate(1).unwrap() - e1 / (v1 + 30.0 / 7.0)).abs() < 1e-9);
        assert!(
            (block.rate(7).unwrap() - per_token.rate(7).unwrap()).abs() < 1e-9,
            "the whole block costs the same either way"
        );
        assert_eq!(block.rate(0), per_token.rate(0));
    }

    /// Streamed experts: a never-accepted block drafter whose 16-token verify costs 10× a plain
    /// step is probed only as the budget allows: what probing loses stays within EXPLORE_BUDGET
    /// of the run.
    #[test]
    fn expensive_probes_stay_within_the_budget() {
        let mut p = DraftPolicy::new(15, None, Some(FanoutModel { experts: 128, top_k: 8 }))
            .with_block_draft();
        let (mut spent, mut plain) = (0.0, 0.0);
        for _ in 0..2000 {
            let n = p.choose(15);
            let ms = if n == 0 { 100.0 } else { 300.0 + 1000.0 };
            p.observe(
                n,
                0,
                if n > 0 { 300.0 } else { 0.0 },
                ms - if n > 0 { 300.0 } else { 0.0 },
                Some(8.0 + 4.0 * n as f64),
            );
            spent += ms;
            plain += 100.0;
        }
        let ratio = plain / spent;
        assert!(ratio >= 1.0 - EXPLORE_BUDGET - 0.01, "adaptive ran at {ratio:.3}× plain decoding");
        assert!(p.probes >= 2, "the block was probed {} times", p.probes);
    }

    #[test]
    fn fixed_length_is_kept() {
        let mut p = DraftPolicy::new(8, Some(4), None);
        assert_eq!(p.choose(8), 4);
        assert_eq!(p.choose(2), 2);
    }
}
