//! Per-sequence state: a preallocated KV cache (`[1, n_kv_heads, capacity, head_dim]` per
//! full-attention layer for K and V, f32 or f16 ([`KvDtype`]), written in place)
//! and, for hybrid models, the recurrent state of
//! the Gated DeltaNet layers ([`RecurrentCache`]). Rolling back (speculative decoding) moves the KV
//! length and restores the recurrent state from its checkpoint; storage is never reallocated.

use candle_core::{DType, Device, Tensor};
use strata_formats::ModelConfig;

use crate::error::{ModelError, Result};
use crate::recurrent::{LinearState, RecurrentCache, RecurrentSnapshot, StepLog};
use crate::synthetic_routing::{RoutingHistory, RoutingRows};

/// Element type of the KV cache's keys and values (`--kv-cache-dtype`; vLLM's
/// `--kv-cache-dtype`, llama.cpp's `-ctk`/`-ctv`). Attention computes in f32 either way; `F16`
/// rounds each key and value to nearest when it is written and halves the cache's bytes (the
/// CPU kernels widen it back to f32 as they load it; CUDA's decode attention likewise, its
/// prompt passes attend on f16 tensor cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
}

impl KvDtype {
    pub fn dtype(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::F16 => DType::F16,
        }
    }

    /// Bytes per key or value element.
    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            _ => Err(format!("KV cache dtype `{s}`: expected f32 or f16")),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        })
    }
}

/// A copy of a run of positions of one sequence's KV cache (see [`KvCache::export_block`]).
#[derive(Debug)]
pub struct KvBlock {
    kv: BlockKv,
    /// A synthetic model's routing choices and tokens at those positions.
    routing: Option<RoutingRows>,
    len: usize,
}

/// A block's keys and values.
#[derive(Debug)]
enum BlockKv {
    /// Per attention layer, `[1, kv_heads, len, head_dim]`.
    Layers { k: Vec<Tensor>, v: Vec<Tensor> },
    /// Every attention layer in one device tensor `[2 · layers, kv_heads, len, head_dim]` (layer
    /// 0's k, its v, layer 1's k, ...): copied in one launch ([`crate::gpu::GpuPath::KvSpan`]).
    #[cfg(feature = "cuda")]
    Span(Tensor),
}

impl BlockKv {
    fn bytes(&self) -> usize {
        match self {
            BlockKv::Layers { k, v } => k.iter().chain(v).map(tensor_bytes).sum(),
            #[cfg(feature = "cuda")]
            BlockKv::Span(t) => tensor_bytes(t),
        }
    }
}

impl KvBlock {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.kv.bytes() + self.routing.as_ref().map_or(0, RoutingRows::bytes)
    }
}

#[derive(Debug)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Layer → index into `k`/`v` (`None` for recurrent layers).
    slot: Vec<Option<usize>>,
    recurrent: RecurrentCache,
    /// A synthetic model's per-sequence routing choices ([`crate::synthetic_routing`]).
    routing: Option<RoutingHistory>,
    len: usize,
    capacity: usize,
    /// Unique among the caches this process made ([`Self::id`]).
    id: u64,
    /// The GPU graph path's state (`cuda` build): captured decode steps for this cache's
    /// tensors, and the device position its kernels read while one runs.
    #[cfg(feature = "cuda")]
    gpu: GpuState,
}

#[cfg(feature = "cuda")]
#[derive(Debug, Default)]
struct GpuState {
    graphs: Option<Box<crate::transformer::DecodeGraphs>>,
    position: Option<(Tensor, usize)>,
    /// Every attention layer's k and v addresses as row table words, by KV slot (taken once:
    /// the tensors never move).
    table_words: std::sync::OnceLock<Vec<[u32; 4]>>,
    /// The prefix cache's block copies over every layer in one launch (`None`: not taken,
    /// [`crate::gpu::GpuPath::KvSpan`]); set up at the first copy.
    span: std::sync::OnceLock<Option<strata_kernels::cuda::KvSpanTable>>,
}

