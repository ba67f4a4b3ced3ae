//! Tokenizers: HF `tokenizer.json` as is, or a HF `tokenizers` BPE tokenizer rebuilt from GGUF
//! metadata (`tokenizer.ggml.*`), reproducing llama.cpp's `llm_tokenizer_bpe` pre-tokenizer regexes
//! (llama.cpp `src/llama-vocab.cpp`, `LLAMA_VOCAB_PRE_TYPE_*`).

use std::path::Path;

use serde_json::{json, Value as Json};

use crate::error::{FormatError, Result};
use crate::gguf::GgufFile;

/// llama.cpp token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer plus the special-token facts generation needs.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// BOS token id, when the model has one.
    pub bos_id: Option<u32>,
    /// Prepend BOS to raw prompts (GGUF `tokenizer.ggml.add_bos_token`, HF post-processor).
    pub add_bos: bool,
    /// Token ids that end generation (EOS, EOT, …), deduplicated.
    pub eos_ids: Vec<u32>,
    /// Strings of the special (control) tokens, longest first.
    specials: std::sync::Arc<Vec<String>>,
    /// `inner` with special-token strings encoded as ordinary text, made on first use.
    plain: std::sync::Arc<std::sync::OnceLock<tokenizers::Tokenizer>>,
    /// The longest token string in bytes.
    max_token_bytes: usize,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn tk_err(e: impl std::fmt::Display) -> FormatError {
    FormatError::Tokenizer(e.to_string())
}

