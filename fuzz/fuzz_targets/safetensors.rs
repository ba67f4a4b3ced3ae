//! A safetensors file from fuzzer bytes beside the tiny Qwen3-MoE fixture's config and tokenizer:
//! header parsed, the model loaded, one token generated. Errors are fine; panics and hangs are
//! findings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::ops::ControlFlow;
use std::path::PathBuf;

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-fuzz-st-{}", std::process::id()));
    if !d.exists() {
        std::fs::create_dir_all(&d).unwrap();
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/moe-tiny/qwen3_moe");
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
            std::fs::copy(src.join(f), d.join(f)).unwrap();
        }
    }
    d
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    std::fs::write(d.join("model.safetensors"), data).unwrap();
    let opts = strata_engine::LoadOptions::new(16, candle_core::Device::Cpu);
    let Ok(engine) = strata_engine::Engine::load(&d, &opts, &mut |_, _| {}) else { return };
    let Ok(mut cache) = engine.new_cache(16) else { return };
    let req = strata_engine::GenerateRequest::new(vec![0, 1], 2, strata_engine::SamplingParams::greedy());
    let _ = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(()));
});
