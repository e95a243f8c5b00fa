//! The wildcard patterns of one rule level, indexed so that finding the first one a value matches does not try every pattern in turn.
//!
//! A pattern is literal segments separated by `*`; a value it matches
//! contains every one of them. Each pattern is keyed by its rarest segment
//! (the one fewest patterns of the level share, the longest on a tie), and
//! one Aho-Corasick automaton over the key segments finds, in one pass over
//! the value, which of them occur. Only the patterns keyed by an occurring
//! segment are candidates; they are checked with [`glob_match`] in config
//! order, stopping at the first match.
//!
//! Cost of one lookup: one automaton pass over the value (plus one step per
//! key-segment occurrence) and a linear [`glob_match`] per candidate. A
//! value cannot make the service try patterns whose key segment it does not
//! contain, which is what made the plain scan of 10,000 patterns expensive;
//! and keying by the rarest segment keeps a segment many patterns share
//! (`*mid1*end`, `*mid2*end`, ...) from making all of them candidates.

use std::cell::RefCell;
use std::collections::HashMap;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};

/// Levels with at most this many key segments search with a DFA.
const DFA_KEYS: usize = 1_000;

/// The wildcard patterns of one level (one key), in config order.
#[derive(Debug, Clone)]
pub struct WildcardIndex {
    patterns: Vec<Box<[u8]>>,
    /// Over the key segments; `None` when no pattern has a segment.
    automaton: Option<AhoCorasick>,
    /// Key segment id → the patterns keyed by it, ascending (config order).
    users: Vec<Vec<u32>>,
    /// Patterns without any segment (`*`-only, or empty), ascending: they
    /// are tried on every value.
    unkeyed: Vec<u32>,
}

/// Per-thread working memory of [`WildcardIndex::first_match`], so a lookup
/// allocates nothing once the thread has seen its largest level. Every
/// entry of `seen` is back to false between lookups.
#[derive(Default)]
struct Scratch {
    seen: Vec<bool>,
    seen_ids: Vec<u32>,
    candidates: Vec<u32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl PartialEq for WildcardIndex {
    fn eq(&self, other: &Self) -> bool {
        // Everything else is derived from the patterns.
        self.patterns == other.patterns
    }
}

impl Eq for WildcardIndex {}

impl Default for WildcardIndex {
    fn default() -> Self {
        WildcardIndex::new(std::iter::empty::<&[u8]>())
    }
}

fn segments(pattern: &[u8]) -> impl Iterator<Item = &[u8]> {
    pattern
        .split(|byte| *byte == b'*')
        .filter(|segment| !segment.is_empty())
}

impl WildcardIndex {
    /// Indexes `patterns`; [`first_match`](Self::first_match) answers
    /// positions in this order.
    pub fn new<'p>(patterns: impl IntoIterator<Item = &'p [u8]>) -> WildcardIndex {
        let patterns: Vec<&[u8]> = patterns.into_iter().collect();
        // How many patterns contain each segment.
        let mut sharing: HashMap<&[u8], usize> = HashMap::new();
        for pattern in &patterns {
            let mut mine: Vec<&[u8]> = segments(pattern).collect();
            mine.sort_unstable();
            mine.dedup();
            for segment in mine {
                *sharing.entry(segment).or_default() += 1;
            }
        }
        let mut key_ids: HashMap<&[u8], usize> = HashMap::new();
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut users: Vec<Vec<u32>> = Vec::new();
        let mut unkeyed = Vec::new();
        for (position, pattern) in patterns.iter().enumerate() {
            let position = u32::try_from(position).unwrap_or(u32::MAX);
            let key = segments(pattern)
                .min_by_key(|segment| (sharing[segment], std::cmp::Reverse(segment.len())));
            let Some(key) = key else {
                unkeyed.push(position);
                continue;
            };
            let id = *key_ids.entry(key).or_insert_with(|| {
                keys.push(key);
                users.push(Vec::new());
                keys.len() - 1
            });
            users[id].push(position);
        }
        let automaton = if keys.is_empty() {
            None
        } else {
            // Standard semantics is what overlapping search needs: every
            // occurrence of every key, not only the leftmost-longest.
            // A DFA scans several times faster than the default NFA; its
            // memory grows with the keys, so large levels keep the NFA.
            let kind = (keys.len() <= DFA_KEYS).then_some(AhoCorasickKind::DFA);
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .kind(kind)
                .build(&keys)
                .ok()
        };
        WildcardIndex {
            patterns: patterns.into_iter().map(Box::from).collect(),
            automaton,
            users,
            unkeyed,
        }
    }

