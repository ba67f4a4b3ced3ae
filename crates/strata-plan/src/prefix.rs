//! `serve --prefix-cache`: the bytes of finished requests' KV blocks kept for later requests that
//! share a prompt prefix — a size, or `auto`: what the plan leaves once everything else is
//! counted ([`auto_bytes`]).
//!
//! Peers: llama-server keeps prompts in host RAM up to `--cache-ram` (8192 MiB by default); vLLM
//! keeps finished sequences' KV blocks in whatever of its KV pool no running sequence holds.
//! A fixed 256 MiB default (before) held ~2,700 tokens of a 30B's f16 KV on an 80–141 GB GPU with
//! tens of GB unused (docs/performance.md, "A request's end no longer stalls the batch").

use std::str::FromStr;

use crate::budget::cache_room;
use crate::plan::{Plan, Strategy};

/// Most bytes `auto` gives the prefix cache: llama-server's `--cache-ram` default.
pub const AUTO_MAX: u64 = 8 << 30;

/// Most bytes `auto` gives the prefix cache when experts stream: there the memory left belongs
/// to the expert cache, whose hits save drive reads on every token (the default before `auto`).
pub const AUTO_STREAMING_MAX: u64 = 256 << 20;

/// What `--prefix-cache` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixCacheBudget {
    /// This many bytes (`0`: no prefix cache).
    Bytes(u64),
    /// Sized by the plan ([`auto_bytes`]).
    Auto,
}

impl FromStr for PrefixCacheBudget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        crate::parse_bytes(s).map(Self::Bytes)
    }
}

/// The prefix cache `auto` takes, from the plan made without one (`base`):
/// - resident (RAM or VRAM): half of the memory the plan leaves free — RAM: available minus
///   everything resident and the host reserve; VRAM: free minus everything resident and the VRAM
///   reserve — at most [`AUTO_MAX`];
/// - experts streaming (from the drive, or through the GPU tier): an eighth of the expert cache's
///   room, at most [`AUTO_STREAMING_MAX`];
/// - too large: none.
///
/// Half of the free memory, not all of it: the rest absorbs what the estimate misses
/// (allocator slack, another process) — the prefix cache fills only as requests end, so an
/// over-sized one would fail late, under load.
pub fn auto_bytes(base: &Plan) -> u64 {
    let m = &base.memory;
    match (base.strategy, &base.gpu) {
        (Strategy::TooLarge, _) => 0,
        (Strategy::Resident, Some(g)) => {
            (cache_room(g.memory.vram_free, g.vram_resident_total, 0) / 2).min(AUTO_MAX)
        }
        (Strategy::Resident, None) => {
            (cache_room(m.available, m.resident_total, m.reserve) / 2).min(AUTO_MAX)
        }
        (_, Some(g)) => {
            (cache_room(g.memory.vram_free, g.vram_fixed, 0) / 8).min(AUTO_STREAMING_MAX)
        }
        (_, None) => {
            let fixed = m.resident_total - m.expert_weights;
            (cache_room(m.available, fixed, m.reserve) / 8).min(AUTO_STREAMING_MAX)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_and_sizes() {
        assert_eq!("auto".parse::<PrefixCacheBudget>().unwrap(), PrefixCacheBudget::Auto);
        assert_eq!("AUTO".parse::<PrefixCacheBudget>().unwrap(), PrefixCacheBudget::Auto);
        assert_eq!("0".parse::<PrefixCacheBudget>().unwrap(), PrefixCacheBudget::Bytes(0));
        assert_eq!("2GiB".parse::<PrefixCacheBudget>().unwrap(), PrefixCacheBudget::Bytes(2 << 30));
        for bad in ["", "lots", "10%"] {
            assert!(bad.parse::<PrefixCacheBudget>().is_err(), "{bad}");
        }
    }
}
