//! Synthetic MoE models for benchmarks (`strata synth`): valid GGUF files with a real
//! architecture's dimensions, random weights from a seeded PRNG, and a byte-level tokenizer.
//!
//! Speed does not depend on weight values, but cache behaviour depends on routing, and random
//! routers route unlike trained ones: a random model's hidden states barely vary, so decoding
//! reuses the same few experts (95% hits with a quarter of the experts cached: `local` routing).
//! `routing: Some(..)` writes a routing override into the metadata
//! ([`strata_formats::synthetic`]; applied by `strata_models::synthetic_routing`): `uniform` (the
//! worst case) or `realistic` (calibrated to published decode statistics of trained models).
//! `routing_skew = S` (for `local` routing) writes a router bias
//! `ffn_gate_inp.bias[e] = -S · ln(rank(e))` (a random rank per layer), which multiplies expert
//! `e`'s softmax score by `rank^-S`: a Zipf(S) popularity. llama.cpp does not load that extra
//! tensor and ignores the override keys (it routes such files by their random routers); files
//! without skew follow llama.cpp's `qwen3moe` / `llama` (Mixtral) layouts exactly.
//!
//! Quantized blocks get random quants with fixed scales chosen so that weights are zero-mean with a
//! standard deviation of about 0.02 (Q4_K: `d = 2.5e-4`, `dmin = 1.875e-3`, as the synthetic
//! Qwen3-30B-A3B in `../shared/tools/make_synth_qwen3moe.py`).

use std::path::Path;

use candle_core::quantized::GgmlDType;
use half::f16;
use strata_formats::gguf_write::{write_gguf, MetaValue, TensorSpec};
use strata_formats::SyntheticRouting;

/// Dimensions of a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthPreset {
    pub name: &'static str,
    /// GGUF architecture: `qwen3moe` or `llama` (Mixtral).
    pub arch: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub context: usize,
    /// q/k RMSNorm per head (Qwen3).
    pub qk_norm: bool,
    /// Intermediate size of the sigmoid-gated shared expert (0: none).
    pub shared_expert_ffn: usize,
    /// Gated DeltaNet layers (hybrid `qwen35moe`); `None` for attention-only models.
    pub linear: Option<LinearPreset>,
}

/// Gated DeltaNet dimensions of a hybrid preset (llama.cpp `qwen35moe` tensors: `attn_qkv`,
/// `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_conv1d`, `ssm_a`, `ssm_dt.bias`, `ssm_norm`, `ssm_out`;
/// the full-attention layers' q projection carries the output gate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearPreset {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    /// Every `full_attention_interval`-th layer is full attention.
    pub full_attention_interval: usize,
}

