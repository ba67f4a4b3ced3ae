//! Verification of draft tokens against the target's distributions.
//!
//! Sampling: speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
//! Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
//! Sampling"): draft token `x ~ q` is accepted with probability `min(1, p(x) / q(x))`; on rejection
//! the token is drawn from `norm(max(p − q, 0))`; when every draft token is accepted a bonus token is
//! drawn from the target's next distribution. The emitted tokens then follow `p` exactly. `p` and
//! `q` are the *final* sampling distributions (penalties, top-k, top-p, min-p, temperature all
//! applied by [`Sampler::distribution`] with the same history), so the transforms are consistent.
//!
//! Greedy (temperature 0) is the special case where `p` is a point mass at the target's argmax: a
//! draft token is accepted iff it equals the argmax, and the correction is the argmax itself.

use crate::sampling::Sampler;

/// A sparse distribution: `(token, probability)` pairs summing to 1 (as [`Sampler::distribution`]).
pub type Dist = Vec<(u32, f32)>;

/// Probability of `t` under `d` (0 when absent).
pub fn prob(d: &[(u32, f32)], t: u32) -> f32 {
    d.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1)
}

/// The draft's distribution for one draft token.
#[derive(Debug, Clone)]
pub enum DraftDist {
    /// A deterministic proposal (n-gram lookup, or a greedy draft): `q(x) = 1`.
    Point,
    /// The draft model's sampling distribution the token was drawn from.
    Sampled(Dist),
}

/// Outcome of checking one draft token against the target's distribution `p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Rejected; emit this token instead (drawn from the residual distribution) and stop.
    Reject(u32),
}

/// Checks draft token `x` (drawn from `q`) against the target distribution `p`, drawing from
/// `sampler`'s RNG only when needed (greedy `p` consumes no randomness).
pub fn verify_token(p: &[(u32, f32)], x: u32, q: &DraftDist, sampler: &mut Sampler) -> Verdict {
    if p.len() == 1 {
        return if p[0].0 == x { Verdict::Accept } else { Verdict::Reject(p[0].0) };
    }
    let px = prob(p, x);
    let qx = match q {
        DraftDist::Point => 1.0,
        DraftDist::Sampled(d) => prob(d, x),
    };
    // u < p(x)/q(x), written without the division; q(x) = 0 cannot happen for a token drawn from q.
    let accept = px > 0.0 && (qx <= 0.0 || sampler.uniform() * qx < px);
    if accept {
        return Verdict::Accept;
    }
    Verdict::Reject(sampler.draw(&residual(p, x, q)))
}

/// `norm(max(p − q, 0))` over `p`'s support (`q` outside it contributes nothing). Falls back to `p`
/// when the residual mass is zero (only possible through rounding).
pub fn residual(p: &[(u32, f32)], x: u32, q: &DraftDist) -> Dist {
    let mut r: Dist = match q {
        DraftDist::Point => p.iter().filter(|d| d.0 != x).copied().collect(),
        DraftDist::Sampled(qd) => p
            .iter()
            .map(|&(t, pt)| (t, (pt - prob(qd, t)).max(0.0)))
            .filter(|d| d.1 > 0.0)
            .collect(),
    };
    let total: f32 = r.iter().map(|d| d.1).sum();
    if total <= 0.0 || r.is_empty() {
        return p.to_vec();
    }
    for d in &mut r {
        d.1 /= total;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        })
    }

    #[test]
    fn greedy_accepts_only_the_argmax() {
        let mut s = sampler(1);
        assert_eq!(verify_token(&[(5, 1.0)], 5, &DraftDist::Point, &mut s), Verdict::Accept);
        assert_eq!(verify_token(&[(5, 1.0)], 6, &DraftDist::Point, &mut s), Verdict::Reject(5));
    }

    /// One speculative step reproduces p exactly: the emitted token's frequency over many draws
    /// matches p within sampling error (the end-to-end chi-square test is in tests/speculative.rs).
    #[test]
    fn one_step_output_follows_p() {
        let p: Dist = vec![(0, 0.5), (1, 0.3), (2, 0.2)];
        let q: Dist = vec![(0, 0.1), (1, 0.1), (2, 0.8)];
        let mut s = sampler(7);
        let n = 200_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            let x = s.draw(&q);
            let t = match verify_token(&p, x, &DraftDist::Sampled(q.clone()), &mut s) {
                Verdict::Accept => x,
                Verdict::Reject(t) => t,
            };
            counts[t as usize] += 1;
        }
        for (i, &(_, pi)) in p.iter().enumerate() {
            let f = counts[i] as f64 / n as f64;
            // 5 standard errors.
            let se = (pi as f64 * (1.0 - pi as f64) / n as f64).sqrt();
            assert!((f - pi as f64).abs() < 5.0 * se, "token {i}: {f} vs {pi}");
        }
    }

    #[test]
    fn residual_of_a_point_draft_removes_it() {
        let r = residual(&[(0, 0.5), (1, 0.5)], 0, &DraftDist::Point);
        assert_eq!(r, vec![(1, 1.0)]);
    }
}
