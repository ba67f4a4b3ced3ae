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
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let mut tokens = engine.text_prompt(&text)?;
    if let Some(c) = a.chunks {
        tokens.truncate(c * a.ctx);
    }
    let json = a.json;
    let r = strata_engine::perplexity::perplexity(
        &engine,
        &tokens,
        a.ctx,
        a.model.prefill_chunk.min(a.ctx),
        &mut |c, n, ppl| {
            if !json {
                eprint!("\r[{c}/{n}] running PPL {ppl:.4}   ");
            }
        },
    )?;
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
    /// Context depth (llama-bench's `-d`): the pp and tg tests run after this many tokens
    /// already in the KV cache (filled untimed before each run); repeatable or comma-separated:
    /// `-d 0,4096,16384`.
    #[arg(long, short = 'd', value_delimiter = ',', default_value = "0")]
    pub n_depth: Vec<usize>,
    /// Repetitions (median reported).
    #[arg(long, short = 'r', default_value_t = 3)]
    pub reps: usize,
    /// Print results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also decode --n-gen tokens in B sequences at once, one forward pass per step over all of
    /// them (continuous batching's decode; llama-batched-bench's S_TG); repeatable or
    /// comma-separated: `--batch 2,4,8`.
    #[arg(long, value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// With --batch: also run each batch's prompts of this many tokens (each sequence its own) in
    /// one forward pass — a server's step for requests that arrive together (`ppN xB`, S_PP).
    #[arg(long, default_value_t = 0)]
    pub batch_prompt: usize,
    /// Also time speculative verify passes of W tokens (all positions' logits, rolled back to one
    /// accepted token: zero acceptance), --n-gen passes from an empty cache, and print each
    /// pass's time over a tg step's; repeatable or comma-separated: `--verify 2,4,8`.
    #[arg(long, value_delimiter = ',', value_name = "W")]
    pub verify: Vec<usize>,
    /// Benchmark one MoE layer of Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8, expert
    /// intermediate 768) with synthetic weights instead of a model: ms per layer for 1 and
    /// --n-prompt tokens against the RAM-bandwidth and compute floors.
    #[arg(long)]
    pub moe_layer: bool,
    /// Quantization of the benchmarked experts (--moe-layer): q4k, q5k, q6k, q8_0, q4_0, q4_1.
    #[arg(long, default_value = "q4k")]
    pub moe_dtype: String,
    /// Measure the drive holding FILE instead of a model (like fio randread): GB/s for 1 and 4 MiB
    /// random reads at queue depth 1, 8, 32, 64, through the page cache (its pages dropped first)
    /// and with O_DIRECT. Use a file of several GB on the drive the models live on.
    #[arg(long, value_name = "FILE")]
    pub disk: Option<PathBuf>,
    /// Seconds per --disk configuration.
    #[arg(long, default_value_t = 1.5)]
    pub disk_seconds: f64,
    /// MoE models: instead of pp/tg, decode --n-gen tokens (sampled, --routing-temp) from
    /// --routing-prompt and report the routing statistics of the decoded tokens: previous-token
    /// reuse per layer, Zipf fit, LRU hit curve at 5 / 10 / 12.5 / 25 / 50% of the experts
    /// cached (simulated on the trace), each prefetch predictor's precision and recall.
    #[arg(long)]
    pub routing: bool,
    /// With --routing: the prompt.
    #[arg(
        long,
        default_value = "The history of the printing press begins in the fifteenth century, when"
    )]
    pub routing_prompt: String,
    /// With --routing: sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    pub routing_temp: f64,
    /// With --routing: write the trace (every decoded token's experts per MoE layer) as JSON.
    #[arg(long)]
    pub routing_trace: Option<PathBuf>,
}

/// Turns on prefetch-predictor scoring (no reads) so a routing report can give their recall.
pub fn score_routing(engine: &mut strata_engine::Engine) -> Result<()> {
    let model = std::sync::Arc::get_mut(&mut engine.model)
        .context("the model is shared; cannot turn predictor scoring on")?;
    model.score_prefetch();
    Ok(())
}

