//! Prometheus metrics (`GET /metrics`, text exposition format) via `prometheus-client`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use strata_engine::batch::{PrefixStats, StepStats};
use strata_engine::{ExpertStats, SpecStats};

/// Expert-streaming counters, copied from the provider's cumulative [`ExpertStats`] at scrape time.
#[derive(Default)]
pub struct ExpertMetrics {
    hits: Counter,
    misses: Counter,
    read_bytes: Counter,
    reads: Counter,
    touched_bytes: Counter,
    prefetch_reads: Counter,
    prefetch_used: Counter,
    prefetch_candidates: Counter,
    prefetch_candidates_used: Counter,
    upload_bytes: Counter,
    stall_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    read_bytes_per_second: Gauge<f64, std::sync::atomic::AtomicU64>,
    hit_rate: Gauge<f64, std::sync::atomic::AtomicU64>,
    last: std::sync::Mutex<ExpertStats>,
}

impl ExpertMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "expert_cache_hits",
            "Routed-expert lookups served from the expert cache",
            self.hits.clone(),
        );
        r.register(
            "expert_cache_misses",
            "Routed-expert lookups that waited for a read",
            self.misses.clone(),
        );
        r.register(
            "expert_read_bytes",
            "Bytes of expert weights read from the model files",
            self.read_bytes.clone(),
        );
        r.register("expert_reads", "Expert read requests issued", self.reads.clone());
        r.register(
            "expert_touched_bytes",
            "Stored bytes of every routed expert used (hits and misses)",
            self.touched_bytes.clone(),
        );
        r.register(
            "expert_prefetch_reads",
            "Experts read ahead on a prediction of the next layer's routing",
            self.prefetch_reads.clone(),
        );
        r.register(
            "expert_prefetch_used",
            "Experts read ahead that the layer then used",
            self.prefetch_used.clone(),
        );
        r.register("expert_prefetch_candidates", "Predicted experts the cache lacked (read ahead or, with the prefetch gate closed, not)", self.prefetch_candidates.clone());
        r.register(
            "expert_prefetch_candidates_used",
            "Predicted uncached experts the layer then used",
            self.prefetch_candidates_used.clone(),
        );
        r.register(
            "expert_upload_bytes",
            "Bytes of experts copied from host memory to the GPU's expert cache",
            self.upload_bytes.clone(),
        );
        r.register(
            "expert_stall_seconds",
            "Time decode waited for expert reads",
            self.stall_seconds.clone(),
        );
        r.register(
            "ssd_read_bytes_per_second",
            "Achieved expert read rate while reads were in flight",
            self.read_bytes_per_second.clone(),
        );
        r.register(
            "expert_cache_hit_rate",
            "Fraction of expert lookups served from the cache",
            self.hit_rate.clone(),
        );
    }

    /// Advances the counters to `now` (the provider's cumulative figures).
    pub fn observe(&self, now: ExpertStats) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let d = now.since(&last);
        self.hits.inc_by(d.hits);
        self.misses.inc_by(d.misses);
        self.read_bytes.inc_by(d.bytes_read);
        self.reads.inc_by(d.reads);
        self.touched_bytes.inc_by(d.touched_bytes);
        self.prefetch_reads.inc_by(d.prefetch_reads);
        self.prefetch_used.inc_by(d.prefetch_used);
        self.prefetch_candidates.inc_by(d.prefetch_candidates);
        self.prefetch_candidates_used.inc_by(d.prefetch_candidates_used);
        self.upload_bytes.inc_by(d.upload_bytes);
        self.stall_seconds.inc_by(d.stall_ns as f64 / 1e9);
        self.read_bytes_per_second.set(now.read_gbps() * 1e9);
        self.hit_rate.set(now.hit_rate());
        *last = now;
    }
}

/// Speculative-decoding counters, summed over finished requests.
pub struct SpecMetrics {
    rounds: Counter,
    drafted: Counter,
    accepted: Counter,
    draft_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    verify_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    fanout: Histogram,
    acceptance_rate: Gauge<f64, std::sync::atomic::AtomicU64>,
    mean_accepted_length: Gauge<f64, std::sync::atomic::AtomicU64>,
    draft_len: Histogram,
}

impl SpecMetrics {
    fn new() -> Self {
        Self {
            rounds: Counter::default(),
            drafted: Counter::default(),
            accepted: Counter::default(),
            draft_seconds: Counter::default(),
            verify_seconds: Counter::default(),
            fanout: Histogram::new(exponential_buckets(1.0, 1.5, 14)),
            acceptance_rate: Gauge::default(),
            mean_accepted_length: Gauge::default(),
            draft_len: Histogram::new([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 31.0]),
        }
    }

