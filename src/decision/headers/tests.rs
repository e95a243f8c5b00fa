//! The `RateLimit-*` headers.

use super::*;
use crate::algorithms::Algorithm;
use crate::decision::{Decision, Options, Request};
use crate::rules::RuleSet;
use crate::rules::{RateLimit, Unit};
use crate::testing::T0;
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

#[tokio::test]
async fn unit_multiplier_reports_configured_unit_and_exact_headers() {
    let fixture = one_rule("k", limit_with(10, Unit::Minute, 5, Algorithm::FixedWindow));
    let decision = fixture
        .limiter
        .decide(&req(vec![desc(&[("k", "v")])]))
        .await
        .unwrap();
    let status = &decision.statuses[0];
    let current = status.current_limit.as_ref().unwrap();
    assert_eq!(
        (current.requests_per_unit, current.unit),
        (10, Unit::Minute)
    );
    // T0 is 1_700_000_000 s: 200 s into its aligned 300 s window.
    assert_eq!(T0 / 1_000_000 % 300, 200);
    assert_eq!(status.duration_until_reset_s, Some(100));
    assert_eq!(header(&decision, "RateLimit-Limit"), Some("10"));
    assert_eq!(header(&decision, "RateLimit-Remaining"), Some("9"));
    assert_eq!(header(&decision, "RateLimit-Reset"), Some("100"));
}

#[tokio::test]
async fn a_burst_is_the_header_limit_and_remaining_never_exceeds_a_limit() {
    let bucket = RateLimit::new(Unit::Second, 1, 10, Algorithm::TokenBucket, Some(20)).unwrap();
    let gcra = RateLimit::new(Unit::Second, 1, 10, Algorithm::Gcra, Some(20)).unwrap();
    let fixture = fixture(
        rules(vec![
            key_node("bucket", vec![bucket]),
            key_node("gcra", vec![gcra]),
        ]),
        options(),
    );
    for key in ["bucket", "gcra"] {
        let one = || req(vec![desc(&[(key, "v")])]);
        let mut seen = Vec::new();
        for _ in 0..20 {
            let decision = fixture.limiter.decide(&one()).await.unwrap();
            let status = &decision.statuses[0];
            let current = status.current_limit.as_ref().unwrap();
            let limit: u32 = header(&decision, "RateLimit-Limit")
                .unwrap()
                .parse()
                .unwrap();
            let remaining: u32 = header(&decision, "RateLimit-Remaining")
                .unwrap()
                .parse()
                .unwrap();
            // The header reports the capacity, which Remaining can reach;
            // the status reports the rate, and Remaining up to it.
            assert_eq!(limit, 20, "{key}");
            assert!(remaining <= limit, "{key}: {remaining} > {limit}");
            assert_eq!(
                (current.requests_per_unit, current.unit),
                (10, Unit::Second)
            );
            assert!(status.limit_remaining <= current.requests_per_unit, "{key}");
            assert_eq!(status.limit_remaining, remaining.min(10), "{key}");
            seen.push(remaining);
        }
        assert_eq!(seen, (0..20).rev().collect::<Vec<u32>>(), "{key}");
        let decision = fixture.limiter.decide(&one()).await.unwrap();
        assert_eq!(decision.overall, OVER, "{key}");
        assert_eq!(header(&decision, "RateLimit-Remaining"), Some("0"));
    }
}

/// `a`: 10 per minute; `b`: 2 per hour, the more restrictive.
fn two_rules() -> RuleSet {
    rules(vec![
        key_node("a", vec![limit(10, Unit::Minute)]),
        key_node("b", vec![limit(2, Unit::Hour)]),
    ])
}

fn both() -> Request {
    req(vec![desc(&[("a", "1")]), desc(&[("b", "1")])])
}

fn assert_headers(decision: &Decision, expected: &[(&str, &str)]) {
    let got: Vec<(&str, &str)> = decision
        .headers
        .iter()
        .map(|(key, value)| (key.as_str(), value.as_str()))
        .collect();
    assert_eq!(got, expected);
}

#[tokio::test]
async fn headers_of_the_most_restrictive_status() {
    let fixture = fixture(two_rules(), options());
    let decision = fixture.limiter.decide(&both()).await.unwrap();
    assert_headers(
        &decision,
        &[
            ("RateLimit-Limit", "2"),
            ("RateLimit-Remaining", "1"),
            ("RateLimit-Reset", "3600"),
        ],
    );
    fixture.limiter.decide(&both()).await.unwrap();
    fixture.clock.advance(1_000_000);
    let decision = fixture.limiter.decide(&both()).await.unwrap();
    assert_eq!(decision.overall, OVER);
    assert_headers(
        &decision,
        &[
            ("RateLimit-Limit", "2"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "3599"),
            ("Retry-After", "3599"),
        ],
    );
    // No rule matched: no headers.
    let decision = fixture
        .limiter
        .decide(&req(vec![desc(&[("nothing", "1")])]))
        .await
        .unwrap();
    assert_headers(&decision, &[]);
}

#[tokio::test]
async fn headers_off_are_never_sent_and_custom_names_are_used() {
    let off = fixture(
        two_rules(),
        Options {
            response_headers: None,
            ..options()
        },
    );
    let decision = off.limiter.decide(&both()).await.unwrap();
    assert_headers(&decision, &[]);
    let custom = fixture(
        two_rules(),
        Options {
            response_headers: Some(HeaderNames {
                limit: "X-L".to_owned(),
                remaining: "X-R".to_owned(),
                reset: "X-Reset".to_owned(),
                retry_after: "X-Retry".to_owned(),
            }),
            ..options()
        },
    );
    let decision = custom.limiter.decide(&both()).await.unwrap();
    assert_headers(
        &decision,
        &[("X-L", "2"), ("X-R", "1"), ("X-Reset", "3600")],
    );
}
