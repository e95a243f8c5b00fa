//! Validated rule trees and descriptor matching (pure: no IO, no clock).
//!
//! `config` builds these from YAML; the limiter asks a [`Domain`] which
//! [`Node`] a descriptor reaches. Types here cannot hold an invalid rule.

pub mod wildcard;

use std::collections::HashMap;
use std::sync::Arc;

use crate::algorithms::{Algorithm, LimitParams};
use crate::rules::wildcard::WildcardIndex;

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
    /// The rule inherited `sliding_window_log` with a number over the log
    /// cap, and uses `sliding_window_counter` instead.
    pub log_capped: bool,
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
    /// Positions of the wildcard nodes, in config order.
    wildcards: Vec<usize>,
    /// Their patterns, indexed: position `i` is `wildcards[i]`.
    patterns: WildcardIndex,
    any: Option<usize>,
}

/// Default of `--max-log-entries`: the most requests per window a
/// sliding-window log may count, since it keeps one entry per request.
pub const DEFAULT_MAX_LOG_ENTRIES: u32 = 10_000;

/// Every loaded domain: what a config file set compiles to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleSet {
    pub domains: HashMap<Arc<str>, Domain>,
    /// Most requests per window a sliding-window log may count: a
    /// RateLimitOverride above it on a sliding log uses the
    /// sliding-window counter instead, as a rule that inherits the log does.
    pub max_log_entries: u32,
}

impl Default for RuleSet {
    fn default() -> Self {
        Self {
            domains: HashMap::new(),
            max_log_entries: DEFAULT_MAX_LOG_ENTRIES,
        }
    }
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
    /// A domain over `children`, with its lookup index built.
    pub fn new(name: Arc<str>, default_algorithm: Algorithm, children: Vec<Node>) -> Domain {
        Domain {
            name,
            default_algorithm,
            index: LevelIndex::new(&children),
            children,
        }
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
        if entries.is_empty() {
            return None;
        }
        let mut levels = Vec::with_capacity(entries.len());
        let mut children = &self.children;
        let mut index = &self.index;
        for (key, value) in entries {
            let key = std::str::from_utf8(key.as_ref()).ok()?;
            let node = index.lookup(children, key, value.as_ref())?;
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
        for slot in by_key.values_mut() {
            slot.patterns =
                WildcardIndex::new(
                    slot.wildcards
                        .iter()
                        .map(|idx| match &children[*idx].value {
                            ValueMatcher::Wildcard(pattern) => pattern.as_bytes(),
                            ValueMatcher::Any | ValueMatcher::Exact(_) => &[][..],
                        }),
                );
        }
        LevelIndex { by_key }
    }

    fn lookup<'a>(&self, children: &'a [Node], key: &str, value: &[u8]) -> Option<&'a Node> {
        let slot = self.by_key.get(key)?;
        // Rule values are text: bytes that are not UTF-8 equal none of them.
        let idx = std::str::from_utf8(value)
            .ok()
            .and_then(|text| slot.exact.get(text))
            .copied()
            .or_else(|| {
                let first = slot.patterns.first_match(value)?;
                slot.wildcards.get(first).copied()
            })
            .or(slot.any)?;
        children.get(idx)
    }
}

pub use crate::rules::wildcard::glob_match;

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing;

    const RULES: &str = r#"
