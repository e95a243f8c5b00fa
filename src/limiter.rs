//! The decision on one request: bounds, matching, one atomic backend call, answers.
//!
//! Transport-neutral: the gRPC service (and the HTTP `/json` endpoint) turn
//! wire messages into a [`Request`] and a [`Decision`] back into wire
//! messages; no prost type is seen here.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;

use crate::algorithms::{Check, LimitParams, Mode, Outcome};
use crate::backends::{self, Backend, CounterKey, KeyEntry, KeyValue, KeyedCheck};
use crate::rules::{Domain, Node, NodeLimits, RuleSet, Unit, ValueMatcher};

/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 32;
/// Longest key or value, in bytes.
pub const MAX_TEXT_BYTES: usize = 1024;

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

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: String,
}

/// A RateLimitOverride.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    /// `None`: the wire said UNKNOWN, which is refused.
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
}

// === impl Limiter ===

impl Limiter {
    pub fn new(rules: Arc<ArcSwap<RuleSet>>, backend: Arc<dyn Backend>, options: Options) -> Self {
        Self {
            rules,
            backend,
            options,
            backend_errors: LogGate::new(),
        }
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
            return Ok(Decision {
                overall: Code::Ok,
                statuses: vec![Status::ok_without_limit(); request.descriptors.len()],
                headers: Vec::new(),
            });
        };
        let plan = plan(domain, request)?;
        if plan.checks.is_empty() {
            return Ok(self.answer(&plan, None));
        }
        for (check, rule) in plan.checks.iter().zip(&plan.check_rules) {
            if check.check.cost > check.check.params.capacity() {
                tracing::warn!(
                    domain = %request.domain,
                    rule = %rule,
                    cost = check.check.cost,
                    capacity = check.check.params.capacity(),
                    "cost exceeds the limit's capacity: this request can never pass"
                );
            }
        }
        match self.backend.decide(&plan.checks).await {
            Ok(verdict) => {
                if verdict.outcomes.len() != plan.checks.len() {
                    let error = backends::Error::Protocol(format!(
                        "{} outcomes for {} checks",
                        verdict.outcomes.len(),
                        plan.checks.len()
                    ));
                    return self.on_backend_error(&plan, error);
                }
                Ok(self.answer(&plan, Some((verdict.allowed, &verdict.outcomes))))
            }
            Err(error) => self.on_backend_error(&plan, error),
        }
    }

    fn on_backend_error(&self, plan: &Plan, error: backends::Error) -> Result<Decision, Error> {
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
                DescriptorPlan::Limits(_) => Status {
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
    fn answer(&self, plan: &Plan, verdict: Option<(bool, &[Outcome])>) -> Decision {
        let allowed = verdict.is_none_or(|(allowed, _)| allowed);
        let outcomes = verdict.map(|(_, it)| it).unwrap_or_default();
        let mut statuses = Vec::with_capacity(plan.descriptors.len());
        // The most restrictive limit of each status, for the headers.
        let mut reported: Vec<Candidate> = Vec::new();
        for descriptor in &plan.descriptors {
            let DescriptorPlan::Limits(limits) = descriptor else {
                statuses.push(descriptor.status_without_counter());
                continue;
            };
            let candidates: Vec<Candidate> = limits
                .iter()
                .map(|it| Candidate::new(it, &outcomes[it.check]))
                .collect();
            let over = candidates.iter().any(|it| it.denied);
            let chosen = most_restrictive(&candidates).clone();
            let remaining = if over { 0 } else { chosen.remaining };
            statuses.push(Status {
                code: if over { Code::OverLimit } else { Code::Ok },
                current_limit: Some(chosen.limit.reported.clone()),
                limit_remaining: clamp_u32(remaining),
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
    Limits(Vec<PlannedLimit>),
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
    /// The real number per window, for `RateLimit-Limit`.
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
    Unlimited,
    Limits(Vec<Matched<'a>>),
}

/// A limit a descriptor matched, before `replaces` and merging.
struct Matched<'a> {
    node: &'a Node,
    limit: &'a crate::rules::RateLimit,
}

fn plan(domain: &Domain, request: &Request) -> Result<Plan, Error> {
    let request_cost = u64::from(request.hits_addend.max(1));
    // First pass: what each descriptor matched, so that `replaces` can look
    // at every matched limit of the request.
    let mut matched: Vec<Found<'_>> = Vec::with_capacity(request.descriptors.len());
    let mut levels: Vec<Vec<&Node>> = Vec::with_capacity(request.descriptors.len());
    for descriptor in &request.descriptors {
        let entries: Vec<(&str, &str)> = descriptor
            .entries
            .iter()
            .map(|it| (it.key.as_str(), it.value.as_str()))
            .collect();
        let found = domain.find(&entries);
        let nodes = found.map(|it| it.levels).unwrap_or_default();
        let res = if descriptor.limit.is_some() {
            // An override ignores the tree's limits (and `replaces`).
            Found::Nothing
        } else {
            match nodes.last() {
                None => Found::Nothing,
                Some(node) => match &node.limits {
                    NodeLimits::None => Found::Nothing,
                    NodeLimits::Unlimited { .. } => Found::Unlimited,
                    NodeLimits::Limited(limits) => {
                        Found::Limits(limits.iter().map(|limit| Matched { node, limit }).collect())
                    }
                },
            }
        };
        matched.push(res);
        levels.push(nodes);
    }
    let replaced: HashSet<&str> = matched
        .iter()
        .filter_map(|it| match it {
            Found::Limits(limits) => Some(limits),
            _ => None,
        })
        .flatten()
        .flat_map(|it| it.limit.replaces.iter().map(|name| &**name))
        .collect();

    let mut checks: Vec<KeyedCheck> = Vec::new();
    let mut check_rules: Vec<Arc<str>> = Vec::new();
    let mut by_key: HashMap<CounterKey, usize> = HashMap::new();
    let mut add = |key: CounterKey, check: Check, rule: Arc<str>| -> usize {
        if let Some(&idx) = by_key.get(&key) {
            checks[idx].check.cost += check.cost;
            return idx;
        }
        by_key.insert(key.clone(), checks.len());
        checks.push(KeyedCheck { key, check });
        check_rules.push(rule);
        checks.len() - 1
    };

    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (idx, descriptor) in request.descriptors.iter().enumerate() {
        let cost = descriptor.hits_addend.unwrap_or(request_cost);
        if let Some(limit_override) = &descriptor.limit {
            let unit = limit_override.unit.expect("validated");
            let algorithm = match levels[idx].last().map(|it| &it.limits) {
                Some(NodeLimits::Limited(limits)) => limits[0].algorithm(),
                _ => domain.default_algorithm,
            };
            let window_us = unit.seconds() * 1_000_000;
            let requests = u64::from(limit_override.requests_per_unit);
            let params = LimitParams::new(algorithm, requests, window_us, None).map_err(|err| {
                Error::InvalidArgument(format!(
                    "descriptor {idx}: override of {requests} per {} cannot be enforced: {err}",
                    unit.name()
                ))
            })?;
            let keys: Vec<&str> = descriptor
                .entries
                .iter()
                .map(|it| it.key.as_str())
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
                        key: Arc::from(it.key.as_str()),
                        value: KeyValue::Value(it.value.clone()),
                    })
                    .collect(),
            };
            let check = Check {
                params,
                cost,
                mode: Mode::Enforce,
            };
            let check_idx = add(key, check, rule);
            descriptors.push(DescriptorPlan::Limits(vec![PlannedLimit {
                check: check_idx,
                mode: Mode::Enforce,
                reported: CurrentLimit {
                    requests_per_unit: limit_override.requests_per_unit,
                    unit,
                    name: Arc::from(""),
                },
                window_us,
                limit: requests,
            }]));
            continue;
        }
        let limits = match &matched[idx] {
            Found::Nothing => {
                descriptors.push(DescriptorPlan::NoLimit);
                continue;
            }
            Found::Unlimited => {
                descriptors.push(DescriptorPlan::Unlimited);
                continue;
            }
            Found::Limits(limits) => limits,
        };
        let mut planned = Vec::with_capacity(limits.len());
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
                entries: descriptor
                    .entries
                    .iter()
                    .zip(&levels[idx])
                    .map(|(entry, level)| KeyEntry {
                        key: Arc::from(entry.key.as_str()),
                        value: match &level.value {
                            ValueMatcher::Wildcard(pattern) if level.share_threshold => {
                                KeyValue::Shared(pattern.clone())
                            }
                            _ => KeyValue::Value(entry.value.clone()),
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
                limit: limit.params.limit(),
            });
        }
        descriptors.push(if planned.is_empty() {
            DescriptorPlan::NoLimit
        } else {
            DescriptorPlan::Limits(planned)
        });
    }
    Ok(Plan {
        descriptors,
        checks,
        check_rules,
    })
}

// === bounds ===

fn validate(request: &Request) -> Result<(), Error> {
    let invalid = |message: String| Err(Error::InvalidArgument(message));
    if request.domain.is_empty() {
        return invalid("empty domain".to_owned());
    }
    if request.domain.len() > MAX_TEXT_BYTES {
        return invalid(format!(
            "domain is {} bytes, at most {MAX_TEXT_BYTES}",
            request.domain.len()
        ));
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
            if entry.key.len() > MAX_TEXT_BYTES {
                return invalid(format!(
                    "descriptor {idx}, entry {entry_idx}: key is {} bytes, at most {MAX_TEXT_BYTES}",
                    entry.key.len()
                ));
            }
            if entry.value.len() > MAX_TEXT_BYTES {
                return invalid(format!(
                    "descriptor {idx}, entry {entry_idx}: value is {} bytes, at most {MAX_TEXT_BYTES}",
                    entry.value.len()
                ));
            }
        }
        if descriptor
            .limit
            .as_ref()
            .is_some_and(|it| it.unit.is_none())
        {
            return invalid(format!("descriptor {idx}: override with unit UNKNOWN"));
        }
    }
    Ok(())
}

// === helpers ===

fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

fn clamp_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Lets one log line through per second and counts the ones it held back,
/// so a backend outage does not flood the logs.
#[derive(Debug)]
struct LogGate {
    last_s: AtomicU64,
    suppressed: AtomicU64,
}

impl LogGate {
    fn new() -> Self {
        Self {
            last_s: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last one)` when this line may be logged.
    fn admit(&self) -> Option<u64> {
        let now_s = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|it| it.as_secs())
            .unwrap_or(0);
        let last = self.last_s.load(Ordering::Relaxed);
        if now_s != last
            && self
                .last_s
                .compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}
