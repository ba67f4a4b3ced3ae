//! Block-quantized weight matrices times f32 activations quantized to 8 bits per ggml's pairing:
//! - Q4_0 (block: f16 d, 16 bytes of nibbles; `w = d·(q − 8)`) × Q8_0,
//! - Q4_1 (block: f16 d, f16 m, 16 bytes of nibbles; `w = d·q + m`) × Q8_1,
//! - Q8_0 (block: f16 d, 32 int8; `w = d·q`) × Q8_0,
//! - Q4_K, Q5_K, Q6_K (256-weight super-blocks, see [`crate::q4k`], [`crate::q5k`], [`crate::q6k`])
//!   × Q8_K.

use half::f16;

use crate::bytes::WeightBytes;
use crate::q8_1::{quantize_row, BlockQ8_1, QK};
pub use crate::SendPtr;

/// The weight block formats these kernels implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockFormat {
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4K => crate::q4k::BLOCK_BYTES,
            BlockFormat::Q5K => crate::q5k::BLOCK_BYTES,
            BlockFormat::Q6K => crate::q6k::BLOCK_BYTES,
        }
    }

    /// Whether activations pair with this format as Q8_K blocks (else Q8_1).
    pub const fn uses_q8k(self) -> bool {
        matches!(self, BlockFormat::Q4K | BlockFormat::Q5K | BlockFormat::Q6K)
    }

    /// Weights per block.
    pub const fn block_elems(self) -> usize {
        if self.uses_q8k() {
            crate::q4k::QK_K
        } else {
            QK
        }
    }
}

/// A `[rows, cols]` block-quantized matrix in ggml's byte layout (row-major blocks), or — dense
/// Q4_1 / Q8_0 matrices held in memory, see [`QuantMatrix::interleaved`] — in the row-interleaved
/// layout of [`crate::interleave`].
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: BlockFormat,
    data: WeightBytes,
    rows: usize,
    cols: usize,
    /// `data` is in [`crate::interleave`]'s layout (groups of 8 rows).
    interleaved: bool,
}