domain: test
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: k
    value: exact
    rate_limit: {unit: minute, requests_per_unit: 1, name: exact}
  - key: k
    value: pre*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: k
    value: "*suf"
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: k
    value: a*z
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: k
    value: "*x*y*"
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 6}
  - key: order
    value: ab*
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: order
    value: a*
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: tenant
    descriptors:
      - key: path
        value: /expensive
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 10, replaces: [{name: exact}]}
      - key: path
        rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        quota_mode: true
        rate_limit: {unit: day, requests_per_unit: 1000}
  - key: files
    value: /files/*
    share_threshold: true
    descriptors:
      - key: method
        rate_limit: {unit: second, requests_per_unit: 7}
  - key: health
    rate_limit: {unlimited: true, name: health, replaces: [{name: exact}]}
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}
      - {unit: minute, unit_multiplier: 5, requests_per_unit: 100, algorithm: gcra}
      - {unit: day, requests_per_unit: 10000}
  - key: parent
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: child
        rate_limit: {unit: second, requests_per_unit: 2}
"#;

    fn rules() -> RuleSet {
        testing::rules_from("rules.yaml", RULES)
    }

    /// Renders a match as `<path> <limits> [flags]`, or `none`.
    fn render(found: Option<Match<'_>>) -> String {
        let Some(found) = found else {
            return "none".to_owned();
        };
        let rule = found.rule();
        let mut out = format!("{} ", rule.path);
        match &rule.limits {
            NodeLimits::None => out.push_str("nolimit"),
            NodeLimits::Unlimited { name, replaces } => {
                out.push_str("unlimited");
                if let Some(name) = name {
                    out.push_str(&format!(" name={name}"));
                }
                for replaced in replaces {
                    out.push_str(&format!(" replaces={replaced}"));
                }
            }
            NodeLimits::Limited(limits) => {
                let parts: Vec<String> = limits
                    .iter()
                    .map(|limit| {
                        let mut part = format!(
                            "{}/{}s:{}:cap{}",
                            limit.requests_per_unit,
                            limit.window_seconds(),
                            limit.algorithm(),
                            limit.params.capacity()
                        );
                        if let Some(name) = &limit.name {
                            part.push_str(&format!(":name={name}"));
                        }
                        for replaced in &limit.replaces {
                            part.push_str(&format!(":replaces={replaced}"));
                        }
                        part
                    })
                    .collect();
                out.push_str(&parts.join(","));
            }
        }
        if rule.shadow_mode {
            out.push_str(" shadow");
        }
        if rule.quota_mode {
            out.push_str(" quota");
        }
        for (idx, level) in found.levels.iter().enumerate() {
            if level.share_threshold {
                out.push_str(&format!(" share@{idx}"));
            }
        }
        out
    }

    fn check(descriptor: &[(&str, &str)], expected: &str) {
        let rules = rules();
        let domain = rules.domain("test").expect("domain test");
        let found = domain.find(descriptor);
        if let Some(found) = &found {
            assert_eq!(found.levels.len(), descriptor.len(), "{descriptor:?}");
        }
        assert_eq!(render(found), expected, "descriptor {descriptor:?}");
    }

    #[test]
    fn matching_table() {
        let sw = "sliding_window_log";
        let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
            // key-only: any value
            (
                vec![("remote_address", "10.0.0.1")],
                format!("remote_address 10/1s:{sw}:cap10"),
            ),
            // exact beats wildcards and key-only
            (
                vec![("k", "exact")],
                format!("k_exact 1/60s:{sw}:cap1:name=exact"),
            ),
            // prefix, suffix, middle and multi-star wildcards
            (vec![("k", "prefix")], format!("k_pre* 2/60s:{sw}:cap2")),
            (vec![("k", "pre")], format!("k_pre* 2/60s:{sw}:cap2")),
            (vec![("k", "endsuf")], format!("k_*suf 3/60s:{sw}:cap3")),
            (vec![("k", "abcz")], format!("k_a*z 4/60s:{sw}:cap4")),
            (vec![("k", "az")], format!("k_a*z 4/60s:{sw}:cap4")),
            (vec![("k", "1x2y3")], format!("k_*x*y* 5/60s:{sw}:cap5")),
            (vec![("k", "xy")], format!("k_*x*y* 5/60s:{sw}:cap5")),
            // no wildcard matches: key-only
            (vec![("k", "yx")], format!("k 6/60s:{sw}:cap6")),
            (vec![("k", "")], format!("k 6/60s:{sw}:cap6")),
            // several wildcards match: the first in config order wins
            (vec![("k", "presuf")], format!("k_pre* 2/60s:{sw}:cap2")),
            (
                vec![("order", "abc")],
                format!("order_ab* 1/3600s:{sw}:cap1"),
            ),
            (vec![("order", "ac")], format!("order_a* 2/3600s:{sw}:cap2")),
            // no wildcard and no key-only node
            (vec![("order", "b")], "none".to_owned()),
            (vec![("unknown", "x")], "none".to_owned()),
            (vec![], "none".to_owned()),
            // nested, with shadow mode and replaces
            (
                vec![("tenant", "t1"), ("path", "/expensive")],
                format!("tenant.path_/expensive 10/60s:{sw}:cap10:replaces=exact shadow"),
            ),
            (
                vec![("tenant", "t1"), ("path", "/cheap")],
                format!("tenant.path 100/60s:{sw}:cap100"),
            ),
            // too short: the reached node has no limit
            (vec![("tenant", "t1")], "tenant nolimit".to_owned()),
            (vec![("tenant", "acme")], "tenant_acme nolimit".to_owned()),
            (
                vec![("tenant", "acme"), ("user", "u1")],
                format!("tenant_acme.user 1000/86400s:{sw}:cap1000 quota"),
            ),
            // no backtracking to the key-only `tenant` when tenant_acme has no `path`
            (
                vec![("tenant", "acme"), ("path", "/expensive")],
                "none".to_owned(),
            ),
            // too long
            (
                vec![("remote_address", "x"), ("more", "y")],
                "none".to_owned(),
            ),
            (
                vec![("parent", "p"), ("child", "c"), ("extra", "e")],
                "none".to_owned(),
            ),
            // a limit on an inner node applies at that depth only
            (vec![("parent", "p")], format!("parent 1/1s:{sw}:cap1")),
            (
                vec![("parent", "p"), ("child", "c")],
                format!("parent.child 2/1s:{sw}:cap2"),
            ),
            // share_threshold on the wildcard level is visible in the match
            (
                vec![("files", "/files/a.txt"), ("method", "GET")],
                format!("files_/files/*.method 7/1s:{sw}:cap7 share@0"),
            ),
            (
                vec![("files", "/other"), ("method", "GET")],
                "none".to_owned(),
            ),
            // unlimited keeps its name and replaces
            (
                vec![("health", "x")],
                "health unlimited name=health replaces=exact".to_owned(),
            ),
            // several limits on one node
            (
                vec![("user", "u1")],
                format!(
                    "user 10/1s:token_bucket:cap20,100/300s:gcra:cap100,10000/86400s:{sw}:cap10000"
                ),
            ),
        ];
        for (descriptor, expected) in cases {
            check(&descriptor, &expected);
        }
    }

    #[test]
    fn share_threshold_level_keeps_the_pattern() {
        let rules = rules();
        let domain = rules.domain("test").expect("domain test");
        let found = domain
            .find(&[("files", "/files/x"), ("method", "PUT")])
            .expect("matches");
        assert!(found.levels[0].share_threshold);
        assert_eq!(
            found.levels[0].value,
            ValueMatcher::Wildcard("/files/*".into())
        );
        assert_eq!(found.levels[1].value, ValueMatcher::Any);
    }

    /// 10,000 wildcard rules and a request of 64 descriptors of 1 KiB
    /// values: every descriptor reaches the rule it should (the time this
    /// takes is measured in `benches/matching.rs`, not asserted here).
    #[test]
    fn ten_thousand_wildcards_and_long_values() {
        let mut yaml = String::from("domain: big\ndescriptors:\n");
        for n in 0..10_000 {
            yaml.push_str(&format!(
                "  - key: k\n    value: \"*mid{n}*end\"\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
        yaml.push_str("  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n");
        let rules = testing::rules_from("big.yaml", &yaml);
        let domain = rules.domain("big").expect("domain big");
        let filler = "x".repeat(1100);
        for descriptor in 0..64 {
            // Even descriptors end with `end` and reach `*mid{n}*end` for
            // the smallest n whose `mid{n}` occurs; odd ones do not end with
            // `end` and fall through to the key-only rule.
            let n = descriptor * 150;
            let tail = if descriptor % 2 == 0 { "end" } else { "enx" };
            let value = format!("{filler}mid{n}{tail}");
            let value = &value[value.len() - 1024..];
            assert_eq!(value.len(), 1024);
            let found = domain.find(&[("k", value)]).expect("a rule");
            let expected = if descriptor % 2 == 0 {
                // `mid{n}` also contains `mid{m}` for each prefix m of n.
                let smallest = (1..=n.to_string().len())
                    .map(|digits| n.to_string()[..digits].parse::<usize>().unwrap())
                    .min()
                    .unwrap();
                format!("k_*mid{smallest}*end")
            } else {
                "k".to_owned()
            };
            assert_eq!(&*found.rule().path, expected, "descriptor {descriptor}");
        }
    }

    #[test]
    fn glob_matches_bytes_that_are_not_utf8() {
        assert!(glob_match("/files/*".as_bytes(), b"/files/\xff\xfe"));
        assert!(glob_match("*".as_bytes(), b"\xff"));
        assert!(glob_match("a*b".as_bytes(), b"a\xc3b"));
        assert!(glob_match("*x*".as_bytes(), b"\xffx\x80"));
        assert!(!glob_match("/files/*".as_bytes(), b"/file\xff"));
        // Literals compare bytes: part of a character is not the character.
        assert!(glob_match("*\u{a9}".as_bytes(), b"\xff\xc2\xa9"));
        assert!(!glob_match("\u{e9}".as_bytes(), b"\xc3"));
        assert!(!glob_match("*\u{e9}*".as_bytes(), b"\xc3\xff\xa9"));
    }

    #[test]
    fn entries_match_by_their_bytes() {
        let rules = rules();
        let domain = rules.domain("test").expect("domain test");
        let path =
            |entries: &[(&[u8], &[u8])]| domain.find(entries).map(|it| it.rule().path.to_string());
        let long = vec![b'x'; 70_000];
        type Entries<'a> = Vec<(&'a [u8], &'a [u8])>;
        let cases: Vec<(Entries<'_>, Option<&str>)> = vec![
            // An exact value matches only the same bytes.
            (vec![(b"k", b"exact")], Some("k_exact")),
            (vec![(b"k", b"exact\xff")], Some("k")),
            (vec![(b"k", b"exac")], Some("k")),
            // Wildcards match bytes, including bytes that are not UTF-8.
            (vec![(b"k", b"pre\xff")], Some("k_pre*")),
            (vec![(b"k", b"\xffsuf")], Some("k_*suf")),
            (vec![(b"k", b"\xff")], Some("k")),
            // Key-only matches any value, of any length.
            (
                vec![(b"remote_address", b"\xff\xfe")],
                Some("remote_address"),
            ),
            (vec![(b"remote_address", &long)], Some("remote_address")),
            (vec![(b"remote_address", b"")], Some("remote_address")),
            // A key that is not UTF-8 matches no rule key.
            (vec![(b"k\xff", b"exact")], None),
            (vec![(b"\xff", b"v")], None),
            (vec![(b"tenant", b"t"), (b"path\xff", b"/x")], None),
        ];
        for (entries, expected) in cases {
            assert_eq!(path(&entries).as_deref(), expected, "{entries:?}");
        }
    }

    /// Reference: the textbook recursive definition.
    fn reference(pattern: &[u8], value: &[u8]) -> bool {
        match pattern.split_first() {
            None => value.is_empty(),
            Some((b'*', rest)) => (0..=value.len()).any(|skip| reference(rest, &value[skip..])),
            Some((ch, rest)) => value.first() == Some(ch) && reference(rest, &value[1..]),
        }
    }

    proptest! {
        #[test]
        fn glob_agrees_with_reference_on_any_bytes(
            pattern in "[a\u{e9}*]{0,8}",
            value in proptest::collection::vec(
                proptest::sample::select(vec![b'a', 0xc3, 0xa9, 0xff]),
                0..10,
            ),
        ) {
            prop_assert_eq!(
                glob_match(pattern.as_bytes(), &value),
                reference(pattern.as_bytes(), &value),
                "pattern {:?} value {:?}", pattern, value
            );
        }
    }
}
