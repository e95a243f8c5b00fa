//! Requests without counters, backend failures and rule swaps.

use std::sync::Arc;

use super::*;
use crate::rules::{NodeLimits, Unit, ValueMatcher};
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

// What deciding counts, and the over-limit cache: src/decision/tests/.
mod metrics;
mod over_limit;

#[tokio::test]
async fn requests_without_counters_never_reach_the_backend() {
    let tree = rules(vec![
        key_node("limited", vec![limit(1, Unit::Minute)]),
        node("health", ValueMatcher::Any, unlimited()),
        with_children(
            node("parent", ValueMatcher::Any, NodeLimits::None),
            vec![key_node("child", vec![limit(1, Unit::Minute)])],
        ),
    ]);
    let limiter = down(tree, FailureMode::Error);
    let unlimited = unlimited_brief();
    let cases: Vec<(Request, Vec<Brief>)> = vec![
        (
            Request {
                domain: "unknown".to_owned(),
                ..req(vec![desc(&[("limited", "a")]), desc(&[("x", "y")])])
            },
            vec![ok_none(), ok_none()],
        ),
        (req(vec![desc(&[("nothing", "a")])]), vec![ok_none()]),
        (req(vec![desc(&[("health", "a")])]), vec![unlimited.clone()]),
        // The node reached by the last entry has no limit: depth must match.
        (req(vec![desc(&[("parent", "a")])]), vec![ok_none()]),
        (
            req(vec![desc(&[("limited", "a"), ("deeper", "b")])]),
            vec![ok_none()],
        ),
        (
            req(vec![desc(&[("health", "a")]), desc(&[("nothing", "b")])]),
            vec![unlimited, ok_none()],
        ),
    ];
    for (request, expected) in cases {
        let decision = limiter.decide(&request).await.unwrap();
        let got: Vec<Brief> = decision.statuses.iter().map(brief).collect();
        assert_eq!((decision.overall, got), (OK, expected), "{request:?}");
        assert!(decision.headers.is_empty());
    }
    // The same limiter does call the backend for a limited descriptor.
    let res = limiter.decide(&req(vec![desc(&[("limited", "a")])])).await;
    assert!(matches!(res, Err(Error::Backend(_))), "{res:?}");
}

#[tokio::test]
async fn backend_failure_follows_the_failure_mode() {
    let tree = || {
        rules(vec![
            key_node("k", vec![limit(1, Unit::Minute)]),
            node("u", ValueMatcher::Any, unlimited()),
        ])
    };
    let request = || req(vec![desc(&[("k", "v")]), desc(&[("u", "v")])]);
    let res = down(tree(), FailureMode::Error).decide(&request()).await;
    assert!(
        matches!(res, Err(Error::Backend(backends::Error::Unavailable(_)))),
        "{res:?}"
    );
    let unlimited = unlimited_brief();
    let cases = [
        (FailureMode::Allow, OK, (OK, 0, None, None)),
        (FailureMode::Deny, OVER, (OVER, 0, None, None)),
    ];
    for (mode, overall, status) in cases {
        let decision = down(tree(), mode).decide(&request()).await.unwrap();
        let got: Vec<Brief> = decision.statuses.iter().map(brief).collect();
        assert_eq!(
            (decision.overall, got),
            (overall, vec![status, unlimited.clone()]),
            "{mode:?}"
        );
        assert!(decision.headers.is_empty());
    }
}

#[tokio::test]
async fn a_rule_swap_applies_to_the_next_request() {
    let fixture = fixture(rules(vec![]), options());
    let one = || req(vec![desc(&[("k", "v")])]);
    check_one(&fixture, one(), OK, vec![ok_none()]).await;
    fixture.limiter.rules().store(Arc::new(rules(vec![key_node(
        "k",
        vec![limit(1, Unit::Minute)],
    )])));
    check(
        &fixture,
        &[(one(), OK, vec![lim(OK, 0, 60, 1, Unit::Minute, "")])],
    )
    .await;
}

#[test]
fn near_limit_ratio_default_is_a_fifth_left() {
    let ratio = NearLimitRatio::DEFAULT;
    assert_eq!(NearLimitRatio::new(0.8), Some(ratio));
    assert_eq!(NearLimitRatio::default(), ratio);
    assert_eq!(ratio.get(), 0.8);
    for capacity in 0..=200u64 {
        for remaining in 0..=capacity + 2 {
            assert_eq!(
                ratio.is_near(remaining, capacity),
                remaining * 5 < capacity,
                "{remaining} of {capacity}"
            );
        }
    }
    // Exact at the largest capacities too.
    let capacity = crate::algorithms::MAX_EXACT - 1;
    assert!(!ratio.is_near(capacity / 5 + 1, capacity));
    assert!(ratio.is_near(capacity / 5 - 1, capacity));
}

#[test]
fn near_limit_ratio_is_a_share() {
    for refused in [-0.1, 1.01, f64::NAN, f64::INFINITY] {
        assert_eq!(NearLimitRatio::new(refused), None, "{refused}");
    }
    let half = NearLimitRatio::new(0.5).unwrap();
    assert!(!half.is_near(5, 10));
    assert!(half.is_near(4, 10));
    // 0: any use is near; 1: never near.
    assert!(NearLimitRatio::new(0.0).unwrap().is_near(9, 10));
    assert!(!NearLimitRatio::new(0.0).unwrap().is_near(10, 10));
    assert!(!NearLimitRatio::new(1.0).unwrap().is_near(0, 10));
}
