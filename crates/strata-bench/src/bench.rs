//! `llama-bench`-style throughput: pp (prompt processing: one forward over N tokens from an empty
//! cache) and tg (text generation: N single-token forwards), median of several runs; with a depth
//! D (llama-bench's `-d`), both after D context tokens already in the cache.

use serde::Serialize;
use strata_models::Logits;

use strata_engine::engine::{Engine, Result};

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub test: String,
    pub tokens: usize,
    /// tok/s of each run.
    pub runs: Vec<f64>,
    pub median_tok_s: f64,
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Reads a pass's logits to the host, as generation's sampler (or speculative acceptance) reads
/// them: on a GPU the pass has then ended, not only been launched (a dense model's replayed graph
/// never synchronizes otherwise).
fn read_logits(out: &strata_models::ForwardOutput) -> Result<()> {
    std::hint::black_box(out.logits.flatten_all()?.to_vec1::<f32>()?);
    std::hint::black_box(out.greedy);
    Ok(())
}

/// Context tokens of a depth-`depth` test (llama-bench's `-d`): distinct from the tested tokens.
fn depth_tokens(engine: &Engine, depth: usize) -> Vec<u32> {
    let vocab = engine.model.config().vocab_size as u32;
    (0..depth as u32).map(|i| (i * 6151 + 101) % vocab).collect()
}

/// Runs `tokens` into `cache` as the engine's prefill runs a prompt: passes of at most `chunk`
/// tokens, each pass's last logits `[vocab]` read to the host as generation reads them (on a
/// GPU: the pass's end, not its launch).
fn prompt_passes(
    engine: &Engine,
    cache: &mut strata_models::KvCache,
    tokens: &[u32],
    chunk: usize,
) -> Result<()> {
    for part in tokens.chunks(chunk.max(1)) {
        let out = strata_models::prefill_scope(part.len(), 0, || {
            engine.model.forward(part, cache, Logits::Last, &[])
        })?;
        read_logits(&out)?;
    }
    Ok(())
}

/// Clears `cache` and fills it with `context` (untimed), in prompt passes of at most
/// [`DEPTH_CHUNK`] tokens.
fn fill_context(
    engine: &Engine,
    cache: &mut strata_models::KvCache,
    context: &[u32],
) -> Result<()> {
    cache.clear();
    prompt_passes(engine, cache, context, DEPTH_CHUNK)
}

/// Prompt tokens per pass while a depth test fills its context (the CLI's default
/// `--prefill-chunk`).
pub const DEPTH_CHUNK: usize = 512;

/// A test's name in llama-bench's form: `pp512`, `tg128 @ d4096`.
fn test_name(kind: &str, n: usize, depth: usize) -> String {
    if depth == 0 {
        format!("{kind}{n}")
    } else {
        format!("{kind}{n} @ d{depth}")
    }
}

/// Prompt processing: `n` tokens in one forward pass (chunked by `chunk`) after `depth` context
/// tokens (filled untimed before each run), `reps` times after one untimed run (llama-bench's
/// warm-up).
pub fn bench_prefill(
    engine: &Engine,
    n: usize,
    chunk: usize,
    depth: usize,
    reps: usize,
) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let context = depth_tokens(engine, depth);
    let mut cache = engine.new_cache(depth + n + 1)?;
    // Warm-up: one untimed run of the whole test, as llama-bench warms up (`test_prompt` with the
    // test's n_prompt). A GPU's first prompt pass loads what the later ones reuse (5.4 s for the
    // synthetic 30B's first 512-token pass on an H100: 94.5 tok/s, then 9,969 tok/s), which a
    // 16-token warm-up (the decode kernels' rows) did not reach.
    fill_context(engine, &mut cache, &context)?;
    prompt_passes(engine, &mut cache, &tokens, chunk)?;
    let mut runs = Vec::new();
    for _ in 0..reps {
        fill_context(engine, &mut cache, &context)?;
        let t = std::time::Instant::now();
        prompt_passes(engine, &mut cache, &tokens, chunk)?;
        runs.push(n as f64 / t.elapsed().as_secs_f64());
    }
    let test = test_name("pp", n, depth);
    Ok(BenchResult { test, tokens: n, median_tok_s: median(&runs), runs })
}

