//! Rule trees built in code: limits, nodes and a rule set of one domain.

use std::sync::Arc;

use crate::algorithms::Algorithm;
use crate::rules::{
    DEFAULT_MAX_LOG_ENTRIES, Domain, Limits, Node, NodeLimits, RateLimit, RuleSet, Unit,
    ValueMatcher,
};

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
    RateLimit::new(unit, unit_multiplier, requests_per_unit, algorithm, None).unwrap()
}

/// `it` named `name`, replacing the limits named `replaces`.
pub(crate) fn named(it: RateLimit, name: &str, replaces: &[&str]) -> RateLimit {
    it.named(
        Some(Arc::from(name)),
        replaces.iter().map(|it| Arc::from(*it)).collect(),
    )
}

/// A node without children or options, its path as the config builds it.
pub(crate) fn node(key: &str, value: ValueMatcher, limits: NodeLimits) -> Node {
    Node::new("", Arc::from(key), value, limits)
}

pub(crate) fn with_children(parent: Node, children: Vec<Node>) -> Node {
    parent.with_children(children)
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
    node(key, ValueMatcher::Any, limited(limits))
}

/// `limits` as a node's limits; panics on a list the config would refuse.
pub(crate) fn limited(limits: Vec<RateLimit>) -> NodeLimits {
    NodeLimits::Limited(Limits::new(limits).unwrap())
}

/// A rule set of the one domain [`DOMAIN`] over `nodes`.
pub(crate) fn rules(nodes: Vec<Node>) -> RuleSet {
    let domain = Domain::new(Arc::from(DOMAIN), Algorithm::SlidingWindowLog, nodes);
    RuleSet::new([domain], DEFAULT_MAX_LOG_ENTRIES)
}
