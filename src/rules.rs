//! Validated rule trees and descriptor matching (pure: no IO, no clock).
//!
//! `config` builds these from YAML; the limiter asks a [`Domain`] which
//! [`Node`] a descriptor reaches. Types here cannot hold an invalid rule.

use std::collections::HashMap;
use std::sync::Arc;

use crate::algorithms::{Algorithm, LimitParams};

/// A time unit of a configured limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// Lowercase name as written in config files.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// Case-insensitive parse of a config unit name.
    pub fn from_name(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|it| it.name().eq_ignore_ascii_case(name))
    }
}

/// One configured limit (a `rate_limit`, or one entry of `rate_limits`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    pub unit: Unit,
    /// Window = `unit × unit_multiplier`; at least 1.
    pub unit_multiplier: u32,
    pub requests_per_unit: u32,
    /// `name`: reported in `current_limit`, and what `replaces` refers to.
    pub name: Option<Arc<str>>,
    /// Names of limits this one replaces when both match one request.
    pub replaces: Vec<Arc<str>>,
    /// Algorithm, window and capacity, validated for exact arithmetic.
    pub params: LimitParams,
}

impl RateLimit {
    pub fn window_seconds(&self) -> u64 {
        self.unit.seconds() * u64::from(self.unit_multiplier)
    }

    pub fn algorithm(&self) -> Algorithm {
        self.params.algorithm()
    }
}

/// What a node enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeLimits {
    /// No `rate_limit`: the node only leads to children.
    None,
    /// `unlimited: true`: always OK, nothing counted.
    Unlimited { name: Option<Arc<str>> },
    /// One or more limits; all must pass.
    Limited(Vec<RateLimit>),
}

/// How a node's `value` matches a descriptor entry's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatcher {
    /// No `value`: any value, one counter per distinct value.
    Any,
    /// An exact value.
    Exact(Arc<str>),
    /// A pattern with `*` (any run of characters, anywhere).
    Wildcard(Arc<str>),
}

/// A node of a domain's descriptor tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub key: Arc<str>,
    pub value: ValueMatcher,
    pub limits: NodeLimits,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    /// Every value this wildcard matches shares one counter.
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    /// Path below the domain, each level `key` or `key_value` (the pattern
    /// for a wildcard), joined by `.`: the metric label `rule`.
    pub path: Arc<str>,
    pub children: Vec<Node>,
}

/// One domain's rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    pub name: Arc<str>,
    /// Used by RateLimitOverride where no rule names an algorithm.
    pub default_algorithm: Algorithm,
    pub children: Vec<Node>,
}

/// Every loaded domain: what a config file set compiles to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet {
    pub domains: HashMap<Arc<str>, Domain>,
}

/// The node a descriptor reached, with the node of every level on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match<'a> {
    /// `levels[i]` matched entry `i`; the last one is the rule.
    pub levels: Vec<&'a Node>,
}

impl<'a> Match<'a> {
    /// The node reached by the last entry.
    pub fn rule(&self) -> &'a Node {
        self.levels.last().expect("a match has at least one level")
    }
}

impl RuleSet {
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }
}

impl Domain {
    /// Walks `entries` (key, value) down the tree: at each level the exact
    /// key+value node, else the first matching wildcard (config order), else
    /// the key-only node; no backtracking. `None` when some level has no
    /// node. The caller checks whether the reached node has limits.
    pub fn find<'a>(&'a self, entries: &[(&str, &str)]) -> Option<Match<'a>> {
        let _ = entries;
        todo!("descriptor matching")
    }
}
