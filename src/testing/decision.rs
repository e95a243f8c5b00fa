//! Requests, limiters and what the limiter tests compare: statuses in
//! brief and headers.

use std::sync::Arc;

use crate::backends::Backend;
use crate::clock::ManualClock;
use crate::decision::{
    Code, Decision, Descriptor, Entry, FailureMode, LimitOverride, Limiter, Options, Request,
};
use crate::metrics::Metrics;
use crate::rules::{RateLimit, RuleSet, Unit};

use super::{FakeBackend, T0, default_options, limiter, memory_backend, rules_from};

pub(crate) use Code::{Ok as OK, OverLimit as OVER};

// === requests ===

/// A descriptor of `entries` given as (key, value), text or raw bytes,
/// without override or cost of its own.
pub(crate) fn desc<K: AsRef<[u8]>, V: AsRef<[u8]>>(entries: &[(K, V)]) -> Descriptor {
    let entries = entries.iter().map(|(key, value)| Entry {
        key: key.as_ref().to_vec(),
        value: value.as_ref().to_vec(),
    });
    Descriptor {
        entries: entries.collect(),
        ..Descriptor::default()
    }
}

/// A descriptor of text `entries` with an override of `requests_per_unit`
/// per `unit`.
pub(crate) fn overridden(
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: Unit,
) -> Descriptor {
    Descriptor {
        limit: Some(LimitOverride {
            requests_per_unit,
            unit: Some(unit),
        }),
        ..desc(entries)
    }
}

/// A request of `descriptors` in the domain [`super::rules::rules`] builds.
pub(crate) fn req(descriptors: Vec<Descriptor>) -> Request {
    request_in(super::rules::DOMAIN, descriptors, 0)
}

pub(crate) fn request_in(domain: &str, descriptors: Vec<Descriptor>, hits_addend: u32) -> Request {
    Request {
        domain: domain.to_owned(),
        descriptors,
        hits_addend,
    }
}

// === limiters ===

/// A limiter on a memory backend and the clock that backend reads.
pub(crate) struct Fixture {
    pub(crate) limiter: Limiter,
    pub(crate) clock: ManualClock,
}

pub(crate) fn fixture(rules: RuleSet, options: Options) -> Fixture {
    let clock = ManualClock::new(T0);
    Fixture {
        limiter: limiter(rules, memory_backend(&clock), options, Metrics::new()),
        clock,
    }
}

/// A limiter under default options over one rule: any value of `key`,
/// limited by `limit`.
pub(crate) fn one_rule(key: &str, limit: RateLimit) -> Fixture {
    fixture(
        super::rules::rules(vec![super::rules::key_node(key, vec![limit])]),
        default_options(),
    )
}

/// A limiter whose backend is always down.
pub(crate) fn down(rules: RuleSet, failure_mode: FailureMode) -> Limiter {
    limiter(
        rules,
        Arc::new(FakeBackend::down()),
        Options {
            failure_mode,
            ..default_options()
        },
        Metrics::new(),
    )
}

/// Limiter options that answer OK when the backend fails.
pub(crate) fn allow_options(shadow_mode: bool) -> Options {
    Options {
        shadow_mode,
        failure_mode: FailureMode::Allow,
        ..default_options()
    }
}

/// A limiter over the config file `api.yaml` of `yaml` on `backend`.
pub(crate) fn yaml_limiter_on(yaml: &str, backend: Arc<dyn Backend>, options: Options) -> Limiter {
    limiter(
        rules_from("api.yaml", yaml),
        backend,
        options,
        Metrics::new(),
    )
}

/// A limiter over the config file `api.yaml` of `yaml`, recording into
/// `metrics`, on a memory backend.
pub(crate) fn yaml_limiter(yaml: &str, shadow_mode: bool, metrics: Metrics) -> Limiter {
    limiter(
        rules_from("api.yaml", yaml),
        memory_backend(&ManualClock::new(T0)),
        allow_options(shadow_mode),
        metrics,
    )
}

// === statuses ===

/// `(code, remaining, reset seconds, (requests_per_unit, unit, name))`
/// of a status: what the table rows compare.
pub(crate) type Brief = (Code, u32, Option<u64>, Option<(u32, Unit, String)>);

pub(crate) fn brief(status: &crate::decision::Status) -> Brief {
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

/// OK without a limit.
pub(crate) fn ok_none() -> Brief {
    (Code::Ok, 0, None, None)
}

/// OK with every request left: an unlimited rule.
pub(crate) fn unlimited_brief() -> Brief {
    (Code::Ok, u32::MAX, None, None)
}

pub(crate) fn lim(
    code: Code,
    remaining: u32,
    reset: u64,
    rpu: u32,
    unit: Unit,
    name: &str,
) -> Brief {
    (
        code,
        remaining,
        Some(reset),
        Some((rpu, unit, name.to_owned())),
    )
}

/// The overall code and the statuses in brief.
pub(crate) fn briefs(decision: &Decision) -> (Code, Vec<Brief>) {
    (
        decision.overall,
        decision.statuses.iter().map(brief).collect(),
    )
}

/// Runs `steps` in order, each `(request, overall, statuses)`.
pub(crate) async fn check(fixture: &Fixture, steps: &[(Request, Code, Vec<Brief>)]) {
    for (idx, (request, overall, statuses)) in steps.iter().enumerate() {
        let decision = fixture.limiter.decide(request).await.unwrap();
        assert_eq!(
            briefs(&decision),
            (*overall, statuses.clone()),
            "step {idx}: {request:?}"
        );
    }
}

/// Runs one step: `request` answers `overall` with `statuses`.
pub(crate) async fn check_one(
    fixture: &Fixture,
    request: Request,
    overall: Code,
    statuses: Vec<Brief>,
) {
    check(fixture, &[(request, overall, statuses)]).await;
}

pub(crate) fn header<'a>(decision: &'a Decision, name: &str) -> Option<&'a str> {
    decision
        .headers
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}
