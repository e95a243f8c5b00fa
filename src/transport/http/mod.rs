//! The HTTP side: `/healthcheck`, `/json` (the decision over JSON), `/rlconfig`, `/metrics`.
//!
//! `/json` reads and writes the proto3 JSON form of the rate-limit messages
//! (camelCase names, enum names; snake_case names are accepted too), like
//! envoyproxy/ratelimit's endpoint, for curl-based debugging.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde::{Deserialize, Deserializer, Serialize};

use crate::decision::{self, Limiter};
use crate::rules::Unit;
use crate::transport::grpc::{Shutdown, Stage};
use crate::transport::listener::Listener;

/// A probe slower than this makes `/healthcheck` answer 503.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The HTTP routes over `limiter`.
pub fn router(limiter: Arc<Limiter>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/json", post(json))
        .route("/rlconfig", get(rlconfig))
        .route("/metrics", get(metrics))
        // The same bound as a gRPC message.
        .layer(DefaultBodyLimit::max(
            crate::transport::grpc::MAX_MESSAGE_BYTES,
        ))
        .with_state(limiter)
}

/// What one client may hold of the HTTP server: connections and time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Most connections open at once; further clients wait in the backlog.
    pub max_connections: usize,
    /// A request head must arrive whole within this time of its first byte
    /// (of the accept, for a connection's first request).
    pub header_timeout: Duration,
    /// A request body must arrive whole within this time of its head.
    pub body_timeout: Duration,
    /// A keep-alive connection is closed after this long without a request.
    pub idle_timeout: Duration,
}

impl HttpLimits {
    /// The defaults of the `serve` flags, with 1024 connections in place
    /// of the cap `main` derives from the descriptor limit.
    pub const fn standard() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Serves HTTP on `listener` with [`HttpLimits::standard`]; see
/// [`serve_limited`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    limiter: Arc<Limiter>,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    serve_limited(listener, limiter, HttpLimits::standard(), shutdown).await
}

/// Serves HTTP/1.1 on `listener` within `limits` through the stages of
/// `shutdown`: `/healthcheck` answers 503 once it leaves `Serving`, and at
/// `Closing` the server stops accepting, closes idle connections and lets
/// in-flight requests finish (the caller bounds how long).
pub async fn serve_limited(
    listener: tokio::net::TcpListener,
    limiter: Arc<Limiter>,
    limits: HttpLimits,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let mut listener = Listener::new(listener, "http", limits.max_connections, limiter.metrics());
    let router = router(limiter).layer(Extension(shutdown.clone()));
    let shutdown = shutdown.closing();
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The connection's watchdog times heads, and also the wait between
    // requests, which hyper's header timeout would cut short.
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            conn = listener.accept(Some(limits.header_timeout), None) => conn,
            () = &mut shutdown => break,
        };
        let watchdog = conn.watchdog();
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                watchdog.request_started();
                let watchdog = watchdog.clone();
                let router = router.clone();
                async move {
                    let request = request.map(|body| TimedBody::new(body, limits.body_timeout));
                    let response = tower::ServiceExt::oneshot(router, request).await;
                    watchdog.idle(limits.idle_timeout, limits.header_timeout);
                    response
                }
            });
        let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(conn), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!("http connection ended: {err}");
            }
        });
    }
    // Closes the listening socket before waiting for the connections.
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A request body that fails once its deadline passes with data still to
/// come, so a client cannot hold a request open by sending its body slowly.
struct TimedBody {
    inner: hyper::body::Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl TimedBody {
    fn new(inner: hyper::body::Incoming, within: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(within)),
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    Poll::Ready(Some(Err("request body not received in time".into())))
                }
                Poll::Pending => Poll::Pending,
            },
            Poll::Ready(frame) => Poll::Ready(frame.map(|it| it.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

async fn healthcheck(
    State(limiter): State<Arc<Limiter>>,
    shutdown: Option<Extension<Shutdown>>,
) -> Response {
    if shutdown.is_some_and(|it| it.stage() != Stage::Serving) {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    }
    let backend = limiter.backend();
    match tokio::time::timeout(PROBE_TIMEOUT, backend.probe()).await {
        Ok(Ok(())) => (StatusCode::OK, "OK\n").into_response(),
        Ok(Err(err)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{err}\n")).into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{} backend did not answer in time\n", backend.name()),
        )
            .into_response(),
    }
}

async fn rlconfig(State(limiter): State<Arc<Limiter>>) -> String {
    crate::config::summary(&limiter.rules().load())
}

/// Prometheus scrape: the text exposition of every metric. Formatting
/// thousands of series takes milliseconds, so it runs on the blocking pool,
/// not on a worker that decisions need.
async fn metrics(State(limiter): State<Arc<Limiter>>) -> Response {
    match tokio::task::spawn_blocking(move || limiter.metrics().encode()).await {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                crate::metrics::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(err) => {
            tracing::error!(error = %err, "encoding the metrics failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "encoding the metrics failed",
            )
                .into_response()
        }
    }
}

/// 200 with the decision, 429 when it is OVER_LIMIT (as envoyproxy/ratelimit
/// answers), 400 for a bad request, 413 for a body over 64 KiB, 503 when the
/// backend failed. The body is read as JSON whatever its content type, so a
/// plain `curl -d` works.
async fn json(
    State(limiter): State<Arc<Limiter>>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(it) => it,
        Err(rejection) => return (rejection.status(), rejection.body_text()).into_response(),
    };
    let request = match serde_json::from_slice::<JsonRequest>(&body) {
        Ok(it) => it.into_request(),
        Err(err) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid json request: {err}\n"),
            )
                .into_response();
        }
    };
    match limiter.decide(&request).await {
        Ok(decision) => {
            let status = match decision.overall {
                decision::Code::Ok => StatusCode::OK,
                decision::Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            (status, axum::Json(JsonResponse::from(decision))).into_response()
        }
        Err(decision::Error::InvalidArgument(message)) => {
            (StatusCode::BAD_REQUEST, message).into_response()
        }
        Err(decision::Error::Backend(err)) => {
            (StatusCode::SERVICE_UNAVAILABLE, err.to_string()).into_response()
        }
    }
}

