//! Prometheus metrics: decisions, hits, backend calls, in-flight requests, reloads.
//!
//! Label cardinality is bounded by the configuration, never by what clients
//! send: `domain` is a configured domain (or `_unknown`), `rule` the matched
//! rule's path, unless the rule opts in with `detailed_metric` or
//! `value_to_metric` (see [`MetricRule`]); those per-value series are
//! capped per rule ([`Metrics::with_max_values_per_rule`]), the excess
//! folded into one overflow series. The hot path resolves a `(domain, rule)`
//! pair to its counters once and then only bumps atomics.
//!
//! Decisions never wait for a scrape: decision and hit counters live in a
//! sharded map of their own, and [`Metrics::encode`] copies each shard's
//! entries out under a brief read lock and formats the text without any
//! lock a decision takes.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

mod quota;
pub mod ratelimit_names;
pub mod ratelimit_prometheus;
pub mod statsd;
pub mod statsd_mapping;
pub use quota::{AssignmentKind, QuotaMetrics};

use crate::backends;

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

/// How one descriptor's decision was answered; the `result` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Allowed, with no more of the most restrictive limit used than
    /// [`Options::near_limit_ratio`](crate::decision::Options::near_limit_ratio).
    Ok,
    /// Allowed, with more of the most restrictive limit used than
    /// [`Options::near_limit_ratio`](crate::decision::Options::near_limit_ratio)
    /// (as envoyproxy/ratelimit's near_limit).
    NearLimit,
    /// OVER_LIMIT.
    OverLimit,
    /// Would have been over, but a shadow-mode rule (or `--shadow-mode`)
    /// let it pass.
    Shadow,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Ok,
        Outcome::NearLimit,
        Outcome::OverLimit,
        Outcome::Shadow,
    ];

    /// This outcome's index in [`Outcome::ALL`].
    fn slot(self) -> usize {
        match self {
            Outcome::Ok => 0,
            Outcome::NearLimit => 1,
            Outcome::OverLimit => 2,
            Outcome::Shadow => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::NearLimit => "near_limit",
            Outcome::OverLimit => "over_limit",
            Outcome::Shadow => "shadow",
        }
    }
}

/// The `rule` label of one descriptor's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricRule {
    /// The matched node's path (`tenant.path_/expensive`): shared, no
    /// allocation.
    Path(Arc<str>),
    /// Built from the descriptor's values: the rule has `detailed_metric`
    /// (every level `key_value`) or some level has `value_to_metric` (that
    /// level `key_value`, the others as in the path). `rule` is the matched
    /// node's path: the cap on per-value series counts per path.
    Values { rule: Arc<str>, label: String },
    /// A RateLimitOverride: [`OVERRIDE_RULE`].
    Override,
}

