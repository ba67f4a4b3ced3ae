//! Continuous batching ([`strata_engine::batch::Batcher`]): batched requests give the tokens they
//! give alone (greedy, bit-identical rows on our kernels), cancelling one leaves the others
//! unchanged, an expert read error fails only the sequences routed to that expert, a stream of long
//! prompts starves nobody, and the prefix cache skips the shared prefix's prefill.

mod common;

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use strata_engine::batch::{BatchConfig, Batcher, SeqEvent, Submission};
use strata_engine::sampling::argmax;
use strata_engine::{Engine, FinishReason, GenerateRequest, SamplingParams};
use strata_models::{
    BatchOptions, BatchSeq, Expert, ExpertProvider, KvCache, Logits, ModelError, ResidentExperts,
    Transformer,
};

/// What one submission produced.
#[derive(Default, Debug)]
struct Outcome {
    tokens: Vec<u32>,
    done: Option<FinishReason>,
    failed: Option<String>,
    /// Batcher steps taken before each token arrived.
    token_steps: Vec<usize>,
}

type Shared = Arc<Mutex<Outcome>>;

fn submission(
    req: GenerateRequest,
    step: Arc<Mutex<usize>>,
) -> (Submission, Shared, Arc<AtomicBool>) {
    let out: Shared = Default::default();
    let cancel = Arc::new(AtomicBool::new(false));
    let o = out.clone();
    let sink = move |ev: SeqEvent<'_>| {
        let mut o = o.lock().unwrap();
        match ev {
            SeqEvent::Token { event: t, .. } if t.id != u32::MAX => {
                o.tokens.push(t.id);
                o.token_steps.push(*step.lock().unwrap());
            }
            SeqEvent::Token { .. } => {}
            SeqEvent::Done { generation: g, .. } => {
                assert_eq!(g.tokens, o.tokens, "Done carries the streamed tokens");
                o.done = Some(g.finish_reason);
            }
            SeqEvent::Failed(e) => o.failed = Some(e.to_string()),
        }
        ControlFlow::Continue(())
    };
    (Submission::new(req, Box::new(sink), cancel.clone()), out, cancel)
}

fn greedy(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt, n, SamplingParams::greedy());
    r.ignore_eos = true;
    r
}

/// Tokens `engine.generate` gives for `req` alone.
fn alone(engine: &Engine, req: &GenerateRequest) -> Vec<u32> {
    let mut cache = engine.new_cache(1024).unwrap();
    engine.generate(&mut cache, req, &mut |_| ControlFlow::Continue(())).unwrap().tokens
}

/// One step; `step` counts steps (tokens record the step that emitted them).
/// Submits every request (one choice each); their outputs, in order.
fn submit_all(b: &mut Batcher, reqs: &[GenerateRequest], step: &Arc<Mutex<usize>>) -> Vec<Shared> {
    reqs.iter()
        .map(|r| {
            let (s, o, _) = submission(r.clone(), step.clone());
            b.submit(s);
            o
        })
        .collect()
}

fn step_once(b: &mut Batcher, step: &Arc<Mutex<usize>>) {
    *step.lock().unwrap() += 1;
    b.step(&|| false).unwrap();
}

/// Runs the batcher until idle.
fn drain(b: &mut Batcher, step: &Arc<Mutex<usize>>) {
    let mut n = 0;
    while b.has_work() {
        step_once(b, step);
        n += 1;
        assert!(n < 10_000, "the batch never drains");
    }
}

fn smollm2_prompts(engine: &Engine) -> Vec<Vec<u32>> {
    let long: String = (0..40).map(|i| format!("Item {i} is a word. ")).collect();
    [
        "The capital of France is".to_string(),
        "def fibonacci(n):".to_string(),
        long,
        "Once upon a time, in a small village by the sea,".to_string(),
        "1, 2, 3, 4,".to_string(),
        "The quick brown fox".to_string(),
    ]
    .iter()
    .map(|t| engine.text_prompt(t).unwrap())
    .collect()
}

#[test]
fn batched_greedy_tokens_equal_each_request_alone() {
    let engine = Arc::new(common::load_smollm2(1024));
    let prompts = smollm2_prompts(&engine);
    assert!(prompts[2].len() > 300, "one prompt spans several prefill chunks");
    let reqs: Vec<GenerateRequest> =
        prompts.iter().enumerate().map(|(i, p)| greedy(p.clone(), 12 + 3 * i)).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&engine, r)).collect();

    let mut cfg = BatchConfig::new(4, 1024); // fewer slots than requests: some wait, then join
    cfg.prefill_chunk = 128;
    batched_equals(&engine, cfg, &reqs, &want);
}

