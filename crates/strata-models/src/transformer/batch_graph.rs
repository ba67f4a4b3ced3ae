//! Batched decode steps as CUDA graphs (`cuda` build): a pass of one token for each of 2 to
//! [`GRAPH_ROWS_MAX`] sequences (continuous batching's decode step) of a model the one-sequence
//! graph path takes ([`super::graph`]) is captured once per (sequences, context bucket) and
//! replayed, so a batched step costs one graph launch instead of ~11 launches per layer and
//! their CPU-side cost (measured before this: a SmolLM2 step took 2.7–3.3 ms for any batch size
//! on an H100, slower at two sequences than one graph-replayed sequence).
//!
//! What changes between steps lives in device buffers written before each launch: the tokens,
//! every layer's table — an attention layer's row table ([`strata_kernels::cuda::Rows`]: per row
//! its position and its sequence's layer cache addresses), a hybrid's Gated DeltaNet layer's
//! state table ([`strata_kernels::cuda::GdnStates`]: per row its sequence's conv window and
//! delta-rule state, advanced by one launch of each kernel for all rows); which sequences share a
//! step does not matter to the graph — and a synthetic model's choice of experts. The bucket (positions up to 256·2ʲ − 1, as for one
//! sequence) holds the step's largest position: the attention kernels' split count is fixed at
//! capture, chunks past a row's length add nothing. The graphs live in the model, shared by every
//! sequence; a shape is captured the second time it comes (a batch size seen once runs op by
//! op). Graph memory is auto-freed on launch: the logits `[rows, vocab]` are brought to the host
//! in one copy and the routing record read back after each launch.
//!
//! Each row's launches are the op-by-op batched pass's (`forward_batch` over one-token
//! sequences: the same kernels over the same rows), so the logits are the same bits.
//!
//! A hybrid's captured step keeps the one-row kernels for its dense products
//! ([`crate::gpu::rows_exact_scope`], as its op-by-op batched passes), and the eager run before a
//! capture is undone for the recurrent states (each sequence's copied and put back), since the
//! graph's first launch repeats the step.
//!
//! Not taken (the op-by-op path runs instead): one sequence (its own graphs), more than
//! [`GRAPH_ROWS_MAX`] sequences, a sequence with more than one token (prefill chunks, verify
//! passes), caches of different capacities, hidden-state taps, a partial layer count, a batch
//! mixing synthetic-routing and other sequences, a hybrid's sequence whose recurrent state is on
//! the host, lost, or under a speculative checkpoint, `STRATA_GPU_BATCH_GRAPHS=0`, or anything
//! [`Transformer::graph_decodable`] refuses. A capture that fails turns the path off for the model (logged once).

use std::collections::{HashMap, HashSet};
use std::sync::PoisonError;

use candle_core::{DType, Device, Tensor};
use strata_kernels::cuda::{self as gpu, Rows};

use super::batch::{slice_routing, BatchOptions, BatchSeq};
use super::device_routing::{choose_ahead, synthetic_choices};
use super::graph::{bucket, replay, Captured, LayerRows, PassKv, ReplayStats, GRAPH_ROWS_MAX};
use super::{ForwardOutput, Mixer, Transformer};
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;

/// A captured step: its sequences (rows) and the largest position it serves (the bucket).
type Key = (usize, usize);

