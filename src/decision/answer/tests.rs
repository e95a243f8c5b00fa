//! Statuses: remaining and reset, the most restrictive limit, modes.

use crate::decision::Options;
use crate::rules::{NodeFlags, Unit};
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

#[tokio::test]
async fn over_limit_after_n_with_remaining_and_reset() {
    let fixture = one_rule("user", named(limit(3, Unit::Minute), "per_user", &[]));
    let one = || req(vec![desc(&[("user", "alice")])]);
    let status = |code, remaining, reset| lim(code, remaining, reset, 3, Unit::Minute, "per_user");
    check(
        &fixture,
        &[
            (one(), OK, vec![status(OK, 2, 60)]),
            (one(), OK, vec![status(OK, 1, 60)]),
            (one(), OK, vec![status(OK, 0, 60)]),
            (one(), OVER, vec![status(OVER, 0, 60)]),
            // Another value has its own counter.
            (
                req(vec![desc(&[("user", "bob")])]),
                OK,
                vec![status(OK, 2, 60)],
            ),
        ],
    )
    .await;
    // 20.5 s later the window still holds all three: 39.5 s → 40 s.
    fixture.clock.advance(20_500_000);
    check_one(&fixture, one(), OVER, vec![status(OVER, 0, 40)]).await;
    fixture.clock.advance(40_000_000);
    check_one(&fixture, one(), OK, vec![status(OK, 2, 60)]).await;
}

#[tokio::test]
async fn denied_request_consumes_nothing_anywhere() {
    let fixture = fixture(
        rules(vec![
            key_node("a", vec![limit(5, Unit::Minute)]),
            key_node("b", vec![limit(1, Unit::Minute)]),
        ]),
        options(),
    );
    let both = || req(vec![desc(&[("a", "1")]), desc(&[("b", "1")])]);
    let a = |code, remaining| lim(code, remaining, 60, 5, Unit::Minute, "");
    let b = |code, remaining| lim(code, remaining, 60, 1, Unit::Minute, "");
    check(
        &fixture,
        &[
            (both(), OK, vec![a(OK, 4), b(OK, 0)]),
            // A had room and reports its current remaining: nothing taken.
            (both(), OVER, vec![a(OK, 4), b(OVER, 0)]),
            (both(), OVER, vec![a(OK, 4), b(OVER, 0)]),
            (req(vec![desc(&[("a", "1")])]), OK, vec![a(OK, 3)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn shadow_and_quota_modes() {
    let shadow_mode = NodeFlags {
        shadow_mode: true,
        ..NodeFlags::default()
    };
    let quota_mode = NodeFlags {
        quota_mode: true,
        ..NodeFlags::default()
    };
    let shadow = key_node("shadow", vec![limit(1, Unit::Minute)]).with_flags(shadow_mode);
    let quota_small = key_node("q1", vec![limit(1, Unit::Minute)]).with_flags(quota_mode);
    let quota_big = key_node("q2", vec![limit(3, Unit::Minute)]).with_flags(quota_mode);
    let fixture = fixture(rules(vec![shadow, quota_small, quota_big]), options());
    let status = |rpu, code, remaining| lim(code, remaining, 60, rpu, Unit::Minute, "");
    let shadow = || req(vec![desc(&[("shadow", "s")])]);
    let quotas = || req(vec![desc(&[("q1", "x")]), desc(&[("q2", "x")])]);
    check(
        &fixture,
        &[
            (shadow(), OK, vec![status(1, OK, 0)]),
            // Out of room, but a shadow rule never denies.
            (shadow(), OK, vec![status(1, OK, 0)]),
            (quotas(), OK, vec![status(1, OK, 0), status(3, OK, 2)]),
            // q1 is out, q2 has room: allowed, q1 reports OVER_LIMIT.
            (quotas(), OK, vec![status(1, OVER, 0), status(3, OK, 1)]),
            (quotas(), OK, vec![status(1, OVER, 0), status(3, OK, 0)]),
            // Every quota limit is out: denied.
            (quotas(), OVER, vec![status(1, OVER, 0), status(3, OVER, 0)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn most_restrictive_limit_of_a_node() {
    let fixture = fixture(
        rules(vec![
            key_node(
                "least",
                vec![limit(10, Unit::Second), limit(5, Unit::Minute)],
            ),
            key_node("tie", vec![limit(5, Unit::Second), limit(5, Unit::Minute)]),
            key_node(
                "denied",
                vec![limit(1, Unit::Second), limit(1, Unit::Minute)],
            ),
        ]),
        options(),
    );
    let one = |key: &str| req(vec![desc(&[(key, "v")])]);
    check(
        &fixture,
        &[
            // Least remaining after the request.
            (one("least"), OK, vec![lim(OK, 4, 60, 5, Unit::Minute, "")]),
            // Equal remaining: the longer window.
            (one("tie"), OK, vec![lim(OK, 4, 60, 5, Unit::Minute, "")]),
            (one("denied"), OK, vec![lim(OK, 0, 60, 1, Unit::Minute, "")]),
        ],
    )
    .await;
    let denied = |reset| vec![lim(OVER, 0, reset, 1, Unit::Minute, "")];
    // Both deny; the minute limit frees up last.
    fixture.clock.advance(500_000);
    check_one(&fixture, one("denied"), OVER, denied(60)).await;
    // Only the minute limit denies now.
    fixture.clock.advance(1_000_000);
    check_one(&fixture, one("denied"), OVER, denied(59)).await;
}

#[tokio::test]
async fn global_shadow_mode_reports_ok_without_retry_after() {
    let fixture = fixture(
        rules(vec![key_node("k", vec![limit(1, Unit::Minute)])]),
        Options {
            shadow_mode: true,
            ..options()
        },
    );
    let one = || req(vec![desc(&[("k", "v")])]);
    let status = |code| lim(code, 0, 60, 1, Unit::Minute, "");
    check(
        &fixture,
        &[
            (one(), OK, vec![status(OK)]),
            (one(), OK, vec![status(OVER)]),
        ],
    )
    .await;
    let decision = fixture.limiter.decide(&one()).await.unwrap();
    assert_eq!(header(&decision, "Retry-After"), None);
    assert_eq!(header(&decision, "RateLimit-Remaining"), Some("0"));
}
