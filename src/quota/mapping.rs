//! From a bucket id to the rule it is governed by.
//!
//! A bucket id is a map of strings; the order of its entries carries no
//! meaning. It becomes a descriptor by one fixed rule: the keys the
//! domain's `bucket_key_order` lists first, in that order, then every
//! other entry sorted by key (bytewise); each entry one level. Without a
//! `bucket_key_order` that is all entries sorted by key. The descriptor
//! then matches the domain's tree exactly as an RLS descriptor does
//! (exact value, else the first matching wildcard, else key-only; depth
//! must match).
//!
//! Of the node it reaches, after the limits the node's own limits
//! `replaces`: no rule → ALLOW_ALL; `unlimited` → ALLOW_ALL; a limit of 0
//! → DENY_ALL; `shadow_mode` → ALLOW_ALL (the bucket's usage is still
//! tracked); otherwise the most restrictive limit (the smallest number per
//! second) is the budget the proxies reporting the bucket share.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::Arc;

use crate::rules::{Domain, Node, NodeLimits, RateLimit, RuleSet, ValueMatcher};

use super::share::Budget;

/// Entries of one bucket id at most; more is refused.
pub const MAX_BUCKET_ENTRIES: usize = 32;

/// Where one shared budget lives: the domain, the rule and the entries
/// (a wildcard level that shares one counter among its values by its
/// pattern), as one string. Two bucket ids reaching the same counter of
/// the same rule share a budget.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey(Arc<str>);

impl PoolKey {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What the rules say of one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// No rule matches (unknown domain included): ALLOW_ALL.
    Unmatched,
    /// `unlimited: true`: ALLOW_ALL.
    Unlimited { rule: Arc<str> },
    /// A limit of 0: DENY_ALL.
    Blocked { rule: Arc<str> },
    /// `shadow_mode`: ALLOW_ALL; the budget is reported, not enforced.
    Shadow { rule: Arc<str>, budget: Budget },
    /// A budget shared by every proxy reporting a bucket of this pool.
    Shared {
        rule: Arc<str>,
        pool: PoolKey,
        budget: Budget,
    },
}

impl Resolution {
    /// The rule's path, the `rule` label of its metrics.
    pub fn rule(&self) -> Option<&Arc<str>> {
        match self {
            Resolution::Unmatched => None,
            Resolution::Unlimited { rule }
            | Resolution::Blocked { rule }
            | Resolution::Shadow { rule, .. }
            | Resolution::Shared { rule, .. } => Some(rule),
        }
    }
}

/// A bucket id's entries sorted by key: what identifies the bucket (the
/// descriptor of a domain without a `bucket_key_order`).
pub fn descriptor<'a>(
    bucket: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<(&'a str, &'a str)> {
    let mut entries: Vec<(&str, &str)> = bucket
        .into_iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect();
    entries.sort_unstable();
    entries
}

/// `entries` (sorted by key) in the order `keys` gives: the entries of
/// those keys first, in that order, then the others as they were.
pub fn ordered<'a>(keys: &[Arc<str>], entries: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut out: Vec<(&str, &str)> = keys
        .iter()
        .filter_map(|key| entries.iter().find(|(name, _)| *name == &**key).copied())
        .collect();
    out.extend(
        entries
            .iter()
            .filter(|(name, _)| !keys.iter().any(|key| **key == **name))
            .copied(),
    );
    out
}