impl QuantMatrix {
    /// `data` must hold `rows · cols / block_elems` blocks; `cols` must be a multiple of the
    /// format's block size (32, or 256 for Q4_K).
    pub fn new(
        format: BlockFormat,
        data: impl Into<WeightBytes>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, String> {
        let data = data.into();
        let need = rows * cols / format.block_elems() * format.block_bytes();
        if !cols.is_multiple_of(format.block_elems()) || data.len() != need {
            return Err(format!(
                "{format:?} matrix [{rows}, {cols}] needs {need} bytes, got {}",
                data.len()
            ));
        }
        Ok(Self { format, data, rows, cols, interleaved: false })
    }

    /// Like [`Self::new`] for a matrix this process holds (a dense layer's weights): moved into the
    /// row-interleaved layout ([`crate::interleave`], same size, faster one-token passes) where
    /// the format and row count allow it and the CPU runs its kernels (x86-64 with AVX2), else
    /// kept as given. Results equal the file layout's up to f32 rounding order.
    ///
    /// Errors: as [`Self::new`].
    pub fn interleaved(
        format: BlockFormat,
        data: Vec<u8>,
        rows: usize,
        cols: usize,
    ) -> Result<Self, String> {
        let m = Self::new(format, data, rows, cols)?;
        if !(crate::interleave::supports(format, rows) && interleave_kernels()) {
            return Ok(m);
        }
        let nb = cols / format.block_elems();
        let data = crate::interleave::interleave(format, m.data.as_slice(), rows, nb);
        Ok(Self { data: data.into(), interleaved: true, ..m })
    }

    /// Stacks matrices with the same format and column count row-wise (e.g. q, k and v into one
    /// matrix so that one pass quantizes the activations and one dispatch computes all three).
    pub fn concat_rows(parts: &[&QuantMatrix]) -> Option<QuantMatrix> {
        let first = parts.first()?;
        // Interleaved groups are whole (row counts are multiples of 8), so bytes concatenate.
        if parts.iter().any(|p| {
            p.format != first.format || p.cols != first.cols || p.interleaved != first.interleaved
        }) {
            return None;
        }
        let data: Vec<u8> = parts.iter().flat_map(|p| p.data.as_slice().iter().copied()).collect();
        Some(QuantMatrix {
            format: first.format,
            data: data.into(),
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            interleaved: first.interleaved,
        })
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Bytes of the quantized blocks.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The quantized blocks as stored.
    #[cfg(test)]
    pub(crate) fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    #[cfg(test)]
    pub(crate) fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data.as_slice()[r * rb..(r + 1) * rb]
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    /// Quantizes `x: [m, cols]` to the activation blocks this matrix's format pairs with (Q8_K for
    /// Q4_K, Q8_1 otherwise), row by row: a row's blocks do not depend on the other rows. On the
    /// calling thread (safe inside a barrier-pool task); [`Self::quantize_parallel`] splits many
    /// rows over the pool.
    pub fn quantize(&self, x: &[f32], m: usize) -> QuantizedActs {
        self.quantize_rows(x, m, false)
    }

    /// [`Self::quantize`] with the rows split over candle's barrier pool when there are at least
    /// [`PARALLEL_QUANTIZE_ROWS`] (the same blocks). Must not be called from inside a pool task.
    pub fn quantize_parallel(&self, x: &[f32], m: usize) -> QuantizedActs {
        self.quantize_rows(x, m, m >= PARALLEL_QUANTIZE_ROWS)
    }

    fn quantize_rows(&self, x: &[f32], m: usize, parallel: bool) -> QuantizedActs {
        assert_eq!(x.len(), m * self.cols);
        if self.format.uses_q8k() {
            let per_row = self.cols / crate::q4k::QK_K;
            let q =
                quantize_each_row(x, self.cols, per_row, crate::q4k::quantize_row_q8k, parallel);
            return QuantizedActs::Q8K(q);
        }
        QuantizedActs::Q8_1(quantize_each_row(x, self.cols, self.cols / QK, quantize_row, parallel))
    }

    /// `out[t, r] = Σ_c x[t, c] · W[r, c]` for `m` activation rows; `x: [m, cols]`, `out: [m, rows]`.
    /// Inside a [`crate::prefill_scope`] of `m` rows, the scope's prompt tokens of a Q4_K matrix
    /// take the prefill path ([`crate::q4k_prefill`]).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(out.len(), m * self.rows);
        // SAFETY: out holds the m · rows elements that matmul_into writes.
        unsafe { self.matmul_into(x, m, SendPtr(out.as_mut_ptr())) }
    }

    /// [`Self::matmul`] into a new `[m, rows]` buffer, not zeroed first: every element is written
    /// once (each task writes all `m` tokens of its rows, and the tasks cover every row), so a
    /// decode step's outputs skip the `memset` that `vec![0.0; n]` costs on the calling thread.
    pub fn matmul_vec(&self, x: &[f32], m: usize) -> Vec<f32> {
        let n = m * self.rows;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        // SAFETY: matmul_into writes all n elements (within the capacity) before the length is
        // set; a panic in a task propagates before set_len, leaving an empty vector.
        unsafe {
            self.matmul_into(x, m, SendPtr(out.as_mut_ptr()));
            out.set_len(n);
        }
        out
    }

    /// Writes `out[t · rows + r]` for every `t < m` and every row `r`.
    ///
    /// # Safety
    /// `out` must be valid for `m · rows` writes, and no other thread may access them meanwhile.
    unsafe fn matmul_into(&self, x: &[f32], m: usize, ptr: SendPtr) {
        let qx = self
            .quantize_parallel(x, m)
            .for_prefill(self, crate::q4k_prefill::first_prefill_row(m));
        let unit = self.row_unit();
        assert!(self.rows.is_multiple_of(unit), "{} rows in groups of {unit}", self.rows);
        // candle's persistent barrier pool: the calling thread works too, and its workers are the
        // ones candle's own ops use, so no second pool competes for the cores.
        candle_core::utils::barrier_pool().execute_chunked(self.rows / unit, |range| {
            let rows = range.start * unit..range.end * unit;
            // SAFETY: every task writes the rows of its own range, for m tokens, into out (m·rows).
            unsafe { self.rows_into(&qx, m, rows, ptr, self.rows) }
        });
    }

    /// Rows `rows` of `W · x` for the `m` tokens of `qx` (from [`Self::quantize`]): writes
    /// `out[t · stride + r]` for every token `t` and row `r` in `rows`. Tokens go through the
    /// largest tile kernel that fits (each weight block unpacked once per tile; weights of the
    /// range reused from cache across tiles). Every tile kernel does a token's arithmetic exactly
    /// as the one-token kernel does, so a token's result does not depend on how many tokens share
    /// the pass (a verify pass of several tokens gives bit-identical outputs to decoding them one
    /// by one).
    ///
    /// # Safety
    /// `out` must be valid for writes at `t · stride + r` for `t < m`, `r` in `rows`, and no other
    /// thread may write those elements meanwhile.
    ///
    /// # Panics
    /// When `qx` is not the activation kind of this format or `rows` exceeds the matrix.
    pub unsafe fn rows_into(
        &self,
        qx: &QuantizedActs,
        m: usize,
        rows: std::ops::Range<usize>,
        out: SendPtr,
        stride: usize,
    ) {
        assert!(rows.end <= self.rows);
        if self.interleaved {
            let QuantizedActs::Q8_1(a) = qx else { panic!("{:?} given Q8_K blocks", self.format) };
            return self.tiles_into(a, m, rows, out, stride, select_group_tiles(self.format));
        }
        match (self.format, qx) {
            (f, QuantizedActs::Q8K(a)) if f.uses_q8k() => {
                self.tiles_into(a, m, rows, out, stride, select_tiles_k(f))
            }
            #[cfg(target_arch = "x86_64")]
            (BlockFormat::Q4K, QuantizedActs::Q8KPrefill { blocks, first, panel }) => {
                let nb = self.cols / crate::q4k::QK_K;
                let tiles = select_tiles_k(self.format);
                self.tiles_into(blocks, *first, rows.clone(), out, stride, tiles);
                let data = self.data.as_slice();
                let at = (out, *first, stride);
                crate::q4k_prefill::rows_into(data, nb, panel, rows, at);
            }
            (f, QuantizedActs::Q8KPrefill { blocks, .. }) if f.uses_q8k() => {
                self.tiles_into(blocks, m, rows, out, stride, select_tiles_k(f))
            }
            (BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q8_0, QuantizedActs::Q8_1(a)) => {
                self.tiles_into(a, m, rows, out, stride, select_tiles(self.format))
            }
            (f, _) => panic!("{f:?} weights given the wrong activation blocks"),
        }
    }

    /// [`Self::rows_into`] through `tiles`, whose kernels take one unit of [`Self::row_unit`]
    /// rows (a row, or an interleaved group of 8) and write `[tokens, unit]` outputs.
    unsafe fn tiles_into<A>(
        &self,
        qx: &[A],
        m: usize,
        rows: std::ops::Range<usize>,
        out: SendPtr,
        stride: usize,
        tiles: &[(usize, RowsFn<A>)],
    ) {
        let unit = self.row_unit();
        assert!(
            rows.start.is_multiple_of(unit) && rows.end.is_multiple_of(unit),
            "rows {rows:?} split a group of {unit}"
        );
        let nb = self.cols / self.format.block_elems();
        assert!(qx.len() >= m * nb);
        let (data, ub) = (self.data.as_slice(), unit * self.row_bytes());
        let mut v = [0f32; MAX_TILE * crate::interleave::GROUP];
        // The file layout's kernels read one row at a time: the row PREFETCH_AHEAD bytes on is
        // fetched before each (the interleaved kernels prefetch block by block themselves).
        let ahead = (unit == 1).then(|| PREFETCH_AHEAD.div_ceil(ub.max(1)));
        let mut t = 0;
        while t < m {
            // The largest tile that fits the tokens left (the last entry takes one).
            let &(size, kernel) = tiles.iter().find(|(s, _)| *s <= m - t).expect("a 1-token tile");
            let a = &qx[t * nb..(t + size) * nb];
            for u in rows.start / unit..rows.end / unit {
                if let Some(next) = ahead.and_then(|k| data.get((u + k) * ub..(u + k + 1) * ub)) {
                    crate::prefetch(next.as_ptr(), next.len());
                }
                kernel(&data[u * ub..(u + 1) * ub], a, nb, &mut v[..size * unit]);
                for j in 0..size {
                    for i in 0..unit {
                        // SAFETY: the caller owns these elements (see the function's contract).
                        unsafe { *out.0.add((t + j) * stride + u * unit + i) = v[j * unit + i] };
                    }
                }
            }
            t += size;
        }
    }
}

/// Weight bytes fetched ahead of the row being computed (software prefetch of the row that
/// many bytes further on). The kernels do too much arithmetic per byte for the hardware
/// prefetchers to keep enough cache lines in flight: one-token passes over matrices not in cache
/// read ~4.9 GB/s from DRAM on the 2-core VM (2 threads), 10–11 GB/s with 2–4 KiB fetched
/// ahead (docs/performance.md, "CPU kernels, continued").
pub(crate) const PREFETCH_AHEAD: usize = 3072;

impl QuantMatrix {
    /// Rows that a parallel task's range must be a multiple of (8 when interleaved, else 1).
    pub fn row_unit(&self) -> usize {
        if self.interleaved {
            crate::interleave::GROUP
        } else {
            1
        }
    }
}

/// Whether this process runs the interleaved kernels: x86-64 with AVX2 (not forced to scalar),
/// unless `$STRATA_CPU_INTERLEAVE` is `0` (the file layout, for measuring one against the other).
fn interleave_kernels() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        cfg!(target_arch = "x86_64")
            && isa() >= Isa::Avx2
            && std::env::var("STRATA_CPU_INTERLEAVE").as_deref() != Ok("0")
    })
}

