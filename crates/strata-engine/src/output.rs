//! One sequence's output side, shared by single-sequence generation ([`crate::Engine::generate`])
//! and the batch scheduler ([`crate::batch`]): sampling (after `logit_bias` and the grammar's
//! token mask), EOS, stop strings, `max_tokens`, log-probabilities (of the raw logits) and
//! incremental detokenization of each decided token.

use std::ops::ControlFlow;

use strata_formats::StreamDecoder;
use strata_grammar::{Constraint, MaskStats};

use crate::engine::{
    Engine, EngineError, FinishReason, GenerateRequest, Result, TokenEvent, TokenLogprobs,
};
use crate::sampling::{log_softmax, top_logprobs, Sampler};
use crate::spec::LogitsConstraint;
use crate::stop::{StopMatcher, StopScan};

/// The tokens and text a sequence has produced, and what ends it.
pub(crate) struct SequenceOutput {
    pub sampler: Sampler,
    /// Prompt and generated tokens (repetition penalties read it).
    pub history: Vec<u32>,
    pub tokens: Vec<u32>,
    pub text: String,
    decoder: StreamDecoder,
    stops: StopMatcher,
    max_tokens: usize,
    ignore_eos: bool,
    logprobs: Option<usize>,
    stopped_by_string: bool,
    /// What changes the logits before sampling: `logit_bias` and the grammar.
    pub rules: OutputRules,
}

/// A sequence's changes to the model's logits before sampling: `logit_bias`, then the grammar's
/// token mask. Speculative verification applies them at every verified position
/// ([`LogitsConstraint`]), so speculation samples from the same distributions as plain decoding.
pub(crate) struct OutputRules {
    /// `[(token, bias)]` added to the logits before sampling.
    logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow.
    constraint: Option<Constraint>,
    /// Tokens a verify round consumed tentatively (rolled back by [`LogitsConstraint::undo`]).
    tentative: usize,
}

impl OutputRules {
    /// `None` when nothing changes the logits (the sampler then reads them as they are).
    pub fn active(&mut self) -> Option<&mut dyn LogitsConstraint> {
        if self.logit_bias.is_empty() && self.constraint.is_none() {
            None
        } else {
            Some(self)
        }
    }
}

impl LogitsConstraint for OutputRules {
    fn constrain(&mut self, logits: &mut [f32]) -> Result<()> {
        for &(id, b) in &self.logit_bias {
            if let Some(x) = logits.get_mut(id as usize) {
                *x += b;
            }
        }
        if let Some(c) = self.constraint.as_mut() {
            c.apply(logits).map_err(EngineError::Grammar)?;
        }
        Ok(())
    }

    fn valid_prefix(&mut self, drafts: &[u32]) -> Result<usize> {
        match self.constraint.as_mut() {
            Some(c) => c.valid_prefix(drafts).map_err(EngineError::Grammar),
            None => Ok(drafts.len()),
        }
    }

    fn advance(&mut self, token: u32) -> Result<()> {
        if let Some(c) = self.constraint.as_mut() {
            if !c.is_eos(token) {
                c.commit(token).map_err(EngineError::Grammar)?;
                self.tentative += 1;
            }
        }
        Ok(())
    }

    fn undo(&mut self) -> Result<()> {
        let n = std::mem::take(&mut self.tentative);
        match self.constraint.as_mut() {
            Some(c) => c.rollback(n).map_err(EngineError::Grammar),
            None => Ok(()),
        }
    }
}

impl SequenceOutput {
    /// Errors: the request's grammar does not compile ([`EngineError::Grammar`]).
    pub fn new(engine: &Engine, req: &GenerateRequest) -> Result<Self> {
        let constraint = match &req.grammar {
            Some(g) => Some(engine.grammars()?.compile(g).map_err(EngineError::Grammar)?),
            None => None,
        };
        Ok(Self {
            sampler: Sampler::new(req.sampling.clone()),
            history: req.prompt.clone(),
            tokens: Vec::new(),
            text: String::new(),
            decoder: StreamDecoder::new(),
            stops: StopMatcher::new(req.stop.clone()),
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            stopped_by_string: false,
            rules: OutputRules { logit_bias: req.logit_bias.clone(), constraint, tentative: 0 },
        })
    }

