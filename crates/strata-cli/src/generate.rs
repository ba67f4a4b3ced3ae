//! `strata generate`.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use strata_engine::{Engine, GenerateRequest, SamplingParams};
use strata_formats::ChatMessage;

use crate::model_args::ModelArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Raw prompt text (BOS added if the model asks for it; special tokens are parsed).
    #[arg(long, short = 'p', group = "input")]
    pub prompt: Option<String>,
    /// Text sent as one user message through the model's chat template.
    #[arg(long, group = "input")]
    pub chat: Option<String>,
    /// Read the raw prompt from a file.
    #[arg(long, group = "input")]
    pub prompt_file: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Maximum tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// With --stream-experts: print a per-token trace to stderr (expert hits, misses, bytes read,
    /// stall ms and elapsed ms of the step that produced each token).
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// MoE models: record every layer's experts for each decoded token and report the routing
    /// statistics (previous-token reuse, Zipf fit, LRU hit curve, prefetch predictors' recall;
    /// the `routing` field with --json, a table on stderr otherwise). Plain decoding only.
    #[arg(long)]
    pub routing_report: bool,
    /// MoE models: write every decoded token's experts per MoE layer to this JSON file
    /// (`{"experts", "top_k", "layers", "tokens": [token][moe layer][top_k]}`), the input of
    /// `scripts/sim_expert_cache.py`. Plain decoding only.
    #[arg(long, value_name = "FILE")]
    pub routing_trace: Option<std::path::PathBuf>,
}