/// Passes of at least this many rows quantize their activations on all cores
/// ([`QuantMatrix::quantize_parallel`]).
pub const PARALLEL_QUANTIZE_ROWS: usize = 16;

/// Rows of `x` (`cols` each) quantized by `quantize` (a row → `per_row` blocks) into one buffer,
/// `[rows · per_row]`, on the barrier pool when `parallel`.
fn quantize_each_row<B: Copy + Send>(
    x: &[f32],
    cols: usize,
    per_row: usize,
    quantize: fn(&[f32], &mut Vec<B>),
    parallel: bool,
) -> Vec<B> {
    let m = x.len() / cols;
    let mut out: Vec<B> = Vec::with_capacity(m * per_row);
    struct Dst<B>(*mut B);
    // SAFETY: each task writes its own rows' blocks only.
    unsafe impl<B: Send> Sync for Dst<B> {}
    let dst = Dst(out.as_mut_ptr());
    let work = |rows: std::ops::Range<usize>| {
        let d = &dst;
        let mut tmp = Vec::with_capacity(per_row);
        for r in rows {
            quantize(&x[r * cols..(r + 1) * cols], &mut tmp);
            assert_eq!(tmp.len(), per_row);
            // SAFETY: row r's blocks are out[r · per_row..(r + 1) · per_row], within capacity,
            // written by this task alone.
            unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr(), d.0.add(r * per_row), per_row) };
        }
    };
    if parallel {
        candle_core::utils::barrier_pool().execute_chunked(m, work);
    } else {
        work(0..m);
    }
    // SAFETY: every row's blocks were written above (a panicking task propagates before this).
    unsafe { out.set_len(m * per_row) };
    out
}

