//! The real gRPC server on an ephemeral port, driven by a tonic client.

use std::sync::Arc;
use std::time::Duration;

use tonic_health::pb::health_check_response::ServingStatus;

use crate::support;
use crate::support::request::descriptor;
use crate::support::service::{
    HEALTH_SERVICES, TestService, call, default_options, memory_backend, refusal, rules_from,
    start_on_memory, start_service_on_threads, start_with_config,
};
use throttlegate::decision::Options;
use throttlegate::metrics::Metrics;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use throttlegate::proto::envoy::r#type::v3::RateLimitUnit;
use throttlegate::testing::FakeBackend;

const CONFIG: &str = r#"
domain: test
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_user}
  - key: health
    rate_limit: {unlimited: true}
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 1, name: premium}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 10, name: expensive, replaces: [{name: premium}]}
  - key: cost
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: parent
    descriptors:
      - key: child
        rate_limit: {unit: hour, requests_per_unit: 2}
"#;

async fn start() -> TestService {
    start_with(default_options()).await
}

async fn start_with(options: Options) -> TestService {
    start_on_memory(CONFIG, options).await
}

fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    descriptor(entries)
}

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    support::request::request("test", descriptors)
}

fn limited(
    code: Code,
    remaining: u32,
    reset_s: i64,
    rpu: u32,
    unit: Unit,
    name: &str,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(RateLimit {
            requests_per_unit: rpu,
            unit: unit as i32,
            name: name.to_owned(),
        }),
        limit_remaining: remaining,
        duration_until_reset: Some(prost_types::Duration {
            seconds: reset_s,
            nanos: 0,
        }),
    }
}

/// [`limited`] by a limit of `rpu` a minute, reset in a minute.
fn per_minute(code: Code, remaining: u32, rpu: u32, name: &str) -> DescriptorStatus {
    limited(code, remaining, 60, rpu, Unit::Minute, name)
}

fn ok_without_limit() -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        ..Default::default()
    }
}

fn headers(response: &RateLimitResponse) -> Vec<(&str, &str)> {
    response
        .response_headers_to_add
        .iter()
        .map(|it| (it.key.as_str(), it.value.as_str()))
        .collect()
}

#[tokio::test]
async fn ok_then_over_limit_after_n() {
    let service = start().await;
    let user = || request(vec![desc(&[("user", "alice")])]);
    for remaining in [2, 1, 0] {
        let res = call(&service, user()).await;
        assert_eq!(res.overall_code, Code::Ok as i32);
        assert_eq!(
            res.statuses,
            vec![per_minute(Code::Ok, remaining, 3, "per_user")]
        );
    }
    let res = call(&service, user()).await;
    assert_eq!(res.overall_code, Code::OverLimit as i32);
    assert_eq!(
        res.statuses,
        vec![per_minute(Code::OverLimit, 0, 3, "per_user")]
    );
    assert_eq!(
        headers(&res),
        vec![
            ("RateLimit-Limit", "3"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "60"),
            ("Retry-After", "60"),
        ]
    );
}

#[tokio::test]
async fn unknown_domain_no_rule_and_unlimited_are_ok() {
    let service = start().await;
    let unknown = RateLimitRequest {
        domain: "nope".to_owned(),
        ..request(vec![desc(&[("user", "alice")]), desc(&[("x", "y")])])
    };
    let res = call(&service, unknown).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    assert_eq!(res.statuses, vec![ok_without_limit(), ok_without_limit()]);
    assert!(res.response_headers_to_add.is_empty());

    // No rule: nothing at this key, and a node above the rule's depth.
    let res = call(
        &service,
        request(vec![desc(&[("nothing", "1")]), desc(&[("parent", "p")])]),
    )
    .await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    assert_eq!(res.statuses, vec![ok_without_limit(), ok_without_limit()]);
    assert!(res.response_headers_to_add.is_empty());

    let res = call(&service, request(vec![desc(&[("health", "x")])])).await;
    assert_eq!(
        res.statuses,
        vec![DescriptorStatus {
            limit_remaining: u32::MAX,
            ..ok_without_limit()
        }]
    );
    assert!(res.response_headers_to_add.is_empty());

    // A nested rule matches a descriptor of the right depth.
    let res = call(
        &service,
        request(vec![desc(&[("parent", "p"), ("child", "c")])]),
    )
    .await;
    assert_eq!(
        res.statuses,
        vec![limited(Code::Ok, 1, 3600, 2, Unit::Hour, "")]
    );
}

