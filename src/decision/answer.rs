//! From the backend's verdict to the answer: for each descriptor its most
//! restrictive limit, the status reporting it and the decision's metric.

use std::sync::{Arc, LazyLock};

use crate::algorithms::{Mode, Outcome, Verdict};
use crate::backends::PerRequest;
use crate::metrics;
use crate::rules::{Domain, Unit};

use super::Shared;
use super::headers;
use super::plan::{DescriptorPlan, Plan, PlannedLimit, PlannedLimits};

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

impl CurrentLimit {
    /// The name of an unnamed limit or of an override: empty, one
    /// allocation shared by every request rather than one per request.
    pub(super) fn unnamed() -> Arc<str> {
        static UNNAMED: LazyLock<Arc<str>> = LazyLock::new(|| Arc::from(""));
        Arc::clone(&UNNAMED)
    }
}

impl Status {
    pub(super) fn ok_without_limit() -> Status {
        Status {
            code: Code::Ok,
            current_limit: None,
            limit_remaining: 0,
            duration_until_reset_s: None,
        }
    }
}

impl DescriptorPlan {
    /// The status of a descriptor that needs no counter.
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

/// The statuses when the backend failed and the failure mode answers
/// `code`: every descriptor with limits gets `code`, without a limit.
pub(super) fn failure_statuses(plan: &Plan, code: Code) -> Vec<Status> {
    plan.descriptors
        .iter()
        .map(|it| match it {
            DescriptorPlan::Limits { .. } => Status {
                code,
                ..Status::ok_without_limit()
            },
            other => other.status_without_counter(),
        })
        .collect()
}

/// A limit with the backend's outcome for it; borrows the limit from the
/// plan, so comparing limits copies no name.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate<'p> {
    pub(super) limit: &'p PlannedLimit,
    /// Could deny: no room, and not a shadow limit.
    pub(super) denied: bool,
    /// A shadow limit without room: would have denied.
    shadowed: bool,
    pub(super) remaining: u64,
    pub(super) reset_us: u64,
}

impl<'p> Candidate<'p> {
    fn new(limit: &'p PlannedLimit, outcome: &Outcome) -> Candidate<'p> {
        let shadow = limit.mode == Mode::Shadow;
        Candidate {
            limit,
            denied: !outcome.has_room && !shadow,
            shadowed: !outcome.has_room && shadow,
            remaining: outcome.remaining,
            reset_us: outcome.reset_us,
        }
    }
}

/// Of `best` and `it`, the more restrictive: the one that denied (the
/// latest to free up if both), else the one with the least remaining
/// (ties: the longer window, then `best`).
pub(super) fn more_restrictive<'a, 'p>(
    best: &'a Candidate<'p>,
    it: &'a Candidate<'p>,
) -> &'a Candidate<'p> {
    let better = match (it.denied, best.denied) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => it.reset_us > best.reset_us,
        (false, false) => {
            it.remaining < best.remaining
                || (it.remaining == best.remaining && it.limit.window_us > best.limit.window_us)
        }
    };
    if better { it } else { best }
}

/// One descriptor's limits against the verdict.
struct Answered<'p> {
    /// Some limit denied.
    over: bool,
    /// Some shadow limit would have denied.
    shadowed: bool,
    /// The most restrictive limit, its `remaining` never above its limit:
    /// a token bucket or GCRA can hold more than its number per window,
    /// up to its capacity.
    chosen: Candidate<'p>,
}

impl<'p> Answered<'p> {
    fn new(limits: &'p PlannedLimits, outcomes: &[Outcome]) -> Answered<'p> {
        let candidate = |it: &'p PlannedLimit| Candidate::new(it, &outcomes[it.check]);
        let mut chosen = candidate(&limits.first);
        let mut over = chosen.denied;
        let mut shadowed = chosen.shadowed;
        for it in limits.rest.iter().map(candidate) {
            over |= it.denied;
            shadowed |= it.shadowed;
            chosen = *more_restrictive(&chosen, &it);
        }
        let remaining = if over {
            0
        } else {
            chosen.remaining.min(chosen.limit.limit)
        };
        Answered {
            over,
            shadowed,
            chosen: Candidate {
                remaining,
                ..chosen
            },
        }
    }

    fn status(&self) -> Status {
        let chosen = &self.chosen;
        let reported = &chosen.limit.reported;
        Status {
            code: if self.over { Code::OverLimit } else { Code::Ok },
            current_limit: Some(reported.clone()),
            // Envoy's own X-RateLimit headers pair this with
            // `current_limit.requests_per_unit` (the rate, which is all
            // the proto carries): a burst above it is not reported here.
            limit_remaining: clamp_u32(chosen.remaining.min(u64::from(reported.requests_per_unit))),
            duration_until_reset_s: Some(ceil_seconds(chosen.reset_us)),
        }
    }
}

impl Shared {
    /// Builds the answer from the plan and, when counters were involved,
    /// the backend's verdict (one outcome per check of the plan).
    pub(super) fn answer(
        &self,
        domain: &Domain,
        plan: &Plan,
        verdict: Option<&Verdict>,
    ) -> Decision {
        let allowed = verdict.is_none_or(|it| it.allowed);
        let outcomes = verdict.map(|it| it.outcomes.as_slice()).unwrap_or_default();
        let mut statuses = Vec::with_capacity(plan.descriptors.len());
        // The most restrictive limit of each status, for the headers.
        let mut reported: PerRequest<Candidate<'_>> = PerRequest::new();
        // Checks whose overdraft a descriptor counted: a check shared by
        // several descriptors is counted under the first.
        let mut charged: PerRequest<usize> = PerRequest::new();
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
            let answered = Answered::new(limits, outcomes);
            let result = self.metric_result(&answered, plan, allowed);
            let mut overdraft = 0u64;
            for limit in limits.iter() {
                let units = outcomes.get(limit.check).map_or(0, |it| it.overdraft);
                if units > 0 && !charged.contains(&limit.check) {
                    charged.push(limit.check);
                    overdraft = overdraft.saturating_add(units);
                }
            }
            self.metrics
                .record(domain.name(), metric, result, *cost, overdraft);
            statuses.push(answered.status());
            reported.push(answered.chosen);
        }
        let overall = if allowed { Code::Ok } else { Code::OverLimit };
        let headers = match &self.options.response_headers {
            Some(names) => {
                let retry = overall == Code::OverLimit && !self.options.shadow_mode;
                headers::headers(names, &reported, retry)
            }
            None => Vec::new(),
        };
        Decision {
            overall: self.shadowed(overall),
            statuses,
            headers,
        }
    }

    /// The `result` label of one descriptor's decision.
    fn metric_result(
        &self,
        answered: &Answered<'_>,
        plan: &Plan,
        allowed: bool,
    ) -> metrics::MetricResult {
        if answered.over {
            return if self.options.shadow_mode && !allowed {
                metrics::MetricResult::Shadow
            } else {
                metrics::MetricResult::OverLimit
            };
        }
        if answered.shadowed {
            return metrics::MetricResult::Shadow;
        }
        let chosen = &answered.chosen;
        let capacity = plan.checks[chosen.limit.check].check.params.capacity();
        if self
            .options
            .near_limit_ratio
            .is_near(chosen.remaining, capacity)
        {
            return metrics::MetricResult::NearLimit;
        }
        metrics::MetricResult::Ok
    }
}

pub(super) fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

pub(super) fn clamp_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
