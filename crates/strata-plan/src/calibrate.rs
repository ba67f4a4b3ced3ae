//! Measured bandwidths for the cost model (`strata info --calibrate`, < 20 s), cached per drive
//! under the user cache dir (`$XDG_CACHE_HOME/strata/calibration.json`, else
//! `~/.cache/strata/...`). Without a cached measurement the plan uses [`Bandwidths::DEFAULTS`] and
//! says so. The measurements themselves live in `strata-bench` (`strata_bench::calibrate`).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Rates the estimates divide by (GB = 10⁹ bytes).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Bandwidths {
    /// Random 4 MiB reads at queue depth 32 through the page cache (its pages dropped first), GB/s.
    pub drive_gbps: f64,
    /// Multi-threaded sequential RAM read, GB/s.
    pub ram_gbps: f64,
    /// Weight bytes per second a decode step streams through the quantized matvec kernels (our Q4_K
    /// kernel on 64 MB of expert-shaped matrices, one token, per-call costs included), GB/s.
    pub matvec_gbps: f64,
    /// The same for dense weights through candle's quantized matmul (the path attention
    /// projections and the LM head take: Q4_K `[4096, 2048]` and `[2048, 4096]`, Q6_K
    /// `[16384, 2048]`, 64 MB in all, one token), GB/s. `None` in calibrations made before it
    /// existed: the plan then uses `matvec_gbps`.
    #[serde(default)]
    pub dense_matvec_gbps: Option<f64>,
    /// Quantized GEMM rate for prefill (candle Q4_K, `[512, 2048] × [2304, 2048]ᵀ`), GFLOP/s.
    pub gemm_gflops: f64,
    pub threads: usize,
}

impl Bandwidths {
    /// Used when nothing was measured: a SATA-class SSD and a modest 2-core machine.
    pub const DEFAULTS: Bandwidths = Bandwidths {
        drive_gbps: 1.0,
        ram_gbps: 20.0,
        matvec_gbps: 8.0,
        dense_matvec_gbps: None,
        gemm_gflops: 200.0,
        threads: 2,
    };
}

/// Where the rates come from.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RatesSource {
    Calibrated { cache_file: String, device: String },
    Defaults,
}

/// The cache file.
pub fn cache_file() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("strata").join("calibration.json")
}

/// The key of the drive holding `path` (`dev<major>:<minor>`).
pub fn device_key(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(m) => {
            let d = m.dev();
            format!("dev{}:{}", (d >> 8) & 0xfff, (d & 0xff) | ((d >> 12) & 0xfff00))
        }
        Err(_) => "unknown".into(),
    }
}

/// Cached rates for the drive holding `model`, or the defaults.
pub fn load(model: &Path) -> (Bandwidths, RatesSource) {
    let file = cache_file();
    let key = device_key(model);
    let cached = std::fs::read_to_string(&file)
        .ok()
        .and_then(|s| {
            serde_json::from_str::<std::collections::BTreeMap<String, Bandwidths>>(&s).ok()
        })
        .and_then(|m| m.get(&key).copied());
    match cached {
        Some(b) => {
            (b, RatesSource::Calibrated { cache_file: file.display().to_string(), device: key })
        }
        None => (Bandwidths::DEFAULTS, RatesSource::Defaults),
    }
}

/// Stores `b` as the rates of `model`'s drive in [`cache_file`].
///
/// Errors: the cache file cannot be written.
pub fn save(model: &Path, b: Bandwidths) -> Result<(), String> {
    let path = cache_file();
    let mut all: std::collections::BTreeMap<String, Bandwidths> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    all.insert(device_key(model), b);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&all).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", path.display()))
}
