//! `strata generate --stream-experts` end to end on synthetic models made by `strata synth`:
//! identical greedy tokens to the resident run at expert-cache budgets of 10%, 50% and 100%, and
//! the process's peak RSS bounded by (resident weights + KV cache + expert cache) + 10%; `strata
//! repack` and every `--prefetch` predictor keep the tokens.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-cli-stream-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn synth(out: &Path, args: &[&str]) {
    let s = strata().args(["synth", "--out"]).arg(out).args(args).output().unwrap();
    assert!(s.status.success(), "synth: {}", String::from_utf8_lossy(&s.stderr));
}

fn generate(model: &Path, extra: &[&str]) -> Value {
    let out = strata()
        .args([
            "generate",
            "--prompt",
            "The quick brown fox jumps over the lazy dog",
            "--max-tokens",
            "64",
            "--ignore-eos",
            "--temp",
            "0",
            "--ctx-size",
            "256",
            "--json",
            "-t",
            "2",
            "-m",
        ])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "generate {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn tiny_moe_streamed_tokens_equal_resident() {
    for (quant, skew) in [("Q4_K", "1.0"), ("Q8_0", "0")] {
        let model = tmp(&format!("tiny-{quant}.gguf"));
        synth(
            &model,
            &[
                "--preset",
                "tiny-moe",
                "--quant",
                quant,
                "--routing",
                "local",
                "--routing-skew",
                skew,
            ],
        );
        let want = generate(&model, &[])["generated_token_ids"].clone();
        assert_eq!(want.as_array().unwrap().len(), 64);
        for budget in ["10%", "50%", "100%"] {
            let got = generate(&model, &["--stream-experts", "--expert-cache", budget]);
            assert_eq!(got["generated_token_ids"], want, "{quant} at {budget}");
            let x = &got["experts"];
            assert!(x["bytes_read"].as_u64().unwrap() > 0, "{x}");
            eprintln!("{quant} skew {skew} at {budget}: {x}");
        }
    }
}

