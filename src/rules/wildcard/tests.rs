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