/// The next [`KvCache::id`].
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes of a tensor's elements.
fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// A layer's key and value storage on the host (from `start` offsets `ko`, `vo`) as the CPU
/// kernels take it. Errors: an element type other than f32 or f16.
fn cpu_storage<'a>(
    k: &'a candle_core::CpuStorage,
    ko: usize,
    v: &'a candle_core::CpuStorage,
    vo: usize,
) -> candle_core::Result<strata_kernels::attention::KvStorage<'a>> {
    use candle_core::backend::BackendStorage;
    use strata_kernels::attention::KvStorage;
    Ok(match k.dtype() {
        DType::F16 => KvStorage::F16 {
            k: &k.as_slice::<half::f16>()?[ko..],
            v: &v.as_slice::<half::f16>()?[vo..],
        },
        _ => KvStorage::F32 { k: &k.as_slice::<f32>()?[ko..], v: &v.as_slice::<f32>()?[vo..] },
    })
}

/// [`KvCache::write_rows`]' in-place write of one of a layer's tensors `[1, heads, capacity,
/// head_dim]`: `src: [n, heads, head_dim]` at positions `pos..pos + n`.
struct RowsWrite<'a> {
    src: &'a [f32],
    n: usize,
    pos: usize,
}

impl candle_core::InplaceOp1 for RowsWrite<'_> {
    fn name(&self) -> &'static str {
        "kv-write-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (_, heads, capacity, hd) = layout.shape().dims4()?;
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("kv-write-rows: the cache is not contiguous");
        };
        if self.src.len() != self.n * heads * hd || self.pos + self.n > capacity {
            candle_core::bail!(
                "kv-write-rows: {} values for {} rows of {heads}×{hd} at {} (capacity {capacity})",
                self.src.len(),
                self.n,
                self.pos
            );
        }
        fn put<T: Copy>(
            dst: &mut [T],
            w: &RowsWrite<'_>,
            (heads, capacity, hd): (usize, usize, usize),
            conv: impl Fn(f32) -> T,
        ) {
            for i in 0..w.n {
                for h in 0..heads {
                    let from = &w.src[(i * heads + h) * hd..][..hd];
                    let to = &mut dst[(h * capacity + w.pos + i) * hd..][..hd];
                    for (d, &x) in to.iter_mut().zip(from) {
                        *d = conv(x);
                    }
                }
            }
        }
        let dims = (heads, capacity, hd);
        match storage {
            candle_core::CpuStorage::F32(d) => put(&mut d[start..], self, dims, |x| x),
            candle_core::CpuStorage::F16(d) => {
                put(&mut d[start..], self, dims, half::f16::from_f32)
            }
            _ => candle_core::bail!("kv-write-rows: a cache neither f32 nor f16"),
        }
        Ok(())
    }
}

impl KvCache {
    /// Allocates `2 · attention_layers · kv_heads · capacity · head_dim · 4` bytes of f32 KV
    /// cache and [`ModelConfig::recurrent_state_bytes`] of recurrent state.
    pub fn new(cfg: &ModelConfig, capacity: usize, device: &Device) -> Result<Self> {
        Self::with_dtype(cfg, capacity, device, KvDtype::F32)
    }

