//! Rule trees built in code: limits, nodes and a rule set of one domain.

use std::collections::HashMap;
use std::sync::Arc;

use crate::algorithms::{Algorithm, LimitParams};
use crate::rules::{Domain, LevelIndex, Node, NodeLimits, RateLimit, RuleSet, Unit, ValueMatcher};

/// The domain [`rules`] builds.
pub(crate) const DOMAIN: &str = "test";

/// `requests_per_unit` per `unit` on the sliding-window log.
pub(crate) fn limit(requests_per_unit: u32, unit: Unit) -> RateLimit {
    limit_with(requests_per_unit, unit, 1, Algorithm::SlidingWindowLog)
}

pub(crate) fn limit_with(
    requests_per_unit: u32,
    unit: Unit,
    unit_multiplier: u32,
    algorithm: Algorithm,
) -> RateLimit {
    let window_us = unit.seconds() * u64::from(unit_multiplier) * 1_000_000;
    RateLimit {
        unit,
        unit_multiplier,
        requests_per_unit,
        name: None,
        replaces: Vec::new(),
        params: LimitParams::new(algorithm, u64::from(requests_per_unit), window_us, None).unwrap(),
        log_capped: false,
    }
}

/// `it` named `name`, replacing the limits named `replaces`.
pub(crate) fn named(mut it: RateLimit, name: &str, replaces: &[&str]) -> RateLimit {
    it.name = Some(Arc::from(name));
    it.replaces = replaces.iter().map(|it| Arc::from(*it)).collect();
    it
}

/// A node without children or options, its path as the config builds it.
pub(crate) fn node(key: &str, value: ValueMatcher, limits: NodeLimits) -> Node {
    let path = match &value {
        ValueMatcher::Any => key.to_owned(),
        ValueMatcher::Exact(it) | ValueMatcher::Wildcard(it) => format!("{key}_{it}"),
    };
    Node {
        key: Arc::from(key),
        value,
        limits,
        shadow_mode: false,
        quota_mode: false,
        share_threshold: false,
        detailed_metric: false,
        value_to_metric: false,
        path: Arc::from(path),
        children: Vec::new(),
        index: LevelIndex::default(),
    }
}

pub(crate) fn with_children(mut parent: Node, children: Vec<Node>) -> Node {
    parent.index = LevelIndex::new(&children);
    parent.children = children;
    parent
}

/// An unnamed unlimited rule that replaces nothing.
pub(crate) fn unlimited() -> NodeLimits {
    NodeLimits::Unlimited {
        name: None,
        replaces: Vec::new(),
    }
}

/// A node for any value of `key` with `limits`.
pub(crate) fn key_node(key: &str, limits: Vec<RateLimit>) -> Node {
    node(key, ValueMatcher::Any, NodeLimits::Limited(limits))
}

/// A rule set of the one domain [`DOMAIN`] over `nodes`.
pub(crate) fn rules(nodes: Vec<Node>) -> RuleSet {
    let domain = Domain::new(Arc::from(DOMAIN), Algorithm::SlidingWindowLog, nodes);
    RuleSet {
        domains: HashMap::from([(domain.name.clone(), domain)]),
        ..RuleSet::default()
    }
}