fn bench_routing(a: &BenchArgs) -> Result<()> {
    let mut m = a.model.clone();
    m.ctx_size = m.ctx_size.max(a.n_gen + 256);
    let (mut engine, _plan) = m.load_with_plan()?;
    anyhow::ensure!(
        engine.model.config().moe.is_some(),
        "--routing: {} is not an MoE model",
        engine.name
    );
    score_routing(&mut engine)?;
    let prompt = engine.text_prompt(&a.routing_prompt)?;
    let params = strata_engine::SamplingParams {
        temperature: a.routing_temp,
        seed: Some(1),
        ..strata_engine::SamplingParams::default()
    };
    let mut req = strata_engine::GenerateRequest::new(prompt, a.n_gen + 1, params);
    req.ignore_eos = true;
    req.record_routing = true;
    req.prefill_chunk = m.prefill_chunk;
    let mut cache = engine.new_cache(m.ctx_size)?;
    let gen = engine.generate(&mut cache, &req, &mut |_| std::ops::ControlFlow::Continue(()))?;
    let trace =
        gen.routing.as_ref().context("no routing was recorded (speculative decoding is on?)")?;
    if let Some(path) = &a.routing_trace {
        std::fs::write(path, serde_json::to_vec(trace)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let r = strata_engine::routing_report::report(trace, gen.prefetch_decode.as_ref());
    if a.json {
        println!(
            "{}",
            serde_json::json!({"model": engine.name, "routing": r, "decode_tok_s": gen.decode_tok_s()})
        );
    } else {
        print!("{}", r.markdown());
    }
    Ok(())
}

fn bench_disk(a: &BenchArgs, file: &std::path::Path) -> Result<()> {
    use strata_engine::expert_store::disk_bench;
    let results = disk_bench::bench_disk(
        file,
        &[1 << 20, 4 << 20],
        &[1, 8, 32, 64],
        &[false, true],
        std::time::Duration::from_secs_f64(a.disk_seconds),
    )
    .map_err(anyhow::Error::msg)?;
    let peak = results.iter().map(|r| r.gbps).fold(0.0, f64::max);
    if a.json {
        println!("{}", serde_json::json!({"file": file, "results": results, "peak_gbps": peak}));
        return Ok(());
    }
    println!("| file | O_DIRECT | block | queue depth | GB/s |");
    println!("|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {} | {} MiB | {} | {:.2} |",
            file.display(),
            r.direct,
            r.block_bytes >> 20,
            r.queue_depth,
            r.gbps
        );
    }
    let best = results.iter().max_by(|a, b| a.gbps.total_cmp(&b.gbps)).map(|r| {
        format!("O_DIRECT {}, {} MiB, QD {}", r.direct, r.block_bytes >> 20, r.queue_depth)
    });
    println!("peak random read: {peak:.2} GB/s ({})", best.unwrap_or_default());
    Ok(())
}

fn parse_dtype(s: &str) -> Result<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType as D;
    Ok(match s.to_ascii_lowercase().as_str() {
        "q4k" | "q4_k" => D::Q4K,
        "q5k" | "q5_k" => D::Q5K,
        "q6k" | "q6_k" => D::Q6K,
        "q8_0" => D::Q8_0,
        "q4_0" => D::Q4_0,
        "q4_1" => D::Q4_1,
        other => {
            anyhow::bail!("unsupported --moe-dtype `{other}` (q4k, q5k, q6k, q8_0, q4_0, q4_1)")
        }
    })
}