/// Activations quantized for one weight format's dot product, `[m, blocks per row]` row-major.
#[derive(Debug, Clone)]
pub enum QuantizedActs {
    /// For Q4_1 and Q8_0 weights (Q8_0 uses `qs` and `d` only).
    Q8_1(Vec<BlockQ8_1>),
    /// For Q4_K, Q5_K and Q6_K weights.
    Q8K(Vec<crate::q4k::BlockQ8K>),
    /// Q8_K blocks whose rows `first..` are prompt tokens, with those rows' panel for the Q4_K
    /// prefill path ([`crate::q4k_prefill`]; other formats use `blocks` alone).
    Q8KPrefill {
        blocks: Vec<crate::q4k::BlockQ8K>,
        first: usize,
        panel: crate::q4k_prefill::Q8KPanel,
    },
}

impl QuantizedActs {
    /// The blocks of rows `rows` (each `nb` blocks) in order, as their own activations.
    pub fn gather(&self, rows: impl Iterator<Item = usize> + Clone, nb: usize) -> QuantizedActs {
        fn pick<A: Copy>(v: &[A], rows: impl Iterator<Item = usize>, nb: usize) -> Vec<A> {
            rows.flat_map(|r| v[r * nb..(r + 1) * nb].iter().copied()).collect()
        }
        match self {
            QuantizedActs::Q8_1(v) => QuantizedActs::Q8_1(pick(v, rows, nb)),
            QuantizedActs::Q8K(v) | QuantizedActs::Q8KPrefill { blocks: v, .. } => {
                QuantizedActs::Q8K(pick(v, rows, nb))
            }
        }
    }

