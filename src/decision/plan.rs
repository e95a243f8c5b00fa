//! Everything decided before the backend call, in four steps: match each
//! descriptor against the rules, drop the limits some matched limit
//! `replaces`, turn overrides into limits of their own, and merge checks
//! that reach one counter.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::algorithms::{Algorithm, Charge, Check, MAX_EXACT, Mode};
use crate::backends::{CounterKey, KeyBytes, KeyEntry, KeyValue, KeyedCheck, PerRequest};
use crate::metrics::MetricRule;
use crate::rules::{Domain, Levels, Node, NodeLimits, RateLimit, Unit, ValueMatcher};

use super::answer::clamp_u32;
use super::labels::{bytes_label, metric_rule};
use super::overrides::charged_override_params;
use super::{CurrentLimit, Descriptor, EnforcedOverride, Entry, Error, Request};

/// Everything decided before the backend call.
#[derive(Debug)]
pub(super) struct Plan {
    pub(super) descriptors: Vec<DescriptorPlan>,
    /// Distinct counters; checks reaching the same counter are merged.
    pub(super) checks: Vec<KeyedCheck>,
}

impl Plan {
    /// A label of the rule of `checks[idx]`, for logs: the rule's path,
    /// with the limit's name if it has one; for an override, the
    /// descriptor's keys. Built only when logged: it is rarely needed.
    pub(super) fn check_rule(&self, idx: usize) -> String {
        let rule = &self.checks[idx].key.rule;
        // The first limit on the check is the one that added it: merged
        // limits are the same limit of one rule, or overrides.
        let name = self
            .descriptors
            .iter()
            .filter_map(DescriptorPlan::limits)
            .flat_map(PlannedLimits::iter)
            .find(|it| it.check == idx)
            .map(|it| &it.reported.name);
        match name {
            Some(name) if !name.is_empty() => format!("{rule} ({name})"),
            _ => rule.to_string(),
        }
    }
}

#[derive(Debug)]
pub(super) enum DescriptorPlan {
    /// No rule, or every matched limit was replaced.
    NoLimit,
    Unlimited,
    Limits {
        limits: PlannedLimits,
        /// The `rule` label of this descriptor's decision.
        metric: MetricRule,
        /// This descriptor's cost, for the hits metric.
        cost: u64,
    },
}

/// The limits of one descriptor: never none, so one of them is always the
/// most restrictive.
#[derive(Debug)]
pub(super) struct PlannedLimits {
    pub(super) first: PlannedLimit,
    pub(super) rest: Vec<PlannedLimit>,
}

impl DescriptorPlan {
    fn limits(&self) -> Option<&PlannedLimits> {
        match self {
            DescriptorPlan::Limits { limits, .. } => Some(limits),
            DescriptorPlan::NoLimit | DescriptorPlan::Unlimited => None,
        }
    }
}

impl PlannedLimits {
    pub(super) fn iter(&self) -> impl Iterator<Item = &PlannedLimit> {
        std::iter::once(&self.first).chain(&self.rest)
    }

