use super::*;
use crate::algorithms::{Algorithm, Check, LimitParams, Mode, Outcome, Verdict};
use crate::backends::{Error, KeyedCheck, keys};

/// The quoted names of the Lua table `local {name} = { ... }` in `source`.
fn lua_table_in(source: &str, name: &str) -> Vec<String> {
    let start = format!("local {name} = {{");
    let (_, rest) = source
        .split_once(&start)
        .unwrap_or_else(|| panic!("the script declares {name}"));
    let (body, _) = rest.split_once('}').expect("the table closes");
    body.split(',')
        .map(str::trim)
        .filter(|it| !it.is_empty())
        .map(|it| it.trim_matches('\'').to_owned())
        .collect()
}

fn lua_table(name: &str) -> Vec<String> {
    lua_table_in(DECIDE_LUA, name)
}

fn names<T>(fields: &[Field<T>]) -> Vec<String> {
    fields.iter().map(|it| it.name.to_owned()).collect()
}

#[test]
fn the_script_reads_the_fields_of_the_layout_in_order() {
    assert_eq!(lua_table("HEADER_FIELDS"), names(&HEADER_FIELDS));
    assert_eq!(lua_table("LIMIT_FIELDS"), names(&LIMIT_FIELDS));
}

#[test]
fn the_batch_layout_is_read_by_the_same_names() {
    assert_eq!(lua_table("BATCH_FIELDS"), names(&BATCH_FIELDS));
    assert_eq!(lua_table("REQUEST_FIELDS"), names(&REQUEST_FIELDS));
}

#[test]
fn a_batch_reply_is_one_section_per_request() {
    let verdicts: Vec<_> = parse_batch_reply(&[1, 3, 3, 10, 0, 0, 0, 7, 1, 2, 9], &[1, 2])
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(verdicts.len(), 2);
    assert!(verdicts[0].allowed);
    assert!(!verdicts[1].allowed);
    assert!(verdicts[0].outcomes[0].consumed);
    assert!(verdicts[1].outcomes[1].has_room && !verdicts[1].outcomes[1].consumed);
    assert_eq!(verdicts[1].outcomes[1].remaining, 2);
    assert!(parse_batch_reply(&[1, 3, 3, 10], &[1, 1]).is_err());
    assert!(parse_batch_reply(&[1, 3, 3, 10, 1], &[1]).is_err());
}

#[test]
fn a_refused_batch_member_gets_its_own_error_and_the_others_their_verdicts() {
    // Request 1 refused at its limit 2, request 2 decided, request 3
    // failed while deciding, request 4 refused at its header.
    let answers = parse_batch_reply(&[-1, 2, 1, 3, 4, 10, -1, -1, -1, 0], &[2, 1, 1, 3]).unwrap();
    assert_eq!(answers.len(), 4);
    let message = |it: &Result<Verdict, Error>| it.as_ref().unwrap_err().to_string();
    assert!(message(&answers[0]).contains("bad parameters for limit 2"));
    let verdict = answers[1].as_ref().unwrap();
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes[0].remaining, 4);
    assert!(message(&answers[2]).contains("failed while deciding"));
    assert!(message(&answers[3]).contains("bad request header"));
    // The key of its limit 2 holds a layout the script refuses.
    let answers = parse_batch_reply(&[-1, -3], &[2]).unwrap();
    assert!(message(&answers[0]).contains("stored state of limit 2 is in a layout"));
    // A reason no script answers, or a refusal cut short, is no reply.
    assert!(parse_batch_reply(&[-1, 3], &[2]).is_err());
    assert!(parse_batch_reply(&[-1, -3], &[1]).is_err());
    assert!(parse_batch_reply(&[-1], &[1]).is_err());
}

#[test]
fn a_reply_is_read_as_signed_big_endian_64_bit_integers() {
    let mut packed = Vec::new();
    for value in [1_i64, 3, -2, 1_764_899_000_123_456] {
        packed.extend_from_slice(&value.to_be_bytes());
    }
    assert_eq!(
        reply_integers(redis::Value::BulkString(packed.clone())).unwrap(),
        [1, 3, -2, 1_764_899_000_123_456]
    );
    packed.pop();
    assert!(reply_integers(redis::Value::BulkString(packed)).is_err());
    // The integers an older script answered with are not read as a reply.
    let array = redis::Value::Array(vec![redis::Value::Int(1), redis::Value::Int(3)]);
    assert!(reply_integers(array).is_err());
    assert!(reply_integers(redis::Value::Nil).is_err());
}

#[test]
fn the_library_is_named_by_its_digest_and_registers_each_entry() {
    let library = library();
    let digest = library.name.strip_prefix("throttlegate_").unwrap();
    assert_eq!(digest.len(), 12);
    assert!(digest.chars().all(|it| it.is_ascii_hexdigit()));
    assert!(
        library
            .source
            .starts_with(&format!("#!lua name={}\n", library.name))
    );
    for function in [&library.decide, &library.decide_batch, &library.refund] {
        assert!(function.ends_with(digest));
        assert!(
            library
                .source
                .contains(&format!("register_function('{function}'"))
        );
    }
}

#[test]
fn the_refund_script_reads_the_fields_of_its_layout_in_order() {
    assert_eq!(
        lua_table_in(REFUND_LUA, "REFUND_HEADER_FIELDS"),
        names(&REFUND_HEADER_FIELDS)
    );
    assert_eq!(
        lua_table_in(REFUND_LUA, "REFUND_FIELDS"),
        names(&REFUND_FIELDS)
    );
}