#[tokio::test]
async fn invalid_requests_are_invalid_argument() {
    let service = start().await;
    let many: Vec<(&str, &str)> = vec![("user", "x"); 33];
    let with_unknown_unit = RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: 5,
            unit: RateLimitUnit::Unknown as i32,
        }),
        ..desc(&[("user", "x")])
    };
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (
            RateLimitRequest {
                domain: String::new(),
                ..request(vec![desc(&[("user", "x")])])
            },
            "empty domain",
        ),
        (request(vec![]), "no descriptors"),
        (request(vec![desc(&[])]), "no entries"),
        (request(vec![desc(&[("", "x")])]), "empty entry key"),
        (
            request(vec![desc(&[("user", "x")]); 65]),
            "too many descriptors",
        ),
        (request(vec![desc(&many)]), "too many entries"),
    ];
    for (request, reason) in cases {
        let status = refusal(&service, request, reason).await;
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "{reason}: {status:?}"
        );
        assert!(status.message().contains(reason), "{reason}: {status:?}");
    }
    // Nothing was counted by the refused requests.
    let res = call(&service, request(vec![desc(&[("user", "x")])])).await;
    assert_eq!(res.statuses[0].limit_remaining, 2);
    // An override whose unit is UNKNOWN enforces nothing, so it is ignored
    // and the rules decide (an error would let the request through Envoy).
    let res = call(&service, request(vec![with_unknown_unit])).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    assert_eq!(res.statuses[0].limit_remaining, 1);
    assert_eq!(
        res.statuses[0]
            .current_limit
            .as_ref()
            .map(|it| it.requests_per_unit),
        Some(3)
    );
}

#[tokio::test]
async fn oversized_message_is_refused_and_the_server_carries_on() {
    let service = start().await;
    let huge = "v".repeat(70 * 1024);
    let status = refusal(
        &service,
        request(vec![desc(&[("user", &huge)])]),
        "a message over 64 KiB",
    )
    .await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let res = call(&service, request(vec![desc(&[("user", "alice")])])).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    assert_eq!(res.statuses[0].limit_remaining, 2);
}

/// Paths the server has no service or method for are UNIMPLEMENTED, and
/// the connection carries on.
#[tokio::test]
async fn unknown_services_and_methods_are_unimplemented() {
    let service = start().await;
    for path in [
        "/no.such.Service/Method",
        "/envoy.service.ratelimit.v3.RateLimitService/NoSuchMethod",
        "/envoy.service.ratelimit.v3.RateLimitService/",
        "/grpc.health.v1.Health/NoSuchMethod",
        "/ShouldRateLimit",
    ] {
        let mut client = tonic::client::Grpc::new(service.channel.clone());
        client.ready().await.expect("ready");
        let status = client
            .unary(
                tonic::Request::new(request(vec![desc(&[("user", "alice")])])),
                tonic::codegen::http::uri::PathAndQuery::from_static(path),
                tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default(),
            )
            .await
            .expect_err(path);
        assert_eq!(
            status.code(),
            tonic::Code::Unimplemented,
            "{path}: {status:?}"
        );
    }
    let res = call(&service, request(vec![desc(&[("user", "alice")])])).await;
    assert_eq!(res.statuses[0].limit_remaining, 2);
}

#[tokio::test]
async fn health_is_serving_for_every_service_name() {
    let service = start().await;
    for name in HEALTH_SERVICES {
        assert_eq!(
            service.health(name).await.unwrap(),
            ServingStatus::Serving,
            "{name:?}"
        );
    }
}

/// Waits until every service name reports `expected`, for at most 5 s each.
async fn wait_for_every_health(service: &TestService, expected: ServingStatus) {
    for name in HEALTH_SERVICES {
        service
            .wait_for_health(name, expected, Duration::from_secs(5))
            .await;
    }
}