    /// These activations (for `w`) with rows `first..` marked as prompt tokens, where `w` is Q4_K
    /// and `first` is given (from [`crate::prefill_scope`]); else unchanged.
    pub fn for_prefill(self, w: &QuantMatrix, first: Option<usize>) -> QuantizedActs {
        match (self, first) {
            (QuantizedActs::Q8K(blocks), Some(first))
                if w.format == BlockFormat::Q4K && !w.interleaved =>
            {
                let nb = w.cols / crate::q4k::QK_K;
                let tokens = blocks.len() / nb - first;
                let panel = crate::q4k_prefill::Q8KPanel::new(&blocks[first * nb..], tokens, nb);
                QuantizedActs::Q8KPrefill { blocks, first, panel }
            }
            (acts, _) => acts,
        }
    }
}

/// Dot products of one weight row with `R` activation rows `a: [R, nb]` (`nb` blocks each) into
/// `out[..R]`.
type RowsFn<A> = fn(w: &[u8], a: &[A], nb: usize, out: &mut [f32]);

/// Most tokens one tile kernel takes.
const MAX_TILE: usize = 8;

/// The tile table of a `kernel::<R>` family: widths 8 down to 1.
#[cfg(target_arch = "x86_64")]
macro_rules! tiles {
    ($($kernel:ident)::+) => {
        &[
            (8, |w, a, nb, o| unsafe { $($kernel)::+::<8>(w, a, nb, o) }),
            (7, |w, a, nb, o| unsafe { $($kernel)::+::<7>(w, a, nb, o) }),
            (6, |w, a, nb, o| unsafe { $($kernel)::+::<6>(w, a, nb, o) }),
            (5, |w, a, nb, o| unsafe { $($kernel)::+::<5>(w, a, nb, o) }),
            (4, |w, a, nb, o| unsafe { $($kernel)::+::<4>(w, a, nb, o) }),
            (3, |w, a, nb, o| unsafe { $($kernel)::+::<3>(w, a, nb, o) }),
            (2, |w, a, nb, o| unsafe { $($kernel)::+::<2>(w, a, nb, o) }),
            (1, |w, a, nb, o| unsafe { $($kernel)::+::<1>(w, a, nb, o) }),
        ]
    };
}

/// The instruction set the kernels use: the best this CPU has, or `$STRATA_CPU_KERNELS`
/// (`avx512`, `avx2`, `scalar`) capped at what it has (for measuring one path against another).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

/// The [`Isa`] in use (decided once per process).
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let best = if !crate::x86::avx2::available() {
            Isa::Scalar
        } else if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
        {
            Isa::Avx512
        } else {
            Isa::Avx2
        };
        #[cfg(not(target_arch = "x86_64"))]
        let best = Isa::Scalar;
        let wanted = match std::env::var("STRATA_CPU_KERNELS").as_deref() {
            Ok("scalar") => Isa::Scalar,
            Ok("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
        };
        best.min(wanted)
    })
}

