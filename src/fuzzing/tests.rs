//! The fuzz targets' twins: the same bodies, driven by proptest over
//! arbitrary bytes and over inputs shaped like the real thing, a few
//! hundred cases each, so CI runs every target on stable Rust.

use proptest::prelude::*;
use prost::Message as _;

use super::*;
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry as WireEntry, RateLimitOverride,
};

const FIXTURES: [&str; 3] = [
    include_str!("../../tests/fixtures/config/valid/basic.yaml"),
    include_str!("../../tests/fixtures/config/valid/wildcard.yaml"),
    include_str!("../../examples/config.yaml"),
];

fn cases(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// === config ===

/// A descriptor as YAML might write it, valid or not.
#[derive(Debug, Clone)]
struct YamlDescriptor {
    key: Option<&'static str>,
    value: Option<&'static str>,
    limit: Option<[Option<&'static str>; 4]>,
    extra: Option<(&'static str, &'static str)>,
    children: Vec<YamlDescriptor>,
}

fn pick(options: &'static [&'static str]) -> impl Strategy<Value = &'static str> {
    prop::sample::select(options)
}

fn yaml_descriptor() -> impl Strategy<Value = YamlDescriptor> {
    let limit = prop::option::of(
        (
            prop::option::of(pick(&[
                "second",
                "Minute",
                "hour",
                "week",
                "fortnight",
                "''",
            ])),
            prop::option::of(pick(&["0", "1", "5", "-1", "4294967296", "x", "[1]"])),
            prop::option::of(pick(&[
                "sliding_window_log",
                "token_bucket",
                "gcra",
                "fixed_window",
                "sliding_window_counter",
                "bogus",
            ])),
            prop::option::of(pick(&["1", "0", "3", "null", "{a: 1}"])),
        )
            .prop_map(|(unit, rpu, algorithm, burst)| [unit, rpu, algorithm, burst]),
    );
    let leaf = (
        prop::option::of(pick(&["k", "key1", "remote_address", "''", "1", "[a]"])),
        prop::option::of(pick(&["v", "foo*", "*", "a*b*c", "''", "null"])),
        limit,
        prop::option::of((
            pick(&[
                "shadow_mode",
                "unlimited",
                "share_threshold",
                "replaces",
                "bogus",
            ]),
            pick(&["true", "no", "7", "[{name: n}]", "{}"]),
        )),
    )
        .prop_map(|(key, value, limit, extra)| YamlDescriptor {
            key,
            value,
            limit,
            extra,
            children: Vec::new(),
        });
    leaf.prop_recursive(4, 32, 4, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..4)).prop_map(|(mut node, children)| {
            node.children = children;
            node
        })
    })
}

fn render(descriptors: &[YamlDescriptor], indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    for it in descriptors {
        out.push_str(&format!("{pad}- key: {}\n", it.key.unwrap_or("null")));
        if let Some(value) = it.value {
            out.push_str(&format!("{pad}  value: {value}\n"));
        }
        if let Some([unit, rpu, algorithm, burst]) = it.limit {
            out.push_str(&format!("{pad}  rate_limit:\n"));
            for (name, field) in [
                ("unit", unit),
                ("requests_per_unit", rpu),
                ("algorithm", algorithm),
                ("burst", burst),
            ] {
                if let Some(field) = field {
                    out.push_str(&format!("{pad}    {name}: {field}\n"));
                }
            }
        }
        if let Some((name, value)) = it.extra {
            out.push_str(&format!("{pad}  {name}: {value}\n"));
        }
        if !it.children.is_empty() {
            out.push_str(&format!("{pad}  descriptors:\n"));
            render(&it.children, indent + 4, out);
        }
    }
}

