//! A pass's logits handed to its sequences: the greedy picks of [`Logits::Greedy`] sequences
//! made on the device, the other sequences' rows brought to the host in one copy when several
//! sequences ran on a GPU.

use std::ops::Range;

use candle_core::{DType, Device, Tensor};

use super::Logits;
use crate::error::Result;
use crate::gpu::{self, GpuPath};

/// Each sequence's logits and greedy pick from a pass's `logits: [rows, vocab]` (f32, on the
/// pass's device), sequence `k` owning rows `picked[k]` and asking for `modes[k]`:
///
/// - [`Logits::Greedy`] on a GPU with [`GpuPath::Argmax`] on: the pick of its last row made on the
///   device (`strata_kernels::cuda::argmax_rows`: the first largest value, as the host's greedy
///   scan; `picks`, `[rows]` u32, when a captured step made them already), its logits an empty
///   `[0, vocab]` host tensor — a 16-sequence step of a 152k
///   vocabulary then reads 64 bytes instead of 9.7 MB of logits through pageable memory;
/// - otherwise its rows, pick `None`: when several sequences ran on a GPU, all such rows come to
///   the host in one copy (reading a view of a device tensor copies its whole buffer: 16
///   sequences' reads of their rows moved 16× the logits), else a view of `logits` where it is.
///
/// Errors: a kernel or copy failure.
pub(super) fn split_logits(
    logits: &Tensor,
    picks: Option<&Tensor>,
    picked: &[Range<usize>],
    modes: &[Logits],
) -> Result<Vec<(Tensor, Option<u32>)>> {
    let vocab = logits.dim(1)?;
    let on_gpu = !logits.device().is_cpu();
    let on_device: Vec<bool> = modes
        .iter()
        .map(|m| on_gpu && *m == Logits::Greedy && gpu::enabled(GpuPath::Argmax))
        .collect();
    let picks = match (on_device.contains(&true), picks) {
        (true, Some(p)) => p.to_vec1::<u32>()?,
        (true, None) => device_argmax(logits)?,
        (false, _) => Vec::new(),
    };
    // The rows still wanted as logits, and where each kept sequence's rows land in `host`.
    let keep: Vec<usize> = (0..picked.len()).filter(|&k| !on_device[k]).collect();
    let mut at: Vec<Range<usize>> = picked.to_vec();
    let host = if on_gpu && picked.len() > 1 && !keep.is_empty() {
        if keep.len() == picked.len() {
            logits.to_device(&Device::Cpu)?
        } else {
            let mut rows: Vec<u32> = Vec::new();
            for &k in &keep {
                let from = rows.len();
                rows.extend(picked[k].start as u32..picked[k].end as u32);
                at[k] = from..rows.len();
            }
            let idx = Tensor::new(rows.as_slice(), logits.device())?;
            logits.index_select(&idx, 0)?.to_device(&Device::Cpu)?
        }
    } else {
        logits.clone()
    };
    let mut out = Vec::with_capacity(picked.len());
    for (k, p) in picked.iter().enumerate() {
        out.push(match on_device[k] {
            true => (Tensor::zeros((0, vocab), DType::F32, &Device::Cpu)?, Some(picks[p.end - 1])),
            false => (host.narrow(0, at[k].start, at[k].len())?, None),
        });
    }
    Ok(out)
}

/// Every row's greedy pick, made on the device.
#[cfg(feature = "cuda")]
fn device_argmax(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(strata_kernels::cuda::argmax_rows(&logits.contiguous()?)?.to_vec1::<u32>()?)
}

#[cfg(not(feature = "cuda"))]
fn device_argmax(_: &Tensor) -> Result<Vec<u32>> {
    Err(candle_core::Error::msg("greedy picks on a GPU need the cuda feature").into())
}
