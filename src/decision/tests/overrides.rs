//! Override parameters, and overrides decided end to end.

use super::*;
use crate::decision::{Descriptor, LimitOverride, Request};
use crate::rules::Unit;
use crate::testing::decision::*;
use crate::testing::default_options as options;
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
        let fixture = fixture(
            rules(vec![key_node(
                "k",
                vec![limit_with(5, Unit::Minute, 1, algorithm)],
            )]),
            options(),
        );
        for (requests, unit) in EXTREME_OVERRIDES {
            let case = format!("{algorithm} {requests}/{}", unit.name());
            let with_cost = |cost: u64| {
                req(vec![Descriptor {
                    limit: Some(LimitOverride {
                        requests_per_unit: requests,
                        unit: Some(unit),
                    }),
                    hits_addend: Some(cost),
                    // One counter per case: overrides of one unit share theirs.
                    ..desc(&[("k", &case)])
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

#[tokio::test]
async fn override_uses_its_own_counter_and_reports_no_name() {
    let fixture = fixture(
        rules(vec![key_node(
            "k",
            vec![named(
                limit_with(100, Unit::Minute, 1, Algorithm::TokenBucket),
                "rule",
                &[],
            )],
        )]),
        options(),
    );
    let with_override = |requests_per_unit| {
        req(vec![Descriptor {
            limit: Some(LimitOverride {
                requests_per_unit,
                unit: Some(Unit::Second),
            }),
            ..desc(&[("k", "v")])
        }])
    };
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
                req(vec![Descriptor {
                    limit: Some(LimitOverride {
                        requests_per_unit: 0,
                        unit: Some(Unit::Minute),
                    }),
                    ..desc(&[("nothing", "v")])
                }]),
                OVER,
                vec![lim(OVER, 0, 60, 0, Unit::Minute, "")],
            ),
        ],
    )
    .await;
    // The rule's algorithm: half a second refills one token (a sliding
    // log would still be full).
    fixture.clock.advance(500_000);
    check(
        &fixture,
        &[(with_override(2), OK, vec![status(2, OK, 0, 1)])],
    )
    .await;

    // No rule: the domain's default (sliding log). Same unit, bigger
    // number: the same counter, and the extra room at once.
    let other = |requests_per_unit| {
        req(vec![Descriptor {
            limit: Some(LimitOverride {
                requests_per_unit,
                unit: Some(Unit::Hour),
            }),
            ..desc(&[("other", "v")])
        }])
    };
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

    // In an unknown domain the override is not enforced.
    let unknown = Request {
        domain: "unknown".to_owned(),
        ..with_override(0)
    };
    check(&fixture, &[(unknown, OK, vec![ok_none()])]).await;
}
