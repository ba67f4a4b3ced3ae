//! MoE architectures against transformers 5.23 (float32 forward on bf16-stored weights):
//! `tests/fixtures/moe-tiny/` holds qwen3_moe (from ../shared, GGUF by llama.cpp's converter) and
//! qwen2_moe, mixtral, olmoe, qwen3_moe_dense, granitemoe (HF only) made by `scripts/make_moe_fixtures.py` (GGUF by the same
//! converter, f32). Each form must give the reference's last-position logits within 1e-4, its argmax at
//! every position, its 16 greedy ids through the KV cache, and transformers' routing (expert ids and
//! weights per token per MoE layer, captured from its router modules).

mod common;

use std::ops::ControlFlow;
use std::path::PathBuf;

use serde_json::Value;
use strata_engine::{GenerateRequest, SamplingParams};
use strata_models::Logits;

const LOGIT_TOL: f32 = 1e-4;
const WEIGHT_TOL: f32 = 1e-5;

fn fixtures() -> PathBuf {
    common::repo_root().join("tests/fixtures/moe-tiny")
}

fn json(name: &str) -> Value {
    let p = fixtures().join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Runs the three reference checks and the routing check on one model form (`path` is an HF dir or a GGUF).
fn check(arch: &str, path: PathBuf) {
    let r = json(&format!("{arch}.reference.json"));
    let engine = common::load(&path, 256);
    let prompt = u32s(&r["input_ids"]);
    let what = path.file_name().unwrap().to_string_lossy().into_owned();

    // Logits at every position in one prefill pass.
    let mut cache = engine.new_cache(256).unwrap();
    let out = engine.model.forward(&prompt, &mut cache, Logits::All, &[]).unwrap();
    let logits = out.logits.to_vec2::<f32>().unwrap();
    let argmax: Vec<u32> = logits.iter().map(|row| strata_engine::sampling::argmax(row)).collect();
    assert_eq!(argmax, u32s(&r["argmax_per_position"]), "{what}: per-position argmax");
    let want = f32s(&r["last_logits"]);
    let last = logits.last().unwrap();
    let diff = last.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{what}: last-position logits max |Δ| = {diff:.2e}");
    assert!(diff <= LOGIT_TOL, "{what}: last-position logits differ by {diff} (> {LOGIT_TOL})");

    // Routing equals transformers' router modules (where the fixture recorded it).
    let routing_file = format!("{arch}.routing.json");
    if !fixtures().join(&routing_file).exists() {
        return check_greedy(&engine, &r, &what);
    }
    let routing = json(&routing_file);
    let layers = routing["layers"].as_array().unwrap();
    assert_eq!(out.routing.len(), layers.len(), "{what}: number of MoE layers");
    for (ours, theirs) in out.routing.iter().zip(layers) {
        assert_eq!(
            ours.layer,
            theirs["layer"].as_u64().unwrap() as usize,
            "{what}: MoE layer index"
        );
        let ids = theirs["expert_ids"].as_array().unwrap();
        let ws = theirs["expert_weights"].as_array().unwrap();
        assert_eq!(ours.num_tokens(), ids.len());
        for t in 0..ids.len() {
            let (our_ids, our_w) = ours.token(t);
            assert_eq!(
                our_ids,
                u32s(&ids[t]).as_slice(),
                "{what}: layer {} token {t} experts",
                ours.layer
            );
            for (a, b) in our_w.iter().zip(f32s(&ws[t])) {
                assert!(
                    (a - b).abs() <= WEIGHT_TOL,
                    "{what}: layer {} token {t} weights {our_w:?} vs {:?}",
                    ours.layer,
                    ws[t]
                );
            }
        }
    }

    check_greedy(&engine, &r, &what);
}

/// 16 greedy ids through the KV cache (prefill, then one token per step).
fn check_greedy(engine: &strata_engine::Engine, r: &Value, what: &str) {
    let prompt = u32s(&r["input_ids"]);
    let want = u32s(&r["greedy_ids"]);
    let mut req = GenerateRequest::new(prompt, want.len(), SamplingParams::greedy());
    req.ignore_eos = true;
    let mut cache = engine.new_cache(256).unwrap();
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(gen.tokens, want, "{what}: greedy ids");
}

#[test]
fn qwen3_moe_hf() {
    check("qwen3_moe", fixtures().join("qwen3_moe"));
}

#[test]
fn qwen3_moe_gguf() {
    check("qwen3_moe", fixtures().join("qwen3_moe.gguf"));
}

#[test]
fn qwen3_moe_with_dense_layers_hf() {
    // decoder_sparse_step 2 and mlp_only_layers [3]: only layer 1 is sparse.
    let cfg = strata_formats::ModelFiles::open(fixtures().join("qwen3_moe_dense"))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(
        (0..4).map(|i| cfg.is_moe_layer(i)).collect::<Vec<_>>(),
        [false, true, false, false]
    );
    check("qwen3_moe_dense", fixtures().join("qwen3_moe_dense"));
}

/// The architecture added as one file (`strata-formats/src/arch/granitemoe.rs`) plus one registry
/// line: embedding/residual/attention/logit multipliers, softmax over the top-k logits, fused
/// `input_linear` experts, `router.layer` names.
#[test]
fn granitemoe_hf() {
    check("granitemoe", fixtures().join("granitemoe"));
}

/// Granite's experts stream like any other fused HF layout.
#[test]
fn granitemoe_hf_streamed() {
    let r = json("granitemoe.reference.json");
    let mut opts = strata_engine::LoadOptions::new(256, candle_core::Device::Cpu);
    opts.stream_experts = Some(strata_engine::StreamOptions {
        budget: strata_engine::CacheBudget::Percent(25.0),
        ..Default::default()
    });
    let engine =
        strata_engine::Engine::load(&fixtures().join("granitemoe"), &opts, &mut |_, _| {}).unwrap();
    check_greedy(&engine, &r, "granitemoe streamed at 25%");
}

#[test]
fn qwen2_moe_hf() {
    check("qwen2_moe", fixtures().join("qwen2_moe"));
}

#[test]
fn qwen2_moe_gguf() {
    check("qwen2_moe", fixtures().join("qwen2_moe.gguf"));
}

#[test]
fn mixtral_hf() {
    check("mixtral", fixtures().join("mixtral"));
}

#[test]
fn mixtral_gguf() {
    check("mixtral", fixtures().join("mixtral.gguf"));
}

#[test]
fn olmoe_hf() {
    check("olmoe", fixtures().join("olmoe"));
}

#[test]
fn olmoe_gguf() {
    check("olmoe", fixtures().join("olmoe.gguf"));
}

#[test]
fn qwen3_next_hf() {
    check("qwen3_next", fixtures().join("qwen3_next"));
}

#[test]
fn qwen3_next_gguf() {
    check("qwen3_next", fixtures().join("qwen3_next.gguf"));
}

#[test]
fn qwen3_5_moe_hf() {
    check("qwen3_5_moe", fixtures().join("qwen3_5_moe"));
}

#[test]
fn qwen3_5_moe_gguf() {
    // llama.cpp's converter reorders qwen35moe value heads (grouped → tiled): read as such.
    let cfg = strata_formats::ModelFiles::open(fixtures().join("qwen3_5_moe.gguf"))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(cfg.linear_attn.as_ref().unwrap().head_order, strata_formats::HeadOrder::Tiled);
    check("qwen3_5_moe", fixtures().join("qwen3_5_moe.gguf"));
}

#[test]
fn generate_and_chat_work_on_moe_models() {
    // The same Engine path `strata generate` / `strata serve` use: chat template from the model dir.
    let engine = common::load(&fixtures().join("qwen3_moe"), 128);
    let (_, prompt) =
        engine.chat_prompt(&[strata_formats::ChatMessage::new("user", "Hello")]).unwrap();
    let mut req = GenerateRequest::new(prompt, 8, SamplingParams::greedy());
    req.ignore_eos = true;
    let mut cache = engine.new_cache(128).unwrap();
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(gen.tokens.len(), 8);
}

/// Writes a safetensors file from `(name, dtype, shape, bytes)` entries.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, String, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}));
        offset += bytes.len();
    }
    let h = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// A copy of the qwen3_moe HF dir whose `model.safetensors` is rewritten by `edit`.
