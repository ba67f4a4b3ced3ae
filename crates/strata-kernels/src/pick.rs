//! The greedy pick over a row of logits on the host: every CPU decode step's token with
//! temperature 0, and the reference of the GPU's `argmax_rows` kernel (the same index, tested in
//! strata-models' CUDA kernel tests).

/// Index of the largest value (first on ties, like llama.cpp's greedy sampler; NaNs are never
/// picked unless the first value is one — then 0, as a loop keeping the first strictly greater
/// value gives). Two passes without a loop-carried comparison per value, which the compiler
/// vectorizes: the largest value over 16 lanes, then the first chunk of 16 holding it and its
/// place there — a 152k vocabulary's greedy pick is on the host path of every generated token.
pub fn argmax(xs: &[f32]) -> u32 {
    const L: usize = 16;
    let Some(&first) = xs.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; L];
    let chunks = xs.chunks_exact(L);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = first;
    for &x in lanes.iter().chain(tail) {
        if x > max {
            max = x;
        }
    }
    for (c, chunk) in xs.chunks(L).enumerate() {
        if chunk.iter().fold(false, |hit, &x| hit | (x == max)) {
            let j = chunk.iter().position(|&x| x == max).unwrap_or(0);
            return (c * L + j) as u32;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition `argmax` must keep: the first strictly greater value wins.
    fn argmax_scalar(xs: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_equals_the_first_strictly_greater_scan() {
        // A fixed pseudo-random sequence in [-10, 10) (xorshift64).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
        };
        for len in [0usize, 1, 7, 8, 9, 31, 1000, 49_152] {
            let mut xs: Vec<f32> = (0..len).map(|_| next()).collect();
            assert_eq!(argmax(&xs), argmax_scalar(&xs), "random, {len} values");
            if len > 20 {
                // Ties (the first wins), a NaN inside, ±0 as the largest.
                let m = xs.iter().copied().fold(f32::MIN, f32::max);
                xs[len / 2] = m;
                xs[len - 1] = m;
                xs[3] = f32::NAN;
                assert_eq!(argmax(&xs), argmax_scalar(&xs), "ties and a NaN, {len} values");
                let mut z: Vec<f32> = xs.iter().map(|x| -x.abs() - 1.0).collect();
                z[5] = -0.0;
                z[len - 2] = 0.0;
                assert_eq!(argmax(&z), argmax_scalar(&z), "±0, {len} values");
                xs[0] = f32::NAN;
                assert_eq!(argmax(&xs), argmax_scalar(&xs), "a NaN first, {len} values");
            }
        }
    }
}
