//! The machine's memory as the plan sees it: RAM total and available, and the cgroup limit when one
//! applies (containers are common). `STRATA_RAM_BYTES` or `--ram` simulate a machine with that much
//! RAM (tests, "what if" plans).

use serde::Serialize;

/// Memory figures in bytes.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct SystemMemory {
    /// Physical RAM (`MemTotal`).
    pub ram_total: u64,
    /// What this process may still use: `MemAvailable`, capped by the cgroup's headroom.
    pub available: u64,
    /// The cgroup memory limit, when one applies.
    pub cgroup_limit: Option<u64>,
    /// True when the figures come from an override, not the machine.
    pub simulated: bool,
}

impl SystemMemory {
    /// Detects the machine's figures, or uses `ram_override` (else `STRATA_RAM_BYTES`) as both
    /// total and available memory.
    pub fn detect(ram_override: Option<u64>) -> Self {
        let env = std::env::var("STRATA_RAM_BYTES")
            .ok()
            .and_then(|v| crate::budget::parse_bytes(&v).ok());
        if let Some(r) = ram_override.or(env) {
            return Self { ram_total: r, available: r, cgroup_limit: None, simulated: true };
        }
        let total = proc_kb_field("/proc/meminfo", "MemTotal:").unwrap_or(8 << 30);
        let available = available_memory().unwrap_or(total / 2);
        Self { ram_total: total, available, cgroup_limit: cgroup_limit(), simulated: false }
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

/// This process's resident set size now and at its peak (`VmRSS`, `VmHWM` of `/proc/self/status`),
/// bytes.
pub fn process_rss() -> Option<(u64, u64)> {
    Some((
        proc_kb_field("/proc/self/status", "VmRSS:")?,
        proc_kb_field("/proc/self/status", "VmHWM:")?,
    ))
}
