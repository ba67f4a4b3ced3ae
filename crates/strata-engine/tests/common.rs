//! Shared test helpers: locating the default model and `../shared`.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// The SmolLM2 GGUF (fetched by `strata fetch-default`, which `.ci/run` runs first).
pub fn smollm2_path() -> PathBuf {
    let dir = std::env::var_os("STRATA_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `cargo run --release -- fetch-default` (or .ci/run) first",
        p.display()
    );
    p
}

/// `tests/fixtures/smollm2-oracle/<name>`: llama.cpp's outputs on SmolLM2 (copied from
/// `../shared/oracles/smollm2`; see that folder's README for how they were made).
pub fn oracle(name: &str) -> PathBuf {
    let p = repo_root().join("tests/fixtures/smollm2-oracle").join(name);
    assert!(p.exists(), "{} is missing from the repository", p.display());
    p
}

pub fn load_smollm2(ctx: usize) -> strata_engine::Engine {
    let opts = strata_engine::LoadOptions::new(ctx, candle_core::Device::Cpu);
    strata_engine::Engine::load(&smollm2_path(), &opts, &mut |_, _| {}).expect("load SmolLM2")
}

/// The committed tiny Qwen3 (dense) HF checkpoint from `tests/fixtures/dflash-tiny/target`
/// (copied from `../shared/fixtures/dflash-tiny`, made with transformers 5.23).
pub fn tiny_qwen3_dir() -> PathBuf {
    repo_root().join("tests/fixtures/dflash-tiny/target")
}

pub fn load(path: &std::path::Path, ctx: usize) -> strata_engine::Engine {
    let opts = strata_engine::LoadOptions::new(ctx, candle_core::Device::Cpu);
    strata_engine::Engine::load(path, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}