fn bench_moe_layer(a: &BenchArgs) -> Result<()> {
    use strata_bench::moe_bench;
    a.model.set_threads();
    let mut shape = moe_bench::MoeLayerShape::qwen3_30b_a3b();
    shape.dtype = parse_dtype(&a.moe_dtype)?;
    let rates = moe_bench::machine_rates(&shape, a.model.threads())?;
    let bench = moe_bench::bench_moe_layer(&shape, &[1, a.n_prompt], a.reps.max(1), &rates)?;
    if a.json {
        println!("{}", serde_json::json!({"shape": shape, "machine": rates, "bench": bench}));
        return Ok(());
    }
    println!(
        "MoE layer: hidden {}, {} experts, top-{}, expert intermediate {}, {:?}, random router (near-uniform routing); {} threads\n\
         measured: RAM read {:.1} GB/s, {:?} GEMM {:.1} GFLOP/s, f32 GEMM {:.1} GFLOP/s",
        shape.hidden,
        shape.experts,
        shape.top_k,
        shape.expert_intermediate,
        shape.dtype,
        rates.threads,
        rates.ram_read_gbps,
        shape.dtype,
        rates.quant_gemm_gflops,
        rates.f32_gemm_gflops
    );
    println!("| tokens | ms/layer (median of {}) | distinct experts | expert MB touched | MB/token | bandwidth floor ms | compute floor ms | floor/actual |", a.reps);
    println!("|---|---|---|---|---|---|---|---|");
    for r in &bench.results {
        println!(
            "| {} | {:.3} | {} | {:.1} | {:.2} | {:.3} | {:.3} | {:.2} |",
            r.tokens,
            r.ms_per_layer,
            r.distinct_experts,
            r.expert_bytes as f64 / 1e6,
            r.expert_bytes_per_token / 1e6,
            r.bandwidth_floor_ms,
            r.compute_floor_ms,
            r.ratio_to_floor
        );
    }
    println!(
        "first use of an expert (beyond a warm one; candle-run formats repack on x86): {:.2} ms per expert",
        bench.first_use_ms_per_expert
    );
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if let Some(f) = &a.disk {
        return bench_disk(&a, f);
    }
    if a.moe_layer {
        return bench_moe_layer(&a);
    }
    if a.routing {
        return bench_routing(&a);
    }
    let mut m = a.model.clone();
    let deepest = a.n_depth.iter().copied().max().unwrap_or(0);
    m.ctx_size = m.ctx_size.max(deepest + a.n_prompt + a.n_gen + 1).max(a.batch_prompt + 1);
    let engine = m.load()?;
    let reps = a.reps.max(1);
    let mut results = Vec::new();
    for &d in &a.n_depth {
        results.push(strata_bench::bench::bench_prefill(&engine, a.n_prompt, a.n_prompt, d, reps)?);
        results.push(strata_bench::bench::bench_decode(&engine, a.n_gen, d, reps)?);
    }
    for &b in a.batch.iter().filter(|&&b| b > 1) {
        if a.batch_prompt > 0 {
            let pp = strata_bench::bench::bench_batch_prefill(&engine, b, a.batch_prompt, reps)?;
            results.push(pp);
        }
        results.push(strata_bench::bench::bench_batch_decode(&engine, b, a.n_gen, a.reps.max(1))?);
    }
    // Verify passes start from an empty cache: their ratio is to the depth-0 tg (else the first).
    let tg_name = format!("tg{}", a.n_gen);
    let tg_tok_s = results.iter().find(|r| r.test == tg_name).unwrap_or(&results[1]).median_tok_s;
    let mut ratios = Vec::new();
    for &w in a.verify.iter().filter(|&&w| w > 0) {
        let v = strata_bench::bench::bench_verify(&engine, w, a.n_gen, a.reps.max(1))?;
        let ratio = strata_bench::bench::verify_ratio(w, v.median_tok_s, tg_tok_s);
        ratios.push((v.test.clone(), w as f64 / v.median_tok_s * 1e3, ratio));
        results.push(v);
    }
    let threads = m.threads();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"model": engine.name, "threads": threads, "results": results})
        );
        return Ok(());
    }
    println!("| model | threads | test | tok/s (median of {}) | runs |", a.reps);
    println!("|---|---|---|---|---|");
    for r in &results {
        let runs: Vec<String> = r.runs.iter().map(|x| format!("{x:.1}")).collect();
        println!(
            "| {} | {} | {} | {:.1} | {} |",
            engine.name,
            threads,
            r.test,
            r.median_tok_s,
            runs.join(", ")
        );
    }
    for (test, ms, ratio) in ratios {
        println!("{test}: {ms:.2} ms per pass = {ratio:.2}× a tg step ({:.2} ms)", 1e3 / tg_tok_s);
    }
    Ok(())
}