#[tokio::test]
async fn health_follows_the_backend_and_failures_are_unavailable() {
    let backend = Arc::new(FakeBackend::failing());
    let service = start_with_config(CONFIG, backend.clone(), default_options()).await;
    for name in HEALTH_SERVICES {
        assert_eq!(service.health(name).await.unwrap(), ServingStatus::Serving);
    }
    backend.set_down(true);
    wait_for_every_health(&service, ServingStatus::NotServing).await;
    // A backend failure is UNAVAILABLE (never UNKNOWN, which Envoy allows)...
    let status = refusal(
        &service,
        request(vec![desc(&[("user", "alice")])]),
        "backend is down",
    )
    .await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    // ...while descriptors that need no counter are still answered.
    let res = call(
        &service,
        request(vec![desc(&[("health", "x")]), desc(&[("x", "y")])]),
    )
    .await;
    assert_eq!(res.overall_code, Code::Ok as i32);

    backend.set_down(false);
    wait_for_every_health(&service, ServingStatus::Serving).await;
}

#[tokio::test]
async fn response_headers_on_and_off() {
    let on = start().await;
    let res = call(&on, request(vec![desc(&[("a", "1")]), desc(&[("b", "1")])])).await;
    assert_eq!(
        headers(&res),
        vec![
            ("RateLimit-Limit", "1"),
            ("RateLimit-Remaining", "0"),
            ("RateLimit-Reset", "60"),
        ]
    );
    let off = start_with(Options {
        response_headers: None,
        ..default_options()
    })
    .await;
    let res = call(
        &off,
        request(vec![desc(&[("a", "1")]), desc(&[("b", "1")])]),
    )
    .await;
    assert_eq!(res.statuses.len(), 2);
    assert!(res.response_headers_to_add.is_empty(), "{res:?}");
}

#[tokio::test]
async fn all_or_nothing_across_descriptors() {
    let service = start().await;
    let both = || request(vec![desc(&[("a", "1")]), desc(&[("b", "1")])]);
    let res = call(&service, both()).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
    // B is exhausted now: the request is denied and A keeps its quota.
    for _ in 0..3 {
        let res = call(&service, both()).await;
        assert_eq!(res.overall_code, Code::OverLimit as i32);
        assert_eq!(
            res.statuses,
            vec![
                per_minute(Code::Ok, 4, 5, ""),
                per_minute(Code::OverLimit, 0, 1, ""),
            ]
        );
    }
    let res = call(&service, request(vec![desc(&[("a", "1")])])).await;
    assert_eq!(res.statuses, vec![per_minute(Code::Ok, 3, 5, "")]);
}

#[tokio::test]
async fn hits_addend_of_request_and_descriptor() {
    let service = start().await;
    let with = |request_hits: u32, descriptor_hits: Option<u64>| RateLimitRequest {
        hits_addend: request_hits,
        ..request(vec![RateLimitDescriptor {
            hits_addend: descriptor_hits,
            ..desc(&[("cost", "c")])
        }])
    };
    let cases = [
        (with(3, None), Code::Ok, 2),
        // Present, even 0, the descriptor's value wins: a check.
        (with(3, Some(0)), Code::Ok, 2),
        (with(3, Some(2)), Code::Ok, 0),
        (with(0, Some(0)), Code::OverLimit, 0),
        (with(1, None), Code::OverLimit, 0),
    ];
    for (idx, (request, code, remaining)) in cases.into_iter().enumerate() {
        let res = call(&service, request).await;
        assert_eq!(res.overall_code, code as i32, "case {idx}");
        assert_eq!(
            res.statuses,
            vec![per_minute(code, remaining, 5, "")],
            "case {idx}"
        );
    }
}

#[tokio::test]
async fn replaced_limit_is_dropped() {
    let service = start().await;
    let both = || request(vec![desc(&[("api_key", "k")]), desc(&[("path", "/x")])]);
    for remaining in [9, 8] {
        let res = call(&service, both()).await;
        assert_eq!(res.overall_code, Code::Ok as i32);
        assert_eq!(
            res.statuses,
            vec![
                ok_without_limit(),
                per_minute(Code::Ok, remaining, 10, "expensive"),
            ]
        );
    }
    // premium (1 per minute) was never counted above.
    let res = call(&service, request(vec![desc(&[("api_key", "k")])])).await;
    assert_eq!(res.statuses, vec![per_minute(Code::Ok, 0, 1, "premium")]);
}

