//! Speculative-decoding counters of one generation (CLI stats line, `--json`, `/metrics`, the
//! server's per-request log).

use serde::Serialize;

/// Counters over the rounds of one generation. A round is one target verify pass (a plain decode
/// step when it drafted nothing).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SpecStats {
    /// Draft source: `draft-model`, `ngram` or `self`.
    pub source: String,
    pub rounds: u64,
    /// Draft tokens proposed and verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Wall-clock ms spent drafting and verifying.
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// `n_hist[N]`: rounds that drafted N tokens.
    pub n_hist: Vec<u64>,
    /// Streamed experts: sum over verify passes of the mean distinct experts per MoE layer, and the
    /// number of passes summed (fan-out of the union of the pass's tokens' experts).
    pub fanout_sum: f64,
    pub fanout_passes: u64,
}

impl SpecStats {
    pub fn new(source: &str, max_draft: usize) -> Self {
        Self { source: source.to_string(), n_hist: vec![0; max_draft + 1], ..Self::default() }
    }

    /// Accepted ÷ drafted.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Tokens emitted per round (accepted drafts + the target's own token): the mean acceptance
    /// length of the speculative-decoding literature.
    pub fn mean_accepted_length(&self) -> f64 {
        (self.accepted + self.rounds) as f64 / self.rounds.max(1) as f64
    }

    /// Mean distinct experts per MoE layer per verify pass (streamed experts only).
    pub fn mean_fanout(&self) -> Option<f64> {
        (self.fanout_passes > 0).then(|| self.fanout_sum / self.fanout_passes as f64)
    }

    pub fn record(
        &mut self,
        drafted: usize,
        accepted: usize,
        draft_ms: f64,
        verify_ms: f64,
        fanout: Option<f64>,
    ) {
        self.rounds += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.draft_ms += draft_ms;
        self.verify_ms += verify_ms;
        if drafted >= self.n_hist.len() {
            self.n_hist.resize(drafted + 1, 0);
        }
        self.n_hist[drafted] += 1;
        if let Some(f) = fanout {
            self.fanout_sum += f;
            self.fanout_passes += 1;
        }
    }

    /// One line for the CLI: `spec ngram: acceptance 62% (124/200), 3.1 tokens/round, draft 1 ms,
    /// verify 900 ms, N histogram 0:3 2:10 4:40, fan-out 21.4 experts/layer`.
    pub fn summary(&self) -> String {
        let hist: Vec<String> = self
            .n_hist
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(n, c)| format!("{n}:{c}"))
            .collect();
        let mut s = format!(
            "spec {}: acceptance {:.0}% ({}/{}), {:.2} tokens/round over {} rounds, draft {:.0} ms, verify {:.0} ms, N histogram {}",
            self.source,
            100.0 * self.acceptance_rate(),
            self.accepted,
            self.drafted,
            self.mean_accepted_length(),
            self.rounds,
            self.draft_ms,
            self.verify_ms,
            hist.join(" ")
        );
        if let Some(f) = self.mean_fanout() {
            s += &format!(", fan-out {f:.1} experts/layer/pass");
        }
        s
    }
}
