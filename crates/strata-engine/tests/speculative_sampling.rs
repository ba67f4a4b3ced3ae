//! Speculative sampling follows the target's distribution: the first 3 sampled tokens over 20k
//! seeded runs (temperature 0.7, top-p 0.9) have the same distribution with and without
//! speculation (two-sample chi-square per position and for tokens 2–3 jointly, p > 0.001), for a
//! draft model, self-draft, n-gram and DFlash drafts. Its own test binary: it runs on one thread (tiny
//! models, where thread hand-offs would cost more than the work).

mod common;

use std::ops::ControlFlow;

use strata_engine::{
    DraftSource, Engine, GenerateRequest, LoadOptions, NgramParams, SamplingParams, SpecConfig,
};

fn spec(source: DraftSource, max_draft: usize) -> SpecConfig {
    SpecConfig { source, max_draft, fixed: Some(max_draft) }
}

/// Regularized upper incomplete gamma Q(a, x) (Numerical Recipes §6.2: series for x < a + 1,
/// continued fraction otherwise): the chi-square survival function is Q(df/2, χ²/2).
fn gamma_q(a: f64, x: f64) -> f64 {
    fn ln_gamma(x: f64) -> f64 {
        // Lanczos approximation (g = 7, n = 9).
        const C: [f64; 9] = [
            0.999_999_999_999_809_9,
            676.5203681218851,
            -1259.1392167224028,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507343278686905,
            -0.13857109526572012,
            9.984_369_578_019_572e-6,
            1.5056327351493116e-7,
        ];
        let x = x - 1.0;
        let t = x + 7.5;
        let s: f64 = C[0] + (1..9).map(|i| C[i] / (x + i as f64)).sum::<f64>();
        0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + s.ln()
    }
    if x <= 0.0 {
        return 1.0;
    }
    let lg = ln_gamma(a);
    if x < a + 1.0 {
        let (mut sum, mut del, mut ap) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            ap += 1.0;
            del *= x / ap;
            sum += del;
            if del.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - lg).exp()
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - lg).exp() * h
    }
}

#[test]
fn chi_square_survival_matches_known_values() {
    // scipy.stats.chi2.sf(x, df): sf(3.841459, 1) = 0.05, sf(18.307038, 10) = 0.05,
    // sf(124.342113, 100) = 0.05, sf(2.0, 4) = 0.735758882.
    for (x, df, want) in [
        (3.841459, 1.0, 0.05),
        (18.307038, 10.0, 0.05),
        (124.342113, 100.0, 0.05),
        (2.0, 4.0, 0.735758882),
    ] {
        let p = gamma_q(df / 2.0, x / 2.0);
        assert!((p - want).abs() < 1e-5, "sf({x}, {df}) = {p}, want {want}");
    }
}