fn config_text() -> impl Strategy<Value = String> {
    (
        pick(&["d", "''", "other", "[x]"]),
        prop::option::of(pick(&["gcra", "fixed_window", "nope"])),
        prop::collection::vec(yaml_descriptor(), 0..6),
    )
        .prop_map(|(domain, default_algorithm, descriptors)| {
            let mut out = format!("domain: {domain}\n");
            if let Some(algorithm) = default_algorithm {
                out.push_str(&format!("default_algorithm: {algorithm}\n"));
            }
            out.push_str("descriptors:\n");
            render(&descriptors, 2, &mut out);
            out
        })
}

/// A fixture with a run of its bytes replaced.
fn mangled_fixture() -> impl Strategy<Value = Vec<u8>> {
    (
        0..FIXTURES.len(),
        any::<prop::sample::Index>(),
        0usize..16,
        prop::collection::vec(prop::sample::select(&b"[]{}*&!|>-:?,'\"\n #0a"[..]), 0..8),
    )
        .prop_map(|(fixture, at, removed, inserted)| {
            let mut text = FIXTURES[fixture].as_bytes().to_vec();
            let at = at.index(text.len());
            let end = (at + removed).min(text.len());
            text.splice(at..end, inserted);
            text
        })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn config_target_takes_any_bytes(mode: u8, text in prop::collection::vec(any::<u8>(), 0..256)) {
        config(&[&[mode][..], &text].concat());
    }

    #[test]
    fn config_target_takes_generated_configs(mode: u8, text in config_text()) {
        config(&[&[mode][..], text.as_bytes()].concat());
    }

    #[test]
    fn config_target_takes_mangled_fixtures(mode: u8, text in mangled_fixture()) {
        config(&[&[mode][..], &text].concat());
    }
}

/// Every fixture loads through the target, alone and in a directory.
#[test]
fn config_target_accepts_the_fixtures() {
    for fixture in FIXTURES {
        for mode in [0, 1, 0x80, 0x81] {
            config(&[&[mode][..], fixture.as_bytes()].concat());
        }
        config::parse_str(CONFIG_FILE, fixture, &config_options(0)).expect("fixture loads");
    }
}

// === request ===

fn wire_request() -> impl Strategy<Value = RateLimitRequest> {
    let entry = (
        pick(&["key1", "subkey1", "key2", "wild", "", "k"]),
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..4),
            pick(&["value1", "subvalue1", "value2", "foo", "foox", ""])
                .prop_map(|it| it.as_bytes().to_vec()),
        ],
    )
        .prop_map(|(key, value)| WireEntry {
            key: key.as_bytes().to_vec(),
            value,
        });
    let descriptor = (
        prop::collection::vec(entry, 0..4),
        prop::option::of((any::<u32>(), -1i32..9)),
        prop::option::of(prop::num::u64::ANY),
    )
        .prop_map(|(entries, limit, hits_addend)| RateLimitDescriptor {
            entries,
            limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                requests_per_unit,
                unit,
            }),
            hits_addend,
        });
    (
        pick(&["test-domain", "wildcards", "", "unknown"]),
        prop::collection::vec(descriptor, 0..6),
        any::<u32>(),
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain: domain.to_owned(),
            descriptors,
            hits_addend,
        })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn request_target_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        request(&bytes);
    }

    #[test]
    fn request_target_takes_generated_requests(wire_request in wire_request()) {
        request(&wire_request.encode_to_vec());
    }
}

/// The bounds the target restates are the limiter's: a request with 65
/// descriptors is refused, one with 64 decided.
#[test]
fn request_target_agrees_on_the_descriptor_bound() {
    let descriptor = RateLimitDescriptor {
        entries: vec![WireEntry {
            key: b"key2".to_vec(),
            value: b"value2".to_vec(),
        }],
        limit: None,
        hits_addend: None,
    };
    for count in [MAX_DESCRIPTORS, MAX_DESCRIPTORS + 1] {
        let wire_request = RateLimitRequest {
            domain: "test-domain".to_owned(),
            descriptors: vec![descriptor.clone(); count],
            hits_addend: 0,
        };
        assert_eq!(
            within_bounds(&wire::from_wire(wire_request.clone())),
            count == MAX_DESCRIPTORS
        );
        request(&wire_request.encode_to_vec());
    }
}