/// The model's captured batched steps and the device buffers they read.
#[derive(Debug)]
pub(crate) struct BatchGraphs {
    /// u32 `[GRAPH_ROWS_MAX]`: the step's tokens, one per sequence (the first `rows`).
    tokens: Tensor,
    /// u32 `[layers · GRAPH_ROWS_MAX · 5]`: every layer's row table, layer `l`'s at
    /// `l · rows · 5` for a step of `rows` sequences.
    tables: Tensor,
    /// A synthetic model's choice of experts, u32 `[moe_layers · GRAPH_ROWS_MAX · model_top_k]`
    /// (the first `moe_layers · rows · model_top_k` written before each step).
    chosen: Option<Tensor>,
    /// The next step's row tables, made while this step ran.
    tables_ahead: Option<Ahead>,
    /// The next step's synthetic routing choice, drawn while this step ran (`choose_ahead`).
    choice_ahead: Option<Ahead>,
    graphs: HashMap<Key, Captured>,
    /// Shapes run once op by op: captured when they come again.
    seen: HashSet<Key>,
    /// A capture failed: batched steps run op by op.
    failed: bool,
    /// Replays timed under `STRATA_GPU_GRAPH_STATS=1`.
    timed: ReplayStats,
}

/// What a step writes before its launch, made while the step before it ran: its row tables' words
/// (a model without recurrent layers: every entry is a position and the cache's layer addresses,
/// which never move) or its synthetic routing choice. They hold for the sequences they were made
/// for — each cache's [`KvCache::id`] and length, in the step's order — and no others.
#[derive(Debug)]
struct Ahead {
    key: Vec<(u64, usize)>,
    values: Vec<u32>,
}

