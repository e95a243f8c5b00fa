//! Metrics of the rate-limit quota service (RLQS): streams and buckets
//! open, assignments sent, usage the proxies reported, shares assigned.
//! Labels are a configured domain (else `_unknown`) and a rule's path
//! (else `_unmatched`), never a bucket's values.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    domain: Arc<str>,
    rule: Arc<str>,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaRuleLabels {
    domain: Arc<str>,
    rule: Arc<str>,
}

/// What kind of assignment a bucket was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AssignmentKind {
    /// A token bucket different from the one the proxy had.
    Changed,
    /// The same token bucket again: its time to live renewed.
    Renewed,
    AllowAll,
    DenyAll,
}

impl AssignmentKind {
    fn name(self) -> &'static str {
        match self {
            AssignmentKind::Changed => "changed",
            AssignmentKind::Renewed => "renewed",
            AssignmentKind::AllowAll => "allow_all",
            AssignmentKind::DenyAll => "deny_all",
        }
    }
}

/// The RLQS metrics, registered with the service's others.
#[derive(Debug, Clone)]
pub struct QuotaMetrics {
    streams: Gauge<i64, AtomicI64>,
    buckets: Gauge<i64, AtomicI64>,
    bucket_bytes: Gauge<i64, AtomicI64>,
    assignments: Family<KindLabels, Counter>,
    reported: Family<KindLabels, Counter>,
    assigned: Family<QuotaRuleLabels, Gauge<i64, AtomicI64>>,
    unanswered: Family<QuotaRuleLabels, Counter>,
    mismatches: Family<QuotaRuleLabels, Counter>,
}

impl QuotaMetrics {
    pub(super) fn register(registry: &mut Registry) -> QuotaMetrics {
        let metrics = QuotaMetrics {
            streams: Gauge::default(),
            buckets: Gauge::default(),
            bucket_bytes: Gauge::default(),
            assignments: Family::default(),
            reported: Family::default(),
            assigned: Family::default(),
            unanswered: Family::default(),
            mismatches: Family::default(),
        };
        registry.register(
            "rlqs_streams",
            "Rate-limit quota (RLQS) streams open",
            metrics.streams.clone(),
        );
        registry.register(
            "rlqs_buckets",
            "Buckets the open RLQS streams report",
            metrics.buckets.clone(),
        );
        registry.register(
            "rlqs_bucket_id_bytes",
            "Bytes the open RLQS streams keep for their bucket ids, as counted against the per-stream bound (keys, values and a fixed overhead per entry and per bucket)",
            metrics.bucket_bytes.clone(),
        );
        registry.register(
            "rlqs_assignments",
            "RLQS assignments sent by domain, rule and kind (changed, renewed: a token bucket new to the proxy or the same one again; allow_all, deny_all)",
            metrics.assignments.clone(),
        );
        registry.register(
            "rlqs_reported_requests",
            "Requests the proxies reported by domain, rule and kind (allowed, denied)",
            metrics.reported.clone(),
        );
        registry.register(
            "rlqs_assigned_requests_per_window",
            "Shares of the window's budget assigned to proxies, summed, in the pool of the rule reported last",
            metrics.assigned.clone(),
        );
        registry.register(
            "rlqs_unanswered_reports",
            "RLQS reports left unanswered because the shared budget could not be read or written in Redis, by domain and rule (the proxy keeps its assignment until it expires, then its fallback)",
            metrics.unanswered.clone(),
        );
        registry.register(
            "rlqs_rule_mismatches",
            "RLQS reports into a pool whose instances' rules give it different budgets (a reload not yet everywhere), by domain and rule; the lowest budget applies until they agree",
            metrics.mismatches.clone(),
        );
        metrics
    }

    /// A stream opened (`+1`) or closed (`-1`).
    pub fn add_streams(&self, delta: i64) {
        self.streams.inc_by(delta);
    }

    /// Buckets reported by open streams, up or down by `delta`.
    pub fn add_buckets(&self, delta: i64) {
        self.buckets.inc_by(delta);
    }

    /// Bytes kept for open streams' bucket ids, up or down by `delta`.
    pub fn add_bucket_bytes(&self, delta: i64) {
        self.bucket_bytes.inc_by(delta);
    }

    pub fn record_assignment(&self, domain: &Arc<str>, rule: &Arc<str>, kind: AssignmentKind) {
        self.assignments
            .get_or_create(&KindLabels {
                domain: domain.clone(),
                rule: rule.clone(),
                kind: kind.name(),
            })
            .inc();
    }

    /// Requests a proxy reported; each count saturates at `u64::MAX`
    /// (a proxy's numbers are its own, and a counter never goes back).
    pub fn record_reported(&self, domain: &Arc<str>, rule: &Arc<str>, allowed: u64, denied: u64) {
        for (kind, count) in [("allowed", allowed), ("denied", denied)] {
            let counter = self.reported.get_or_create(&KindLabels {
                domain: domain.clone(),
                rule: rule.clone(),
                kind,
            });
            let _ = counter
                .inner()
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |it| {
                    Some(it.saturating_add(count))
                });
        }
    }

    /// A report of a bucket of `rule` left unanswered: its pool could not
    /// be read or written.
    pub fn record_unanswered(&self, domain: &Arc<str>, rule: &Arc<str>) {
        self.unanswered
            .get_or_create(&QuotaRuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            })
            .inc();
    }

    /// A report of a bucket of `rule` into a pool whose instances disagree
    /// on its budget.
    pub fn record_rule_mismatch(&self, domain: &Arc<str>, rule: &Arc<str>) {
        self.mismatches
            .get_or_create(&QuotaRuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            })
            .inc();
    }

    pub fn set_assigned(&self, domain: &Arc<str>, rule: &Arc<str>, per_window: u64) {
        self.assigned
            .get_or_create(&QuotaRuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            })
            .set(i64::try_from(per_window).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests;