/// The same with f16 KV caches (`--kv-cache-dtype f16`): batched rows read the f16 keys and
/// values as a sequence alone does, so its tokens are the same.
#[test]
fn batched_greedy_tokens_equal_alone_with_an_f16_kv_cache() {
    let mut opts = strata_engine::LoadOptions::new(1024, candle_core::Device::Cpu);
    opts.kv_dtype = strata_models::KvDtype::F16;
    let engine = Arc::new(Engine::load(&common::smollm2_path(), &opts, &mut |_, _| {}).unwrap());
    let prompts = smollm2_prompts(&engine);
    let reqs: Vec<GenerateRequest> =
        prompts.iter().take(4).enumerate().map(|(i, p)| greedy(p.clone(), 10 + 2 * i)).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&engine, r)).collect();
    let mut cfg = BatchConfig::new(3, 1024);
    cfg.prefill_chunk = 128;
    batched_equals(&engine, cfg, &reqs, &want);
}

/// Runs `reqs` through a batcher of `cfg` until idle: they shared passes up to `cfg.slots`
/// sequences, and each request's tokens are `want`'s.
fn batched_equals(
    engine: &Arc<Engine>,
    cfg: BatchConfig,
    reqs: &[GenerateRequest],
    want: &[Vec<u32>],
) {
    let (slots, split) = (cfg.slots, cfg.split_mixed);
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0));
    let outs = submit_all(&mut b, reqs, &step);
    let mut max_batch = 0;
    while b.has_work() {
        let st = b.step(&|| false).unwrap();
        max_batch = max_batch.max(st.sequences);
    }
    assert_eq!(max_batch, slots, "requests shared passes");
    for (i, o) in outs.iter().enumerate() {
        let o = o.lock().unwrap();
        assert_eq!(o.failed, None);
        assert_eq!(o.done, Some(FinishReason::Length));
        assert_eq!(o.tokens, want[i], "request {i} ({split:?}): batched tokens differ from alone");
    }
}

/// With and without deferred emission ([`BatchConfig::defer_emission`]).
#[test]
fn cancelling_one_request_leaves_the_others_unchanged() {
    let engine = Arc::new(common::load_smollm2(512));
    let prompts = smollm2_prompts(&engine);
    let reqs: Vec<GenerateRequest> = prompts[..3].iter().map(|p| greedy(p.clone(), 20)).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&engine, r)).collect();
    for defer in [false, true] {
        cancel_one(&engine, &reqs, &want, defer);
    }
}

fn cancel_one(engine: &Arc<Engine>, reqs: &[GenerateRequest], want: &[Vec<u32>], defer: bool) {
    let mut cfg = BatchConfig::new(3, 512);
    cfg.defer_emission = Some(defer);
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0));
    let subs: Vec<(Shared, Arc<AtomicBool>)> = reqs
        .iter()
        .map(|r| {
            let (s, o, c) = submission(r.clone(), step.clone());
            b.submit(s);
            (o, c)
        })
        .collect();
    while subs[1].0.lock().unwrap().tokens.len() < 5 {
        b.step(&|| false).unwrap();
    }
    subs[1].1.store(true, Ordering::SeqCst);
    drain(&mut b, &step);
    let cancelled = subs[1].0.lock().unwrap();
    assert_eq!(cancelled.done, Some(FinishReason::Cancelled));
    assert!(cancelled.tokens.len() < 20);
    assert_eq!(cancelled.tokens[..], want[1][..cancelled.tokens.len()]);
    for i in [0, 2] {
        let o = subs[i].0.lock().unwrap();
        assert_eq!(o.done, Some(FinishReason::Length));
        assert_eq!(o.tokens, want[i], "request {i} changed when another was cancelled ({defer})");
    }
}

/// Resident experts, but one (layer, expert) fails to "read".
#[derive(Debug)]
struct FailingExperts {
    inner: ResidentExperts,
    bad: (usize, usize),
}