impl Ahead {
    /// The values, when made for `seqs` as they stand.
    fn take_for(slot: &mut Option<Ahead>, seqs: &[BatchSeq<'_>]) -> Option<Vec<u32>> {
        slot.take()
            .filter(|a| {
                a.key.len() == seqs.len()
                    && a.key.iter().zip(seqs).all(|(&k, s)| k == (s.cache.id(), s.cache.len()))
            })
            .map(|a| a.values)
    }
}

impl Transformer {
    /// One decode token for each of `seqs` (2 to [`GRAPH_ROWS_MAX`] sequences) through a
    /// captured batched step; `None` when the batch cannot take this path (the caller runs the
    /// op-by-op pass). On success every cache advances by one and each result holds the
    /// sequence's logits `[1, vocab]` (on the host) or its greedy pick, and routing.
    pub(super) fn try_batch_graphed(
        &self,
        seqs: &mut [BatchSeq<'_>],
        opts: &BatchOptions<'_>,
    ) -> Result<Option<Vec<Result<ForwardOutput>>>> {
        let t0 = std::time::Instant::now();
        let n = seqs.len();
        if !(2..=GRAPH_ROWS_MAX).contains(&n)
            || !opts.hidden_layers.is_empty()
            || opts.n_layers.is_some_and(|l| l < self.layers.len())
        {
            return Ok(None);
        }
        let cap = seqs[0].cache.capacity();
        let synthetic = seqs.iter().filter(|s| s.cache.has_routing_history()).count();
        // A hybrid's sequences keep their recurrent state on the device, where no speculative
        // checkpoint logs its passes (as for one sequence, `super::graph`).
        let hybrid = self.has_recurrent_layers();
        let plain = seqs.iter().all(|s| {
            s.tokens.len() == 1
                && (s.tokens[0] as usize) < self.cfg.vocab_size
                && s.cache.check_room(1).is_ok()
                && s.cache.capacity() == cap
                && s.cache.device_position().is_none()
                && (!hybrid || s.cache.recurrent_device().is_some_and(|d| d.steppable()))
        });
        if !plain
            || (synthetic != 0 && synthetic != n)
            || !crate::gpu::enabled(crate::gpu::GpuPath::BatchGraphs)
            || !self.graph_decodable()
        {
            return Ok(None);
        }
        let Device::Cuda(dev) = &self.device else { return Ok(None) };
        let mut guard = self.batch_graphs.lock().unwrap_or_else(PoisonError::into_inner);
        let longest = seqs.iter().map(|s| s.cache.len()).max().unwrap_or(0);
        let key = (n, bucket(longest, cap));
        let g = match guard.as_mut() {
            Some(g) => g,
            None => guard.insert(self.new_batch_graphs()?),
        };
        let captured = g.graphs.contains_key(&key);
        // A shape seen for the first time runs op by op; so does everything after a failure.
        if !captured && (g.failed || g.seen.insert(key)) {
            return Ok(None);
        }
        if opts.stop.is_some_and(|stop| stop()) {
            return Err(ModelError::Interrupted);
        }
        let tokens: Vec<u32> = seqs.iter().map(|s| s.tokens[0]).collect();
        gpu::write_u32s(&g.tokens, &tokens)?;
        let mut tables_ms = self.write_row_tables(g, seqs)?;
        let t_choice = std::time::Instant::now();
        let chosen = self.write_batch_choice(g, seqs, &tokens)?;
        let choice_ms = t_choice.elapsed().as_secs_f64() * 1e3;
        if synthetic != 0 && chosen.is_none() {
            return Ok(None); // no MoE layer routes on the device: nothing was recorded
        }
        let ids = g.tokens.narrow(0, 0, n)?;
        if !captured {
            // The tables' views, which the launches (not a replay) take.
            let t_views = std::time::Instant::now();
            let tables = self.row_table_views(g, seqs, key.1)?;
            tables_ms[2] = t_views.elapsed().as_secs_f64() * 1e3;
            // Run the step (parameter uploads cached for the capture), capture the same
            // launches, then launch the new graph at once (as for one sequence: its memory
            // exists only once it has run); the launch rewrites the same cache entries. A
            // hybrid's recurrent states would advance twice: they are put back after the run
            // (a copy of each sequence's; without the memory for the copies the path is off, as
            // after a failed capture).
            let _htod = dev.enable_cuda_graph_htod_cache();
            let before = match hybrid {
                true => match seqs.iter().map(|s| s.cache.snapshot_recurrent()).collect() {
                    Some(copies) => Some::<Vec<_>>(copies),
                    None => {
                        g.failed = true;
                        eprintln!(
                            "strata: no device memory to copy the recurrent states for a \
                             batched step's capture: batched steps run op by op"
                        );
                        return Ok(None);
                    }
                },
                false => None,
            };
            let eager = {
                let mut kv = PassKv::Rows { tables: &tables, like: seqs[0].cache };
                self.decode_body(&mut kv, &ids, false, chosen.clone())?
            };
            for (s, b) in seqs.iter_mut().zip(before.iter().flatten()) {
                s.cache.restore_recurrent(b);
            }
            let mut kv = PassKv::Rows { tables: &tables, like: seqs[0].cache };
            // The greedy picks inside the graph (read with its outputs).
            let picks = crate::gpu::enabled(crate::gpu::GpuPath::Argmax);
            match self.capture(dev, &mut kv, &ids, false, chosen.clone(), picks) {
                Ok(c) => {
                    g.graphs.insert(key, c);
                }
                Err(e) => {
                    g.failed = true;
                    eprintln!("strata: CUDA graph capture of a batched step failed: {e}");
                    // The eager run's outputs stand; a hybrid's states went back, so it runs
                    // again (the same launches over the same inputs: the same bits).
                    let (logits, routing) = match hybrid {
                        true => self.decode_body(&mut kv, &ids, false, chosen)?,
                        false => eager,
                    };
                    let routing =
                        routing.as_ref().map(|d| d.read(self.experts.as_ref())).transpose()?;
                    return finish(seqs, &logits, None, routing.unwrap_or_default()).map(Some);
                }
            }
        }
        let c = g.graphs.get(&key).expect("captured above");
        if super::graph::stats_on() {
            g.timed.add_prep(t0.elapsed().as_secs_f64() * 1e3, choice_ms, tables_ms);
        }
        let (mut tables_ahead, mut choice_ahead) = (None, None);
        let out = replay(dev, c, &mut g.timed, |c, wait| {
            // While the step runs: the next step's routing choice drawn (synthetic models) and
            // its row tables, for the same sequences one position on.
            let key: Vec<(u64, usize)> =
                seqs.iter().map(|s| (s.cache.id(), s.cache.len() + 1)).collect();
            if synthetic != 0 {
                let next: Vec<usize> = key.iter().map(|k| k.1).collect();
                let mut caches: Vec<&mut KvCache> =
                    seqs.iter_mut().map(|s| &mut *s.cache).collect();
                let ids = choose_ahead(self, &mut caches, &next);
                choice_ahead = ids.map(|ids| Ahead { key: key.clone(), values: ids });
            }
            if !hybrid {
                let words = self.row_table_words(seqs, 1);
                tables_ahead = words.ok().map(|words| Ahead { key, values: words });
            }
            if let Some(work) = opts.while_running {
                work();
            }
            wait();
            let routing = c.routing.as_ref().map(|d| d.read(self.experts.as_ref())).transpose()?;
            finish(seqs, &c.logits, c.picks.as_ref(), routing.unwrap_or_default()).map(Some)
        });
        g.tables_ahead = tables_ahead;
        g.choice_ahead = choice_ahead;
        out
    }

    fn new_batch_graphs(&self) -> Result<BatchGraphs> {
        let table_words = self.layers.len() * GRAPH_ROWS_MAX * 5;
        Ok(BatchGraphs {
            tokens: Tensor::zeros(GRAPH_ROWS_MAX, DType::U32, &self.device)?,
            tables: Tensor::zeros(table_words, DType::U32, &self.device)?,
            chosen: None,
            tables_ahead: None,
            choice_ahead: None,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            failed: false,
            timed: ReplayStats::default(),
        })
    }

    /// Writes every layer's table for this step (one host-to-device copy): the words made
    /// during the step before ([`Ahead`]) when they were made for these sequences at these
    /// lengths, else made now; returns the ms of the entries and the copy (and 0 for the views,
    /// [`Self::row_table_views`]).
    fn write_row_tables(&self, g: &mut BatchGraphs, seqs: &[BatchSeq<'_>]) -> Result<[f64; 3]> {
        let t = std::time::Instant::now();
        let words = match Ahead::take_for(&mut g.tables_ahead, seqs) {
            Some(words) => words,
            None => self.row_table_words(seqs, 0)?,
        };
        let entries = t.elapsed().as_secs_f64() * 1e3;
        gpu::write_u32s(&g.tables, &words)?;
        let copy = t.elapsed().as_secs_f64() * 1e3 - entries;
        Ok([entries, copy, 0.0])
    }

    /// Every layer's table words for a step of `seqs` at their lengths plus `ahead` (0: this
    /// step; 1: the next, drawn up while this one runs — attention layers only): an attention
    /// layer's row table (each row's position and its cache's layer addresses), a Gated DeltaNet
    /// layer's state table; layer `l`'s at `l · rows · 5`.
    fn row_table_words(&self, seqs: &[BatchSeq<'_>], ahead: usize) -> Result<Vec<u32>> {
        let n = seqs.len();
        let mut words = Vec::with_capacity(self.layers.len() * n * 5);
        for (layer, l) in self.layers.iter().enumerate() {
            if let Mixer::GatedDeltaNet(_) = l.mixer {
                for s in seqs {
                    let pos = (s.cache.len() + ahead) as u32;
                    let state = s.cache.recurrent_device().map(|d| d.table_row(layer, pos));
                    let Some(Some(row)) = state.transpose()? else { return Err(no_state(layer)) };
                    words.extend(row);
                }
                continue;
            }
            let mut table = gpu::RowTable::default();
            for s in seqs {
                let (k, v) = s.cache.layer_kv(layer)?;
                let kept = s.cache.table_words(layer)?;
                // SAFETY: `kept` is this cache's `address_words` (KvCache::table_words), and
                // the cache outlives the step.
                unsafe { table.push_words(s.cache.len() + ahead, 1, gpu::LayerKv { k, v }, kept) }?;
            }
            words.extend_from_slice(table.words());
        }
        Ok(words)
    }

    /// Views of the tables [`Self::write_row_tables`] wrote, one per layer: an attention layer's
    /// row table (positions at most `max`), a Gated DeltaNet layer's state table — what an
    /// eager run or a capture of the step launches with (a replay reads the buffer itself).
    fn row_table_views(
        &self,
        g: &BatchGraphs,
        seqs: &[BatchSeq<'_>],
        max: usize,
    ) -> Result<Vec<LayerRows>> {
        let n = seqs.len();
        let mut out = Vec::with_capacity(self.layers.len());
        for (layer, l) in self.layers.iter().enumerate() {
            let view = g.tables.narrow(0, layer * n * 5, n * 5)?.reshape((n, 5))?;
            out.push(match l.mixer {
                Mixer::GatedDeltaNet(_) => {
                    let d = seqs[0].cache.recurrent_device().ok_or_else(|| no_state(layer))?;
                    // SAFETY: every row holds `DeviceRecurrent::table_row` of one of this
                    // step's sequences (distinct caches), the address words of its live states
                    // of the model's shape; the caches outlive the step, and each capture or
                    // replay over the table comes after this step's rewrite of it.
                    LayerRows::States(unsafe { gpu::GdnStates::in_buffer(view, *d.shape()) }?)
                }
                Mixer::Attention(_) => {
                    let (k, v) = seqs[0].cache.layer_kv(layer)?;
                    LayerRows::Kv(Rows::in_buffer(view, max, gpu::LayerKv { k, v })?)
                }
            });
        }
        Ok(out)
    }

    /// A synthetic model's choice for this step ([`synthetic_choices`], recorded in each
    /// sequence's history) written into `g.chosen`: a view of its first entries; `None` for
    /// other models.
    fn write_batch_choice(
        &self,
        g: &mut BatchGraphs,
        seqs: &mut [BatchSeq<'_>],
        tokens: &[u32],
    ) -> Result<Option<Tensor>> {
        let pass: Vec<(usize, &[u32])> =
            seqs.iter().zip(tokens.chunks(1)).map(|(s, t)| (s.cache.len(), t)).collect();
        let ahead = Ahead::take_for(&mut g.choice_ahead, seqs);
        let mut caches: Vec<&mut KvCache> = seqs.iter_mut().map(|s| &mut *s.cache).collect();
        let Some(ids) = synthetic_choices(self, &mut caches, &pass, self.layers.len(), ahead)
        else {
            return Ok(None);
        };
        self.write_choice(&mut g.chosen, &ids, tokens.len()).map(Some)
    }
}

fn no_state(layer: usize) -> ModelError {
    ModelError::Candle(candle_core::Error::msg(format!(
        "batched step: layer {layer}'s recurrent state is not on the device"
    )))
}

/// Each sequence's result from a step's logits `[rows, vocab]` (on the device: greedy picks made
/// there — `picks`, when the graph made them — the other rows brought to the host in one copy,
/// [`super::pick::split_logits`]) and routing; every cache advances by its one token.
fn finish(
    seqs: &mut [BatchSeq<'_>],
    logits: &Tensor,
    picks: Option<&Tensor>,
    routing: Vec<crate::moe::LayerRouting>,
) -> Result<Vec<Result<ForwardOutput>>> {
    let rows: Vec<std::ops::Range<usize>> = (0..seqs.len()).map(|k| k..k + 1).collect();
    let modes: Vec<_> = seqs.iter().map(|s| s.logits).collect();
    let split = super::pick::split_logits(logits, picks, &rows, &modes)?;
    let mut out = Vec::with_capacity(seqs.len());
    for ((k, s), (logits, greedy)) in seqs.iter_mut().enumerate().zip(split) {
        s.cache.advance(1);
        let routing = routing.iter().map(|lr| slice_routing(lr, &(k..k + 1))).collect();
        out.push(Ok(ForwardOutput { logits, greedy, hidden_states: Vec::new(), routing }));
    }
    Ok(out)
}