// === request JSON ===

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hits_addend", deserialize_with = "number")]
    hits_addend: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, alias = "hits_addend", deserialize_with = "optional_number")]
    hits_addend: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonOverride {
    #[serde(default, alias = "requests_per_unit", deserialize_with = "number")]
    requests_per_unit: u32,
    #[serde(default)]
    unit: JsonUnit,
}

/// An override unit by name (`"MINUTE"`) or number (`2`).
#[derive(Debug, Default)]
struct JsonUnit(Option<Unit>);

impl<'de> Deserialize<'de> for JsonUnit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Name(String),
            Number(u64),
        }
        // envoy.type.v3.RateLimitUnit: no WEEK.
        const NAMES: [(&str, Option<Unit>); 7] = [
            ("UNKNOWN", None),
            ("SECOND", Some(Unit::Second)),
            ("MINUTE", Some(Unit::Minute)),
            ("HOUR", Some(Unit::Hour)),
            ("DAY", Some(Unit::Day)),
            ("MONTH", Some(Unit::Month)),
            ("YEAR", Some(Unit::Year)),
        ];
        let unit = match Raw::deserialize(deserializer)? {
            Raw::Name(name) => NAMES
                .iter()
                .find(|(it, _)| *it == name)
                .map(|(_, unit)| *unit)
                .ok_or_else(|| serde::de::Error::custom(format!("unknown unit '{name}'")))?,
            Raw::Number(n) => usize::try_from(n)
                .ok()
                .and_then(|idx| NAMES.get(idx))
                .map(|(_, unit)| *unit)
                .ok_or_else(|| serde::de::Error::custom(format!("unknown unit {n}")))?,
        };
        Ok(JsonUnit(unit))
    }
}

/// proto3 JSON writes 64-bit integers as strings and accepts both forms.
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonNumber {
    Number(u64),
    Text(String),
}

impl JsonNumber {
    fn value<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            JsonNumber::Number(n) => Ok(n),
            JsonNumber::Text(text) => text
                .parse()
                .map_err(|_| E::custom(format!("not an unsigned integer: '{text}'"))),
        }
    }
}

