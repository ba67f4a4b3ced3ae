//! Prometheus metrics (`GET /metrics`, text exposition format) via `prometheus-client`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
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
        Self { registry, requests, request_errors, prompt_tokens, generated_tokens, ttft, token_latency, queue_depth, active }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