impl TextTokenizer {
    /// Rebuilds the tokenizer stored in GGUF metadata. Supports `tokenizer.ggml.model == "gpt2"`
    /// (byte-level BPE) with the pre-tokenizers llama.cpp knows for Llama-3, Qwen2, SmolLM/StarCoder
    /// and GPT-2.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(FormatError::invalid(
                &g.path,
                format!("tokenizer model `{model}` is not supported yet (supported: gpt2 byte-level BPE); use the HF directory with tokenizer.json"),
            ));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let merges = g.get_str_array("tokenizer.ggml.merges").unwrap_or_default();
        let types = g.get_u64_array("tokenizer.ggml.token_type").unwrap_or_default();
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");

        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, tok) in tokens.iter().enumerate() {
            let ty = types.get(id).copied().unwrap_or(1);
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                added.push(json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
                }));
            }
            // Keep the first id of a duplicated string (filler vocabularies repeat strings).
            vocab.entry(tok.to_string()).or_insert(json!(id));
        }
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
        let pre_tokenizer = match pre {
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
                json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]})
            }
            "qwen2" | "deepseek-r1-qwen" | "qwen35" => {
                json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]})
            }
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva" => json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]
            }),
            _ => byte_level(true),
        };
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            }
        });
        let inner = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&spec).map_err(tk_err)?)
            .map_err(|e| {
            FormatError::invalid(&g.path, format!("cannot build tokenizer from GGUF metadata: {e}"))
        })?;
        let bos_id = g.get_u64("tokenizer.ggml.bos_token_id").ok().map(|v| v as u32);
        let mut eos_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Ok(v) = g.get_u64(key) {
                eos_ids.push(v as u32);
            }
        }
        eos_ids.dedup();
        Ok(Self::assemble(
            inner,
            bos_id,
            g.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
            eos_ids,
        ))
    }

    /// Loads `tokenizer.json` from an HF directory; BOS/EOS come from `tokenizer_config.json`,
    /// `config.json` and `generation_config.json` (the latter's `eos_token_id` may be a list).
    pub fn from_hf_dir(
        dir: &Path,
        config: &Json,
        generation_config: Option<&Json>,
    ) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            if path.exists() {
                FormatError::invalid(&path, format!("cannot load tokenizer: {e}"))
            } else {
                FormatError::MissingFile { path: path.clone() }
            }
        })?;
        let tok_cfg = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let token_id = |v: &Json| -> Option<u32> {
            match v {
                Json::String(s) => inner.token_to_id(s),
                Json::Object(o) => {
                    o.get("content").and_then(|c| c.as_str()).and_then(|s| inner.token_to_id(s))
                }
                _ => None,
            }
        };
        let mut eos_ids = Vec::new();
        for src in [generation_config, Some(config)].into_iter().flatten() {
            match src.get("eos_token_id") {
                Some(Json::Number(n)) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
                Some(Json::Array(a)) => {
                    eos_ids.extend(a.iter().filter_map(|x| x.as_u64().map(|v| v as u32)))
                }
                _ => {}
            }
        }
        if let Some(id) = tok_cfg.as_ref().and_then(|c| c.get("eos_token")).and_then(token_id) {
            eos_ids.push(id);
        }
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));
        let bos_id = tok_cfg
            .as_ref()
            .and_then(|c| c.get("bos_token"))
            .and_then(token_id)
            .or_else(|| config.get("bos_token_id").and_then(|v| v.as_u64()).map(|v| v as u32));
        // HF adds BOS through the post-processor; we encode without it and prepend it ourselves.
        let probe = inner.encode("a", true).map_err(tk_err)?;
        let add_bos = bos_id.is_some_and(|b| probe.get_ids().first() == Some(&b));
        Ok(Self::assemble(inner, bos_id, add_bos, eos_ids))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        add_bos: bool,
        eos_ids: Vec<u32>,
    ) -> Self {
        let mut specials: Vec<String> = inner
            .get_added_tokens_decoder()
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content.clone())
            .collect();
        specials.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let max_token_bytes =
            inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        TextTokenizer {
            inner,
            bos_id,
            add_bos,
            eos_ids,
            specials: std::sync::Arc::new(specials),
            plain: Default::default(),
            max_token_bytes,
        }
    }

    /// The first special-token string (`<|im_end|>`, …) inside `text`, if any.
    pub fn find_special<'a>(&'a self, text: &str) -> Option<&'a str> {
        self.specials.iter().find(|t| text.contains(t.as_str())).map(String::as_str)
    }

    /// Encodes text with special-token strings as ordinary text (what a user typed: `<|im_end|>`
    /// in a message becomes the tokens of those characters, never the control token). No BOS.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        Ok(plain.encode(text, false).map_err(tk_err)?.get_ids().to_vec())
    }

    /// Encodes `text` whose byte ranges `plain` (ascending, disjoint) hold user text: those with
    /// [`Self::encode_plain`], the rest with special tokens parsed. No BOS.
    pub fn encode_with_plain_spans(
        &self,
        text: &str,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut pos = 0;
        for r in plain {
            let (Some(before), Some(inside)) = (text.get(pos..r.start), text.get(r.clone())) else {
                return Err(FormatError::Tokenizer(format!("span {r:?} is not inside the text")));
            };
            ids.extend(self.encode(before, false)?);
            ids.extend(self.encode_plain(inside)?);
            pos = r.end;
        }
        ids.extend(self.encode(text.get(pos..).unwrap_or_default(), false)?);
        Ok(ids)
    }

    /// The longest token's length in bytes (for a lower bound on a text's token count: every
    /// token of a byte-level vocabulary covers at least one byte and at most this many).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// At least this many tokens encode `bytes` bytes of text: no token covers more than
    /// [`Self::max_token_bytes`] of the text's bytes (halved again for normalizers that shrink
    /// text, e.g. NFKC ligatures). Lets a server refuse a huge prompt without tokenizing it.
    pub fn min_tokens_for(&self, bytes: usize) -> usize {
        bytes / (2 * self.max_token_bytes)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text; special-token strings in the text (e.g. `<|im_start|>`) become their ids, as
    /// llama.cpp does with `parse_special = true`. BOS is prepended when `add_bos` and the model
    /// asks for it.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tk_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            if let Some(b) = self.bos_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text; `skip_special` drops control tokens such as `<|im_end|>`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(tk_err)
    }

    /// The string of one token id (for logprobs output), without skipping specials.
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    /// The raw bytes token `id` stands for (a piece of a multi-byte character is its own bytes,
    /// not U+FFFD): byte-level BPE symbols mapped back through GPT-2's byte table, `<0xHH>`
    /// byte-fallback tokens as that byte, SentencePiece's `▁` as a space, added tokens as their
    /// text. Empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Some(t) = self.inner.get_added_tokens_decoder().get(&id) {
            return t.content.as_bytes().to_vec();
        }
        let Some(tok) = self.inner.id_to_token(id) else { return Vec::new() };
        if matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            let table = gpt2_byte_symbols();
            let bytes: Option<Vec<u8>> =
                tok.chars().map(|c| table.iter().position(|&s| s == c).map(|b| b as u8)).collect();
            if let Some(b) = bytes {
                return b;
            }
        }
        if let Some(hex) = tok.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
        tok.replace('\u{2581}', " ").into_bytes()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Incremental detokenizer for streaming: emits text only once it is complete UTF-8 (a multi-byte
/// character split across tokens is held back), the same scheme as HF `TextStreamer` / TGI.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the newly completed text, if any.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            let delta = now.get(before.len()..).map(str::to_string).unwrap_or_default();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Whatever text is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).map(str::to_string).unwrap_or_default())
    }
}

pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Json>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| FormatError::invalid(path, format!("invalid JSON: {e}")))
}

/// GPT-2's byte-to-unicode table (`bytes_to_unicode` in openai/gpt-2 `encoder.py`): the symbol
/// byte-level BPE vocabularies use for each byte, indexed by byte.
pub fn gpt2_byte_symbols() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable = |b: u32| {
        (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut n = 0;
    for b in 0..256u32 {
        table[b as usize] = if printable(b) {
            char::from_u32(b).unwrap_or('\0')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}