fn number<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    let n = JsonNumber::deserialize(deserializer)?.value()?;
    T::try_from(n).map_err(|_| serde::de::Error::custom(format!("{n} is out of range")))
}

fn optional_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    match Option::<JsonNumber>::deserialize(deserializer)? {
        Some(n) => Ok(Some(n.value()?)),
        None => Ok(None),
    }
}

impl JsonRequest {
    fn into_request(self) -> decision::Request {
        decision::Request {
            domain: self.domain,
            hits_addend: self.hits_addend,
            descriptors: self
                .descriptors
                .into_iter()
                .map(|it| decision::Descriptor {
                    entries: it
                        .entries
                        .into_iter()
                        .map(|entry| decision::Entry {
                            key: entry.key.into_bytes(),
                            value: entry.value.into_bytes(),
                        })
                        .collect(),
                    limit: it.limit.map(|limit| decision::LimitOverride {
                        requests_per_unit: limit.requests_per_unit,
                        unit: limit.unit.0,
                    }),
                    hits_addend: it.hits_addend,
                })
                .collect(),
        }
    }
}

// === response JSON ===

/// Fields at their default value are omitted, as proto3 JSON does.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse {
    overall_code: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus {
    code: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_limit: Option<JsonLimit>,
    #[serde(skip_serializing_if = "is_zero")]
    limit_remaining: u32,
    /// A proto3 JSON Duration: `"60s"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_until_reset: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonLimit {
    #[serde(skip_serializing_if = "is_zero")]
    requests_per_unit: u32,
    unit: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    name: String,
}

#[derive(Debug, Serialize)]
struct JsonHeader {
    key: String,
    value: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn code_name(code: decision::Code) -> &'static str {
    match code {
        decision::Code::Ok => "OK",
        decision::Code::OverLimit => "OVER_LIMIT",
    }
}

fn unit_name(unit: Unit) -> &'static str {
    match unit {
        Unit::Second => "SECOND",
        Unit::Minute => "MINUTE",
        Unit::Hour => "HOUR",
        Unit::Day => "DAY",
        Unit::Week => "WEEK",
        Unit::Month => "MONTH",
        Unit::Year => "YEAR",
    }
}

