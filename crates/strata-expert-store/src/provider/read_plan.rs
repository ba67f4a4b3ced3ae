//! How one expert's bytes are read into its slot: coalesced (buffered) or aligned (O_DIRECT)
//! reads, split into pieces when `--read-chunk` asks, then moved in place.

use strata_formats::ExpertExtent;

use crate::io::DIRECT_ALIGN;
use crate::slab::Slot;

/// Splits the read `(offset, len, need, slot offset)` into pieces of at most `chunk` bytes
/// (`chunk` 0: one piece). Each piece's `need` is the part of the original `need` it covers.
pub(super) fn pieces(
    offset: u64,
    len: usize,
    need: usize,
    at: usize,
    chunk: usize,
) -> Vec<(u64, usize, usize, usize)> {
    if chunk == 0 || len <= chunk {
        return vec![(offset, len, need, at)];
    }
    (0..len)
        .step_by(chunk)
        .map(|s| {
            let l = chunk.min(len - s);
            (offset + s as u64, l, need.saturating_sub(s).min(l), at + s)
        })
        .collect()
}

/// How one expert is read into its slot: jobs (file, offset, len, need, slot offset) and the moves
/// that put the data in place afterwards (src, dst, len), in ascending `dst`. After them gate, up
/// and down lie at slot offsets 0, G and G+U.
#[derive(Debug, Clone, Default)]
pub(super) struct ReadPlan {
    pub(super) jobs: Vec<(usize, u64, usize, usize, usize)>,
    pub(super) moves: Vec<(usize, usize, usize)>,
    /// Moves can run in place (every `src >= dst`); otherwise they copy from a snapshot.
    pub(super) in_place: bool,
    /// Slot bytes the plan uses.
    pub(super) span: usize,
}

/// Parts of one expert at most this far apart in a file are read as one range (the gap is read
/// and dropped): one request instead of two (`strata repack`'s alignment padding, safetensors'
/// headers between tensors).
pub(super) const MAX_GAP: u64 = 4096;

impl ReadPlan {
    /// Parts in the same file, taken in file order (safetensors stores `down_proj` before
    /// `gate_proj` and `up_proj`) and at most [`MAX_GAP`] apart, become one read; with `direct`,
    /// every read is widened to [`DIRECT_ALIGN`] in offset and length.
    pub(super) fn new(extent: &ExpertExtent, direct: bool) -> Self {
        struct Run {
            file: usize,
            start: u64,
            end: u64,
            /// (file offset, len, final slot offset)
            parts: Vec<(u64, usize, usize)>,
        }
        let mut parts: Vec<(usize, u64, usize, usize)> = Vec::new(); // file, offset, len, final slot offset
        let mut dst = 0usize;
        for p in &extent.parts {
            parts.push((p.file, p.offset, p.len as usize, dst));
            dst += p.len as usize;
        }
        parts.sort_by_key(|p| (p.0, p.1));
        let mut runs: Vec<Run> = Vec::new();
        for (file, offset, len, at) in parts {
            match runs.last_mut() {
                Some(r) if r.file == file && offset >= r.end && offset - r.end <= MAX_GAP => {
                    r.end = offset + len as u64;
                    r.parts.push((offset, len, at));
                }
                _ => runs.push(Run {
                    file,
                    start: offset,
                    end: offset + len as u64,
                    parts: vec![(offset, len, at)],
                }),
            }
        }
        let mut plan = ReadPlan::default();
        let mut cursor = 0usize;
        for r in runs {
            let start =
                if direct { r.start / DIRECT_ALIGN as u64 * DIRECT_ALIGN as u64 } else { r.start };
            let need = (r.end - start) as usize;
            let len = if direct { need.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN } else { need };
            plan.jobs.push((r.file, start, len, need, cursor));
            for (offset, plen, at) in r.parts {
                let src = cursor + (offset - start) as usize;
                if src != at {
                    plan.moves.push((src, at, plen));
                }
            }
            cursor += len;
        }
        // In ascending `dst` with every `src >= dst`, a move never overwrites a later move's source
        // (destinations are disjoint and each lies below the next one's).
        plan.moves.sort_by_key(|m| m.1);
        plan.in_place = plan.moves.iter().all(|m| m.0 >= m.1);
        plan.span = cursor.max(dst);
        plan
    }

