//! Compute device selection (`--device auto|cpu|cuda[:N]`): the CPU, or an NVIDIA GPU through
//! candle's CUDA backend when Strata is built with the `cuda` cargo feature.

use std::str::FromStr;

use candle_core::Device;

/// What `--device` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA device 0 when built with `cuda` and a GPU is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// CUDA device ordinal N.
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (auto, cpu, cuda, cuda:N)")),
        }
    }
}

/// Whether this build has the CUDA backend.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Opens the device. CUDA quantized matmuls use f32 activations (see `open_cuda`). CUDA devices
/// get their default memory pool's release threshold set to
/// `u64::MAX`: cudarc's allocations come from it, and the default (0) hands memory back to the
/// driver at every synchronisation (measured ~30% slower matmuls on the H100, see
/// `../shared/tools/cuda-toolkit.sh`).
///
/// Errors: CUDA asked for in a build without the `cuda` feature, or the device cannot be opened.
pub fn open_device(choice: DeviceChoice) -> Result<Device, String> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto if !CUDA_BUILT || !candle_core::utils::cuda_is_available() => {
            Ok(Device::Cpu)
        }
        DeviceChoice::Auto => open_cuda(0).or(Ok(Device::Cpu)),
        DeviceChoice::Cuda(n) => open_cuda(n),
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_n: usize) -> Result<Device, String> {
    Err("this strata was built without CUDA: rebuild with `cargo build --release --features cuda` (see scripts/build_cuda.sh)".into())
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize) -> Result<Device, String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let device = Device::new_cuda(n).map_err(|e| format!("cuda:{n}: {e}"))?;
    // Quantized matmuls dequantize weights and keep activations in f32 (candle's DMMV kernels) unless
    // STRATA_CUDA_MMVQ=1 picks its MMVQ/MMQ kernels, which quantize activations to Q8_1. Measured on
    // the H100 (docs/performance.md, "CUDA"): DMMV logits equal the CPU's f32 reference within
    // 1.2e-6 with identical greedy tokens on SmolLM2, and decode 12% faster there; MMVQ's Q8_1
    // activations moved SmolLM2's logits by up to 17% of their range.
    candle_core::quantized::cuda::set_force_dmmv(
        !std::env::var("STRATA_CUDA_MMVQ").is_ok_and(|v| v == "1"),
    );
    if let Device::Cuda(d) = &device {
        // cudarc records and waits on CUDA events around every kernel argument so that tensors
        // shared between streams stay ordered: several driver calls per launch. Strata computes on
        // one stream, and the GPU expert tier orders its copy stream with explicit events
        // (gpu_tier/copy.rs), so the tracking is turned off (STRATA_CUDA_EVENT_TRACKING=1 keeps
        // it; docs/performance.md, "GPU decode step", measures both).
        if !std::env::var("STRATA_CUDA_EVENT_TRACKING").is_ok_and(|v| v == "1") {
            // SAFETY: see above — one compute stream; cross-stream copies are ordered explicitly.
            unsafe { d.disable_event_tracking() };
        }
        let stream = d.cuda_stream();
        let cu_device = stream.context().cu_device();
        // SAFETY: plain driver calls on the device candle just opened; `threshold` outlives them.
        unsafe {
            let mut pool = std::mem::MaybeUninit::<sys::CUmemoryPool>::uninit();
            if sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), cu_device)
                == sys::CUresult::CUDA_SUCCESS
            {
                let mut threshold: u64 = u64::MAX;
                let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
                let _ = sys::cuMemPoolSetAttribute(
                    pool.assume_init(),
                    attr,
                    &mut threshold as *mut u64 as *mut std::ffi::c_void,
                );
            }
        }
    }
    Ok(device)
}

/// A short name for logs: `cpu` or `cuda:N`.
/// Free and total memory of a CUDA device, bytes (`None` for other devices or on error).
pub fn gpu_memory(d: &Device) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = d {
        use candle_core::cuda_backend::cudarc::driver::result;
        c.cuda_stream().context().bind_to_thread().ok()?;
        return result::mem_get_info().ok().map(|(free, total)| (free as u64, total as u64));
    }
    let _ = d;
    None
}

pub fn device_name(d: &Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_names() {
        assert_eq!("auto".parse::<DeviceChoice>(), Ok(DeviceChoice::Auto));
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:1".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(1)));
        assert!("gpu".parse::<DeviceChoice>().is_err());
        if !CUDA_BUILT {
            assert!(open_device(DeviceChoice::Cuda(0)).unwrap_err().contains("without CUDA"));
            assert!(open_device(DeviceChoice::Auto).unwrap().is_cpu());
        }
    }
}
