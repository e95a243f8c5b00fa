//! The wildcard patterns of one rule level, indexed so that finding the first one a value matches does not try every pattern in turn.
//!
//! A pattern is literal segments separated by `*`. One Aho-Corasick
//! automaton over every distinct segment of the level finds, in one pass
//! over the value, which segments occur anywhere in it; only a pattern all
//! of whose segments occur can match, and only those candidates are checked
//! with [`glob_match`], in config order, stopping at the first match.
//!
//! Cost of one lookup: one automaton pass over the value (plus one step per
//! segment occurrence), one step per (occurring segment, pattern using it)
//! pair, and a linear [`glob_match`] per candidate. A value cannot make the
//! service try patterns whose segments it does not contain, which is what
//! made the plain scan of 10,000 patterns expensive.

use std::cell::RefCell;

use aho_corasick::{AhoCorasick, MatchKind};

/// The wildcard patterns of one level (one key), in config order.
#[derive(Debug, Clone)]
pub struct WildcardIndex {
    patterns: Vec<Pattern>,
    /// Over every distinct non-empty segment; `None` when no pattern has one.
    automaton: Option<AhoCorasick>,
    /// Segment id → the patterns containing it, ascending (config order).
    users: Vec<Vec<u32>>,
    /// The first pattern made only of `*`: it matches every value, so no
    /// later pattern can ever be the first match.
    catch_all: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    text: Box<[u8]>,
    /// How many distinct segments must occur in a value it matches.
    segments: u32,
}

/// Per-thread working memory of [`WildcardIndex::first_match`], so a lookup
/// allocates nothing once the thread has seen its largest level. Every
/// entry is back to false/0 between lookups.
#[derive(Default)]
struct Scratch {
    segment_seen: Vec<bool>,
    seen: Vec<u32>,
    counts: Vec<u32>,
    touched: Vec<u32>,
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

impl WildcardIndex {
    /// Indexes `patterns`; [`first_match`](Self::first_match) answers
    /// positions in this order.
    pub fn new<'p>(patterns: impl IntoIterator<Item = &'p [u8]>) -> WildcardIndex {
        let mut literals: Vec<&[u8]> = Vec::new();
        let mut literal_ids: std::collections::HashMap<&[u8], u32> =
            std::collections::HashMap::new();
        let mut users: Vec<Vec<u32>> = Vec::new();
        let mut compiled = Vec::new();
        let mut catch_all = None;
        for (position, text) in patterns.into_iter().enumerate() {
            let position = u32::try_from(position).unwrap_or(u32::MAX);
            let mut segments = 0;
            for segment in text.split(|byte| *byte == b'*') {
                if segment.is_empty() {
                    continue;
                }
                let id = *literal_ids.entry(segment).or_insert_with(|| {
                    literals.push(segment);
                    users.push(Vec::new());
                    u32::try_from(literals.len() - 1).unwrap_or(u32::MAX)
                });
                let list = &mut users[id as usize];
                // A segment repeated within one pattern counts once.
                if list.last() != Some(&position) {
                    list.push(position);
                    segments += 1;
                }
            }
            if segments == 0 && text.contains(&b'*') && catch_all.is_none() {
                catch_all = Some(position);
            }
            compiled.push(Pattern {
                text: text.into(),
                segments,
            });
        }
        let automaton = if literals.is_empty() {
            None
        } else {
            // Standard semantics is what overlapping search needs: every
            // occurrence of every segment, not only the leftmost-longest.
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .build(&literals)
                .ok()
        };
        WildcardIndex {
            patterns: compiled,
            automaton,
            users,
            catch_all,
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
        let Some(automaton) = &self.automaton else {
            // No pattern has a literal segment (so each is `*`-only or
            // empty), or the automaton could not be built: try them in turn.
            return self
                .patterns
                .iter()
                .position(|it| glob_match(&it.text, value));
        };
        // Nothing after the catch-all can be first.
        let limit = self
            .catch_all
            .map_or(self.patterns.len(), |position| position as usize);
        if limit == 0 {
            return self.catch_all.map(|position| position as usize);
        }
        let found = SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let scratch = &mut *scratch;
            if scratch.segment_seen.len() < self.users.len() {
                scratch.segment_seen.resize(self.users.len(), false);
            }
            if scratch.counts.len() < self.patterns.len() {
                scratch.counts.resize(self.patterns.len(), 0);
            }
            for found in automaton.find_overlapping_iter(value) {
                let id = found.pattern().as_usize();
                if !scratch.segment_seen[id] {
                    scratch.segment_seen[id] = true;
                    scratch.seen.push(id as u32);
                }
            }
            for id in scratch.seen.drain(..) {
                scratch.segment_seen[id as usize] = false;
                for &position in &self.users[id as usize] {
                    if position as usize >= limit {
                        break;
                    }
                    let count = &mut scratch.counts[position as usize];
                    if *count == 0 {
                        scratch.touched.push(position);
                    }
                    *count += 1;
                    if *count == self.patterns[position as usize].segments {
                        scratch.candidates.push(position);
                    }
                }
            }
            for position in scratch.touched.drain(..) {
                scratch.counts[position as usize] = 0;
            }
            scratch.candidates.sort_unstable();
            let found = scratch
                .candidates
                .iter()
                .copied()
                .find(|position| glob_match(&self.patterns[*position as usize].text, value));
            scratch.candidates.clear();
            found.map(|position| position as usize)
        });
        // A pattern with no segment (only stars, or empty) never became a
        // candidate above; the catch-all is the only one that can matter,
        // besides an empty pattern, which matches only "".
        found.or_else(|| {
            if value.is_empty() {
                self.scan(value, limit)
                    .or(self.catch_all.map(|it| it as usize))
            } else {
                self.catch_all.map(|position| position as usize)
            }
        })
    }

    /// The first of the first `limit` patterns with no segment that matches
    /// `value`, by trying them in turn.
    fn scan(&self, value: &[u8], limit: usize) -> Option<usize> {
        self.patterns[..limit]
            .iter()
            .position(|it| it.segments == 0 && glob_match(&it.text, value))
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
    fn only_patterns_whose_segments_all_occur_are_tried() {
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

    proptest! {
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