impl SynthPreset {
    pub const NAMES: [&'static str; 5] =
        ["qwen3-30b-a3b", "mixtral-8x7b", "qwen3.5-122b-a10b", "tiny-moe", "tiny-hybrid"];

    /// Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B), Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1),
    /// Qwen3.5-122B-A10B (the `text_config` of Qwen/Qwen3.5-122B-A10B: 48 layers, 3 of 4 Gated
    /// DeltaNet, 256 experts top-8 plus a shared expert), and 4-layer models small enough for tests.
    pub fn by_name(name: &str) -> Option<Self> {
        Some(match name {
            "qwen3-30b-a3b" => Self {
                name: "qwen3-30b-a3b",
                arch: "qwen3moe",
                layers: 48,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                experts: 128,
                top_k: 8,
                expert_ffn: 768,
                vocab: 151_936,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                context: 32_768,
                qk_norm: true,
                shared_expert_ffn: 0,
                linear: None,
            },
            "mixtral-8x7b" => Self {
                name: "mixtral-8x7b",
                arch: "llama",
                layers: 32,
                hidden: 4096,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                experts: 8,
                top_k: 2,
                expert_ffn: 14_336,
                vocab: 32_000,
                rope_theta: 1e6,
                rms_eps: 1e-5,
                context: 32_768,
                qk_norm: false,
                shared_expert_ffn: 0,
                linear: None,
            },
            "tiny-moe" => Self {
                name: "tiny-moe",
                arch: "qwen3moe",
                layers: 4,
                hidden: 256,
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                experts: 16,
                top_k: 4,
                expert_ffn: 256,
                vocab: 512,
                rope_theta: 1e6,
                rms_eps: 1e-6,
                context: 4096,
                qk_norm: true,
                shared_expert_ffn: 0,
                linear: None,
            },
            "qwen3.5-122b-a10b" => Self {
                name: "qwen3.5-122b-a10b",
                arch: "qwen35moe",
                layers: 48,
                hidden: 3072,
                heads: 32,
                kv_heads: 2,
                head_dim: 256,
                experts: 256,
                top_k: 8,
                expert_ffn: 1024,
                vocab: 248_320,
                rope_theta: 1e7,
                rms_eps: 1e-6,
                context: 262_144,
                qk_norm: true,
                shared_expert_ffn: 1024,
                linear: Some(LinearPreset {
                    k_heads: 16,
                    v_heads: 64,
                    k_dim: 128,
                    v_dim: 128,
                    conv_kernel: 4,
                    full_attention_interval: 4,
                }),
            },
            // The qwen3.5-122b-a10b layout at test size.
            "tiny-hybrid" => Self {
                name: "tiny-hybrid",
                layers: 4,
                hidden: 256,
                heads: 4,
                head_dim: 64,
                experts: 16,
                top_k: 4,
                expert_ffn: 256,
                vocab: 512,
                context: 4096,
                shared_expert_ffn: 256,
                linear: Some(LinearPreset {
                    k_heads: 2,
                    v_heads: 4,
                    k_dim: 64,
                    v_dim: 64,
                    conv_kernel: 4,
                    full_attention_interval: 4,
                }),
                ..Self::by_name("qwen3.5-122b-a10b")?
            },
            _ => return None,
        })
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub preset: SynthPreset,
    /// Type of every 2-D/3-D weight (routers stay F32): Q4_K, Q4_1, Q8_0 or F32.
    pub quant: GgmlDType,
    pub seed: u64,
    /// Zipf exponent of expert popularity planted as a router bias (see the module docs); `None`:
    /// none. Only meaningful with `routing: None` (with an override it only changes weights).
    pub routing_skew: Option<f64>,
    /// A routing override written into the metadata (`strata synth --routing uniform|realistic`);
    /// `None`: the random router decides (`--routing local`).
    pub routing: Option<SyntheticRouting>,
}

/// Sizes of the written file.
#[derive(Debug, Clone, Copy)]
pub struct SynthReport {
    pub file_bytes: u64,
    /// Routed experts' bytes (all layers).
    pub expert_bytes: u64,
}

/// Parses `Q4_K`, `Q4_1`, `Q8_0`, `F32` (case-insensitive, `_` optional).
pub fn parse_quant(s: &str) -> Result<GgmlDType, String> {
    match s.to_ascii_uppercase().replace('_', "").as_str() {
        "Q4K" => Ok(GgmlDType::Q4K),
        "Q41" => Ok(GgmlDType::Q4_1),
        "Q80" => Ok(GgmlDType::Q8_0),
        "F32" => Ok(GgmlDType::F32),
        _ => Err(format!("unsupported --quant `{s}` (Q4_K, Q4_1, Q8_0, F32)")),
    }
}

/// How a tensor's values are generated.
#[derive(Debug, Clone)]
enum Fill {
    Random,
    Ones,
    Values(Vec<f32>),
}

/// wyrand (Wang Yi): a fast 64-bit PRNG; reproducible from its seed.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xA076_1D64_78BD_642F);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xE703_7ED1_A0B4_28DB) as u128);
        ((t >> 64) ^ t) as u64
    }
    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// GPT-2's byte symbols in HF tokenizers' vocabulary order: the printable bytes first, then the
/// others (each id the same as GPT-2's `encoder.json`).
fn byte_symbols() -> Vec<String> {
    let table = strata_formats::tokenizer::gpt2_byte_symbols();
    let mut order: Vec<usize> = (0..256).collect();
    order.sort_by_key(|&b| table[b] as u32);
    order.into_iter().map(|b| table[b].to_string()).collect()
}

/// Byte-level BPE vocabulary: 256 byte symbols, "ĠĠ" (the one merge), fillers, and
/// `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (at Qwen's ids when the vocabulary is Qwen's).
fn vocab(size: usize) -> (Vec<String>, Vec<i32>, [u32; 3]) {
    let special_at = if size == 151_936 { 151_643 } else { size - 3 };
    let names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut toks = byte_symbols();
    toks.push("\u{120}\u{120}".into());
    let mut types = vec![1; toks.len()];
    while toks.len() < size {
        let i = toks.len();
        if (special_at..special_at + 3).contains(&i) {
            toks.push(names[i - special_at].into());
            types.push(3);
        } else {
            toks.push(format!("fill{i}"));
            types.push(1);
        }
    }
    let s = special_at as u32;
    (toks, types, [s, s + 1, s + 2])
}

fn metadata(
    p: &SynthPreset,
    quant: GgmlDType,
    routing: Option<&SyntheticRouting>,
) -> Vec<(String, MetaValue)> {
    let a = p.arch;
    let k = |s: &str| format!("{a}.{s}");
    let (toks, types, [eot, _, im_end]) = vocab(p.vocab);
    let mut m = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        (
            "general.name".into(),
            MetaValue::Str(format!(
                "{} synthetic ({quant:?}, random weights, {} layers)",
                p.name, p.layers
            )),
        ),
        ("general.alignment".into(), MetaValue::U32(strata_formats::gguf_write::ALIGNMENT as u32)),
        (k("block_count"), MetaValue::U32(p.layers as u32)),
        (k("context_length"), MetaValue::U32(p.context as u32)),
        (k("embedding_length"), MetaValue::U32(p.hidden as u32)),
        // qwen3moe: the dense FFN size (unused: every layer is MoE); llama (Mixtral): the expert FFN.
        (
            k("feed_forward_length"),
            MetaValue::U32(
                (if a == "qwen3moe" { p.expert_ffn * p.top_k } else { p.expert_ffn }) as u32,
            ),
        ),
        (k("attention.head_count"), MetaValue::U32(p.heads as u32)),
        (k("attention.head_count_kv"), MetaValue::U32(p.kv_heads as u32)),
        (k("attention.key_length"), MetaValue::U32(p.head_dim as u32)),
        (k("attention.value_length"), MetaValue::U32(p.head_dim as u32)),
        (k("rope.freq_base"), MetaValue::F32(p.rope_theta)),
        // Qwen3.5 rotates a quarter of each head (`partial_rotary_factor` 0.25).
        (
            k("rope.dimension_count"),
            MetaValue::U32((if p.linear.is_some() { p.head_dim / 4 } else { p.head_dim }) as u32),
        ),
        (k("attention.layer_norm_rms_epsilon"), MetaValue::F32(p.rms_eps)),
        (k("expert_count"), MetaValue::U32(p.experts as u32)),
        (k("expert_used_count"), MetaValue::U32(p.top_k as u32)),
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::StrArray(toks)),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32Array(types)),
        ("tokenizer.ggml.merges".into(), MetaValue::StrArray(vec!["\u{120} \u{120}".into()])),
        ("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(eot)),
        ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(im_end)),
        ("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(false)),
    ];
    if a != "llama" {
        m.push((k("expert_feed_forward_length"), MetaValue::U32(p.expert_ffn as u32)));
    }
    if p.shared_expert_ffn > 0 {
        m.push((
            k("expert_shared_feed_forward_length"),
            MetaValue::U32(p.shared_expert_ffn as u32),
        ));
    }
    if let Some(r) = routing {
        m.extend(r.to_metadata());
    }
    if let Some(la) = &p.linear {
        m.push((k("ssm.conv_kernel"), MetaValue::U32(la.conv_kernel as u32)));
        m.push((k("ssm.state_size"), MetaValue::U32(la.k_dim as u32)));
        m.push((k("ssm.group_count"), MetaValue::U32(la.k_heads as u32)));
        m.push((k("ssm.time_step_rank"), MetaValue::U32(la.v_heads as u32)));
        m.push((k("ssm.inner_size"), MetaValue::U32((la.v_heads * la.v_dim) as u32)));
        m.push((k("full_attention_interval"), MetaValue::U32(la.full_attention_interval as u32)));
        // M-RoPE sections over the rotated pairs (Qwen3.5's `mrope_section` [11, 11, 10] for its
        // 32 pairs), which llama.cpp requires; text positions are equal in all three, so the
        // rotation is plain RoPE either way (Strata does not read the key).
        let pairs = (p.head_dim / 4 / 2) as i32;
        let sections = vec![(pairs + 2) / 3, (pairs + 1) / 3, pairs / 3, 0];
        m.push((k("rope.dimension_sections"), MetaValue::I32Array(sections)));
    }
    m
}

