//! Routing overrides of synthetic benchmark models (`strata synth --routing uniform|realistic`).
//!
//! A random-weight model routes unlike a trained one (its hidden states barely vary, so decoding
//! reuses the same experts), and every streaming figure depends on routing. A synthetic GGUF can
//! therefore carry a routing process in its metadata (`strata.synthetic.routing*` keys) that the
//! router applies after computing its logits as usual: the tokens still flow through the router,
//! the expert provider, its caches, prefetch and speculative verification.
//!
//! Only files `strata synth` wrote may carry these keys: [`SyntheticRouting::from_gguf`] checks the
//! vocabulary `strata synth` writes (256 byte symbols, one merge, `fill{id}` fillers and three
//! control tokens) and refuses the keys in any other file, so a real model can never switch an
//! override on.

use candle_core::quantized::gguf_file::Value;
use serde::{Deserialize, Serialize};

use crate::error::{FormatError, Result};
use crate::gguf::GgufFile;
use crate::gguf_write::MetaValue;

/// Metadata key of the routing mode (`uniform` or `realistic`).
pub const KEY_MODE: &str = "strata.synthetic.routing";
/// Prefix of every routing-override key.
pub const KEY_PREFIX: &str = "strata.synthetic.routing";
pub const KEY_SEED: &str = "strata.synthetic.routing.seed";
pub const KEY_ZIPF: &str = "strata.synthetic.routing.zipf";
pub const KEY_REUSE: &str = "strata.synthetic.routing.reuse";
pub const KEY_DRIFT: &str = "strata.synthetic.routing.drift";
pub const KEY_DRIFT_PERIOD: &str = "strata.synthetic.routing.drift_period";
pub const KEY_PREGATE_RECALL: &str = "strata.synthetic.routing.pregate_recall";

/// How a synthetic model's routers choose experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingMode {
    /// Every token's top-k drawn independently and uniformly: the worst case for an expert cache.
    Uniform,
    /// Calibrated to published decode statistics of trained MoE models: Zipf popularity per layer
    /// drifting over the sequence, previous-token reuse, a pre-gating predictor of known recall.
    Realistic,
}

impl RoutingMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Uniform => "uniform",
            Self::Realistic => "realistic",
        }
    }
}

/// The routing process a synthetic model's metadata selects. Every draw is a hash of
/// (`seed`, layer, position, token id, …), so a sequence routes the same way whatever the pass
/// width, device or expert provider.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SyntheticRouting {
    pub mode: RoutingMode,
    pub seed: u64,
    /// Zipf exponent `s` of each layer's expert popularity: the expert of rank `r` (a random
    /// order per layer) has weight `r^-s` (published per-layer fits: 0.45–0.84, OLMoE).
    pub zipf: f64,
    /// Probability that each of the previous token's experts is kept (the measured previous-token
    /// reuse; published: 0.25–0.47). The other choices are drawn from the popularity, excluding
    /// the previous token's experts.
    pub reuse: f64,
    /// Standard deviation of the log-popularity drift: every expert's log-weight moves by a
    /// Gaussian of this deviation per `drift_period` tokens, linearly interpolated in between
    /// (segment locality).
    pub drift: f64,
    /// Tokens between drift knots.
    pub drift_period: u64,
    /// Recall of the pre-gating prediction of the next layer's experts (published: 0.8–0.9 one
    /// layer ahead): each routed expert is predicted with this probability, otherwise replaced by
    /// a popularity draw.
    pub pregate_recall: f64,
}

impl SyntheticRouting {
    /// The defaults of `strata synth --routing realistic` (docs/performance.md, "Routing").
    pub fn realistic(seed: u64) -> Self {
        Self {
            mode: RoutingMode::Realistic,
            seed,
            zipf: 0.6,
            reuse: 0.35,
            drift: 0.5,
            drift_period: 256,
            pregate_recall: 0.8,
        }
    }

    /// `strata synth --routing uniform`.
    pub fn uniform(seed: u64) -> Self {
        Self { mode: RoutingMode::Uniform, ..Self::realistic(seed) }
    }