    fn one(limit: PlannedLimit) -> PlannedLimits {
        PlannedLimits {
            first: limit,
            rest: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct PlannedLimit {
    /// Index into `Plan::checks`.
    pub(super) check: usize,
    pub(super) mode: Mode,
    pub(super) reported: CurrentLimit,
    /// The real window, for ties and for the headers.
    pub(super) window_us: u64,
    /// The most that can pass at once, for `RateLimit-Limit`: the number
    /// per window, or the `burst` of a token bucket or GCRA.
    pub(super) limit: u64,
}

/// Plans `request` in `domain`; refuses an override no algorithm can enforce.
pub(super) fn plan(
    domain: &Domain,
    request: &Request,
    max_log_entries: u32,
) -> Result<Plan, Error> {
    // First, what every descriptor matched: `replaces` looks at every
    // matched limit of the request.
    let matched: PerRequest<Matched<'_>> = request
        .descriptors
        .iter()
        .map(|it| match_descriptor(domain, it))
        .collect();
    let mut planner = Planner {
        domain,
        max_log_entries,
        replaced: matched.iter().flat_map(|it| it.found.replaces()).collect(),
        checks: Checks::default(),
    };
    let request_cost = request.cost();
    let mut descriptors = Vec::with_capacity(request.descriptors.len());
    for (idx, (descriptor, matched)) in request.descriptors.iter().zip(&matched).enumerate() {
        let cost = descriptor.cost(request_cost);
        let planned = match descriptor.enforced_override() {
            Some(limit_override) => {
                planner.override_limit(idx, descriptor, limit_override, matched, cost)?
            }
            None => planner.rule_limits(descriptor, matched, cost),
        };
        descriptors.push(planned);
    }
    Ok(planner.checks.into_plan(descriptors))
}

// === match ===

/// What one descriptor reached in the tree.
struct Matched<'r> {
    /// The node of every level on the way; empty when no rule matched.
    levels: Levels<'r>,
    found: Found<'r>,
}

/// The limits a descriptor reached (overrides aside).
enum Found<'r> {
    Nothing,
    Unlimited {
        name: Option<&'r str>,
        replaces: &'r [Arc<str>],
    },
    Limits {
        node: &'r Node,
        limits: &'r [RateLimit],
    },
}

fn match_descriptor<'r>(domain: &'r Domain, descriptor: &Descriptor) -> Matched<'r> {
    let pairs = descriptor
        .entries
        .iter()
        .map(|it| (it.key.as_slice(), it.value.as_slice()));
    let levels = domain.find_levels(pairs).unwrap_or_default();
    // An override ignores the tree's limits (and `replaces`).
    let found = match levels.last() {
        Some(node) if descriptor.enforced_override().is_none() => Found::at(node),
        _ => Found::Nothing,
    };
    Matched { levels, found }
}

impl<'r> Found<'r> {
    fn at(node: &'r Node) -> Found<'r> {
        match node.limits() {
            NodeLimits::None => Found::Nothing,
            NodeLimits::Unlimited { name, replaces } => Found::Unlimited {
                name: name.as_deref(),
                replaces,
            },
            NodeLimits::Limited(limits) => Found::Limits { node, limits },
        }
    }

    /// Names this descriptor's limits replace.
    fn replaces(&self) -> impl Iterator<Item = &'r str> + use<'r> {
        let (unlimited, limits): (&'r [Arc<str>], &'r [RateLimit]) = match *self {
            Found::Nothing => (&[], &[]),
            Found::Unlimited { replaces, .. } => (replaces, &[]),
            Found::Limits { limits, .. } => (&[], limits),
        };
        let limited = limits.iter().flat_map(RateLimit::replaces);
        unlimited.iter().chain(limited).map(|it| &**it)
    }
}

// === replaces, overrides, limits ===

struct Planner<'r> {
    domain: &'r Domain,
    max_log_entries: u32,
    /// Names some matched limit of the request replaces.
    replaced: HashSet<&'r str>,
    checks: Checks,
}