/// Tile kernels for `format` (largest first, ending with one token). Measured on the AVX2 kernels
/// (docs/performance.md): a pass over 2 tokens costs ~1.3× one token, over 4 ~1.7×, over 8 ~3×;
/// every width up to 8 has its own kernel, so a verify pass of up to 8 tokens is one tile.
/// Q4_1 and Q8_0 have no AVX-512 path (measured no faster, see [`crate::x86`]).
fn select_tiles(format: BlockFormat) -> &'static [(usize, RowsFn<BlockQ8_1>)] {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::x86::avx2;
        if isa() >= Isa::Avx2 {
            return match format {
                BlockFormat::Q4_0 => tiles!(avx2::q4_0_tokens),
                BlockFormat::Q4_1 => tiles!(avx2::q4_1_tokens),
                BlockFormat::Q8_0 => tiles!(avx2::q8_0_tokens),
                _ => unreachable!("K-quants pair with Q8_K activations (select_tiles_k)"),
            };
        }
    }
    match format {
        BlockFormat::Q4_0 => &[(1, |w, a, _, o| o[0] = dot_q4_0_scalar(w, a))],
        BlockFormat::Q4_1 => &[(1, |w, a, _, o| o[0] = dot_q4_1_scalar(w, a))],
        BlockFormat::Q8_0 => &[(1, |w, a, _, o| o[0] = dot_q8_0_scalar(w, a))],
        _ => unreachable!("K-quants pair with Q8_K activations (select_tiles_k)"),
    }
}

/// K-quant tile kernels: AVX-512 (with VNNI where the CPU has it) or AVX2 (bit-identical to each
/// other), else the scalar kernel.
fn select_tiles_k(format: BlockFormat) -> &'static [(usize, RowsFn<crate::q4k::BlockQ8K>)] {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::{q4k, q5k, q6k};
        let vnni = isa() == Isa::Avx512 && std::is_x86_feature_detected!("avx512vnni");
        match (isa(), format) {
            (Isa::Avx512, BlockFormat::Q4K) if vnni => return tiles!(q4k::q4k_tokens_vnni),
            (Isa::Avx512, BlockFormat::Q4K) => return tiles!(q4k::q4k_tokens_avx512),
            (Isa::Avx512, BlockFormat::Q5K) => return tiles!(q5k::q5k_tokens_avx512),
            (Isa::Avx512, BlockFormat::Q6K) => return tiles!(q6k::q6k_tokens_avx512),
            (Isa::Avx2, BlockFormat::Q4K) => return tiles!(q4k::q4k_tokens_avx2),
            (Isa::Avx2, BlockFormat::Q5K) => return tiles!(q5k::q5k_tokens_avx2),
            (Isa::Avx2, BlockFormat::Q6K) => return tiles!(q6k::q6k_tokens_avx2),
            _ => {}
        }
    }
    match format {
        BlockFormat::Q4K => &[(1, |w, a, _, o| o[0] = crate::q4k::dot_q4k_scalar(w, a))],
        BlockFormat::Q5K => &[(1, |w, a, _, o| o[0] = crate::q5k::dot_q5k_scalar(w, a))],
        BlockFormat::Q6K => &[(1, |w, a, _, o| o[0] = crate::q6k::dot_q6k_scalar(w, a))],
        _ => unreachable!("Q4_1 and Q8_0 pair with Q8_1 activations (select_tiles)"),
    }
}

/// Tile kernels of the interleaved layout for `format` (8 tokens down to 1).
fn select_group_tiles(format: BlockFormat) -> &'static [(usize, RowsFn<BlockQ8_1>)] {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::interleave::avx2;
        // VNNI only where AVX-512 is in use (`STRATA_CPU_KERNELS=avx2` measures without it).
        let vnni = isa() == Isa::Avx512 && avx2::vnni_available();
        match (format, vnni) {
            (BlockFormat::Q4_1, true) => tiles!(avx2::q4_1x8_tokens_vnni),
            (BlockFormat::Q8_0, true) => tiles!(avx2::q8_0x8_tokens_vnni),
            (BlockFormat::Q4_1, false) => tiles!(avx2::q4_1x8_tokens),
            (BlockFormat::Q8_0, false) => tiles!(avx2::q8_0x8_tokens),
            (f, _) => unreachable!("{f:?} is not interleaved"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("{format:?}: no interleaved kernels on this architecture")
}

/// ggml `ggml_vec_dot_q8_0_q8_0`, generic version.
pub fn dot_q8_0_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BlockFormat::Q8_0.block_bytes()).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let sumi: i32 =
            blk[2..34].iter().zip(&y.qs).map(|(&q, &v)| q as i8 as i32 * v as i32).sum();
        sumf += sumi as f32 * (d * y.d);
    }
    sumf
}