fn edited_qwen3_moe(
    tag: &str,
    edit: impl Fn(
        Vec<(String, String, Vec<usize>, Vec<u8>)>,
    ) -> Vec<(String, String, Vec<usize>, Vec<u8>)>,
) -> PathBuf {
    let src = fixtures().join("qwen3_moe");
    let dir = std::env::temp_dir().join(format!("strata-moe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        if f.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    let set =
        strata_formats::safetensors::SafetensorsSet::open(vec![src.join("model.safetensors")])
            .unwrap();
    let mut names: Vec<&String> = set.tensors.keys().collect();
    names.sort();
    let tensors = names
        .into_iter()
        .map(|n| {
            let info = set.info(n).unwrap();
            (n.clone(), info.dtype.clone(), info.shape.clone(), set.bytes(info).to_vec())
        })
        .collect();
    write_safetensors(&dir.join("model.safetensors"), &edit(tensors));
    dir
}

#[test]
fn qwen3_moe_hf_fused_expert_layout() {
    // transformers 5's fused layout: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I].
    let dir = edited_qwen3_moe("fused", |tensors| {
        let (experts, mut rest): (Vec<_>, Vec<_>) =
            tensors.into_iter().partition(|t| t.0.contains(".mlp.experts."));
        let get = |name: &str| {
            experts.iter().find(|t| t.0 == name).unwrap_or_else(|| panic!("{name}")).clone()
        };
        for layer in 0..4 {
            let p = |e: usize, proj: &str| {
                format!("model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
            };
            let (mut gate_up, mut down) = (Vec::new(), Vec::new());
            for e in 0..8 {
                gate_up.extend(get(&p(e, "gate_proj")).3);
                gate_up.extend(get(&p(e, "up_proj")).3);
                down.extend(get(&p(e, "down_proj")).3);
            }
            rest.push((
                format!("model.layers.{layer}.mlp.experts.gate_up_proj"),
                "BF16".into(),
                vec![8, 64, 64],
                gate_up,
            ));
            rest.push((
                format!("model.layers.{layer}.mlp.experts.down_proj"),
                "BF16".into(),
                vec![8, 64, 32],
                down,
            ));
        }
        rest
    });
    let layout = strata_formats::ModelFiles::open(&dir)
        .unwrap()
        .expert_layout(
            0,
            strata_formats::ExpertDims { num_experts: 8, hidden: 64, intermediate: 32 },
        )
        .unwrap();
    assert!(matches!(layout, strata_formats::ExpertLayout::HfFused { .. }), "{layout:?}");
    check("qwen3_moe", dir.clone());
    let _ = std::fs::remove_dir_all(dir);
}

fn load_error(path: &std::path::Path) -> String {
    let opts = strata_engine::LoadOptions::new(64, candle_core::Device::Cpu);
    match strata_engine::Engine::load(path, &opts, &mut |_, _| {}) {
        Ok(_) => panic!("{} loaded but its expert shapes are inconsistent", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn inconsistent_expert_shapes_are_a_load_error_naming_the_tensor() {
    // HF: one expert's up_proj stored as [64, 32] instead of [32, 64] (same byte count).
    let bad = "model.layers.2.mlp.experts.5.up_proj.weight";
    let dir = edited_qwen3_moe("badshape", |mut tensors| {
        let t = tensors.iter_mut().find(|t| t.0 == bad).unwrap();
        t.2 = vec![64, 32];
        tensors
    });
    let msg = load_error(&dir);
    assert!(msg.contains(bad) && msg.contains("[32, 64]"), "{msg}");
    let _ = std::fs::remove_dir_all(dir);

    // GGUF: blk.1.ffn_up_exps.weight's two inner dims swapped in the tensor table (same byte count).
    let mut bytes = std::fs::read(fixtures().join("qwen3_moe.gguf")).unwrap();
    let name = b"blk.1.ffn_up_exps.weight";
    let at =
        bytes.windows(name.len()).position(|w| w == name).expect("tensor name in the GGUF header")
            + name.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 3, "3-D expert tensor");
    let dims = at + 4; // ne[0] = hidden (64), ne[1] = expert intermediate (32), ne[2] = experts
    let (ne0, ne1) = (bytes[dims..dims + 8].to_vec(), bytes[dims + 8..dims + 16].to_vec());
    bytes[dims..dims + 8].copy_from_slice(&ne1);
    bytes[dims + 8..dims + 16].copy_from_slice(&ne0);
    let path =
        std::env::temp_dir().join(format!("strata-moe-badshape-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let msg = load_error(&path);
    assert!(msg.contains("blk.1.ffn_up_exps.weight"), "{msg}");
    let _ = std::fs::remove_file(path);
}
