//! `strata bench` as a user runs it on a synthetic model: `-d` (llama-bench's context depth) adds
//! a pp and a tg test per depth, named as llama-bench names them, each timed after its context is
//! in the cache; `--batch` with `--batch-prompt` adds a batched prompt pass and batched decoding;
//! and `--kv-cache-dtype f16` runs on the CPU too. The KV
//! cache's default element type is f16 on every device (the plan shows it).

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// A tiny synthetic MoE written to a file of its own for the test `name` (tests run in parallel).
fn tiny_moe(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-cli-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let out = d.join(format!("{name}.gguf"));
    let s = strata()
        .args(["synth", "--preset", "tiny-moe", "--quant", "Q8_0", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(s.status.success(), "synth: {}", String::from_utf8_lossy(&s.stderr));
    out
}

#[test]
fn bench_depths_add_a_pp_and_a_tg_test_each_and_an_f16_kv_cache_runs_on_the_cpu() {
    let model = tiny_moe("depths");
    let run = |extra: &[&str]| {
        strata()
            .args(["bench", "-p", "8", "-n", "4", "-r", "1", "-t", "2", "--device", "cpu", "-m"])
            .arg(&model)
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["-d", "0,24", "--json"]);
    assert!(out.status.success(), "bench: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(names, ["pp8", "tg4", "pp8 @ d24", "tg4 @ d24"]);
    for r in results {
        assert!(r["median_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }

    // `--batch B --batch-prompt P`: B prompts of P tokens in one pass (S_PP), then B sequences
    // decoding together (S_TG), named as llama-batched-bench's rows are counted.
    let out = run(&["--batch", "3", "--batch-prompt", "6", "--json"]);
    assert!(out.status.success(), "bench: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(names, ["pp8", "tg4", "pp6 x3", "tg4 x3"]);
    assert_eq!(results[2]["tokens"].as_u64(), Some(18), "every sequence's prompt tokens");
    assert!(results[2]["median_tok_s"].as_f64().unwrap() > 0.0);

    let out = run(&["--kv-cache-dtype", "f16", "-d", "0,24", "--json"]);
    assert!(out.status.success(), "bench: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    assert!(results.iter().all(|r| r["median_tok_s"].as_f64().unwrap() > 0.0), "{v}");
    std::fs::remove_file(&model).ok();
}

/// Without `--kv-cache-dtype`, the plans for a CUDA device (simulated with `--vram`, so this runs
/// without a GPU) and for the CPU count an f16 KV cache — half the f32 bytes.
#[test]
fn the_kv_cache_defaults_to_f16_on_cuda_and_on_the_cpu() {
    let model = tiny_moe("kv-default");
    let kv_bytes = |extra: &[&str]| -> u64 {
        let out = strata()
            .args(["info", "--json", "--ctx-size", "1024", "-m"])
            .arg(&model)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "info: {}", String::from_utf8_lossy(&out.stderr));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["memory"]["kv_cache"].as_u64().unwrap()
    };
    let cuda = ["--device", "cuda", "--vram", "8GiB"];
    let f32_bytes = kv_bytes(&[&cuda[..], &["--kv-cache-dtype", "f32"]].concat());
    assert!(f32_bytes > 0);
    assert_eq!(kv_bytes(&cuda), f32_bytes / 2, "CUDA default: f16");
    assert_eq!(kv_bytes(&cuda), kv_bytes(&[&cuda[..], &["--kv-cache-dtype", "f16"]].concat()));
    assert_eq!(kv_bytes(&["--device", "cpu"]), f32_bytes / 2, "CPU default: f16");
    let cpu_f32 = kv_bytes(&["--device", "cpu", "--kv-cache-dtype", "f32"]);
    assert_eq!(cpu_f32, f32_bytes, "f32 on the CPU when asked for");
    std::fs::remove_file(&model).ok();
}
