//! Constrained decoding: the token mask that keeps a generation inside a grammar — a JSON schema
//! (OpenAI `response_format` `json_schema`), any JSON object (`json_object`), a Lark grammar or a
//! regular expression — computed by llguidance (Microsoft's constrained-decoding library, also
//! used by llama.cpp and vLLM: <https://github.com/guidance-ai/llguidance>, Earley parser over a
//! token trie of the vocabulary).
//!
//! [`Grammars`] is built once per model from its tokenizer (the trie of every token's bytes);
//! [`Grammars::compile`] turns a [`GrammarSpec`] into a per-sequence [`Constraint`], whose
//! [`Constraint::apply`] sets the logits of tokens the grammar cannot take next to −∞ before
//! sampling, and [`Constraint::commit`] advances it by the sampled token. Masking before any
//! sampling step (greedy, temperature, top-k/p, min-p) samples exactly from the model's
//! distribution restricted to the grammar and renormalised.

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use strata_formats::TextTokenizer;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", "json_schema": {"schema": …}}`).
    JsonSchema(Value),
    /// A Lark grammar in llguidance's dialect (`%json {…}` inlines a schema;
    /// <https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md>).
    Lark(String),
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
}

/// Errors: the grammar does not compile (its message names the problem), or the vocabulary
/// cannot be turned into a token trie.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("invalid grammar: {0}")]
    Invalid(String),
    #[error("constrained decoding failed: {0}")]
    Runtime(String),
}

/// The per-model grammar compiler: llguidance's parser factory over the model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("eos", &self.eos).finish()
    }
}

impl Grammars {
    /// The compiler for a model whose logits have `vocab` entries and whose tokens `tok`
    /// decodes (ids past the tokenizer's vocabulary are never allowed; special tokens can only be
    /// named in a grammar, never produced by its text). Errors when the tokenizer has no EOS.
    pub fn new(tok: &TextTokenizer, vocab: usize) -> Result<Self, GrammarError> {
        let eos = tok.eos_ids.clone();
        let first_eos = *eos.first().ok_or_else(|| {
            GrammarError::Runtime("the tokenizer has no end-of-sequence token".into())
        })?;
        let special: std::collections::HashSet<u32> = tok
            .inner()
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let known = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if id as usize >= known {
                    Vec::new()
                } else if special.contains(&id) || eos.contains(&id) {
                    // llguidance's marker for special tokens: never matched by grammar text.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tok.token_text(id).into_bytes());
                    w
                } else {
                    tok.token_bytes(id)
                }
            })
            .collect();
        let mut info = TokRxInfo::new(vocab as u32, first_eos);
        info.tok_bos = tok.bos_id;
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Runtime(e.to_string()))?;
        factory.quiet();
        Ok(Self { factory, eos })
    }

    /// Compiles `spec` into a fresh per-sequence constraint. Errors: [`GrammarError::Invalid`]
    /// naming what does not compile (a malformed schema or grammar, an unsupported keyword).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let t = Instant::now();
        let grammar = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
        };
        let parser = self.factory.create_parser(grammar);
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Constraint {
            matcher,
            eos: self.eos.clone(),
            stats: MaskStats { compile_us: t.elapsed().as_micros() as u64, ..Default::default() },
        })
    }
}

/// llguidance's JSON layout for a schema that does not set its own (`x-guidance`): single-line
/// JSON with `", "` and `": "` separators and no other whitespace, so that a model cannot pad an
/// answer with whitespace until `max_tokens` cuts it off.
pub fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// What masking cost one sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MaskStats {
    /// Microseconds to compile the grammar.
    pub compile_us: u64,
    /// Masks computed (one per sampled token; with speculative decoding, one per verified
    /// position).
    pub masks: u64,
    /// Microseconds spent computing them.
    pub mask_us: u64,
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
    stats: MaskStats,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stats", &self.stats).finish()
    }
}

impl Constraint {
    /// Sets `logits[t]` (`[vocab]`) to −∞ for every token the grammar cannot take next. Once the
    /// grammar is complete only end-of-sequence tokens remain. Errors: the parser failed.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let t = Instant::now();
        let mask =
            self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Runtime(e.to_string()))?;
        let eos_ok = self.eos.first().is_some_and(|&e| mask.is_allowed(e));
        for (id, l) in logits.iter_mut().enumerate() {
            let id = id as u32;
            let ok = if self.eos.contains(&id) { eos_ok } else { mask.is_allowed(id) };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
        self.stats.masks += 1;
        self.stats.mask_us += t.elapsed().as_micros() as u64;
        Ok(())
    }

    /// Advances the grammar by the sampled `token` (an end-of-sequence token ends it). Errors:
    /// the token was not allowed (it was not sampled under [`Self::apply`]'s mask).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| GrammarError::Runtime(e.to_string()))
    }

    /// Undoes the last `n` tokens [`Self::commit`] consumed (end-of-sequence tokens consume
    /// nothing and do not count). Speculative verification commits accepted drafts tentatively and
    /// rolls them back at the end of its round. Errors: `n` exceeds the tokens consumed.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        self.matcher.rollback(n).map_err(|e| GrammarError::Runtime(e.to_string()))
    }

    /// How many of `tokens`, taken in order from the current state, the grammar accepts; the
    /// state does not change (a draft past that point could never be accepted).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> Result<usize, GrammarError> {
        self.matcher.validate_tokens(tokens).map_err(|e| GrammarError::Runtime(e.to_string()))
    }

    /// Whether `token` is an end-of-sequence token ([`Self::commit`] does not consume those).
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }

    /// Whether the grammar is complete and can take nothing more (only EOS is allowed then).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    pub fn stats(&self) -> MaskStats {
        self.stats
    }
}
