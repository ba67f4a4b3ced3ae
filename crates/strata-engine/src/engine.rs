//! The generation loop: chunked prefill, then decode one token at a time, with sampling, stop
//! tokens, stop strings, max tokens and per-token callbacks (streaming, cancellation).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use serde::Serialize;
use strata_expert_store::StreamOptions;
use strata_formats::{ChatMessage, ChatTemplate, GenerationDefaults, ModelFiles, TextTokenizer};
use strata_models::{
    DFlashDraft, ExpertProvider, ExpertStats, KvCache, Logits, PrefetchStats, Transformer,
};

use crate::output::SequenceOutput;
use crate::routing_report::RoutingTrace;
use crate::sampling::SamplingParams;
use crate::spec::{Emitted, SpecConfig, SpecStats, Speculator};

/// Errors of the engine. Request-level errors (prompt too long, bad template input) are separate
/// variants so servers can map them to 4xx.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] strata_models::ModelError),
    /// Boxed like [`strata_models::ModelError::Format`].
    #[error(transparent)]
    Format(Box<strata_formats::FormatError>),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("the prompt has {prompt} tokens but the context holds {ctx}")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// A message content holds a special-token string and the chat template does not pass
    /// contents through as they are (or trimmed), so it cannot be kept as text.
    #[error("a message contains the special token `{0}`, and this model's chat template changes message contents so that Strata cannot keep it as plain text")]
    SpecialTokenInContent(String),
    /// The memory plan says the model cannot run here ([`crate::planned::load_planned`]).
    #[error("{0}")]
    PlanRefused(String),
    /// The request's grammar does not compile, or constrained decoding failed.
    #[error(transparent)]
    Grammar(strata_grammar::GrammarError),
    /// A batched pass failed as a whole (every sequence in it gets this).
    #[error("{0}")]
    Internal(String),
    /// Speculative-decoding settings that do not fit the model (draft vocabulary, layer count).
    #[error("speculative decoding: {0}")]
    Spec(String),
}

impl From<strata_formats::FormatError> for EngineError {
    fn from(e: strata_formats::FormatError) -> Self {
        EngineError::Format(Box::new(e))
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// A loaded model ready to generate: weights, tokenizer, chat template.
pub struct Engine {
    pub model: Arc<Transformer>,
    pub tokenizer: TextTokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub defaults: GenerationDefaults,
    /// Short model name (file stem / directory name).
    pub name: String,
    /// Bytes of the weights loaded into memory at start (everything but streamed experts), as
    /// stored in the file.
    pub resident_weight_bytes: u64,
    /// Speculative decoding for every generation ([`Engine::set_speculation`]).
    pub spec: Option<SpecConfig>,
    /// The grammar compiler over this model's vocabulary, built on first use.
    pub grammars: std::sync::OnceLock<std::result::Result<strata_grammar::Grammars, String>>,
}

/// Options for loading.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Largest context any sequence will use (sizes RoPE tables).
    pub ctx_size: usize,
    pub device: Device,
    /// Stream routed experts from the model file instead of loading them (`--stream-experts`).
    pub stream_experts: Option<StreamOptions>,
    /// Experts per token override (`--moe-top-k`, `STRATA_MOE_TOP_K`).
    pub moe_top_k: Option<usize>,
    /// Element type of the KV caches (`--kv-cache-dtype`).
    pub kv_dtype: strata_models::KvDtype,
}

impl LoadOptions {
    pub fn new(ctx_size: usize, device: Device) -> Self {
        Self {
            ctx_size,
            device,
            stream_experts: None,
            moe_top_k: None,
            kv_dtype: strata_models::KvDtype::F32,
        }
    }
}

impl Engine {
    /// Opens and loads a model. `progress(done, total)` is called as layers load.
    pub fn load(
        path: &std::path::Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::from_files(&ModelFiles::open(path)?, opts, progress)
    }

