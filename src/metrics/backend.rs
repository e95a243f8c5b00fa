//! Backend call metrics: latency and failures, by backend and kind.
//!
//! Invariant: the limiter resolves a backend's series once
//! ([`Metrics::backend`]) and then only bumps them; a call that ran out of
//! its caller's time is not a backend failure (it is counted as abandoned).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::Metrics;
use crate::backends;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendErrorLabels {
    backend: &'static str,
    kind: &'static str,
}

/// The metrics of every backend, by label.
#[derive(Debug)]
pub(super) struct BackendFamilies {
    latency: Family<BackendLabels, Histogram, fn() -> Histogram>,
    errors: Family<BackendErrorLabels, Counter>,
    /// Failed backend calls of every backend and kind together.
    failures: Counter,
}

impl BackendFamilies {
    /// Registers `backend_latency` and `backend_errors`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let latency = Family::<BackendLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram,
        );
        registry.register_with_unit(
            "backend_latency",
            "Duration of one backend decision call",
            Unit::Seconds,
            latency.clone(),
        );
        let errors = Family::<BackendErrorLabels, Counter>::default();
        registry.register(
            "backend_errors",
            "Failed backend calls by kind (timeout, unavailable, protocol, full, shed)",
            errors.clone(),
        );
        BackendFamilies {
            latency,
            errors,
            failures: Counter::default(),
        }
    }

    /// Failed calls of every backend (envoyproxy/ratelimit's `redis_error`).
    pub(super) fn failures(&self) -> u64 {
        self.failures.get()
    }
}

/// The pre-resolved metrics of one backend, for the limiter's hot path.
#[derive(Debug, Clone)]
pub struct BackendMetrics {
    latency: Histogram,
    timeout: Counter,
    unavailable: Counter,
    protocol: Counter,
    full: Counter,
    shed: Counter,
    /// Every failed call of every backend (envoyproxy/ratelimit's
    /// `redis_error`); not exposed in our own registry.
    failures: Counter,
}

impl BackendMetrics {
    /// Records how long one backend call took.
    pub fn observe_latency(&self, elapsed: Duration) {
        self.latency.observe(elapsed.as_secs_f64());
    }

    /// Counts one failed backend call by its kind.
    pub fn record_error(&self, error: &backends::Error) {
        match error {
            backends::Error::Timeout(_) => self.timeout.inc(),
            backends::Error::Unavailable(_) => self.unavailable.inc(),
            backends::Error::Protocol(_) => self.protocol.inc(),
            backends::Error::Full(_) => self.full.inc(),
            backends::Error::Shed(_) => self.shed.inc(),
            // The caller's deadline, not the backend: counted as an
            // abandoned call (stage `deadline`) by the limiter.
            backends::Error::Deadline => return,
        };
        self.failures.inc();
    }
}

impl Metrics {
    /// The latency histogram and error counters of the backend `name`.
    pub fn backend(&self, name: &'static str) -> BackendMetrics {
        let families = &self.backends;
        let error = |kind| {
            families.errors.get_or_create_owned(&BackendErrorLabels {
                backend: name,
                kind,
            })
        };
        BackendMetrics {
            latency: families
                .latency
                .get_or_create_owned(&BackendLabels { backend: name }),
            timeout: error("timeout"),
            unavailable: error("unavailable"),
            protocol: error("protocol"),
            full: error("full"),
            shed: error("shed"),
            failures: families.failures.clone(),
        }
    }
}

/// 50 µs to about 1.6 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}