impl Planner<'_> {
    fn is_replaced(&self, name: Option<&str>) -> bool {
        name.is_some_and(|it| self.replaced.contains(it))
    }

    /// The limits of a descriptor decided by the rules, without those
    /// replaced.
    fn rule_limits(
        &mut self,
        descriptor: &Descriptor,
        matched: &Matched<'_>,
        cost: u64,
    ) -> DescriptorPlan {
        let (node, limits) = match matched.found {
            Found::Nothing => return DescriptorPlan::NoLimit,
            // A replaced unlimited rule is dropped like any other.
            Found::Unlimited { name, .. } if self.is_replaced(name) => {
                return DescriptorPlan::NoLimit;
            }
            Found::Unlimited { .. } => return DescriptorPlan::Unlimited,
            Found::Limits { node, limits } => (node, limits),
        };
        let kept: PerRequest<&RateLimit> = limits
            .iter()
            .filter(|it| !self.is_replaced(it.name().map(|name| &**name)))
            .collect();
        let Some((first, rest)) = kept.split_first() else {
            return DescriptorPlan::NoLimit;
        };
        // Every limit of the rule counts under the same entries: built
        // once (a long key or value hashed once), cloned only for a rule
        // with several limits, and moved into the last limit's key.
        let mut entries = key_entries(&matched.levels, &descriptor.entries);
        let first_entries = entries_for(&mut entries, !rest.is_empty());
        let mut planned = PlannedLimits::one(self.rule_limit(node, first, first_entries, cost));
        for (idx, limit) in rest.iter().enumerate() {
            let limit_entries = entries_for(&mut entries, idx + 1 < rest.len());
            planned
                .rest
                .push(self.rule_limit(node, limit, limit_entries, cost));
        }
        DescriptorPlan::Limits {
            limits: planned,
            metric: metric_rule(&matched.levels, &descriptor.entries),
            cost,
        }
    }

    /// One limit of the rule `node`, its check added to the plan's.
    fn rule_limit(
        &mut self,
        node: &Node,
        limit: &RateLimit,
        entries: Vec<KeyEntry>,
        cost: u64,
    ) -> PlannedLimit {
        let mode = mode_of(node);
        let key = CounterKey {
            domain: self.domain.name().clone(),
            rule: node.path().clone(),
            algorithm: limit.algorithm(),
            window_s: limit.window_seconds(),
            is_override: false,
            entries,
        };
        let check = Check {
            params: limit.params(),
            cost,
            mode,
        };
        PlannedLimit {
            check: self.checks.add(key, check),
            mode,
            reported: CurrentLimit {
                requests_per_unit: limit.requests_per_unit(),
                unit: limit.unit(),
                name: limit.name().cloned().unwrap_or_else(CurrentLimit::unnamed),
            },
            window_us: limit.params().window_us(),
            limit: limit.params().capacity(),
        }
    }

    /// The one limit of a descriptor with an override: the rule's
    /// algorithm (else the domain's default) and charge (else
    /// `if_allowed`), the override's unit and number (or the largest below
    /// it the algorithm holds exactly).
    fn override_limit(
        &mut self,
        idx: usize,
        descriptor: &Descriptor,
        limit_override: EnforcedOverride,
        matched: &Matched<'_>,
        cost: u64,
    ) -> Result<DescriptorPlan, Error> {
        let EnforcedOverride {
            requests_per_unit,
            unit,
        } = limit_override;
        let algorithm = rule_algorithm(&matched.levels).unwrap_or(self.domain.default_algorithm());
        let window_us = unit.seconds() * 1_000_000;
        let requests = u64::from(requests_per_unit);
        let charge = rule_charge(&matched.levels).unwrap_or_default();
        let params =
            charged_override_params(algorithm, requests, window_us, self.max_log_entries, charge)
                .map_err(|err| {
                Error::InvalidArgument(format!(
                    "descriptor {idx}: override of {requests} per {} cannot be enforced: {err}",
                    unit.name()
                ))
            })?;
        let rule = override_rule(descriptor);
        let key = self.override_key(descriptor, rule, params.algorithm(), unit);
        let check = Check {
            params,
            cost,
            mode: Mode::Enforce,
        };
        let limit = PlannedLimit {
            check: self.checks.add(key, check),
            mode: Mode::Enforce,
            reported: CurrentLimit {
                // What is enforced, which can be below what was asked.
                requests_per_unit: clamp_u32(params.limit()),
                unit,
                name: CurrentLimit::unnamed(),
            },
            window_us,
            limit: params.capacity(),
        };
        Ok(DescriptorPlan::Limits {
            limits: PlannedLimits::one(limit),
            metric: MetricRule::Override,
            cost,
        })
    }

    fn override_key(
        &self,
        descriptor: &Descriptor,
        rule: Arc<str>,
        algorithm: Algorithm,
        unit: Unit,
    ) -> CounterKey {
        CounterKey {
            domain: self.domain.name().clone(),
            rule,
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
        }
    }
}

fn mode_of(node: &Node) -> Mode {
    if node.shadow_mode() {
        Mode::Shadow
    } else if node.quota_mode() {
        Mode::Quota
    } else {
        Mode::Enforce
    }
}

