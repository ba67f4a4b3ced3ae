//! What previous runs of a model measured, so the next plan can use it: the routing locality (hit
//! rate at a cache size) and the compute time per decoded token. Recorded by `strata generate`
//! after each generation in `$XDG_CACHE_HOME/strata/observed.json` (else `~/.cache/...`), keyed by
//! the model file's path, size and modification time.
//!
//! Uniform routing is a floor for the hit rate; real routing is more local (a measured synthetic
//! Qwen3-30B-A3B hit 94% with 21% of its experts cached), so a measured hit rate is the better
//! predictor. Misses are scaled to another cache size as `miss(f) = miss₀ · (1 − f) / (1 − f₀)`
//! (`f` = cached share of the experts), which keeps `miss(1) = 0`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One model's measurements.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Observed {
    /// Share of the experts the cache held (streaming runs; 1.0 when resident).
    pub cache_fraction: f64,
    /// Decode-phase expert cache hit rate.
    pub hit_rate: f64,
    /// Decode wall time minus I/O stalls, per token, ms (the best seen).
    pub compute_ms_per_token: f64,
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
    std::fs::read_to_string(file()).ok().and_then(|s| serde_json::from_str(&s).ok()).unwrap_or_default()
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
            let locality = if run.cache_fraction < 1.0 { run } else { *old };
            Observed {
                cache_fraction: locality.cache_fraction,
                hit_rate: locality.hit_rate,
                compute_ms_per_token: old.compute_ms_per_token.min(run.compute_ms_per_token),
                tokens: old.tokens + run.tokens,
            }
        }
        None => run,
    };
    all.insert(key, merged);
    let path = file();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    // Write and rename: concurrent runs never leave a half-written file.
    let tmp = path.with_extension(format!("json.{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string_pretty(&all).unwrap_or_default()).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The miss rate expected at cache share `f`, scaled from an observation.
pub fn miss_rate_at(o: &Observed, f: f64) -> f64 {
    let miss0 = (1.0 - o.hit_rate).clamp(0.0, 1.0);
    if o.cache_fraction >= 1.0 {
        return (1.0 - f).clamp(0.0, 1.0); // only resident runs seen: nothing known about locality
    }
    (miss0 * (1.0 - f) / (1.0 - o.cache_fraction)).clamp(0.0, 1.0 - f.min(1.0)).max(0.0)
}
