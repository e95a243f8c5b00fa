//! Validated rule trees and descriptor matching (pure: no IO, no clock).
//!
//! `config` builds these from YAML; the limiter (`decision`) asks a
//! [`Domain`] which [`Node`] a descriptor reaches.
//!
//! What the types hold, so no reader has to check it again (every field
//! is private, and each is set only by the constructor or consuming
//! builder that keeps its invariant):
//! - [`RateLimit::new`] derives a limit's params from its unit, multiplier,
//!   number and algorithm, so they always agree; [`RateLimit::named`] and
//!   [`RateLimit::log_capped`] add only what does not touch the params, and
//!   a capped log is always on the sliding-window counter.
//! - [`Limits::new`]: a node's limits are never empty and never two on one
//!   counter.
//! - [`Node::new`] derives a node's path from its parent, key and value, so
//!   the path never disagrees with them; [`Node::with_flags`] keeps
//!   `share_threshold` only on a wildcard.
//! - [`Node::with_children`], [`Domain::new`] and [`RuleSet::new`] build
//!   each level's lookup index with the level, and nothing below a built
//!   node or domain can be changed, so an index always matches its nodes.
//!
//! What only the config format defines (keys allowed, envoyproxy's
//! messages) is checked in `config`.
//!
//! Files: `limit` holds a limit and a node's limits, `level_index` the
//! lookup index of one level, `wildcard` the index of a level's wildcard
//! patterns; this file the tree (nodes, domains, the rule set) and
//! matching.

mod level_index;
mod limit;
pub mod wildcard;

use std::sync::Arc;

use smallvec::SmallVec;

use crate::algorithms::Algorithm;
use level_index::LevelIndex;

pub use limit::{Limits, LimitsError, NodeLimits, RateLimit, RateLimitError, SharedCounter, Unit};

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

impl ValueMatcher {
    /// The matcher a config `value` means: empty is no value (as in
    /// envoyproxy/ratelimit), one with `*` a pattern.
    pub fn from_config(value: &str) -> ValueMatcher {
        if value.is_empty() {
            ValueMatcher::Any
        } else if value.contains('*') {
            ValueMatcher::Wildcard(value.into())
        } else {
            ValueMatcher::Exact(value.into())
        }
    }
}

/// A node's own part of a rule path: `key`, or `key_value` (the pattern
/// for a wildcard). Within one level it is envoyproxy's composite key.
pub fn segment(key: &str, value: &ValueMatcher) -> String {
    match value {
        ValueMatcher::Any => key.to_owned(),
        ValueMatcher::Exact(value) | ValueMatcher::Wildcard(value) => format!("{key}_{value}"),
    }
}

/// The options of one node, each off unless its config sets it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeFlags {
    /// Over-limit answers are counted and logged, but the request is let
    /// through.
    pub shadow_mode: bool,
    pub quota_mode: bool,
    /// Every value this wildcard matches shares one counter.
    pub share_threshold: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
}

/// A node of a domain's descriptor tree.
///
/// Built by [`Node::new`], which derives its path, and given limits, flags
/// and children only through consuming builders ([`Node::with_limits`],
/// [`Node::with_flags`], [`Node::with_children`]): the lookup index over
/// the children is built with them, and a tree cannot be changed below a
/// node once built, so the index never goes stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    key: Arc<str>,
    value: ValueMatcher,
    limits: NodeLimits,
    /// `share_threshold` only on a wildcard.
    flags: NodeFlags,
    /// Path below the domain, each level's [`segment`] joined by `.`: the
    /// metric label `rule`.
    path: Arc<str>,
    children: Vec<Node>,
    /// Lookup index over `children`.
    index: LevelIndex,
}

/// One domain's rules, built by [`Domain::new`] with the index over its
/// top level, as [`Node`]s are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    name: Arc<str>,
    /// Used by RateLimitOverride where no rule names an algorithm.
    default_algorithm: Algorithm,
    /// The order of a quota bucket's keys as a descriptor (RLQS): these
    /// first, in this order, then the others sorted. Empty: all sorted.
    bucket_key_order: Vec<Arc<str>>,
    children: Vec<Node>,
    /// Lookup index over `children`.
    index: LevelIndex,
}