fn tensors(o: &SynthOptions) -> Vec<(TensorSpec, Fill)> {
    let p = &o.preset;
    let q = o.quant;
    let t = |name: String, shape: Vec<usize>, dtype| TensorSpec { name, shape, dtype, align: 0 };
    let (h, hd, e, i) = (p.hidden, p.head_dim, p.experts, p.expert_ffn);
    let mut rng = Rng::new(o.seed ^ 0x5EED);
    let mut v = vec![(t("token_embd.weight".into(), vec![p.vocab, h], q), Fill::Random)];
    // The layout readers derive from `full_attention_interval` (written in the metadata).
    let recurrent = p.linear.map_or_else(
        || vec![false; p.layers],
        |la| {
            strata_formats::LinearAttnConfig::interval_layout(p.layers, la.full_attention_interval)
        },
    );
    for (l, &is_recurrent) in recurrent.iter().enumerate() {
        let b = |s: &str| format!("blk.{l}.{s}");
        v.push((t(b("attn_norm.weight"), vec![h], GgmlDType::F32), Fill::Ones));
        match &p.linear {
            Some(la) if is_recurrent => {
                let (kw, vw, nv) = (la.k_heads * la.k_dim, la.v_heads * la.v_dim, la.v_heads);
                let f32 = GgmlDType::F32;
                v.push((t(b("attn_qkv.weight"), vec![2 * kw + vw, h], q), Fill::Random));
                v.push((t(b("attn_gate.weight"), vec![vw, h], q), Fill::Random));
                v.push((t(b("ssm_beta.weight"), vec![nv, h], q), Fill::Random));
                v.push((t(b("ssm_alpha.weight"), vec![nv, h], q), Fill::Random));
                v.push((
                    t(b("ssm_conv1d.weight"), vec![2 * kw + vw, la.conv_kernel], f32),
                    Fill::Random,
                ));
                // Decay exp(−0.5·softplus(a)) ≈ 0.7 per token.
                v.push((t(b("ssm_a"), vec![nv], f32), Fill::Values(vec![-0.5; nv])));
                v.push((t(b("ssm_dt.bias"), vec![nv], f32), Fill::Values(vec![0.0; nv])));
                v.push((t(b("ssm_norm.weight"), vec![la.v_dim], f32), Fill::Ones));
                v.push((t(b("ssm_out.weight"), vec![h, vw], q), Fill::Random));
            }
            _ => {
                // Hybrid full attention: the q projection carries the output gate.
                let gate = if p.linear.is_some() { 2 } else { 1 };
                v.push((t(b("attn_q.weight"), vec![gate * p.heads * hd, h], q), Fill::Random));
                v.push((t(b("attn_k.weight"), vec![p.kv_heads * hd, h], q), Fill::Random));
                v.push((t(b("attn_v.weight"), vec![p.kv_heads * hd, h], q), Fill::Random));
                v.push((t(b("attn_output.weight"), vec![h, p.heads * hd], q), Fill::Random));
                if p.qk_norm {
                    v.push((t(b("attn_q_norm.weight"), vec![hd], GgmlDType::F32), Fill::Ones));
                    v.push((t(b("attn_k_norm.weight"), vec![hd], GgmlDType::F32), Fill::Ones));
                }
            }
        }
        let ffn_norm =
            if p.linear.is_some() { "post_attention_norm.weight" } else { "ffn_norm.weight" };
        v.push((t(b(ffn_norm), vec![h], GgmlDType::F32), Fill::Ones));
        if p.shared_expert_ffn > 0 {
            let sf = p.shared_expert_ffn;
            v.push((t(b("ffn_gate_inp_shexp.weight"), vec![1, h], GgmlDType::F32), Fill::Random));
            v.push((t(b("ffn_gate_shexp.weight"), vec![sf, h], q), Fill::Random));
            v.push((t(b("ffn_up_shexp.weight"), vec![sf, h], q), Fill::Random));
            v.push((t(b("ffn_down_shexp.weight"), vec![h, sf], q), Fill::Random));
        }
        v.push((t(b("ffn_gate_inp.weight"), vec![e, h], GgmlDType::F32), Fill::Random));
        if let Some(s) = o.routing_skew {
            // A random rank per expert (Fisher-Yates), bias -S·ln(rank).
            let mut ranks: Vec<usize> = (1..=e).collect();
            for j in (1..e).rev() {
                ranks.swap(j, (rng.next() % (j as u64 + 1)) as usize);
            }
            let bias = ranks.iter().map(|&r| -(s * (r as f64).ln()) as f32).collect();
            v.push((t(b("ffn_gate_inp.bias"), vec![e], GgmlDType::F32), Fill::Values(bias)));
        }
        v.push((t(b("ffn_gate_exps.weight"), vec![e, i, h], q), Fill::Random));
        v.push((t(b("ffn_up_exps.weight"), vec![e, i, h], q), Fill::Random));
        v.push((t(b("ffn_down_exps.weight"), vec![e, h, i], q), Fill::Random));
    }
    v.push((t("output_norm.weight".into(), vec![h], GgmlDType::F32), Fill::Ones));
    v.push((t("output.weight".into(), vec![p.vocab, h], q), Fill::Random));
    v
}

