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
    /// `unlimited: true`: always OK, nothing counted. It still replaces the
    /// limits it names, as in envoyproxy/ratelimit.
    Unlimited {
        name: Option<Arc<str>>,
        replaces: Vec<Arc<str>>,
    },
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
    /// Lookup index over `children`; build it with [`LevelIndex::new`]
    /// whenever `children` is set.
    pub index: LevelIndex,
}

/// One domain's rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    pub name: Arc<str>,
    /// Used by RateLimitOverride where no rule names an algorithm.
    pub default_algorithm: Algorithm,
    pub children: Vec<Node>,
    /// Lookup index over `children`, as in [`Node::index`].
    pub index: LevelIndex,
}

/// Index of one level's nodes by key, so matching does not scan every
/// sibling: per key, the exact values, the wildcards in config order and the
/// key-only node, as positions in the level's `children`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LevelIndex {
    by_key: HashMap<Arc<str>, KeySlot>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct KeySlot {
    exact: HashMap<Arc<str>, usize>,
    wildcards: Vec<usize>,
    any: Option<usize>,
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
    /// node (including a descriptor longer than the tree is deep, and an
    /// empty one). The caller checks whether the reached node has limits.
    pub fn find<'a>(&'a self, entries: &[(&str, &str)]) -> Option<Match<'a>> {
        if entries.is_empty() {
            return None;
        }
        let mut levels = Vec::with_capacity(entries.len());
        let mut children = &self.children;
        let mut index = &self.index;
        for (key, value) in entries {
            let node = index.lookup(children, key, value)?;
            levels.push(node);
            children = &node.children;
            index = &node.index;
        }
        Some(Match { levels })
    }
}

impl LevelIndex {
    /// Indexes `children`. When two nodes have the same key and value
    /// (config validation refuses that) the first one wins.
    pub fn new(children: &[Node]) -> LevelIndex {
        let mut by_key: HashMap<Arc<str>, KeySlot> = HashMap::new();
        for (idx, node) in children.iter().enumerate() {
            let slot = by_key.entry(node.key.clone()).or_default();
            match &node.value {
                ValueMatcher::Any => {
                    slot.any.get_or_insert(idx);
                }
                ValueMatcher::Exact(value) => {
                    slot.exact.entry(value.clone()).or_insert(idx);
                }
                ValueMatcher::Wildcard(_) => slot.wildcards.push(idx),
            }
        }
        LevelIndex { by_key }
    }

    fn lookup<'a>(&self, children: &'a [Node], key: &str, value: &str) -> Option<&'a Node> {
        let slot = self.by_key.get(key)?;
        let idx = slot
            .exact
            .get(value)
            .copied()
            .or_else(|| {
                slot.wildcards.iter().copied().find(|idx| {
                    matches!(&children[*idx].value, ValueMatcher::Wildcard(pattern) if glob_match(pattern, value))
                })
            })
            .or(slot.any)?;
        children.get(idx)
    }
}

/// Whether `value` matches `pattern`, where each `*` matches any run of
/// characters (possibly empty) and everything else matches itself.
///
/// With `*` as the only metacharacter, taking the leftmost occurrence of
/// each literal segment is always optimal, so this runs in time linear in
/// the lengths (no backtracking blow-up on hostile values).
pub fn glob_match(pattern: &str, value: &str) -> bool {
    let Some((prefix, rest)) = pattern.split_once('*') else {
        return pattern == value;
    };
    let (middle, suffix) = rest.rsplit_once('*').unwrap_or(("", rest));
    if value.len() < prefix.len() + suffix.len()
        || !value.starts_with(prefix)
        || !value.ends_with(suffix)
    {
        return false;
    }
    // Both ends are char boundaries (they end/start a matched literal) and
    // do not overlap (length checked above).
    let mut haystack = &value[prefix.len()..value.len() - suffix.len()];
    for part in middle.split('*').filter(|part| !part.is_empty()) {
        match haystack.find(part) {
            Some(at) => haystack = &haystack[at + part.len()..],
            None => return false,
        }
    }
    true
}
