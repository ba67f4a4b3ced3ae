//! CPU attention of a continuous batch's short passes (decode rows, short verify passes): the
//! q/k norms and RoPE once over every sequence's rows, each sequence's keys and values written to
//! its own cache, then one parallel region over all sequences
//! (`strata_kernels::attention::attend_sequences`) — instead of a dozen tensor ops and one
//! barrier per sequence and layer.

use candle_core::Tensor;

use super::{Attention, SeqPart, EXACT_ROWS_MAX};
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::rope::RotaryEmbedding;

impl Attention {
    /// Projections `q: [rows, nh·hd]`, `k, v: [rows, nkv·hd]` of every part's rows (parts in
    /// row order, part `s` at positions `parts[s].cache.len()..` of its own cache) →
    /// `[rows, nh·hd]` (before the output projection), keys and values written to each cache.
    /// Every row's result equals attending its sequence alone, and a multi-row pass equals
    /// decoding its tokens one by one (`KvCache::attend_sequences`). `None`: not on the CPU, or a part longer than
    /// [`EXACT_ROWS_MAX`] rows (a prompt chunk: attended per sequence by the blocked kernel).
    pub(super) fn attend_short_cpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        layer: usize,
        parts: &mut [SeqPart<'_>],
        rope: &RotaryEmbedding,
    ) -> Result<Option<Tensor>> {
        let rows = q.dim(0)?;
        let mut next = 0;
        let short = parts.iter().all(|p| {
            let ok = p.rows.start == next && p.rows.len() <= EXACT_ROWS_MAX;
            next = p.rows.end;
            ok
        });
        if !q.device().is_cpu() || !short || next != rows {
            return Ok(None);
        }
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let mut pos: Vec<u32> = Vec::with_capacity(rows);
        for p in parts.iter() {
            let len = p.cache.len();
            pos.extend((len..len + p.rows.len()).map(|i| i as u32));
        }
        // Host rows [rows, heads, hd] (row-major: each row's heads side by side), rotated in
        // place, written to each cache and read by the kernel in that layout.
        let heads = |t: &Tensor, n: usize, norm: &Option<_>| -> candle_core::Result<Vec<f32>> {
            self.split_heads(t, n, norm)?.flatten_all()?.to_vec1::<f32>()
        };
        let mut qv = heads(q, nh, &self.q_norm)?;
        let mut kv = heads(k, nkv, &self.k_norm)?;
        let vv = heads(v, nkv, &None)?;
        rope.rotate_rows(&mut qv, nh, hd, &pos)?;
        rope.rotate_rows(&mut kv, nkv, hd, &pos)?;
        let kw = nkv * hd;
        for p in parts.iter_mut() {
            let r = p.rows.start * kw..p.rows.end * kw;
            p.cache.write_rows(layer, &kv[r.clone()], &vv[r], p.rows.len())?;
        }
        let width = nh * hd; // [rows, nh, hd] row-major
        let seqs: Vec<(&KvCache, &[f32], usize)> = parts
            .iter()
            .map(|p| {
                let q = &qv[p.rows.start * width..p.rows.end * width];
                (&*p.cache, q, p.cache.len() + 1)
            })
            .collect();
        let Some(out) = KvCache::attend_sequences(layer, &seqs, nh, self.scale as f32)? else {
            return Ok(None);
        };
        Ok(Some(Tensor::from_vec(out, (rows, width), q.device())?))
    }
}
