//! Prometheus metrics: decisions, hits, backend calls, in-flight requests,
//! listeners, reloads, and the rate-limit quota service.
//!
//! Label cardinality is bounded by the configuration, never by what clients
//! send: `domain` is a configured domain (or `_unknown`), `rule` the matched
//! rule's path, unless the rule opts in with `detailed_metric` or
//! `value_to_metric` (see [`MetricRule`]); those per-value series are
//! capped per rule ([`Metrics::with_max_values_per_rule`]), the excess
//! folded into one overflow series. The hot path resolves a `(domain, rule)`
//! pair to its counters once and then only bumps atomics, and never waits
//! for a scrape.
//!
//! Files: `decisions` holds the per-rule decision series, `calls` the
//! latency, in-flight and abandoned calls, `backend`, `listener`,
//! `config_loads` and `limiter` the metrics of each, `quota` RLQS's; this
//! file registers them all in one [`Metrics`] and encodes it. `statsd`,
//! `statsd_mapping`, `ratelimit_names` and `ratelimit_prometheus` export
//! the same counters under envoyproxy/ratelimit's names.

use std::sync::atomic::AtomicI64;
use std::sync::{Mutex, PoisonError};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod backend;
mod calls;
mod config_loads;
mod decisions;
mod limiter;
mod listener;
mod quota;
pub mod ratelimit_names;
pub mod ratelimit_prometheus;
pub mod statsd;
pub mod statsd_mapping;

pub use backend::BackendMetrics;
pub use calls::{DECISION_LATENCY_BUCKETS, InFlight, Method};
pub use decisions::{MetricResult, MetricRule};
pub use listener::ListenerMetrics;
pub use quota::{AssignmentKind, QuotaMetrics};

use backend::BackendFamilies;
use calls::CallMetrics;
use config_loads::ConfigLoadMetrics;
use decisions::DecisionMetrics;
use limiter::LimiterMetrics;
use listener::ListenerFamilies;

/// The `Content-Type` of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `domain` label of requests for a domain no config defines: one
/// series whatever names clients send.
pub const UNKNOWN_DOMAIN: &str = "_unknown";
/// The `rule` label of decisions in an unknown domain.
pub const UNKNOWN_RULE: &str = "_unknown";
/// The `rule` label of a RateLimitOverride (its keys come from the client).
pub const OVERRIDE_RULE: &str = "_override";
/// Appended (after `:`) to a rule's path to form the `rule` label that
/// per-value decisions fold into once the rule has its maximum of series.
pub const OVERFLOW_SUFFIX: &str = "_overflow";
/// Per-value series a rule may create unless configured otherwise.
pub const DEFAULT_MAX_VALUES_PER_RULE: usize = 10_000;

/// The `result` label of a reload (of the config, or of the TLS files).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: &'static str,
}

/// Every metric of the service, and its registry.
pub struct Metrics {
    /// Behind a lock only so that [`Metrics::observe_stored_counters`] can
    /// register late; taken per scrape, never per request.
    registry: Mutex<Registry>,
    decisions: DecisionMetrics,
    backends: BackendFamilies,
    calls: CallMetrics,
    config_loads: ConfigLoadMetrics,
    limiter: LimiterMetrics,
    listeners: ListenerFamilies,
    stored_counters: Gauge<i64, AtomicI64>,
    stored_source: Mutex<Option<CounterSource>>,
    quota: QuotaMetrics,
    /// Lines the statsd sink could not deliver, registered when it starts.
    statsd_dropped: Counter,
}

type CounterSource = Box<dyn Fn() -> u64 + Send + Sync>;

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Metrics with at most [`DEFAULT_MAX_VALUES_PER_RULE`] per-value series
    /// per rule.
    pub fn new() -> Self {
        Self::with_max_values_per_rule(DEFAULT_MAX_VALUES_PER_RULE)
    }

    /// Metrics where each rule with `detailed_metric` or `value_to_metric`
    /// creates at most `max` per-value `rule` labels; later values are
    /// counted under `<path>:_overflow`.
    pub fn with_max_values_per_rule(max: usize) -> Self {
        // The exposition writes metrics in this order (the decision
        // series, a collector, after all of them).
        let mut registry = Registry::with_prefix("throttlegate");
        let decisions = DecisionMetrics::register(&mut registry, max);
        let backends = BackendFamilies::register(&mut registry);
        let calls = CallMetrics::register(&mut registry);
        let config_loads = ConfigLoadMetrics::register(&mut registry);
        let limiter = LimiterMetrics::register(&mut registry);
        let listeners = ListenerFamilies::register(&mut registry);
        let quota = QuotaMetrics::register(&mut registry);
        Self {
            registry: Mutex::new(registry),
            decisions,
            backends,
            calls,
            config_loads,
            limiter,
            listeners,
            stored_counters: Gauge::default(),
            stored_source: Mutex::new(None),
            quota,
            statsd_dropped: Counter::default(),
        }
    }

    /// The rate-limit quota service's metrics.
    pub fn quota(&self) -> &QuotaMetrics {
        &self.quota
    }

    /// Exposes `throttlegate_memory_counters`, read from `source` at each
    /// scrape (so `source` must be cheap: no scan of every counter).
    pub fn observe_stored_counters(&self, source: impl Fn() -> u64 + Send + Sync + 'static) {
        let mut slot = self
            .stored_source
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            self.registry
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .register(
                    "memory_counters",
                    "Counters held by the in-memory backend, idle ones not yet swept included",
                    self.stored_counters.clone(),
                );
        }
        *slot = Some(Box::new(source));
    }

    /// The text exposition of every metric (OpenMetrics, [`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        if let Some(source) = &*self
            .stored_source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            self.stored_counters
                .set(i64::try_from(source()).unwrap_or(i64::MAX));
        }
        let mut text = String::new();
        let registry = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        prometheus_client::encoding::text::encode(&mut text, &registry)
            .expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests;