/// Text generation: `n` single-token forwards after `depth` context tokens (filled untimed
/// before each run; 0: from an empty cache), `reps` times. Each step's
/// logits `[vocab]` are read to the host, as the sampler of a generation reads them (and as
/// llama-bench waits for each token): on a GPU a step whose pass never synchronizes (a dense
/// model's replayed graph) would otherwise time only its launch.
pub fn bench_decode(engine: &Engine, n: usize, depth: usize, reps: usize) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let context = depth_tokens(engine, depth);
    let mut cache = engine.new_cache(depth + n + 1)?;
    let mut runs = Vec::new();
    let step = |cache: &mut strata_models::KvCache, token: u32| -> Result<()> {
        let out = engine.model.forward(&[token], cache, Logits::Last, &[])?;
        read_logits(&out)?;
        Ok(())
    };
    fill_context(engine, &mut cache, &context)?;
    step(&mut cache, 1)?;
    let mut reads = 0;
    for _ in 0..reps {
        fill_context(engine, &mut cache, &context)?;
        let before = strata_models::gpu::host_reads();
        let t = std::time::Instant::now();
        for i in 0..n as u32 {
            step(&mut cache, (i * 7919 + 13) % vocab)?;
        }
        runs.push(n as f64 / t.elapsed().as_secs_f64());
        reads += strata_models::gpu::host_reads() - before;
    }
    if !engine.model.device().is_cpu() {
        let per = reads as f64 / (n * reps).max(1) as f64;
        eprintln!(
            "tg{n}: {per:.2} device→host reads per decode step inside the model's layers \
             (host paths of Gated DeltaNet layers and routers; a pass's routing record)"
        );
    }
    let test = test_name("tg", n, depth);
    Ok(BenchResult { test, tokens: n, median_tok_s: median(&runs), runs })
}

/// Speculative verify passes at zero acceptance: `n` passes of `width` tokens each, every
/// position's logits (as a verify pass asks), each rolled back to its first token (one accepted
/// token per pass, the cache growing by one), from an empty cache, `reps` times after two warm-up
/// passes; tok/s counts `width` tokens per pass. A pass's cost against a decode step's is
/// `width / verify tok/s` over `1 / tg tok/s` ([`verify_ratio`]).
pub fn bench_verify(engine: &Engine, width: usize, n: usize, reps: usize) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let width = width.max(1);
    let mut cache = engine.new_cache(n + width + 2)?;
    let pass = |cache: &mut strata_models::KvCache, i: usize| -> Result<()> {
        let toks: Vec<u32> =
            (0..width).map(|j| ((i * width + j) as u32 * 7919 + 13) % vocab).collect();
        let start = cache.len();
        cache.checkpoint();
        // Every position's logits `[width, vocab]` read to the host, as acceptance reads them.
        let out = engine.model.forward(&toks, cache, Logits::All, &[])?;
        read_logits(&out)?;
        cache.rollback(start + 1)?;
        cache.release_checkpoint();
        Ok(())
    };
    pass(&mut cache, 0)?;
    pass(&mut cache, 1)?;
    let mut runs = Vec::new();
    for _ in 0..reps {
        cache.clear();
        let t = std::time::Instant::now();
        for i in 0..n {
            pass(&mut cache, i)?;
        }
        runs.push((n * width) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(BenchResult {
        test: format!("verify{width} x{n}"),
        tokens: n * width,
        median_tok_s: median(&runs),
        runs,
    })
}

/// A `width`-token verify pass's time over a decode step's, from their tok/s ([`bench_verify`],
/// [`bench_decode`]): `(width / verify) / (1 / decode)`.
pub fn verify_ratio(width: usize, verify_tok_s: f64, decode_tok_s: f64) -> f64 {
    width as f64 / verify_tok_s * decode_tok_s
}

/// Token `i` of sequence `s` in the batched tests: a fixed spread over the vocabulary.
fn batch_token(i: u32, s: u32, vocab: u32) -> u32 {
    (i * 7919 + s * 104_729 + 13) % vocab
}

/// One batched forward pass of `tokens[s]` on `caches[s]`, each sequence asking for its greedy
/// pick (what greedy serving reads: on a GPU the pick, made there; elsewhere, or with
/// `STRATA_GPU_ARGMAX=0`, each sequence's logits `[vocab]` read to the host). Returns the seconds
/// until the pass returned (on a GPU: the host's launches, up to its first synchronisation) and
/// until every result was read.
fn batch_pass(
    engine: &Engine,
    caches: &mut [strata_models::KvCache],
    tokens: &[&[u32]],
) -> Result<(f64, f64)> {
    use strata_models::{BatchOptions, BatchSeq};
    let mut seqs: Vec<BatchSeq<'_>> = caches
        .iter_mut()
        .zip(tokens)
        .map(|(cache, &t)| BatchSeq { tokens: t, cache, logits: Logits::Greedy })
        .collect();
    let t = std::time::Instant::now();
    let outs = engine.model.forward_batch(&mut seqs, BatchOptions::default())?;
    let returned = t.elapsed().as_secs_f64();
    for r in outs {
        read_logits(&r?)?;
    }
    Ok((returned, t.elapsed().as_secs_f64()))
}

/// Batched prompt passes (llama-batched-bench's S_PP): `batch` sequences' `n`-token prompts (each
/// its own tokens) in one forward pass, as a server's step runs requests that arrive together
/// ([`strata_models::Transformer::forward_batch`]; each sequence's last position's greedy pick
/// read, as a greedy request's first token), after one untimed warm-up pass; `reps` times from
/// empty caches. tok/s counts every sequence's prompt tokens.
pub fn bench_batch_prefill(
    engine: &Engine,
    batch: usize,
    n: usize,
    reps: usize,
) -> Result<BenchResult> {
    let batch = batch.max(1);
    let vocab = engine.model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|s| (0..n as u32).map(|i| batch_token(i, s, vocab)).collect())
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut caches = (0..batch).map(|_| engine.new_cache(n + 1)).collect::<Result<Vec<_>>>()?;
    let mut pass = || -> Result<f64> {
        caches.iter_mut().for_each(|c| c.clear());
        Ok(batch_pass(engine, &mut caches, &refs)?.1)
    };
    pass()?; // warm-up
    let runs = (0..reps).map(|_| Ok((n * batch) as f64 / pass()?)).collect::<Result<Vec<f64>>>()?;
    Ok(BenchResult {
        test: format!("pp{n} x{batch}"),
        tokens: n * batch,
        median_tok_s: median(&runs),
        runs,
    })
}

