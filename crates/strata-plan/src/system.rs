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
            .and_then(|v| strata_expert_store::parse_bytes(&v).ok());
        if let Some(r) = ram_override.or(env) {
            return Self { ram_total: r, available: r, cgroup_limit: None, simulated: true };
        }
        let total = strata_expert_store::budget::proc_kb_field("/proc/meminfo", "MemTotal:")
            .unwrap_or(8 << 30);
        let available = strata_expert_store::available_memory().unwrap_or(total / 2);
        Self {
            ram_total: total,
            available,
            cgroup_limit: strata_expert_store::budget::cgroup_limit(),
            simulated: false,
        }
    }
}