    fn register(&self, r: &mut Registry) {
        r.register("spec_rounds", "Speculative rounds (target verify passes)", self.rounds.clone());
        r.register("spec_draft_tokens", "Draft tokens proposed and verified", self.drafted.clone());
        r.register("spec_accepted_tokens", "Draft tokens accepted", self.accepted.clone());
        r.register("spec_draft_seconds", "Time spent drafting", self.draft_seconds.clone());
        r.register(
            "spec_verify_seconds",
            "Time spent in target verify passes",
            self.verify_seconds.clone(),
        );
        r.register(
            "spec_acceptance_rate",
            "Accepted / drafted tokens since start",
            self.acceptance_rate.clone(),
        );
        r.register(
            "spec_mean_accepted_length",
            "Tokens emitted per round since start",
            self.mean_accepted_length.clone(),
        );
        r.register(
            "spec_draft_length",
            "Draft tokens chosen per round (N)",
            self.draft_len.clone(),
        );
        r.register(
            "spec_expert_fanout",
            "Mean distinct experts per MoE layer per verify pass, per request",
            self.fanout.clone(),
        );
    }

    /// Adds a finished request's counters.
    pub fn observe(&self, s: &SpecStats) {
        self.rounds.inc_by(s.rounds);
        self.drafted.inc_by(s.drafted);
        self.accepted.inc_by(s.accepted);
        self.draft_seconds.inc_by(s.draft_ms / 1e3);
        self.verify_seconds.inc_by(s.verify_ms / 1e3);
        for (n, &c) in s.n_hist.iter().enumerate() {
            for _ in 0..c {
                self.draft_len.observe(n as f64);
            }
        }
        if let Some(f) = s.mean_fanout() {
            self.fanout.observe(f);
        }
        // Since start: the counters' totals through SpecStats' own formulas.
        let total = SpecStats {
            rounds: self.rounds.get(),
            drafted: self.drafted.get(),
            accepted: self.accepted.get(),
            ..SpecStats::default()
        };
        self.acceptance_rate.set(total.acceptance_rate());
        self.mean_accepted_length.set(total.mean_accepted_length());
    }
}

/// Continuous-batching figures, updated after every step of the batch thread.
#[derive(Clone)]
pub struct BatchMetrics {
    steps: Counter,
    batch_size: Histogram,
    batch_rows: Histogram,
    generated: Counter,
    expert_read_bytes: Counter,
    distinct_experts: Gauge<f64, std::sync::atomic::AtomicU64>,
    read_bytes_per_token: Gauge<f64, std::sync::atomic::AtomicU64>,
    prefix_lookups: Counter,
    prefix_hits: Counter,
    prefix_reused_tokens: Counter,
    prefix_bytes: Gauge,
    last_prefix: std::sync::Arc<std::sync::Mutex<PrefixStats>>,
}

impl Default for BatchMetrics {
    fn default() -> Self {
        Self {
            steps: Counter::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            generated: Counter::default(),
            expert_read_bytes: Counter::default(),
            distinct_experts: Gauge::default(),
            read_bytes_per_token: Gauge::default(),
            prefix_lookups: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_reused_tokens: Counter::default(),
            prefix_bytes: Gauge::default(),
            last_prefix: Default::default(),
        }
    }
}

impl BatchMetrics {
    fn register(&self, r: &mut Registry) {
        r.register("batch_steps", "Forward passes of the batch thread", self.steps.clone());
        r.register(
            "batch_size",
            "Sequences per forward pass (decoding and prefilling)",
            self.batch_size.clone(),
        );
        r.register("batch_rows", "Tokens per forward pass", self.batch_rows.clone());
        r.register(
            "batch_generated_tokens",
            "Tokens generated by batched passes",
            self.generated.clone(),
        );
        r.register(
            "batch_expert_read_bytes",
            "Expert bytes read from the drive during batched passes",
            self.expert_read_bytes.clone(),
        );
        r.register(
            "batch_distinct_experts_per_layer",
            "Distinct routed experts per MoE layer in the last pass (the batch's union)",
            self.distinct_experts.clone(),
        );
        r.register(
            "expert_read_bytes_per_generated_token",
            "Expert bytes read from the drive per generated token, since start",
            self.read_bytes_per_token.clone(),
        );
        r.register(
            "prefix_cache_lookups",
            "Requests that looked for a cached prompt prefix",
            self.prefix_lookups.clone(),
        );
        r.register("prefix_cache_hits", "Requests that found one", self.prefix_hits.clone());
        r.register(
            "prefix_cache_reused_tokens",
            "Prompt tokens not prefilled thanks to the prefix cache",
            self.prefix_reused_tokens.clone(),
        );
        r.register("prefix_cache_bytes", "Bytes the prefix cache holds", self.prefix_bytes.clone());
    }

