//! `strata compare-devices --batch N`: on the compared device, N sequences decoded together (one
//! forward pass per step over all of them, as the server's continuous batching runs them) against
//! each decoded alone — greedy tokens and every step's logits; together, the prompts but the last
//! run in one batched prompt pass, alone one pass each. The prompts are the compared prompt cycled
//! to different lengths (at least [`PROMPT_MIN`] tokens, so longer runs cross the 256-position
//! bucket of captured CUDA graphs), and the last sequence joins at step [`JOIN_STEP`] (its prompt
//! in one pass with the others' decode rows: a server's mixed step) and leaves halfway, so the
//! batch changes size as requests start and end. Together, every other step of each sequence asks
//! for its greedy pick alone (`Logits::Greedy`: on a GPU made on the device, the step's other rows
//! copied to the host around it); those steps' tokens are compared, the others' logits too.

use anyhow::{bail, Result};
use strata_engine::sampling::argmax;
use strata_engine::Engine;
use strata_models::{BatchOptions, BatchSeq, KvCache, Logits};

/// The shortest prompt of a sequence in the batch, tokens.
pub const PROMPT_MIN: usize = 240;

/// The step at which, together, the last sequence's prompt joins the others' decode rows.
pub const JOIN_STEP: usize = 2;

/// Decodes `batch` sequences for `steps` greedy tokens together and alone on `e`'s device and
/// prints one table row. Errors: a sequence's tokens differ, or a step's logits differ by more
/// than `tolerance` (max |Δ| ÷ max |logit| of the sequence alone), or a model error.
pub fn batched_equals_alone(
    e: &Engine,
    ids: &[u32],
    batch: usize,
    steps: usize,
    tolerance: f64,
) -> Result<()> {
    if ids.is_empty() || batch < 2 {
        bail!("--batch needs a prompt and at least 2 sequences");
    }
    let base = ids.len().max(PROMPT_MIN);
    let prompts: Vec<Vec<u32>> =
        (0..batch).map(|s| ids.iter().cycle().take(base + 5 * s).copied().collect()).collect();
    // The last sequence leaves halfway.
    let steps_of = |s: usize| if s + 1 == batch { steps / 2 } else { steps };
    let cap = base + 5 * batch + steps + 1;
    let alone: Vec<Vec<Step>> = prompts
        .iter()
        .enumerate()
        .map(|(s, p)| {
            decode(e, &[p.as_slice()], &[steps_of(s)], cap, false).map(|mut v| v.remove(0))
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let counts: Vec<usize> = (0..batch).map(steps_of).collect();
    let together = decode(e, &refs, &counts, cap, true)?;
    let (mut worst, mut same, mut total) = (0f64, 0usize, 0usize);
    for (a, b) in alone.iter().zip(&together) {
        for ((ta, la), (tb, lb)) in a.iter().zip(b) {
            if let (Some(x), Some(y)) = (la, lb) {
                worst = worst.max(crate::compare::max_rel_diff(x, y));
            }
            same += usize::from(ta == tb);
            total += 1;
        }
    }
    println!("| sequences | steps (last one) | max |Δlogit| ÷ max |logit| vs alone | greedy tokens equal |");
    println!("|---|---|---|---|");
    println!("| {batch} | {steps} ({}) | {worst:.2e} | {same}/{total} |", steps / 2);
    if same != total || worst > tolerance {
        bail!("batched decoding differs from decoding alone: {same}/{total} tokens, {worst:.2e}");
    }
    Ok(())
}

/// One decode step of a sequence: its greedy token, and its logits unless the step asked for
/// the pick alone.
type Step = (u32, Option<Vec<f32>>);

/// Prefills `prompts` (each alone, or with `mix` in one batched pass), then decodes them greedily
/// together, sequence `s` for `steps[s]` tokens (a sequence leaves the batch when its count is
/// reached): every step's token and logits per sequence. `mix`: the last sequence joins late —
/// its prompt runs in the pass of step [`JOIN_STEP`], after the others' decode rows (a server's
/// mixed step: a request arriving while others decode) — and sequence `s` asks for
/// [`Logits::Greedy`] at the steps where `step + s` is even (the pick then comes from the model,
/// made on the device on a GPU).
fn decode(
    e: &Engine,
    prompts: &[&[u32]],
    steps: &[usize],
    cap: usize,
    mix: bool,
) -> Result<Vec<Vec<Step>>> {
    let n = prompts.len();
    let joins_late = |s: usize| mix && n > 1 && s + 1 == n;
    let mut caches: Vec<KvCache> =
        prompts.iter().map(|_| e.new_cache(cap)).collect::<Result<_, _>>()?;
    let mut next = vec![0u32; n];
    let mut started = vec![false; n];
    if mix {
        // Together: every prompt but the late one in one pass, as the server's step runs
        // requests that arrive together.
        let mut seqs: Vec<BatchSeq<'_>> = caches
            .iter_mut()
            .zip(prompts)
            .enumerate()
            .filter(|(s, _)| !joins_late(*s))
            .map(|(_, (cache, p))| BatchSeq { tokens: p, cache, logits: Logits::Last })
            .collect();
        let outs = e.model.forward_batch(&mut seqs, BatchOptions::default())?;
        for (s, out) in (0..n).filter(|&s| !joins_late(s)).zip(outs) {
            next[s] = argmax(&out?.logits.flatten_all()?.to_vec1::<f32>()?);
            started[s] = true;
        }
    } else {
        for (s, (p, c)) in prompts.iter().zip(caches.iter_mut()).enumerate() {
            let out = e.model.forward(p, c, Logits::Last, &[])?;
            next[s] = argmax(&out.logits.flatten_all()?.to_vec1::<f32>()?);
            started[s] = true;
        }
    }
    let mut out_steps: Vec<Vec<Step>> = vec![Vec::new(); n];
    let mut step = 0;
    while (0..n).any(|s| out_steps[s].len() < steps[s]) {
        // Decode rows first, then the prompt joining now (the last sequence): the server's order.
        let decoding = |s: usize| started[s] && out_steps[s].len() < steps[s];
        let joining = |s: usize| !started[s] && step == JOIN_STEP;
        let members: Vec<usize> = (0..n).filter(|&s| decoding(s) || joining(s)).collect();
        let toks: Vec<[u32; 1]> = (0..n).map(|s| [next[s]]).collect();
        let mode = |s: usize| match (joining(s), mix && (step + s).is_multiple_of(2)) {
            (true, _) | (false, false) => Logits::Last,
            (false, true) => Logits::Greedy,
        };
        let mut seqs: Vec<BatchSeq<'_>> = caches
            .iter_mut()
            .enumerate()
            .filter(|(s, _)| members.contains(s))
            .map(|(s, cache)| {
                let tokens: &[u32] = if joining(s) { prompts[s] } else { &toks[s] };
                BatchSeq { tokens, cache, logits: mode(s) }
            })
            .collect();
        let outs = e.model.forward_batch(&mut seqs, BatchOptions::default())?;
        for (&s, out) in members.iter().zip(outs) {
            let out = out?;
            let (token, row) = match out.greedy {
                Some(t) => (t, None),
                None => {
                    let row = out.logits.flatten_all()?.to_vec1::<f32>()?;
                    (argmax(&row), Some(row))
                }
            };
            next[s] = token;
            if started[s] {
                out_steps[s].push((token, row));
            }
        }
        for &s in &members {
            started[s] = true;
        }
        step += 1;
    }
    Ok(out_steps)
}
