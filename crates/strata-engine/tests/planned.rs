//! `load_planned`: the plan decides the strategy and the cache size, the engine loads that way,
//! and a model that does not fit is refused before any weight is read.

mod common;

use std::ops::ControlFlow;

use strata_engine::{load_planned, EngineError, GenerateRequest, LoadRequest, SamplingParams};
use strata_plan::{Strategy, StreamMode};

fn synth_moe(name: &str, layers: usize) -> std::path::PathBuf {
    let pid = std::process::id();
    let out = std::env::temp_dir().join(format!("strata-planned-{pid}-{name}.gguf"));
    let preset = strata_bench::synth::SynthPreset {
        layers,
        ..strata_bench::synth::SynthPreset::by_name("tiny-moe").unwrap()
    };
    let o = strata_bench::synth::SynthOptions {
        preset,
        quant: candle_core::quantized::GgmlDType::Q8_0,
        seed: 3,
        routing_skew: None,
        routing: None,
    };
    strata_bench::synth::synth(&out, &o, &mut |_, _| {}).unwrap();
    out
}

fn greedy(engine: &strata_engine::Engine) -> Vec<u32> {
    let req = GenerateRequest::new(vec![1, 2, 3, 4], 8, SamplingParams::greedy());
    let mut cache = engine.new_cache(64).unwrap();
    engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap().tokens
}

#[test]
fn plan_decides_resident_or_streaming_and_outputs_agree() {
    let path = synth_moe("fits", 8);
    let mut req = LoadRequest::new(64, candle_core::Device::Cpu);
    req.ram = Some(64 << 30);
    req.io_threads = 2;
    let (resident, plan) = load_planned(&path, &req, &mut |_, _| {}).unwrap();
    assert_eq!(plan.strategy, Strategy::Resident, "{}", plan.reason);
    assert!(resident.model.experts().direct_io().is_none(), "resident experts read nothing");

    req.stream = StreamMode::On;
    let (streamed, plan) = load_planned(&path, &req, &mut |_, _| {}).unwrap();
    assert_eq!(plan.strategy, Strategy::ExpertStreaming, "{}", plan.reason);
    assert!(plan.expert_cache_bytes.is_some(), "a streaming plan sizes the cache");
    assert!(streamed.model.experts().direct_io().is_some(), "experts stream from the file");
    assert_eq!(greedy(&resident), greedy(&streamed));
    std::fs::remove_file(&path).ok();
}

#[test]
fn a_model_that_does_not_fit_is_refused_before_loading() {
    let path = synth_moe("refused", 8);
    let mut req = LoadRequest::new(64, candle_core::Device::Cpu);
    req.ram = Some(1 << 20);
    match load_planned(&path, &req, &mut |_, _| panic!("nothing may load")) {
        Err(EngineError::PlanRefused(msg)) => assert!(msg.contains("does not fit"), "{msg}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a 1 MiB machine cannot hold the model"),
    }
    std::fs::remove_file(&path).ok();
}

/// `--kv-cache-dtype f16`: the plan counts half the KV bytes of f32 (the model's
/// `kv_bytes_per_token` at 2 bytes a value), and the engine it loads on the CPU makes f16 caches
/// of half the bytes.
#[test]
fn an_f16_kv_cache_halves_the_planned_and_the_allocated_bytes() {
    let path = synth_moe("kv16", 2);
    let mut req = LoadRequest::new(4096, candle_core::Device::Cpu);
    req.ram = Some(64 << 30);
    let files = strata_formats::ModelFiles::open(&path).unwrap();
    let f32_plan = strata_engine::plan_for(&files, &path, &req).unwrap();
    req.kv_dtype = strata_models::KvDtype::F16;
    let f16_plan = strata_engine::plan_for(&files, &path, &req).unwrap();
    let cfg = files.config().unwrap();
    assert_eq!(f32_plan.memory.kv_cache, 4096 * cfg.kv_bytes_per_token() as u64);
    assert_eq!(f16_plan.memory.kv_cache * 2, f32_plan.memory.kv_cache);
    let (engine, _) = load_planned(&path, &req, &mut |_, _| {}).unwrap();
    assert_eq!(engine.model.kv_dtype(), strata_models::KvDtype::F16);
    let cache = engine.model.new_cache(64).unwrap();
    assert_eq!(cache.bytes(), 64 * cfg.kv_bytes_per_token() / 2);
    std::fs::remove_file(&path).ok();
}
