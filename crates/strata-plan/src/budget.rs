//! Expert cache sizing, the one rule used by the plan (host and VRAM), the host expert cache and
//! the VRAM expert tier: `--expert-cache` / `--gpu-expert-cache` is a size (`6GiB`, `512MiB`, `2G`,
//! `1000000`), a percentage of the model's expert bytes (`10%`), or `auto`: the
//! [`cache_room`] left in the memory after everything else resident and a reserve
//! ([`host_reserve`] in RAM, [`VRAM_RESERVE`] on a GPU), at most every expert.

use std::str::FromStr;

/// VRAM left free by the GPU expert tier's `auto` budget and by the plan on a GPU: activations,
/// the KV cache's growth, cuBLAS workspaces, the CUDA context.
pub const VRAM_RESERVE: u64 = 2 << 30;

/// RAM kept free by the plan and by `auto` host caches: 512 MiB + 5% of `available` bytes (the OS,
/// the page cache, activations and other processes).
pub fn host_reserve(available: u64) -> u64 {
    (512 << 20) + available / 20
}

/// Bytes an expert cache may take in a memory with `available` bytes once `fixed` bytes (dense
/// weights, KV cache, compute buffers — whatever the caller has counted) and `reserve` bytes are
/// set aside.
pub fn cache_room(available: u64, fixed: u64, reserve: u64) -> u64 {
    available.saturating_sub(fixed.saturating_add(reserve))
}

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
    /// Cache bytes for a model with `expert_bytes` of routed experts, given the `room` bytes
    /// ([`cache_room`]) that `auto` may take. `Bytes` is taken as asked (the caller warns when it
    /// exceeds `room`); `Percent` is a share of `expert_bytes`; `auto` is `room`, at most
    /// `expert_bytes`.
    pub fn resolve(self, expert_bytes: u64, room: u64) -> u64 {
        match self {
            Self::Bytes(b) => b,
            Self::Percent(p) => (expert_bytes as f64 * p / 100.0) as u64,
            Self::Auto => room.min(expert_bytes),
        }
    }
}

/// Experts a cache of `budget` holds, out of `experts` of `entry_bytes` each (memory per cached
/// expert), with `room` bytes for `auto`: `Percent` counts experts (a 10% cache holds 10% of them,
/// whatever their decoded size), the others divide [`CacheBudget::resolve`]'s bytes by
/// `entry_bytes`. At least `top_k + 1` (a decode step needs a layer's top-k experts at once plus
/// one slot to evict into), at most `experts`.
pub fn cache_entries(
    budget: CacheBudget,
    experts: usize,
    top_k: usize,
    entry_bytes: u64,
    room: u64,
) -> usize {
    let wanted = match budget {
        CacheBudget::Percent(p) => (experts as f64 * p / 100.0).ceil() as usize,
        b => (b.resolve(experts as u64 * entry_bytes, room) / entry_bytes.max(1)) as usize,
    };
    wanted.clamp((top_k + 1).min(experts), experts.max(1))
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
        assert_eq!(CacheBudget::Percent(10.0).resolve(1000, 0), 100);
        // auto: 4 GiB available, 1 GiB dense, reserve 512 MiB + 5% of 4 GiB.
        let room = cache_room(4 << 30, 1 << 30, host_reserve(4 << 30));
        assert_eq!(room, (3u64 << 30) - (512 << 20) - (4u64 << 30) / 20);
        assert_eq!(CacheBudget::Auto.resolve(1 << 40, room), room);
        assert_eq!(CacheBudget::Auto.resolve(1000, room), 1000);
        assert_eq!(cache_entries(CacheBudget::Percent(10.0), 128, 8, 100, 0), 13);
        assert_eq!(cache_entries(CacheBudget::Bytes(0), 128, 8, 100, 0), 9);
        assert_eq!(cache_entries(CacheBudget::Auto, 128, 8, 100, 5_000), 50);
        assert_eq!(cache_entries(CacheBudget::Auto, 128, 8, 100, 1 << 40), 128);
    }
}
