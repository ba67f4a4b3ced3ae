//! HF safetensors + qwen3 (q/k norm, untied lm_head, tokenizer.json) against transformers: the tiny
//! Qwen3 target of the DFlash fixture, whose 48 greedy ids transformers 5.23 computed (float32).

mod common;

use std::ops::ControlFlow;

use strata_engine::{GenerateRequest, SamplingParams};

fn reference() -> serde_json::Value {
    let p = common::repo_root().join("tests/fixtures/dflash-tiny/reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn greedy_ids_equal_transformers_through_kv_cache() {
    let r = reference();
    let engine = common::load(&common::tiny_qwen3_dir(), 256);
    let cfg = engine.model.config();
    assert_eq!(
        (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        (5, 64, 4, 2, 16)
    );
    assert!(cfg.qk_norm == strata_formats::QkNorm::PerHead && !cfg.tie_word_embeddings);
    let want = ids(&r["target_greedy_ids"]);
    // Chunked prefill (chunk 7 < 24 prompt tokens) must not change anything.
    for chunk in [512, 7] {
        let mut req =
            GenerateRequest::new(ids(&r["input_ids"]), want.len(), SamplingParams::greedy());
        req.ignore_eos = true;
        req.prefill_chunk = chunk;
        let mut cache = engine.new_cache(256).unwrap();
        let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(gen.tokens, want, "prefill chunk {chunk}");
    }
}

#[test]
fn eos_comes_from_config_and_tokenizer_config() {
    let engine = common::load(&common::tiny_qwen3_dir(), 64);
    assert!(engine.tokenizer.eos_ids.contains(&510), "{:?}", engine.tokenizer.eos_ids);
    assert_eq!(engine.tokenizer.bos_id, None);
}
