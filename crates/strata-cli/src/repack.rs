//! `strata repack IN OUT`: the bundled expert layout (one 4 KiB-aligned read per expert); see
//! `strata_formats::repack`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Args, Debug)]
pub struct RepackArgs {
    /// Input MoE GGUF (3-D `ffn_*_exps` expert tensors, as llama.cpp's converter writes them).
    pub input: PathBuf,
    /// Output GGUF: the same tensors and metadata, each expert's gate/up/down in one aligned range.
    pub output: PathBuf,
}

pub fn run(a: RepackArgs) -> Result<()> {
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template(
            "repacking {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(a.output.display().to_string());
    let r = strata_formats::repack::repack_gguf(&a.input, &a.output, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let r = r.map_err(anyhow::Error::msg)?;
    println!(
        "{}: {} experts of {} MoE layers bundled (gate, up, down contiguous from a {}-byte boundary); {:.2} GB",
        a.output.display(),
        r.experts,
        r.layers,
        strata_formats::repack::BUNDLE_ALIGN,
        r.file_bytes as f64 / 1e9
    );
    Ok(())
}
