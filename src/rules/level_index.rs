//! The lookup index of one level of a rule tree: per key, the exact
//! values, the wildcards in config order and the key-only node.
//!
//! Invariant: built only with its level ([`Node::with_children`],
//! [`Domain::new`](super::Domain::new)), and a built level cannot change, so an index always
//! matches its nodes. Its maps use foldhash rather than SipHash (looked up
//! on every request with request bytes); their keys are the config's, so
//! no client can fill them with colliding keys.

use std::sync::Arc;

use super::wildcard::WildcardIndex;
use super::{Node, ValueMatcher};

/// Index of one level's nodes by key, so matching does not scan every
/// sibling: per key, the exact values, the wildcards in config order and the
/// key-only node, as positions in the level's `children`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct LevelIndex {
    by_key: foldhash::HashMap<Arc<str>, KeySlot>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct KeySlot {
    exact: foldhash::HashMap<Arc<str>, usize>,
    /// Positions of the wildcard nodes, in config order.
    wildcards: Vec<usize>,
    /// Their patterns, indexed: position `i` is `wildcards[i]`.
    patterns: WildcardIndex,
    any: Option<usize>,
}

impl LevelIndex {
    /// Indexes `children`. When two nodes have the same key and value
    /// (config validation refuses that) the first one wins.
    pub(super) fn new(children: &[Node]) -> LevelIndex {
        let mut by_key: foldhash::HashMap<Arc<str>, KeySlot> = foldhash::HashMap::default();
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

    pub(super) fn lookup<'a>(
        &self,
        children: &'a [Node],
        key: &str,
        value: &[u8],
    ) -> Option<&'a Node> {
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
