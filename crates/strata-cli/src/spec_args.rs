//! Speculative-decoding flags (`generate`, `serve`, `bench`), in llama.cpp / vLLM terms.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use strata_engine::{DraftSource, Engine, LoadOptions, NgramParams, SpecConfig};

/// Draft source for `--spec` (a `--draft-model` implies `draft-model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SpecKind {
    /// No speculative decoding.
    Off,
    /// A separate draft model (`--draft-model PATH`).
    DraftModel,
    /// Prompt lookup decoding: drafts copied from earlier in the context.
    Ngram,
    /// Self-speculation: the target's first `--draft-layers` layers draft.
    #[value(name = "self")]
    SelfDraft,
    /// DFlash block diffusion: a z-lab DFlash draft (`--draft-model DIR`) proposes a block of
    /// tokens in one pass from the model's hidden states (same as `--dflash`).
    Dflash,
}

/// How many draft tokens each round verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DraftPolicyKind {
    /// Measure acceptance and verify cost online; choose 0..=--num-draft-tokens per round.
    Adaptive,
    /// Always --num-draft-tokens (where the draft source has that many).
    Fixed,
}

#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding draft source. Output is unchanged (greedy: identical tokens; sampling:
    /// the same distribution).
    #[arg(long, value_enum)]
    pub spec: Option<SpecKind>,
    /// Draft model for speculative decoding (same vocabulary as the model).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Most draft tokens per round (default 4; DFlash: the block size − 1).
    #[arg(long)]
    pub num_draft_tokens: Option<usize>,
    /// DFlash speculative decoding with the z-lab DFlash draft given by `--draft-model DIR`.
    #[arg(long)]
    pub dflash: bool,
    /// DFlash tokens per block (the anchor and B − 1 drafted positions; default: the draft's
    /// `block_size`).
    #[arg(long)]
    pub dflash_block_size: Option<usize>,
    /// Draft length: adaptive (measured, may choose 0 = plain decoding) or fixed.
    #[arg(long, value_enum, default_value = "adaptive")]
    pub draft_policy: DraftPolicyKind,
    /// `--spec self`: layers of the model used as the draft (default: a quarter of its layers).
    #[arg(long)]
    pub draft_layers: Option<usize>,
    /// `--spec ngram`: longest context suffix matched, in tokens.
    #[arg(long, default_value_t = NgramParams::default().max)]
    pub ngram_max: usize,
    /// `--spec ngram`: shortest context suffix matched, in tokens.
    #[arg(long, default_value_t = NgramParams::default().min)]
    pub ngram_min: usize,
}

impl SpecArgs {
    /// The draft source these flags ask for (`None`: off).
    pub fn kind(&self) -> Result<Option<SpecKind>> {
        if self.dflash || self.spec == Some(SpecKind::Dflash) {
            if self.spec.is_some_and(|k| k != SpecKind::Dflash) {
                bail!(
                    "--dflash cannot be combined with --spec {:?}",
                    self.spec.unwrap_or(SpecKind::Off)
                );
            }
            if self.draft_model.is_none() {
                bail!("--dflash needs --draft-model DIR (a z-lab DFlash draft)");
            }
            return Ok(Some(SpecKind::Dflash));
        }
        if self.dflash_block_size.is_some() {
            bail!("--dflash-block-size is for --dflash");
        }
        Ok(match (self.spec, &self.draft_model) {
            (None, None) | (Some(SpecKind::Off), None) => None,
            (None | Some(SpecKind::DraftModel), Some(_)) => Some(SpecKind::DraftModel),
            (Some(SpecKind::DraftModel), None) => {
                bail!("--spec draft-model needs --draft-model PATH")
            }
            (Some(k), Some(_)) => {
                bail!("--draft-model is used by --spec draft-model, not --spec {k:?}")
            }
            (Some(k), None) => Some(k),
        })
    }

    /// The draft model path, when one is used (counts in the memory plan).
    pub fn draft_path(&self) -> Option<&std::path::Path> {
        self.draft_model.as_deref()
    }

    /// Turns speculation on in `engine` as asked (loading the draft model if any).
    pub fn apply(&self, engine: &mut Engine, opts: &LoadOptions) -> Result<()> {
        let Some(kind) = self.kind()? else { return Ok(()) };
        let mut max_draft = self.num_draft_tokens.unwrap_or(4);
        let source = match kind {
            SpecKind::Off => return Ok(()),
            SpecKind::Dflash => {
                let path = self.draft_model.as_ref().expect("kind() checked");
                let (draft, bytes) = Engine::load_dflash_draft(path, opts, &engine.model)?;
                let block_size = self.dflash_block_size.unwrap_or(draft.block_size());
                max_draft = self.num_draft_tokens.unwrap_or(block_size.saturating_sub(1));
                eprintln!("DFlash draft {} loaded ({:.2} GB), block size {block_size}, target layers {:?}", path.display(), bytes as f64 / 1e9, draft.dflash_config().target_layer_ids);
                DraftSource::DFlash { draft, block_size }
            }
            SpecKind::DraftModel => {
                let path = self.draft_model.as_ref().expect("kind() checked");
                let mut o = opts.clone();
                o.stream_experts = None;
                let (model, bytes) = Engine::load_draft_model(path, &o)?;
                eprintln!("draft model {} loaded ({:.2} GB)", path.display(), bytes as f64 / 1e9);
                DraftSource::Model(model)
            }
            SpecKind::Ngram => {
                DraftSource::Ngram(NgramParams { max: self.ngram_max, min: self.ngram_min })
            }
            SpecKind::SelfDraft => DraftSource::SelfDraft {
                layers: self.draft_layers.unwrap_or((engine.model.num_layers() / 4).max(1)),
            },
        };
        let fixed = (self.draft_policy == DraftPolicyKind::Fixed).then_some(max_draft);
        engine.set_speculation(Some(SpecConfig { source, max_draft, fixed }))?;
        Ok(())
    }
}
