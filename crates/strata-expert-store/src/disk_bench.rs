//! `strata bench --disk FILE`: the drive's random-read bandwidth, like fio's `randread`: reads of
//! 1 and 4 MiB at 4 KiB-aligned random offsets, queue depth 1 to 64, through the page cache
//! (after `posix_fadvise(DONTNEED)` drops the file's cached pages) and with `O_DIRECT`. Expert
//! streaming figures are held against the best of these.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::io::{IoEngine, ReadJob, DIRECT_ALIGN};
use crate::slab::Slab;

/// One configuration's result.
#[derive(Debug, Clone, Serialize)]
pub struct DiskResult {
    pub direct: bool,
    pub block_bytes: usize,
    pub queue_depth: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
}

/// Asks the kernel to drop `path`'s clean cached pages (no root needed).
pub fn drop_file_cache(path: &Path) -> Result<(), String> {
    use std::os::unix::io::AsRawFd;
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: a valid descriptor; the call only advises the page cache.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(format!("{}: posix_fadvise failed ({r})", path.display()));
    }
    Ok(())
}

/// Runs every configuration for about `per_config` each. Errors: the file is smaller than 8 MiB,
/// cannot be opened, or a read fails.
pub fn bench_disk(
    path: &Path,
    block_sizes: &[usize],
    depths: &[usize],
    direct_modes: &[bool],
    per_config: Duration,
) -> Result<Vec<DiskResult>, String> {
    let len = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.len();
    let max_block = block_sizes.iter().copied().max().unwrap_or(1 << 20);
    if len < (8 << 20).max(2 * max_block as u64) {
        return Err(format!(
            "{}: {len} bytes is too small to measure a drive (use a file of a few GB)",
            path.display()
        ));
    }
    let max_qd = depths.iter().copied().max().unwrap_or(1);
    let slab = Slab::new(max_qd * 4, max_block)?;
    let slots: Vec<_> = (0..max_qd * 4).map_while(|_| slab.try_acquire()).collect();
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut results = Vec::new();
    for &direct in direct_modes {
        for &bs in block_sizes {
            for &qd in depths {
                drop_file_cache(path)?;
                let io = IoEngine::open(&[path.to_path_buf()], qd, direct)?;
                let (t0, mut bytes) = (Instant::now(), 0u64);
                while t0.elapsed() < per_config {
                    let jobs: Vec<ReadJob> = slots[..qd * 4]
                        .iter()
                        .map(|s| {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let offset = rng % ((len - bs as u64) / DIRECT_ALIGN as u64)
                                * DIRECT_ALIGN as u64;
                            ReadJob { file: 0, offset, len: bs, need: bs, dst: s.as_mut_ptr() }
                        })
                        .collect();
                    io.submit(jobs, crate::io::Priority::Demand).wait()?;
                    bytes += (qd * 4 * bs) as u64;
                }
                let seconds = t0.elapsed().as_secs_f64();
                results.push(DiskResult {
                    direct,
                    block_bytes: bs,
                    queue_depth: qd,
                    bytes,
                    seconds,
                    gbps: bytes as f64 / seconds / 1e9,
                });
            }
        }
    }
    Ok(results)
}