impl ExpertProvider for FailingExperts {
    fn expert(&self, layer: usize, expert: usize) -> strata_models::Result<Arc<Expert>> {
        if (layer, expert) == self.bad {
            return Err(ModelError::ExpertRead {
                layer,
                expert,
                message: "injected I/O error".into(),
            });
        }
        self.inner.expert(layer, expert)
    }
    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }
}

#[test]
fn an_expert_read_error_fails_only_the_sequences_routed_to_it() {
    let path = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_moe.gguf");
    let files = strata_formats::ModelFiles::open(&path).unwrap();
    let cfg = files.config().unwrap();
    let plain = common::load(&path, 256);
    // Two prompts and the experts each touches (prompt and generated tokens, every layer).
    let prompts: Vec<Vec<u32>> = vec![vec![364, 223, 397, 100, 250], vec![9, 8, 7, 6, 5, 4]];
    let reqs: Vec<GenerateRequest> = prompts.iter().map(|p| greedy(p.clone(), 8)).collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&plain, r)).collect();
    let used = |i: usize| {
        let mut cache = plain.new_cache(256).unwrap();
        let mut seq = prompts[i].clone();
        seq.extend_from_slice(&want[i][..want[i].len() - 1]);
        let out = plain.model.forward(&seq, &mut cache, strata_models::Logits::All, &[]).unwrap();
        let mut set = std::collections::BTreeSet::new();
        for r in &out.routing {
            for &e in &r.expert_ids {
                set.insert((r.layer, e as usize));
            }
        }
        set
    };
    let (a, b_used) = (used(0), used(1));
    let bad = *a.difference(&b_used).next().expect("an expert only the first request uses");

    let mut resident = ResidentExperts::new(cfg.num_layers);
    for l in 0..cfg.num_layers {
        if cfg.is_moe_layer(l) {
            resident.load_layer(&files, &cfg, l, &candle_core::Device::Cpu).unwrap();
        }
    }
    let provider = Arc::new(FailingExperts { inner: resident, bad });
    let model = Transformer::load_with_experts(
        &files,
        &candle_core::Device::Cpu,
        256,
        Some(provider),
        &mut |_, _| {},
    )
    .unwrap();
    let engine = Arc::new(Engine { model: Arc::new(model), ..common::load(&path, 256) });
    let mut b = Batcher::new(engine, BatchConfig::new(2, 256)).unwrap();
    let step = Arc::new(Mutex::new(0));
    let outs = submit_all(&mut b, &reqs, &step);
    drain(&mut b, &step);
    let failed = outs[0].lock().unwrap();
    let msg = failed.failed.as_deref().expect("the request routed to the bad expert fails");
    assert!(msg.contains("injected I/O error"), "{msg}");
    let ok = outs[1].lock().unwrap();
    assert_eq!(ok.failed, None);
    assert_eq!(ok.tokens, want[1], "the other request goes on unchanged");
}

#[test]
fn long_prompts_starve_neither_running_requests_nor_earlier_prompts() {
    let engine = Arc::new(common::load_smollm2(1024));
    let long: String = (0..60).map(|i| format!("Line {i}: nothing to see here. ")).collect();
    let long = engine.text_prompt(&long).unwrap();
    assert!(long.len() > 500);
    let mut cfg = BatchConfig::new(3, 1024);
    cfg.prefill_chunk = 128;
    cfg.step_tokens = 128;
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0));
    let (s, short, _) = submission(greedy(engine.text_prompt("Hello").unwrap(), 24), step.clone());
    b.submit(s);
    step_once(&mut b, &step); // the short request is decoding
    let mut longs = Vec::new();
    let mut n = 1;
    while b.has_work() {
        // A new long prompt arrives every other step for a while.
        if n % 2 == 0 && longs.len() < 8 {
            let (s, o, _) = submission(greedy(long.clone(), 2), step.clone());
            b.submit(s);
            longs.push(o);
        }
        step_once(&mut b, &step);
        n += 1;
        assert!(n < 2_000);
    }
    let short = short.lock().unwrap();
    assert_eq!(short.done, Some(FinishReason::Length));
    // One token per step while it runs: prompts never hold a running request back.
    for w in short.token_steps.windows(2) {
        assert_eq!(w[1], w[0] + 1, "a decode step was skipped: {:?}", short.token_steps);
    }
    // Prompts finish in arrival order (first come, first served).
    let firsts: Vec<usize> = longs.iter().map(|o| o.lock().unwrap().token_steps[0]).collect();
    assert!(firsts.windows(2).all(|w| w[0] <= w[1]), "{firsts:?}");
    assert!(longs.iter().all(|o| o.lock().unwrap().done == Some(FinishReason::Length)));
}

