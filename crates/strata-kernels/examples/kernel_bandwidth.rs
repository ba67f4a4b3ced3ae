//! Weight bandwidth of one-token passes (decode) over matrices that are not in cache: `count`
//! random matrices of `rows × cols` in `format`, each multiplied by one activation row in turn,
//! three rounds of 20 sweeps; prints GB/s of weights read and µs per matrix. The figure behind
//! the kernels' prefetch distances (docs/performance.md, "CPU kernels, continued").
//!
//! `cargo run --release -p strata-kernels --example kernel_bandwidth -- ROWS COLS COUNT FORMAT
//! [x8]` (FORMAT: q4_0, q4_1, q8_0, q4_k, q6_k; `x8`: the row-interleaved layout of dense layers,
//! [`QuantMatrix::interleaved`]); threads: candle's pool (`CANDLE_NUM_THREADS`). `$TOKENS`
//! (default 1) activation rows per pass: with several, the passes are prefill-like and the
//! figure to read is the multiply-accumulate rate (GMAC/s), printed beside; `PREFILL=1` runs them
//! as prompt tokens ([`strata_kernels::prefill_scope`]).

use std::time::Instant;

use strata_kernels::{BlockFormat, QuantMatrix};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: kernel_bandwidth ROWS COLS COUNT q4_0|q4_1|q8_0|q4_k|q6_k [x8]";
    let (rows, cols, count, format, x8) = match args.as_slice() {
        [r, c, n, f] => (r, c, n, f, false),
        [r, c, n, f, x] if x == "x8" => (r, c, n, f, true),
        _ => panic!("{usage}"),
    };
    let num = |s: &String| s.parse::<usize>().expect(usage);
    let (rows, cols, count) = (num(rows), num(cols), num(count));
    let format = match format.to_ascii_lowercase().as_str() {
        "q4_0" => BlockFormat::Q4_0,
        "q4_1" => BlockFormat::Q4_1,
        "q8_0" => BlockFormat::Q8_0,
        "q4_k" => BlockFormat::Q4K,
        "q6_k" => BlockFormat::Q6K,
        _ => panic!("{usage}"),
    };
    let (block_bytes, block_elems) = (format.block_bytes(), format.block_elems());
    let bytes = rows * cols / block_elems * block_bytes;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mats: Vec<QuantMatrix> = (0..count)
        .map(|_| {
            let mut v = vec![0u8; bytes];
            for (i, b) in v.iter_mut().enumerate() {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                // Random bytes, with the f16 scales at the start of each block kept finite.
                *b = (seed >> 33) as u8;
                if i % block_bytes < 4 && i % 2 == 1 {
                    *b &= 0x3B;
                }
            }
            if x8 {
                QuantMatrix::interleaved(format, v, rows, cols).expect("matrix")
            } else {
                QuantMatrix::new(format, v, rows, cols).expect("matrix")
            }
        })
        .collect();
    let tokens: usize = std::env::var("TOKENS").map_or(1, |t| t.parse().expect("TOKENS"));
    let x: Vec<f32> = (0..tokens * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0f32; tokens * rows];
    let prefill = std::env::var("PREFILL").as_deref() == Ok("1");
    let sweeps = 20;
    for round in 0..3 {
        let t = Instant::now();
        for _ in 0..sweeps {
            for m in &mats {
                if prefill {
                    strata_kernels::prefill_scope(tokens, 0, || m.matmul(&x, tokens, &mut out));
                } else {
                    m.matmul(&x, tokens, &mut out);
                }
            }
        }
        let s = t.elapsed().as_secs_f64();
        let n = (count * sweeps) as f64;
        println!(
            "round {round}: {:.2} GB/s, {:.1} GMAC/s, {:.1} µs per matrix ({format:?} {rows}×{cols}{}, {tokens} tokens, {:.0} MB in all)",
            bytes as f64 * n / s / 1e9,
            (rows * cols * tokens) as f64 * n / s / 1e9,
            s / n * 1e6,
            if mats[0].row_unit() > 1 { " interleaved" } else { "" },
            (bytes * count) as f64 / 1e6
        );
    }
}
