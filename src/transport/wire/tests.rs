use super::*;

#[test]
fn override_units_map_and_unknown_is_none() {
    let cases = [
        (RateLimitUnit::Unknown as i32, None),
        (RateLimitUnit::Second as i32, Some(Unit::Second)),
        (RateLimitUnit::Minute as i32, Some(Unit::Minute)),
        (RateLimitUnit::Hour as i32, Some(Unit::Hour)),
        (RateLimitUnit::Day as i32, Some(Unit::Day)),
        (RateLimitUnit::Month as i32, Some(Unit::Month)),
        (RateLimitUnit::Year as i32, Some(Unit::Year)),
        (99, None),
    ];
    for (wire, expected) in cases {
        assert_eq!(override_unit(wire), expected, "{wire}");
    }
}

/// JSON accepts the names and numbers of `envoy.type.v3.RateLimitUnit`
/// and nothing else: WEEK is a response unit only.
#[test]
fn override_units_by_name_and_number() {
    let known = [
        ("UNKNOWN", None),
        ("SECOND", Some(Unit::Second)),
        ("MINUTE", Some(Unit::Minute)),
        ("HOUR", Some(Unit::Hour)),
        ("DAY", Some(Unit::Day)),
        ("MONTH", Some(Unit::Month)),
        ("YEAR", Some(Unit::Year)),
    ];
    for (number, (name, unit)) in (0u64..).zip(known) {
        assert_eq!(override_unit_named(name), Ok(unit), "{name}");
        assert_eq!(override_unit_numbered(number), Ok(unit), "{number}");
    }
    for name in ["WEEK", "minute", ""] {
        let err = override_unit_named(name).unwrap_err();
        assert_eq!(err.to_string(), format!("unknown unit '{name}'"));
    }
    for number in [7, 99, u64::MAX] {
        let err = override_unit_numbered(number).unwrap_err();
        assert_eq!(err.to_string(), format!("unknown unit {number}"));
    }
}

fn arbitrary_decision() -> impl proptest::strategy::Strategy<Value = decision::Decision> {
    use proptest::prelude::*;
    let code = prop_oneof![Just(decision::Code::Ok), Just(decision::Code::OverLimit)];
    let limit = (
        prop_oneof![Just(0u32), Just(1), Just(127), Just(128), any::<u32>()],
        proptest::sample::select(Unit::ALL.to_vec()),
        prop_oneof![Just(String::new()), "[a-z\\u{e9}]{1,40}", ".{0,300}"],
    )
        .prop_map(|(requests_per_unit, unit, name)| decision::CurrentLimit {
            requests_per_unit,
            unit,
            name: name.into(),
        });
    let seconds = prop_oneof![
        Just(0u64),
        Just(1),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        any::<u64>()
    ];
    let status = (
        code.clone(),
        proptest::option::of(limit),
        prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()],
        proptest::option::of(seconds),
    )
        .prop_map(
            |(code, current_limit, limit_remaining, duration_until_reset_s)| decision::Status {
                code,
                current_limit,
                limit_remaining,
                duration_until_reset_s,
            },
        );
    let header = (".{0,20}", ".{0,200}");
    (
        code,
        proptest::collection::vec(status, 0..70),
        proptest::collection::vec(header, 0..5),
    )
        .prop_map(|(overall, statuses, headers)| decision::Decision {
            overall,
            statuses,
            headers,
        })
}

proptest::proptest! {
    /// The direct encoding is byte for byte prost's encoding of the
    /// message `to_wire` builds, and says its length right.
    #[test]
    fn encode_writes_what_prost_writes(decision in arbitrary_decision()) {
        use prost::Message;
        let expected = to_wire(decision.clone()).encode_to_vec();
        let mut written = Vec::new();
        encode(&decision, &mut written);
        proptest::prop_assert_eq!(encoded_len(&decision), written.len());
        proptest::prop_assert_eq!(written, expected);
    }
}

#[test]
fn response_units_and_codes_are_named_as_envoy_names_them() {
    let names: Vec<&str> = Unit::ALL.into_iter().map(unit_name).collect();
    assert_eq!(
        names,
        ["SECOND", "MINUTE", "HOUR", "DAY", "WEEK", "MONTH", "YEAR"]
    );
    assert_eq!(code_name(decision::Code::Ok), "OK");
    assert_eq!(code_name(decision::Code::OverLimit), "OVER_LIMIT");
}

#[test]
fn descriptor_hits_addend_presence_is_kept() {
    let request = rls::RateLimitRequest {
        domain: "d".to_owned(),
        hits_addend: 3,
        descriptors: vec![
            common::RateLimitDescriptor {
                entries: vec![common::rate_limit_descriptor::Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: None,
                hits_addend: Some(0),
            },
            common::RateLimitDescriptor::default(),
        ],
    };
    let res = from_wire(request);
    assert_eq!(res.hits_addend, 3);
    assert_eq!(res.descriptors[0].hits_addend, Some(0));
    assert_eq!(res.descriptors[0].entries[0].key, b"k");
    assert_eq!(res.descriptors[1].hits_addend, None);
}

#[test]
fn entries_that_are_not_utf8_decode_and_keep_their_bytes() {
    use prost::Message;
    // What Envoy sends for a header value with byte 0xFF: the wire form
    // of `string` and `bytes` is the same.
    let entry = common::rate_limit_descriptor::Entry {
        key: b"path".to_vec(),
        value: b"/\xff\xfe".to_vec(),
    };
    let request = rls::RateLimitRequest {
        domain: "d".to_owned(),
        descriptors: vec![common::RateLimitDescriptor {
            entries: vec![entry],
            limit: None,
            hits_addend: None,
        }],
        hits_addend: 0,
    };
    let wire = request.encode_to_vec();
    let decoded = rls::RateLimitRequest::decode(wire.as_slice()).expect("decodes");
    let res = from_wire(decoded);
    assert_eq!(res.descriptors[0].entries[0].value, b"/\xff\xfe");
}