// === decision ===

fn limit_spec(unit: Unit) -> impl Strategy<Value = ScenarioLimit> {
    (prop::sample::select(&Algorithm::ALL[..]), 0u32..6).prop_map(move |(algorithm, requests)| {
        ScenarioLimit {
            algorithm,
            requests,
            unit,
        }
    })
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let config = (
        limit_spec(Unit::Second),
        limit_spec(Unit::Second),
        limit_spec(Unit::Minute),
        limit_spec(Unit::Second),
    )
        .prop_map(|(a, b0, b1, c)| ScenarioConfig { a, b: [b0, b1], c });
    let descriptor = (
        prop::sample::select(
            &[
                ScenarioRule::A,
                ScenarioRule::B,
                ScenarioRule::C,
                ScenarioRule::Unmatched,
            ][..],
        ),
        0u8..3,
        prop::option::of(0u64..5),
    )
        .prop_map(|(target, value, cost)| StepDescriptor {
            target,
            value,
            cost,
        });
    let step = (
        prop_oneof![0u64..1_300_000, prop::sample::select(&ADVANCES[..])],
        0u32..4,
        prop::collection::vec(descriptor, 1..5),
    )
        .prop_map(|(advance_us, hits_addend, descriptors)| ScenarioStep {
            advance_us,
            hits_addend,
            descriptors,
        });
    (config, prop::collection::vec(step, 0..MAX_STEPS))
        .prop_map(|(config, steps)| Scenario { config, steps })
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn decision_target_takes_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        decision(&bytes);
    }

    #[test]
    fn decision_target_holds_its_invariants_on_generated_scenarios(scenario in scenario()) {
        run_scenario(&scenario);
    }
}

/// The invariants can fail: a sliding log of 2 per second that allowed 3
/// in one second is caught.
#[test]
#[should_panic(expected = "allowed 3 within one window of 2 per second")]
fn the_window_check_catches_an_excess() {
    let spec = ScenarioLimit {
        algorithm: Algorithm::SlidingWindowLog,
        requests: 2,
        unit: Unit::Second,
    };
    check_window(
        spec,
        &[(T0, 1), (T0 + 500_000, 1), (T0 + 999_999, 1)],
        T0 + 999_999,
    );
}

/// Entries a whole window old no longer count, for the log; the fixed
/// window starts over at its boundary.
#[test]
fn the_window_check_forgets_what_left_the_window() {
    let log = ScenarioLimit {
        algorithm: Algorithm::SlidingWindowLog,
        requests: 2,
        unit: Unit::Second,
    };
    check_window(
        log,
        &[(T0, 1), (T0 + 1, 1), (T0 + 1_000_000, 1)],
        T0 + 1_000_000,
    );
    let fixed = ScenarioLimit {
        algorithm: Algorithm::FixedWindow,
        ..log
    };
    check_window(
        fixed,
        &[(T0 + 999_998, 1), (T0 + 999_999, 1), (T0 + 1_000_000, 1)],
        T0 + 1_000_000,
    );
}

/// A scenario decoded from bytes has the documented shape.
#[test]
fn scenarios_decode_from_any_bytes() {
    assert_eq!(Scenario::decode(&[]).steps, Vec::new());
    let scenario = Scenario::decode(&[0x21, 0x10, 0x30, 0x44, 5, 0x03, 0x11, 0x12, 0x13, 0x14]);
    assert_eq!(scenario.config.a.requests, 2);
    assert_eq!(scenario.config.a.algorithm, Algorithm::TokenBucket);
    assert_eq!(scenario.config.b[1].unit, Unit::Minute);
    assert_eq!(scenario.steps.len(), 1);
    assert_eq!(scenario.steps[0].advance_us, 50_000);
    assert_eq!(scenario.steps[0].descriptors.len(), 4);
    assert_eq!(scenario.steps[0].descriptors[0].cost, Some(0));
}
