//! Prefix caching: the KV entries of finished sequences, kept in blocks of `block` tokens keyed by
//! the hash of every token up to the block's end (the hash chain of vLLM's automatic prefix
//! caching, Kwon et al. 2023 / vLLM `core/block/prefix_caching_block.py`; llama-server's
//! `cache_prompt` keeps one prompt per slot instead). A new sequence copies the longest cached
//! prefix of its prompt into its own KV cache and prefills only the rest.
//!
//! Hybrid models (Gated DeltaNet) carry recurrent state that no block holds: a block is usable as
//! a prefix's end only when a snapshot of the state after it was kept with it (the batch
//! scheduler takes one at the last block boundary inside each prompt).
//!
//! Blocks are evicted least recently used first, deepest first among equals (a chain's tail goes
//! before its head), under a byte budget.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use strata_models::{KvBlock, KvCache, RecurrentSnapshot};

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Sequences that looked for a prefix.
    pub lookups: u64,
    /// Of those, sequences that found one.
    pub hits: u64,
    /// Prompt tokens not prefilled thanks to a hit.
    pub reused_tokens: u64,
    /// Blocks dropped for room.
    pub evicted_blocks: u64,
    /// Bytes held now.
    pub bytes: u64,
}

struct Entry {
    parent: u64,
    depth: usize,
    tokens: Vec<u32>,
    kv: Arc<KvBlock>,
    recurrent: Option<Arc<RecurrentSnapshot>>,
    last_use: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.kv.bytes() + self.recurrent.as_ref().map_or(0, |r| r.bytes())
    }
}

/// A prefix found by [`PrefixCache::lookup`]: import it with [`KvCache::import_prefix`].
pub struct PrefixHit {
    pub blocks: Vec<Arc<KvBlock>>,
    pub recurrent: Option<Arc<RecurrentSnapshot>>,
    /// Tokens the blocks cover.
    pub tokens: usize,
}

impl PrefixHit {
    /// Copies the prefix into `cache` (cleared first).
    pub fn import(&self, cache: &mut KvCache) -> strata_models::Result<()> {
        let blocks: Vec<&KvBlock> = self.blocks.iter().map(Arc::as_ref).collect();
        cache.import_prefix(&blocks, self.recurrent.as_deref())
    }
}

/// KV blocks of earlier sequences under a byte budget.
pub struct PrefixCache {
    block: usize,
    budget: usize,
    used: usize,
    entries: HashMap<u64, Entry>,
    tick: u64,
    stats: PrefixStats,
}

/// The hash of the chain up to and including `tokens`, after the chain `parent`.
fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

const ROOT: u64 = 0;

impl PrefixCache {
    /// `block`: tokens per block (at least 1); `budget`: bytes held at most.
    pub fn new(block: usize, budget: usize) -> Self {
        Self {
            block: block.max(1),
            budget,
            used: 0,
            entries: HashMap::new(),
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block(&self) -> usize {
        self.block
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats { bytes: self.used as u64, ..self.stats }
    }

    /// The longest cached prefix of `prompt` a new sequence can start from: whole blocks, at
    /// most `prompt.len() − 1` tokens (the last prompt token must run to give logits), ending at
    /// a block with a recurrent snapshot when `hybrid`.
    pub fn lookup(&mut self, prompt: &[u32], hybrid: bool) -> Option<PrefixHit> {
        self.stats.lookups += 1;
        self.tick += 1;
        let usable = prompt.len().saturating_sub(1) / self.block;
        let mut parent = ROOT;
        let mut chain: Vec<u64> = Vec::new();
        for b in 0..usable {
            let tokens = &prompt[b * self.block..(b + 1) * self.block];
            let h = chain_hash(parent, tokens);
            match self.entries.get(&h) {
                Some(e) if e.parent == parent && e.tokens == tokens => chain.push(h),
                _ => break,
            }
            parent = h;
        }
        if hybrid {
            while let Some(&h) = chain.last() {
                if self.entries[&h].recurrent.is_some() {
                    break;
                }
                chain.pop();
            }
        }
        if chain.is_empty() {
            return None;
        }
        let tick = self.tick;
        let mut blocks = Vec::with_capacity(chain.len());
        for h in &chain {
            let e = self.entries.get_mut(h).expect("chained entry");
            e.last_use = tick;
            blocks.push(e.kv.clone());
        }
        let recurrent = self.entries[chain.last().expect("non-empty")].recurrent.clone();
        let tokens = chain.len() * self.block;
        self.stats.hits += 1;
        self.stats.reused_tokens += tokens as u64;
        Some(PrefixHit { blocks, recurrent, tokens })
    }

    /// Keeps the whole blocks of `tokens` (the sequence's tokens whose entries `cache` holds, from
    /// position 0) that are not cached yet, and `recurrent` — the state after position `p`, a
    /// block boundary — with the block ending there. Blocks that do not fit the budget after
    /// evicting older ones are not kept. Errors: `cache` does not hold those positions.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        cache: &KvCache,
        recurrent: Option<(usize, RecurrentSnapshot)>,
    ) -> strata_models::Result<()> {
        self.tick += 1;
        let n = tokens.len().min(cache.len()) / self.block;
        let mut recurrent = recurrent.filter(|(p, _)| *p > 0 && p % self.block == 0);
        let mut parent = ROOT;
        for b in 0..n {
            let span = &tokens[b * self.block..(b + 1) * self.block];
            let h = chain_hash(parent, span);
            let snap = match &recurrent {
                Some((p, _)) if *p == (b + 1) * self.block => recurrent.take().map(|(_, s)| s),
                _ => None,
            };
            match self.entries.get_mut(&h) {
                Some(e) if e.parent == parent && e.tokens == span => {
                    e.last_use = self.tick;
                    if let (None, Some(s)) = (&e.recurrent, snap) {
                        let extra = s.bytes();
                        e.recurrent = Some(Arc::new(s));
                        self.used += extra;
                    }
                }
                Some(_) => return Ok(()), // a hash collision: keep the older chain
                None => {
                    let kv = cache.export_block(b * self.block, self.block)?;
                    let entry = Entry {
                        parent,
                        depth: b,
                        tokens: span.to_vec(),
                        kv: Arc::new(kv),
                        recurrent: snap.map(Arc::new),
                        last_use: self.tick,
                    };
                    let size = entry.bytes();
                    if !self.make_room(size) {
                        return Ok(());
                    }
                    self.used += size;
                    self.entries.insert(h, entry);
                }
            }
            parent = h;
        }
        self.evict_to_budget();
        Ok(())
    }

    /// Evicts until `size` more bytes fit; false when they cannot (larger than the budget, or
    /// only blocks used by this very insertion are left).
    fn make_room(&mut self, size: usize) -> bool {
        while self.used + size > self.budget {
            if !self.evict_one(self.tick) {
                return false;
            }
        }
        true
    }

    fn evict_to_budget(&mut self) {
        while self.used > self.budget && self.evict_one(u64::MAX) {}
    }

    /// Drops the least recently used block (deepest first) used before `before`.
    fn evict_one(&mut self, before: u64) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| e.last_use < before)
            .min_by_key(|(_, e)| (e.last_use, std::cmp::Reverse(e.depth)))
            .map(|(&h, _)| h);
        match victim.and_then(|h| self.entries.remove(&h)) {
            Some(e) => {
                self.used -= e.bytes();
                self.stats.evicted_blocks += 1;
                true
            }
            None => false,
        }
    }
}
