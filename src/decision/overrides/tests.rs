//! Override parameters, and overrides decided end to end.

use super::*;
use crate::decision::{Descriptor, LimitOverride, Request};
use crate::rules::Unit;
use crate::testing::decision::*;
use crate::testing::rules::*;

#[test]
fn override_params_are_exact_and_never_above_the_number_asked() {
    for algorithm in Algorithm::ALL {
        for (requests, unit) in EXTREME_OVERRIDES {
            let asked = u64::from(requests);
            let window_us = unit.seconds() * 1_000_000;
            let params = override_params(algorithm, asked, window_us, 10_000)
                .unwrap_or_else(|err| panic!("{algorithm} {requests}/{unit:?}: {err}"));
            let case = format!("{algorithm} {requests}/{}", unit.name());
            assert!(params.limit() <= asked, "{case}: {params:?}");
            assert!(params.capacity() <= asked, "{case}: {params:?}");
            assert!(params.limit() > 0, "{case}: {params:?}");
            assert_eq!(params.window_us(), window_us, "{case}");
            let exact = LimitParams::new(params.algorithm(), asked, window_us, None).is_ok();
            if exact {
                assert_eq!(params.limit(), asked, "{case}: exact, so unchanged");
            } else {
                // The nearest below: the next numbers up are not exact.
                let above = (params.limit() + 1)..=asked.min(params.limit() + 2_000);
                for n in above {
                    assert!(
                        LimitParams::new(params.algorithm(), n, window_us, None).is_err(),
                        "{case}: {n} is exact and nearer than {}",
                        params.limit()
                    );
                }
            }
            let expected = if algorithm == Algorithm::SlidingWindowLog && asked > 10_000 {
                Algorithm::SlidingWindowCounter
            } else {
                algorithm
            };
            assert_eq!(params.algorithm(), expected, "{case}");
        }
    }
    // The numbers the exactness rule refuses do change.
    let refused = |algorithm, requests: u64, unit: Unit| {
        LimitParams::new(algorithm, requests, unit.seconds() * 1_000_000, None).is_err()
    };
    assert!(refused(Algorithm::TokenBucket, 999_999, Unit::Month));
    assert!(refused(Algorithm::Gcra, 1_000_003, Unit::Year));
    assert!(refused(
        Algorithm::SlidingWindowCounter,
        1_000_000,
        Unit::Year
    ));
}

#[test]
fn divisors_of_a_window() {
    let mut got = divisors(360);
    got.sort_unstable();
    let expected: Vec<u64> = (1..=360).filter(|it| 360 % it == 0).collect();
    assert_eq!(got, expected);
    assert_eq!(divisors(1), vec![1]);
    // A year in µs: 2^13 · 3^3 · 5^9 · 73.
    assert_eq!(
        divisors(Unit::Year.seconds() * 1_000_000).len(),
        14 * 4 * 10 * 2
    );
}

/// Numbers a client may send that some algorithm cannot hold exactly.
const EXTREME_OVERRIDES: [(u32, Unit); 5] = [
    (1, Unit::Year),
    (u32::MAX, Unit::Second),
    (999_999, Unit::Month),
    (1_000_003, Unit::Year),
    (1_000_000, Unit::Year),
];

#[tokio::test]
async fn every_override_is_decided_on_every_algorithm() {
    for algorithm in Algorithm::ALL {
        let fixture = one_rule("k", limit_with(5, Unit::Minute, 1, algorithm));
        for (requests, unit) in EXTREME_OVERRIDES {
            let case = format!("{algorithm} {requests}/{}", unit.name());
            let with_cost = |cost: u64| {
                req(vec![Descriptor {
                    hits_addend: Some(cost),
                    // One counter per case: overrides of one unit share theirs.
                    ..overridden(&[("k", &case)], requests, unit)
                }])
            };
            // More than asked at once never passes.
            let decision = fixture
                .limiter
                .decide(&with_cost(u64::from(requests) + 1))
                .await
                .unwrap_or_else(|err| panic!("{case}: {err}"));
            assert_eq!(decision.overall, OVER, "{case}");
            let current = decision.statuses[0].current_limit.clone().unwrap();
            assert_eq!(current.unit, unit, "{case}");
            let enforced = current.requests_per_unit;
            assert!(enforced > 0 && enforced <= requests, "{case}: {enforced}");
            let limit: u64 = header(&decision, "RateLimit-Limit")
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(limit, u64::from(enforced), "{case}");
            // The whole enforced number passes, then nothing more.
            let decision = fixture
                .limiter
                .decide(&with_cost(u64::from(enforced)))
                .await
                .unwrap();
            assert_eq!(decision.overall, OK, "{case}");
            assert_eq!(decision.statuses[0].limit_remaining, 0, "{case}");
            let decision = fixture.limiter.decide(&with_cost(1)).await.unwrap();
            assert_eq!(decision.overall, OVER, "{case}");
        }
    }
}