#[tokio::test]
async fn override_replaces_the_tree_for_its_descriptor() {
    let service = start().await;
    let overridden = || {
        request(vec![RateLimitDescriptor {
            limit: Some(RateLimitOverride {
                requests_per_unit: 1,
                unit: RateLimitUnit::Hour as i32,
            }),
            ..desc(&[("user", "alice")])
        }])
    };
    let res = call(&service, overridden()).await;
    assert_eq!(
        res.statuses,
        vec![limited(Code::Ok, 0, 3600, 1, Unit::Hour, "")]
    );
    let res = call(&service, overridden()).await;
    assert_eq!(res.overall_code, Code::OverLimit as i32);
    assert_eq!(
        res.statuses,
        vec![limited(Code::OverLimit, 0, 3600, 1, Unit::Hour, "")]
    );
    // The configured rule's counter was not touched.
    let res = call(&service, request(vec![desc(&[("user", "alice")])])).await;
    assert_eq!(res.statuses, vec![per_minute(Code::Ok, 2, 3, "per_user")]);
}

#[tokio::test]
async fn reflection_lists_the_service() {
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let service = start().await;
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol(
            "envoy.service.ratelimit.v3.RateLimitService".to_owned(),
        ),
        // grpcurl resolves imports by file name.
        MessageRequest::FileByFilename("google/protobuf/duration.proto".to_owned()),
    ];
    let mut inbound = support::reflection::v1::ask(service.channel.clone(), requests)
        .await
        .expect("reflection call");
    let first = support::reflection::v1::next(&mut inbound).await;
    let names = support::reflection::v1::service_names(first);
    assert!(
        names.contains(&"envoy.service.ratelimit.v3.RateLimitService".to_owned()),
        "{names:?}"
    );
    for what in ["service", "google/protobuf/duration.proto"] {
        let res = support::reflection::v1::next(&mut inbound).await;
        assert!(
            matches!(&res, MessageResponse::FileDescriptorResponse(it) if !it.file_descriptor_proto.is_empty()),
            "{what}: {res:?}"
        );
    }
}

#[tokio::test]
async fn shutdown_reports_not_serving_then_drains_in_flight_requests() {
    shutdown_drains_on(0).await;
}

