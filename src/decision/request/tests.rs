//! The bounds of a request, and bytes of any kind within them.

use std::sync::Arc;

use super::*;
use crate::rules::{Unit, ValueMatcher};
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

#[tokio::test]
async fn bounds_are_invalid_argument_with_a_reason() {
    let many_entries: Vec<(&str, &str)> = vec![("k", "v"); MAX_ENTRIES + 1];
    let cases: Vec<(Request, &str)> = vec![
        (
            Request {
                domain: String::new(),
                ..req(vec![desc(&[("k", "v")])])
            },
            "empty domain",
        ),
        (req(vec![]), "no descriptors"),
        (
            req(vec![Descriptor::default()]),
            "descriptor 0 has no entries",
        ),
        (
            req(vec![desc(&[("k", "v")]), desc(&[("", "v")])]),
            "descriptor 1, entry 0: empty entry key",
        ),
        (
            req(vec![desc(&[("k", "v")]); MAX_DESCRIPTORS + 1]),
            "too many descriptors: 65, at most 64",
        ),
        (
            req(vec![desc(&many_entries)]),
            "descriptor 0 has too many entries: 33, at most 32",
        ),
    ];
    let fixture = fixture(rules(vec![]), options());
    for (request, expected) in cases {
        match fixture.limiter.decide(&request).await {
            Err(Error::InvalidArgument(message)) => assert_eq!(message, expected),
            other => panic!("{expected}: got {other:?}"),
        }
    }
    // At the bounds exactly: accepted.
    let entries: Vec<(&str, &str)> = vec![("k", "v"); MAX_ENTRIES];
    let request = req(vec![desc(&entries); MAX_DESCRIPTORS]);
    assert!(fixture.limiter.decide(&request).await.is_ok());
}

#[tokio::test]
async fn keys_and_values_of_any_length_and_bytes_are_decided() {
    let fixture = fixture(
        rules(vec![
            key_node("path", vec![limit(2, Unit::Hour)]),
            node(
                "exact",
                ValueMatcher::Exact(Arc::from("v")),
                limited(vec![limit(1, Unit::Hour)]),
            ),
        ]),
        options(),
    );
    let entry = |key: &[u8], value: &[u8]| desc(&[(key, value)]);
    let long = vec![b'a'; 70_000];
    let mut long_other = long.clone();
    long_other[69_999] = b'b';
    let status = |code, remaining| lim(code, remaining, 3600, 2, Unit::Hour, "");
    let one = |it: Descriptor| req(vec![it]);
    check(
        &fixture,
        &[
            // A long value, a domain longer than 1 KiB, a long key that
            // matches no rule: all decided.
            (one(entry(b"path", &long)), OK, vec![status(OK, 1)]),
            (one(entry(b"path", &long)), OK, vec![status(OK, 0)]),
            (one(entry(b"path", &long)), OVER, vec![status(OVER, 0)]),
            // Another long value with the same first bytes: its own counter.
            (one(entry(b"path", &long_other)), OK, vec![status(OK, 1)]),
            (one(entry(&long, b"v")), OK, vec![ok_none()]),
            // Bytes that are not UTF-8: their own counter too.
            (one(entry(b"path", b"\xff")), OK, vec![status(OK, 1)]),
            (one(entry(b"path", b"\xfe")), OK, vec![status(OK, 1)]),
            (one(entry(b"path", b"\xff")), OK, vec![status(OK, 0)]),
            (one(entry(b"path", b"")), OK, vec![status(OK, 1)]),
            // An exact rule value matches the same bytes only.
            (one(entry(b"exact", b"v\xff")), OK, vec![ok_none()]),
            (
                one(entry(b"exact", b"v")),
                OK,
                vec![lim(OK, 0, 3600, 1, Unit::Hour, "")],
            ),
        ],
    )
    .await;
    let long_domain = Request {
        domain: "d".repeat(2_000),
        ..one(entry(b"path", b"v"))
    };
    check_one(&fixture, long_domain, OK, vec![ok_none()]).await;
}