    /// [`Self::new`] with keys and values held as `dtype` (`dtype.bytes()` per element).
    ///
    /// Errors: the allocation fails.
    pub fn with_dtype(
        cfg: &ModelConfig,
        capacity: usize,
        device: &Device,
        dtype: KvDtype,
    ) -> Result<Self> {
        let mk =
            || Tensor::zeros((1, cfg.num_kv_heads, capacity, cfg.head_dim), dtype.dtype(), device);
        let (mut k, mut v, mut slot) = (Vec::new(), Vec::new(), Vec::with_capacity(cfg.num_layers));
        for i in 0..cfg.num_layers {
            if cfg.is_recurrent_layer(i) {
                slot.push(None);
            } else {
                slot.push(Some(k.len()));
                k.push(mk()?);
                v.push(mk()?);
            }
        }
        let routing = cfg
            .moe
            .as_ref()
            .filter(|m| m.synthetic_routing.is_some())
            .map(|m| RoutingHistory::new(cfg.num_layers, m.experts_per_token));
        Ok(Self {
            k,
            v,
            slot,
            recurrent: RecurrentCache::on_device(cfg.linear_attn.as_ref(), device)?,
            routing,
            len: 0,
            capacity,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            #[cfg(feature = "cuda")]
            gpu: GpuState::default(),
        })
    }