#[test]
fn argv_is_the_header_then_each_limit_in_field_order() {
    let params = LimitParams::new(Algorithm::TokenBucket, 10, 60_000_000, Some(20)).unwrap();
    let check = Check {
        params,
        cost: 3,
        mode: Mode::Quota,
    };
    let rate = params.rate();
    let header = HeaderArgs {
        now_us: None,
        grace_ms: 7,
        receipts: false,
    };
    let limit = ScriptLimit::of(&check);
    let args = argv(&header, &[limit]);
    assert_eq!(
        args,
        [Arg::Text(""), Arg::Int(7), Arg::Int(0), Arg::Limit(limit)]
    );
    // A limit is one argument: its fields joined by ':'.
    let mut cmd = redis::Cmd::new();
    cmd.arg(args[3]);
    let written: Vec<_> = cmd
        .args_iter()
        .map(|it| match it {
            redis::Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
            _ => panic!("a limit is a plain argument"),
        })
        .collect();
    assert_eq!(
        written,
        [format!(
            "token_bucket:10:60000000:20:{}:{}:3:quota:if_allowed",
            rate.per_us, rate.scale
        )]
    );
}

#[test]
fn replies_are_checked() {
    let verdict = parse_reply(&[1, 3, 3, 10], 1).unwrap();
    assert!(verdict.allowed);
    assert_eq!(
        verdict.outcomes[0],
        Outcome {
            has_room: true,
            consumed: true,
            remaining: 3,
            overdraft: 0,
            reset_us: 10
        }
    );
    let verdict = parse_reply(&[0, 1, 3, 10, 0, 0, 7], 2).unwrap();
    assert!(verdict.outcomes[0].has_room && !verdict.outcomes[0].consumed);
    assert!(!verdict.outcomes[1].has_room && !verdict.outcomes[1].consumed);
    assert!(parse_reply(&[1, 3, 3], 1).is_err());
    assert!(parse_reply(&[2, 3, 3, 10], 1).is_err());
    assert!(
        parse_reply(&[1, 2, 3, 10], 1).is_err(),
        "consumed without room"
    );
    assert!(parse_reply(&[1, 4, 3, 10], 1).is_err());
    // A negative remaining is the overdraft: nothing remains.
    let verdict = parse_reply(&[0, 0, -3, 10], 1).unwrap();
    assert_eq!(
        (verdict.outcomes[0].remaining, verdict.outcomes[0].overdraft),
        (0, 3)
    );
    assert!(parse_reply(&[0, 0, i64::MIN, 10], 1).is_err());
    assert!(parse_reply(&[1, 3, 3, -10], 1).is_err());
}

#[test]
fn receipts_follow_each_limit_when_asked_for() {
    let (verdict, receipts) =
        decode_reply_with_receipts(&[1, 3, 3, 10, 40, 2, 5, 0, 1, 9, 0, 0, 0, 9, 0], 2).unwrap();
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes[1].remaining, 9);
    assert_eq!(
        receipts,
        [
            Receipt {
                at_us: 40,
                units: 2,
            },
            Receipt::NONE
        ]
    );
    let (provisional, _) =
        decode_provisional(&[1, 3, 3, 10, 40, 2, 5, 0, 1, 9, 0, 0, 0, 9, 0], 2).unwrap();
    assert_eq!(provisional[0].if_denied.remaining, 5);
    assert!(!provisional[0].if_denied.consumed);
    assert_eq!(provisional[1].if_denied, provisional[1].if_allowed);
    assert!(decode_reply_with_receipts(&[1, 3, 3, 10], 1).is_err());
    assert!(decode_reply_with_receipts(&[1, 3, 3, 10, 40, -2, 3, 0], 1).is_err());
}

#[test]
fn a_refund_sends_only_the_limits_with_something_to_give_back() {
    use crate::backends::{CounterKey, KeyEntry, KeyValue};
    let keyed = |window_s: u64| {
        let params = LimitParams::new(Algorithm::FixedWindow, 10, window_s * 1_000_000, None);
        KeyedCheck {
            key: CounterKey {
                domain: "d".into(),
                rule: "r".into(),
                algorithm: Algorithm::FixedWindow,
                window_s,
                is_override: false,
                entries: vec![KeyEntry {
                    key: "k".into(),
                    value: KeyValue::Value("v".into()),
                }],
            },
            check: Check {
                params: params.unwrap(),
                cost: 2,
                mode: Mode::Enforce,
            },
        }
    };
    let checks = [keyed(1), keyed(60)];
    let taken = Receipt {
        at_us: 60_000_000,
        units: 2,
    };
    let header = RefundHeader { now_us: Some(7) };
    let call = refund_args("tg", &header, &checks, &[Receipt::NONE, taken])
        .unwrap()
        .expect("one limit to refund");
    assert_eq!(call.keys, [keys::encode("tg", &checks[1].key)]);
    assert_eq!(
        call.argv,
        [
            Arg::Int(7),
            Arg::Text("fixed_window"),
            Arg::Int(60_000_000),
            Arg::Int(10),
            Arg::Int(1),
            Arg::Int(6_000_000),
            Arg::Int(60_000_000),
            Arg::Int(2),
        ]
    );
    let none = refund_args("tg", &header, &checks, &[Receipt::NONE, Receipt::NONE]);
    assert!(none.unwrap().is_none());
    assert!(refund_args("tg", &header, &checks, &[taken]).is_err());
}
