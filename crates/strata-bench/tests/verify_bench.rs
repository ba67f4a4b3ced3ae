//! `strata bench --verify`: verify passes rolled back to one token run the asked number of passes
//! without filling the cache, and count `width` tokens per pass.

use std::path::PathBuf;

fn engine() -> strata_engine::Engine {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/moe-tiny/qwen3_moe.gguf");
    let opts = strata_engine::LoadOptions::new(64, candle_core::Device::Cpu);
    strata_engine::Engine::load(&path, &opts, &mut |_, _| {}).unwrap()
}

#[test]
fn verify_passes_roll_back_to_one_token_each() {
    let engine = engine();
    for width in [1usize, 4] {
        let r = strata_bench::bench::bench_verify(&engine, width, 40, 2).unwrap();
        assert_eq!(r.tokens, 40 * width, "tokens counted for width {width}");
        assert_eq!(r.runs.len(), 2);
        assert!(r.runs.iter().all(|&t| t.is_finite() && t > 0.0), "{:?}", r.runs);
        // 40 passes of 4 tokens would need 160 positions without the rollback: the bench's cache
        // holds n + width + 2.
    }
    // The ratio is the pass's time over a step's: a 4-token pass at 400 tok/s (10 ms) against a
    // step at 100 tok/s (10 ms) costs one step.
    let pass_ms = 4.0 / 400.0;
    let step_ms = 1.0 / 100.0;
    assert_eq!(strata_bench::bench::verify_ratio(4, 400.0, 100.0), pass_ms / step_ms);
}
