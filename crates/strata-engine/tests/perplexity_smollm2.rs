//! `llama-perplexity -c 512` on `tests/fixtures/smollm2-oracle/ppl.txt` gives 14.8775 (llama.cpp b4748);
//! ours must land within 1%, and the running PPL after each chunk must track llama.cpp's — with
//! an f32 KV cache (the CPU's default) and with an f16 one (`--kv-cache-dtype f16`, llama.cpp's
//! default, which that figure was measured with).

mod common;

#[test]
fn perplexity_within_one_percent_of_llama_cpp() {
    perplexity_matches(strata_models::KvDtype::F32);
}

#[test]
fn perplexity_with_an_f16_kv_cache_within_one_percent_of_llama_cpp() {
    perplexity_matches(strata_models::KvDtype::F16);
}

fn perplexity_matches(kv_dtype: strata_models::KvDtype) {
    let (text, res) = (common::oracle("ppl.txt"), common::oracle("ppl_result.json"));
    let res: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(res).unwrap()).unwrap();
    let want = res["final_ppl"].as_f64().unwrap();
    let running: Vec<f64> = res["per_chunk_running_ppl"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let mut opts = strata_engine::LoadOptions::new(512, candle_core::Device::Cpu);
    opts.kv_dtype = kv_dtype;
    let engine = strata_engine::Engine::load(&common::smollm2_path(), &opts, &mut |_, _| {})
        .expect("load SmolLM2");
    let tokens = engine.text_prompt(&std::fs::read_to_string(text).unwrap()).unwrap();
    assert_eq!(
        tokens.len(),
        res["tokens"].as_u64().unwrap() as usize,
        "token count differs from llama.cpp"
    );
    let r = strata_engine::perplexity::perplexity(&engine, &tokens, 512, 512, &mut |_, _, _| {})
        .unwrap();
    assert_eq!(r.chunks, 55);
    assert_eq!(r.scored_tokens, 55 * 255);
    let worst_chunk =
        r.running.iter().zip(&running).map(|(a, b)| (a / b - 1.0).abs()).fold(0.0, f64::max);
    eprintln!(
        "{kv_dtype} KV cache: PPL {:.4} ± {:.4} (llama.cpp {want}); largest running-PPL \
         deviation {:.3}%; {:.0} s",
        r.ppl,
        r.ppl_stderr,
        worst_chunk * 100.0,
        r.seconds
    );
    assert!((r.ppl / want - 1.0).abs() < 0.01, "PPL {} vs llama.cpp {want}", r.ppl);
    assert!(worst_chunk < 0.01, "running PPL deviates by {:.3}%", worst_chunk * 100.0);
}