    /// A number no other cache made by this process has: tells a cache from one made later in
    /// its place (at the same address, with the same length).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The position the GPU kernels read from the device, and the largest it may hold, while a
    /// graph-captured decode step runs (`None` otherwise: the position is `len()`).
    #[cfg(feature = "cuda")]
    pub fn device_position(&self) -> Option<(&Tensor, usize)> {
        self.gpu.position.as_ref().map(|(t, m)| (t, *m))
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn set_device_position(&mut self, p: Option<(Tensor, usize)>) {
        self.gpu.position = p;
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn take_graphs(&mut self) -> Option<Box<crate::transformer::DecodeGraphs>> {
        self.gpu.graphs.take()
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn put_graphs(&mut self, g: Box<crate::transformer::DecodeGraphs>) {
        self.gpu.graphs = Some(g);
    }

    /// Whether the sequence carries a synthetic model's routing history (its routers then choose
    /// on the host, from that history).
    pub fn has_routing_history(&self) -> bool {
        self.routing.is_some()
    }

    /// The routing history of a synthetic model's routers (`None` for every other model).
    pub fn routing_history_mut(&mut self) -> Option<&mut RoutingHistory> {
        self.routing.as_mut()
    }

    /// Layer `layer`'s recurrent state and, while a checkpoint is held, its update log.
    pub fn recurrent_mut(
        &mut self,
        layer: usize,
    ) -> Option<(&mut LinearState, Option<&mut StepLog>)> {
        self.recurrent.layer_mut(layer)
    }

    /// The recurrent state on the GPU, when this sequence keeps it there (`cuda` build).
    #[cfg(feature = "cuda")]
    pub fn recurrent_device(&self) -> Option<&crate::recurrent::device::DeviceRecurrent> {
        self.recurrent.device()
    }

    /// The recurrent state on the GPU, when this sequence keeps it there (`cuda` build).
    #[cfg(feature = "cuda")]
    pub fn recurrent_device_mut(
        &mut self,
    ) -> Option<&mut crate::recurrent::device::DeviceRecurrent> {
        self.recurrent.device_mut()
    }

    /// Marks the current length as a position [`Self::rollback`] can return to, with every
    /// position after it (copies the recurrent state; free for attention-only models).
    pub fn checkpoint(&mut self) {
        self.recurrent.checkpoint(self.len);
    }

    /// Ends the checkpoint's logging (the end of a speculative round); see [`RecurrentCache::release`].
    pub fn release_checkpoint(&mut self) {
        self.recurrent.release();
    }

    /// Sequence length of the active checkpoint of a hybrid model's recurrent state, if any.
    pub fn checkpoint_len(&self) -> Option<usize> {
        self.recurrent.checkpoint_len()
    }

    /// Rolls back to `len` tokens: the KV length moves, recurrent state is restored from the
    /// checkpoint and replayed. Errors (`ModelError::Rollback`, state unchanged) when recurrent
    /// state would be needed from before the checkpoint.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        if let Err(checkpoint) = self.recurrent.rollback(len, self.len) {
            return Err(ModelError::Rollback { to: len, checkpoint });
        }
        self.len = self.len.min(len);
        Ok(())
    }

    /// Forgets the tokens past `len` (later passes overwrite their KV entries); a recurrent state
    /// stays as it is — for a pass that failed after advancing this cache, whose sequence is
    /// then cleared or discarded (restoring the state needs a checkpoint: [`Self::rollback`]).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Tokens currently cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Fails if `n` more tokens do not fit.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.len + n > self.capacity {
            return Err(ModelError::ContextFull { needed: self.len + n, capacity: self.capacity });
        }
        Ok(())
    }

    /// Writes `k, v: [1, kv_heads, n, head_dim]` (f32) of `layer` at positions `len..len+n`
    /// (rounded to the cache's [`KvDtype`]) and returns positions `0..len+n` in f32: views of an
    /// f32 cache, copies of an f16 one. [`KvCache::advance`] commits the `n` tokens after the
    /// last layer.
    pub fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        self.write(layer, k, v)?;
        let (s, total) = (self.kv_slot(layer)?, self.len + k.dim(2)?);
        let read = |t: &Tensor| t.narrow(2, 0, total)?.to_dtype(DType::F32);
        Ok((read(&self.k[s])?, read(&self.v[s])?))
    }

    /// [`Self::append`] without reading the cache back (the CPU kernels read its storage).
    pub fn write(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> candle_core::Result<()> {
        let s = self.kv_slot(layer)?;
        let dtype = self.k[s].dtype();
        self.k[s].slice_set(&k.to_dtype(dtype)?.contiguous()?, 2, self.len)?;
        self.v[s].slice_set(&v.to_dtype(dtype)?.contiguous()?, 2, self.len)
    }

    /// [`Self::write`] from host rows: `k, v: [n, n_kv_heads, head_dim]` (row-major f32, a CPU
    /// batch's rows of this sequence) written at positions `len()..len() + n` of `layer`, each
    /// value converted to the cache's element type as [`Self::write`] converts it (f16: rounded to
    /// nearest) — without building `[1, heads, n, head_dim]` tensors first.
    ///
    /// Errors: the layer has no KV cache; the cache is not on the CPU; `k` or `v` is not
    /// `n · n_kv_heads · head_dim` long; the rows pass the capacity.
    pub fn write_rows(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        n: usize,
    ) -> candle_core::Result<()> {
        let s = self.kv_slot(layer)?;
        for (dst, src) in [(&self.k[s], k), (&self.v[s], v)] {
            dst.inplace_op1(&RowsWrite { src, n, pos: self.len })?;
        }
        Ok(())
    }

    /// `layer`'s k and v device addresses as row table words
    /// ([`strata_kernels::cuda::LayerKv::address_words`]), taken for every layer at the first
    /// call and kept (`cuda` build).
    ///
    /// Errors: the layer has no KV cache; the cache is not on a CUDA device.
    #[cfg(feature = "cuda")]
    pub fn table_words(&self, layer: usize) -> candle_core::Result<[u32; 4]> {
        let s = self.kv_slot(layer)?;
        if self.gpu.table_words.get().is_none() {
            let words = self
                .k
                .iter()
                .zip(&self.v)
                .map(|(k, v)| strata_kernels::cuda::LayerKv { k, v }.address_words())
                .collect::<candle_core::Result<Vec<_>>>()?;
            let _ = self.gpu.table_words.set(words);
        }
        Ok(self.gpu.table_words.get().expect("set above")[s])
    }

    /// Layer `layer`'s key and value storage `[1, n_kv_heads, capacity, head_dim]` (f32, or f16
    /// for a [`KvDtype::F16`] cache), for
    /// kernels that write positions `len()..` in place and read them (the GPU decode path).
    /// Errors: the layer has no KV cache (a recurrent layer).
    pub fn layer_kv(&self, layer: usize) -> candle_core::Result<(&Tensor, &Tensor)> {
        let s = self.kv_slot(layer)?;
        Ok((&self.k[s], &self.v[s]))
    }

    fn kv_slot(&self, layer: usize) -> candle_core::Result<usize> {
        self.slot
            .get(layer)
            .copied()
            .flatten()
            .ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} has no KV cache")))
    }

    /// CPU attention of a prompt pass (more than [`crate::EXACT_ROWS_MAX`] rows):
    /// `q: [seq, n_heads · head_dim]` of `layer`, row `i` over positions `0..first + i` (the
    /// tokens just appended included), by the blocked kernel
    /// (`strata_kernels::attention_prefill`); returns `[seq, n_heads · head_dim]`. Shorter passes
    /// (decode, verify) go through [`Self::attend_sequences`]. `None` when the cache is not on
    /// the CPU.
    pub fn attend_prefill(
        &self,
        layer: usize,
        q: &[f32],
        seq: usize,
        n_heads: usize,
        scale: f32,
        first: usize,
    ) -> candle_core::Result<Option<Vec<f32>>> {
        let (ks, ko, vs, vo, layout) = self.layer_storage(layer)?;
        let (candle_core::Storage::Cpu(kc), candle_core::Storage::Cpu(vc)) = (&*ks, &*vs) else {
            return Ok(None);
        };
        let cache = cpu_storage(kc, ko, vc, vo)?;
        let mut out = vec![0f32; seq * n_heads * layout.head_dim];
        strata_kernels::attention_prefill::attend_prefill(
            q, cache, layout, n_heads, seq, first, scale, &mut out,
        );
        Ok(Some(out))
    }

    /// Layer `layer`'s key and value storage (read guards and start offsets) and its layout.
    #[allow(clippy::type_complexity)]
    fn layer_storage(
        &self,
        layer: usize,
    ) -> candle_core::Result<(
        impl std::ops::Deref<Target = candle_core::Storage> + '_,
        usize,
        impl std::ops::Deref<Target = candle_core::Storage> + '_,
        usize,
        strata_kernels::attention::KvLayout,
    )> {
        let s = self.kv_slot(layer)?;
        let (ks, kl) = self.k[s].storage_and_layout();
        let (vs, vl) = self.v[s].storage_and_layout();
        let (_, n_kv_heads, capacity, head_dim) = self.k[s].dims4()?;
        let layout = strata_kernels::attention::KvLayout { n_kv_heads, capacity, head_dim };
        Ok((ks, kl.start_offset(), vs, vl.start_offset(), layout))
    }

    /// CPU attention of several sequences' short passes (up to [`crate::EXACT_ROWS_MAX`] rows
    /// each: decode rows, verify passes, a continuous batch's decode rows) in one parallel region
    /// (`strata_kernels::attention::attend_sequences`): `seqs[i] = (cache, q, first)` with
    /// `q: [seq_i, n_heads · head_dim]`, row `j` over positions `0..first + j` of `cache`'s
    /// `layer`. Returns `[Σ seq_i, n_heads · head_dim]`; every row's arithmetic is the same
    /// whatever the batch, so a verify pass equals decoding its tokens one by one and a batched
    /// sequence equals itself alone. `None` when a cache is not on the CPU.
    pub fn attend_sequences(
        layer: usize,
        seqs: &[(&KvCache, &[f32], usize)],
        n_heads: usize,
        scale: f32,
    ) -> candle_core::Result<Option<Vec<f32>>> {
        use strata_kernels::attention::SeqAttend;
        let guards = seqs
            .iter()
            .map(|(c, _, _)| c.layer_storage(layer))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut items = Vec::with_capacity(seqs.len());
        let mut rows = 0;
        for ((_, q, first), (ks, ko, vs, vo, kv)) in seqs.iter().zip(&guards) {
            let (candle_core::Storage::Cpu(kc), candle_core::Storage::Cpu(vc)) = (&**ks, &**vs)
            else {
                return Ok(None);
            };
            let seq = q.len() / (n_heads * kv.head_dim);
            if seq > crate::attention::EXACT_ROWS_MAX {
                candle_core::bail!("attend_sequences takes passes of at most EXACT_ROWS_MAX rows");
            }
            rows += seq;
            items.push(SeqAttend {
                q,
                cache: cpu_storage(kc, *ko, vc, *vo)?,
                kv: *kv,
                seq,
                first_len: *first,
            });
        }
        let hd = guards.first().map_or(0, |g| g.4.head_dim);
        let mut out = vec![0f32; rows * n_heads * hd];
        strata_kernels::attention::attend_sequences(&items, n_heads, scale, &mut out);
        Ok(Some(out))
    }

    /// A copy of positions `start..start + len` of every attention layer's keys and values (and a
    /// synthetic model's routing history there): a block of a prefix cache. Errors when the
    /// range is not cached.
    pub fn export_block(&self, start: usize, len: usize) -> Result<KvBlock> {
        if start + len > self.len {
            return Err(ModelError::ContextFull { needed: start + len, capacity: self.len });
        }
        let routing = self.routing.as_ref().map(|h| h.rows(start, len));
        #[cfg(feature = "cuda")]
        if let Some(span) = self.span() {
            let kv = BlockKv::Span(span.export(start, len)?);
            return Ok(KvBlock { kv, routing, len });
        }
        let copy = |t: &Tensor| t.narrow(2, start, len).and_then(|t| t.force_contiguous());
        let k = self.k.iter().map(copy).collect::<candle_core::Result<Vec<_>>>()?;
        let v = self.v.iter().map(copy).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(KvBlock { kv: BlockKv::Layers { k, v }, routing, len })
    }

    /// The table that copies a block of every attention layer in one launch
    /// ([`crate::gpu::GpuPath::KvSpan`] on, caches the kernel takes); `None` otherwise.
    #[cfg(feature = "cuda")]
    fn span(&self) -> Option<&strata_kernels::cuda::KvSpanTable> {
        use strata_kernels::cuda::{KvSpanTable, LayerKv};
        self.gpu
            .span
            .get_or_init(|| {
                let layers: Vec<LayerKv<'_>> =
                    self.k.iter().zip(&self.v).map(|(k, v)| LayerKv { k, v }).collect();
                // `new` refuses caches the kernel does not take (kv_span_supports).
                crate::gpu::enabled(crate::gpu::GpuPath::KvSpan)
                    .then(|| KvSpanTable::new(&layers).ok())
                    .flatten()
            })
            .as_ref()
    }

    /// Starts a new sequence from a cached prefix: `blocks` back to back from position 0, then
    /// the recurrent state after the last of them (hybrid models need it: their state is not
    /// in the blocks). The length becomes the blocks' total. Errors when they do not fit or do
    /// not match this model's layers.
    pub fn import_prefix(
        &mut self,
        blocks: &[&KvBlock],
        recurrent: Option<&RecurrentSnapshot>,
    ) -> Result<()> {
        self.clear();
        let total: usize = blocks.iter().map(|b| b.len).sum();
        self.check_room(total)?;
        let mut pos = 0;
        for b in blocks {
            match &b.kv {
                BlockKv::Layers { k, v } => {
                    if k.len() != self.k.len() || v.len() != self.v.len() {
                        return Err(
                            candle_core::Error::msg("a prefix block of another model").into()
                        );
                    }
                    for (dst, src) in self.k.iter().zip(k).chain(self.v.iter().zip(v)) {
                        dst.slice_set(src, 2, pos)?;
                    }
                }
                #[cfg(feature = "cuda")]
                // (`import` refuses a block of another layer count or shape.)
                BlockKv::Span(t) => {
                    let span = self.span().ok_or_else(|| {
                        candle_core::Error::msg(
                            "a device prefix block for a cache that cannot take it",
                        )
                    })?;
                    span.import(t, pos)?;
                }
            }
            if let (Some(h), Some(rows)) = (self.routing.as_mut(), &b.routing) {
                h.set_rows(pos, rows);
            }
            pos += b.len;
        }
        match recurrent {
            Some(r) => self.recurrent.restore(r),
            None if self.recurrent.is_active() && total > 0 => {
                return Err(candle_core::Error::msg(
                    "a hybrid model's prefix needs its recurrent state",
                )
                .into())
            }
            None => {}
        }
        self.len = total;
        Ok(())
    }

    /// Sets the recurrent state to `snap` (made by [`Self::snapshot_recurrent`] on this model),
    /// the length unchanged; drops a checkpoint.
    pub fn restore_recurrent(&mut self, snap: &RecurrentSnapshot) {
        self.recurrent.restore(snap);
    }

    /// A copy of the recurrent state now (`None` for attention-only models).
    pub fn snapshot_recurrent(&self) -> Option<RecurrentSnapshot> {
        self.recurrent.snapshot()
    }

    /// Commits `n` appended tokens.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// A new sequence: length 0, recurrent state zeroed.
    pub fn clear(&mut self) {
        self.len = 0;
        self.recurrent.clear();
    }

    /// Bytes allocated (KV cache, recurrent state and its checkpoint).
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(tensor_bytes).sum::<usize>()
            + self.recurrent.bytes()
            + self.routing.as_ref().map_or(0, RoutingHistory::bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::{KvDtype, RowsWrite};
    use candle_core::{DType, Device, Tensor};

    /// `KvCache::write_rows`' in-place write of host rows `[n, heads, hd]` leaves a layer's
    /// tensor with the bits `KvCache::write`'s `slice_set` of the same rows as `[1, heads, n, hd]`
    /// (converted by `to_dtype`) leaves, f32 and f16, at a position past 0; rows past the
    /// capacity or of the wrong length are refused.
    #[test]
    fn rows_written_in_place_equal_slice_set() {
        let (heads, cap, hd, n, pos) = (3, 10, 8, 4, 5);
        let rows: Vec<f32> =
            (0..n * heads * hd).map(|i| ((i * 29 % 97) as f32 - 48.0) * 0.0137).collect();
        for dtype in [DType::F32, DType::F16] {
            let dev = Device::Cpu;
            let got = Tensor::zeros((1, heads, cap, hd), dtype, &dev).unwrap();
            got.inplace_op1(&RowsWrite { src: &rows, n, pos }).unwrap();
            let want = Tensor::zeros((1, heads, cap, hd), dtype, &dev).unwrap();
            let src = Tensor::from_vec(rows.clone(), (n, heads, hd), &dev).unwrap();
            let src = src.transpose(0, 1).unwrap().unsqueeze(0).unwrap();
            let src = src.to_dtype(dtype).unwrap().contiguous().unwrap();
            want.slice_set(&src, 2, pos).unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let (g, w) =
                (bits(&got).to_vec1::<f32>().unwrap(), bits(&want).to_vec1::<f32>().unwrap());
            assert_eq!(g, w, "{dtype:?}");
            assert!(got.inplace_op1(&RowsWrite { src: &rows, n, pos: cap - n + 1 }).is_err());
            assert!(got.inplace_op1(&RowsWrite { src: &rows[1..], n, pos }).is_err());
        }
    }

    #[test]
    fn kv_dtype_parses_what_it_prints_and_refuses_other_types() {
        for d in [KvDtype::F32, KvDtype::F16] {
            assert_eq!(d.to_string().parse::<KvDtype>(), Ok(d));
            assert_eq!(d.to_string().to_uppercase().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!(KvDtype::F16.bytes() * 2, KvDtype::F32.bytes());
        for bad in ["bf16", "q8_0", "", "f64"] {
            let err = bad.parse::<KvDtype>().unwrap_err();
            assert!(err.contains("expected f32 or f16"), "{err}");
        }
    }
}
