//! Matching, costs, shared counters and `replaces`.

use std::sync::Arc;

use crate::decision::{Descriptor, Request};
use crate::rules::{Node, NodeFlags, NodeLimits, Unit, ValueMatcher};
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

#[tokio::test]
async fn costs_from_request_and_descriptor_hits_addend() {
    let fixture = one_rule("k", limit(5, Unit::Minute));
    let status = |code, remaining| lim(code, remaining, 60, 5, Unit::Minute, "");
    let with = |request_hits: u32, descriptor_hits: Option<u64>| Request {
        hits_addend: request_hits,
        ..req(vec![Descriptor {
            hits_addend: descriptor_hits,
            ..desc(&[("k", "v")])
        }])
    };
    check(
        &fixture,
        &[
            // 0 means 1.
            (with(0, None), OK, vec![status(OK, 4)]),
            (with(2, None), OK, vec![status(OK, 2)]),
            // The descriptor's own value wins, even 0 (a check).
            (with(9, Some(0)), OK, vec![status(OK, 2)]),
            (with(9, Some(1)), OK, vec![status(OK, 1)]),
            // More than is left: denied, nothing consumed.
            (with(2, None), OVER, vec![status(OVER, 0)]),
            (with(1, None), OK, vec![status(OK, 0)]),
            // A check with nothing left is OVER_LIMIT.
            (with(0, Some(0)), OVER, vec![status(OVER, 0)]),
        ],
    )
    .await;
    // A cost larger than the capacity can never pass, however large.
    fixture.clock.advance(60_000_000);
    check_one(&fixture, with(6, None), OVER, vec![status(OVER, 0)]).await;
    let huge = Request {
        hits_addend: 0,
        ..req(vec![
            Descriptor {
                hits_addend: Some(u64::MAX),
                ..desc(&[("k", "v")])
            },
            Descriptor {
                hits_addend: Some(u64::MAX),
                ..desc(&[("k", "v")])
            },
        ])
    };
    check(
        &fixture,
        &[
            (huge, OVER, vec![status(OVER, 0), status(OVER, 0)]),
            (with(1, None), OK, vec![status(OK, 4)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn descriptors_reaching_one_counter_add_their_costs() {
    let fixture = one_rule("k", limit(3, Unit::Minute));
    let status = |code, remaining| lim(code, remaining, 60, 3, Unit::Minute, "");
    let twice = || req(vec![desc(&[("k", "v")]), desc(&[("k", "v")])]);
    check(
        &fixture,
        &[
            (twice(), OK, vec![status(OK, 1), status(OK, 1)]),
            // Needs 2, has 1.
            (twice(), OVER, vec![status(OVER, 0), status(OVER, 0)]),
            (req(vec![desc(&[("k", "v")])]), OK, vec![status(OK, 0)]),
        ],
    )
    .await;
}

/// Past the few checks found by comparing keys, repeated counters are
/// found through a map: merged all the same, wherever they repeat.
#[tokio::test]
async fn many_descriptors_reaching_repeated_counters_are_merged() {
    let fixture = one_rule("k", limit(3, Unit::Minute));
    let status = |code, remaining| lim(code, remaining, 60, 3, Unit::Minute, "");
    // 12 distinct counters, then the first and the last again: 14 descriptors.
    let values: Vec<String> = (0..12).chain([0, 11]).map(|it| it.to_string()).collect();
    let request = || req(values.iter().map(|it| desc(&[("k", it)])).collect());
    let expect = |twice: u32, once: u32| {
        let mut statuses: Vec<_> = (0..12)
            .map(|it| match it {
                0 | 11 => status(OK, twice),
                _ => status(OK, once),
            })
            .collect();
        statuses.extend([status(OK, twice), status(OK, twice)]);
        statuses
    };
    check(
        &fixture,
        &[
            (request(), OK, expect(1, 2)),
            // The repeated counters need 2 and have 1: the whole request is denied.
            (
                request(),
                OVER,
                (0..12)
                    .map(|it| match it {
                        0 | 11 => status(OVER, 0),
                        _ => status(OK, 2),
                    })
                    .chain([status(OVER, 0), status(OVER, 0)])
                    .collect(),
            ),
            (req(vec![desc(&[("k", "5")])]), OK, vec![status(OK, 1)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn share_threshold_values_share_one_counter() {
    let shared = node(
        "path",
        ValueMatcher::Wildcard(Arc::from("/files/*")),
        limited(vec![limit(2, Unit::Hour)]),
    )
    .with_flags(NodeFlags {
        share_threshold: true,
        ..NodeFlags::default()
    });
    let own = node(
        "path",
        ValueMatcher::Wildcard(Arc::from("/own/*")),
        limited(vec![limit(2, Unit::Hour)]),
    );
    let fixture = fixture(rules(vec![shared, own]), options());
    let status = |code, remaining| lim(code, remaining, 3600, 2, Unit::Hour, "");
    let path = |value: &str| req(vec![desc(&[("path", value)])]);
    check(
        &fixture,
        &[
            (path("/files/a"), OK, vec![status(OK, 1)]),
            (path("/files/b"), OK, vec![status(OK, 0)]),
            (path("/files/c"), OVER, vec![status(OVER, 0)]),
            (path("/own/a"), OK, vec![status(OK, 1)]),
            (path("/own/b"), OK, vec![status(OK, 1)]),
        ],
    )
    .await;
}

/// `api_key`: 1 per minute, named `premium`.
fn premium_rule() -> Node {
    key_node(
        "api_key",
        vec![named(limit(1, Unit::Minute), "premium", &[])],
    )
}

#[tokio::test]
async fn replaced_limits_are_dropped_and_not_counted() {
    let fixture = fixture(
        rules(vec![
            premium_rule(),
            key_node(
                "path",
                vec![named(limit(10, Unit::Minute), "expensive", &["premium"])],
            ),
        ]),
        options(),
    );
    let premium = |code, remaining| lim(code, remaining, 60, 1, Unit::Minute, "premium");
    let expensive = |remaining| lim(OK, remaining, 60, 10, Unit::Minute, "expensive");
    let both = || req(vec![desc(&[("api_key", "k")]), desc(&[("path", "/x")])]);
    check(
        &fixture,
        &[
            (both(), OK, vec![ok_none(), expensive(9)]),
            (both(), OK, vec![ok_none(), expensive(8)]),
            // premium was never counted above.
            (
                req(vec![desc(&[("api_key", "k")])]),
                OK,
                vec![premium(OK, 0)],
            ),
            (
                req(vec![desc(&[("api_key", "k")])]),
                OVER,
                vec![premium(OVER, 0)],
            ),
            // Replaced even while exhausted: the replacing limit decides.
            (both(), OK, vec![ok_none(), expensive(7)]),
        ],
    )
    .await;
}

#[tokio::test]
async fn an_unlimited_rule_replaces_too_and_can_be_replaced() {
    let fixture = fixture(
        rules(vec![
            premium_rule(),
            node(
                "vip",
                ValueMatcher::Any,
                NodeLimits::Unlimited {
                    name: Some(Arc::from("vip")),
                    replaces: vec![Arc::from("premium")],
                },
            ),
            key_node(
                "boss",
                vec![named(limit(5, Unit::Minute), "boss", &["vip"])],
            ),
        ]),
        options(),
    );
    let unlimited = unlimited_brief();
    let vip = || req(vec![desc(&[("api_key", "k")]), desc(&[("vip", "v")])]);
    check(
        &fixture,
        &[
            (vip(), OK, vec![ok_none(), unlimited.clone()]),
            (vip(), OK, vec![ok_none(), unlimited]),
            // A replaced unlimited rule is dropped like any other.
            (
                req(vec![desc(&[("vip", "v")]), desc(&[("boss", "b")])]),
                OK,
                vec![ok_none(), lim(OK, 4, 60, 5, Unit::Minute, "boss")],
            ),
        ],
    )
    .await;
}
