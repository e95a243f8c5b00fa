//! Metrics of calls as the transport sees them: how long each took to
//! answer, how many are in flight, and which got no decision in their
//! caller's time.
//!
//! Invariant: every `abandoned_calls` series (method × stage) exists from
//! the start, so `increase()` sees the first one; the in-flight gauge is
//! only moved by an [`InFlight`] guard, so it returns to 0.

use std::sync::atomic::AtomicI64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::Metrics;
use crate::backends;

/// The call a request came by; the `method` label of the abandoned calls
/// and of the decision latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// gRPC `ShouldRateLimit`.
    ShouldRateLimit,
    /// HTTP `POST /json`.
    Json,
}

impl Method {
    pub const ALL: [Method; 2] = [Method::ShouldRateLimit, Method::Json];

    pub fn name(self) -> &'static str {
        match self {
            Method::ShouldRateLimit => "ShouldRateLimit",
            Method::Json => "json",
        }
    }
}

/// Edges of the decision latency histogram, in seconds: fine around
/// Envoy's default rate-limit timeout of 20 ms (10, 15, 20, 25 ms), so
/// that the share of answers near or past it can be read off a bucket.
pub const DECISION_LATENCY_BUCKETS: [f64; 16] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AbandonedLabels {
    method: &'static str,
    stage: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: &'static str,
}

/// Counts one in-flight request until dropped.
#[derive(Debug)]
pub struct InFlight<'a> {
    gauge: &'a Gauge<i64, AtomicI64>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Abandoned calls, decision latency and calls in flight.
#[derive(Debug)]
pub(super) struct CallMetrics {
    abandoned: Family<AbandonedLabels, Counter>,
    /// `throttlegate_decision_latency_seconds` of each [`Method`], in
    /// [`Method::ALL`]'s order.
    decision_latency: [Histogram; 2],
    in_flight: Gauge<i64, AtomicI64>,
}

impl CallMetrics {
    /// Registers `abandoned_calls`, `decision_latency` and
    /// `grpc_requests_in_flight`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let abandoned = Family::<AbandonedLabels, Counter>::default();
        registry.register(
            "abandoned_calls",
            "Calls that got no decision in their caller's time, by method and by the stage they were at: the caller cancelled or its deadline passed first (read, decide, queue, connect, backend), or the deadline left no time for a backend call (deadline); each was answered through the failure mode or not at all",
            abandoned.clone(),
        );
        // Every series exists from the start, so `increase()` sees the first one.
        for method in Method::ALL {
            for stage in backends::Stage::ALL {
                abandoned.get_or_create_owned(&AbandonedLabels {
                    method: method.name(),
                    stage: stage.name(),
                });
            }
        }
        let latency_family =
            Family::<MethodLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                decision_latency_histogram,
            );
        registry.register_with_unit(
            "decision_latency",
            "Time from a call's arrival (its headers) to its answer, decided or answered through the failure mode; compare with the caller's timeout (Envoy's is 20 ms by default)",
            Unit::Seconds,
            latency_family.clone(),
        );
        let decision_latency = Method::ALL.map(|method| {
            latency_family.get_or_create_owned(&MethodLabels {
                method: method.name(),
            })
        });
        let in_flight = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "grpc_requests_in_flight",
            "ShouldRateLimit calls being decided",
            in_flight.clone(),
        );
        CallMetrics {
            abandoned,
            decision_latency,
            in_flight,
        }
    }

    /// The decision latency histogram of `ShouldRateLimit`.
    pub(super) fn should_rate_limit_latency(&self) -> &Histogram {
        &self.decision_latency[0]
    }
}

impl Metrics {
    /// Counts one call of `method` that got no decision in its caller's
    /// time, at `stage`.
    pub fn record_abandoned(&self, method: Method, stage: backends::Stage) {
        self.calls
            .abandoned
            .get_or_create(&AbandonedLabels {
                method: method.name(),
                stage: stage.name(),
            })
            .inc();
    }

    /// Records how long one call of `method` took to answer.
    pub fn observe_decision_latency(&self, method: Method, elapsed: Duration) {
        let idx = Method::ALL.iter().position(|it| *it == method).unwrap_or(0);
        if let Some(histogram) = self.calls.decision_latency.get(idx) {
            histogram.observe(elapsed.as_secs_f64());
        }
    }

    /// Counts a request as in flight until the guard is dropped.
    pub fn track_in_flight(&self) -> InFlight<'_> {
        self.calls.in_flight.inc();
        InFlight {
            gauge: &self.calls.in_flight,
        }
    }
}

/// [`DECISION_LATENCY_BUCKETS`].
fn decision_latency_histogram() -> Histogram {
    Histogram::new(DECISION_LATENCY_BUCKETS)
}
