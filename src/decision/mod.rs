//! The decision on one request: bounds, matching, one atomic backend call, answers.
//!
//! Transport-neutral: the gRPC service (and the HTTP `/json` endpoint) turn
//! wire messages into a [`Request`] and a [`Decision`] back into wire
//! messages; no prost type is seen here.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::algorithms::{Algorithm, Check, LimitParams, MAX_EXACT, Mode, Outcome, ParamsError};
use crate::backends::{self, Backend, CounterKey, KeyBytes, KeyEntry, KeyValue, KeyedCheck};
use crate::log_gate::LogGate;
use crate::metrics::{self, BackendMetrics, MetricRule, Metrics};
use crate::rules::{Domain, Node, NodeLimits, RuleSet, Unit, ValueMatcher};

/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 32;

/// One request, as the transports hand it over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// The request's cost; 0 means 1.
    pub hits_addend: u32,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
    /// A per-request limit enforced instead of the config tree.
    pub limit: Option<LimitOverride>,
    /// When present (even 0) it wins over the request's cost; 0 checks
    /// without consuming.
    pub hits_addend: Option<u64>,
}

/// One key/value pair of a descriptor: any bytes of any length (Envoy
/// copies header values, which need not be UTF-8, into them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// A RateLimitOverride.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    /// `None`: the wire said UNKNOWN; the override is then ignored.
    pub unit: Option<Unit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Ok,
    OverLimit,
}

/// The limit a status reports: the configured unit and number (a
/// `unit_multiplier` cannot be expressed on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentLimit {
    pub requests_per_unit: u32,
    pub unit: Unit,
    /// The rule's `name`; empty for an override or an unnamed rule.
    pub name: Arc<str>,
}

/// The answer for one request descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub current_limit: Option<CurrentLimit>,
    pub limit_remaining: u32,
    /// Whole seconds, rounded up; `None` when no limit applies.
    pub duration_until_reset_s: Option<u64>,
}

/// The answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub overall: Code,
    /// One per request descriptor, in request order.
    pub statuses: Vec<Status>,
    /// Response headers to add, `(name, value)`.
    pub headers: Vec<(String, String)>,
}

/// What to answer when the backend fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Fail the call: the gRPC service answers UNAVAILABLE and Envoy's own
    /// `failure_mode_deny` decides.
    Error,
    /// Answer OK.
    Allow,
    /// Answer OVER_LIMIT.
    Deny,
}

/// Names of the response headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
    pub retry_after: String,
}