    /// How many patterns are indexed.
    pub fn len(&self) -> usize {
        self.patterns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    /// The position of the first pattern (config order) that `value`
    /// matches, as [`glob_match`] decides.
    pub fn first_match(&self, value: &[u8]) -> Option<usize> {
        // The first unkeyed pattern that matches (`*`-only ones match
        // everything) bounds the answer: only earlier keyed ones can win.
        let unkeyed = self
            .unkeyed
            .iter()
            .copied()
            .find(|position| glob_match(&self.patterns[*position as usize], value));
        let Some(automaton) = &self.automaton else {
            if self.users.is_empty() {
                return unkeyed.map(|position| position as usize);
            }
            // The automaton could not be built: try every pattern in turn.
            return self.patterns.iter().position(|it| glob_match(it, value));
        };
        let limit = unkeyed.unwrap_or(u32::MAX);
        if limit == 0 {
            return Some(0);
        }
        let keyed = SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let scratch = &mut *scratch;
            if scratch.seen.len() < self.users.len() {
                scratch.seen.resize(self.users.len(), false);
            }
            for found in automaton.find_overlapping_iter(value) {
                let id = found.pattern().as_usize();
                if !scratch.seen[id] {
                    scratch.seen[id] = true;
                    scratch.seen_ids.push(id as u32);
                    // Each pattern has one key: no pattern is added twice.
                    let users = &self.users[id];
                    let before = users.partition_point(|position| *position < limit);
                    scratch.candidates.extend_from_slice(&users[..before]);
                }
            }
            for id in scratch.seen_ids.drain(..) {
                scratch.seen[id as usize] = false;
            }
            scratch.candidates.sort_unstable();
            let found = scratch
                .candidates
                .iter()
                .copied()
                .find(|position| glob_match(&self.patterns[*position as usize], value));
            scratch.candidates.clear();
            found
        });
        keyed.or(unkeyed).map(|position| position as usize)
    }
}

/// Whether `value` matches `pattern`, where each `*` matches any run of
/// bytes (possibly empty) and every other byte matches itself.
///
/// With `*` as the only metacharacter, taking the leftmost occurrence of
/// each literal segment is always optimal, so this runs in time linear in
/// the lengths (no backtracking blow-up on hostile values).
pub fn glob_match(pattern: &[u8], value: &[u8]) -> bool {
    let Some(first) = memchr::memchr(b'*', pattern) else {
        return pattern == value;
    };
    let prefix = &pattern[..first];
    let rest = &pattern[first + 1..];
    let (middle, suffix) = match memchr::memrchr(b'*', rest) {
        Some(last) => (&rest[..last], &rest[last + 1..]),
        None => (&rest[..0], rest),
    };
    if value.len() < prefix.len() + suffix.len()
        || !value.starts_with(prefix)
        || !value.ends_with(suffix)
    {
        return false;
    }
    // Prefix and suffix do not overlap (length checked above).
    let mut haystack = &value[prefix.len()..value.len() - suffix.len()];
    for part in middle.split(|byte| *byte == b'*') {
        if part.is_empty() {
            continue;
        }
        match memchr::memmem::find(haystack, part) {
            Some(at) => haystack = &haystack[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests;
