//! `strata`: an LLM inference server and CLI for MoE models that stream expert weights.

mod compare;
mod compare_batch;
mod default_model;
mod generate;
mod info;
mod measure;
mod model_args;
mod repack;
mod serve;
mod spec_args;
mod synth;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "strata", version, about = "LLM inference for Mixture-of-Experts models larger than memory", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the model over the OpenAI HTTP API (chat/completions, completions, models, health, metrics).
    Serve(serve::ServeArgs),
    /// Generate text from a prompt (streams to stdout, stats on stderr).
    Generate(generate::GenerateArgs),
    /// Perplexity over a text file, scored like llama-perplexity.
    Perplexity(measure::PerplexityArgs),
    /// Throughput: prompt processing (pp) and text generation (tg) tok/s, like llama-bench.
    Bench(measure::BenchArgs),
    /// The memory plan: model facts, memory, strategy (resident / expert streaming / too large),
    /// expert cache and estimated speed, from metadata only; --calibrate measures the bandwidths.
    Info(info::InfoArgs),
    /// Write a synthetic (random-weight) MoE GGUF with a real model's dimensions, for benchmarks.
    Synth(synth::SynthArgs),
    /// Rewrite an MoE GGUF so each expert's gate/up/down is one 4 KiB-aligned range (one read per
    /// streamed expert); tokens are identical.
    Repack(repack::RepackArgs),
    /// The same model on the CPU and on `--device` (cuda): logits over a prompt and greedy tokens.
    CompareDevices(compare::CompareArgs),
    /// Fetch the default model (SmolLM2-135M-Instruct Q4_1) into models/ and print its path.
    FetchDefault,
}

fn main() {
    let cli = Cli::parse();
    let res: Result<()> = match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Perplexity(a) => measure::perplexity(a),
        Command::Bench(a) => measure::bench(a),
        Command::Synth(a) => synth::run(a),
        Command::Repack(a) => repack::run(a),
        Command::Info(a) => info::run(a),
        Command::CompareDevices(a) => compare::run(a),
        Command::FetchDefault => default_model::ensure().map(|p| println!("{}", p.display())),
    };
    if let Err(e) = res {
        if let Some(refused @ strata_engine::EngineError::PlanRefused(_)) =
            e.downcast_ref::<strata_engine::EngineError>()
        {
            eprintln!("strata: {refused}");
            std::process::exit(2);
        }
        eprintln!("strata: error: {e:#}");
        std::process::exit(1);
    }
}