#[test]
fn the_prefix_cache_skips_a_shared_prefix() {
    let engine = Arc::new(common::load_smollm2(2048));
    let shared: String = (0..50).map(|i| format!("Rule {i}: be kind to the user. ")).collect();
    let ask = |q: &str| engine.text_prompt(&format!("{shared}\nQuestion: {q}\nAnswer:")).unwrap();
    let (p1, p2) = (ask("What is rule 3?"), ask("What is the last rule?"));
    let common_len = p1.iter().zip(&p2).take_while(|(a, b)| a == b).count();
    assert!(common_len > 500, "{common_len}");
    let want2 = alone(&engine, &greedy(p2.clone(), 8));

    let mut cfg = BatchConfig::new(1, 2048);
    cfg.prefix_cache_bytes = 256 << 20;
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0));
    let (s, _, _) = submission(greedy(p1.clone(), 8), step.clone());
    b.submit(s);
    drain(&mut b, &step);
    let st = b.prefix_stats().unwrap();
    assert_eq!((st.lookups, st.hits), (1, 0));
    assert!(st.bytes > 0);
    let (s, o2, _) = submission(greedy(p2.clone(), 8), step.clone());
    b.submit(s);
    drain(&mut b, &step);
    let st = b.prefix_stats().unwrap();
    assert_eq!((st.lookups, st.hits), (2, 1));
    assert_eq!(st.reused_tokens as usize, common_len / 64 * 64, "whole 64-token blocks reused");
    assert_eq!(o2.lock().unwrap().tokens, want2, "a prefix hit gives the tokens of a cold run");
}

/// Hybrid models (Gated DeltaNet): the prefix cache keeps the recurrent state at the last block
/// boundary inside each prompt, and a later prompt sharing that prefix starts from it: its tokens
/// and their log-probabilities are a cold run's (within float rounding of the cut prefill).
#[test]
fn a_hybrid_prefix_hit_restores_the_recurrent_state() {
    let path = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_next.gguf");
    let engine = Arc::new(common::load(&path, 512));
    let shared: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 500).collect();
    let with = |tail: &[u32]| [shared.as_slice(), tail].concat();
    let (p1, p2) = (with(&[7, 8, 9]), with(&[300, 301, 302, 303]));
    let mut req2 = greedy(p2.clone(), 12);
    req2.logprobs = Some(0);
    let mut cache = engine.new_cache(512).unwrap();
    let mut cold = Vec::new();
    engine
        .generate(&mut cache, &req2, &mut |ev| {
            if let Some(l) = &ev.logprobs {
                cold.push((ev.id, l.logprob));
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    let mut cfg = BatchConfig::new(1, 512);
    cfg.prefix_cache_bytes = 64 << 20;
    cfg.prefill_chunk = 100; // the snapshot boundary (128) falls inside a chunk: the pass is cut there
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0));
    let (s, _, _) = submission(greedy(p1, 12), step.clone());
    b.submit(s);
    drain(&mut b, &step);
    assert_eq!(b.prefix_stats().unwrap().hits, 0);
    let warm: Arc<Mutex<Vec<(u32, f32)>>> = Default::default();
    let w = warm.clone();
    let sink = move |ev: SeqEvent<'_>| {
        if let SeqEvent::Token { event: t, .. } = ev {
            if let Some(l) = &t.logprobs {
                w.lock().unwrap().push((t.id, l.logprob));
            }
        }
        ControlFlow::Continue(())
    };
    let cancel = Arc::new(AtomicBool::new(false));
    b.submit(Submission::new(req2, Box::new(sink), cancel));
    drain(&mut b, &step);
    let st = b.prefix_stats().unwrap();
    assert_eq!(
        (st.hits, st.reused_tokens),
        (1, 128),
        "two 64-token blocks, the second with its state"
    );
    let warm = warm.lock().unwrap();
    assert_eq!(warm.len(), cold.len());
    for ((wi, wl), (ci, cl)) in warm.iter().zip(&cold) {
        assert_eq!(wi, ci);
        assert!((wl - cl).abs() < 1e-4, "logprob {wl} against a cold run's {cl}");
    }
}