/// Default of `--max-log-entries`: the most requests per window a
/// sliding-window log may count, since it keeps one entry per request.
pub const DEFAULT_MAX_LOG_ENTRIES: u32 = 10_000;

/// Every loaded domain: what a config file set compiles to. Built by
/// [`RuleSet::new`], so each domain is found under its own name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSet {
    /// foldhash rather than SipHash: looked up on every request, by
    /// configured names only.
    domains: foldhash::HashMap<Arc<str>, Domain>,
    /// Most requests per window a sliding-window log may count: a
    /// RateLimitOverride above it on a sliding log uses the
    /// sliding-window counter instead, as a rule that inherits the log does.
    max_log_entries: u32,
    /// No config has arrived yet ([`RuleSet::awaiting_first_config`]).
    awaiting: bool,
}

impl Default for RuleSet {
    fn default() -> Self {
        Self {
            domains: foldhash::HashMap::default(),
            max_log_entries: DEFAULT_MAX_LOG_ENTRIES,
            awaiting: false,
        }
    }
}

/// The node a descriptor reached, with the node of every level on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match<'a> {
    /// `levels[i]` matched entry `i`; the last one is the rule.
    pub levels: Vec<&'a Node>,
}

/// The node of every level a descriptor reached: most rules have a few
/// levels, held without a heap allocation.
pub type Levels<'a> = SmallVec<[&'a Node; 4]>;

impl<'a> Match<'a> {
    /// The node reached by the last entry.
    pub fn rule(&self) -> &'a Node {
        self.levels.last().expect("a match has at least one level")
    }
}

impl RuleSet {
    /// The rule set of `domains`; of two domains with one name, the later
    /// one is kept.
    pub fn new(domains: impl IntoIterator<Item = Domain>, max_log_entries: u32) -> RuleSet {
        RuleSet {
            domains: domains
                .into_iter()
                .map(|domain| (domain.name.clone(), domain))
                .collect(),
            max_log_entries,
            awaiting: false,
        }
    }

    /// No rules at all, not even an empty config: what a service serving
    /// before its first config (rules pushed by a management server, forced
    /// to start without them) holds until that config arrives. Unlike an
    /// empty config, where every domain is unknown and answered OK, no
    /// request can be decided against it.
    pub fn awaiting_first_config() -> RuleSet {
        RuleSet {
            awaiting: true,
            ..RuleSet::default()
        }
    }

    /// Whether this is [`RuleSet::awaiting_first_config`].
    pub fn is_awaiting_first_config(&self) -> bool {
        self.awaiting
    }

    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// Every domain, in no particular order.
    pub fn domains(&self) -> impl ExactSizeIterator<Item = &Domain> {
        self.domains.values()
    }

    /// Most requests per window a sliding-window log may count: a
    /// RateLimitOverride above it on a sliding log uses the sliding-window
    /// counter instead, as a rule that inherits the log does.
    pub fn max_log_entries(&self) -> u32 {
        self.max_log_entries
    }
}

impl Node {
    /// A node without children below the rule path `parent` (empty at the
    /// top of a domain), every flag off.
    pub fn new(parent: &str, key: Arc<str>, value: ValueMatcher, limits: NodeLimits) -> Node {
        let segment = segment(&key, &value);
        let path = if parent.is_empty() {
            segment
        } else {
            format!("{parent}.{segment}")
        };
        Node {
            key,
            value,
            limits,
            flags: NodeFlags::default(),
            path: path.into(),
            children: Vec::new(),
            index: LevelIndex::default(),
        }
    }

    /// This node enforcing `limits` in place of the ones it had.
    pub fn with_limits(self, limits: NodeLimits) -> Node {
        Node { limits, ..self }
    }

    /// This node with `flags` in place of the ones it had, except that
    /// `share_threshold` is kept only on a wildcard: values of any other
    /// node have no pattern to share (the config refuses it with a message).
    pub fn with_flags(self, flags: NodeFlags) -> Node {
        let wildcard = matches!(self.value, ValueMatcher::Wildcard(_));
        let flags = NodeFlags {
            share_threshold: flags.share_threshold && wildcard,
            ..flags
        };
        Node { flags, ..self }
    }