impl HeaderNames {
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`, `Retry-After`.
    pub fn standard() -> HeaderNames {
        HeaderNames {
            limit: "RateLimit-Limit".to_owned(),
            remaining: "RateLimit-Remaining".to_owned(),
            reset: "RateLimit-Reset".to_owned(),
            retry_after: "Retry-After".to_owned(),
        }
    }
}

/// Service-wide behaviour of the limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Report an OVER_LIMIT overall code as OK (statuses unchanged).
    pub shadow_mode: bool,
    /// `None`: no response headers.
    pub response_headers: Option<HeaderNames>,
    pub failure_mode: FailureMode,
}

/// Why a request got no decision.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Backend(backends::Error),
}

/// Decides requests against the current rules and a backend.
#[derive(Debug)]
pub struct Limiter {
    rules: Arc<ArcSwap<RuleSet>>,
    backend: Arc<dyn Backend>,
    options: Options,
    backend_errors: LogGate,
    /// Requests whose cost exceeds a limit's capacity: clients choose them.
    never_pass: LogGate,
    metrics: Arc<Metrics>,
    /// `metrics`' series for `backend`, resolved once.
    backend_metrics: BackendMetrics,
}

// === impl Limiter ===

impl Limiter {
    /// A limiter recording its decisions and backend calls in `metrics`.
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        backend: Arc<dyn Backend>,
        options: Options,
        metrics: Arc<Metrics>,
    ) -> Self {
        let backend_metrics = metrics.backend(backend.name());
        Self {
            rules,
            backend,
            options,
            backend_errors: LogGate::new(),
            never_pass: LogGate::new(),
            metrics,
            backend_metrics,
        }
    }

    /// Where decisions, backend calls and reloads are counted.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The rules in force; a reload stores a new set here.
    pub fn rules(&self) -> &Arc<ArcSwap<RuleSet>> {
        &self.rules
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Decides one request: at most one backend call, none when no
    /// descriptor needs a counter.
    pub async fn decide(&self, request: &Request) -> Result<Decision, Error> {
        validate(request)?;
        // One snapshot per request: a reload mid-request cannot mix rule sets.
        let rules = self.rules.load_full();
        let Some(domain) = rules.domain(&request.domain) else {
            // One series for every unknown domain: clients choose the names.
            let cost = u64::from(request.hits_addend.max(1));
            for descriptor in &request.descriptors {
                self.metrics.record_decision(
                    metrics::UNKNOWN_DOMAIN,
                    metrics::UNKNOWN_RULE,
                    metrics::Outcome::Ok,
                    descriptor.hits_addend.unwrap_or(cost),
                );
            }
            return Ok(Decision {
                overall: Code::Ok,
                statuses: vec![Status::ok_without_limit(); request.descriptors.len()],
                headers: Vec::new(),
            });
        };
        let plan = plan(domain, request, rules.max_log_entries)?;
        if plan.checks.is_empty() {
            return Ok(self.answer(domain, &plan, None));
        }
        for (check, rule) in plan.checks.iter().zip(&plan.check_rules) {
            if check.check.cost > check.check.params.capacity()
                && let Some(suppressed) = self.never_pass.admit()
            {
                tracing::warn!(
                    domain = %request.domain,
                    rule = %rule,
                    cost = check.check.cost,
                    capacity = check.check.params.capacity(),
                    suppressed,
                    "cost exceeds the limit's capacity: this request can never pass"
                );
            }
        }
        let started = Instant::now();
        let res = self.backend.decide(&plan.checks).await;
        self.backend_metrics.observe_latency(started.elapsed());
        match res {
            Ok(verdict) => {
                if verdict.outcomes.len() != plan.checks.len() {
                    let error = backends::Error::Protocol(format!(
                        "{} outcomes for {} checks",
                        verdict.outcomes.len(),
                        plan.checks.len()
                    ));
                    return self.on_backend_error(&plan, error);
                }
                Ok(self.answer(domain, &plan, Some((verdict.allowed, &verdict.outcomes))))
            }
            Err(error) => self.on_backend_error(&plan, error),
        }
    }

    fn on_backend_error(&self, plan: &Plan, error: backends::Error) -> Result<Decision, Error> {
        self.backend_metrics.record_error(&error);
        if let Some(suppressed) = self.backend_errors.admit() {
            tracing::error!(
                backend = self.backend.name(),
                failure_mode = ?self.options.failure_mode,
                suppressed,
                "backend failed: {error}"
            );
        }
        let code = match self.options.failure_mode {
            FailureMode::Error => return Err(Error::Backend(error)),
            FailureMode::Allow => Code::Ok,
            FailureMode::Deny => Code::OverLimit,
        };
        let statuses = plan
            .descriptors
            .iter()
            .map(|it| match it {
                DescriptorPlan::Limits { .. } => Status {
                    code,
                    current_limit: None,
                    limit_remaining: 0,
                    duration_until_reset_s: None,
                },
                other => other.status_without_counter(),
            })
            .collect();
        Ok(Decision {
            overall: self.shadowed(code),
            statuses,
            headers: Vec::new(),
        })
    }

    fn shadowed(&self, code: Code) -> Code {
        if self.options.shadow_mode {
            Code::Ok
        } else {
            code
        }
    }

    /// Builds the answer from the plan and, when counters were involved,
    /// the backend's verdict `(allowed, outcomes)`.
    fn answer(
        &self,
        domain: &Domain,
        plan: &Plan,
        verdict: Option<(bool, &[Outcome])>,
    ) -> Decision {
        let allowed = verdict.is_none_or(|(allowed, _)| allowed);
        let outcomes = verdict.map(|(_, it)| it).unwrap_or_default();
        let mut statuses = Vec::with_capacity(plan.descriptors.len());
        // The most restrictive limit of each status, for the headers.
        let mut reported: Vec<Candidate> = Vec::new();
        for descriptor in &plan.descriptors {
            let DescriptorPlan::Limits {
                limits,
                metric,
                cost,
            } = descriptor
            else {
                statuses.push(descriptor.status_without_counter());
                continue;
            };
            let candidates: Vec<Candidate> = limits
                .iter()
                .map(|it| Candidate::new(it, &outcomes[it.check]))
                .collect();
            let over = candidates.iter().any(|it| it.denied);
            let chosen = most_restrictive(&candidates).clone();
            // Never more than the reported limit: a token bucket or GCRA
            // can hold more than its number per window, up to its capacity.
            let remaining = if over {
                0
            } else {
                chosen.remaining.min(chosen.limit.limit)
            };
            let result = if over {
                if self.options.shadow_mode && !allowed {
                    metrics::Outcome::Shadow
                } else {
                    metrics::Outcome::OverLimit
                }
            } else if candidates
                .iter()
                .any(|it| it.limit.mode == Mode::Shadow && !outcomes[it.limit.check].has_room)
            {
                metrics::Outcome::Shadow
            } else if remaining.saturating_mul(5)
                < plan.checks[chosen.limit.check].check.params.capacity()
            {
                metrics::Outcome::NearLimit
            } else {
                metrics::Outcome::Ok
            };
            self.metrics.record(&domain.name, metric, result, *cost);
            statuses.push(Status {
                code: if over { Code::OverLimit } else { Code::Ok },
                current_limit: Some(chosen.limit.reported.clone()),
                // Envoy's own X-RateLimit headers pair this with
                // `current_limit.requests_per_unit` (the rate, which is all
                // the proto carries): a burst above it is not reported here.
                limit_remaining: clamp_u32(
                    remaining.min(u64::from(chosen.limit.reported.requests_per_unit)),
                ),
                duration_until_reset_s: Some(ceil_seconds(chosen.reset_us)),
            });
            reported.push(Candidate {
                remaining,
                ..chosen
            });
        }
        let overall = if allowed { Code::Ok } else { Code::OverLimit };
        let headers = match (&self.options.response_headers, reported.is_empty()) {
            (Some(names), false) => {
                let chosen = most_restrictive(&reported);
                let reset = ceil_seconds(chosen.reset_us).to_string();
                let mut headers = vec![
                    (names.limit.clone(), chosen.limit.limit.to_string()),
                    (names.remaining.clone(), chosen.remaining.to_string()),
                    (names.reset.clone(), reset.clone()),
                ];
                if overall == Code::OverLimit && !self.options.shadow_mode {
                    headers.push((names.retry_after.clone(), reset));
                }
                headers
            }
            _ => Vec::new(),
        };
        Decision {
            overall: self.shadowed(overall),
            statuses,
            headers,
        }
    }
}

impl Status {
    fn ok_without_limit() -> Status {
        Status {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset_s: None,
        }
    }
}

// === planning ===

/// Everything decided before the backend call.
#[derive(Debug)]
struct Plan {
    descriptors: Vec<DescriptorPlan>,
    /// Distinct counters; checks reaching the same counter are merged.
    checks: Vec<KeyedCheck>,
    /// `check_rules[i]`: a label of `checks[i]`'s rule, for logs.
    check_rules: Vec<Arc<str>>,
}

#[derive(Debug)]
enum DescriptorPlan {
    /// No rule, or every matched limit was replaced.
    NoLimit,
    Unlimited,
    Limits {
        limits: Vec<PlannedLimit>,
        /// The `rule` label of this descriptor's decision.
        metric: MetricRule,
        /// This descriptor's cost, for the hits metric.
        cost: u64,
    },
}

impl DescriptorPlan {
    fn status_without_counter(&self) -> Status {
        match self {
            DescriptorPlan::Unlimited => Status {
                limit_remaining: u32::MAX,
                ..Status::ok_without_limit()
            },
            _ => Status::ok_without_limit(),
        }
    }
}

#[derive(Debug, Clone)]
struct PlannedLimit {
    /// Index into `Plan::checks`.
    check: usize,
    mode: Mode,
    reported: CurrentLimit,
    /// The real window, for ties and for the headers.
    window_us: u64,
    /// The most that can pass at once, for `RateLimit-Limit`: the number
    /// per window, or the `burst` of a token bucket or GCRA.
    limit: u64,
}

/// A limit considered while choosing the most restrictive one.
#[derive(Debug, Clone)]
struct Candidate {
    limit: PlannedLimit,
    /// Could deny: no room, and not a shadow limit.
    denied: bool,
    remaining: u64,
    reset_us: u64,
}

impl Candidate {
    fn new(limit: &PlannedLimit, outcome: &Outcome) -> Candidate {
        Candidate {
            limit: limit.clone(),
            denied: !outcome.has_room && limit.mode != Mode::Shadow,
            remaining: outcome.remaining,
            reset_us: outcome.reset_us,
        }
    }
}

/// The one that denied (the latest to free up if several), else the one
/// with the least remaining (ties: the longer window, then the first).
fn most_restrictive(candidates: &[Candidate]) -> &Candidate {
    let mut best = &candidates[0];
    for it in &candidates[1..] {
        let better = match (it.denied, best.denied) {
            (true, false) => true,
            (false, true) => false,
            (true, true) => it.reset_us > best.reset_us,
            (false, false) => {
                it.remaining < best.remaining
                    || (it.remaining == best.remaining && it.limit.window_us > best.limit.window_us)
            }
        };
        if better {
            best = it;
        }
    }
    best
}

/// What a descriptor reached in the tree (overrides aside).
enum Found<'a> {
    Nothing,
    Unlimited {
        name: Option<&'a str>,
        replaces: &'a [Arc<str>],
    },
    Limits(Vec<Matched<'a>>),
}

impl Found<'_> {
    /// Names this descriptor's limits replace.
    fn replaces(&self) -> Vec<&str> {
        match self {
            Found::Nothing => Vec::new(),
            Found::Unlimited { replaces, .. } => replaces.iter().map(|it| &**it).collect(),
            Found::Limits(limits) => limits
                .iter()
                .flat_map(|it| it.limit.replaces.iter().map(|name| &**name))
                .collect(),
        }
    }
}

/// A limit a descriptor matched, before `replaces` and merging.
struct Matched<'a> {
    node: &'a Node,
    limit: &'a crate::rules::RateLimit,
}

fn plan(domain: &Domain, request: &Request, max_log_entries: u32) -> Result<Plan, Error> {
    let request_cost = u64::from(request.hits_addend.max(1));
    // First pass: what each descriptor matched, so that `replaces` can look
    // at every matched limit of the request.
    let mut matched: Vec<Found<'_>> = Vec::with_capacity(request.descriptors.len());
    let mut levels: Vec<Vec<&Node>> = Vec::with_capacity(request.descriptors.len());
    for descriptor in &request.descriptors {
        let entries: Vec<(&[u8], &[u8])> = descriptor
            .entries
            .iter()
            .map(|it| (it.key.as_slice(), it.value.as_slice()))
            .collect();
        let found = domain.find(&entries);
        let nodes = found.map(|it| it.levels).unwrap_or_default();
        let res = if enforced_override(descriptor).is_some() {
            // An override ignores the tree's limits (and `replaces`).
            Found::Nothing
        } else {
            match nodes.last() {
                None => Found::Nothing,
                Some(node) => match &node.limits {
                    NodeLimits::None => Found::Nothing,
                    NodeLimits::Unlimited { name, replaces } => Found::Unlimited {
                        name: name.as_deref(),
                        replaces,
                    },
                    NodeLimits::Limited(limits) => {
                        Found::Limits(limits.iter().map(|limit| Matched { node, limit }).collect())
                    }
                },
            }
        };
        matched.push(res);
        levels.push(nodes);
    }
    let replaced: HashSet<&str> = matched.iter().flat_map(Found::replaces).collect();

    let mut checks: Vec<KeyedCheck> = Vec::new();
    let mut check_rules: Vec<Arc<str>> = Vec::new();
    let mut by_key: HashMap<CounterKey, usize> = HashMap::new();
    // Checks on one counter become one check needing room for the sum of
    // their costs. Equal keys mean equal params (config refuses two limits
    // of a node sharing window and algorithm), except two overrides of one
    // descriptor and unit with different numbers in the same request: the
    // first one's number is enforced.
    let mut add = |key: CounterKey, check: Check, rule: Arc<str>| -> usize {
        if let Some(&idx) = by_key.get(&key) {
            let sum = checks[idx].check.cost.saturating_add(check.cost);
            checks[idx].check.cost = sum.min(MAX_EXACT);
            return idx;
        }
        by_key.insert(key.clone(), checks.len());
        checks.push(KeyedCheck { key, check });
        check_rules.push(rule);
        checks.len() - 1
    };

    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (idx, descriptor) in request.descriptors.iter().enumerate() {
        // No capacity reaches 2^53 (exact in a Lua number), so a larger
        // cost is denied either way; capping keeps every backend exact.
        let cost = descriptor
            .hits_addend
            .unwrap_or(request_cost)
            .min(MAX_EXACT);
        if let Some((limit_override, unit)) = enforced_override(descriptor) {
            let algorithm = match levels[idx].last().map(|it| &it.limits) {
                Some(NodeLimits::Limited(limits)) => limits.first().map(|it| it.algorithm()),
                _ => None,
            }
            .unwrap_or(domain.default_algorithm);
            let window_us = unit.seconds() * 1_000_000;
            let requests = u64::from(limit_override.requests_per_unit);
            let params = override_params(algorithm, requests, window_us, max_log_entries).map_err(
                |err| {
                    Error::InvalidArgument(format!(
                        "descriptor {idx}: override of {requests} per {} cannot be enforced: {err}",
                        unit.name()
                    ))
                },
            )?;
            let algorithm = params.algorithm();
            // What is enforced, which can be below what was asked.
            let enforced = params.limit();
            let keys: Vec<String> = descriptor
                .entries
                .iter()
                .map(|it| bytes_label(&it.key))
                .collect();
            let rule: Arc<str> = Arc::from(keys.join("."));
            let key = CounterKey {
                domain: domain.name.clone(),
                rule: rule.clone(),
                algorithm,
                // The override's unit, not its number: raising the number
                // mid-window keeps the counter and gives the extra room at once.
                window_s: unit.seconds(),
                is_override: true,
                entries: descriptor
                    .entries
                    .iter()
                    .map(|it| KeyEntry {
                        key: KeyBytes::new(&it.key),
                        value: KeyValue::Value(KeyBytes::new(&it.value)),
                    })
                    .collect(),
            };
            let check = Check {
                params,
                cost,
                mode: Mode::Enforce,
            };
            let check_idx = add(key, check, rule);
            descriptors.push(DescriptorPlan::Limits {
                limits: vec![PlannedLimit {
                    check: check_idx,
                    mode: Mode::Enforce,
                    reported: CurrentLimit {
                        requests_per_unit: clamp_u32(enforced),
                        unit,
                        name: Arc::from(""),
                    },
                    window_us,
                    limit: params.capacity(),
                }],
                metric: MetricRule::Override,
                cost,
            });
            continue;
        }
        let limits = match &matched[idx] {
            Found::Nothing => {
                descriptors.push(DescriptorPlan::NoLimit);
                continue;
            }
            Found::Unlimited { name, .. } => {
                // A replaced unlimited rule is dropped like any other.
                descriptors.push(if name.is_some_and(|it| replaced.contains(it)) {
                    DescriptorPlan::NoLimit
                } else {
                    DescriptorPlan::Unlimited
                });
                continue;
            }
            Found::Limits(limits) => limits,
        };
        let mut planned = Vec::with_capacity(limits.len());
        // Once per descriptor: a long key or value is hashed once, not per limit.
        let entry_bytes: Vec<(KeyBytes, KeyBytes)> = descriptor
            .entries
            .iter()
            .map(|it| (KeyBytes::new(&it.key), KeyBytes::new(&it.value)))
            .collect();
        for Matched { node, limit } in limits {
            if limit
                .name
                .as_deref()
                .is_some_and(|name| replaced.contains(name))
            {
                continue;
            }
            let mode = if node.shadow_mode {
                Mode::Shadow
            } else if node.quota_mode {
                Mode::Quota
            } else {
                Mode::Enforce
            };
            let key = CounterKey {
                domain: domain.name.clone(),
                rule: node.path.clone(),
                algorithm: limit.algorithm(),
                window_s: limit.window_seconds(),
                is_override: false,
                entries: entry_bytes
                    .iter()
                    .zip(&levels[idx])
                    .map(|((key, value), level)| KeyEntry {
                        key: key.clone(),
                        value: match &level.value {
                            ValueMatcher::Wildcard(pattern) if level.share_threshold => {
                                KeyValue::Shared(pattern.clone())
                            }
                            _ => KeyValue::Value(value.clone()),
                        },
                    })
                    .collect(),
            };
            let check = Check {
                params: limit.params,
                cost,
                mode,
            };
            let rule_label: Arc<str> = match &limit.name {
                Some(name) => Arc::from(format!("{} ({name})", node.path)),
                None => node.path.clone(),
            };
            let check_idx = add(key, check, rule_label);
            planned.push(PlannedLimit {
                check: check_idx,
                mode,
                reported: CurrentLimit {
                    requests_per_unit: limit.requests_per_unit,
                    unit: limit.unit,
                    name: limit.name.clone().unwrap_or_else(|| Arc::from("")),
                },
                window_us: limit.params.window_us(),
                limit: limit.params.capacity(),
            });
        }
        descriptors.push(if planned.is_empty() {
            DescriptorPlan::NoLimit
        } else {
            DescriptorPlan::Limits {
                limits: planned,
                metric: metric_rule(&levels[idx], &descriptor.entries),
                cost,
            }
        });
    }
    Ok(Plan {
        descriptors,
        checks,
        check_rules,
    })
}

/// The parameters enforced for a RateLimitOverride of `requests` per
/// `window_us` on `algorithm` (the matched rule's, else the domain's
/// default). A client chooses the number, so every number is decided:
///
/// - a sliding-window log over `max_log_entries` uses the sliding-window
///   counter, as a rule that inherits the log does (the log would keep one
///   entry per request);
/// - where the algorithm cannot hold the number exactly in 53 bits (see
///   [`LimitParams::new`]), the largest number below it that it can hold at
///   the same window: the same algorithm with a smaller number admits no
///   more, in any state, than with the number asked.
fn override_params(
    algorithm: Algorithm,
    requests: u64,
    window_us: u64,
    max_log_entries: u32,
) -> Result<LimitParams, ParamsError> {
    let algorithm =
        if algorithm == Algorithm::SlidingWindowLog && requests > u64::from(max_log_entries) {
            Algorithm::SlidingWindowCounter
        } else {
            algorithm
        };
    let exact = LimitParams::new(algorithm, requests, window_us, None);
    if exact.is_ok() {
        return exact;
    }
    let fitted = match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => largest_exact_rate(requests, window_us),
        // `(N + 1) × W_ms < 2^53`.
        Algorithm::SlidingWindowCounter => ((MAX_EXACT - 1) / (window_us / 1_000))
            .saturating_sub(1)
            .min(requests),
        // Exact for every number a request can carry.
        Algorithm::SlidingWindowLog | Algorithm::FixedWindow => requests,
    };
    LimitParams::new(algorithm, fitted, window_us, None)
}

/// The largest `n <= requests` for which a token bucket or GCRA of `n` per
/// `window_us` (capacity `n`) stays exact: `n × W / gcd(n, W) < 2^53`.
///
/// Write `n = m × g` with `g = gcd(n, W)`: the condition is `m × W < 2^53`,
/// so `m <= M = (2^53 - 1) / W`, and `g` divides `W`. The best `n` for a
/// divisor `g` is `min(requests / g, M) × g` (a larger gcd only helps), so
/// the largest over the divisors of `W` is the answer.
fn largest_exact_rate(requests: u64, window_us: u64) -> u64 {
    let most_m = (MAX_EXACT - 1) / window_us;
    divisors(window_us)
        .into_iter()
        .map(|g| (requests / g).min(most_m) * g)
        .max()
        .unwrap_or(0)
}

/// Every divisor of `n > 0`. Windows are whole seconds of µs (products of
/// 2, 3, 5, 7 and 73 for the units a request can name), so trial division
/// ends quickly.
fn divisors(mut n: u64) -> Vec<u64> {
    let mut primes: Vec<(u64, u32)> = Vec::new();
    let mut p = 2;
    while p * p <= n {
        let mut power = 0;
        while n.is_multiple_of(p) {
            n /= p;
            power += 1;
        }
        if power > 0 {
            primes.push((p, power));
        }
        p += 1;
    }
    if n > 1 {
        primes.push((n, 1));
    }
    let mut out = vec![1u64];
    for (p, power) in primes {
        let mut next = Vec::with_capacity(out.len() * (power as usize + 1));
        for &d in &out {
            let mut it = d;
            for k in 0..=power {
                next.push(it);
                // Never past `d × p^power`, which divides `n`: no overflow.
                if k < power {
                    it *= p;
                }
            }
        }
        out = next;
    }
    out
}

/// The `rule` label of a descriptor that reached `levels`: the rule's path,
/// unless the rule has `detailed_metric` (every level with its value, as
/// envoyproxy/ratelimit) or some level has `value_to_metric` (that level
/// with its value, even where the config names none or a wildcard).
fn metric_rule(levels: &[&Node], entries: &[Entry]) -> MetricRule {
    let Some(rule) = levels.last() else {
        return MetricRule::Override;
    };
    let detailed = rule.detailed_metric;
    if !detailed && !levels.iter().any(|it| it.value_to_metric) {
        return MetricRule::Path(rule.path.clone());
    }
    let mut label = String::new();
    for (level, entry) in levels.iter().zip(entries) {
        if !label.is_empty() {
            label.push('.');
        }
        label.push_str(&level.key);
        if detailed || level.value_to_metric {
            // Escaped, and a long value as its digest: a label stays short
            // and printable whatever the request sends.
            label.push('_');
            label.push_str(&bytes_label(&entry.value));
        } else if let ValueMatcher::Exact(value) | ValueMatcher::Wildcard(value) = &level.value {
            label.push('_');
            label.push_str(value);
        }
    }
    MetricRule::Values {
        rule: rule.path.clone(),
        label,
    }
}

/// The descriptor's override with its unit, if it has one that can be
/// enforced. An override whose unit is UNKNOWN says nothing enforceable, so
/// the descriptor is decided by the rules as if it had none: refusing the
/// request would let it through Envoy.
fn enforced_override(descriptor: &Descriptor) -> Option<(&LimitOverride, Unit)> {
    let limit_override = descriptor.limit.as_ref()?;
    Some((limit_override, limit_override.unit?))
}

// === bounds ===

/// Refuses only what no Envoy sends and no rule could decide: an empty
/// domain, no descriptors, too many of them, a descriptor without entries
/// or with too many, an empty entry key. Keys and values of any length and
/// any bytes are decided (the 64 KiB message cap bounds them).
fn validate(request: &Request) -> Result<(), Error> {
    let invalid = |message: String| Err(Error::InvalidArgument(message));
    if request.domain.is_empty() {
        return invalid("empty domain".to_owned());
    }
    if request.descriptors.is_empty() {
        return invalid("no descriptors".to_owned());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return invalid(format!(
            "too many descriptors: {}, at most {MAX_DESCRIPTORS}",
            request.descriptors.len()
        ));
    }
    for (idx, descriptor) in request.descriptors.iter().enumerate() {
        if descriptor.entries.is_empty() {
            return invalid(format!("descriptor {idx} has no entries"));
        }
        if descriptor.entries.len() > MAX_ENTRIES {
            return invalid(format!(
                "descriptor {idx} has too many entries: {}, at most {MAX_ENTRIES}",
                descriptor.entries.len()
            ));
        }
        for (entry_idx, entry) in descriptor.entries.iter().enumerate() {
            if entry.key.is_empty() {
                return invalid(format!(
                    "descriptor {idx}, entry {entry_idx}: empty entry key"
                ));
            }
        }
    }
    Ok(())
}

/// Request bytes as text for logs and metric labels: UTF-8 as is, every
/// byte that is not UTF-8 and every control character as `\xNN` (or
/// `\u{NNNN}`), and `\` as `\\`, so no two byte strings look alike; never
/// raw bytes.
pub fn printable(bytes: &[u8]) -> Cow<'_, str> {
    if let Ok(text) = std::str::from_utf8(bytes)
        && !text.chars().any(|ch| ch == '\\' || ch.is_control())
    {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(bytes.len() + 8);
    // Writing into a String cannot fail.
    for chunk in bytes.utf8_chunks() {
        for ch in chunk.valid().chars() {
            match ch {
                '\\' => out.push_str("\\\\"),
                _ if ch.is_ascii_control() => {
                    let _ = write!(out, "\\x{:02x}", u32::from(ch));
                }
                _ if ch.is_control() => {
                    let _ = write!(out, "{}", ch.escape_unicode());
                }
                _ => out.push(ch),
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(out, "\\x{byte:02x}");
        }
    }
    Cow::Owned(out)
}

/// Request bytes as a short label for logs and metrics: [`printable`], or
/// `sha256:<hex>` for bytes a counter key holds as their digest.
pub fn bytes_label(bytes: &[u8]) -> String {
    match KeyBytes::new(bytes).digest() {
        Some(digest) => {
            let mut out = String::with_capacity(7 + 64);
            out.push_str("sha256:");
            for byte in digest {
                // Writing into a String cannot fail.
                let _ = write!(out, "{byte:02x}");
            }
            out
        }
        None => printable(bytes).into_owned(),
    }
}

// === helpers ===

fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

fn clamp_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::rules::{DEFAULT_MAX_LOG_ENTRIES, Limits, RateLimit, ValueMatcher};
    use crate::testing::{self, FakeBackend, T0};

    // === rule builders ===

    fn limit(requests_per_unit: u32, unit: Unit) -> RateLimit {
        limit_with(requests_per_unit, unit, 1, Algorithm::SlidingWindowLog)
    }

    fn limit_with(
        requests_per_unit: u32,
        unit: Unit,
        unit_multiplier: u32,
        algorithm: Algorithm,
    ) -> RateLimit {
        RateLimit::new(unit, unit_multiplier, requests_per_unit, algorithm, None).unwrap()
    }

    fn named(mut it: RateLimit, name: &str, replaces: &[&str]) -> RateLimit {
        it.name = Some(Arc::from(name));
        it.replaces = replaces.iter().map(|it| Arc::from(*it)).collect();
        it
    }

    fn node(key: &str, value: ValueMatcher, limits: NodeLimits) -> Node {
        Node::new("", Arc::from(key), value, limits)
    }

    fn with_children(parent: Node, children: Vec<Node>) -> Node {
        parent.with_children(children)
    }

    fn unlimited() -> NodeLimits {
        NodeLimits::Unlimited {
            name: None,
            replaces: Vec::new(),
        }
    }

    fn key_node(key: &str, limits: Vec<RateLimit>) -> Node {
        node(
            key,
            ValueMatcher::Any,
            NodeLimits::Limited(Limits::new(limits).unwrap()),
        )
    }

    fn rules(nodes: Vec<Node>) -> RuleSet {
        let domain = Domain::new(Arc::from("test"), Algorithm::SlidingWindowLog, nodes);
        RuleSet::new([domain], DEFAULT_MAX_LOG_ENTRIES)
    }

    // === request builders ===

    fn desc(entries: &[(&str, &str)]) -> Descriptor {
        Descriptor {
            entries: entries
                .iter()
                .map(|(key, value)| Entry {
                    key: key.as_bytes().to_vec(),
                    value: value.as_bytes().to_vec(),
                })
                .collect(),
            limit: None,
            hits_addend: None,
        }
    }

    fn req(descriptors: Vec<Descriptor>) -> Request {
        Request {
            domain: "test".to_owned(),
            descriptors,
            hits_addend: 0,
        }
    }

    fn options() -> Options {
        testing::default_options()
    }

    struct Fixture {
        limiter: Limiter,
        clock: ManualClock,
    }

    fn fixture(rules: RuleSet, options: Options) -> Fixture {
        let clock = ManualClock::new(T0);
        Fixture {
            limiter: testing::limiter(
                rules,
                testing::memory_backend(&clock),
                options,
                Metrics::new(),
            ),
            clock,
        }
    }

    /// A limiter whose backend is always down.
    fn down(rules: RuleSet, failure_mode: FailureMode) -> Limiter {
        testing::limiter(
            rules,
            Arc::new(FakeBackend::down()),
            Options {
                failure_mode,
                ..options()
            },
            Metrics::new(),
        )
    }

    /// `(code, remaining, reset seconds, (requests_per_unit, unit, name))`
    /// of a status: what the table rows compare.
    type Brief = (Code, u32, Option<u64>, Option<(u32, Unit, String)>);

    fn brief(status: &Status) -> Brief {
        (
            status.code,
            status.limit_remaining,
            status.duration_until_reset_s,
            status
                .current_limit
                .as_ref()
                .map(|it| (it.requests_per_unit, it.unit, it.name.to_string())),
        )
    }

    fn ok_none() -> Brief {
        (Code::Ok, 0, None, None)
    }

    fn lim(code: Code, remaining: u32, reset: u64, rpu: u32, unit: Unit, name: &str) -> Brief {
        (
            code,
            remaining,
            Some(reset),
            Some((rpu, unit, name.to_owned())),
        )
    }

    /// Runs `steps` in order, each `(request, overall, statuses)`.
    async fn check(fixture: &Fixture, steps: &[(Request, Code, Vec<Brief>)]) {
        for (idx, (request, overall, statuses)) in steps.iter().enumerate() {
            let decision = fixture.limiter.decide(request).await.unwrap();
            let got: Vec<Brief> = decision.statuses.iter().map(brief).collect();
            assert_eq!(
                (decision.overall, &got),
                (*overall, statuses),
                "step {idx}: {request:?}"
            );
        }
    }

    fn header<'a>(decision: &'a Decision, name: &str) -> Option<&'a str> {
        decision
            .headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }

    use Code::{Ok as OK, OverLimit as OVER};

    // === tests ===

    #[tokio::test]
    async fn bounds_are_invalid_argument_with_a_reason() {
        let many_entries: Vec<(&str, &str)> = vec![("k", "v"); MAX_ENTRIES + 1];
        let cases: Vec<(Request, &str)> = vec![
            (
                Request {
                    domain: String::new(),
                    ..req(vec![desc(&[("k", "v")])])
                },
                "empty domain",
            ),
            (req(vec![]), "no descriptors"),
            (req(vec![desc(&[])]), "descriptor 0 has no entries"),
            (
                req(vec![desc(&[("k", "v")]), desc(&[("", "v")])]),
                "descriptor 1, entry 0: empty entry key",
            ),
            (
                req(vec![desc(&[("k", "v")]); MAX_DESCRIPTORS + 1]),
                "too many descriptors: 65, at most 64",
            ),
            (
                req(vec![desc(&many_entries)]),
                "descriptor 0 has too many entries: 33, at most 32",
            ),
        ];
        let fixture = fixture(rules(vec![]), options());
        for (request, expected) in cases {
            match fixture.limiter.decide(&request).await {
                Err(Error::InvalidArgument(message)) => assert_eq!(message, expected),
                other => panic!("{expected}: got {other:?}"),
            }
        }
        // At the bounds exactly: accepted.
        let entries: Vec<(&str, &str)> = vec![("k", "v"); MAX_ENTRIES];
        let request = req(vec![desc(&entries); MAX_DESCRIPTORS]);
        assert!(fixture.limiter.decide(&request).await.is_ok());
    }

    #[tokio::test]
    async fn keys_and_values_of_any_length_and_bytes_are_decided() {
        let fixture = fixture(
            rules(vec![
                key_node("path", vec![limit(2, Unit::Hour)]),
                node(
                    "exact",
                    ValueMatcher::Exact(Arc::from("v")),
                    NodeLimits::Limited(Limits::new(vec![limit(1, Unit::Hour)]).unwrap()),
                ),
            ]),
            options(),
        );
        let entry = |key: &[u8], value: &[u8]| Descriptor {
            entries: vec![Entry {
                key: key.to_vec(),
                value: value.to_vec(),
            }],
            ..Descriptor::default()
        };
        let long = vec![b'a'; 70_000];
        let mut long_other = long.clone();
        long_other[69_999] = b'b';
        let status = |code, remaining| lim(code, remaining, 3600, 2, Unit::Hour, "");
        let one = |it: Descriptor| req(vec![it]);
        check(
            &fixture,
            &[
                // A long value, a domain longer than 1 KiB, a long key that
                // matches no rule: all decided.
                (one(entry(b"path", &long)), OK, vec![status(OK, 1)]),
                (one(entry(b"path", &long)), OK, vec![status(OK, 0)]),
                (one(entry(b"path", &long)), OVER, vec![status(OVER, 0)]),
                // Another long value with the same first bytes: its own counter.
                (one(entry(b"path", &long_other)), OK, vec![status(OK, 1)]),
                (one(entry(&long, b"v")), OK, vec![ok_none()]),
                // Bytes that are not UTF-8: their own counter too.
                (one(entry(b"path", b"\xff")), OK, vec![status(OK, 1)]),
                (one(entry(b"path", b"\xfe")), OK, vec![status(OK, 1)]),
                (one(entry(b"path", b"\xff")), OK, vec![status(OK, 0)]),
                (one(entry(b"path", b"")), OK, vec![status(OK, 1)]),
                // An exact rule value matches the same bytes only.
                (one(entry(b"exact", b"v\xff")), OK, vec![ok_none()]),
                (
                    one(entry(b"exact", b"v")),
                    OK,
                    vec![lim(OK, 0, 3600, 1, Unit::Hour, "")],
                ),
            ],
        )
        .await;
        let long_domain = Request {
            domain: "d".repeat(2_000),
            ..one(entry(b"path", b"v"))
        };
        check(&fixture, &[(long_domain, OK, vec![ok_none()])]).await;
    }

    #[tokio::test]
    async fn metric_labels_show_bytes_escaped() {
        let mut detailed = key_node("path", vec![limit(5, Unit::Hour)]);
        detailed.detailed_metric = true;
        let fixture = fixture(rules(vec![detailed]), options());
        let request = req(vec![Descriptor {
            entries: vec![Entry {
                key: b"path".to_vec(),
                value: b"/a\xff\\b\n".to_vec(),
            }],
            ..Descriptor::default()
        }]);
        fixture.limiter.decide(&request).await.unwrap();
        let long = vec![b'v'; 1_000];
        let request = req(vec![Descriptor {
            entries: vec![Entry {
                key: b"path".to_vec(),
                value: long.clone(),
            }],
            ..Descriptor::default()
        }]);
        fixture.limiter.decide(&request).await.unwrap();
        let text = fixture.limiter.metrics().encode();
        // The label holds `\xff`, `\\` and `\x0a` as text; the exposition
        // escapes each backslash once more.
        let expected = r#"rule="path_/a\\xff\\\\b\\x0a""#;
        assert!(text.contains(expected), "{expected}\n{text}");
        // A long value is its digest.
        let expected = format!("rule=\"path_{}\"", bytes_label(&long));
        assert!(expected.contains("sha256:"), "{expected}");
        assert!(text.contains(&expected), "{expected}\n{text}");
        assert!(!text.contains("vvvv"), "{text}");
    }

    #[test]
    fn printable_escapes_what_is_not_text() {
        let cases: [(&[u8], &str); 7] = [
            (b"plain", "plain"),
            ("ü".as_bytes(), "ü"),
            (b"\xff", "\\xff"),
            (b"a\xc3", "a\\xc3"),
            (b"\\xff", "\\\\xff"),
            (b"tab\t", "tab\\x09"),
            ("\u{85}".as_bytes(), "\\u{85}"),
        ];
        for (bytes, expected) in cases {
            assert_eq!(printable(bytes), expected, "{bytes:?}");
        }
    }

    #[tokio::test]
    async fn requests_without_counters_never_reach_the_backend() {
        let tree = rules(vec![
            key_node("limited", vec![limit(1, Unit::Minute)]),
            node("health", ValueMatcher::Any, unlimited()),
            with_children(
                node("parent", ValueMatcher::Any, NodeLimits::None),
                vec![key_node("child", vec![limit(1, Unit::Minute)])],
            ),
        ]);
        let limiter = down(tree, FailureMode::Error);
        let unlimited = (OK, u32::MAX, None, None);
        let cases: Vec<(Request, Vec<Brief>)> = vec![
            (
                Request {
                    domain: "unknown".to_owned(),
                    ..req(vec![desc(&[("limited", "a")]), desc(&[("x", "y")])])
                },
                vec![ok_none(), ok_none()],
            ),
            (req(vec![desc(&[("nothing", "a")])]), vec![ok_none()]),
            (req(vec![desc(&[("health", "a")])]), vec![unlimited.clone()]),
            // The node reached by the last entry has no limit: depth must match.
            (req(vec![desc(&[("parent", "a")])]), vec![ok_none()]),
            (
                req(vec![desc(&[("limited", "a"), ("deeper", "b")])]),
                vec![ok_none()],
            ),
            (
                req(vec![desc(&[("health", "a")]), desc(&[("nothing", "b")])]),
                vec![unlimited, ok_none()],
            ),
        ];
        for (request, expected) in cases {
            let decision = limiter.decide(&request).await.unwrap();
            let got: Vec<Brief> = decision.statuses.iter().map(brief).collect();
            assert_eq!((decision.overall, got), (OK, expected), "{request:?}");
            assert!(decision.headers.is_empty());
        }
        // The same limiter does call the backend for a limited descriptor.
        let res = limiter.decide(&req(vec![desc(&[("limited", "a")])])).await;
        assert!(matches!(res, Err(Error::Backend(_))), "{res:?}");
    }

    #[tokio::test]
    async fn over_limit_after_n_with_remaining_and_reset() {
        let fixture = fixture(
            rules(vec![key_node(
                "user",
                vec![named(limit(3, Unit::Minute), "per_user", &[])],
            )]),
            options(),
        );
        let one = || req(vec![desc(&[("user", "alice")])]);
        let status =
            |code, remaining, reset| lim(code, remaining, reset, 3, Unit::Minute, "per_user");
        check(
            &fixture,
            &[
                (one(), OK, vec![status(OK, 2, 60)]),
                (one(), OK, vec![status(OK, 1, 60)]),
                (one(), OK, vec![status(OK, 0, 60)]),
                (one(), OVER, vec![status(OVER, 0, 60)]),
                // Another value has its own counter.
                (
                    req(vec![desc(&[("user", "bob")])]),
                    OK,
                    vec![status(OK, 2, 60)],
                ),
            ],
        )
        .await;
        // 20.5 s later the window still holds all three: 39.5 s → 40 s.
        fixture.clock.advance(20_500_000);
        check(&fixture, &[(one(), OVER, vec![status(OVER, 0, 40)])]).await;
        fixture.clock.advance(40_000_000);
        check(&fixture, &[(one(), OK, vec![status(OK, 2, 60)])]).await;
    }

    #[tokio::test]
    async fn denied_request_consumes_nothing_anywhere() {
        let fixture = fixture(
            rules(vec![
                key_node("a", vec![limit(5, Unit::Minute)]),
                key_node("b", vec![limit(1, Unit::Minute)]),
            ]),
            options(),
        );
        let both = || req(vec![desc(&[("a", "1")]), desc(&[("b", "1")])]);
        let a = |code, remaining| lim(code, remaining, 60, 5, Unit::Minute, "");
        let b = |code, remaining| lim(code, remaining, 60, 1, Unit::Minute, "");
        check(
            &fixture,
            &[
                (both(), OK, vec![a(OK, 4), b(OK, 0)]),
                // A had room and reports its current remaining: nothing taken.
                (both(), OVER, vec![a(OK, 4), b(OVER, 0)]),
                (both(), OVER, vec![a(OK, 4), b(OVER, 0)]),
                (req(vec![desc(&[("a", "1")])]), OK, vec![a(OK, 3)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn costs_from_request_and_descriptor_hits_addend() {
        let fixture = fixture(
            rules(vec![key_node("k", vec![limit(5, Unit::Minute)])]),
            options(),
        );
        let status = |code, remaining| lim(code, remaining, 60, 5, Unit::Minute, "");
        let with = |request_hits: u32, descriptor_hits: Option<u64>| Request {
            hits_addend: request_hits,
            ..req(vec![Descriptor {
                hits_addend: descriptor_hits,
                ..desc(&[("k", "v")])
            }])
        };
        check(
            &fixture,
            &[
                // 0 means 1.
                (with(0, None), OK, vec![status(OK, 4)]),
                (with(2, None), OK, vec![status(OK, 2)]),
                // The descriptor's own value wins, even 0 (a check).
                (with(9, Some(0)), OK, vec![status(OK, 2)]),
                (with(9, Some(1)), OK, vec![status(OK, 1)]),
                // More than is left: denied, nothing consumed.
                (with(2, None), OVER, vec![status(OVER, 0)]),
                (with(1, None), OK, vec![status(OK, 0)]),
                // A check with nothing left is OVER_LIMIT.
                (with(0, Some(0)), OVER, vec![status(OVER, 0)]),
            ],
        )
        .await;
        // A cost larger than the capacity can never pass, however large.
        fixture.clock.advance(60_000_000);
        check(&fixture, &[(with(6, None), OVER, vec![status(OVER, 0)])]).await;
        let huge = Request {
            hits_addend: 0,
            ..req(vec![
                Descriptor {
                    hits_addend: Some(u64::MAX),
                    ..desc(&[("k", "v")])
                },
                Descriptor {
                    hits_addend: Some(u64::MAX),
                    ..desc(&[("k", "v")])
                },
            ])
        };
        check(
            &fixture,
            &[
                (huge, OVER, vec![status(OVER, 0), status(OVER, 0)]),
                (with(1, None), OK, vec![status(OK, 4)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn descriptors_reaching_one_counter_add_their_costs() {
        let fixture = fixture(
            rules(vec![key_node("k", vec![limit(3, Unit::Minute)])]),
            options(),
        );
        let status = |code, remaining| lim(code, remaining, 60, 3, Unit::Minute, "");
        let twice = || req(vec![desc(&[("k", "v")]), desc(&[("k", "v")])]);
        check(
            &fixture,
            &[
                (twice(), OK, vec![status(OK, 1), status(OK, 1)]),
                // Needs 2, has 1.
                (twice(), OVER, vec![status(OVER, 0), status(OVER, 0)]),
                (req(vec![desc(&[("k", "v")])]), OK, vec![status(OK, 0)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn share_threshold_values_share_one_counter() {
        let mut shared = node(
            "path",
            ValueMatcher::Wildcard(Arc::from("/files/*")),
            NodeLimits::Limited(Limits::new(vec![limit(2, Unit::Hour)]).unwrap()),
        );
        shared.share_threshold = true;
        let mut own = node(
            "path",
            ValueMatcher::Wildcard(Arc::from("/own/*")),
            NodeLimits::Limited(Limits::new(vec![limit(2, Unit::Hour)]).unwrap()),
        );
        own.share_threshold = false;
        let fixture = fixture(rules(vec![shared, own]), options());
        let status = |code, remaining| lim(code, remaining, 3600, 2, Unit::Hour, "");
        let path = |value: &str| req(vec![desc(&[("path", value)])]);
        check(
            &fixture,
            &[
                (path("/files/a"), OK, vec![status(OK, 1)]),
                (path("/files/b"), OK, vec![status(OK, 0)]),
                (path("/files/c"), OVER, vec![status(OVER, 0)]),
                (path("/own/a"), OK, vec![status(OK, 1)]),
                (path("/own/b"), OK, vec![status(OK, 1)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn replaced_limits_are_dropped_and_not_counted() {
        let fixture = fixture(
            rules(vec![
                key_node(
                    "api_key",
                    vec![named(limit(1, Unit::Minute), "premium", &[])],
                ),
                key_node(
                    "path",
                    vec![named(limit(10, Unit::Minute), "expensive", &["premium"])],
                ),
            ]),
            options(),
        );
        let premium = |code, remaining| lim(code, remaining, 60, 1, Unit::Minute, "premium");
        let expensive = |remaining| lim(OK, remaining, 60, 10, Unit::Minute, "expensive");
        let both = || req(vec![desc(&[("api_key", "k")]), desc(&[("path", "/x")])]);
        check(
            &fixture,
            &[
                (both(), OK, vec![ok_none(), expensive(9)]),
                (both(), OK, vec![ok_none(), expensive(8)]),
                // premium was never counted above.
                (
                    req(vec![desc(&[("api_key", "k")])]),
                    OK,
                    vec![premium(OK, 0)],
                ),
                (
                    req(vec![desc(&[("api_key", "k")])]),
                    OVER,
                    vec![premium(OVER, 0)],
                ),
                // Replaced even while exhausted: the replacing limit decides.
                (both(), OK, vec![ok_none(), expensive(7)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn an_unlimited_rule_replaces_too_and_can_be_replaced() {
        let fixture = fixture(
            rules(vec![
                key_node(
                    "api_key",
                    vec![named(limit(1, Unit::Minute), "premium", &[])],
                ),
                node(
                    "vip",
                    ValueMatcher::Any,
                    NodeLimits::Unlimited {
                        name: Some(Arc::from("vip")),
                        replaces: vec![Arc::from("premium")],
                    },
                ),
                key_node(
                    "boss",
                    vec![named(limit(5, Unit::Minute), "boss", &["vip"])],
                ),
            ]),
            options(),
        );
        let unlimited = (OK, u32::MAX, None, None);
        let vip = || req(vec![desc(&[("api_key", "k")]), desc(&[("vip", "v")])]);
        check(
            &fixture,
            &[
                (vip(), OK, vec![ok_none(), unlimited.clone()]),
                (vip(), OK, vec![ok_none(), unlimited]),
                // A replaced unlimited rule is dropped like any other.
                (
                    req(vec![desc(&[("vip", "v")]), desc(&[("boss", "b")])]),
                    OK,
                    vec![ok_none(), lim(OK, 4, 60, 5, Unit::Minute, "boss")],
                ),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn override_uses_its_own_counter_and_reports_no_name() {
        let fixture = fixture(
            rules(vec![key_node(
                "k",
                vec![named(
                    limit_with(100, Unit::Minute, 1, Algorithm::TokenBucket),
                    "rule",
                    &[],
                )],
            )]),
            options(),
        );
        let with_override = |requests_per_unit| {
            req(vec![Descriptor {
                limit: Some(LimitOverride {
                    requests_per_unit,
                    unit: Some(Unit::Second),
                }),
                ..desc(&[("k", "v")])
            }])
        };
        // Token bucket (the rule's algorithm): 2 per second refills one
        // token per 500 ms.
        let status =
            |rpu, code, remaining, reset| lim(code, remaining, reset, rpu, Unit::Second, "");
        check(
            &fixture,
            &[
                (with_override(2), OK, vec![status(2, OK, 1, 1)]),
                (with_override(2), OK, vec![status(2, OK, 0, 1)]),
                (with_override(2), OVER, vec![status(2, OVER, 0, 1)]),
                // The rule's own counter is untouched.
                (
                    req(vec![desc(&[("k", "v")])]),
                    OK,
                    vec![lim(OK, 99, 1, 100, Unit::Minute, "rule")],
                ),
                // An override for a descriptor no rule matches is enforced too.
                (
                    req(vec![Descriptor {
                        limit: Some(LimitOverride {
                            requests_per_unit: 0,
                            unit: Some(Unit::Minute),
                        }),
                        ..desc(&[("nothing", "v")])
                    }]),
                    OVER,
                    vec![lim(OVER, 0, 60, 0, Unit::Minute, "")],
                ),
            ],
        )
        .await;
        // The rule's algorithm: half a second refills one token (a sliding
        // log would still be full).
        fixture.clock.advance(500_000);
        check(
            &fixture,
            &[(with_override(2), OK, vec![status(2, OK, 0, 1)])],
        )
        .await;

        // No rule: the domain's default (sliding log). Same unit, bigger
        // number: the same counter, and the extra room at once.
        let other = |requests_per_unit| {
            req(vec![Descriptor {
                limit: Some(LimitOverride {
                    requests_per_unit,
                    unit: Some(Unit::Hour),
                }),
                ..desc(&[("other", "v")])
            }])
        };
        let hourly = |rpu, code, remaining| lim(code, remaining, 3600, rpu, Unit::Hour, "");
        check(
            &fixture,
            &[
                (other(1), OK, vec![hourly(1, OK, 0)]),
                (other(1), OVER, vec![hourly(1, OVER, 0)]),
                (other(2), OK, vec![hourly(2, OK, 0)]),
            ],
        )
        .await;

        // In an unknown domain the override is not enforced.
        let unknown = Request {
            domain: "unknown".to_owned(),
            ..with_override(0)
        };
        check(&fixture, &[(unknown, OK, vec![ok_none()])]).await;
    }

    /// Numbers a client may send that some algorithm cannot hold exactly.
    const EXTREME_OVERRIDES: [(u32, Unit); 5] = [
        (1, Unit::Year),
        (u32::MAX, Unit::Second),
        (999_999, Unit::Month),
        (1_000_003, Unit::Year),
        (1_000_000, Unit::Year),
    ];

    #[test]
    fn override_params_are_exact_and_never_above_the_number_asked() {
        for algorithm in Algorithm::ALL {
            for (requests, unit) in EXTREME_OVERRIDES {
                let asked = u64::from(requests);
                let window_us = unit.seconds() * 1_000_000;
                let params = override_params(algorithm, asked, window_us, 10_000)
                    .unwrap_or_else(|err| panic!("{algorithm} {requests}/{unit:?}: {err}"));
                let case = format!("{algorithm} {requests}/{}", unit.name());
                assert!(params.limit() <= asked, "{case}: {params:?}");
                assert!(params.capacity() <= asked, "{case}: {params:?}");
                assert!(params.limit() > 0, "{case}: {params:?}");
                assert_eq!(params.window_us(), window_us, "{case}");
                let exact = LimitParams::new(params.algorithm(), asked, window_us, None).is_ok();
                if exact {
                    assert_eq!(params.limit(), asked, "{case}: exact, so unchanged");
                } else {
                    // The nearest below: the next numbers up are not exact.
                    let above = (params.limit() + 1)..=asked.min(params.limit() + 2_000);
                    for n in above {
                        assert!(
                            LimitParams::new(params.algorithm(), n, window_us, None).is_err(),
                            "{case}: {n} is exact and nearer than {}",
                            params.limit()
                        );
                    }
                }
                let expected = if algorithm == Algorithm::SlidingWindowLog && asked > 10_000 {
                    Algorithm::SlidingWindowCounter
                } else {
                    algorithm
                };
                assert_eq!(params.algorithm(), expected, "{case}");
            }
        }
        // The numbers the exactness rule refuses do change.
        let refused = |algorithm, requests: u64, unit: Unit| {
            LimitParams::new(algorithm, requests, unit.seconds() * 1_000_000, None).is_err()
        };
        assert!(refused(Algorithm::TokenBucket, 999_999, Unit::Month));
        assert!(refused(Algorithm::Gcra, 1_000_003, Unit::Year));
        assert!(refused(
            Algorithm::SlidingWindowCounter,
            1_000_000,
            Unit::Year
        ));
    }

    #[test]
    fn divisors_of_a_window() {
        let mut got = divisors(360);
        got.sort_unstable();
        let expected: Vec<u64> = (1..=360).filter(|it| 360 % it == 0).collect();
        assert_eq!(got, expected);
        assert_eq!(divisors(1), vec![1]);
        // A year in µs: 2^13 · 3^3 · 5^9 · 73.
        assert_eq!(
            divisors(Unit::Year.seconds() * 1_000_000).len(),
            14 * 4 * 10 * 2
        );
    }

    #[tokio::test]
    async fn every_override_is_decided_on_every_algorithm() {
        for algorithm in Algorithm::ALL {
            let fixture = fixture(
                rules(vec![key_node(
                    "k",
                    vec![limit_with(5, Unit::Minute, 1, algorithm)],
                )]),
                options(),
            );
            for (requests, unit) in EXTREME_OVERRIDES {
                let case = format!("{algorithm} {requests}/{}", unit.name());
                let with_cost = |cost: u64| {
                    req(vec![Descriptor {
                        limit: Some(LimitOverride {
                            requests_per_unit: requests,
                            unit: Some(unit),
                        }),
                        hits_addend: Some(cost),
                        // One counter per case: overrides of one unit share theirs.
                        ..desc(&[("k", &case)])
                    }])
                };
                // More than asked at once never passes.
                let decision = fixture
                    .limiter
                    .decide(&with_cost(u64::from(requests) + 1))
                    .await
                    .unwrap_or_else(|err| panic!("{case}: {err}"));
                assert_eq!(decision.overall, OVER, "{case}");
                let current = decision.statuses[0].current_limit.clone().unwrap();
                assert_eq!(current.unit, unit, "{case}");
                let enforced = current.requests_per_unit;
                assert!(enforced > 0 && enforced <= requests, "{case}: {enforced}");
                let limit: u64 = header(&decision, "RateLimit-Limit")
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_eq!(limit, u64::from(enforced), "{case}");
                // The whole enforced number passes, then nothing more.
                let decision = fixture
                    .limiter
                    .decide(&with_cost(u64::from(enforced)))
                    .await
                    .unwrap();
                assert_eq!(decision.overall, OK, "{case}");
                assert_eq!(decision.statuses[0].limit_remaining, 0, "{case}");
                let decision = fixture.limiter.decide(&with_cost(1)).await.unwrap();
                assert_eq!(decision.overall, OVER, "{case}");
            }
        }
    }

    #[tokio::test]
    async fn shadow_and_quota_modes() {
        let mut shadow = key_node("shadow", vec![limit(1, Unit::Minute)]);
        shadow.shadow_mode = true;
        let mut quota_small = key_node("q1", vec![limit(1, Unit::Minute)]);
        quota_small.quota_mode = true;
        let mut quota_big = key_node("q2", vec![limit(3, Unit::Minute)]);
        quota_big.quota_mode = true;
        let fixture = fixture(rules(vec![shadow, quota_small, quota_big]), options());
        let status = |rpu, code, remaining| lim(code, remaining, 60, rpu, Unit::Minute, "");
        let shadow = || req(vec![desc(&[("shadow", "s")])]);
        let quotas = || req(vec![desc(&[("q1", "x")]), desc(&[("q2", "x")])]);
        check(
            &fixture,
            &[
                (shadow(), OK, vec![status(1, OK, 0)]),
                // Out of room, but a shadow rule never denies.
                (shadow(), OK, vec![status(1, OK, 0)]),
                (quotas(), OK, vec![status(1, OK, 0), status(3, OK, 2)]),
                // q1 is out, q2 has room: allowed, q1 reports OVER_LIMIT.
                (quotas(), OK, vec![status(1, OVER, 0), status(3, OK, 1)]),
                (quotas(), OK, vec![status(1, OVER, 0), status(3, OK, 0)]),
                // Every quota limit is out: denied.
                (quotas(), OVER, vec![status(1, OVER, 0), status(3, OVER, 0)]),
            ],
        )
        .await;
    }

    #[tokio::test]
    async fn most_restrictive_limit_of_a_node() {
        let fixture = fixture(
            rules(vec![
                key_node(
                    "least",
                    vec![limit(10, Unit::Second), limit(5, Unit::Minute)],
                ),
                key_node("tie", vec![limit(5, Unit::Second), limit(5, Unit::Minute)]),
                key_node(
                    "denied",
                    vec![limit(1, Unit::Second), limit(1, Unit::Minute)],
                ),
            ]),
            options(),
        );
        let one = |key: &str| req(vec![desc(&[(key, "v")])]);
        check(
            &fixture,
            &[
                // Least remaining after the request.
                (one("least"), OK, vec![lim(OK, 4, 60, 5, Unit::Minute, "")]),
                // Equal remaining: the longer window.
                (one("tie"), OK, vec![lim(OK, 4, 60, 5, Unit::Minute, "")]),
                (one("denied"), OK, vec![lim(OK, 0, 60, 1, Unit::Minute, "")]),
            ],
        )
        .await;
        // Both deny; the minute limit frees up last.
        fixture.clock.advance(500_000);
        check(
            &fixture,
            &[(
                one("denied"),
                OVER,
                vec![lim(OVER, 0, 60, 1, Unit::Minute, "")],
            )],
        )
        .await;
        // Only the minute limit denies now.
        fixture.clock.advance(1_000_000);
        check(
            &fixture,
            &[(
                one("denied"),
                OVER,
                vec![lim(OVER, 0, 59, 1, Unit::Minute, "")],
            )],
        )
        .await;
    }

    #[tokio::test]
    async fn unit_multiplier_reports_configured_unit_and_exact_headers() {
        let fixture = fixture(
            rules(vec![key_node(
                "k",
                vec![limit_with(10, Unit::Minute, 5, Algorithm::FixedWindow)],
            )]),
            options(),
        );
        let decision = fixture
            .limiter
            .decide(&req(vec![desc(&[("k", "v")])]))
            .await
            .unwrap();
        let status = &decision.statuses[0];
        let current = status.current_limit.as_ref().unwrap();
        assert_eq!(
            (current.requests_per_unit, current.unit),
            (10, Unit::Minute)
        );
        // T0 is 1_700_000_000 s: 200 s into its aligned 300 s window.
        assert_eq!(T0 / 1_000_000 % 300, 200);
        assert_eq!(status.duration_until_reset_s, Some(100));
        assert_eq!(header(&decision, "RateLimit-Limit"), Some("10"));
        assert_eq!(header(&decision, "RateLimit-Remaining"), Some("9"));
        assert_eq!(header(&decision, "RateLimit-Reset"), Some("100"));
    }

    #[tokio::test]
    async fn a_burst_is_the_header_limit_and_remaining_never_exceeds_a_limit() {
        let mut bucket = limit_with(10, Unit::Second, 1, Algorithm::TokenBucket);
        bucket.params = LimitParams::new(Algorithm::TokenBucket, 10, 1_000_000, Some(20)).unwrap();
        let mut gcra = limit_with(10, Unit::Second, 1, Algorithm::Gcra);
        gcra.params = LimitParams::new(Algorithm::Gcra, 10, 1_000_000, Some(20)).unwrap();
        let fixture = fixture(
            rules(vec![
                key_node("bucket", vec![bucket]),
                key_node("gcra", vec![gcra]),
            ]),
            options(),
        );
        for key in ["bucket", "gcra"] {
            let one = || req(vec![desc(&[(key, "v")])]);
            let mut seen = Vec::new();
            for _ in 0..20 {
                let decision = fixture.limiter.decide(&one()).await.unwrap();
                let status = &decision.statuses[0];
                let current = status.current_limit.as_ref().unwrap();
                let limit: u32 = header(&decision, "RateLimit-Limit")
                    .unwrap()
                    .parse()
                    .unwrap();
                let remaining: u32 = header(&decision, "RateLimit-Remaining")
                    .unwrap()
                    .parse()
                    .unwrap();
                // The header reports the capacity, which Remaining can reach;
                // the status reports the rate, and Remaining up to it.
                assert_eq!(limit, 20, "{key}");
                assert!(remaining <= limit, "{key}: {remaining} > {limit}");
                assert_eq!(
                    (current.requests_per_unit, current.unit),
                    (10, Unit::Second)
                );
                assert!(status.limit_remaining <= current.requests_per_unit, "{key}");
                assert_eq!(status.limit_remaining, remaining.min(10), "{key}");
                seen.push(remaining);
            }
            assert_eq!(seen, (0..20).rev().collect::<Vec<u32>>(), "{key}");
            let decision = fixture.limiter.decide(&one()).await.unwrap();
            assert_eq!(decision.overall, OVER, "{key}");
            assert_eq!(header(&decision, "RateLimit-Remaining"), Some("0"));
        }
    }

    #[tokio::test]
    async fn headers_of_the_most_restrictive_status() {
        let tree = || {
            rules(vec![
                key_node("a", vec![limit(10, Unit::Minute)]),
                key_node("b", vec![limit(2, Unit::Hour)]),
            ])
        };
        let fixture = fixture(tree(), options());
        let both = || req(vec![desc(&[("a", "1")]), desc(&[("b", "1")])]);
        let expect = |decision: &Decision, expected: &[(&str, &str)]| {
            let got: Vec<(&str, &str)> = decision
                .headers
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_str()))
                .collect();
            assert_eq!(got, expected);
        };
        let decision = fixture.limiter.decide(&both()).await.unwrap();
        expect(
            &decision,
            &[
                ("RateLimit-Limit", "2"),
                ("RateLimit-Remaining", "1"),
                ("RateLimit-Reset", "3600"),
            ],
        );
        fixture.limiter.decide(&both()).await.unwrap();
        fixture.clock.advance(1_000_000);
        let decision = fixture.limiter.decide(&both()).await.unwrap();
        assert_eq!(decision.overall, OVER);
        expect(
            &decision,
            &[
                ("RateLimit-Limit", "2"),
                ("RateLimit-Remaining", "0"),
                ("RateLimit-Reset", "3599"),
                ("Retry-After", "3599"),
            ],
        );
        // No rule matched: no headers.
        let decision = fixture
            .limiter
            .decide(&req(vec![desc(&[("nothing", "1")])]))
            .await
            .unwrap();
        expect(&decision, &[]);

        // Off: never any headers; custom names are used.
        let off = self::fixture(
            tree(),
            Options {
                response_headers: None,
                ..options()
            },
        );
        assert!(
            off.limiter
                .decide(&both())
                .await
                .unwrap()
                .headers
                .is_empty()
        );
        let custom = self::fixture(
            tree(),
            Options {
                response_headers: Some(HeaderNames {
                    limit: "X-L".to_owned(),
                    remaining: "X-R".to_owned(),
                    reset: "X-Reset".to_owned(),
                    retry_after: "X-Retry".to_owned(),
                }),
                ..options()
            },
        );
        let decision = custom.limiter.decide(&both()).await.unwrap();
        expect(
            &decision,
            &[("X-L", "2"), ("X-R", "1"), ("X-Reset", "3600")],
        );
    }

    #[tokio::test]
    async fn global_shadow_mode_reports_ok_without_retry_after() {
        let fixture = fixture(
            rules(vec![key_node("k", vec![limit(1, Unit::Minute)])]),
            Options {
                shadow_mode: true,
                ..options()
            },
        );
        let one = || req(vec![desc(&[("k", "v")])]);
        let status = |code| lim(code, 0, 60, 1, Unit::Minute, "");
        check(
            &fixture,
            &[
                (one(), OK, vec![status(OK)]),
                (one(), OK, vec![status(OVER)]),
            ],
        )
        .await;
        let decision = fixture.limiter.decide(&one()).await.unwrap();
        assert_eq!(header(&decision, "Retry-After"), None);
        assert_eq!(header(&decision, "RateLimit-Remaining"), Some("0"));
    }

    #[tokio::test]
    async fn backend_failure_follows_the_failure_mode() {
        let tree = || {
            rules(vec![
                key_node("k", vec![limit(1, Unit::Minute)]),
                node("u", ValueMatcher::Any, unlimited()),
            ])
        };
        let request = || req(vec![desc(&[("k", "v")]), desc(&[("u", "v")])]);
        let res = down(tree(), FailureMode::Error).decide(&request()).await;
        assert!(
            matches!(res, Err(Error::Backend(backends::Error::Unavailable(_)))),
            "{res:?}"
        );
        let unlimited = (OK, u32::MAX, None, None);
        let cases = [
            (FailureMode::Allow, OK, (OK, 0, None, None)),
            (FailureMode::Deny, OVER, (OVER, 0, None, None)),
        ];
        for (mode, overall, status) in cases {
            let decision = down(tree(), mode).decide(&request()).await.unwrap();
            let got: Vec<Brief> = decision.statuses.iter().map(brief).collect();
            assert_eq!(
                (decision.overall, got),
                (overall, vec![status, unlimited.clone()]),
                "{mode:?}"
            );
            assert!(decision.headers.is_empty());
        }
    }

    #[tokio::test]
    async fn a_rule_swap_applies_to_the_next_request() {
        let fixture = fixture(rules(vec![]), options());
        let one = || req(vec![desc(&[("k", "v")])]);
        check(&fixture, &[(one(), OK, vec![ok_none()])]).await;
        fixture.limiter.rules().store(Arc::new(rules(vec![key_node(
            "k",
            vec![limit(1, Unit::Minute)],
        )])));
        check(
            &fixture,
            &[(one(), OK, vec![lim(OK, 0, 60, 1, Unit::Minute, "")])],
        )
        .await;
    }
}
