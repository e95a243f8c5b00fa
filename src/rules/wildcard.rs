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
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Reference: the textbook recursive definition.
    fn reference(pattern: &[u8], value: &[u8]) -> bool {
        match pattern.split_first() {
            None => value.is_empty(),
            Some((b'*', rest)) => (0..=value.len()).any(|skip| reference(rest, &value[skip..])),
            Some((byte, rest)) => value.first() == Some(byte) && reference(rest, &value[1..]),
        }
    }

    /// The first pattern matching `value`, trying each in config order.
    fn naive_first(patterns: &[Vec<u8>], value: &[u8]) -> Option<usize> {
        patterns.iter().position(|it| glob_match(it, value))
    }

    fn index(patterns: &[Vec<u8>]) -> WildcardIndex {
        WildcardIndex::new(patterns.iter().map(Vec::as_slice))
    }

    #[test]
    fn glob_handles_hostile_input() {
        let value = vec![b'a'; 1024];
        let pattern = format!("{}b", "*a".repeat(200));
        assert!(!glob_match(pattern.as_bytes(), &value));
        let pattern = "*a".repeat(200);
        assert!(glob_match(pattern.as_bytes(), &value));
        // Multi-byte characters around stars, compared byte by byte.
        assert!(glob_match("é*ü".as_bytes(), "éxxü".as_bytes()));
        assert!(!glob_match("éé*".as_bytes(), "é".as_bytes()));
        assert!(glob_match(b"**", b""));
        assert!(!glob_match(b"ab*ba", b"aba"));
        // Values need not be UTF-8.
        assert!(glob_match(b"\xff*\x00", b"\xff\x80\x00"));
    }

    #[test]
    fn first_match_keeps_config_order() {
        let patterns: Vec<Vec<u8>> = ["a*z", "*mid*", "ab*", "*", "never*"]
            .iter()
            .map(|it| it.as_bytes().to_vec())
            .collect();
        let index = index(&patterns);
        let cases: [(&[u8], Option<usize>); 6] = [
            (b"abz", Some(0)),
            (b"abmid", Some(1)),
            (b"abc", Some(2)),
            (b"zzz", Some(3)),
            (b"", Some(3)),
            (b"never", Some(3)),
        ];
        for (value, expected) in cases {
            assert_eq!(index.first_match(value), expected, "{value:?}");
        }
    }

    #[test]
    fn a_segment_every_pattern_shares_does_not_decide() {
        // 10,000 patterns sharing the suffix: a value with one `midN` is
        // decided by that pattern, wherever it is in the list.
        let patterns: Vec<Vec<u8>> = (0..10_000)
            .map(|n| format!("*mid{n}x*end").into_bytes())
            .collect();
        let index = index(&patterns);
        let mut value = vec![b'.'; 1000];
        value.extend_from_slice(b"mid9876xend");
        assert_eq!(index.first_match(&value), Some(9876));
        value.extend_from_slice(b"!");
        assert_eq!(index.first_match(&value), None);
    }

    #[test]
    fn empty_and_star_only_patterns() {
        let patterns: Vec<Vec<u8>> = vec![b"".to_vec(), b"x*".to_vec(), b"**".to_vec()];
        let index = index(&patterns);
        assert_eq!(index.first_match(b""), Some(0));
        assert_eq!(index.first_match(b"xy"), Some(1));
        assert_eq!(index.first_match(b"y"), Some(2));
        assert_eq!(WildcardIndex::default().first_match(b"y"), None);
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

        #[test]
        fn glob_agrees_with_reference(pattern in "[ab*]{0,8}", value in "[ab]{0,10}") {
            prop_assert_eq!(
                glob_match(pattern.as_bytes(), value.as_bytes()),
                reference(pattern.as_bytes(), value.as_bytes()),
                "pattern {:?} value {:?}", pattern, value
            );
        }

        #[test]
        fn index_agrees_with_first_match_scan(
            patterns in proptest::collection::vec("[abc*]{0,6}", 0..24),
            values in proptest::collection::vec("[abc]{0,12}", 1..8),
        ) {
            let patterns: Vec<Vec<u8>> = patterns.into_iter().map(String::into_bytes).collect();
            let index = index(&patterns);
            for value in values {
                prop_assert_eq!(
                    index.first_match(value.as_bytes()),
                    naive_first(&patterns, value.as_bytes()),
                    "patterns {:?} value {:?}", patterns, value
                );
            }
        }
    }
}