/// Two-sample chi-square test of equal distributions (Press et al., Numerical Recipes §14.3,
/// unequal sample sizes): `r = n_a / n_b`, statistic `Σ (x/√r − y·√r)² / (x + y)`; cells with fewer
/// than 10 observations in total are pooled. Returns (statistic, degrees of freedom, p-value).
fn two_sample_chi_square(
    a: &std::collections::HashMap<Vec<u32>, u64>,
    b: &std::collections::HashMap<Vec<u32>, u64>,
    r: f64,
) -> (f64, usize, f64) {
    let keys: std::collections::BTreeSet<&Vec<u32>> = a.keys().chain(b.keys()).collect();
    let (mut stat, mut cells, mut pool_a, mut pool_b) = (0.0, 0usize, 0u64, 0u64);
    let add = |x: u64, y: u64, stat: &mut f64| {
        *stat += (x as f64 / r.sqrt() - y as f64 * r.sqrt()).powi(2) / (x + y) as f64;
    };
    for k in keys {
        let (x, y) = (a.get(k).copied().unwrap_or(0), b.get(k).copied().unwrap_or(0));
        if x + y < 10 {
            pool_a += x;
            pool_b += y;
        } else {
            add(x, y, &mut stat);
            cells += 1;
        }
    }
    if pool_a + pool_b > 0 {
        add(pool_a, pool_b, &mut stat);
        cells += 1;
    }
    let df = cells.saturating_sub(1).max(1);
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

type Counts = Vec<std::collections::HashMap<Vec<u32>, u64>>;

/// Counts of token 1, 2, 3 and of the pair (2, 3) over `runs` seeded generations of 3 tokens.
fn sample_counts(engine: &Engine, prompt: &[u32], seed0: u64, runs: u64) -> (Counts, u64) {
    let sampling = |seed| SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 0,
        min_p: 0.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let mut by_pos: Counts = vec![Default::default(); 4];
    let mut cache = engine.new_cache(prompt.len() + 8).unwrap();
    let mut drafted = 0;
    for i in 0..runs {
        let mut req = GenerateRequest::new(prompt.to_vec(), 3, sampling(seed0 + i));
        req.ignore_eos = true;
        let g = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(g.tokens.len(), 3);
        drafted += g.spec.map_or(0, |s| s.drafted);
        for (counts, &t) in by_pos.iter_mut().zip(&g.tokens) {
            *counts.entry(vec![t]).or_default() += 1;
        }
        *by_pos[3].entry(g.tokens[1..3].to_vec()).or_default() += 1;
    }
    (by_pos, drafted)
}

#[test]
fn sampled_speculation_follows_the_target_distribution() {
    // Before candle's first parallel op (it reads this once).
    std::env::set_var("RAYON_NUM_THREADS", "1");
    // Target: the tiny qwen3_moe fixture; draft: the tiny dense Qwen3 of the DFlash fixture (both
    // vocab 512, hidden 64: fast enough for 20k runs).
    let target = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_moe");
    let draft = Engine::load_draft_model(
        &common::tiny_qwen3_dir(),
        &LoadOptions::new(1024, candle_core::Device::Cpu),
    )
    .unwrap()
    .0;
    let mut engine =
        Engine::load(&target, &LoadOptions::new(512, candle_core::Device::Cpu), &mut |_, _| {})
            .unwrap();
    let short = engine.text_prompt("The quick brown fox").unwrap();
    // Token ids 0..256 once each, so that n-gram lookup often finds the token sampled last.
    let every: Vec<u32> = (0..256).collect();
    // 20k runs with the draft model (q a real distribution: the full rejection-sampling path);
    // fewer with self-draft (same path, another q) and n-gram (q a point mass), whose prompt is long.
    let cases = [
        ("draft model", spec(DraftSource::Model(draft), 2), &short, 20_000u64),
        ("self", spec(DraftSource::SelfDraft { layers: 1 }, 2), &short, 5_000),
        ("ngram", spec(DraftSource::Ngram(NgramParams { max: 1, min: 1 }), 2), &every, 3_000),
    ];
    for (name, cfg, prompt, runs) in cases {
        engine.set_speculation(None).unwrap();
        let (plain, _) = sample_counts(&engine, prompt, 1_000_000, runs);
        engine.set_speculation(Some(cfg)).unwrap();
        let (got, drafted) = sample_counts(&engine, prompt, 0, runs);
        assert!(
            drafted >= runs / 4,
            "{name}: too few drafts were verified ({drafted} in {runs} runs)"
        );
        for (pos, (a, b)) in got.iter().zip(&plain).enumerate() {
            let (stat, df, p) = two_sample_chi_square(a, b, 1.0);
            let what =
                if pos < 3 { format!("token {}", pos + 1) } else { "tokens 2–3 jointly".into() };
            eprintln!("{name} ({runs} runs each), {what}: chi² {stat:.1}, df {df}, p {p:.4}");
            assert!(p > 0.001, "{name}, {what}: speculative sampling differs from plain sampling (chi² {stat:.1}, df {df}, p {p:.2e})");
        }
    }
}

/// DFlash under sampling: the trained fixture draft's block proposals (sampled from the draft's
/// distribution per position, as z-lab's `dflash_generate`) go through the same rejection sampling.
#[test]
fn sampled_dflash_follows_the_target_distribution() {
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let fx = common::repo_root().join("tests/fixtures/dflash-tiny");
    let mut engine = Engine::load(
        &fx.join("target"),
        &LoadOptions::new(256, candle_core::Device::Cpu),
        &mut |_, _| {},
    )
    .unwrap();
    let draft = Engine::load_dflash_draft(
        &fx.join("draft_memo"),
        &LoadOptions::new(256, candle_core::Device::Cpu),
        &engine.model,
    )
    .unwrap()
    .0;
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("reference.json")).unwrap()).unwrap();
    let prompt: Vec<u32> =
        r["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let runs = 5_000;
    engine.set_speculation(None).unwrap();
    let (plain, _) = sample_counts(&engine, &prompt, 1_000_000, runs);
    engine.set_speculation(Some(spec(DraftSource::DFlash { draft, block_size: 8 }, 7))).unwrap();
    let (got, drafted) = sample_counts(&engine, &prompt, 0, runs);
    assert!(drafted >= runs, "too few drafts were verified ({drafted} in {runs} runs)");
    for (pos, (a, b)) in got.iter().zip(&plain).enumerate() {
        let (stat, df, p) = two_sample_chi_square(a, b, 1.0);
        eprintln!("dflash ({runs} runs each), position {pos}: chi² {stat:.1}, df {df}, p {p:.4}");
        assert!(p > 0.001, "dflash, position {pos}: speculative sampling differs from plain sampling (chi² {stat:.1}, df {df}, p {p:.2e})");
    }
}