    /// Adds one step's figures and the prefix cache's cumulative counters.
    pub fn observe(&self, st: &StepStats, prefix: Option<PrefixStats>) {
        if st.sequences > 0 {
            self.steps.inc();
            self.batch_size.observe(st.sequences as f64);
            self.batch_rows.observe(st.rows as f64);
            self.generated.inc_by(st.generated as u64);
            self.expert_read_bytes.inc_by(st.expert_bytes_read);
            if st.distinct_experts_per_layer > 0.0 {
                self.distinct_experts.set(st.distinct_experts_per_layer);
            }
            let tokens = self.generated.get().max(1);
            self.read_bytes_per_token.set(self.expert_read_bytes.get() as f64 / tokens as f64);
        }
        if let Some(p) = prefix {
            let mut last = self.last_prefix.lock().unwrap_or_else(|e| e.into_inner());
            self.prefix_lookups.inc_by(p.lookups - last.lookups);
            self.prefix_hits.inc_by(p.hits - last.hits);
            self.prefix_reused_tokens.inc_by(p.reused_tokens - last.reused_tokens);
            self.prefix_bytes.set(p.bytes as i64);
            *last = p;
        }
    }
}

/// Requests that ended before their answer was complete.
#[derive(Clone, Default)]
pub struct Cancellations {
    /// The client closed the connection.
    pub by_client: Counter,
    /// The server shut down (the client got a `server_shutting_down` error).
    pub by_shutdown: Counter,
}

impl Cancellations {
    fn register(&self, r: &mut Registry) {
        r.register(
            "requests_cancelled_by_client",
            "Requests whose client went away before the answer was complete",
            self.by_client.clone(),
        );
        r.register(
            "requests_cut_by_shutdown",
            "Requests ended by a server shutdown (answered with a server_shutting_down error)",
            self.by_shutdown.clone(),
        );
    }
}

pub struct Metrics {
    registry: Registry,
    pub requests: Counter,
    pub request_errors: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    /// Seconds from request start to the first generated token.
    pub ttft: Histogram,
    /// Seconds per generated token (decode).
    pub token_latency: Histogram,
    pub queue_depth: Gauge,
    pub active: Gauge,
    pub cancellations: Cancellations,
    /// Registered only when experts are streamed.
    pub experts: ExpertMetrics,
    /// Registered only with speculative decoding.
    pub spec: SpecMetrics,
    /// Registered only when requests are batched.
    pub batch: BatchMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics; the expert-streaming family is registered when `streaming`, the speculative
    /// decoding family when `speculative`.
    pub fn with_families(streaming: bool, speculative: bool) -> Self {
        let mut m = Self::new();
        if !speculative {
            m.batch.register(&mut m.registry);
        }
        if streaming {
            m.experts.register(&mut m.registry);
        }
        if speculative {
            m.spec.register(&mut m.registry);
        }
        m
    }

    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("strata");
        let requests = Counter::default();
        let request_errors = Counter::default();
        let prompt_tokens = Counter::default();
        let generated_tokens = Counter::default();
        let ttft = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        let token_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        let queue_depth = Gauge::default();
        let active = Gauge::default();
        registry.register("requests", "Completion requests received", requests.clone());
        registry.register(
            "request_errors",
            "Completion requests answered with an error",
            request_errors.clone(),
        );
        registry.register("prompt_tokens", "Prompt tokens processed", prompt_tokens.clone());
        registry.register("generated_tokens", "Tokens generated", generated_tokens.clone());
        registry.register("time_to_first_token_seconds", "Time to first token", ttft.clone());
        registry.register(
            "token_latency_seconds",
            "Decode time per generated token",
            token_latency.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for a sequence slot",
            queue_depth.clone(),
        );
        registry.register("active_requests", "Requests generating now", active.clone());
        let cancellations = Cancellations::default();
        cancellations.register(&mut registry);
        Self {
            registry,
            requests,
            request_errors,
            prompt_tokens,
            generated_tokens,
            ttft,
            token_latency,
            queue_depth,
            active,
            cancellations,
            experts: ExpertMetrics::default(),
            spec: SpecMetrics::new(),
            batch: BatchMetrics::default(),
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
