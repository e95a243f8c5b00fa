//! The quota assigner the RLQS transport calls, as the RLS transport calls
//! the limiter: each stream opens its [`StreamMembers`], and each bucket
//! it reports is resolved to its rule (DENY_ALL past what its client may
//! keep alive, `claims`), booked as a member of its pool in the
//! [`QuotaBook`], and answered in the stream's outbox; what happens is
//! counted (by domain and rule) and logged here.
//!
//! Invariant: a bucket in a pool has joined it through its stream's
//! members, and leaves it when its rule stops sharing a budget or its
//! stream closes (whichever way the stream ends).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;

use crate::clock::Micros;
use crate::log_gate::LogGate;
use crate::metrics::{AssignmentKind, QuotaMetrics};
use crate::rules::RuleSet;

use super::book::{BucketNumber, Order, Outbox, QuotaBook};
use super::bucket::Grant;
use super::claims::PoolClaims;
use super::mapping::{PoolKey, Resolution, resolve};
use super::share::{Budget, MemberId, Usage};

/// Expired shares and claims are swept at most this often, whoever asks.
pub const SWEEP_EVERY_US: Micros = 1_000_000;

/// The quota assigner: the rules (reloads included), the pools, the
/// clients' pool claims, and the metrics and log lines of what the
/// proxies report.
pub struct QuotaAssigner {
    rules: Arc<ArcSwap<RuleSet>>,
    book: Arc<QuotaBook>,
    claims: PoolClaims,
    metrics: QuotaMetrics,
    /// Lines a failing store causes, at most one a second.
    log: LogGate,
    last_sweep: AtomicU64,
}

/// One stream's buckets as members of their pools, and the outbox through
/// which their grants reach the stream. Dropped, it leaves every pool.
pub struct StreamMembers {
    assigner: Arc<QuotaAssigner>,
    outbox: Arc<Outbox>,
    /// The client's address: for its pool claims, and in [`proxy_key`],
    /// by which a reconnected proxy's bucket is recognised.
    client: Option<IpAddr>,
    members: HashMap<BucketNumber, Membership>,
}

/// One bucket of a stream: its member id and whether it is in a pool.
#[derive(Debug, Clone, Copy)]
struct Membership {
    member: MemberId,
    in_pool: bool,
}

/// What one report message is decided under: the rules as it came, its
/// domain and that domain's metric label (`_unknown` when no rule names
/// it), and when it came.
pub struct ReportScope {
    rules: Arc<RuleSet>,
    domain: String,
    label: Arc<str>,
    now: Micros,
}

/// One bucket's report: the stream's number for it, its entries (sorted by
/// key) and the usage reported.
#[derive(Debug, Clone, Copy)]
pub struct BucketReport<'a> {
    pub bucket: BucketNumber,
    pub entries: &'a [(&'a str, &'a str)],
    pub usage: Usage,
}

impl QuotaAssigner {
    /// The assigner answering by `rules` (the limiter's, so reloads
    /// apply), with the pools of `book`.
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        book: Arc<QuotaBook>,
        metrics: QuotaMetrics,
    ) -> QuotaAssigner {
        QuotaAssigner {
            rules,
            book,
            claims: PoolClaims::default(),
            metrics,
            log: LogGate::new(),
            last_sweep: AtomicU64::new(0),
        }
    }

    pub fn now(&self) -> Micros {
        self.book.now()
    }

    /// Forgets expired shares and claims, at most once per
    /// [`SWEEP_EVERY_US`] whoever asks.
    pub fn sweep_now_and_then(&self) {
        let now = self.book.now();
        let last = self.last_sweep.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= SWEEP_EVERY_US
            && self
                .last_sweep
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.book.sweep();
            self.claims.sweep(now);
        }
    }

    /// The members of a new stream from `client`, none yet.
    pub fn open(self: &Arc<Self>, client: Option<IpAddr>) -> StreamMembers {
        StreamMembers {
            assigner: self.clone(),
            outbox: Outbox::new(),
            client,
            members: HashMap::new(),
        }
    }
}

impl StreamMembers {
    /// Where the stream's grants wait to be written.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// What a report message in `domain` arriving now is decided under.
    pub fn scope(&self, domain: &str) -> ReportScope {
        let rules = self.assigner.rules.load_full();
        let label = rules
            .domain(domain)
            .map_or_else(|| Arc::from("_unknown"), |it| it.name().clone());
        ReportScope {
            rules,
            domain: domain.to_owned(),
            label,
            now: self.assigner.now(),
        }
    }

    /// What the rules say of the bucket of `entries` (sorted by key):
    /// DENY_ALL when its pool would be one more than the client may keep
    /// alive (the client's claim on it made or renewed otherwise).
    pub fn resolve(&self, scope: &ReportScope, entries: &[(&str, &str)]) -> Resolution {
        let resolution = resolve(&scope.rules, &scope.domain, entries);
        self.assigner
            .claims
            .bound(self.client, resolution, scope.now, &self.assigner.log)
    }