/// The same stop with connections on serving threads (`--grpc-threads`,
/// the binary's default): the request in flight on a serving thread is
/// answered, and every serving thread ends with the server.
#[tokio::test]
async fn shutdown_drains_requests_on_serving_threads_and_ends_the_threads() {
    let before = serving_threads();
    shutdown_drains_on(2).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while serving_threads() > before {
        assert!(
            std::time::Instant::now() < deadline,
            "serving threads outlived the server"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Threads of this process named as serving threads are (`grpc-N`).
fn serving_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("grpc-"))
        .count()
}

async fn shutdown_drains_on(threads: usize) {
    let (inner, _clock) = memory_backend();
    // Every decision lags, to have requests in flight at shutdown.
    let backend = Arc::new(FakeBackend::slow(inner, Duration::from_millis(500)));
    let service = start_service_on_threads(
        rules_from(CONFIG),
        backend,
        default_options(),
        Metrics::new(),
        threads,
    )
    .await;
    let addr = service.addr;

    let mut health = tonic_health::pb::health_client::HealthClient::new(service.channel.clone());
    let mut watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: "ratelimit".to_owned(),
        })
        .await
        .expect("watch health")
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);

    let mut client = service.client();
    let in_flight = tokio::spawn(async move {
        client
            .should_rate_limit(request(vec![desc(&[("user", "a")])]))
            .await
    });
    // Let the request reach the backend before the signal.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = tokio::spawn(service.stop());

    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("health changes at the signal")
        .unwrap()
        .unwrap();
    assert_eq!(next.status(), ServingStatus::NotServing);
    // The server ends the Watch itself rather than wait for it to drain.
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the watch ends at the close")
        .expect_err("ended with a status");
    assert_eq!(end.code(), tonic::Code::Unavailable, "{end:?}");

    let res = in_flight
        .await
        .unwrap()
        .expect("the in-flight request completes");
    assert_eq!(res.into_inner().overall_code, Code::Ok as i32);
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("drains within its deadline")
        .unwrap()
        .expect("clean stop");
    // Nothing listens any more.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn metrics_count_grpc_decisions_and_no_request_stays_in_flight() {
    use tower::ServiceExt;

    let service = start().await;
    // 3 per minute: remaining 2 and 1 are ok, 0 is near the limit (under
    // 20%), then over.
    for _ in 0..5 {
        call(&service, request(vec![desc(&[("user", "alice")])])).await;
    }
    let unknown = RateLimitRequest {
        domain: "no-such-domain".to_owned(),
        ..request(vec![desc(&[("user", "alice")])])
    };
    call(&service, unknown).await;
    let res = throttlegate::transport::http::router(service.http.clone())
        .oneshot(
            axum::http::Request::get("/metrics")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), axum::http::StatusCode::OK);
    assert_eq!(
        res.headers().get("content-type").unwrap(),
        throttlegate::metrics::CONTENT_TYPE
    );
    let body = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    let text = String::from_utf8(body.to_vec()).unwrap();
    for line in [
        r#"throttlegate_decisions_total{domain="test",rule="user",result="ok"} 2"#,
        r#"throttlegate_decisions_total{domain="test",rule="user",result="near_limit"} 1"#,
        r#"throttlegate_decisions_total{domain="test",rule="user",result="over_limit"} 2"#,
        r#"throttlegate_hits_total{domain="test",rule="user"} 5"#,
        r#"throttlegate_decisions_total{domain="_unknown",rule="_unknown",result="ok"} 1"#,
        r#"throttlegate_backend_latency_seconds_count{backend="memory"} 5"#,
        "throttlegate_grpc_requests_in_flight 0",
    ] {
        assert!(text.contains(&format!("{line}\n")), "{line}\n{text}");
    }
    assert!(
        !text.contains("alice") && !text.contains("no-such-domain"),
        "{text}"
    );
}

// === what a decided or refused call looks like on the wire ===

/// What tonic's own server answers: a decision for domain `test`, an
/// INVALID_ARGUMENT status for any other.
struct TonicReference;

#[tonic::async_trait]
impl throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService
    for TonicReference
{
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        if request.get_ref().domain != "test" {
            return Err(tonic::Status::invalid_argument("empty domain"));
        }
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        }))
    }
}

/// Serves [`TonicReference`] with tonic's server on an ephemeral port.
async fn tonic_reference() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer::new(TonicReference);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr
}

type Headers = tonic::codegen::http::HeaderMap;

