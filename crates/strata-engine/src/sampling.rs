//! Token sampling, in llama.cpp's default order (`common/sampling.cpp`): repetition / presence /
//! frequency penalties → top-k → top-p → min-p → temperature → draw. Temperature 0 is greedy (argmax
//! of the penalised logits).
//!
//! [`Sampler::distribution`] exposes the final sparse distribution so that speculative decoding can
//! apply exactly the same transforms to target and draft (rejection sampling needs p and q).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Sampling parameters (OpenAI / llama.cpp names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f64,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1.0 = disabled.
    pub top_p: f64,
    /// 0.0 = disabled.
    pub min_p: f64,
    /// CTRL repetition penalty (Keskar et al. 2019); 1.0 = disabled.
    pub repeat_penalty: f64,
    /// OpenAI presence penalty; 0 = disabled.
    pub presence_penalty: f64,
    /// OpenAI frequency penalty; 0 = disabled.
    pub frequency_penalty: f64,
    /// How many recent tokens the penalties look at (llama.cpp `--repeat-last-n`, default 64).
    pub penalty_last_n: usize,
    /// RNG seed; `None` = from entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether repetition, presence or frequency penalties change the logits.
    pub fn has_penalties(&self) -> bool {
        self.repeat_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A sampler with its own RNG (same seed, same output).
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
}

/// The greedy pick: index of the largest value, first on ties (the host kernel,
/// [`strata_kernels::pick::argmax`]; GPU passes pick on the device with the same semantics).
pub use strata_kernels::pick::argmax;

/// `log(softmax(logits))` over the whole vocabulary.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// The `n` most likely `(token, logprob)` pairs, most likely first.
pub fn top_logprobs(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(n - 1, |&a, &b| {
        logprobs[b as usize].total_cmp(&logprobs[a as usize])
    });
    idx.truncate(n);
    idx.sort_by(|&a, &b| logprobs[b as usize].total_cmp(&logprobs[a as usize]));
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// Applies the penalties to `logits` in place, looking at the last `penalty_last_n` of `history`.
    pub fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if !p.has_penalties() || p.penalty_last_n == 0 {
            return;
        }
        let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in recent {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &c) in &counts {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if p.repeat_penalty != 1.0 {
                let r = p.repeat_penalty as f32;
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
            *l -= c as f32 * p.frequency_penalty as f32 + p.presence_penalty as f32;
        }
    }

    /// The sampling distribution after all transforms: `(token, probability)` pairs summing to 1,
    /// most likely first. Greedy gives one token with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        if p.is_greedy() && !p.has_penalties() {
            return vec![(argmax(logits), 1.0)]; // no copy of the vocabulary's logits
        }
        let mut l = logits.to_vec();
        self.apply_penalties(&mut l, history);
        if p.is_greedy() {
            return vec![(argmax(&l), 1.0)];
        }
        // Candidates sorted by logit, truncated by top-k.
        let k = if p.top_k == 0 { l.len() } else { p.top_k.min(l.len()) };
        let mut cand: Vec<(u32, f32)> = top_logprobs(&l, k);
        // Probabilities at temperature 1 for top-p / min-p (llama.cpp applies temperature last).
        let softmax = |c: &[(u32, f32)], t: f32| -> Vec<f32> {
            let m = c[0].1;
            let e: Vec<f32> = c.iter().map(|&(_, x)| ((x - m) / t).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        if p.top_p < 1.0 {
            let probs = softmax(&cand, 1.0);
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f32 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let probs = softmax(&cand, 1.0);
            let thr = probs[0] * p.min_p as f32;
            let keep = probs.iter().take_while(|&&pr| pr >= thr).count();
            cand.truncate(keep.max(1));
        }
        let probs = softmax(&cand, p.temperature as f32);
        cand.iter().zip(probs).map(|(&(t, _), pr)| (t, pr)).collect()
    }

    /// Draws a token from `distribution`.
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        if dist.len() == 1 {
            return dist[0].0;
        }
        let total: f32 = dist.iter().map(|d| d.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(t, pr) in dist {
            if r < pr {
                return t;
            }
            r -= pr;
        }
        dist[dist.len() - 1].0
    }

    /// Samples the next token from raw `logits` given the sequence so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let dist = self.distribution(logits, history);
        self.draw(&dist)
    }

    /// A uniform number in [0, 1) from this sampler's RNG (rejection sampling).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_and_penalty_changes_it() {
        let logits = [1.0, 3.0, 2.0];
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&logits, &[]), 1);
        let mut s =
            Sampler::new(SamplingParams { repeat_penalty: 2.0, ..SamplingParams::greedy() });
        // 3.0 / 2 = 1.5 < 2.0
        assert_eq!(s.sample(&logits, &[1]), 2);
    }

    #[test]
    fn top_k_one_is_deterministic_and_seed_reproduces() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(3),
            ..Default::default()
        };
        let mut s = Sampler::new(p.clone());
        let best = argmax(&logits);
        assert!((0..20).all(|_| s.sample(&logits, &[]) == best));
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(7),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&logits, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "temperature 1 over 100 tokens should vary");
    }

    #[test]
    fn top_p_and_min_p_truncate() {
        // probs ∝ exp([4,3,0,0]) ≈ [0.72, 0.26, 0.013, 0.013]
        let logits = [4.0, 3.0, 0.0, 0.0];
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            min_p: 0.0,
            seed: Some(1),
            ..Default::default()
        });
        let d = s.distribution(&logits, &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: Some(1),
            ..Default::default()
        });
        assert_eq!(s.distribution(&logits, &[]).len(), 1);
        let total: f32 = d.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn log_softmax_normalises() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
        assert_eq!(top_logprobs(&lp, 2).iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