    /// This node over `children` (replacing any it had), with their lookup
    /// index built.
    pub fn with_children(self, children: Vec<Node>) -> Node {
        Node {
            index: LevelIndex::new(&children),
            children,
            ..self
        }
    }

    /// The nodes one level below, in config order.
    pub fn children(&self) -> &[Node] {
        &self.children
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn value(&self) -> &ValueMatcher {
        &self.value
    }

    pub fn limits(&self) -> &NodeLimits {
        &self.limits
    }

    /// Path below the domain, each level's [`segment`] joined by `.`: the
    /// metric label `rule`.
    pub fn path(&self) -> &Arc<str> {
        &self.path
    }

    pub fn flags(&self) -> NodeFlags {
        self.flags
    }

    pub fn shadow_mode(&self) -> bool {
        self.flags.shadow_mode
    }

    pub fn quota_mode(&self) -> bool {
        self.flags.quota_mode
    }

    /// Every value this wildcard matches shares one counter; never set on
    /// a node that is not a wildcard.
    pub fn share_threshold(&self) -> bool {
        self.flags.share_threshold
    }

    pub fn detailed_metric(&self) -> bool {
        self.flags.detailed_metric
    }

    pub fn value_to_metric(&self) -> bool {
        self.flags.value_to_metric
    }
}

impl Domain {
    /// A domain over `children`, with its lookup index built.
    pub fn new(name: Arc<str>, default_algorithm: Algorithm, children: Vec<Node>) -> Domain {
        Domain {
            name,
            default_algorithm,
            bucket_key_order: Vec::new(),
            index: LevelIndex::new(&children),
            children,
        }
    }

    /// The domain with `keys` as its quota bucket key order (no key
    /// twice, none empty: the config checks).
    pub fn with_bucket_key_order(mut self, keys: Vec<Arc<str>>) -> Domain {
        self.bucket_key_order = keys;
        self
    }

    /// The keys a quota bucket's entries are ordered by, first; the
    /// others follow sorted by key.
    pub fn bucket_key_order(&self) -> &[Arc<str>] {
        &self.bucket_key_order
    }

    /// The nodes of the top level, in config order.
    pub fn children(&self) -> &[Node] {
        &self.children
    }

    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// Used by RateLimitOverride where no rule names an algorithm.
    pub fn default_algorithm(&self) -> Algorithm {
        self.default_algorithm
    }

    /// Walks `entries` (key, value) down the tree: at each level the exact
    /// key+value node, else the first matching wildcard (config order), else
    /// the key-only node; no backtracking. `None` when some level has no
    /// node (including a descriptor longer than the tree is deep, and an
    /// empty one). The caller checks whether the reached node has limits.
    ///
    /// Keys and values are bytes: an exact rule value matches only the same
    /// bytes, a wildcard matches bytes, and a key that is not UTF-8 matches
    /// no rule (rule keys are text).
    pub fn find<'a, K: AsRef<[u8]>, V: AsRef<[u8]>>(
        &'a self,
        entries: &[(K, V)],
    ) -> Option<Match<'a>> {
        let pairs = entries
            .iter()
            .map(|(key, value)| (key.as_ref(), value.as_ref()));
        let levels = self.find_levels(pairs)?;
        Some(Match {
            levels: levels.into_vec(),
        })
    }

    /// What [`Domain::find`] finds, from `(key, value)` pairs as they come
    /// and with the levels on the stack: every request matches its
    /// descriptors this way, without allocating.
    pub fn find_levels<'a, 'e>(
        &'a self,
        entries: impl Iterator<Item = (&'e [u8], &'e [u8])>,
    ) -> Option<Levels<'a>> {
        let mut levels = Levels::new();
        let mut children = &self.children;
        let mut index = &self.index;
        for (key, value) in entries {
            let key = std::str::from_utf8(key).ok()?;
            let node = index.lookup(children, key, value)?;
            levels.push(node);
            children = &node.children;
            index = &node.index;
        }
        // No entries reach no rule.
        (!levels.is_empty()).then_some(levels)
    }
}

pub use crate::rules::wildcard::glob_match;

#[cfg(test)]
mod tests;