/// `n` choices from one prefill: the prompt runs once (one prefill pass), each choice samples on
/// its own seed; greedy choices are all the request's greedy answer.
#[test]
fn n_choices_share_one_prefill() {
    let engine = Arc::new(common::load_smollm2(512));
    let prompt = engine.text_prompt("Write a short poem about the sea:").unwrap();
    let greedy_alone = alone(&engine, &greedy(prompt.clone(), 10));
    let run = |req: GenerateRequest| {
        let mut b = Batcher::new(engine.clone(), BatchConfig::new(3, 512)).unwrap();
        let outs: Arc<Mutex<Vec<Vec<u32>>>> = Arc::new(Mutex::new(vec![Vec::new(); 3]));
        let done = Arc::new(Mutex::new(0));
        let (o, d) = (outs.clone(), done.clone());
        let sink = move |ev: SeqEvent<'_>| {
            match ev {
                SeqEvent::Token { choice, event } if event.id != u32::MAX => {
                    o.lock().unwrap()[choice].push(event.id)
                }
                SeqEvent::Done { .. } => *d.lock().unwrap() += 1,
                SeqEvent::Failed(e) => panic!("{e}"),
                _ => {}
            }
            ControlFlow::Continue(())
        };
        let mut sub = Submission::new(req, Box::new(sink), Arc::new(AtomicBool::new(false)));
        sub.n = 3;
        b.submit(sub);
        let first = b.step(&|| false).unwrap();
        assert_eq!((first.sequences, first.generated), (1, 3), "one prefill, three first tokens");
        while b.has_work() {
            b.step(&|| false).unwrap();
        }
        assert_eq!(*done.lock().unwrap(), 3);
        let v = outs.lock().unwrap().clone();
        v
    };
    for o in run(greedy(prompt.clone(), 10)) {
        assert_eq!(o, greedy_alone);
    }
    let mut sampled = greedy(prompt, 10);
    sampled.sampling =
        SamplingParams { temperature: 1.0, seed: Some(7), ..SamplingParams::default() };
    let o = run(sampled);
    assert!(o.iter().all(|c| c.len() == 10));
    assert!(o[0] != o[1] || o[1] != o[2], "seeds differ per choice: {o:?}");
}

/// The server's warm-up runs its two requests (the second a prefix hit) and leaves the batch as
/// it found it: idle, the prefix cache empty, and a request after it gives its tokens alone.
#[test]
fn the_warm_up_leaves_an_idle_batch_and_an_empty_prefix_cache() {
    let engine = Arc::new(common::load_smollm2(512));
    let prompt = engine.text_prompt("The capital of France is").unwrap();
    let want = alone(&engine, &greedy(prompt.clone(), 8));
    let mut cfg = BatchConfig::new(2, 512);
    cfg.prefix_cache_bytes = 64 << 20;
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let w = b.warm_up().unwrap();
    assert!(w.ms > 0.0);
    assert!(w.prefix_hit, "the second warm-up request runs on the first's prefix");
    assert_eq!(w.batch_sizes, 0, "no batched graphs on the CPU");
    assert!(!b.has_work());
    assert_eq!(b.free_slots(), 2);
    let st = b.prefix_stats().unwrap();
    assert_eq!((st.lookups, st.hits, st.bytes), (0, 0, 0), "a fresh prefix cache after it");
    let step = Arc::new(Mutex::new(0));
    let (s, o, _) = submission(greedy(prompt, 8), step.clone());
    b.submit(s);
    drain(&mut b, &step);
    assert_eq!(o.lock().unwrap().tokens, want);

    // Refused while a request waits; too short a context is an error, not a panic.
    let (s, _, _) = submission(greedy(vec![1, 2, 3], 2), step.clone());
    b.submit(s);
    assert!(b.warm_up().is_err());
    let mut tiny = Batcher::new(engine, BatchConfig::new(1, 5)).unwrap();
    assert!(tiny.warm_up().is_err());
}

