//! Bad model files give clear errors that name the file, tensor or key — never a panic.

mod common;

use std::path::{Path, PathBuf};

use strata_engine::{Engine, EngineError, LoadOptions};
use strata_formats::FormatError;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-load-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load_err(path: &Path) -> FormatError {
    let opts = LoadOptions::new(64, candle_core::Device::Cpu);
    match Engine::load(path, &opts, &mut |_, _| {}) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(EngineError::Format(e)) => *e,
        Err(EngineError::Model(strata_models::ModelError::Format(e))) => *e,
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

/// A minimal GGUF v3 writer for crafting bad files: metadata strings/u32s and raw tensors.
fn write_gguf(path: &Path, kv: &[(&str, GgufVal)], tensors: &[(&str, &[u64], u32, usize)]) {
    let mut b: Vec<u8> = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(0x4655_4747u32.to_le_bytes());
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        match v {
            GgufVal::Str(x) => {
                b.extend(8u32.to_le_bytes());
                s(&mut b, x);
            }
            GgufVal::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims.iter().rev() {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (*bytes as u64).div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.resize(b.len() + offset as usize, 0);
    std::fs::write(path, b).unwrap();
}

enum GgufVal {
    Str(&'static str),
    U32(u32),
}

#[test]
fn missing_file() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(matches!(e, FormatError::MissingFile { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn not_a_model() {
    let d = scratch("notmodel");
    let p = d.join("notes.txt");
    std::fs::write(&p, "hello, this is not a model file at all").unwrap();
    let e = load_err(&p);
    assert!(matches!(e, FormatError::UnknownFormat { .. }), "{e}");
    let e = load_err(&d);
    assert!(e.to_string().contains("config.json"), "{e}");
}

#[test]
fn truncated_gguf_names_the_tensor() {
    let d = scratch("trunc");
    let src = std::fs::read(common::smollm2_path()).unwrap();
    let p = d.join("half.gguf");
    std::fs::write(&p, &src[..src.len() / 2]).unwrap();
    let e = load_err(&p);
    match &e {
        FormatError::Truncated { tensor, .. } => {
            assert!(tensor.starts_with("blk.") || tensor.contains("weight"), "{e}")
        }
        _ => panic!("expected Truncated, got {e}"),
    }
    assert!(e.to_string().contains("half.gguf"), "{e}");
    // A file cut inside the header is also an error, not a panic.
    let p = d.join("header.gguf");
    std::fs::write(&p, &src[..5000]).unwrap();
    let e = load_err(&p);
    assert!(e.to_string().contains("truncated"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let d = scratch("arch");
    let p = d.join("mamba.gguf");
    write_gguf(
        &p,
        &[
            ("general.architecture", GgufVal::Str("mamba9")),
            ("mamba9.block_count", GgufVal::U32(1)),
        ],
        &[("token_embd.weight", &[4, 32], 0, 4 * 32 * 4)],
    );
    let e = load_err(&p);
    assert!(matches!(&e, FormatError::UnknownArchitecture { arch, .. } if arch == "mamba9"), "{e}");
}

#[test]
fn unsupported_tensor_type_is_named() {
    let d = scratch("dtype");
    let p = d.join("iq.gguf");
    // ggml type 16 = IQ2_XXS, which candle has no kernels for.
    write_gguf(
        &p,
        &[("general.architecture", GgufVal::Str("llama"))],
        &[("blk.0.attn_q.weight", &[256, 256], 16, 256 * 256)],
    );
    let e = load_err(&p);
    match &e {
        FormatError::UnsupportedTensorType { tensor, dtype, .. } => {
            assert_eq!(tensor, "blk.0.attn_q.weight");
            assert!(dtype.contains("IQ2_XXS"), "{e}");
        }
        _ => panic!("expected UnsupportedTensorType, got {e}"),
    }
}

fn copy_tiny_qwen3(dst: &Path) {
    for f in std::fs::read_dir(common::tiny_qwen3_dir()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
    }
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let d = scratch("shape");
    copy_tiny_qwen3(&d);
    let cfg_path = d.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(&cfg_path, cfg).unwrap();
    let e = load_err(&d);
    match &e {
        FormatError::ShapeMismatch { tensor, expected, actual, .. } => {
            assert_eq!(tensor, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!(
                (expected.as_slice(), actual.as_slice()),
                (&[96usize, 64][..], &[128usize, 64][..])
            );
        }
        _ => panic!("expected ShapeMismatch, got {e}"),
    }
}

#[test]
fn truncated_safetensors_names_the_tensor() {
    let d = scratch("st");
    copy_tiny_qwen3(&d);
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let e = load_err(&d);
    assert!(matches!(e, FormatError::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
}

#[test]
fn missing_metadata_key_is_named() {
    let d = scratch("missing");
    let p = d.join("empty-llama.gguf");
    write_gguf(
        &p,
        &[
            ("general.architecture", GgufVal::Str("llama")),
            ("llama.block_count", GgufVal::U32(1)),
            ("llama.embedding_length", GgufVal::U32(32)),
            ("llama.feed_forward_length", GgufVal::U32(64)),
            ("llama.attention.head_count", GgufVal::U32(2)),
            ("llama.vocab_size", GgufVal::U32(8)),
            ("tokenizer.ggml.model", GgufVal::Str("gpt2")),
        ],
        &[("token_embd.weight", &[8, 32], 0, 8 * 32 * 4)],
    );
    let e = load_err(&p);
    // The config is complete; the tokenizer has no token list.
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");
}

/// Copies a GGUF with extra metadata `extra` (tensors byte for byte).
fn copy_gguf_with(
    src: &Path,
    dst: &Path,
    extra: Vec<(String, strata_formats::gguf_write::MetaValue)>,
) {
    use std::io::{Read, Seek, SeekFrom};
    use strata_formats::gguf_write::{write_gguf, MetaValue, TensorSpec};
    let g = strata_formats::gguf::GgufFile::open(src).unwrap();
    let mut meta: Vec<(String, MetaValue)> =
        g.metadata.iter().map(|(k, v)| (k.clone(), MetaValue::Gguf(v.clone()))).collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    meta.extend(extra);
    let specs: Vec<TensorSpec> = g
        .tensor_order
        .iter()
        .map(|n| TensorSpec {
            name: n.clone(),
            shape: g.tensors[n].shape.clone(),
            dtype: g.tensors[n].dtype,
            align: 0,
        })
        .collect();
    let mut f = std::fs::File::open(src).unwrap();
    let mut fill = |i: usize, offset: u64, buf: &mut [u8]| {
        f.seek(SeekFrom::Start(g.tensors[&g.tensor_order[i]].offset + offset))
            .map_err(|e| e.to_string())?;
        f.read_exact(buf).map_err(|e| e.to_string())
    };
    write_gguf(dst, &meta, &specs, 1 << 20, &mut fill, &mut |_, _| {}).unwrap();
}

#[test]
fn a_routing_override_in_a_model_strata_synth_did_not_write_is_refused() {
    let src = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_moe.gguf");
    let d = scratch("override");
    // The copy without extra keys loads: the refusal below is the keys' doing.
    let plain = d.join("plain.gguf");
    copy_gguf_with(&src, &plain, Vec::new());
    Engine::load(&plain, &LoadOptions::new(64, candle_core::Device::Cpu), &mut |_, _| {}).unwrap();
    let forged = d.join("forged.gguf");
    copy_gguf_with(&src, &forged, strata_formats::SyntheticRouting::uniform(1).to_metadata());
    let msg = load_err(&forged).to_string();
    assert!(
        msg.contains("strata.synthetic.routing")
            && msg.contains("only models written by `strata synth`"),
        "{msg}"
    );
}