/// ggml `ggml_vec_dot_q4_0_q8_0`, generic version.
pub fn dot_q4_0_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BlockFormat::Q4_0.block_bytes()).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let mut sumi = 0i32;
        for (j, &q) in blk[2..18].iter().enumerate() {
            sumi += ((q & 0x0F) as i32 - 8) * y.qs[j] as i32
                + ((q >> 4) as i32 - 8) * y.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * (d * y.d);
    }
    sumf
}

/// ggml `ggml_vec_dot_q4_1_q8_1`, generic version.
pub fn dot_q4_1_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BlockFormat::Q4_1.block_bytes()).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        let qs = &blk[4..20];
        let mut sumi = 0i32;
        for (j, &q) in qs.iter().enumerate() {
            sumi += (q & 0x0F) as i32 * y.qs[j] as i32 + (q >> 4) as i32 * y.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * d * y.d + m * y.s;
    }
    sumf
}

#[cfg(test)]
mod tests {
    use super::*;

    type DotFn = fn(&[u8], &[BlockQ8_1]) -> f32;

    fn pseudo(i: usize) -> f32 {
        ((i as f32 * 0.7131).sin() * 43758.547).fract() - 0.5
    }

    fn make_q4_1(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut data = Vec::new();
        let mut dense = Vec::new();
        for b in 0..rows * cols / QK {
            let d = f16::from_f32(0.01 + 0.001 * (b % 7) as f32);
            let m = f16::from_f32(-0.08 + 0.002 * (b % 5) as f32);
            data.extend_from_slice(&d.to_le_bytes());
            data.extend_from_slice(&m.to_le_bytes());
            let qs: Vec<u8> = (0..16).map(|j| ((b * 31 + j * 7) % 256) as u8).collect();
            data.extend_from_slice(&qs);
            let mut vals = [0f32; QK];
            for j in 0..16 {
                vals[j] = d.to_f32() * (qs[j] & 0xF) as f32 + m.to_f32();
                vals[j + 16] = d.to_f32() * (qs[j] >> 4) as f32 + m.to_f32();
            }
            dense.extend_from_slice(&vals);
        }
        (QuantMatrix::new(BlockFormat::Q4_1, data, rows, cols).unwrap(), dense)
    }

    fn make_q4_0(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut data = Vec::new();
        let mut dense = Vec::new();
        for b in 0..rows * cols / QK {
            let d = f16::from_f32(0.01 + 0.001 * (b % 7) as f32);
            data.extend_from_slice(&d.to_le_bytes());
            let qs: Vec<u8> = (0..16).map(|j| ((b * 29 + j * 13) % 256) as u8).collect();
            data.extend_from_slice(&qs);
            let mut vals = [0f32; QK];
            for j in 0..16 {
                vals[j] = d.to_f32() * ((qs[j] & 0xF) as f32 - 8.0);
                vals[j + 16] = d.to_f32() * ((qs[j] >> 4) as f32 - 8.0);
            }
            dense.extend_from_slice(&vals);
        }
        (QuantMatrix::new(BlockFormat::Q4_0, data, rows, cols).unwrap(), dense)
    }

    fn make_q8_0(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut data = Vec::new();
        let mut dense = Vec::new();
        for b in 0..rows * cols / QK {
            let d = f16::from_f32(0.002 + 0.0003 * (b % 7) as f32);
            data.extend_from_slice(&d.to_le_bytes());
            for j in 0..QK {
                let q = ((b * 37 + j * 11) % 255) as i32 - 127;
                data.push(q as i8 as u8);
                dense.push(d.to_f32() * q as f32);
            }
        }
        (QuantMatrix::new(BlockFormat::Q8_0, data, rows, cols).unwrap(), dense)
    }

    /// `matmul_vec` (a buffer not zeroed first) gives `matmul`'s values into a buffer of NaNs,
    /// for the file layout and the interleaved one, over tile-sized and odd token counts.
    #[test]
    fn matmul_vec_writes_every_output_as_matmul_does() {
        let (w, _) = make_q4_1(48, 256);
        let data = w.data.as_slice().to_vec();
        let inter = QuantMatrix::interleaved(BlockFormat::Q4_1, data, 48, 256).unwrap();
        for m in [1, 3, 8, 13] {
            let x: Vec<f32> = (0..m * 256).map(|i| pseudo(i + 5)).collect();
            for mat in [&w, &inter] {
                let mut want = vec![f32::NAN; m * 48];
                mat.matmul(&x, m, &mut want);
                assert!(want.iter().all(|v| v.is_finite()), "matmul left an output unwritten");
                let got = mat.matmul_vec(&x, m);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{m} tokens, interleaved {}", mat.interleaved);
            }
        }
    }

