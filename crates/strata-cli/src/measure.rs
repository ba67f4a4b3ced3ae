//! `strata perplexity` and `strata bench`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::model_args::ModelArgs;

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Chunk size in tokens (llama-perplexity -c); the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let engine = a.model.load()?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let mut tokens = engine.text_prompt(&text)?;
    if let Some(c) = a.chunks {
        tokens.truncate(c * a.ctx);
    }
    let json = a.json;
    let r = strata_engine::perplexity::perplexity(&engine, &tokens, a.ctx, a.model.prefill_chunk.min(a.ctx), &mut |c, n, ppl| {
        if !json {
            eprint!("\r[{c}/{n}] running PPL {ppl:.4}   ");
        }
    })?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        eprintln!();
        println!(
            "PPL {:.4} +/- {:.5} over {} chunks of {} tokens ({} scored of {}) in {:.1} s, {} threads",
            r.ppl, r.ppl_stderr, r.chunks, a.ctx, r.scored_tokens, r.total_tokens, r.seconds, a.model.threads()
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt-processing test size (tokens).
    #[arg(long, short = 'p', default_value_t = 512)]
    pub n_prompt: usize,
    /// Text-generation test size (tokens).
    #[arg(long, short = 'n', default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions (median reported).
    #[arg(long, short = 'r', default_value_t = 3)]
    pub reps: usize,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let mut m = a.model.clone();
    m.ctx_size = m.ctx_size.max(a.n_prompt + a.n_gen + 1);
    let engine = m.load()?;
    let pp = strata_engine::bench::bench_prefill(&engine, a.n_prompt, a.n_prompt, a.reps.max(1))?;
    let tg = strata_engine::bench::bench_decode(&engine, a.n_gen, a.reps.max(1))?;
    let threads = m.threads();
    if a.json {
        println!("{}", serde_json::json!({"model": engine.name, "threads": threads, "results": [pp, tg]}));
        return Ok(());
    }
    println!("| model | threads | test | tok/s (median of {}) | runs |", a.reps);
    println!("|---|---|---|---|---|");
    for r in [&pp, &tg] {
        let runs: Vec<String> = r.runs.iter().map(|x| format!("{x:.1}")).collect();
        println!("| {} | {} | {} | {:.1} | {} |", engine.name, threads, r.test, r.median_tok_s, runs.join(", "));
    }
    Ok(())
}