/// An override on a rule charged always is charged always too, and is
/// decided at every extreme number: where twice the capacity is not exact
/// the number enforced is smaller, never an error. A charge of 2^64 − 1
/// goes into debt, and the check after it is denied.
#[tokio::test]
async fn an_override_takes_the_charge_of_its_rule() {
    for algorithm in Algorithm::ALL {
        let limit = limit_with(5, Unit::Minute, 1, algorithm)
            .charged(crate::algorithms::Charge::Always)
            .unwrap();
        let fixture = one_rule("k", limit);
        for (requests, unit) in EXTREME_OVERRIDES {
            let case = format!("{algorithm} {requests}/{}", unit.name());
            let with_cost = |cost: u64| {
                req(vec![Descriptor {
                    hits_addend: Some(cost),
                    ..overridden(&[("k", &case)], requests, unit)
                }])
            };
            let decision = fixture
                .limiter
                .decide(&with_cost(1))
                .await
                .unwrap_or_else(|err| panic!("{case}: {err}"));
            assert_eq!(decision.overall, OK, "{case}");
            let enforced = decision.statuses[0].current_limit.clone().unwrap();
            assert!(enforced.requests_per_unit <= requests, "{case}");
            let charge = fixture.limiter.decide(&with_cost(u64::MAX)).await.unwrap();
            assert_eq!(charge.overall, OVER, "{case}");
            let check = fixture.limiter.decide(&with_cost(0)).await.unwrap();
            assert_eq!(check.overall, OVER, "{case}: the charge was recorded");
        }
    }
}

/// A request of one descriptor of `entries` with an override.
fn one_override(entries: &[(&str, &str)], requests_per_unit: u32, unit: Unit) -> Request {
    req(vec![overridden(entries, requests_per_unit, unit)])
}

/// A rule of 100 per minute on a token bucket, named `rule`, for `k`.
fn token_bucket_rule() -> Fixture {
    one_rule(
        "k",
        named(
            limit_with(100, Unit::Minute, 1, Algorithm::TokenBucket),
            "rule",
            &[],
        ),
    )
}

#[tokio::test]
async fn override_uses_its_own_counter_and_reports_no_name() {
    let fixture = token_bucket_rule();
    let with_override =
        |requests_per_unit| one_override(&[("k", "v")], requests_per_unit, Unit::Second);
    // Token bucket (the rule's algorithm): 2 per second refills one
    // token per 500 ms.
    let status = |rpu, code, remaining, reset| lim(code, remaining, reset, rpu, Unit::Second, "");
    check(
        &fixture,
        &[
            (with_override(2), OK, vec![status(2, OK, 1, 1)]),
            (with_override(2), OK, vec![status(2, OK, 0, 1)]),
            (with_override(2), OVER, vec![status(2, OVER, 0, 1)]),
            // The rule's own counter is untouched.
            (
                req(vec![desc(&[("k", "v")])]),
                OK,
                vec![lim(OK, 99, 1, 100, Unit::Minute, "rule")],
            ),
            // An override for a descriptor no rule matches is enforced too.
            (
                one_override(&[("nothing", "v")], 0, Unit::Minute),
                OVER,
                vec![lim(OVER, 0, 60, 0, Unit::Minute, "")],
            ),
        ],
    )
    .await;
    // The rule's algorithm: half a second refills one token (a sliding
    // log would still be full).
    fixture.clock.advance(500_000);
    check_one(&fixture, with_override(2), OK, vec![status(2, OK, 0, 1)]).await;
}

#[tokio::test]
async fn override_without_a_rule_uses_the_default_algorithm_and_keeps_its_counter() {
    let fixture = token_bucket_rule();
    // No rule: the domain's default (sliding log). Same unit, bigger
    // number: the same counter, and the extra room at once.
    let other = |requests_per_unit| one_override(&[("other", "v")], requests_per_unit, Unit::Hour);
    let hourly = |rpu, code, remaining| lim(code, remaining, 3600, rpu, Unit::Hour, "");
    check(
        &fixture,
        &[
            (other(1), OK, vec![hourly(1, OK, 0)]),
            (other(1), OVER, vec![hourly(1, OVER, 0)]),
            (other(2), OK, vec![hourly(2, OK, 0)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn override_in_an_unknown_domain_is_not_enforced() {
    let fixture = token_bucket_rule();
    let unknown = Request {
        domain: "unknown".to_owned(),
        ..one_override(&[("k", "v")], 0, Unit::Second)
    };
    check_one(&fixture, unknown, OK, vec![ok_none()]).await;
}

#[tokio::test]
async fn override_of_an_unknown_unit_leaves_the_rules_to_decide() {
    let fixture = token_bucket_rule();
    let unknown_unit = Descriptor {
        limit: Some(LimitOverride {
            requests_per_unit: 0,
            unit: None,
        }),
        ..desc(&[("k", "v")])
    };
    assert_eq!(unknown_unit.enforced_override(), None);
    // A token bucket of 100 per minute refills one per 600 ms.
    let rule = |remaining, reset| lim(OK, remaining, reset, 100, Unit::Minute, "rule");
    check(
        &fixture,
        &[
            (req(vec![unknown_unit.clone()]), OK, vec![rule(99, 1)]),
            // The rule's own counter: the override neither replaced nor split it.
            (req(vec![desc(&[("k", "v")])]), OK, vec![rule(98, 2)]),
        ],
    )
    .await;
}
