//! Stop strings over streamed text: text that could still turn into a stop string is held back, so
//! a client never sees a partial stop string (the behaviour of llama-server and vLLM).

/// Accumulates generated text and releases the part that can no longer be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What [`StopMatcher::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopScan {
    /// Text safe to emit (may be empty).
    Continue(String),
    /// A stop string matched: emit this text (up to the stop string), then finish.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        self.pending.push_str(text);
        if self.stops.is_empty() {
            return StopScan::Continue(std::mem::take(&mut self.pending));
        }
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopScan::Stopped(out);
        }
        // Hold back the longest suffix of `pending` that is a prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in self.pending.char_indices() {
                let suffix = &self.pending[i..];
                if s.starts_with(suffix) {
                    hold = hold.max(suffix.len());
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopScan::Continue(out)
    }

    /// Held-back text at the end of generation (no stop string completed).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_stop_and_cuts_at_match() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), StopScan::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopScan::Continue("".into()));
        assert_eq!(m.push("D tail"), StopScan::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("a E"), StopScan::Continue("a ".into()));
        assert_eq!(m.push("x"), StopScan::Continue("Ex".into()));
        assert_eq!(m.push("yy"), StopScan::Continue("yy".into()));
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(vec!["b".into(), "cd".into()]);
        assert_eq!(m.push("a cd b"), StopScan::Stopped("a ".into()));
    }
}