/// Batched text generation (llama-batched-bench's S_TG): `batch` sequences decoding together, one
/// forward pass over all of them per step ([`strata_models::Transformer::forward_batch`]), `n`
/// steps from empty caches, `reps` times; tok/s counts every sequence's tokens.
pub fn bench_batch_decode(
    engine: &Engine,
    batch: usize,
    n: usize,
    reps: usize,
) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let mut caches =
        (0..batch.max(1)).map(|_| engine.new_cache(n + 2)).collect::<Result<Vec<_>>>()?;
    // Seconds until the pass returned and until its results were read, summed over steps.
    let split = std::cell::Cell::new((0f64, 0f64));
    let step = |caches: &mut [strata_models::KvCache], i: u32| -> Result<()> {
        let toks: Vec<[u32; 1]> =
            (0..caches.len() as u32).map(|s| [batch_token(i, s, vocab)]).collect();
        let refs: Vec<&[u32]> = toks.iter().map(|t| t.as_slice()).collect();
        let (returned, total) = batch_pass(engine, caches, &refs)?;
        split.set((split.get().0 + returned, split.get().1 + total));
        Ok(())
    };
    step(&mut caches, 0)?; // warm-up
    let mut runs = Vec::new();
    for _ in 0..reps {
        caches.iter_mut().for_each(|c| c.clear());
        let t = std::time::Instant::now();
        for i in 0..n as u32 {
            step(&mut caches, i)?;
        }
        runs.push((n * caches.len()) as f64 / t.elapsed().as_secs_f64());
    }
    if std::env::var("STRATA_BENCH_SPLIT").is_ok_and(|v| v == "1") {
        let (returned, total) = split.get();
        let steps = (n * reps + 1) as f64;
        eprintln!(
            "tg{n} x{}: per step {:.3} ms, of which {:.3} ms until the pass returned",
            caches.len(),
            total * 1e3 / steps,
            returned * 1e3 / steps
        );
    }
    Ok(BenchResult {
        test: format!("tg{n} x{}", caches.len()),
        tokens: n * caches.len(),
        median_tok_s: median(&runs),
        runs,
    })
}
