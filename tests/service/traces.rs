//! OpenTelemetry traces of the built binary, received by OTLP receivers
//! in the test that speak the real protos: HTTP (`POST /v1/traces`,
//! protobuf) and gRPC (`TraceService/Export`). What arrives: the resource
//! names, one span per decision with its domain and verdict, the backend
//! call as its child, the caller's trace continued from `traceparent`, a
//! `b3` header and `x-b3-*` headers; and nothing at sampling rate 0 or
//! with tracing off.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;

use crate::support::process::{Serve, ServiceProcess, free_addr, spawn_with_env};
use crate::support::service::one_entry_request;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";

const TRACE_A: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN_A: &str = "00f067aa0ba902b7";
const TRACE_B: &str = "0af7651916cd43dd8448eb211c80319c";
const SPAN_B: &str = "b7ad6b7169203331";
const TRACE_C: &str = "463ac35c9f6413ad48485a3953bb6124";
const SPAN_C: &str = "0020000000000001";

/// One span as received, with its resource's attributes.
#[derive(Debug, Clone)]
struct Received {
    resource: HashMap<String, String>,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: HashMap<String, String>,
}

/// Every span received so far, by either receiver.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Received>>>);

impl Spans {
    fn add(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.0.lock().unwrap();
        for resource_spans in request.resource_spans {
            let resource = strings(
                &resource_spans
                    .resource
                    .map(|it| it.attributes)
                    .unwrap_or_default(),
            );
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Received {
                        resource: resource.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: strings(&span.attributes),
                    });
                }
            }
        }
    }

    fn all(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }

    /// The spans of `trace_id`, once `count` of them have arrived.
    async fn of_trace(&self, trace_id: &str, count: usize) -> Vec<Received> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let found: Vec<Received> = self
                .all()
                .into_iter()
                .filter(|it| it.trace_id == trace_id)
                .collect();
            if found.len() >= count {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {count} spans of trace {trace_id} within 15 s; all: {:#?}",
                found.len(),
                self.all()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn strings(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .filter_map(|it| match it.value.as_ref()?.value.as_ref()? {
            Value::StringValue(text) => Some((it.key.clone(), text.clone())),
            other => Some((it.key.clone(), format!("{other:?}"))),
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|it| format!("{it:02x}")).collect()
}

/// An OTLP/HTTP receiver: `POST /v1/traces` with a protobuf
/// `ExportTraceServiceRequest`, answered 200 with an empty response.
async fn http_receiver(spans: Spans) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let spans = spans.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let spans = spans.clone();
                    async move { export_over_http(request, &spans).await }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn export_over_http(
    request: hyper::Request<hyper::body::Incoming>,
    spans: &Spans,
) -> Result<hyper::Response<http_body_util::Full<bytes::Bytes>>, std::convert::Infallible> {
    use http_body_util::BodyExt;
    let respond = |status: u16, body: Vec<u8>| {
        let mut response = hyper::Response::new(http_body_util::Full::from(body));
        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
        response.headers_mut().insert(
            "content-type",
            hyper::header::HeaderValue::from_static("application/x-protobuf"),
        );
        Ok(response)
    };
    let protobuf = request
        .headers()
        .get("content-type")
        .is_some_and(|it| it == "application/x-protobuf");
    if request.method() != hyper::Method::POST || request.uri().path() != "/v1/traces" || !protobuf
    {
        return respond(404, Vec::new());
    }
    let body = request.into_body().collect().await.unwrap().to_bytes();
    match ExportTraceServiceRequest::decode(body) {
        Ok(export) => {
            spans.add(export);
            respond(200, ExportTraceServiceResponse::default().encode_to_vec())
        }
        Err(_) => respond(400, Vec::new()),
    }
}

/// An OTLP/gRPC receiver: `TraceService/Export`.
struct GrpcReceiver(Spans);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.add(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn grpc_receiver(spans: Spans) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(GrpcReceiver(spans)))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    addr
}

/// One `ShouldRateLimit` of `user=<user>` with `headers`; its overall code.
async fn decide(service: &mut ServiceProcess, user: &str, headers: &[(&'static str, &str)]) -> i32 {
    let mut request = tonic::Request::new(one_entry_request("api", "user", user));
    for (name, value) in headers {
        request
            .metadata_mut()
            .insert(*name, value.parse().expect("an ASCII header value"));
    }
    service
        .client()
        .await
        .should_rate_limit(request)
        .await
        .expect("decided")
        .into_inner()
        .overall_code
}

/// The decision span and the backend span of one trace, checked to be
/// parent and child.
fn decision_and_backend(spans: &[Received]) -> (&Received, &Received) {
    let decision = spans
        .iter()
        .find(|it| it.name == "ShouldRateLimit")
        .unwrap_or_else(|| panic!("no decision span: {spans:#?}"));
    let backend = spans
        .iter()
        .find(|it| it.name == "backend decide")
        .unwrap_or_else(|| panic!("no backend span: {spans:#?}"));
    assert_eq!(backend.parent_span_id, decision.span_id, "{spans:#?}");
    assert_eq!(backend.trace_id, decision.trace_id);
    assert_eq!(backend.attributes["ratelimit.backend"], "memory");
    (decision, backend)
}

#[tokio::test]
async fn spans_over_http_continue_w3c_and_b3_contexts_with_domain_verdict_and_backend() {
    let spans = Spans::default();
    let receiver = http_receiver(spans.clone()).await;
    let mut service = Serve::yaml(CONFIG)
        .args(&[
            "--tracing",
            "on",
            "--tracing-endpoint",
            &format!("http://{receiver}"),
            "--tracing-service-name",
            "rl",
            "--tracing-service-namespace",
            "gateway",
            "--tracing-service-instance-id",
            "pod-1",
        ])
        .spawn();
    service.connect().await;

    let traceparent = format!("00-{TRACE_A}-{SPAN_A}-01");
    assert_eq!(
        decide(&mut service, "a", &[("traceparent", &traceparent)]).await,
        Code::Ok as i32
    );
    let b3 = format!("{TRACE_B}-{SPAN_B}-1");
    assert_eq!(
        decide(&mut service, "a", &[("b3", &b3)]).await,
        Code::OverLimit as i32
    );
    let multi = [
        ("x-b3-traceid", TRACE_C),
        ("x-b3-spanid", SPAN_C),
        ("x-b3-sampled", "1"),
    ];
    assert_eq!(decide(&mut service, "b", &multi).await, Code::Ok as i32);
    // The caller decided not to sample: no span.
    let unsampled = "00-11111111111111111111111111111111-2222222222222222-00";
    decide(&mut service, "c", &[("traceparent", unsampled)]).await;

    for (trace, parent, verdict) in [
        (TRACE_A, SPAN_A, "OK"),
        (TRACE_B, SPAN_B, "OVER_LIMIT"),
        (TRACE_C, SPAN_C, "OK"),
    ] {
        let found = spans.of_trace(trace, 2).await;
        let (decision, _) = decision_and_backend(&found);
        assert_eq!(decision.parent_span_id, parent, "{found:#?}");
        assert_eq!(decision.attributes["ratelimit.domain"], "api");
        assert_eq!(decision.attributes["ratelimit.verdict"], verdict);
        assert_eq!(decision.resource["service.name"], "rl");
        assert_eq!(decision.resource["service.namespace"], "gateway");
        assert_eq!(decision.resource["service.instance.id"], "pod-1");
    }
    // A trace of its own for a call without context (rate 1: sampled).
    decide(&mut service, "d", &[]).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let root = loop {
        let root = spans
            .all()
            .into_iter()
            .find(|it| it.name == "ShouldRateLimit" && it.parent_span_id.is_empty());
        if let Some(root) = root {
            break root;
        }
        assert!(Instant::now() < deadline, "{:#?}", spans.all());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    decision_and_backend(&spans.of_trace(&root.trace_id, 2).await);
    assert!(
        !spans
            .all()
            .iter()
            .any(|it| it.trace_id == "11111111111111111111111111111111"),
        "an unsampled caller's trace was sent"
    );
}

/// envoyproxy/ratelimit's variables alone turn tracing on over gRPC
/// (`TRACING_EXPORTER_PROTOCOL=grpc`, `OTEL_EXPORTER_OTLP_ENDPOINT`
/// without a scheme, as Go's exporter takes it).
#[tokio::test]
async fn envoyproxy_variables_send_spans_over_grpc() {
    let spans = Spans::default();
    let receiver = grpc_receiver(spans.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let config_dir = dir.path().join("rl/config");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::write(config_dir.join("config.yaml"), CONFIG).unwrap();
    let (grpc, http) = (free_addr(), free_addr());
    let root = dir.path().to_str().unwrap().to_owned();
    let (grpc_port, http_port) = (grpc.port().to_string(), http.port().to_string());
    let endpoint = receiver.to_string();
    let mut service = spawn_with_env(
        &[
            ("RUNTIME_ROOT", root.as_str()),
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("HOST", "127.0.0.1"),
            ("GRPC_HOST", "127.0.0.1"),
            ("GRPC_PORT", &grpc_port),
            ("PORT", &http_port),
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("TRACING_SERVICE_NAMESPACE", "gateway"),
            ("TRACING_SERVICE_INSTANCE_ID", "pod-2"),
            ("TRACING_SAMPLING_RATE", "1"),
        ],
        grpc,
        http,
    );
    service.connect().await;
    let b3 = format!("{TRACE_B}-{SPAN_B}-1");
    decide(&mut service, "a", &[("b3", &b3)]).await;
    let found = spans.of_trace(TRACE_B, 2).await;
    let (decision, _) = decision_and_backend(&found);
    assert_eq!(decision.parent_span_id, SPAN_B);
    assert_eq!(decision.attributes["ratelimit.verdict"], "OK");
    // Their default service name, kept for a drop-in.
    assert_eq!(decision.resource["service.name"], "RateLimit");
    assert_eq!(decision.resource["service.namespace"], "gateway");
    assert_eq!(decision.resource["service.instance.id"], "pod-2");
}

/// At sampling rate 0 a call without a sampled context sends nothing, and
/// with tracing off nothing is sent at all, sampled context or not. The
/// one call a caller sampled at rate 0 shows the exporter works, so the
/// silence of the others is not a slow exporter.
#[tokio::test]
async fn rate_zero_and_tracing_off_send_nothing() {
    let spans = Spans::default();
    let receiver = http_receiver(spans.clone()).await;
    let endpoint = format!("http://{receiver}");
    let mut rate_zero = Serve::yaml(CONFIG)
        .args(&[
            "--tracing",
            "on",
            "--tracing-endpoint",
            &endpoint,
            "--tracing-sampling-rate",
            "0",
        ])
        .spawn();
    let mut off = Serve::yaml(CONFIG)
        .args(&["--tracing-endpoint", &endpoint])
        .spawn();
    rate_zero.connect().await;
    off.connect().await;
    let sampled = format!("00-{TRACE_A}-{SPAN_A}-01");
    for i in 0..20 {
        let user = format!("u{i}");
        decide(&mut rate_zero, &user, &[]).await;
        decide(&mut off, &user, &[]).await;
        decide(&mut off, &user, &[("traceparent", &sampled)]).await;
    }
    let parent = format!("00-{TRACE_C}-{SPAN_C}-01");
    decide(&mut rate_zero, "x", &[("traceparent", &parent)]).await;
    spans.of_trace(TRACE_C, 2).await;
    // A batch leaves within a second of its first span.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let all = spans.all();
    assert!(
        all.iter().all(|it| it.trace_id == TRACE_C),
        "spans other than the sampled caller's: {all:#?}"
    );
    assert_eq!(all.len(), 2, "{all:#?}");
}
