//! Rotary position embeddings (Su et al. 2021, RoFormer) with the frequency scalings of transformers'
//! `modeling_rope_utils.py`: linear, YaRN (`_compute_yarn_parameters`) and Llama 3
//! (`_compute_llama3_parameters`).

use candle_core::{Device, Tensor, D};
use strata_formats::{RopeScaling, RopeStyle};

/// Precomputed cos/sin tables `[max_positions, rope_dim / 2]`.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    cos: Tensor,
    sin: Tensor,
    rope_dim: usize,
    style: RopeStyle,
}

/// Inverse frequencies `[rope_dim / 2]` and the attention (magnitude) factor.
pub fn inv_freq(theta: f64, rope_dim: usize, scaling: &RopeScaling) -> (Vec<f64>, f64) {
    let half = rope_dim / 2;
    let base: Vec<f64> =
        (0..half).map(|i| 1.0 / theta.powf(2.0 * i as f64 / rope_dim as f64)).collect();
    match *scaling {
        RopeScaling::None => (base, 1.0),
        RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let old = original_max_position as f64;
            let low_wl = old / low_freq_factor;
            let high_wl = old / high_freq_factor;
            let f = base
                .iter()
                .map(|&freq| {
                    let wl = 2.0 * std::f64::consts::PI / freq;
                    if wl < high_wl {
                        freq
                    } else if wl > low_wl {
                        freq / factor
                    } else {
                        let smooth =
                            (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect();
            (f, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            attention_factor,
        } => {
            let d = rope_dim as f64;
            let corr = |rot: f64| {
                (d * (original_max_position as f64 / (rot * 2.0 * std::f64::consts::PI)).ln())
                    / (2.0 * theta.ln())
            };
            let low = corr(beta_fast).floor().max(0.0);
            let high = corr(beta_slow).ceil().min(d - 1.0);
            let high = if (high - low).abs() < f64::EPSILON { high + 0.001 } else { high };
            let f = base
                .iter()
                .enumerate()
                .map(|(i, &extra)| {
                    let inter = extra / factor;
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extra_factor = 1.0 - ramp;
                    inter * (1.0 - extra_factor) + extra * extra_factor
                })
                .collect();
            let mscale = attention_factor.unwrap_or(if factor > 1.0 {
                0.1 * factor.ln() + 1.0
            } else {
                1.0
            });
            (f, mscale)
        }
    }
}

impl RotaryEmbedding {
    pub fn new(
        theta: f64,
        rope_dim: usize,
        scaling: &RopeScaling,
        style: RopeStyle,
        max_positions: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let (freqs, mscale) = inv_freq(theta, rope_dim, scaling);
        let half = rope_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &freqs {
                let a = p as f64 * f;
                cos.push((a.cos() * mscale) as f32);
                sin.push((a.sin() * mscale) as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_positions, half), device)?,
            sin: Tensor::from_vec(sin, (max_positions, half), device)?,
            rope_dim,
            style,
        })
    }

    /// The cos and sin tables `[max_positions, rope_dim / 2]` and the pair layout (the GPU
    /// kernels apply them themselves).
    pub fn tables(&self) -> (&Tensor, &Tensor, RopeStyle) {
        (&self.cos, &self.sin, self.style)
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rotates `x: [1, heads, seq, head_dim]` for positions `pos..pos+seq`.
    pub fn apply(&self, x: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        let seq = x.dim(2)?;
        self.rotate(x, &self.cos.narrow(0, pos, seq)?, &self.sin.narrow(0, pos, seq)?)
    }

    /// Rotates host rows `x: [rows, heads, head_dim]` (row-major f32) in place, row `i` for
    /// position `positions[i]` (the rows of several sequences in one call: a CPU batch's decode
    /// rows). Each row's result equals [`Self::apply`] at that position, bit for bit: the same
    /// products and sums as candle's `rope` / `rope_i`, in one serial loop over the few rows
    /// (candle's kernel spreads a multi-row call over rayon's pool, whose wake-ups took ~10% of a
    /// CPU batch step beside our own pool).
    ///
    /// Errors: a position past the tables, `x` not `positions.len() · heads · head_dim` long,
    /// `head_dim` below the rotary dimension, tables not on the CPU.
    pub fn rotate_rows(
        &self,
        x: &mut [f32],
        heads: usize,
        head_dim: usize,
        positions: &[u32],
    ) -> candle_core::Result<()> {
        if x.len() != positions.len() * heads * head_dim
            || head_dim < self.rope_dim
            || positions.iter().any(|&p| p as usize >= self.max_positions())
        {
            candle_core::bail!(
                "rope: {} positions for {} values of {heads} heads × {head_dim}",
                positions.len(),
                x.len()
            );
        }
        let half = self.rope_dim / 2;
        // The tables in place (contiguous `[max_positions, half]` f32, `Self::new`).
        let (cg, sg) = (self.cos.storage_and_layout(), self.sin.storage_and_layout());
        let (candle_core::Storage::Cpu(cs), candle_core::Storage::Cpu(ss)) = (&*cg.0, &*sg.0)
        else {
            candle_core::bail!("rope: rotate_rows runs on the CPU");
        };
        let cos = &cs.as_slice::<f32>()?[cg.1.start_offset()..];
        let sin = &ss.as_slice::<f32>()?[sg.1.start_offset()..];
        for (i, x) in x.chunks_exact_mut(head_dim).enumerate() {
            let p = positions[i / heads] as usize;
            let (c, s) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            for j in 0..half {
                // candle's `rope_i` pairs (2j, 2j + 1), `rope` pairs (j, j + rope_dim / 2).
                let (a, z) = match self.style {
                    RopeStyle::Interleaved => (2 * j, 2 * j + 1),
                    RopeStyle::Neox => (j, j + half),
                };
                let (x0, x1) = (x[a], x[z]);
                x[a] = x0 * c[j] - x1 * s[j];
                x[z] = x0 * s[j] + x1 * c[j];
            }
        }
        Ok(())
    }

    /// `x: [1, heads, rows, head_dim]` with `cos`, `sin: [rows, rope_dim / 2]`.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let head_dim = x.dim(3)?;
        let rot = |t: &Tensor| match self.style {
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(t, cos, sin),
            RopeStyle::Neox => candle_nn::rotary_emb::rope(t, cos, sin),
        };
        if self.rope_dim == head_dim {
            return rot(&x.contiguous()?);
        }
        let head = rot(&x.narrow(D::Minus1, 0, self.rope_dim)?.contiguous()?)?;
        let tail = x.narrow(D::Minus1, self.rope_dim, head_dim - self.rope_dim)?;
        Tensor::cat(&[&head, &tail], D::Minus1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rotate_rows` over rows at scattered positions equals `apply` of each row alone (candle's
    /// kernels), bit for bit, for both pair layouts and a partial rotary dimension.
    #[test]
    fn rotate_rows_equals_apply_per_row() {
        let dev = Device::Cpu;
        for (style, rope_dim) in
            [(RopeStyle::Neox, 64), (RopeStyle::Interleaved, 64), (RopeStyle::Neox, 32)]
        {
            let rope =
                RotaryEmbedding::new(10_000.0, rope_dim, &RopeScaling::None, style, 512, &dev)
                    .unwrap();
            let (heads, hd) = (3, 64);
            let positions = [0u32, 7, 300, 511, 42];
            let rows = positions.len();
            // [rows, heads, hd]
            let vals: Vec<f32> =
                (0..heads * rows * hd).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.031).collect();
            let mut got = vals.clone();
            rope.rotate_rows(&mut got, heads, hd, &positions).unwrap();
            let x = Tensor::from_vec(vals, (rows, heads, hd), &dev).unwrap();
            for (r, &p) in positions.iter().enumerate() {
                let one = x.narrow(0, r, 1).unwrap(); // [1, heads, hd] = [1, heads, 1, hd]'s values
                let want = rope.apply(&one.unsqueeze(2).unwrap(), p as usize).unwrap();
                let w = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(
                    w,
                    got[r * heads * hd..(r + 1) * heads * hd],
                    "{style:?} {rope_dim}, row {r} at {p}"
                );
            }
            let mut short = got.clone();
            assert!(rope.rotate_rows(&mut short, heads, hd, &positions[..2]).is_err());
            assert!(rope.rotate_rows(&mut short, heads, hd, &[0, 1, 2, 3, 512]).is_err());
        }
    }
}
