//! CPU kernels for ggml block-quantized weights: Q4_0, Q4_1, Q8_0 and Q4_K, Q5_K, Q6_K matrices
//! times f32 activations, each format with tile kernels for 1–8 tokens per weight row (every
//! token's arithmetic the one-token kernel's, so a speculative verify pass is bit-identical to
//! decoding token by token), AVX2 paths, AVX-512 paths for the K-quants (chosen at run time by
//! [`isa`]; bit-identical to the AVX2 ones) and a scalar fallback for other CPUs; a row-interleaved
//! layout of dense Q4_1 / Q8_0 layers with its own tile kernels ([`interleave`]); one MoE layer's experts in two parallel
//! regions ([`moe`]); and decode attention. With the `cuda` feature, `cuda` holds our own GPU
//! decode kernels (`cuda/decode.cu`).
//!
//! Why our own: candle 0.11 computes Q4_1 with scalar code, rounds the Q8_1 block sum through f16
//! arithmetic, quantizes Q8_0 activations per 256 values on AVX-512 where ggml uses per-32 blocks,
//! and repacks Q4_K/Q6_K matrices on x86 into a second copy (1.33× their size, ~6 ms per streamed
//! expert). These kernels follow ggml's arithmetic (`ggml/src/ggml-quants.c` quantizers,
//! `ggml-cpu/arch/x86/quants.c` `ggml_vec_dot_*` AVX2 kernels) and read weights as stored.

pub mod attention;
pub mod attention_prefill;
pub mod bytes;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod f32;
pub mod interleave;
pub mod matrix;
pub mod moe;
pub mod pick;
pub mod q4k;
pub mod q4k_prefill;
pub mod q5k;
pub mod q6k;
pub mod q8_1;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use bytes::WeightBytes;
pub use matrix::{isa, BlockFormat, Isa, QuantMatrix, QuantizedActs};
pub use q4k_prefill::prefill_scope;

/// Runs `f` with the thread-local `flag` set to `value`, and puts the value before back when it
/// returns or unwinds — the scoped switches that choose kernels for the passes inside them
/// ([`prefill_scope`], `strata_models::gpu::rows_exact_scope`).
pub fn with_thread_flag<T: Copy + 'static, R>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(flag, flag.with(|c| c.replace(value)));
    f()
}

/// One MoE layer's experts addressed through a table on the GPU (the GPU expert tier's mapped
/// experts, `strata-expert-store`'s `gpu_tier`): `addr` is the device address of `3 × experts`
/// u64 device addresses — every expert's gate part, then every expert's up part, then every
/// expert's down part — each pointing at the expert's `[rows, cols]` Q4_K matrix in a VRAM cache
/// slot or in page-locked host memory mapped into the device's address space (the kernels then
/// read it over the bus). The fused MoE kernels take it in place of the `[E, rows, cols]`
/// tensors' addresses (`indirect`); the tensors still give the shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertTable {
    /// Device address of the table (`3 × experts` u64, 8-byte aligned).
    pub addr: u64,
    /// Experts of the layer (the routing's ids are below it).
    pub experts: usize,
}

impl ExpertTable {
    /// Device address of projection `k`'s (0 gate, 1 up, 2 down) part of the table.
    pub fn part(&self, k: usize) -> u64 {
        self.addr + (k * self.experts * 8) as u64
    }
}

/// A raw pointer to an f32 output buffer that may cross threads; each task writes disjoint
/// elements ([`QuantMatrix::rows_into`]).
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Asks the CPU to bring the `bytes` bytes from `p` into cache, a 64-byte line at a time (a hint:
/// it never faults, so `p` may run past the end of the weights; no effect on other
/// architectures).
#[inline(always)]
pub(crate) fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes).step_by(64) {
        // SAFETY: a prefetch hint; the address is computed without dereferencing.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(off) as *const i8,
            )
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    thread_local! {
        static FLAG: Cell<u32> = const { Cell::new(1) };
    }

    /// The flag holds the value inside the scope (nested scopes too) and its value before after
    /// it — also when `f` panics.
    #[test]
    fn a_thread_flag_is_put_back_after_its_scope() {
        let seen = super::with_thread_flag(&FLAG, 2, || {
            let inner = super::with_thread_flag(&FLAG, 3, || FLAG.with(Cell::get));
            (FLAG.with(Cell::get), inner)
        });
        assert_eq!(seen, (2, 3));
        assert_eq!(FLAG.with(Cell::get), 1);
        let unwound = std::panic::catch_unwind(|| {
            super::with_thread_flag(&FLAG, 4, || panic!("inside the scope"))
        });
        assert!(unwound.is_err());
        assert_eq!(FLAG.with(Cell::get), 1);
    }
}