    /// The stream's bucket `report.bucket`, which [`StreamMembers::resolve`]
    /// resolved to `resolution`, reported: counted, booked in its pool
    /// (leaving it when it no longer shares a budget), and answered in the
    /// outbox. A pool that cannot be read or written leaves it unanswered
    /// (counted and logged): the proxy keeps what it has until it
    /// expires, then its configured fallback.
    pub async fn report(
        &mut self,
        scope: &ReportScope,
        report: BucketReport<'_>,
        resolution: Resolution,
    ) {
        let assigner = self.assigner.clone();
        let metrics = &assigner.metrics;
        let entry = self
            .members
            .entry(report.bucket)
            .or_insert_with(|| Membership {
                member: assigner.book.member_id(),
                in_pool: false,
            });
        let Membership { member, in_pool } = *entry;
        let rule = resolution
            .rule()
            .cloned()
            .unwrap_or_else(|| Arc::from("_unmatched"));
        let usage = report.usage;
        metrics.record_reported(&scope.label, &rule, usage.allowed, usage.denied);
        entry.in_pool = matches!(resolution, Resolution::Shared { .. });
        let answer = match resolution {
            Resolution::Shared { pool, budget, .. } => {
                self.share(scope, &report, &rule, member, &pool, budget)
                    .await
            }
            other => {
                if in_pool {
                    self.leave(member).await;
                }
                let (kind, grant) = match other {
                    Resolution::Blocked { .. } => (AssignmentKind::DenyAll, Grant::DenyAll),
                    _ => (AssignmentKind::AllowAll, Grant::AllowAll),
                };
                metrics.record_assignment(&scope.label, &rule, kind);
                Some((grant, None))
            }
        };
        if let Some((grant, order)) = answer {
            self.outbox.put(report.bucket, grant, order, scope.now);
        }
    }

    /// Books `report` as `member`'s report of `pool` (of `budget`), and
    /// counts and logs what it decided: the reporter's grant, `None` when
    /// the pool could not be decided.
    async fn share(
        &self,
        scope: &ReportScope,
        report: &BucketReport<'_>,
        rule: &Arc<str>,
        member: MemberId,
        pool: &PoolKey,
        budget: Budget,
    ) -> Option<(Grant, Option<Order>)> {
        let (metrics, label) = (&self.assigner.metrics, &scope.label);
        let proxy = proxy_key(self.client, &scope.domain, report.entries);
        let outcome = self
            .assigner
            .book
            .report(
                member,
                proxy,
                report.bucket,
                &self.outbox,
                pool,
                budget,
                Some(report.usage),
            )
            .await;
        let outcome = match outcome {
            Ok(it) => it,
            Err(err) => {
                metrics.record_unanswered(label, rule);
                if let Some(suppressed) = self.assigner.log.admit() {
                    tracing::warn!(error = %err, suppressed, "a quota share could not be decided");
                }
                return None;
            }
        };
        let kind = if outcome.changed {
            AssignmentKind::Changed
        } else {
            AssignmentKind::Renewed
        };
        metrics.record_assignment(label, rule, kind);
        for _ in 0..outcome.pushed {
            metrics.record_assignment(label, rule, AssignmentKind::Changed);
        }
        metrics.set_assigned(label, rule, outcome.committed);
        if outcome.disagree {
            metrics.record_rule_mismatch(label, rule);
            if let Some(suppressed) = self.assigner.log.admit() {
                tracing::warn!(
                    domain = %label,
                    rule = %rule,
                    suppressed,
                    "instances sharing a quota pool have rules giving it different budgets; the lowest applies until they agree"
                );
            }
        }
        Some((outcome.grant, Some(outcome.order)))
    }

    async fn leave(&self, member: MemberId) {
        if let Err(err) = self.assigner.book.leave(member).await
            && let Some(suppressed) = self.assigner.log.admit()
        {
            tracing::warn!(error = %err, suppressed, "a quota share could not be given up; it expires");
        }
    }

    /// Leaves every pool (in a task of its own: a stream may end outside
    /// any task) and forgets the stream's buckets.
    pub fn leave_all(&mut self) {
        let members: Vec<MemberId> = self
            .members
            .values()
            .filter(|it| it.in_pool)
            .map(|it| it.member)
            .collect();
        self.members.clear();
        if !members.is_empty()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let book = self.assigner.book.clone();
            runtime.spawn(async move {
                for member in members {
                    // An error leaves the share to expire.
                    let _ = book.leave(member).await;
                }
            });
        }
    }
}

impl Drop for StreamMembers {
    fn drop(&mut self) {
        self.leave_all();
    }
}

/// What recognises a proxy's bucket across its streams: its address, the
/// domain and the bucket's entries (0 when the address is unknown: never
/// recognised). Two proxies behind one address reporting one bucket look
/// the same: docs/rlqs.md says what that costs.
fn proxy_key(peer: Option<IpAddr>, domain: &str, entries: &[(&str, &str)]) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let Some(peer) = peer else {
        return 0;
    };
    BuildHasherDefault::<DefaultHasher>::default()
        .hash_one((peer, domain, entries))
        .max(1)
}