/// One line of expert-streaming figures for a generation over `tokens` tokens (prompt + generated).
pub fn expert_stats_line(x: &strata_engine::ExpertStats, tokens: usize) -> String {
    let per = tokens.max(1) as f64;
    let gpu = if x.uploads > 0 {
        format!(
            " | copied to the GPU {:.2} MB/token ({} experts)",
            x.upload_bytes as f64 / 1e6 / per,
            x.uploads
        )
    } else {
        String::new()
    };
    let line = format!(
        "experts: hit rate {:.1}% | read {:.1} MB in {} reads = {:.2} MB/token at {:.2} GB/s while reading | stall {:.1} ms/token | touched {:.2} MB/token",
        x.hit_rate() * 100.0,
        x.bytes_read as f64 / 1e6,
        x.reads,
        x.bytes_read as f64 / 1e6 / per,
        x.read_gbps(),
        x.stall_ns as f64 / 1e6 / per,
        x.touched_bytes as f64 / 1e6 / per,
    );
    line + &gpu
}

/// One line of prefetch figures for the decode phase: reads the prefetcher started and how many
/// were used, and every predictor's precision / recall.
pub fn prefetch_line(
    x: &strata_engine::ExpertStats,
    p: &strata_engine::PrefetchStats,
    mode: strata_engine::PrefetchMode,
) -> String {
    let pr = |s: &strata_models::PredictorStats| format!("{:.2}/{:.2}", s.precision(), s.recall());
    format!(
        "prefetch ({}): {} experts read ahead, {} used ({:.0}%); precision on uncached experts {:.2} ({} of {}) | precision/recall: pregate {}, previous {}, union {}",
        mode.name(),
        x.prefetch_reads,
        x.prefetch_used,
        100.0 * x.prefetch_used as f64 / x.prefetch_reads.max(1) as f64,
        x.prefetch_candidates_used as f64 / x.prefetch_candidates.max(1) as f64,
        x.prefetch_candidates_used,
        x.prefetch_candidates,
        pr(&p.pregate),
        pr(&p.previous),
        pr(&p.union)
    )
}

/// The decode phase's reads held against the drive's peak: achieved GB/s ÷ peak, and the floor the
/// misses imply (miss bytes per token ÷ peak read rate). The peak is `strata info --calibrate`'s
/// measurement for the drive holding `model` (or the plan's default, said so).
pub fn drive_floor_line(
    d: &strata_engine::ExpertStats,
    tokens: usize,
    model: &std::path::Path,
) -> String {
    let (rates, source) = strata_plan::calibrate::load(model);
    let peak = rates.drive_gbps;
    let per = d.bytes_read as f64 / tokens.max(1) as f64;
    let floor_ms = per / (peak * 1e9) * 1e3;
    let basis = match source {
        strata_plan::RatesSource::Calibrated { .. } => "measured by `strata info --calibrate`",
        strata_plan::RatesSource::Defaults => {
            "DEFAULT, not measured: run `strata info --calibrate`"
        }
    };
    format!(
        "decode reads: {:.2} MB/token at {:.2} GB/s = {:.0}% of the drive's peak {:.2} GB/s ({basis}); read floor {:.1} ms/token, stall {:.1} ms/token",
        per / 1e6,
        d.read_gbps(),
        100.0 * d.read_gbps() / peak.max(1e-9),
        peak,
        floor_ms,
        d.stall_ns as f64 / 1e6 / tokens.max(1) as f64
    )
}