    /// Applies the moves to a slot whose reads completed.
    pub(super) fn place(&self, slot: &mut Slot) {
        if self.in_place {
            for &(src, dst, len) in &self.moves {
                slot.copy_within(src, dst, len);
            }
        } else {
            let snapshot = slot.as_ref()[..self.span].to_vec();
            for &(src, dst, len) in &self.moves {
                slot.write(dst, &snapshot[src..src + len]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slab::Slab;
    use strata_formats::ByteRange;
    use strata_formats::ExpertEncoding;

    fn extent(parts: [(usize, u64, u64); 3]) -> ExpertExtent {
        ExpertExtent {
            parts: parts.map(|(file, offset, len)| ByteRange { file, offset, len }),
            encodings: [ExpertEncoding::Float(candle_core::DType::F32); 3],
        }
    }

    #[test]
    fn buffered_plan_coalesces_close_ranges() {
        // Adjacent: one read, nothing moves.
        let p = ReadPlan::new(&extent([(0, 100, 10), (0, 110, 10), (0, 120, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 27, 27, 0)]);
        assert!(p.moves.is_empty());
        assert_eq!(p.span, 27);
        // Small gaps are read and compacted away.
        let p = ReadPlan::new(&extent([(0, 100, 10), (0, 120, 10), (0, 500, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 407, 407, 0)]);
        assert_eq!(p.moves, vec![(20, 10, 10), (400, 20, 7)]);
        assert_eq!(p.span, 407);
        // Another file, a range behind the previous one, or a gap over MAX_GAP: separate reads.
        let p = ReadPlan::new(&extent([(0, 100, 10), (1, 110, 10), (1, 120, 7)]), false);
        assert_eq!(p.jobs, vec![(0, 100, 10, 10, 0), (1, 110, 17, 17, 10)]);
        // Parts are read in file order; far apart, they stay separate reads.
        let p =
            ReadPlan::new(&extent([(0, 9000, 10), (0, 100, 10), (0, 110 + MAX_GAP + 1, 7)]), false);
        assert_eq!(
            p.jobs,
            vec![(0, 100, 10, 10, 0), (0, 110 + MAX_GAP + 1, 7, 7, 10), (0, 9000, 10, 10, 17)]
        );
        assert_eq!(p.moves, vec![(17, 0, 10), (0, 10, 10), (10, 20, 7)]);
        assert!(!p.in_place);
    }

    #[test]
    fn safetensors_order_is_one_read_placed_through_a_snapshot() {
        // HF per-expert tensors: down_proj, gate_proj, up_proj back to back.
        let x = extent([(0, 1000, 100), (0, 1100, 100), (0, 900, 100)]);
        let p = ReadPlan::new(&x, false);
        assert_eq!(p.jobs, vec![(0, 900, 300, 300, 0)]);
        assert_eq!(p.moves, vec![(100, 0, 100), (200, 100, 100), (0, 200, 100)]);
        assert!(!p.in_place);
        let slab = Slab::new(1, 4096).unwrap();
        let mut slot = slab.try_acquire().unwrap();
        let file: Vec<u8> = (0..300).map(|i| (i / 100) as u8).collect(); // down=0, gate=1, up=2
        slot.write(0, &file);
        p.place(&mut slot);
        let want: Vec<u8> = [1u8, 2, 0].iter().flat_map(|&b| std::iter::repeat_n(b, 100)).collect();
        assert_eq!(&slot.as_ref()[..300], want.as_slice());
    }

    #[test]
    fn long_reads_split_into_pieces_that_cover_them() {
        assert_eq!(pieces(100, 10, 10, 0, 0), vec![(100, 10, 10, 0)]);
        assert_eq!(pieces(100, 10, 10, 0, 16), vec![(100, 10, 10, 0)]);
        assert_eq!(
            pieces(100, 10, 10, 5, 4),
            vec![(100, 4, 4, 5), (104, 4, 4, 9), (108, 2, 2, 13)]
        );
        // An aligned superset past the end of the file: the last pieces need less, or nothing.
        assert_eq!(
            pieces(0, 12288, 5000, 0, 4096),
            vec![(0, 4096, 4096, 0), (4096, 4096, 904, 4096), (8192, 4096, 0, 8192)]
        );
    }

    #[test]
    fn direct_plan_reads_aligned_supersets_and_compacts() {
        let p = ReadPlan::new(&extent([(0, 5000, 3000), (0, 20000, 100), (0, 8192, 4096)]), true);
        // 5000..8000 and 8192..12288 are 192 bytes apart: one aligned read 4096..12288.
        assert_eq!(p.jobs, vec![(0, 4096, 8192, 8192, 0), (0, 16384, 4096, 3716, 8192)]);
        assert_eq!(p.moves, vec![(904, 0, 3000), (8192 + 3616, 3000, 100), (4096, 3100, 4096)]);
        assert!(p.in_place);
        for (off, len, _, _, at) in p.jobs.iter().map(|j| (j.1, j.2, j.3, j.0, j.4)) {
            assert_eq!((off % 4096, len % 4096, at % 4096), (0, 0, 0));
        }
    }
}