impl MetricRule {
    pub fn as_str(&self) -> &str {
        match self {
            MetricRule::Path(path) => path,
            MetricRule::Values { label, .. } => label,
            MetricRule::Override => OVERRIDE_RULE,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    domain: Arc<str>,
    rule: Arc<str>,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    domain: Arc<str>,
    rule: Arc<str>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    backend: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AbandonedLabels {
    method: &'static str,
    stage: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendErrorLabels {
    backend: &'static str,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AcceptErrorLabels {
    listener: &'static str,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: &'static str,
}

/// The counters of one `(domain, rule)`, resolved once.
#[derive(Debug, Default)]
struct RuleCounters {
    /// Indexed like [`Outcome::ALL`].
    decisions: [AtomicU64; 4],
    /// Hits by outcome, indexed like [`Outcome::ALL`]: their sum is the
    /// rule's hits, and envoyproxy/ratelimit's statistics count hits per
    /// outcome.
    hits: [AtomicU64; 4],
    /// Units charged past the limit's room (limits charged always).
    overdraft: AtomicU64,
    /// Label built from request values: a result's series appears only
    /// once it is non-zero (a value seen once makes one series, not four).
    per_value: bool,
}

impl RuleCounters {
    /// Hits of every outcome together.
    fn total_hits(&self) -> u64 {
        self.hits
            .iter()
            .map(|it| it.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    fn record(&self, slot: usize, hits: u64, overdraft: u64) {
        self.decisions[slot].fetch_add(1, Ordering::Relaxed);
        self.hits[slot].fetch_add(hits, Ordering::Relaxed);
        if overdraft > 0 {
            self.overdraft.fetch_add(overdraft, Ordering::Relaxed);
        }
    }
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// One domain's counters by `rule` label.
type DomainCounters = FastMap<Arc<str>, Arc<RuleCounters>>;

/// One shard of [`Series`]: `domain → rule → counters`, looked up by `&str`
/// without allocating.
type Shard = RwLock<FastMap<Arc<str>, DomainCounters>>;

/// Per-value series budgets by `(domain, rule path)`.
type Budgets = FastMap<(Arc<str>, Arc<str>), ValueBudget>;

/// Shards of the decision series: a new label locks one shard for an insert,
/// and a scrape holds each shard only while copying its entries out.
const SHARDS: usize = 32;

/// `domain → rule → counters`, split over [`SHARDS`] by a hash of both.
#[derive(Debug)]
struct Series {
    shards: Box<[Shard]>,
    hasher: foldhash::fast::FixedState,
}

/// One series as copied out of [`Series`] for a scrape.
type SeriesEntry = (Arc<str>, Arc<str>, Arc<RuleCounters>);

impl Series {
    fn new() -> Series {
        Series {
            shards: (0..SHARDS)
                .map(|_| RwLock::new(FastMap::default()))
                .collect(),
            hasher: foldhash::fast::FixedState::default(),
        }
    }

    fn shard(&self, domain: &str, rule: &str) -> &Shard {
        let hash = self.hasher.hash_one((domain, rule));
        &self.shards[(hash % SHARDS as u64) as usize]
    }

    /// Every series, sorted by domain and rule. Holds one shard's read lock
    /// at a time, only to clone `Arc`s.
    fn snapshot(&self) -> Vec<SeriesEntry> {
        let mut entries = Vec::new();
        for shard in &self.shards {
            let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
            for (domain, rules) in shard.iter() {
                for (rule, counters) in rules {
                    entries.push((domain.clone(), rule.clone(), counters.clone()));
                }
            }
        }
        entries.sort_unstable_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        entries
    }
}

/// Per-value series created so far by one rule, against the cap.
#[derive(Debug)]
struct ValueBudget {
    created: usize,
    /// Decisions folded into the overflow series; resolved on the first.
    overflowed: Option<Counter>,
}

/// Encodes `throttlegate_decisions_total` and `throttlegate_hits_total` from
/// a snapshot of [`Series`] at each scrape.
#[derive(Debug)]
struct SeriesCollector(Arc<Series>);

impl Collector for SeriesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let entries = self.0.snapshot();
        if entries.is_empty() {
            return Ok(());
        }
        // The counters keep moving after the snapshot; each is read once.
        let mut family =
            encoder.encode_descriptor("decisions", DECISIONS_HELP, None, MetricType::Counter)?;
        for (domain, rule, counters) in &entries {
            for (slot, outcome) in Outcome::ALL.iter().enumerate() {
                let value = counters.decisions[slot].load(Ordering::Relaxed);
                if counters.per_value && value == 0 {
                    continue;
                }
                let labels = DecisionLabels {
                    domain: domain.clone(),
                    rule: rule.clone(),
                    result: outcome.name(),
                };
                family
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
            }
        }
        let mut family = encoder.encode_descriptor("hits", HITS_HELP, None, MetricType::Counter)?;
        for (domain, rule, counters) in &entries {
            let value = counters.total_hits();
            if counters.per_value && value == 0 {
                continue;
            }
            let labels = RuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            };
            family
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
        }
        // Only rules that ever went past their room: most never do.
        let mut family = encoder.encode_descriptor(
            "overdraft_units",
            OVERDRAFT_HELP,
            None,
            MetricType::Counter,
        )?;
        for (domain, rule, counters) in &entries {
            let value = counters.overdraft.load(Ordering::Relaxed);
            if value == 0 {
                continue;
            }
            let labels = RuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            };
            family
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
        }
        Ok(())
    }
}

const DECISIONS_HELP: &str =
    "Descriptor decisions by domain, rule and result (ok, near_limit, over_limit, shadow)";
const HITS_HELP: &str = "Hits (sum of request costs) by domain and rule";
const OVERDRAFT_HELP: &str = "Units charged past the limit's room by limits with charge: always \
     (usage recorded after the fact), by domain and rule";

/// Every metric of the service, and its registry.
pub struct Metrics {
    /// Behind a lock only so that [`Metrics::observe_stored_counters`] can
    /// register late; taken per scrape, never per request.
    registry: Mutex<Registry>,
    /// Decision and hit counters by `(domain, rule)`, encoded by a
    /// [`SeriesCollector`].
    series: Arc<Series>,
    max_values_per_rule: usize,
    /// `(domain, rule path) →` per-value series created; taken only when a
    /// per-value label is seen for the first time.
    value_budgets: Mutex<Budgets>,
    value_overflows: Family<RuleLabels, Counter>,
    backend_latency: Family<BackendLabels, Histogram, fn() -> Histogram>,
    backend_errors: Family<BackendErrorLabels, Counter>,
    abandoned: Family<AbandonedLabels, Counter>,
    /// `throttlegate_decision_latency_seconds` of each [`Method`], in
    /// [`Method::ALL`]'s order.
    decision_latency: [Histogram; 2],
    in_flight: Gauge<i64, AtomicI64>,
    reloads: Family<ReloadLabels, Counter>,
    config_loaded_at: Gauge<i64, AtomicI64>,
    stored_counters: Gauge<i64, AtomicI64>,
    over_limit_cache_hits: Counter,
    late_replies: Counter,
    charges_resent: Counter,
    charges_lost: Counter,
    over_limit_cache_entries: Gauge<i64, AtomicI64>,
    open_connections: Family<ListenerLabels, Gauge>,
    accept_errors: Family<AcceptErrorLabels, Counter>,
    tls_handshake_errors: Family<ListenerLabels, Counter>,
    tls_reloads: Family<ReloadLabels, Counter>,
    stored_source: Mutex<Option<CounterSource>>,
    quota: QuotaMetrics,
    /// Failed backend calls of every backend and kind together.
    backend_failures: Counter,
    /// Lines the statsd sink could not deliver, registered when it starts.
    statsd_dropped: Counter,
    /// Successful config loads, start-up included (not in our registry:
    /// envoyproxy/ratelimit's `config_load_success`).
    config_load_success: Counter,
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

/// The pre-resolved metrics of one listener (`grpc`, `http`).
#[derive(Debug, Clone)]
pub struct ListenerMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// `accept` failures for lack of file descriptors (EMFILE, ENFILE).
    pub accept_errors_descriptors: Counter,
    /// Other `accept` failures (ENOBUFS, ENOMEM...).
    pub accept_errors_other: Counter,
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
        let mut registry = Registry::with_prefix("throttlegate");
        let series = Arc::new(Series::new());
        registry.register_collector(Box::new(SeriesCollector(series.clone())));
        let value_overflows = Family::<RuleLabels, Counter>::default();
        registry.register(
            "metric_value_overflows",
            "Decisions of rules with per-value metrics counted under the rule's overflow label because the rule reached its maximum of series",
            value_overflows.clone(),
        );
        let backend_latency =
            Family::<BackendLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        registry.register_with_unit(
            "backend_latency",
            "Duration of one backend decision call",
            Unit::Seconds,
            backend_latency.clone(),
        );
        let backend_errors = Family::<BackendErrorLabels, Counter>::default();
        registry.register(
            "backend_errors",
            "Failed backend calls by kind (timeout, unavailable, protocol, full, shed)",
            backend_errors.clone(),
        );
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
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "config_reloads",
            "Configuration reloads by result (ok, error)",
            reloads.clone(),
        );
        // Both series exist from the start, so `increase()` sees the first one.
        for result in ["ok", "error"] {
            reloads.get_or_create_owned(&ReloadLabels { result });
        }
        let config_loaded_at = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "config_last_success_timestamp_seconds",
            "When the config last loaded without error (start-up or reload), in seconds since the epoch; 0 before",
            config_loaded_at.clone(),
        );
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
        let open_connections = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "open_connections",
            "Client connections open, by listener (grpc, http)",
            open_connections.clone(),
        );
        let accept_errors = Family::<AcceptErrorLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts by listener and kind (descriptors: out of file descriptors, other)",
            accept_errors.clone(),
        );
        let tls_handshake_errors = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "tls_handshake_errors",
            "TLS handshakes that failed, by listener (refused or missing client certificates, plain text on a TLS port, deadlines)",
            tls_handshake_errors.clone(),
        );
        let tls_reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "tls_reloads",
            "Reloads of the TLS certificate, key and client CA files by result (ok; error: the certificate in force stays)",
            tls_reloads.clone(),
        );
        let quota = QuotaMetrics::register(&mut registry);
        Self {
            registry: Mutex::new(registry),
            series,
            max_values_per_rule: max,
            value_budgets: Mutex::new(FastMap::default()),
            value_overflows,
            backend_latency,
            backend_errors,
            abandoned,
            decision_latency,
            in_flight,
            reloads,
            config_loaded_at,
            stored_counters: Gauge::default(),
            over_limit_cache_hits,
            late_replies,
            charges_resent,
            charges_lost,
            over_limit_cache_entries,
            open_connections,
            accept_errors,
            tls_handshake_errors,
            tls_reloads,
            stored_source: Mutex::new(None),
            quota,
            backend_failures: Counter::default(),
            statsd_dropped: Counter::default(),
            config_load_success: Counter::default(),
        }
    }

    /// The rate-limit quota service's metrics.
    pub fn quota(&self) -> &QuotaMetrics {
        &self.quota
    }

    /// Counts one descriptor decision of cost `hits` under the fixed
    /// label `rule` (a rule path, or one of the `_` labels).
    pub fn record_decision(&self, domain: &str, rule: &str, outcome: Outcome, hits: u64) {
        self.record_series(domain, rule, None, outcome, hits, 0);
    }

    /// Counts one descriptor decision of cost `hits`, `overdraft` of
    /// them charged past the limit's room, under its rule's label; a
    /// per-value label past its rule's cap is folded into the rule's
    /// overflow label.
    pub fn record(
        &self,
        domain: &str,
        rule: &MetricRule,
        outcome: Outcome,
        hits: u64,
        overdraft: u64,
    ) {
        let path = match rule {
            MetricRule::Values { rule, .. } => Some(rule),
            MetricRule::Path(_) | MetricRule::Override => None,
        };
        self.record_series(domain, rule.as_str(), path, outcome, hits, overdraft);
    }

    /// `path`: set for a per-value label, the rule whose budget it uses.
    fn record_series(
        &self,
        domain: &str,
        label: &str,
        path: Option<&Arc<str>>,
        outcome: Outcome,
        hits: u64,
        overdraft: u64,
    ) {
        let slot = outcome.slot();
        let shard = self.series.shard(domain, label);
        {
            let rules = shard.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(counters) = rules.get(domain).and_then(|it| it.get(label)) {
                counters.record(slot, hits, overdraft);
                return;
            }
        }
        // First decision under this label: create its series once.
        {
            let mut rules = shard.write().unwrap_or_else(PoisonError::into_inner);
            let by_rule = match rules.get_mut(domain) {
                Some(it) => it,
                None => rules.entry(Arc::from(domain)).or_default(),
            };
            if let Some(counters) = by_rule.get(label) {
                counters.record(slot, hits, overdraft);
                return;
            }
            if path.is_none_or(|path| self.take_value_budget(domain, path)) {
                let counters = Arc::new(RuleCounters {
                    per_value: path.is_some(),
                    ..RuleCounters::default()
                });
                counters.record(slot, hits, overdraft);
                by_rule.insert(Arc::from(label), counters);
                return;
            }
        }
        // Over the cap: the shard lock is released before recording the
        // overflow label, which may live in another shard.
        if let Some(path) = path {
            let overflow = format!("{path}:{OVERFLOW_SUFFIX}");
            self.record_series(domain, &overflow, None, outcome, hits, overdraft);
        }
    }

    /// Whether the rule `path` may create one more per-value series (and
    /// then counts it); if not, counts the overflow, and logs the rule's
    /// first one.
    fn take_value_budget(&self, domain: &str, path: &Arc<str>) -> bool {
        let mut budgets = self
            .value_budgets
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let budget = budgets
            .entry((Arc::from(domain), path.clone()))
            .or_insert(ValueBudget {
                created: 0,
                overflowed: None,
            });
        if budget.created < self.max_values_per_rule {
            budget.created += 1;
            return true;
        }
        let counter = budget.overflowed.get_or_insert_with(|| {
            tracing::warn!(
                domain,
                rule = %path,
                max = self.max_values_per_rule,
                "rule reached its maximum of per-value metric series; further values are counted under {path}:{OVERFLOW_SUFFIX}"
            );
            self.value_overflows.get_or_create_owned(&RuleLabels {
                domain: Arc::from(domain),
                rule: path.clone(),
            })
        });
        counter.inc();
        false
    }

    /// The latency histogram and error counters of the backend `name`.
    pub fn backend(&self, name: &'static str) -> BackendMetrics {
        let error = |kind| {
            self.backend_errors
                .get_or_create_owned(&BackendErrorLabels {
                    backend: name,
                    kind,
                })
        };
        BackendMetrics {
            latency: self
                .backend_latency
                .get_or_create_owned(&BackendLabels { backend: name }),
            timeout: error("timeout"),
            unavailable: error("unavailable"),
            protocol: error("protocol"),
            full: error("full"),
            shed: error("shed"),
            failures: self.backend_failures.clone(),
        }
    }

    /// The connection gauge and accept error counters of the listener `name`.
    pub fn listener(&self, name: &'static str) -> ListenerMetrics {
        let error = |kind| {
            self.accept_errors.get_or_create_owned(&AcceptErrorLabels {
                listener: name,
                kind,
            })
        };
        ListenerMetrics {
            open: self
                .open_connections
                .get_or_create_owned(&ListenerLabels { listener: name }),
            accept_errors_descriptors: error("descriptors"),
            accept_errors_other: error("other"),
        }
    }

    /// The counter of failed TLS handshakes on the listener `name`.
    pub fn tls_handshake_errors(&self, name: &'static str) -> Counter {
        self.tls_handshake_errors
            .get_or_create_owned(&ListenerLabels { listener: name })
    }

    /// Counts one reload of the TLS files, swapped in or refused. Both
    /// series exist once TLS is on, so `increase()` sees the first one.
    pub fn record_tls_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.tls_reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// Creates both TLS reload series at 0 (TLS is on).
    pub fn enable_tls_reloads(&self) {
        for result in ["ok", "error"] {
            self.tls_reloads
                .get_or_create_owned(&ReloadLabels { result });
        }
    }

    /// Counts one request answered from the over-limit cache.
    pub fn record_over_limit_cache_hit(&self) {
        self.over_limit_cache_hits.inc();
    }

    /// The over-limit cache holds `entries` counters.
    pub fn set_over_limit_cache_entries(&self, entries: usize) {
        self.over_limit_cache_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// Counts one decision whose reply came after the backend's timeout,
    /// counted all the same.
    pub fn record_late_reply(&self) {
        self.late_replies.inc();
    }

    /// Counts a charge sent again after its caller's time and decided.
    pub fn record_charge_resent(&self) {
        self.charges_resent.inc();
    }

    /// Counts a charge never written to the backend.
    pub fn record_charge_lost(&self) {
        self.charges_lost.inc();
    }

    /// Counts one call of `method` that got no decision in its caller's
    /// time, at `stage`.
    pub fn record_abandoned(&self, method: Method, stage: backends::Stage) {
        self.abandoned
            .get_or_create(&AbandonedLabels {
                method: method.name(),
                stage: stage.name(),
            })
            .inc();
    }

    /// Records how long one call of `method` took to answer.
    pub fn observe_decision_latency(&self, method: Method, elapsed: Duration) {
        let idx = Method::ALL.iter().position(|it| *it == method).unwrap_or(0);
        if let Some(histogram) = self.decision_latency.get(idx) {
            histogram.observe(elapsed.as_secs_f64());
        }
    }

    /// Counts a request as in flight until the guard is dropped.
    pub fn track_in_flight(&self) -> InFlight<'_> {
        self.in_flight.inc();
        InFlight {
            gauge: &self.in_flight,
        }
    }

    /// Counts one configuration reload, successful or refused; a
    /// successful one is also the config's last good load.
    pub fn record_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reloads.get_or_create(&ReloadLabels { result }).inc();
        if ok {
            self.record_config_loaded(SystemTime::now());
        }
    }

    /// The config loaded without error at `at` (at start-up, or a reload).
    pub fn record_config_loaded(&self, at: SystemTime) {
        self.config_load_success.inc();
        let seconds = at.duration_since(UNIX_EPOCH).map_or(0, |it| it.as_secs());
        self.config_loaded_at
            .set(i64::try_from(seconds).unwrap_or(i64::MAX));
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

/// [`DECISION_LATENCY_BUCKETS`].
fn decision_latency_histogram() -> Histogram {
    Histogram::new(DECISION_LATENCY_BUCKETS)
}

/// 50 µs to about 1.6 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::metrics_text::{assert_samples, sample};

    #[test]
    fn outcome_slots_follow_all() {
        for (idx, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome.slot(), idx, "{outcome:?}");
        }
    }

    #[test]
    fn reloads_in_flight_and_stored_counters() {
        let metrics = Metrics::new();
        let text = metrics.encode();
        assert_samples(
            &text,
            &[("throttlegate_config_reloads_total{result=\"ok\"}", 0.0)],
        );
        assert!(!text.contains("throttlegate_memory_counters"), "{text}");
        assert_samples(
            &text,
            &[("throttlegate_config_last_success_timestamp_seconds", 0.0)],
        );
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        metrics.record_reload(true);
        metrics.record_reload(false);
        metrics.record_reload(false);
        let loaded_at = sample(
            &metrics.encode(),
            "throttlegate_config_last_success_timestamp_seconds",
        )
        .expect("the gauge");
        assert!(loaded_at >= before as f64, "{loaded_at} < {before}");
        metrics.record_config_loaded(UNIX_EPOCH + std::time::Duration::from_secs(1_796_310_000));
        assert_samples(
            &metrics.encode(),
            &[(
                "throttlegate_config_last_success_timestamp_seconds",
                1_796_310_000.0,
            )],
        );
        let stored = Arc::new(std::sync::atomic::AtomicU64::new(7));
        let source = stored.clone();
        metrics.observe_stored_counters(move || source.load(std::sync::atomic::Ordering::Relaxed));
        let guard = metrics.track_in_flight();
        let text = metrics.encode();
        assert_samples(
            &text,
            &[
                ("throttlegate_config_reloads_total{result=\"ok\"}", 1.0),
                ("throttlegate_config_reloads_total{result=\"error\"}", 2.0),
                ("throttlegate_grpc_requests_in_flight", 1.0),
                ("throttlegate_memory_counters", 7.0),
            ],
        );
        drop(guard);
        stored.store(3, std::sync::atomic::Ordering::Relaxed);
        let text = metrics.encode();
        assert_samples(
            &text,
            &[
                ("throttlegate_grpc_requests_in_flight", 0.0),
                ("throttlegate_memory_counters", 3.0),
            ],
        );
    }
}