    /// Loads a model whose files are already open (the CLI opened them to make the memory plan).
    pub fn from_files(
        files: &ModelFiles,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        // Architecture and dimensions first: the most fundamental error is reported.
        let cfg = files.config()?;
        let tokenizer = files.tokenizer()?;
        let chat_template = files.chat_template(&tokenizer)?;
        let mut resident_weight_bytes = files.total_tensor_bytes();
        let experts: Option<Arc<dyn ExpertProvider>> = match &opts.stream_experts {
            Some(so) => {
                let (p, expert_bytes) =
                    strata_expert_store::open_streaming(files, &cfg, &opts.device, so)?;
                resident_weight_bytes -= expert_bytes;
                Some(p)
            }
            None => None,
        };
        let mut model =
            Transformer::load_with_experts(files, &opts.device, opts.ctx_size, experts, progress)?;
        model.set_moe_top_k(opts.moe_top_k);
        model.set_kv_dtype(opts.kv_dtype);
        if let Some(so) = &opts.stream_experts {
            model.set_prefetch(so.prefetch);
        }
        Ok(Self {
            model: Arc::new(model),
            tokenizer,
            chat_template,
            defaults: files.generation_defaults(),
            name: files.short_name(),
            resident_weight_bytes,
            spec: None,
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// Loads a draft model for speculative decoding (`--draft-model`): resident, on the target's
    /// device, RoPE tables for `opts.ctx_size`. Returns it with its weight bytes as stored.
    pub fn load_draft_model(
        path: &std::path::Path,
        opts: &LoadOptions,
    ) -> Result<(Arc<Transformer>, u64)> {
        let files = ModelFiles::open(path)?;
        let model = Transformer::load(&files, &opts.device, opts.ctx_size, &mut |_, _| {})?;
        Ok((Arc::new(model), files.total_tensor_bytes()))
    }

    /// Loads a DFlash draft (`--dflash --draft-model DIR`) for `target`: on the target's device,
    /// RoPE tables for `opts.ctx_size` plus the longest block. Returns it with its weight bytes
    /// as stored. Errors: see [`DFlashDraft::load`].
    pub fn load_dflash_draft(
        path: &std::path::Path,
        opts: &LoadOptions,
        target: &Transformer,
    ) -> Result<(Arc<DFlashDraft>, u64)> {
        let files = ModelFiles::open(path)?;
        let draft =
            DFlashDraft::load(&files, target, opts.ctx_size + strata_models::EXACT_ROWS_MAX)?;
        Ok((Arc::new(draft), files.total_tensor_bytes()))
    }

    /// Turns speculative decoding on for every later generation (`None`: off). Errors when the
    /// settings do not fit the model (see [`SpecConfig::validate`]).
    pub fn set_speculation(&mut self, cfg: Option<SpecConfig>) -> Result<()> {
        if let Some(c) = &cfg {
            c.validate(&self.model)?;
        }
        self.spec = cfg;
        Ok(())
    }

    /// The grammar compiler for this model (built on first use: a token trie of the vocabulary).
    /// Errors: the tokenizer cannot back constrained decoding (no EOS token).
    pub fn grammars(&self) -> Result<&strata_grammar::Grammars> {
        self.grammars
            .get_or_init(|| {
                strata_grammar::Grammars::new(&self.tokenizer, self.model.config().vocab_size)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| EngineError::Grammar(strata_grammar::GrammarError::Runtime(e.clone())))
    }

    /// Renders messages through the chat template (with the generation prompt) and tokenizes the
    /// result without adding BOS (templates include it themselves, as in transformers).
    ///
    /// Special-token strings inside message contents (`<|im_end|>` typed by a user) are tokenized
    /// as text, never as control tokens: only the template's own markers are special. Errors with
    /// [`EngineError::SpecialTokenInContent`] when a content holds one and the template changes
    /// contents beyond trimming, so that Strata cannot tell where the content landed.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<(String, Vec<u32>)> {
        self.chat_prompt_with_tools(messages, None)
    }

    /// [`Self::chat_prompt`] with the request's tool definitions passed to the template (see
    /// [`ChatTemplate::render_with_tools`]).
    pub fn chat_prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<(String, Vec<u32>)> {
        let tpl = self.chat_template.as_ref().ok_or(EngineError::NoChatTemplate)?;
        let Some(special) = messages.iter().find_map(|m| self.tokenizer.find_special(&m.content))
        else {
            let text = tpl.render_with_tools(messages, true, tools)?;
            let ids = self.tokenizer.encode(&text, false)?;
            return Ok((text, ids));
        };
        let r = tpl.render_spans(messages, true, tools)?;
        let spans =
            r.spans.ok_or_else(|| EngineError::SpecialTokenInContent(special.to_string()))?;
        let ids = self.tokenizer.encode_with_plain_spans(&r.text, &spans)?;
        Ok((r.text, ids))
    }

    /// Tokenizes a raw prompt (BOS added if the model asks for it).
    pub fn text_prompt(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, true)?)
    }

    pub fn new_cache(&self, ctx_size: usize) -> Result<KvCache> {
        Ok(self.model.new_cache(ctx_size)?)
    }

    /// Runs one request to completion on `cache` (cleared first), calling `on_token` for each
    /// generated token; `on_token` returning `Break` cancels generation (finish reason `cancelled`).
    pub fn generate(
        &self,
        cache: &mut KvCache,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<Generation> {
        self.generate_with(cache, req, on_token, &|| false)
    }

    /// [`Self::generate`] that also polls `stop` between the layers of every prefill pass and
    /// before every decode step: when it returns true, generation ends at once with finish reason
    /// `cancelled` (no tokens if it was still prefilling). A server's shutdown uses it so that a
    /// long prompt does not outlive the grace period.
    pub fn generate_with(
        &self,
        cache: &mut KvCache,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
        stop: &dyn Fn() -> bool,
    ) -> Result<Generation> {
        let prompt = &req.prompt;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= cache.capacity() {
            return Err(EngineError::PromptTooLong { prompt: prompt.len(), ctx: cache.capacity() });
        }
        cache.clear();
        let experts0 = self.model.experts().stats();
        let streaming = experts0.is_some();
        let chunk = req.prefill_chunk.max(1);
        let mut out = SequenceOutput::new(self, req)?;
        let mut spec = match &self.spec {
            Some(cfg) => {
                Some(Speculator::new(&self.model, cfg, cache.capacity(), streaming, chunk)?)
            }
            None => None,
        };
        let t0 = Instant::now();
        let prefilled = match spec.as_mut() {
            // The speculator keeps what its draft needs from the prompt (DFlash: hidden states).
            Some(s) => s.prefill(cache, prompt, stop),
            None => self.prefill(cache, prompt, chunk, stop),
        };
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let logits = match prefilled {
            Ok(l) => l,
            Err(EngineError::Model(strata_models::ModelError::Interrupted)) => {
                cache.clear(); // a pass stopped half way
                let timings = Timings { prefill_ms, decode_ms: 0.0, ttft_ms: 0.0 };
                return Ok(Generation::cancelled(prompt.len(), timings));
            }
            Err(e) => return Err(e),
        };

        let experts_prefilled = self.model.experts().stats();
        let prefetch_prefilled = self.model.prefetch_stats();
        // Speculative rounds route rejected drafts too: only plain decoding is traced.
        let mut routing = (req.record_routing && spec.is_none()).then(|| {
            RoutingTrace::new(self.model.config().moe.as_ref().map_or(0, |m| m.num_experts))
        });
        let t1 = Instant::now();
        let mut ttft_ms = 0.0;
        let finish;
        // Tokens decided but not yet emitted (a speculative round decides several at once), each
        // with the target logits it was chosen from. The first comes from the prefill logits.
        let mut ready: std::collections::VecDeque<Emitted> = std::collections::VecDeque::new();
        let first = out.sample(&logits)?;
        ready.push_back((first, logits));
        loop {
            if stop() {
                finish = FinishReason::Cancelled;
                break;
            }
            let (id, logits) = ready.pop_front().expect("a decided token");
            if out.tokens.is_empty() {
                ttft_ms = t0.elapsed().as_secs_f64() * 1e3;
            }
            if let Some(f) = out.emit(self, id, &logits, on_token)? {
                finish = f;
                break;
            }
            if !ready.is_empty() {
                continue;
            }
            if cache.len() + 1 > cache.capacity() {
                finish = FinishReason::Length;
                break;
            }
            match spec.as_mut() {
                Some(s) => {
                    let left = out.remaining();
                    let rules = out.rules.active();
                    ready.extend(s.round(cache, &out.history, &mut out.sampler, left, rules)?)
                }
                None => {
                    let fwd = self.model.forward(&[id], cache, Logits::Last, &[])?;
                    if let Some(t) = routing.as_mut() {
                        t.push(&fwd.routing);
                    }
                    let logits: Vec<f32> = fwd.logits.flatten_all()?.to_vec1()?;
                    ready.push_back((out.sample(&logits)?, logits));
                }
            }
        }
        out.flush(self, on_token)?;
        let decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        let experts_end = self.model.experts().stats();
        let delta = |from: Option<ExpertStats>| match (experts_end, from) {
            (Some(now), Some(before)) => Some(now.since(&before)),
            _ => None,
        };
        let (experts, experts_decode) = (delta(experts0), delta(experts_prefilled));
        let prefetch_decode = match (self.model.prefetch_stats(), prefetch_prefilled) {
            (Some(now), Some(before)) => Some(now.since(&before)),
            _ => None,
        };
        let mask = out.mask_stats();
        Ok(Generation {
            prompt_tokens: prompt.len(),
            tokens: out.tokens,
            text: out.text,
            finish_reason: finish,
            timings: Timings { prefill_ms, decode_ms, ttft_ms },
            experts,
            experts_decode,
            prefetch_decode,
            spec: spec.map(|s| s.stats),
            routing,
            mask,
        })
    }
}

impl Engine {
    /// Chunked prefill of `prompt` into the empty `cache`; the last position's logits `[vocab]`.
    fn prefill(
        &self,
        cache: &mut KvCache,
        prompt: &[u32],
        chunk: usize,
        stop: &dyn Fn() -> bool,
    ) -> Result<Vec<f32>> {
        let mut logits = None;
        for part in prompt.chunks(chunk) {
            let out = strata_models::prefill_scope(part.len(), 0, || {
                self.model.forward_interruptible(part, cache, Logits::Last, &[], stop)
            })?;
            logits = Some(out.logits);
        }
        Ok(logits.ok_or(EngineError::EmptyPrompt)?.flatten_all()?.to_vec1()?)
    }
}

/// One generation request (already tokenized).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Return log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Prompt tokens per prefill forward pass.
    pub prefill_chunk: usize,
    /// Record every MoE layer's experts for each decoded token ([`Generation::routing`]; plain
    /// decoding only).
    pub record_routing: bool,
    /// The grammar the output must follow (`response_format`, tool calls).
    pub grammar: Option<strata_grammar::GrammarSpec>,
    /// `[(token, bias)]` added to the logits before sampling (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
}

impl GenerateRequest {
    pub fn new(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prefill_chunk: 512,
            record_routing: false,
            grammar: None,
            logit_bias: Vec::new(),
        }
    }
}

/// Log-probabilities of a generated token (log-softmax of the raw logits).
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Emitted per generated token. `text` is the newly completed text (may be empty while a
/// multi-byte character or a possible stop string is held back). A final event with
/// `id == u32::MAX` flushes held-back text.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub id: u32,
    pub text: String,
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS token or stop string.
    Stop,
    /// max_tokens or the context is full.
    Length,
    /// The caller cancelled (client disconnected).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Wall-clock timings in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Timings {
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Time to first token (prefill + first sample).
    pub ttft_ms: f64,
}

/// A finished generation.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: Timings,
    /// Expert-streaming counters of this generation (`None` with resident experts). With several
    /// generations running at once they include the others' reads.
    pub experts: Option<ExpertStats>,
    /// The same counters for the decode phase only (after prefill).
    pub experts_decode: Option<ExpertStats>,
    /// Precision/recall of the expert-prefetch predictors during decode (`None` without
    /// streaming).
    pub prefetch_decode: Option<PrefetchStats>,
    /// Speculative-decoding counters (`None` without speculation).
    pub spec: Option<SpecStats>,
    /// The decode steps' routing, with [`GenerateRequest::record_routing`] and no speculation.
    #[serde(skip)]
    pub routing: Option<RoutingTrace>,
    /// What the grammar's token masks cost (`None` without a grammar).
    pub mask: Option<strata_grammar::MaskStats>,
}

impl Generation {
    /// A generation stopped during prefill: no tokens, finish reason `cancelled`.
    fn cancelled(prompt_tokens: usize, timings: Timings) -> Self {
        Self {
            prompt_tokens,
            tokens: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Cancelled,
            timings,
            experts: None,
            experts_decode: None,
            prefetch_decode: None,
            spec: None,
            routing: None,
            mask: None,
        }
    }

    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / (self.timings.prefill_ms / 1e3).max(1e-9)
    }
    /// Decode rate over the tokens after the first (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        (self.tokens.len().saturating_sub(1)) as f64 / (self.timings.decode_ms / 1e3).max(1e-9)
    }
}
