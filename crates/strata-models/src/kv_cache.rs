//! Preallocated KV cache: `[1, n_kv_heads, capacity, head_dim]` f32 per layer for K and V, written in
//! place. Rolling back (speculative decoding) only moves the length; storage is never reallocated.

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

thread_local! {
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[derive(Debug)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Allocates `2 · layers · kv_heads · capacity · head_dim · 4` bytes.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, capacity: usize, device: &Device) -> Result<Self> {
        let mk = || Tensor::zeros((1, kv_heads, capacity, head_dim), DType::F32, device);
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(mk()?);
            v.push(mk()?);
        }
        Ok(Self { k, v, len: 0, capacity })
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

    /// Writes `k, v: [1, kv_heads, n, head_dim]` of `layer` at positions `len..len+n` and returns
    /// views of positions `0..len+n`. [`KvCache::advance`] commits the `n` tokens after the last
    /// layer.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        self.k[layer].slice_set(&k.contiguous()?, 2, self.len)?;
        self.v[layer].slice_set(&v.contiguous()?, 2, self.len)?;
        let total = self.len + n;
        Ok((self.k[layer].narrow(2, 0, total)?, self.v[layer].narrow(2, 0, total)?))
    }

    /// Decode fast path (CPU): attention of one query `q: [n_heads · head_dim]` over positions
    /// `0..positions` of `layer` (decode: `len + 1`, the token just appended included); returns
    /// `[n_heads · head_dim]`. `None` when the cache is not on the CPU.
    pub fn attend_one(&self, layer: usize, q: &[f32], n_heads: usize, scale: f32, positions: usize) -> candle_core::Result<Option<Vec<f32>>> {
        let (ks, kl) = self.k[layer].storage_and_layout();
        let (vs, vl) = self.v[layer].storage_and_layout();
        let (candle_core::Storage::Cpu(kc), candle_core::Storage::Cpu(vc)) = (&*ks, &*vs) else { return Ok(None) };
        let k = &kc.as_slice::<f32>()?[kl.start_offset()..];
        let v = &vc.as_slice::<f32>()?[vl.start_offset()..];
        let (_, n_kv_heads, capacity, head_dim) = self.k[layer].dims4()?;
        let layout = strata_kernels::attention::KvLayout { n_kv_heads, capacity, head_dim };
        let mut out = vec![0f32; n_heads * head_dim];
        SCORES.with(|s| strata_kernels::attention::attend_one(q, k, v, layout, n_heads, positions, scale, &mut out, &mut s.borrow_mut()));
        Ok(Some(out))
    }

    /// Commits `n` appended tokens.
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Rolls back to `len` tokens (rejected draft tokens, a new prompt sharing a prefix). Storage
    /// is kept; positions past `len` are overwritten by the next append.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|t| t.elem_count() * 4).sum()
    }
}