    /// Samples the next token from `logits: [vocab]`, after adding `logit_bias` and masking what
    /// the grammar cannot take. Errors: the grammar's parser failed.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let Some(rules) = self.rules.active() else {
            return Ok(self.sampler.sample(logits, &self.history));
        };
        let mut l = logits.to_vec();
        rules.constrain(&mut l)?;
        Ok(self.sampler.sample(&l, &self.history))
    }

    /// Whether the next token is the argmax of the raw logits and nothing else reads them:
    /// greedy sampling without repetition penalties, no log-probabilities, no `logit_bias`, no
    /// grammar. Such a decode step can take the greedy pick made on the device
    /// (`strata_models::Logits::Greedy`) and emit it with empty logits.
    pub fn greedy_only(&self) -> bool {
        let p = &self.sampler.params;
        p.is_greedy()
            && !p.has_penalties()
            && self.logprobs.is_none()
            && self.rules.logit_bias.is_empty()
            && self.rules.constraint.is_none()
    }

    /// What the grammar's masks cost (`None` without a grammar).
    pub fn mask_stats(&self) -> Option<MaskStats> {
        self.rules.constraint.as_ref().map(Constraint::stats)
    }

    /// Emits token `id` chosen from `logits` (read only for log-probabilities: empty is fine
    /// without them) through `on_token`. Returns how the generation ends
    /// with it, if it does: EOS or a stop string (`Stop`), `max_tokens` (`Length`), or the
    /// callback asked to stop (`Cancelled`).
    pub fn emit(
        &mut self,
        engine: &Engine,
        id: u32,
        logits: &[f32],
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Option<FinishReason>> {
        let logprobs = self.logprobs.map(|n| {
            let lp = log_softmax(logits);
            TokenLogprobs { logprob: lp[id as usize], top: top_logprobs(&lp, n) }
        });
        let grammar_done = self.record(engine, id)?;
        self.publish(engine, id, logprobs, grammar_done, on_token)
    }

    /// Whether a token's publication ([`Self::publish`]) can come after the next token's pass:
    /// no grammar (whose state the next sampling reads) and no log-probabilities (of logits
    /// a later pass replaces).
    pub fn defers(&self) -> bool {
        self.logprobs.is_none() && self.rules.constraint.is_none()
    }

    /// Whether emitting `id` next ends the generation whatever its text: EOS, or the last
    /// token `max_tokens` allows. (A stop string or the callback may end it too: only
    /// [`Self::publish`] knows.)
    pub fn ends_with(&self, engine: &Engine, id: u32) -> bool {
        self.is_eos(engine, id) || self.tokens.len() + 1 >= self.max_tokens
    }

    fn is_eos(&self, engine: &Engine, id: u32) -> bool {
        !self.ignore_eos && engine.tokenizer.eos_ids.contains(&id)
    }

    /// The first half of [`Self::emit`]: token `id` joins the output's tokens (and the grammar's
    /// state). Returns whether the grammar is complete with it. [`Self::publish`] must follow,
    /// before the next token's `record`.
    pub fn record(&mut self, engine: &Engine, id: u32) -> Result<bool> {
        self.tokens.push(id);
        self.history.push(id);
        let is_eos = self.is_eos(engine, id);
        match self.rules.constraint.as_mut() {
            Some(c) => {
                c.commit(id).map_err(EngineError::Grammar)?;
                Ok(!is_eos && c.is_finished())
            }
            None => Ok(false),
        }
    }

    /// The second half of [`Self::emit`] for the token [`Self::record`] took last: its text
    /// (incremental detokenization, stop strings) through `on_token`, and how the generation
    /// ends with it.
    pub fn publish(
        &mut self,
        engine: &Engine,
        id: u32,
        logprobs: Option<TokenLogprobs>,
        grammar_done: bool,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Option<FinishReason>> {
        let is_eos = self.is_eos(engine, id);
        let mut delta = String::new();
        let mut stopped = false;
        if !is_eos {
            if let Some(piece) = self.decoder.push(&engine.tokenizer, id)? {
                match self.stops.push(&piece) {
                    StopScan::Continue(t) => delta = t,
                    StopScan::Stopped(t) => {
                        delta = t;
                        stopped = true;
                    }
                }
            }
        }
        self.text.push_str(&delta);
        let ev = TokenEvent { id, text: delta, logprobs };
        if on_token(&ev).is_break() {
            return Ok(Some(FinishReason::Cancelled));
        }
        if is_eos || stopped || grammar_done {
            self.stopped_by_string = stopped;
            return Ok(Some(FinishReason::Stop));
        }
        if self.tokens.len() >= self.max_tokens {
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    /// Tokens still allowed by `max_tokens`.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.tokens.len())
    }

    /// Flushes text held back (an incomplete character, a possible stop string that did not
    /// complete) as a final event with `id == u32::MAX`.
    pub fn flush(
        &mut self,
        engine: &Engine,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<()> {
        if self.stopped_by_string {
            return Ok(());
        }
        let piece = self.decoder.flush(&engine.tokenizer)?;
        let tail = match self.stops.push(&piece) {
            StopScan::Continue(t) => t + &self.stops.flush(),
            StopScan::Stopped(t) => t,
        };
        if !tail.is_empty() {
            self.text.push_str(&tail);
            let _ = on_token(&TokenEvent { id: u32::MAX, text: tail, logprobs: None });
        }
        Ok(())
    }
}
