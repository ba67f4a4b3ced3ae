//! Prometheus metrics (`GET /metrics`, text exposition format) via `prometheus-client`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use strata_engine::ExpertStats;

/// Expert-streaming counters, copied from the provider's cumulative [`ExpertStats`] at scrape time.
#[derive(Default)]
pub struct ExpertMetrics {
    hits: Counter,
    misses: Counter,
    read_bytes: Counter,
    reads: Counter,
    touched_bytes: Counter,
    stall_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    read_bytes_per_second: Gauge<f64, std::sync::atomic::AtomicU64>,
    hit_rate: Gauge<f64, std::sync::atomic::AtomicU64>,
    last: std::sync::Mutex<ExpertStats>,
}

impl ExpertMetrics {
    fn register(&self, r: &mut Registry) {
        r.register("expert_cache_hits", "Routed-expert lookups served from the expert cache", self.hits.clone());
        r.register("expert_cache_misses", "Routed-expert lookups that waited for a read", self.misses.clone());
        r.register("expert_read_bytes", "Bytes of expert weights read from the model files", self.read_bytes.clone());
        r.register("expert_reads", "Expert read requests issued", self.reads.clone());
        r.register("expert_touched_bytes", "Stored bytes of every routed expert used (hits and misses)", self.touched_bytes.clone());
        r.register("expert_stall_seconds", "Time decode waited for expert reads", self.stall_seconds.clone());
        r.register("ssd_read_bytes_per_second", "Achieved expert read rate while reads were in flight", self.read_bytes_per_second.clone());
        r.register("expert_cache_hit_rate", "Fraction of expert lookups served from the cache", self.hit_rate.clone());
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
        self.stall_seconds.inc_by(d.stall_ns as f64 / 1e9);
        self.read_bytes_per_second.set(now.read_gbps() * 1e9);
        self.hit_rate.set(now.hit_rate());
        *last = now;
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
    /// Registered only when experts are streamed.
    pub experts: ExpertMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics; the expert-streaming family is registered when `streaming`.
    pub fn with_experts(streaming: bool) -> Self {
        let mut m = Self::new();
        if streaming {
            m.experts.register(&mut m.registry);
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
        registry.register("request_errors", "Completion requests answered with an error", request_errors.clone());
        registry.register("prompt_tokens", "Prompt tokens processed", prompt_tokens.clone());
        registry.register("generated_tokens", "Tokens generated", generated_tokens.clone());
        registry.register("time_to_first_token_seconds", "Time to first token", ttft.clone());
        registry.register("token_latency_seconds", "Decode time per generated token", token_latency.clone());
        registry.register("queue_depth", "Requests waiting for a sequence slot", queue_depth.clone());
        registry.register("active_requests", "Requests generating now", active.clone());
        Self { registry, requests, request_errors, prompt_tokens, generated_tokens, ttft, token_latency, queue_depth, active, experts: ExpertMetrics::default() }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
