//! Hostile descriptors through the real gRPC server, on both backends:
//! keys and values of any length and any bytes are decided, and only a
//! request no Envoy sends is an error (INVALID_ARGUMENT, never INTERNAL).

use crate::support;
use crate::support::redis::RedisServer;
use crate::support::request::descriptor;
use crate::support::service::{
    TestService, call, default_options, refusal, should_rate_limit_raw, start_on_memory,
};
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

const CONFIG: &str = r#"
domain: wire
descriptors:
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: file
    value: /f/*
    rate_limit: {unit: hour, requests_per_unit: 2}
"#;

/// Under the 64 KiB message cap with room for the rest of the request.
const HUGE: usize = 60_000;

fn desc(entries: &[(&[u8], &[u8])]) -> RateLimitDescriptor {
    descriptor(entries)
}

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    support::request::request("wire", descriptors)
}

/// `(code, limit_remaining)` of every status.
fn statuses(response: &RateLimitResponse) -> Vec<(i32, u32)> {
    response
        .statuses
        .iter()
        .map(|it| (it.code, it.limit_remaining))
        .collect()
}

/// `len` bytes: `fill`, then `last`.
fn long(len: usize, fill: u8, last: u8) -> Vec<u8> {
    let mut bytes = vec![fill; len];
    bytes[len - 1] = last;
    bytes
}

async fn memory_service() -> TestService {
    start_on_memory(CONFIG, default_options()).await
}

async fn redis_service(server: &RedisServer) -> TestService {
    support::redis::service(server, CONFIG).await
}

// === scenarios, run on each backend ===

/// Once `remote_address` is used up, adding a descriptor with an over-long,
/// non-UTF-8 or empty value (or key) changes nothing: OVER_LIMIT.
async fn exhausted_descriptor_stays_over_limit(service: &TestService) {
    let address: (&[u8], &[u8]) = (b"remote_address", b"203.0.113.9");
    let res = call(service, request(vec![desc(&[address])])).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    let res = call(service, request(vec![desc(&[address])])).await;
    assert_eq!(res.overall_code, Code::OverLimit as i32);

    let medium = long(1_100, b'a', b'a');
    let huge = long(HUGE, b'a', b'a');
    let long_key = long(2_000, b'k', b'k');
    let hostile: Vec<(&[u8], &[u8])> = vec![
        (b"path", &medium),
        (b"path", &huge),
        (b"path", b"/\xff\xfe"),
        (b"path", b""),
        (b"file", b"/f/\xff"),
        (b"unmatched\xff", b"x"),
        (&long_key, b"x"),
    ];
    for entry in hostile {
        let res = call(service, request(vec![desc(&[address]), desc(&[entry])])).await;
        assert_eq!(
            res.overall_code,
            Code::OverLimit as i32,
            "{:?}",
            (entry.0.len(), entry.1.len())
        );
        assert_eq!(res.statuses[0].code, Code::OverLimit as i32);
    }
}

/// Each over-long or non-UTF-8 value is counted on its own counter: the
/// key-only rule allows exactly 3 for each, and two long values sharing
/// their first 256 bytes (and more) are different counters.
async fn hostile_values_get_their_own_counters(service: &TestService) {
    let values: Vec<Vec<u8>> = vec![
        long(1_100, b'a', b'a'),
        long(1_100, b'a', b'b'),
        long(HUGE, b'a', b'a'),
        long(HUGE, b'a', b'b'),
        b"\xff".to_vec(),
        b"\xfe".to_vec(),
        b"\xff\xfe".to_vec(),
        Vec::new(),
    ];
    // Round by round, so values sharing a counter would run out early.
    for (round, expected) in [(0, (Code::Ok, 2)), (1, (Code::Ok, 1)), (2, (Code::Ok, 0))]
        .into_iter()
        .chain([(3, (Code::OverLimit, 0))])
    {
        for value in &values {
            let res = call(service, request(vec![desc(&[(b"path", value)])])).await;
            assert_eq!(
                statuses(&res),
                vec![(expected.0 as i32, expected.1)],
                "round {round}, value of {} bytes starting {:?}",
                value.len(),
                &value[..value.len().min(4)]
            );
        }
    }
    // A wildcard matches bytes that are not UTF-8, one counter per value.
    for value in [&b"/f/\xff"[..], b"/f/\xfe"] {
        for expected in [(Code::Ok, 1), (Code::Ok, 0), (Code::OverLimit, 0)] {
            let res = call(service, request(vec![desc(&[(b"file", value)])])).await;
            assert_eq!(
                statuses(&res),
                vec![(expected.0 as i32, expected.1)],
                "{value:?}"
            );
        }
    }
}

/// Every request shape no Envoy sends is INVALID_ARGUMENT with its reason.
async fn malformed_shapes_are_invalid_argument(service: &TestService) {
    let one = || desc(&[(b"path", b"x")]);
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (
            RateLimitRequest {
                domain: String::new(),
                ..request(vec![one()])
            },
            "empty domain",
        ),
        (request(vec![]), "no descriptors"),
        (
            request(vec![one(), desc(&[])]),
            "descriptor 1 has no entries",
        ),
        (
            request(vec![desc(&[(b"path", b"x"), (b"", b"x")])]),
            "descriptor 0, entry 1: empty entry key",
        ),
        (
            request(vec![one(); 65]),
            "too many descriptors: 65, at most 64",
        ),
        (
            request(vec![desc(&[(&b"path"[..], &b"x"[..]); 33])]),
            "descriptor 0 has too many entries: 33, at most 32",
        ),
    ];
    for (request, reason) in cases {
        let status = refusal(service, request, reason).await;
        assert_eq!(
            (status.code(), status.message()),
            (tonic::Code::InvalidArgument, reason)
        );
    }
    // At the bounds exactly, with a long value and bytes that are not
    // UTF-8 among the entries: decided.
    let mut descriptors = vec![desc(&[(&b"k"[..], &b"v"[..]); 32]); 64];
    descriptors[63].entries[31].value = long(1_100, b'v', b'v');
    descriptors[0].entries[0].value = b"\xff".to_vec();
    let res = call(service, request(descriptors)).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
}

/// A body that is not a `RateLimitRequest` is INVALID_ARGUMENT, not INTERNAL.
async fn garbage_bodies_are_invalid_argument(service: &TestService) {
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("a truncated field", vec![0x0a, 0x05, b'w']),
        ("an invalid tag", vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
        ("a domain that is not UTF-8", vec![0x0a, 0x01, 0xff]),
        ("text", b"not protobuf at all".to_vec()),
    ];
    for (what, body) in bodies {
        let status = should_rate_limit_raw(service.channel.clone(), body)
            .await
            .expect_err(what);
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{what}: {status:?}"
        );
        assert!(
            status.message().starts_with("malformed request"),
            "{what}: {status:?}"
        );
    }
    // The same path with a well-formed body is decided.
    let body = prost::Message::encode_to_vec(&request(vec![desc(&[(b"path", b"ok")])]));
    let answer = should_rate_limit_raw(service.channel.clone(), body)
        .await
        .expect("a decision");
    let res: RateLimitResponse = prost::Message::decode(answer.as_slice()).expect("a response");
    assert_eq!(res.overall_code, Code::Ok as i32);
}

// === memory ===

#[tokio::test]
async fn memory_exhausted_descriptor_stays_over_limit_with_hostile_values() {
    exhausted_descriptor_stays_over_limit(&memory_service().await).await;
}

#[tokio::test]
async fn memory_hostile_values_get_their_own_counters() {
    hostile_values_get_their_own_counters(&memory_service().await).await;
}

#[tokio::test]
async fn memory_malformed_shapes_are_invalid_argument() {
    malformed_shapes_are_invalid_argument(&memory_service().await).await;
}

#[tokio::test]
async fn memory_garbage_bodies_are_invalid_argument() {
    garbage_bodies_are_invalid_argument(&memory_service().await).await;
}

// === Redis ===

#[tokio::test]
async fn redis_exhausted_descriptor_stays_over_limit_with_hostile_values() {
    let server = RedisServer::start();
    exhausted_descriptor_stays_over_limit(&redis_service(&server).await).await;
}

#[tokio::test]
async fn redis_hostile_values_get_their_own_counters_under_short_keys() {
    let server = RedisServer::start();
    hostile_values_get_their_own_counters(&redis_service(&server).await).await;
    let mut conn = server.connection().await;
    let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    // 8 path values and 2 file values, each its own counter.
    assert_eq!(keys.len(), 10, "{keys:?}");
    for key in &keys {
        let text = std::str::from_utf8(key).expect("keys are text: other bytes are escaped");
        assert!(text.len() < 200, "{text}");
    }
    let digests = keys
        .iter()
        .filter(|it| it.windows(2).any(|pair| pair == b"%#"))
        .count();
    assert_eq!(digests, 4, "{keys:?}");
    assert!(
        keys.iter().any(|it| it.ends_with(b"path=%FF%FE")),
        "{keys:?}"
    );
}

#[tokio::test]
async fn redis_malformed_shapes_are_invalid_argument() {
    let server = RedisServer::start();
    malformed_shapes_are_invalid_argument(&redis_service(&server).await).await;
}

#[tokio::test]
async fn redis_garbage_bodies_are_invalid_argument() {
    let server = RedisServer::start();
    garbage_bodies_are_invalid_argument(&redis_service(&server).await).await;
}

// === reflection ===

/// The generated types read entries as bytes, but reflection serves the
/// published contract: `string`, so grpcurl builds requests as Envoy does.
#[tokio::test]
async fn reflection_still_shows_entries_as_strings() {
    use crate::support::reflection::v1;
    use prost_types::field_descriptor_proto::Type;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let service = memory_service().await;
    let symbol = "envoy.extensions.common.ratelimit.v3.RateLimitDescriptor";
    let requests = [MessageRequest::FileContainingSymbol(symbol.to_owned())];
    let mut inbound = v1::ask(service.channel.clone(), requests)
        .await
        .expect("reflection call");
    let res = v1::next(&mut inbound).await;
    let MessageResponse::FileDescriptorResponse(files) = res else {
        panic!("{res:?}");
    };
    let entry = files
        .file_descriptor_proto
        .iter()
        .map(|bytes| {
            <prost_types::FileDescriptorProto as prost::Message>::decode(bytes.as_slice())
                .expect("a file descriptor")
        })
        .filter(|file| file.package() == "envoy.extensions.common.ratelimit.v3")
        .flat_map(|file| file.message_type)
        .filter(|message| message.name() == "RateLimitDescriptor")
        .flat_map(|message| message.nested_type)
        .find(|message| message.name() == "Entry")
        .expect("RateLimitDescriptor.Entry is served");
    let types: Vec<(&str, Type)> = entry
        .field
        .iter()
        .map(|field| (field.name(), field.r#type()))
        .collect();
    assert_eq!(types, vec![("key", Type::String), ("value", Type::String)]);
}