    /// Checks every parameter's range; the message names the offending one.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let unit = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("{name} {v} is outside [0, 1]"))
            }
        };
        unit("reuse", self.reuse)?;
        unit("pregate_recall", self.pregate_recall)?;
        if !(0.0..=4.0).contains(&self.zipf) {
            return Err(format!("zipf {} is outside [0, 4]", self.zipf));
        }
        if !(0.0..=4.0).contains(&self.drift) {
            return Err(format!("drift {} is outside [0, 4]", self.drift));
        }
        if self.drift_period == 0 {
            return Err("drift_period must be at least 1".into());
        }
        Ok(())
    }

    /// The metadata keys that select this override (what `strata synth` writes).
    pub fn to_metadata(&self) -> Vec<(String, MetaValue)> {
        let f = |x: f64| MetaValue::Gguf(Value::F64(x));
        vec![
            (KEY_MODE.into(), MetaValue::Str(self.mode.name().into())),
            (KEY_SEED.into(), MetaValue::Gguf(Value::U64(self.seed))),
            (KEY_ZIPF.into(), f(self.zipf)),
            (KEY_REUSE.into(), f(self.reuse)),
            (KEY_DRIFT.into(), f(self.drift)),
            (KEY_DRIFT_PERIOD.into(), MetaValue::Gguf(Value::U64(self.drift_period))),
            (KEY_PREGATE_RECALL.into(), f(self.pregate_recall)),
        ]
    }

    /// The override a GGUF's metadata selects, if any.
    ///
    /// Errors (`FormatError::Invalid` naming the key): override keys in a file whose vocabulary is
    /// not the one `strata synth` writes (a non-synthetic model can never switch an override on),
    /// an unknown mode, a missing or out-of-range parameter.
    pub fn from_gguf(g: &GgufFile) -> Result<Option<Self>> {
        let keys: Vec<&String> = g.metadata.keys().filter(|k| k.starts_with(KEY_PREFIX)).collect();
        if keys.is_empty() {
            return Ok(None);
        }
        let synthetic =
            g.get_str_array("tokenizer.ggml.tokens").map(|t| is_synth_vocab(&t)).unwrap_or(false);
        if !synthetic {
            return Err(FormatError::invalid(
                &g.path,
                format!("metadata key `{}` overrides expert routing, but only models written by `strata synth` may carry it (this file's vocabulary is not strata synth's)", keys[0]),
            ));
        }
        let mode = match g.get_str(KEY_MODE)? {
            "uniform" => RoutingMode::Uniform,
            "realistic" => RoutingMode::Realistic,
            other => {
                return Err(FormatError::invalid(
                    &g.path,
                    format!("`{KEY_MODE}` = `{other}`: expected `uniform` or `realistic`"),
                ))
            }
        };
        let r = Self {
            mode,
            seed: g.get_u64(KEY_SEED)?,
            zipf: g.get_f64(KEY_ZIPF)?,
            reuse: g.get_f64(KEY_REUSE)?,
            drift: g.get_f64(KEY_DRIFT)?,
            drift_period: g.get_u64(KEY_DRIFT_PERIOD)?,
            pregate_recall: g.get_f64(KEY_PREGATE_RECALL)?,
        };
        r.validate()
            .map_err(|m| FormatError::invalid(&g.path, format!("`{KEY_PREFIX}.*`: {m}")))?;
        Ok(Some(r))
    }
}

/// Whether `tokens` is the vocabulary `strata synth` writes: 256 byte symbols, `ĠĠ`, then
/// `fill{id}` at every id but exactly three control tokens (`<|endoftext|>`, `<|im_start|>`,
/// `<|im_end|>`).
pub fn is_synth_vocab(tokens: &[&str]) -> bool {
    const SPECIAL: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    if tokens.len() < 260 || tokens[256] != "\u{120}\u{120}" {
        return false;
    }
    let mut specials = 0;
    for (i, t) in tokens.iter().enumerate().skip(257) {
        if SPECIAL.contains(t) {
            specials += 1;
        } else if t.strip_prefix("fill").and_then(|n| n.parse::<usize>().ok()) != Some(i) {
            return false;
        }
    }
    specials == 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_vocab_is_recognised_and_nothing_else() {
        let mut v: Vec<String> = (0..256).map(|i| format!("b{i}")).collect();
        v.push("\u{120}\u{120}".into());
        v.extend((257..600).map(|i| format!("fill{i}")));
        v[597] = "<|endoftext|>".into();
        v[598] = "<|im_start|>".into();
        v[599] = "<|im_end|>".into();
        fn refs(v: &[String]) -> Vec<&str> {
            v.iter().map(String::as_str).collect()
        }
        assert!(is_synth_vocab(&refs(&v)));
        let mut real = v.clone();
        real[300] = "hello".into();
        assert!(!is_synth_vocab(&refs(&real)));
        let mut shifted = v.clone();
        shifted[300] = "fill301".into();
        assert!(!is_synth_vocab(&refs(&shifted)));
        let mut extra = v.clone();
        extra[400] = "<|im_end|>".into();
        assert!(!is_synth_vocab(&refs(&extra)));
    }

    #[test]
    fn parameters_are_range_checked() {
        assert!(SyntheticRouting::realistic(1).validate().is_ok());
        assert!(SyntheticRouting { reuse: 1.5, ..SyntheticRouting::realistic(1) }
            .validate()
            .unwrap_err()
            .contains("reuse"));
        assert!(SyntheticRouting { zipf: f64::NAN, ..SyntheticRouting::realistic(1) }
            .validate()
            .unwrap_err()
            .contains("zipf"));
        assert!(SyntheticRouting { drift_period: 0, ..SyntheticRouting::realistic(1) }
            .validate()
            .unwrap_err()
            .contains("drift_period"));
    }
}