/// One ShouldRateLimit call sent with `h2`, with `extra` request headers:
/// the response's headers and its trailers (`None`: trailers-only).
async fn raw_call(
    addr: std::net::SocketAddr,
    request: &RateLimitRequest,
    extra: &[(&str, &str)],
) -> (Headers, Option<Headers>) {
    use tonic::codegen::http;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let mut builder = http::Request::post(format!(
        "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers");
    for (name, value) in extra {
        builder = builder.header(*name, *value);
    }
    let (response, mut body) = client
        .send_request(builder.body(()).unwrap(), false)
        .expect("send");
    let message = prost::Message::encode_to_vec(request);
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    // The server may answer (and end the stream) before the body is sent.
    let _ = body.send_data(framed.into(), true);
    let response = response.await.expect("a response");
    let (parts, mut body) = response.into_parts();
    if body.is_end_stream() {
        return (parts.headers, None);
    }
    while let Some(data) = body.data().await {
        let data = data.expect("data");
        let _ = body.flow_control().release_capacity(data.len());
    }
    let trailers = body.trailers().await.expect("trailers");
    (parts.headers, trailers)
}

/// The names in `headers`, sorted, without `date` (which tonic's server
/// sends and this one leaves out: gRPC has no use for it).
fn names(headers: &Headers) -> Vec<String> {
    let mut names: Vec<String> = headers
        .keys()
        .map(|it| it.as_str().to_owned())
        .filter(|it| it != "date")
        .collect();
    names.sort();
    names
}

/// A decided call carries the headers and trailers tonic's server sends
/// (`content-type`; `grpc-status` in the trailers), and no
/// `content-length`, which tonic's server never sends with a message and
/// clients hand to applications as metadata; a refused call is the same
/// trailers-only answer as tonic's.
#[tokio::test]
async fn answers_carry_the_headers_tonics_server_sends_and_no_content_length() {
    let service = start().await;
    let reference = tonic_reference().await;
    let decided = request(vec![desc(&[("user", "alice")])]);
    let refused = RateLimitRequest {
        domain: String::new(),
        ..decided.clone()
    };

    let (ours, our_trailers) = raw_call(service.addr, &decided, &[]).await;
    let (theirs, their_trailers) = raw_call(reference, &decided, &[]).await;
    assert_eq!(ours.get("content-length"), None, "{ours:?}");
    assert_eq!(
        names(&ours),
        names(&theirs),
        "ours {ours:?}, tonic's {theirs:?}"
    );
    assert_eq!(ours.get("content-type"), theirs.get("content-type"));
    let (ours, theirs) = (
        our_trailers.expect("trailers"),
        their_trailers.expect("trailers"),
    );
    assert_eq!(
        names(&ours),
        names(&theirs),
        "ours {ours:?}, tonic's {theirs:?}"
    );
    assert_eq!(
        ours.get("grpc-status").map(|it| it.as_bytes()),
        Some(&b"0"[..])
    );

    let (ours, our_trailers) = raw_call(service.addr, &refused, &[]).await;
    let (theirs, their_trailers) = raw_call(reference, &refused, &[]).await;
    assert!(
        our_trailers.is_none() && their_trailers.is_none(),
        "trailers-only"
    );
    assert_eq!(
        names(&ours),
        names(&theirs),
        "ours {ours:?}, tonic's {theirs:?}"
    );
    assert_eq!(
        ours.get("grpc-status").map(|it| it.as_bytes()),
        Some(&b"3"[..])
    );
    assert_eq!(ours.get("grpc-message"), theirs.get("grpc-message"));

    // A tonic client sees no content-length among the answer's metadata.
    let answer = service
        .client()
        .should_rate_limit(decided)
        .await
        .expect("decided");
    assert_eq!(answer.metadata().get("content-length"), None, "{answer:?}");
}

/// A 15 KB `grpc-encoding` is refused UNIMPLEMENTED with a `grpc-message`
/// of at most 1 KiB (it quotes the encoding), still a valid status.
#[tokio::test]
async fn status_messages_quoting_the_client_are_capped_at_one_kib() {
    let service = start().await;
    let decided = request(vec![desc(&[("user", "alice")])]);
    let encoding = "x".repeat(15 * 1024);
    let (headers, trailers) =
        raw_call(service.addr, &decided, &[("grpc-encoding", &encoding)]).await;
    assert!(trailers.is_none(), "trailers-only: {trailers:?}");
    assert_eq!(
        headers.get("grpc-status").map(|it| it.as_bytes()),
        Some(&b"12"[..])
    );
    let message = headers.get("grpc-message").expect("grpc-message");
    assert!(
        message.len() <= 1024,
        "grpc-message of {} bytes",
        message.len()
    );
    let message = message.to_str().expect("visible ASCII");
    assert!(
        message.starts_with("Content is compressed with `xxx"),
        "{message}"
    );
    assert_eq!(
        headers.get("grpc-accept-encoding").map(|it| it.as_bytes()),
        Some(&b"identity"[..])
    );
    // Cut at a whole character, and marked.
    let decoded = percent_encoding::percent_decode(message.as_bytes())
        .decode_utf8()
        .expect("UTF-8 once decoded");
    assert!(decoded.ends_with("xxx..."), "{decoded}");
    // The connection and the server carry on.
    let res = call(&service, decided).await;
    assert_eq!(res.overall_code, Code::Ok as i32);
}
