//! What the limiter counts beside decisions: answers from the over-limit
//! cache and its size, replies that came late, and charges sent again or
//! lost.
//!
//! Invariant: each is one unlabelled series, registered at start-up.

use std::sync::atomic::AtomicI64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Metrics;

/// The limiter's counters besides the decision series.
#[derive(Debug)]
pub(super) struct LimiterMetrics {
    over_limit_cache_hits: Counter,
    late_replies: Counter,
    charges_resent: Counter,
    charges_lost: Counter,
    over_limit_cache_entries: Gauge<i64, AtomicI64>,
}

impl LimiterMetrics {
    /// Registers `over_limit_cache_hits`, `late_replies`, `charges_resent`,
    /// `charges_lost` and `over_limit_cache_entries`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let over_limit_cache_hits = Counter::default();
        registry.register(
            "over_limit_cache_hits",
            "Requests answered OVER_LIMIT from the over-limit cache, without a backend call",
            over_limit_cache_hits.clone(),
        );
        let late_replies = Counter::default();
        registry.register(
            "late_replies",
            "Decisions whose reply came after the backend's timeout (the request was answered through the failure mode) and that were still counted in decisions and hits",
            late_replies.clone(),
        );
        let charges_resent = Counter::default();
        registry.register(
            "charges_resent",
            "Charges (requests with a limit charged always) not written to the backend in their caller's time, sent again afterwards and decided (counted in decisions and hits)",
            charges_resent.clone(),
        );
        let charges_lost = Counter::default();
        registry.register(
            "charges_lost",
            "Charges never written to the backend: beyond the bound of charges held to be sent again, or still unwritten 10 s after their caller's time",
            charges_lost.clone(),
        );
        let over_limit_cache_entries = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "over_limit_cache_entries",
            "Counters the over-limit cache holds as full, expired ones not yet dropped included",
            over_limit_cache_entries.clone(),
        );
        LimiterMetrics {
            over_limit_cache_hits,
            late_replies,
            charges_resent,
            charges_lost,
            over_limit_cache_entries,
        }
    }
}

impl Metrics {
    /// Counts one request answered from the over-limit cache.
    pub fn record_over_limit_cache_hit(&self) {
        self.limiter.over_limit_cache_hits.inc();
    }

    /// The over-limit cache holds `entries` counters.
    pub fn set_over_limit_cache_entries(&self, entries: usize) {
        self.limiter
            .over_limit_cache_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Counts one decision whose reply came after the backend's timeout,
    /// counted all the same.
    pub fn record_late_reply(&self) {
        self.limiter.late_replies.inc();
    }

    /// Counts a charge sent again after its caller's time and decided.
    pub fn record_charge_resent(&self) {
        self.limiter.charges_resent.inc();
    }

    /// Counts a charge never written to the backend.
    pub fn record_charge_lost(&self) {
        self.limiter.charges_lost.inc();
    }
}
