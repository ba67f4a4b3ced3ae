//! The expert cache's byte budget (`--expert-cache`): a size (`6GiB`, `512MiB`, `2G`, `1000000`),
//! a percentage of the model's expert bytes (`10%`), or `auto` (from available memory).

use std::str::FromStr;

/// VRAM left free by the GPU expert tier's `auto` budget and by the plan on a GPU: activations,
/// the KV cache's growth, cuBLAS workspaces, the CUDA context.
pub const VRAM_RESERVE: u64 = 2 << 30;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CacheBudget {
    Bytes(u64),
    /// Percent of the model's total routed-expert bytes.
    Percent(f64),
    /// Available memory (cgroup limit included) minus the dense weights and a reserve.
    Auto,
}

impl FromStr for CacheBudget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| format!("bad percentage `{s}`"))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(format!("expert cache percentage must be in (0, 100], got `{s}`"));
            }
            return Ok(Self::Percent(v));
        }
        parse_bytes(t).map(Self::Bytes)
    }
}

/// `123`, `4k`/`4KB`/`4KiB`, `5M`, `6G`, `1T` (powers of 1024 for every suffix, like llama.cpp and
/// most memory flags).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 =
        num.parse().map_err(|_| format!("bad size `{s}` (examples: 6GiB, 512MiB, 10%)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!("bad size unit `{other}` in `{s}` (examples: 6GiB, 512MiB, 10%)"))
        }
    };
    Ok((v * mult as f64) as u64)
}

impl CacheBudget {
    /// Bytes for a model with `expert_bytes` of routed experts and `dense_bytes` of everything
    /// else, given `available` bytes of memory.
    pub fn resolve(self, expert_bytes: u64, dense_bytes: u64, available: u64) -> u64 {
        match self {
            Self::Bytes(b) => b,
            Self::Percent(p) => (expert_bytes as f64 * p / 100.0) as u64,
            // Keep 1 GiB + 10% of what is left for the KV cache, activations and the OS.
            Self::Auto => {
                let left = available.saturating_sub(dense_bytes).saturating_sub(1 << 30);
                (left - left / 10).min(expert_bytes)
            }
        }
    }
}

/// Memory this process may still use (bytes): `MemAvailable` from `/proc/meminfo`, capped by the
/// cgroup (v2 `memory.max` or v1 `memory.limit_in_bytes`) limit minus its current usage.
pub fn available_memory() -> Option<u64> {
    let avail = proc_kb_field("/proc/meminfo", "MemAvailable:")?;
    Some(match cgroup_headroom() {
        Some(c) => avail.min(c),
        None => avail,
    })
}

/// The cgroup memory limit minus usage, when a limit applies: this process's own cgroup (from
/// `/proc/self/cgroup`), v2 `memory.max`/`memory.current` or v1
/// `memory.limit_in_bytes`/`memory.usage_in_bytes`.
pub fn cgroup_headroom() -> Option<u64> {
    cgroup_memory().map(|(limit, usage)| limit.saturating_sub(usage))
}

/// The cgroup memory limit of this process, when one applies.
pub fn cgroup_limit() -> Option<u64> {
    cgroup_memory().map(|(limit, _)| limit)
}

/// (limit, usage) of this process's memory cgroup, when it has a limit.
fn cgroup_memory() -> Option<(u64, u64)> {
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let groups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut candidates = Vec::new();
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) =
            (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or("/"));
        if controllers.split(',').any(|c| c == "memory") {
            candidates.push((
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
                format!("/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"),
            ));
        } else if controllers.is_empty() {
            candidates.push((
                format!("/sys/fs/cgroup{path}/memory.max"),
                format!("/sys/fs/cgroup{path}/memory.current"),
            ));
        }
    }
    // Inside a container the paths above may not exist: its own cgroup is mounted at the root.
    candidates.push(("/sys/fs/cgroup/memory.max".into(), "/sys/fs/cgroup/memory.current".into()));
    candidates.push((
        "/sys/fs/cgroup/memory/memory.limit_in_bytes".into(),
        "/sys/fs/cgroup/memory/memory.usage_in_bytes".into(),
    ));
    candidates.into_iter().find_map(|(limit, usage)| {
        let (limit, usage) = (read(&limit)?, read(&usage)?);
        // "no limit" reads as a huge number (v1) or fails to parse ("max", v2).
        (limit < 1 << 60).then_some((limit, usage))
    })
}

/// A `Key:   1234 kB` line of a `/proc` file (`/proc/meminfo`, `/proc/self/status`), in bytes.
pub fn proc_kb_field(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|v| v * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_and_percentages() {
        assert_eq!("6GiB".parse::<CacheBudget>().unwrap(), CacheBudget::Bytes(6 << 30));
        assert_eq!("512M".parse::<CacheBudget>().unwrap(), CacheBudget::Bytes(512 << 20));
        assert_eq!("1.5g".parse::<CacheBudget>().unwrap(), CacheBudget::Bytes(3 << 29));
        assert_eq!("4096".parse::<CacheBudget>().unwrap(), CacheBudget::Bytes(4096));
        assert_eq!("10%".parse::<CacheBudget>().unwrap(), CacheBudget::Percent(10.0));
        assert_eq!("auto".parse::<CacheBudget>().unwrap(), CacheBudget::Auto);
        for bad in ["", "x", "10 parsecs", "0%", "150%", "%"] {
            assert!(bad.parse::<CacheBudget>().is_err(), "{bad}");
        }
        assert_eq!(CacheBudget::Percent(10.0).resolve(1000, 0, 0), 100);
        assert_eq!(
            CacheBudget::Auto.resolve(1 << 40, 1 << 30, 4 << 30),
            (2u64 << 30) - (2u64 << 30) / 10
        );
    }
}

/// This process's resident set size now and at its peak (`VmRSS`, `VmHWM` of `/proc/self/status`),
/// bytes.
pub fn process_rss() -> Option<(u64, u64)> {
    Some((
        proc_kb_field("/proc/self/status", "VmRSS:")?,
        proc_kb_field("/proc/self/status", "VmHWM:")?,
    ))
}
