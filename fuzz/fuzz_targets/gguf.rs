//! A GGUF file from fuzzer bytes: header, config, tokenizer, chat template, the memory plan's
//! facts, then the model loaded and one token generated. Any error is fine; a panic, an abort or a
//! hang is a finding.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::ops::ControlFlow;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("strata-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, data).unwrap();
    let Ok(files) = strata_formats::ModelFiles::open(&path) else { return };
    let _ = files.config();
    let Ok(tok) = files.tokenizer() else { return };
    let _ = files.chat_template(&tok);
    let opts = strata_engine::LoadOptions::new(16, candle_core::Device::Cpu);
    let Ok(engine) = strata_engine::Engine::from_files(&files, &opts, &mut |_, _| {}) else { return };
    let Ok(mut cache) = engine.new_cache(16) else { return };
    let req = strata_engine::GenerateRequest::new(vec![0, 1], 2, strata_engine::SamplingParams::greedy());
    let _ = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(()));
});