/// Sampling flags (llama.cpp names). Unset flags take the model's generation_config, then
/// llama.cpp's defaults.
#[derive(Args, Debug, Clone, Default)]
pub struct SamplingArgs {
    /// Temperature; 0 = greedy.
    #[arg(long)]
    pub temp: Option<f64>,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Drop tokens below min_p × the top probability (0 = off).
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Repetition penalty over the last --repeat-last-n tokens (1 = off).
    #[arg(long)]
    pub repeat_penalty: Option<f64>,
    /// Tokens the penalties look back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// OpenAI-style presence penalty.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f64,
    /// OpenAI-style frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f64,
    /// RNG seed (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self, engine: &Engine) -> SamplingParams {
        let d = &engine.defaults;
        let base = SamplingParams::default();
        SamplingParams {
            temperature: self.temp.or(d.temperature).unwrap_or(base.temperature),
            top_k: self.top_k.or(d.top_k).unwrap_or(base.top_k),
            top_p: self.top_p.or(d.top_p).unwrap_or(base.top_p),
            min_p: self.min_p.or(d.min_p).unwrap_or(base.min_p),
            repeat_penalty: self
                .repeat_penalty
                .or(d.repetition_penalty)
                .unwrap_or(base.repeat_penalty),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let rss_before_load = strata_plan::system::process_rss().map(|r| r.0);
    let (mut engine, plan) = args.model.load_with_plan()?;
    if args.routing_report {
        crate::measure::score_routing(&mut engine)?;
    }
    let prompt = if let Some(chat) = &args.chat {
        engine.chat_prompt(&[ChatMessage::new("user", chat.as_str())])?.1
    } else if let Some(p) = &args.prompt {
        engine.text_prompt(p)?
    } else if let Some(f) = &args.prompt_file {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        engine.text_prompt(&text)?
    } else {
        bail!("give one of --prompt, --chat or --prompt-file");
    };
    let mut req =
        GenerateRequest::new(prompt.clone(), args.max_tokens, args.sampling.params(&engine));
    req.stop = args.stop.clone();
    req.ignore_eos = args.ignore_eos;
    req.prefill_chunk = args.model.prefill_chunk;
    req.record_routing = args.routing_report || args.routing_trace.is_some();
    let mut cache = engine.new_cache(args.model.ctx_size)?;
    let stdout = std::io::stdout();
    let json = args.json;
    let experts = engine.model.experts().clone();
    let mut trace = args.verbose.then(|| (experts.stats(), std::time::Instant::now(), 0usize));
    let gen = engine.generate(&mut cache, &req, &mut |ev| {
        if let Some((Some(last), t, i)) = trace.as_mut() {
            if let Some(now) = experts.stats() {
                let d = now.since(last);
                eprintln!(
                    "[token {i}] id {} | experts {} hit {} miss | read {:.2} MB in {} reads | stall {:.1} ms | step {:.1} ms",
                    ev.id,
                    d.hits,
                    d.misses,
                    d.bytes_read as f64 / 1e6,
                    d.reads,
                    d.stall_ns as f64 / 1e6,
                    t.elapsed().as_secs_f64() * 1e3
                );
                *last = now;
                *t = std::time::Instant::now();
                *i += 1;
            }
        }
        if !json && !ev.text.is_empty() {
            let mut out = stdout.lock();
            let _ = out.write_all(ev.text.as_bytes());
            let _ = out.flush();
        }
        ControlFlow::Continue(())
    })?;
    record_observation(&engine, &plan, &gen);
    if let Some(path) = &args.routing_trace {
        let Some(t) = &gen.routing else {
            bail!("--routing-trace: no routing recorded (a dense model, or speculative decoding, which routes rejected drafts too)");
        };
        let text = serde_json::to_string(t)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if json {
        let obj = serde_json::json!({
            "model": engine.name,
            "prompt_token_ids": prompt,
            "generated_token_ids": gen.tokens,
            "text": gen.text,
            "finish_reason": gen.finish_reason.as_str(),
            "timings": gen.timings,
            "prompt_tokens": gen.prompt_tokens,
            "generated_tokens": gen.tokens.len(),
            "prefill_tok_s": gen.prefill_tok_s(),
            "decode_tok_s": gen.decode_tok_s(),
            "threads": args.model.threads(),
            "experts": gen.experts,
            "experts_decode": gen.experts_decode,
            "prefetch": engine.model.prefetch_mode().map(|m| m.name()),
            "prefetch_decode": gen.prefetch_decode,
            "spec": gen.spec.as_ref().map(spec_json),
            "memory": memory_report(&engine, &cache, rss_before_load),
            "routing": gen.routing.as_ref().map(|t| strata_engine::routing_report::report(t, gen.prefetch_decode.as_ref())),
        });
        println!("{obj}");
    } else {
        println!();
        eprintln!(
            "prompt {} tokens, prefill {:.1} tok/s | generated {} tokens, decode {:.1} tok/s | TTFT {:.0} ms | finish {} | {} threads",
            gen.prompt_tokens,
            gen.prefill_tok_s(),
            gen.tokens.len(),
            gen.decode_tok_s(),
            gen.timings.ttft_ms,
            gen.finish_reason.as_str(),
            args.model.threads()
        );
        if let Some(s) = &gen.spec {
            eprintln!("{}", s.summary());
        }
        if let Some(t) = &gen.routing {
            eprintln!(
                "{}",
                strata_engine::routing_report::report(t, gen.prefetch_decode.as_ref()).markdown()
            );
        } else if args.routing_report {
            eprintln!("routing report: not recorded (speculative decoding routes rejected drafts too; run without --spec)");
        }
        if let Some(x) = &gen.experts {
            eprintln!(
                "{}",
                crate::measure::expert_stats_line(x, gen.prompt_tokens + gen.tokens.len())
            );
            if let Some(d) = &gen.experts_decode {
                eprintln!(
                    "{}",
                    crate::measure::drive_floor_line(
                        d,
                        gen.tokens.len().saturating_sub(1),
                        std::path::Path::new(&plan.model.path)
                    )
                );
                if let (Some(p), Some(mode)) = (&gen.prefetch_decode, engine.model.prefetch_mode())
                {
                    eprintln!("{}", crate::measure::prefetch_line(d, p, mode));
                }
            }
        }
    }
    Ok(())
}

/// Speculative-decoding counters with the derived figures.
pub fn spec_json(s: &strata_engine::SpecStats) -> serde_json::Value {
    let mut v = serde_json::to_value(s).unwrap_or_default();
    v["acceptance_rate"] = s.acceptance_rate().into();
    v["mean_accepted_length"] = s.mean_accepted_length().into();
    v["mean_fanout"] = s.mean_fanout().into();
    v
}

/// What the process holds (bytes): weights outside the expert provider, the provider's budget, the
/// KV cache, and the RSS before loading and at its peak.
fn memory_report(
    engine: &strata_engine::Engine,
    cache: &strata_models::KvCache,
    rss_before_load: Option<u64>,
) -> serde_json::Value {
    let rss = strata_plan::system::process_rss();
    serde_json::json!({
        "resident_weight_bytes": engine.resident_weight_bytes,
        "experts_bytes": engine.model.experts().memory_bytes(),
        "kv_cache_bytes": cache.bytes(),
        "rss_before_load_bytes": rss_before_load,
        "rss_peak_bytes": rss.map(|r| r.1),
    })
}

/// Records this run's decode hit rate and compute time for the next plan of the same model
/// (`strata_plan::observed`). Failing to write the cache only logs.
fn record_observation(
    engine: &strata_engine::Engine,
    plan: &strata_plan::Plan,
    gen: &strata_engine::Generation,
) {
    if gen.spec.is_some() {
        return; // observations describe plain decoding
    }
    let n = gen.tokens.len().saturating_sub(1) as u64;
    let (hit_rate, stall_ms, read_ms, cache_fraction) = match &gen.experts_decode {
        Some(d) => {
            let byte_hit = if d.touched_bytes > 0 {
                1.0 - d.bytes_read as f64 / d.touched_bytes as f64
            } else {
                d.hit_rate()
            };
            let read_ms = d.bytes_read as f64 / (plan.estimate.rates.drive_gbps * 1e9) * 1e3;
            (
                byte_hit.clamp(0.0, 1.0),
                d.stall_ns as f64 / 1e6,
                read_ms,
                (engine.model.experts().memory_bytes() as f64
                    / plan.model.expert_bytes.max(1) as f64)
                    .min(1.0),
            )
        }
        None => (1.0, 0.0, 0.0, 1.0),
    };
    let per_token = |ms: f64| ms / n.max(1) as f64;
    let run = strata_plan::Observed {
        cache_fraction,
        hit_rate,
        hidden_read_ms_per_token: per_token((read_ms - stall_ms).max(0.0)),
        compute_ms_per_token: per_token((gen.timings.decode_ms - stall_ms).max(0.0)),
        resident_compute_ms_per_token: None,
        tokens: n,
    };
    if let Err(e) = strata_plan::observed::record(std::path::Path::new(&plan.model.path), run) {
        eprintln!("warning: could not record this run for future plans: {e}");
    }
}