#[test]
fn repacked_model_and_every_prefetch_predictor_keep_the_tokens() {
    let model = tmp("tiny-repack.gguf");
    synth(
        &model,
        &["--preset", "tiny-moe", "--quant", "Q4_K", "--routing", "local", "--routing-skew", "0.5"],
    );
    let bundled = tmp("tiny-repack-bundled.gguf");
    let r = strata().arg("repack").arg(&model).arg(&bundled).output().unwrap();
    assert!(r.status.success(), "repack: {}", String::from_utf8_lossy(&r.stderr));
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("experts of 4 MoE layers bundled"),
        "{}",
        String::from_utf8_lossy(&r.stdout)
    );
    let want = generate(&model, &[])["generated_token_ids"].clone();
    assert_eq!(generate(&bundled, &[])["generated_token_ids"], want, "bundled, resident");
    for p in ["off", "pregate", "previous", "union"] {
        for m in [&model, &bundled] {
            let got = generate(
                m,
                &[
                    "--stream-experts",
                    "--expert-cache",
                    "10%",
                    "--prefetch",
                    p,
                    "--prefetch-min-precision",
                    "0",
                ],
            );
            assert_eq!(got["generated_token_ids"], want, "{} --prefetch {p}", m.display());
            assert_eq!(got["prefetch"], p, "{got}");
            let (x, pd) = (&got["experts_decode"], &got["prefetch_decode"]);
            assert!(pd["pregate"]["actual"].as_u64().unwrap() > 0, "{pd}");
            if p == "off" {
                assert_eq!(x["prefetch_reads"], 0, "{x}");
            }
        }
    }
    // Bad input: a dense model has nothing to bundle; an unknown predictor is refused by name.
    let dense = tmp("dense-out.gguf");
    let r = strata().arg("repack").arg(&bundled).arg(&dense).output().unwrap();
    assert!(
        !r.status.success() && String::from_utf8_lossy(&r.stderr).contains("already repacked"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert!(!dense.exists());
    let r = strata()
        .args(["generate", "--prompt", "x", "--stream-experts", "--prefetch", "psychic", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        !r.status.success()
            && String::from_utf8_lossy(&r.stderr).contains("unknown prefetch predictor `psychic`"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
}

#[test]
fn streamed_rss_stays_within_weights_kv_and_cache() {
    // 256 layers of tiny-moe in Q8_0: 0.86 GB of experts, 10% cached.
    let model = tmp("rss.gguf");
    synth(&model, &["--preset", "tiny-moe", "--quant", "Q8_0", "--layers", "256"]);
    let got = generate(&model, &["--stream-experts", "--expert-cache", "10%"]);
    let m = &got["memory"];
    let field = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("{k} in {m}"));
    let bound = field("resident_weight_bytes") + field("experts_bytes") + field("kv_cache_bytes");
    let used = field("rss_peak_bytes") - field("rss_before_load_bytes");
    eprintln!(
        "peak RSS growth {used} bytes, bound {bound} bytes (+10%): {:.3}",
        used as f64 / bound as f64
    );
    assert!(used as f64 <= bound as f64 * 1.1, "RSS grew by {used} bytes > 1.1 × {bound}");
    // And the model's experts are far larger than what was held.
    let file = std::fs::metadata(&model).unwrap().len();
    assert!(used * 3 < file, "RSS {used} vs file {file}: streaming held most of the model");

    // The memory plan decides: on a (simulated) machine with 1.3 GB the model does not fit resident,
    // so `--stream-experts auto` (the default) streams; with 200 MB nothing fits: exit status 2.
    let out = strata()
        .env("STRATA_RAM_BYTES", "1300MB")
        .args(["info", "--json", "--ctx-size", "256", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["strategy"], "EXPERT-STREAMING", "{plan}");
    let auto = strata()
        .env("STRATA_RAM_BYTES", "1300MB")
        .args([
            "generate",
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
            "--temp",
            "0",
            "--ctx-size",
            "256",
            "--json",
            "-m",
        ])
        .arg(&model)
        .output()
        .unwrap();
    assert!(auto.status.success(), "{}", String::from_utf8_lossy(&auto.stderr));
    let v: Value = serde_json::from_slice(&auto.stdout).unwrap();
    assert!(v["experts"]["bytes_read"].as_u64().unwrap() > 0, "auto did not stream: {v}");
    assert!(String::from_utf8_lossy(&auto.stderr).contains("plan: EXPERT-STREAMING"));
    // A plan for a (simulated) GPU with too little VRAM for the experts: GPU-OFFLOAD with a VRAM
    // expert cache, on any build (no GPU needed to plan).
    let out = strata()
        .env("STRATA_RAM_BYTES", "8GB")
        .args(["info", "--json", "--ctx-size", "256", "--device", "cuda", "--vram", "2600MB", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    let plan: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(plan["strategy"], "GPU-OFFLOAD", "{plan}");
    assert!(plan["gpu"]["vram_expert_cache_bytes"].as_u64().unwrap() > 0, "{plan}");
    assert!(plan["recommended_command"].as_str().unwrap().contains("--gpu-expert-cache"), "{plan}");
    let refused = strata()
        .env("STRATA_RAM_BYTES", "200MB")
        .args(["generate", "--prompt", "hello", "--max-tokens", "4", "-m"])
        .arg(&model)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("does not fit"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let _ = std::fs::remove_file(&model);
}

/// `strata synth --routing uniform|realistic` on tiny-moe with Qwen3-30B-A3B's routing shape (128
/// experts, top-8; 4 layers): the routing report of 64 generated tokens (63 decode steps) has the
/// statistics the override asks for (the ranges for the 30B shape), and streaming at 10%
/// gives the resident tokens and the same routing.
#[test]
fn routing_overrides_route_as_configured_and_streaming_keeps_the_tokens() {
    let mut reports = Vec::new();
    for routing in ["uniform", "realistic"] {
        let model = tmp(&format!("tiny-routing-{routing}.gguf"));
        synth(
            &model,
            &[
                "--preset",
                "tiny-moe",
                "--experts",
                "128",
                "--top-k",
                "8",
                "--quant",
                "Q4_K",
                "--routing",
                routing,
            ],
        );
        let resident = generate(&model, &["--routing-report"]);
        let r = resident["routing"].clone();
        assert_eq!(r["tokens"], 63, "{r}");
        // Prefetch off: the hit rate is the cache's alone (pre-gating at recall 0.8 reads ahead
        // most of what the cache lacks).
        let streamed = generate(
            &model,
            &["--stream-experts", "--expert-cache", "10%", "--prefetch", "off", "--routing-report"],
        );
        assert_eq!(
            streamed["generated_token_ids"], resident["generated_token_ids"],
            "{routing}: streamed tokens"
        );
        assert_eq!(
            streamed["routing"]["reuse_per_layer"], r["reuse_per_layer"],
            "{routing}: streamed routing"
        );
        let x = &streamed["experts_decode"];
        let hit_rate = x["hits"].as_f64().unwrap()
            / (x["hits"].as_f64().unwrap() + x["misses"].as_f64().unwrap());
        let lru = |f: f64| {
            r["lru_per_layer"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| (p["fraction"].as_f64().unwrap() - f).abs() < 1e-9)
                .unwrap()["hit_rate"]
                .as_f64()
                .unwrap()
        };
        let reuse = r["reuse"]["mean"].as_f64().unwrap();
        let pregate_recall = r["predictors"][0][1]["recall"].as_f64().unwrap();
        eprintln!("{routing}: reuse {reuse:.3}, LRU 10% {:.3} 25% {:.3} 50% {:.3}, zipf {}, pregate recall {pregate_recall:.3}, streamed hit rate at 10% {hit_rate:.3}", lru(0.1), lru(0.25), lru(0.5), r["zipf"]);
        assert!(
            (0.65..=0.95).contains(&pregate_recall),
            "{routing}: pre-gating recall {pregate_recall} (configured 0.8)"
        );
        if routing == "uniform" {
            assert!(lru(0.10) <= 0.20, "uniform: simulated LRU hits at 10% {}", lru(0.10));
            assert!(hit_rate <= 0.20, "uniform: streamed hit rate at 10% {hit_rate}");
            assert!(reuse < 0.12, "uniform reuse {reuse} (chance 8/128)");
        } else {
            assert!((0.25..=0.45).contains(&reuse), "realistic reuse {reuse}");
            assert!((0.40..=0.85).contains(&lru(0.25)), "realistic LRU hits at 25% {}", lru(0.25));
            assert!((0.15..=0.70).contains(&lru(0.10)), "realistic LRU hits at 10% {}", lru(0.10));
            assert!(r["top_expert_share"].as_f64().unwrap() > 2.0 / 128.0, "{r}");
        }
        reports.push(r);
    }
    let lru25 = |r: &Value| r["lru_per_layer"][3]["hit_rate"].as_f64().unwrap();
    assert!(
        lru25(&reports[1]) > lru25(&reports[0]) + 0.2,
        "realistic routing must cache better than uniform: {} vs {}",
        lru25(&reports[1]),
        lru25(&reports[0])
    );
    // A local-routing file (no override) keeps the random routers and reports the same way.
    let local = tmp("tiny-routing-local.gguf");
    synth(&local, &["--preset", "tiny-moe", "--quant", "Q4_K", "--routing", "local"]);
    let trace_path = tmp("tiny-routing-local.trace.json");
    let g =
        generate(&local, &["--routing-report", "--routing-trace", trace_path.to_str().unwrap()]);
    assert_eq!(g["routing"]["tokens"], 63);
    // The raw trace (`--routing-trace`) is what the report was computed from: its previous-token
    // reuse, recomputed here, equals the report's.
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace_path).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
    };
    let tokens: Vec<Vec<Vec<u64>>> = t["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|tok| tok.as_array().unwrap().iter().map(ids).collect())
        .collect();
    let (k, experts) = (t["top_k"].as_u64().unwrap(), t["experts"].as_u64().unwrap());
    let layers = t["layers"].as_array().unwrap().len();
    assert_eq!(tokens.len(), 63);
    assert!(tokens
        .iter()
        .flatten()
        .all(|l| l.len() == k as usize && l.iter().all(|&e| e < experts)));
    let reuse = (0..layers)
        .map(|l| {
            let kept: usize = tokens
                .windows(2)
                .map(|w| w[1][l].iter().filter(|e| w[0][l].contains(e)).count())
                .sum();
            kept as f64 / (62 * k) as f64
        })
        .sum::<f64>()
        / layers as f64;
    let reported = g["routing"]["reuse"]["mean"].as_f64().unwrap();
    assert!((reuse - reported).abs() < 1e-9, "trace reuse {reuse} vs report {reported}");
    // Out-of-range parameters are refused by name.
    let s = strata()
        .args(["synth", "--preset", "tiny-moe", "--routing-reuse", "1.5", "--out"])
        .arg(tmp("bad.gguf"))
        .output()
        .unwrap();
    assert!(
        !s.status.success() && String::from_utf8_lossy(&s.stderr).contains("reuse 1.5"),
        "{}",
        String::from_utf8_lossy(&s.stderr)
    );
}