/// What the rules of `domain` say of the bucket whose sorted entries are
/// `entries` (ordered by the domain's `bucket_key_order` first).
pub fn resolve(rules: &RuleSet, domain: &str, entries: &[(&str, &str)]) -> Resolution {
    let Some(domain) = rules.domain(domain) else {
        return Resolution::Unmatched;
    };
    let ordered_entries;
    let entries = if domain.bucket_key_order().is_empty() {
        entries
    } else {
        ordered_entries = ordered(domain.bucket_key_order(), entries);
        &ordered_entries
    };
    let pairs = entries
        .iter()
        .map(|(key, value)| (key.as_bytes(), value.as_bytes()));
    let Some(levels) = domain.find_levels(pairs) else {
        return Resolution::Unmatched;
    };
    let Some(node) = levels.last().copied() else {
        return Resolution::Unmatched;
    };
    let rule = node.path().clone();
    let limits = match node.limits() {
        NodeLimits::None => return Resolution::Unmatched,
        NodeLimits::Unlimited { .. } => return Resolution::Unlimited { rule },
        NodeLimits::Limited(limits) => limits,
    };
    let replaced: HashSet<&str> = limits
        .iter()
        .flat_map(RateLimit::replaces)
        .map(|it| &**it)
        .collect();
    let kept = limits
        .iter()
        .filter(|it| !it.name().is_some_and(|name| replaced.contains(&**name)));
    let Some(budget) = kept.map(budget_of).min_by(|a, b| tighter(*a, *b)) else {
        return Resolution::Unmatched;
    };
    if budget.per_window == 0 {
        return Resolution::Blocked { rule };
    }
    if node.shadow_mode() {
        return Resolution::Shadow { rule, budget };
    }
    let pool = pool_key(domain, &levels, entries);
    Resolution::Shared { rule, pool, budget }
}

fn budget_of(limit: &RateLimit) -> Budget {
    Budget {
        per_window: u64::from(limit.requests_per_unit()),
        window_us: limit.params().window_us(),
    }
}

/// Orders budgets by their rate, the smaller first; of equal rates the
/// shorter window first.
fn tighter(a: Budget, b: Budget) -> std::cmp::Ordering {
    let rate_a = u128::from(a.per_window) * u128::from(b.window_us);
    let rate_b = u128::from(b.per_window) * u128::from(a.window_us);
    rate_a.cmp(&rate_b).then(a.window_us.cmp(&b.window_us))
}

/// The entries part of a pool key longer than this is written as `|%#`
/// and the SHA-256 digest of it in 64 hex digits.
pub const MAX_INLINE_ENTRIES_BYTES: usize = 256;

/// The domain, the rule's path and the entries, each escaped; entries
/// longer than [`MAX_INLINE_ENTRIES_BYTES`] as their digest, so a key
/// made of client values is at most the domain and path (configured)
/// plus 67 bytes past them. Escaping never writes `%#`, so a digest never
/// equals an entries part written out.
fn pool_key(domain: &Domain, levels: &[&Node], entries: &[(&str, &str)]) -> PoolKey {
    let mut key = String::new();
    let _ = write!(key, "{}", escape(domain.name()));
    if let Some(node) = levels.last() {
        let _ = write!(key, "|{}", escape(node.path()));
    }
    let mut tail = String::new();
    for (level, (name, value)) in levels.iter().zip(entries) {
        let _ = write!(tail, "|{}=", escape(name));
        match level.value() {
            ValueMatcher::Wildcard(pattern) if level.share_threshold() => {
                let _ = write!(tail, "~{}", escape(pattern));
            }
            _ => tail.push_str(&escape(value)),
        }
    }
    if tail.len() > MAX_INLINE_ENTRIES_BYTES {
        use sha2::{Digest, Sha256};
        key.push_str("|%#");
        for byte in Sha256::digest(tail.as_bytes()) {
            let _ = write!(key, "{byte:02x}");
        }
    } else {
        key.push_str(&tail);
    }
    PoolKey(key.into())
}

/// `%`, `|`, `=` and `~` escaped, so the parts of a key never run together.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '%' | '|' | '=' | '~' => {
                let _ = write!(out, "%{:02X}", ch as u32);
            }
            _ => out.push(ch),
        }
    }
    out
}

/// The text of a bucket id, entries sorted, for logs and `/rlconfig`.
pub fn bucket_label(entries: &[(&str, &str)]) -> String {
    let mut label = String::new();
    for (key, value) in entries {
        if !label.is_empty() {
            label.push(',');
        }
        let _ = write!(label, "{}={}", escape(key), escape(value));
    }
    label
}

#[cfg(test)]
mod tests;