/// Two prompts prefilled alone, then one pass of their next tokens (decode rows) and a third
/// prompt (a chunk), merged or split ([`BatchOptions::split_mixed`]), then one decode step of all
/// three: every sequence's logits of both passes, and its cache length.
fn mixed_pass(engine: &Engine, split: bool) -> (Vec<Vec<f32>>, Vec<usize>) {
    let prompts = smollm2_prompts(engine);
    let mut caches: Vec<KvCache> = (0..3).map(|_| engine.new_cache(1024).unwrap()).collect();
    let mut next = Vec::new();
    for (p, c) in prompts.iter().zip(caches.iter_mut()).take(2) {
        let out = engine.model.forward(p, c, Logits::Last, &[]).unwrap();
        next.push([argmax(&out.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap())]);
    }
    let mut logits = Vec::new();
    let rows = 2 + prompts[2].len();
    let [c0, c1, c2] = &mut caches[..] else { unreachable!() };
    let mut seqs = vec![
        BatchSeq { tokens: &next[0], cache: c0, logits: Logits::Last },
        BatchSeq { tokens: &next[1], cache: c1, logits: Logits::Last },
        BatchSeq { tokens: &prompts[2], cache: c2, logits: Logits::Last },
    ];
    let opts = BatchOptions { split_mixed: Some(split), ..Default::default() };
    let outs =
        strata_models::prefill_scope(rows, 2, || engine.model.forward_batch(&mut seqs, opts));
    let mut last = Vec::new();
    for out in outs.unwrap() {
        let row = out.unwrap().logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        last.push([argmax(&row)]);
        logits.push(row);
    }
    let mut seqs: Vec<BatchSeq<'_>> = caches
        .iter_mut()
        .zip(&last)
        .map(|(cache, t)| BatchSeq { tokens: t, cache, logits: Logits::Last })
        .collect();
    for out in engine.model.forward_batch(&mut seqs, BatchOptions::default()).unwrap() {
        logits.push(out.unwrap().logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    (logits, caches.iter().map(KvCache::len).collect())
}

#[test]
fn a_mixed_pass_split_in_two_equals_it_merged() {
    let engine = common::load_smollm2(1024);
    let prompts = smollm2_prompts(&engine);
    let (merged, lens) = mixed_pass(&engine, false);
    let (split, split_lens) = mixed_pass(&engine, true);
    let want: Vec<usize> = (0..3).map(|i| prompts[i].len() + 1 + usize::from(i < 2)).collect();
    assert_eq!(lens, want);
    assert_eq!(split_lens, want);
    assert_eq!(merged.len(), 6);
    for (i, (a, b)) in merged.iter().zip(&split).enumerate() {
        assert!(a == b, "sequence {} of pass {}: split logits differ from merged", i % 3, i / 3);
    }

    // Stopped during the chunks' pass: the decode rows' caches keep their lengths too.
    let mut caches: Vec<KvCache> = (0..2).map(|_| engine.new_cache(1024).unwrap()).collect();
    engine.model.forward(&prompts[0], &mut caches[0], Logits::Last, &[]).unwrap();
    let polls = std::cell::Cell::new(0usize);
    let layers = engine.model.config().num_layers;
    let stop = || {
        polls.set(polls.get() + 1);
        polls.get() > layers // the decode rows' pass polls once per layer
    };
    let [c0, c1] = &mut caches[..] else { unreachable!() };
    let len0 = c0.len();
    let mut seqs = vec![
        BatchSeq { tokens: &[1], cache: c0, logits: Logits::Last },
        BatchSeq { tokens: &prompts[1], cache: c1, logits: Logits::Last },
    ];
    let opts = BatchOptions { split_mixed: Some(true), stop: Some(&stop), ..Default::default() };
    let res = engine.model.forward_batch(&mut seqs, opts);
    assert!(matches!(res, Err(ModelError::Interrupted)), "the second pass was stopped");
    assert_eq!(polls.get(), layers + 1, "the decode rows' pass ran whole, the chunks' was stopped");
    assert_eq!((caches[0].len(), caches[1].len()), (len0, 0));
}

/// Hybrid models (Gated DeltaNet): each sequence's recurrent state is its own in a batch —
/// requests decoded together, joining while others decode (mixed steps), give their tokens alone.
#[test]
fn hybrid_batched_greedy_tokens_equal_each_request_alone() {
    let path = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_next.gguf");
    let engine = Arc::new(common::load(&path, 512));
    let reqs: Vec<GenerateRequest> = (0..5u32)
        .map(|r| {
            let p: Vec<u32> = (0..20 + 37 * r).map(|i| (i * 31 + 7 * r + 3) % 500).collect();
            greedy(p, 10 + 2 * r as usize)
        })
        .collect();
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| alone(&engine, r)).collect();
    // Merged steps (the CPU's default), and decode rows split from prompt chunks (a GPU's).
    for split in [None, Some(true)] {
        let mut cfg = BatchConfig::new(3, 512); // fewer slots than requests: some join later
        cfg.prefill_chunk = 48;
        cfg.split_mixed = split;
        batched_equals(&engine, cfg, &reqs, &want);
    }
}

/// Every event of one request: `(token id, text)` per token (the flush's `u32::MAX` included),
/// then its finish reason, and the step each token arrived in.
#[derive(Default, Debug, PartialEq)]
struct Events {
    tokens: Vec<(u32, String)>,
    done: Option<FinishReason>,
    text: Option<String>,
}

/// Runs `reqs` through a batcher with `defer` emission; each request's events, and the step
/// (counted from 1) each token arrived in, per request.
fn run_events(
    engine: &Arc<Engine>,
    reqs: &[GenerateRequest],
    defer: bool,
) -> (Vec<Events>, Vec<Vec<usize>>) {
    let mut cfg = BatchConfig::new(reqs.len(), 512);
    cfg.defer_emission = Some(defer);
    let mut b = Batcher::new(engine.clone(), cfg).unwrap();
    let step = Arc::new(Mutex::new(0usize));
    let mut outs = Vec::new();
    for r in reqs {
        let ev: Arc<Mutex<(Events, Vec<usize>)>> = Default::default();
        let (e, st) = (ev.clone(), step.clone());
        let sink = move |x: SeqEvent<'_>| {
            let mut e = e.lock().unwrap();
            match x {
                SeqEvent::Token { event, .. } => {
                    e.0.tokens.push((event.id, event.text.clone()));
                    e.1.push(*st.lock().unwrap());
                }
                SeqEvent::Done { generation: g, .. } => {
                    assert!(e.0.done.is_none(), "one Done");
                    e.0.done = Some(g.finish_reason);
                    e.0.text = Some(g.text);
                }
                SeqEvent::Failed(err) => panic!("failed: {err}"),
            }
            ControlFlow::Continue(())
        };
        b.submit(Submission::new(r.clone(), Box::new(sink), Arc::new(AtomicBool::new(false))));
        outs.push(ev);
    }
    drain(&mut b, &step);
    outs.into_iter().map(|o| std::mem::take(&mut *o.lock().unwrap())).unzip()
}

