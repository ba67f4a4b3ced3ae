//! `strata repack IN OUT`: rewrites an MoE GGUF so that each routed expert's gate, up and down
//! projections are one contiguous byte range starting at a 4 KiB-aligned file offset — one read per
//! expert instead of three. This is the per-expert form of "row-column bundling" (Alizadeh et al.
//! 2023, "LLM in a flash", §3.2: store together what is read together).
//!
//! Layout written: every tensor of the input in its order, except that a layer's three 3-D tensors
//! `blk.L.ffn_{gate,up,down}_exps.weight` `[E, ·, ·]` become, at the place of the first of them,
//! `blk.L.ffn_gate.e.weight`, `blk.L.ffn_up.e.weight`, `blk.L.ffn_down.e.weight` for e = 0..E (the
//! per-expert names llama.cpp used for Mixtral), each gate at a multiple of [`BUNDLE_ALIGN`], the
//! up and down right after it (at the file's `general.alignment`). Metadata is copied verbatim,
//! plus `strata.expert_layout = "bundled"`. Tensor bytes are copied, never re-encoded, so the
//! repacked model computes exactly what the original does.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::gguf::GgufFile;
use crate::gguf_write::{write_gguf, MetaValue, TensorSpec, ALIGNMENT};

/// File-offset alignment of each expert's bundle (bytes): the page size, and `O_DIRECT`'s
/// alignment.
pub const BUNDLE_ALIGN: u64 = 4096;

/// Metadata key marking the bundled layout.
pub const LAYOUT_KEY: &str = "strata.expert_layout";

/// What [`repack_gguf`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepackReport {
    /// MoE layers whose experts were bundled.
    pub layers: usize,
    /// Experts bundled (over all layers).
    pub experts: usize,
    /// Size of the output file (bytes).
    pub file_bytes: u64,
}

/// Where an output tensor's bytes come from in the input file.
struct Source {
    offset: u64,
}

/// Rewrites `input` into `output` (see the module docs). `progress(done, total)` in bytes.
///
/// Errors: `input` unreadable or not a GGUF, `output` the same file as `input`, no 3-D expert
/// tensors (not an MoE GGUF, or already repacked), a layer missing one of its three expert
/// tensors, I/O errors while copying (the incomplete output is then removed).
pub fn repack_gguf(
    input: &Path,
    output: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RepackReport, String> {
    let g = GgufFile::open(input).map_err(|e| e.to_string())?;
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize()) {
        if a == b {
            return Err(format!(
                "{}: the output must be a different file from the input",
                output.display()
            ));
        }
    }
    let align = match g.get("general.alignment") {
        Some(candle_core::quantized::gguf_file::Value::U32(a)) if *a > 0 => *a as u64,
        _ => ALIGNMENT,
    };
    if !BUNDLE_ALIGN.is_multiple_of(align) {
        return Err(format!(
            "{}: general.alignment {align} does not divide {BUNDLE_ALIGN}",
            input.display()
        ));
    }
    let exps = |name: &str| -> Option<usize> {
        let rest = name.strip_prefix("blk.")?;
        let (layer, tail) = rest.split_once('.')?;
        matches!(tail, "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight")
            .then(|| layer.parse().ok())?
    };
    let mut specs = Vec::new();
    let mut sources = Vec::new();
    let mut bundled = HashSet::new();
    let mut experts = 0;
    for name in &g.tensor_order {
        let info = g.tensor_info(name).map_err(|e| e.to_string())?;
        let Some(layer) = exps(name) else {
            specs.push(TensorSpec {
                name: name.clone(),
                shape: info.shape.clone(),
                dtype: info.dtype,
                align: 0,
            });
            sources.push(Source { offset: info.offset });
            continue;
        };
        if !bundled.insert(layer) {
            continue; // the layer's experts were written at its first expert tensor
        }
        let parts = ["gate", "up", "down"].map(|p| format!("blk.{layer}.ffn_{p}_exps.weight"));
        let infos = parts
            .iter()
            .map(|p| g.tensor_info(p).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let n = infos[0].shape[0];
        if infos.iter().any(|i| i.shape.len() != 3 || i.shape[0] != n) {
            return Err(format!(
                "{}: layer {layer}'s expert tensors disagree on the expert count",
                input.display()
            ));
        }
        for e in 0..n {
            for (k, (p, info)) in ["gate", "up", "down"].iter().zip(&infos).enumerate() {
                let (offset, _) = g.index_range(&parts[k], e).map_err(|e| e.to_string())?;
                let align = if k == 0 { BUNDLE_ALIGN } else { 0 };
                specs.push(TensorSpec {
                    name: crate::experts::per_expert_name(layer, p, e),
                    shape: info.shape[1..].to_vec(),
                    dtype: info.dtype,
                    align,
                });
                sources.push(Source { offset });
            }
        }
        experts += n;
    }
    if bundled.is_empty() {
        let hint = if g.get(LAYOUT_KEY).is_some() {
            " (it is already repacked)"
        } else {
            " (not an MoE GGUF?)"
        };
        return Err(format!(
            "{}: no `blk.L.ffn_*_exps.weight` expert tensors{hint}",
            input.display()
        ));
    }
    let mut keys: Vec<&String> = g.metadata.keys().filter(|k| k.as_str() != LAYOUT_KEY).collect();
    keys.sort();
    let mut meta: Vec<(String, MetaValue)> =
        keys.into_iter().map(|k| (k.clone(), MetaValue::Gguf(g.metadata[k].clone()))).collect();
    meta.push((LAYOUT_KEY.into(), MetaValue::Str("bundled".into())));
    let file = std::fs::File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let mut fill = |i: usize, offset: u64, buf: &mut [u8]| -> Result<(), String> {
        file.read_exact_at(buf, sources[i].offset + offset).map_err(|e| {
            format!("{}: read at {}: {e}", input.display(), sources[i].offset + offset)
        })
    };
    if let Err(e) = write_gguf(output, &meta, &specs, 8 << 20, &mut fill, progress) {
        let _ = std::fs::remove_file(output); // never leave a half-written model behind
        return Err(e);
    }
    let file_bytes =
        std::fs::metadata(output).map_err(|e| format!("{}: {e}", output.display()))?.len();
    Ok(RepackReport { layers: bundled.len(), experts, file_bytes })
}