/// Random blocks of `dtype` into `buf` (whole blocks). Weights have std ≈ 0.02.
fn fill_random(dtype: GgmlDType, buf: &mut [u8], rng: &mut Rng) {
    for c in buf.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        c.copy_from_slice(&r[..c.len()]);
    }
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes())
    };
    match dtype {
        GgmlDType::Q4K => buf.chunks_exact_mut(144).for_each(|b| {
            put(b, 0, 2.5e-4);
            put(b, 2, 1.875e-3);
        }),
        GgmlDType::Q4_1 => buf.chunks_exact_mut(20).for_each(|b| {
            put(b, 0, 0.009);
            put(b, 2, -0.0675);
        }),
        GgmlDType::Q8_0 => buf.chunks_exact_mut(34).for_each(|b| put(b, 0, 2.7e-4)),
        _ => buf
            .chunks_exact_mut(4)
            .for_each(|b| b.copy_from_slice(&(0.0346 * rng.unit()).to_le_bytes())),
    }
}

/// Writes the synthetic model to `out`. `progress(done, total)` in bytes.
///
/// Errors: I/O, or dimensions that do not fit the block type (Q4_K needs multiples of 256).
pub fn synth(
    out: &Path,
    o: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, String> {
    let ts = tensors(o);
    let meta = metadata(&o.preset, o.quant, o.routing.as_ref());
    let specs: Vec<TensorSpec> = ts.iter().map(|(s, _)| s.clone()).collect();
    let mut expert_bytes = 0;
    for s in &specs {
        if s.name.contains("_exps.") {
            expert_bytes += s.bytes()?;
        }
    }
    let seed = o.seed;
    let mut fill = |i: usize, offset: u64, buf: &mut [u8]| {
        let (spec, how) = &ts[i];
        match how {
            Fill::Random => {
                let mut rng = Rng::new(
                    seed ^ (i as u64).wrapping_mul(0x1000_0000_01B3) ^ offset.rotate_left(17),
                );
                fill_random(spec.dtype, buf, &mut rng);
            }
            Fill::Ones => {
                buf.chunks_exact_mut(4).for_each(|b| b.copy_from_slice(&1f32.to_le_bytes()))
            }
            Fill::Values(v) => {
                let start = offset as usize / 4;
                for (b, x) in buf.chunks_exact_mut(4).zip(&v[start..]) {
                    b.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        Ok(())
    };
    write_gguf(out, &meta, &specs, 16 << 20, &mut fill, progress)?;
    let file_bytes = std::fs::metadata(out).map_err(|e| format!("{}: {e}", out.display()))?.len();
    Ok(SynthReport { file_bytes, expert_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_symbols_are_gpt2s() {
        let s = byte_symbols();
        assert_eq!(s.len(), 256);
        assert_eq!(s[0], "!");
        // Bytes outside the printable ranges follow them in byte order: 0x00 at 188, space at 220 ('Ġ').
        assert_eq!(s[188], "\u{100}");
        assert_eq!(s[220], "\u{120}");
        let mut u = s.clone();
        u.sort();
        u.dedup();
        assert_eq!(u.len(), 256);
    }

    #[test]
    fn qwen35_122b_preset_has_the_published_size() {
        let o = SynthOptions {
            preset: SynthPreset::by_name("qwen3.5-122b-a10b").unwrap(),
            quant: GgmlDType::Q4K,
            seed: 0,
            routing_skew: None,
            routing: None,
        };
        let ts = tensors(&o);
        let count = |pred: &dyn Fn(&str) -> bool| {
            ts.iter()
                .filter(|(s, _)| pred(&s.name))
                .map(|(s, _)| s.shape.iter().product::<usize>())
                .sum::<usize>() as f64
        };
        let total = count(&|_| true);
        let experts = count(&|n: &str| n.contains("_exps."));
        // Active per token: everything but the routed experts and the embedding table, plus top-8 of 256.
        let active =
            total - experts - count(&|n: &str| n == "token_embd.weight") + experts * 8.0 / 256.0;
        eprintln!(
            "qwen3.5-122b-a10b preset: {:.1}B parameters, {:.1}B active",
            total / 1e9,
            active / 1e9
        );
        // Qwen's published figures: 122B total (with a vision tower and MTP layer we do not write), 10B active.
        assert!((118e9..123e9).contains(&total), "{total}");
        assert!((9e9..11e9).contains(&active), "{active}");
        assert_eq!(
            ts.iter().filter(|(s, _)| s.name.ends_with("ssm_out.weight")).count(),
            36,
            "3 of 4 layers are Gated DeltaNet"
        );
    }

    #[test]
    fn presets_exist_and_quants_parse() {
        for n in SynthPreset::NAMES {
            assert!(SynthPreset::by_name(n).is_some(), "{n}");
        }
        assert_eq!(parse_quant("q4_k").unwrap(), GgmlDType::Q4K);
        assert!(parse_quant("q3_k").is_err());
    }
}