/// A rule's counter key entries: each level's value, or the level's
/// wildcard pattern where the level shares one counter among its values.
fn key_entries(levels: &[&Node], entries: &[Entry]) -> Vec<KeyEntry> {
    entries
        .iter()
        .zip(levels)
        .map(|(entry, level)| KeyEntry {
            key: KeyBytes::new(&entry.key),
            value: match level.value() {
                ValueMatcher::Wildcard(pattern) if level.share_threshold() => {
                    KeyValue::Shared(pattern.clone())
                }
                _ => KeyValue::Value(KeyBytes::new(&entry.value)),
            },
        })
        .collect()
}

/// Key entries for one more limit's key: a clone while a later limit
/// still needs them, else `entries` themselves.
fn entries_for(entries: &mut Vec<KeyEntry>, needed_later: bool) -> Vec<KeyEntry> {
    if needed_later {
        entries.clone()
    } else {
        std::mem::take(entries)
    }
}

/// The charge of the first limit of the rule `levels` reached, if any.
fn rule_charge(levels: &[&Node]) -> Option<Charge> {
    match levels.last()?.limits() {
        NodeLimits::Limited(limits) => limits.first().map(|it| it.charge()),
        NodeLimits::None | NodeLimits::Unlimited { .. } => None,
    }
}

/// The algorithm of the first limit of the rule `levels` reached, if any.
fn rule_algorithm(levels: &[&Node]) -> Option<Algorithm> {
    match levels.last()?.limits() {
        NodeLimits::Limited(limits) => limits.first().map(|it| it.algorithm()),
        NodeLimits::None | NodeLimits::Unlimited { .. } => None,
    }
}

/// An override's rule label: the descriptor's keys, escaped.
fn override_rule(descriptor: &Descriptor) -> Arc<str> {
    let keys: Vec<String> = descriptor
        .entries
        .iter()
        .map(|it| bytes_label(&it.key))
        .collect();
    Arc::from(keys.join("."))
}

// === merge ===

/// Plans with at most this many checks find a repeated counter by
/// comparing keys, without hashing them or cloning one into a map: nearly
/// every request reaches one or two counters.
const COMPARED_CHECKS: usize = 8;

/// The plan's checks, one per counter.
#[derive(Default)]
struct Checks {
    checks: Vec<KeyedCheck>,
    /// Every check's index by its key, once there are more than
    /// [`COMPARED_CHECKS`]; `None` until then, so that nearly every
    /// request never builds (or seeds) a map.
    by_key: Option<HashMap<CounterKey, usize>>,
}

impl Checks {
    /// Adds a check and returns its index. Checks on one counter become
    /// one check needing room for the sum of their costs. Equal keys mean
    /// equal params (config refuses two limits of a node sharing window
    /// and algorithm), except two overrides of one descriptor and unit
    /// with different numbers in the same request: the first one's number
    /// is enforced.
    fn add(&mut self, key: CounterKey, check: Check) -> usize {
        if let Some(idx) = self.position(&key) {
            let merged = &mut self.checks[idx].check;
            merged.cost = merged.cost.saturating_add(check.cost).min(MAX_EXACT);
            return idx;
        }
        let idx = self.checks.len();
        if idx >= COMPARED_CHECKS {
            let checks = &self.checks;
            let by_key = self.by_key.get_or_insert_with(|| {
                let known = checks.iter().enumerate();
                known.map(|(i, it)| (it.key.clone(), i)).collect()
            });
            by_key.insert(key.clone(), idx);
        }
        self.checks.push(KeyedCheck { key, check });
        idx
    }

    /// The index of the check on `key`, if there is one.
    fn position(&self, key: &CounterKey) -> Option<usize> {
        match &self.by_key {
            Some(by_key) => by_key.get(key).copied(),
            None => self.checks.iter().position(|it| it.key == *key),
        }
    }

    fn into_plan(self, descriptors: Vec<DescriptorPlan>) -> Plan {
        Plan {
            descriptors,
            checks: self.checks,
        }
    }
}

#[cfg(test)]
mod tests;