    #[test]
    fn q8_0_simd_equals_scalar_and_approximates_f32() {
        check(make_q8_0(29, 320), dot_q8_0_scalar);
    }

    #[test]
    fn q4_0_simd_equals_scalar_and_approximates_f32() {
        check(make_q4_0(23, 288), dot_q4_0_scalar);
    }

    #[test]
    fn q4_1_simd_equals_scalar_and_approximates_f32() {
        check(make_q4_1(37, 256), dot_q4_1_scalar);
    }

    /// Every tile kernel this CPU runs against the scalar reference (each token of a tile
    /// bit-identical to the one-token kernel).
    #[test]
    fn every_tile_kernel_equals_scalar() {
        for (format, scalar) in [
            (BlockFormat::Q4_0, dot_q4_0_scalar as DotFn),
            (BlockFormat::Q4_1, dot_q4_1_scalar),
            (BlockFormat::Q8_0, dot_q8_0_scalar),
        ] {
            // 288 columns = 9 blocks.
            let w = match format {
                BlockFormat::Q4_0 => make_q4_0(5, 288).0,
                BlockFormat::Q4_1 => make_q4_1(5, 288).0,
                _ => make_q8_0(5, 288).0,
            };
            let nb = 9;
            let x: Vec<f32> = (0..MAX_TILE * 288).map(|i| pseudo(i + 11)).collect();
            let mut q = Vec::new();
            quantize_row(&x, &mut q);
            let tiles = select_tiles(format);
            let one = tiles.last().unwrap().1;
            for &(size, kernel) in tiles {
                for r in 0..5 {
                    let mut v = vec![0f32; size];
                    kernel(w.row(r), &q[..size * nb], nb, &mut v);
                    for t in 0..size {
                        let mut single = [0f32];
                        one(w.row(r), &q[t * nb..(t + 1) * nb], nb, &mut single);
                        assert_eq!(
                            single[0].to_bits(),
                            v[t].to_bits(),
                            "{format:?} tile {size} row {r} token {t}"
                        );
                        let s = scalar(w.row(r), &q[t * nb..(t + 1) * nb]);
                        assert!(
                            (s - v[t]).abs() <= 1e-4 * s.abs().max(1.0),
                            "{format:?} simd {} scalar {s}",
                            v[t]
                        );
                    }
                }
            }
        }
    }

    fn check((w, dense): (QuantMatrix, Vec<f32>), dot_scalar: DotFn) {
        // 15 tokens: tiles of 8, 4, 3.
        let (rows, cols, m) = (w.rows(), w.cols(), 15);
        let x: Vec<f32> = (0..m * cols).map(pseudo).collect();
        let mut out = vec![0f32; m * rows];
        w.matmul(&x, m, &mut out);
        // Bit-identical to one token at a time (speculative verification relies on it).
        for t in 0..m {
            let mut one = vec![0f32; rows];
            w.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
            assert!(
                one.iter()
                    .zip(&out[t * rows..(t + 1) * rows])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "token {t}: batched differs from single"
            );
        }
        let mut q = Vec::new();
        for t in 0..m {
            quantize_row(&x[t * cols..(t + 1) * cols], &mut q);
            for r in 0..rows {
                let s = dot_scalar(w.row(r), &q);
                assert!(
                    (s - out[t * rows + r]).abs() <= 1e-4 * s.abs().max(1.0),
                    "simd {} scalar {s}",
                    out[t * rows + r]
                );
                let exact: f32 = (0..cols).map(|c| dense[r * cols + c] * x[t * cols + c]).sum();
                let scale: f32 =
                    (0..cols).map(|c| (dense[r * cols + c] * x[t * cols + c]).abs()).sum();
                // 8-bit activations: error well under 1% of Σ|w·x|.
                assert!((exact - s).abs() < 0.01 * scale, "q8 {s} exact {exact} (Σ|wx| {scale})");
            }
        }
    }
}