impl From<decision::Decision> for JsonResponse {
    fn from(decision: decision::Decision) -> Self {
        JsonResponse {
            overall_code: code_name(decision.overall),
            statuses: decision
                .statuses
                .into_iter()
                .map(|it| JsonStatus {
                    code: code_name(it.code),
                    current_limit: it.current_limit.map(|limit| JsonLimit {
                        requests_per_unit: limit.requests_per_unit,
                        unit: unit_name(limit.unit),
                        name: limit.name.to_string(),
                    }),
                    limit_remaining: it.limit_remaining,
                    duration_until_reset: it.duration_until_reset_s.map(|s| format!("{s}s")),
                })
                .collect(),
            response_headers_to_add: decision
                .headers
                .into_iter()
                .map(|(key, value)| JsonHeader { key, value })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;
    use crate::clock::ManualClock;
    use crate::metrics::Metrics;
    use crate::testing;

    const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}\n";

    fn limiter() -> Arc<Limiter> {
        Arc::new(testing::limiter(
            testing::rules_from("api.yaml", CONFIG),
            testing::memory_backend(&ManualClock::new(testing::T0)),
            testing::default_options(),
            Metrics::new(),
        ))
    }

    async fn send(router: &Router, request: Request<Body>) -> (StatusCode, String) {
        let res = router.clone().oneshot(request).await.unwrap();
        let status = res.status();
        let body = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    fn post_json(body: &str) -> Request<Body> {
        Request::post("/json")
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap()
    }

    #[tokio::test]
    async fn json_decides_in_camel_case_and_accepts_snake_case() {
        let router = router(limiter());
        let camel = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}],"hitsAddend":1}"#;
        let (status, body) = send(&router, post_json(camel)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "overallCode": "OK",
                "statuses": [{
                    "code": "OK",
                    "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE", "name": "per_user"},
                    "limitRemaining": 1,
                    "durationUntilReset": "60s",
                }],
                "responseHeadersToAdd": [
                    {"key": "RateLimit-Limit", "value": "2"},
                    {"key": "RateLimit-Remaining", "value": "1"},
                    {"key": "RateLimit-Reset", "value": "60"},
                ],
            })
        );
        // snake_case, and a 64-bit number written as a string.
        let snake = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}],"hits_addend":"1"}],"hits_addend":5}"#;
        let (status, body) = send(&router, post_json(snake)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains(r#""code":"OK""#), "{body}");
        // Now exhausted: 429 with the OVER_LIMIT answer.
        let (status, body) = send(&router, post_json(camel)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
        assert!(body.contains(r#""overallCode":"OVER_LIMIT""#), "{body}");
        assert!(
            body.contains(r#"{"key":"Retry-After","value":"60"}"#),
            "{body}"
        );
    }

    #[tokio::test]
    async fn json_override_by_unit_name_and_bad_requests() {
        let router = router(limiter());
        let with_override = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"b"}],"limit":{"requestsPerUnit":7,"unit":"HOUR"}}]}"#;
        let (status, body) = send(&router, post_json(with_override)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(
            body.contains(r#""currentLimit":{"requestsPerUnit":7,"unit":"HOUR"}"#),
            "{body}"
        );
        let cases = [
            (r#"{"domain":"","descriptors":[]}"#, "empty domain"),
            (r#"{"domain":"api"}"#, "no descriptors"),
            (r#"{"domain":"api","descriptor":[]}"#, "unknown field"),
            (r#"{"domain":"api","#, ""),
        ];
        for (body, reason) in cases {
            let (status, text) = send(&router, post_json(body)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
            assert!(text.contains(reason), "{body}: {text}");
        }
    }

    #[tokio::test]
    async fn json_decides_values_of_any_length() {
        let router = router(limiter());
        let long = "v".repeat(2_000);
        let body = format!(
            r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"user","value":"{long}"}}]}}]}}"#
        );
        for remaining in [1, 0] {
            let (status, text) = send(&router, post_json(&body)).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            let value: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                value["statuses"][0]["limitRemaining"].as_u64().unwrap_or(0),
                remaining
            );
        }
        let (status, _) = send(&router, post_json(&body)).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    }

    #[tokio::test]
    async fn json_reads_a_body_sent_without_a_json_content_type() {
        // What `curl -d` sends.
        let request = Request::post("/json")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(
                r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#,
            ))
            .unwrap();
        let (status, body) = send(&router(limiter()), request).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains(r#""overallCode":"OK""#), "{body}");
    }

    #[tokio::test]
    async fn json_body_over_64_kib_is_refused() {
        let router = router(limiter());
        let huge = format!(
            r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"user","value":"{}"}}]}}]}}"#,
            "v".repeat(70 * 1024)
        );
        let (status, _) = send(&router, post_json(&huge)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        let small = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#;
        let (status, body) = send(&router, post_json(small)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }

    #[tokio::test]
    async fn metrics_expose_the_decisions_made_over_json() {
        let router = router(limiter());
        let body = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#;
        for _ in 0..3 {
            send(&router, post_json(body)).await;
        }
        let res = router
            .clone()
            .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            res.headers().get("content-type").unwrap(),
            crate::metrics::CONTENT_TYPE
        );
        let text = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .unwrap();
        let text = String::from_utf8(text.to_vec()).unwrap();
        // 2 per minute: remaining 1 is ok, 0 is near the limit, then over.
        for (result, count) in [("ok", 1), ("near_limit", 1), ("over_limit", 1)] {
            let line = format!(
                "throttlegate_decisions_total{{domain=\"api\",rule=\"user\",result=\"{result}\"}} {count}\n"
            );
            assert!(text.contains(&line), "{line}{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[tokio::test]
    async fn healthcheck_and_rlconfig() {
        let router = router(limiter());
        let (status, body) = send(
            &router,
            Request::get("/healthcheck").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "OK\n"));
        let (status, body) = send(
            &router,
            Request::get("/rlconfig").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("domain api"), "{body}");
        assert!(body.contains("2/minute"), "{body}");
    }
}