/// Deferred emission (a decode token published while the next step runs, on by default on a
/// GPU) gives every request the events it gets without it — tokens, texts, a stop string met
/// mid-way, `max_tokens`, EOS — each decode token one step later.
#[test]
fn deferred_emission_sends_the_same_events_one_step_later() {
    let engine = Arc::new(common::load_smollm2(512));
    let prompts = smollm2_prompts(&engine);
    let mut reqs: Vec<GenerateRequest> =
        prompts[..4].iter().enumerate().map(|(i, p)| greedy(p.clone(), 14 + i)).collect();
    // A stop string from request 0's own text, met mid-way; request 2 ends at EOS if it comes.
    let (plain, _) = run_events(&engine, &reqs[..1], false);
    let text = plain[0].text.clone().unwrap();
    let stop = text
        .split_whitespace()
        .find(|w| text.find(w).is_some_and(|at| at > text.len() / 3))
        .unwrap_or_else(|| panic!("no word first met past a third of {text:?}"));
    reqs[0].stop = vec![stop.to_string()];
    reqs[2].ignore_eos = false;
    reqs[3].max_tokens = 1;

    let (want, want_steps) = run_events(&engine, &reqs, false);
    let (got, got_steps) = run_events(&engine, &reqs, true);
    assert_eq!(want[0].done, Some(FinishReason::Stop), "the stop string was met");
    assert!((3..14).contains(&want[0].tokens.len()), "mid-way: {:?}", want[0]);
    assert_eq!(got, want);
    // Deferral happened: decode tokens (after the first) arrived one step later, but for a
    // last token that ends its sequence by itself (EOS, max_tokens), sent at once; the stop
    // string is found in a deferred token.
    for (i, (g, w)) in got_steps.iter().zip(&want_steps).enumerate() {
        let n = want[i].tokens.iter().filter(|(id, _)| *id != u32::MAX).count();
        for k in 0..g.len().min(w.len()) {
            let later = usize::from(k >= 1 && (k + 1 < n || i == 0));
            assert_eq!(g[k], w[k] + later, "request {i}, token {k}: {g:?} against {w:?}");
        }
    }
}
