//! N-gram draft: prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding;
//! vLLM's `ngram` speculator with `prompt_lookup_max` / `prompt_lookup_min`). The last `n` tokens of
//! the context (prompt and generated text) are searched for earlier in the context, longest `n`
//! first (`max` down to `min`), most recent occurrence first; the tokens that followed that
//! occurrence are the draft. Costs no model forward, so it pays on input-grounded tasks (editing,
//! summarising, code rewriting) where the output copies spans of the input.

/// N-gram lookup parameters (`--ngram-max`, `--ngram-min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramParams {
    /// Longest suffix matched, in tokens.
    pub max: usize,
    /// Shortest suffix matched, in tokens.
    pub min: usize,
}

impl Default for NgramParams {
    fn default() -> Self {
        Self { max: 3, min: 2 }
    }
}

/// Up to `n` tokens proposed to follow `context` (empty when no suffix of length `min..=max`
/// occurs earlier).
pub fn propose(context: &[u32], n: usize, params: NgramParams) -> Vec<u32> {
    let len = context.len();
    if n == 0 {
        return Vec::new();
    }
    for size in (params.min.max(1)..=params.max).rev() {
        if size >= len {
            continue;
        }
        let key = &context[len - size..];
        // Most recent earlier occurrence that has at least one token after it.
        for start in (0..len - size).rev() {
            if &context[start..start + size] == key {
                let from = start + size;
                return context[from..(from + n).min(len)].to_vec();
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_most_recent_match_wins() {
        // ... 1 2 3 [4 5] ... 9 2 3 [7 8] ... 2 3 → the 3-gram "1 2 3"? no: suffix is "x 2 3".
        let ctx = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 1, 2, 3];
        let p = NgramParams { max: 3, min: 1 };
        // "1 2 3" occurs at 0 → continuation 4 5 6.
        assert_eq!(propose(&ctx, 3, p), vec![4, 5, 6]);
        // With max 2, "2 3" most recently at 7 → 7 8 0.
        assert_eq!(propose(&ctx, 3, NgramParams { max: 2, min: 1 }), vec![7, 8, 0]);
        // Continuation is cut at the end of the context.
        assert_eq!(propose(&[5, 6, 5], 4, p), vec![6, 5]);
        assert!(propose(&[1, 2, 3], 4, p).is_empty());
        assert!(propose(&ctx, 0, p).is_empty());
    }
}
