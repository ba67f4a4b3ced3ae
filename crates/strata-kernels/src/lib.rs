//! CPU matrix-vector kernels for ggml block-quantized weights.
//!
//! candle 0.11 has SIMD kernels for Q4_0, Q8_0 and the K-quants but computes Q4_1 with scalar code
//! and rounds the Q8_1 block sum through f16 arithmetic; its AVX512 Q8_0 path quantizes activations
//! per 256 values (Q8_K) where ggml uses per-32 Q8_0 blocks. Both drift measurably from llama.cpp. These
//! kernels follow ggml exactly (`ggml/src/ggml-quants.c` `quantize_row_q8_1_ref`,
//! `ggml-cpu/ggml-cpu-quants.c` `ggml_vec_dot_q4_1_q8_1`) with an AVX2 path and a scalar fallback.

pub mod attention;
pub mod bytes;
pub mod matrix;
pub mod q4k;
pub mod q8_1;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use bytes::WeightBytes;
pub use matrix::{BlockFormat, QuantMatrix};

/// A raw pointer that may cross threads; each task writes disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
