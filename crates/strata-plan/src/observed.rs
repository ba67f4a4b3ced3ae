//! What previous runs of a model measured, so the next plan can use it: the routing locality (hit
//! rate at a cache size) and the compute time per decoded token. Recorded by `strata generate`
//! after each generation in `$XDG_CACHE_HOME/strata/observed.json` (else `~/.cache/...`), keyed by
//! the model file's path, size and modification time.
//!
//! A measured hit rate predicts this model's routing better than the typical curve
//! ([`crate::hit_curve`]); misses are scaled to another cache size along that curve's shape
//! (`f` = cached share of the experts), which keeps `miss(1) = 0`. The hit rate recorded is the
//! byte hit rate, `1 − bytes read ÷ expert bytes touched`: a prefetched expert is a cache hit but
//! its read still took the drive's time, and a wasted prefetch read counts too. How much read
//! time prefetch hid behind compute (`hidden_read_ms_per_token`) is kept so that the estimate
//! charges only the rest as stalls. Compute time is kept apart for streamed runs (where the reads'
//! CPU work, page-cache copies included, counts as compute) and resident ones.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One model's measurements.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Observed {
    /// Share of the experts the cache held (streaming runs; 1.0 when resident).
    pub cache_fraction: f64,
    /// Decode-phase byte hit rate: `1 − bytes read ÷ expert bytes touched` (prefetch reads,
    /// wasted ones included, count as reads).
    pub hit_rate: f64,
    /// Read time per decoded token (bytes read ÷ the calibrated drive rate, ms) that did not
    /// stall decoding: hidden behind compute by prefetch. 0 without prefetch.
    #[serde(default)]
    pub hidden_read_ms_per_token: f64,
    /// Decode wall time minus I/O stalls, per token, ms, of the latest streaming run (of a
    /// resident run while none streamed).
    pub compute_ms_per_token: f64,
    /// The same for resident runs (the best seen), if any ran.
    #[serde(default)]
    pub resident_compute_ms_per_token: Option<f64>,
    /// Decoded tokens behind these figures.
    pub tokens: u64,
}

fn file() -> PathBuf {
    crate::calibrate::cache_file().with_file_name("observed.json")
}

/// The key of a model: canonical path, size and mtime (a replaced file starts afresh).
pub fn model_key(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let canon = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    match std::fs::metadata(&canon) {
        Ok(m) => format!("{}|{}|{}", canon.display(), m.size(), m.mtime()),
        Err(_) => canon.display().to_string(),
    }
}

fn read_all() -> BTreeMap<String, Observed> {
    std::fs::read_to_string(file())
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default()
}

/// What was measured for `model`, if anything.
pub fn load(model: &Path) -> Option<Observed> {
    read_all().get(&model_key(model)).copied()
}

/// Records a run (≥ 8 decoded tokens): the hit rate of the latest streaming run at its cache size
/// (a resident run says nothing about locality and keeps the previous one), the best compute time
/// seen. Errors: the cache file cannot be written.
pub fn record(model: &Path, run: Observed) -> Result<(), String> {
    if run.tokens < 8 {
        return Ok(());
    }
    let mut all = read_all();
    let key = model_key(model);
    let merged = match all.get(&key) {
        Some(old) => {
            let streamed = run.cache_fraction < 1.0;
            let locality = if streamed { run } else { *old };
            let resident = match (old.resident_compute_ms_per_token, streamed) {
                (Some(r), false) => Some(r.min(run.compute_ms_per_token)),
                (None, false) => Some(run.compute_ms_per_token),
                (r, true) => r,
            };
            let old_streamed = old.cache_fraction < 1.0;
            Observed {
                cache_fraction: locality.cache_fraction,
                hit_rate: locality.hit_rate,
                hidden_read_ms_per_token: locality.hidden_read_ms_per_token,
                compute_ms_per_token: if streamed || !old_streamed {
                    run.compute_ms_per_token
                } else {
                    old.compute_ms_per_token
                },
                resident_compute_ms_per_token: resident,
                tokens: old.tokens + run.tokens,
            }
        }
        None => Observed {
            resident_compute_ms_per_token: (run.cache_fraction >= 1.0)
                .then_some(run.compute_ms_per_token),
            ..run
        },
    };
    all.insert(key, merged);
    let path = file();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // Write and rename: concurrent runs never leave a half-written file.
    let tmp = path.with_extension(format!("json.{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string_pretty(&all).unwrap_or_default())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The miss rate expected at cache share `f`, scaled from an observation along the typical hit
/// curve ([`crate::hit_curve`]).
pub fn miss_rate_at(o: &Observed, f: f64) -> f64 {
    if o.cache_fraction >= 1.0 {
        // Only resident runs seen: nothing measured about routing.
        return 1.0 - crate::hit_curve::typical_hit_rate(f);
    }
    crate::hit_curve::scaled_miss_rate((1.0 - o.hit_rate).clamp(0.0, 1.0), o.cache_fraction, f)
}
