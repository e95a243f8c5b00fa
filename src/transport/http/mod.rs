//! The HTTP side: `/healthcheck`, `/json` (the decision over JSON, see
//! `json`), `/rlconfig`, `/metrics`.

pub mod json;
pub mod ratelimit_stats;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::config::ConfigStatus;
use crate::decision::Limiter;
use crate::log_gate::LogGate;
use crate::metrics::Metrics;
use crate::quota::QuotaBook;
use crate::rules::RuleSet;
use crate::transport::health::Health;
use crate::transport::listener::Listener;
use crate::transport::shutdown::Shutdown;
use crate::transport::tls::{Io, TlsAcceptor, handshake_failed};

/// What the routes answer from.
#[derive(Debug, Clone)]
pub struct HttpApp {
    /// Decides `/json` requests.
    pub limiter: Arc<Limiter>,
    /// Served by `/metrics`; also where connections are counted.
    pub metrics: Arc<Metrics>,
    /// What `/healthcheck` answers.
    pub health: Health,
    /// The rate-limit quota shares `/rlconfig` lists.
    pub quota: Arc<QuotaBook>,
    /// The rules in force, summarised by `/rlconfig`.
    pub rules: Arc<ArcSwap<RuleSet>>,
    /// Where those rules came from, when, and the last refused reload.
    pub config: Arc<ConfigStatus>,
    /// TLS on every connection (offering ALPN `http/1.1`); `None`: plain
    /// text.
    pub tls: Option<TlsAcceptor>,
}

/// The HTTP routes over `app`.
pub fn router(app: HttpApp) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/json", post(json::decide))
        .route("/rlconfig", get(rlconfig))
        .route("/metrics", get(metrics))
        // The same bound as a gRPC message.
        .layer(DefaultBodyLimit::max(
            crate::transport::grpc::MAX_MESSAGE_BYTES,
        ))
        .with_state(app)
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
    /// of the cap `app` derives from the descriptor limit.
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
    app: HttpApp,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    serve_limited(listener, app, HttpLimits::standard(), shutdown).await
}

/// Serves HTTP/1.1 on `listener` within `limits` through the stages of
/// `shutdown`: `/healthcheck` answers 503 once it leaves `Serving`, and at
/// `Closing` the server stops accepting, closes idle connections and lets
/// in-flight requests finish (the caller bounds how long).
pub async fn serve_limited(
    listener: tokio::net::TcpListener,
    app: HttpApp,
    limits: HttpLimits,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let mut listener = Listener::new(listener, "http", limits.max_connections, &app.metrics);
    let tls = app.tls.clone();
    let handshake_errors = app.metrics.tls_handshake_errors("http");
    let handshake_log = Arc::new(LogGate::new());
    let router = router(HttpApp {
        health: app.health.following(shutdown.clone()),
        ..app
    });
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
        // Watched from now on: the graceful stop waits for this connection
        // even while its TLS handshake is still running.
        let watcher = graceful.watcher();
        let router = router.clone();
        let builder = builder.clone();
        let tls = tls.clone();
        let handshake_errors = handshake_errors.clone();
        let handshake_log = handshake_log.clone();
        // The handshake (bounded by the header deadline armed at accept)
        // runs here, never in the accept loop.
        tokio::spawn(async move {
            let io = match &tls {
                None => Io::Plain(conn),
                Some(acceptor) => match acceptor.handshake(conn).await {
                    Ok(io) => io,
                    Err(err) => {
                        handshake_failed("http", &err, &handshake_errors, &handshake_log);
                        return;
                    }
                },
            };
            let watchdog = io.watchdog();
            let service = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    watchdog.request_started();
                    let watchdog = watchdog.clone();
                    let router = router.clone();
                    async move {
                        let request = request.map(|body| TimedBody::new(body, limits.body_timeout));
                        let response = tower::ServiceExt::oneshot(router, request).await;
                        watchdog.idle(limits.idle_timeout, limits.header_timeout);
                        response
                    }
                },
            );
            let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            if let Err(err) = watcher.watch(connection).await {
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

/// 200 when requests should be sent here; 503 with the reason otherwise
/// (a stop under way, the backend failing its probe).
async fn healthcheck(State(app): State<HttpApp>) -> Response {
    match app.health.check().await {
        Ok(()) => (StatusCode::OK, "OK\n").into_response(),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("{err}\n")).into_response(),
    }
}

async fn rlconfig(State(app): State<HttpApp>) -> String {
    let mut text = app.config.render();
    let notes = app.health.backend_notes().await;
    if !notes.is_empty() {
        // Above the rules, after the config's own lines and their blank line.
        for note in notes {
            text.push_str(&note);
            text.push('\n');
        }
        text.push('\n');
    }
    text.push_str(&crate::config::summary(&app.rules.load()));
    text.push_str(&quota_summary(&app.quota.pools()));
    text
}

/// The active rate-limit quota (RLQS) buckets: each shared budget, then
/// each proxy's share of it (requests per window) and the demand it
/// reported; `held` marks a share still counted for a proxy that left or
/// went silent. Nothing when no proxy has reported a shared bucket.
fn quota_summary(pools: &[crate::quota::PoolView]) -> String {
    use std::fmt::Write as _;
    let mut text = String::new();
    if pools.is_empty() {
        return text;
    }
    let _ = writeln!(text, "rate-limit quota buckets:");
    for pool in pools {
        let window_s = pool.budget.window_us as f64 / 1e6;
        let _ = writeln!(
            text,
            "  {}: {} per {window_s}s",
            pool.pool.as_str(),
            pool.budget.per_window
        );
        for member in &pool.members {
            let show = |it: Option<u64>| it.map_or_else(|| "-".to_owned(), |it| it.to_string());
            let _ = writeln!(
                text,
                "    proxy bucket {}: share {}, demand {}{}",
                member.member,
                show(member.share),
                show(member.demand),
                if member.active { "" } else { " (held)" }
            );
        }
    }
    text
}

/// Prometheus scrape: the text exposition of every metric. Formatting
/// thousands of series takes milliseconds, so it runs on the blocking pool,
/// not on a worker that decisions need.
async fn metrics(State(app): State<HttpApp>) -> Response {
    match tokio::task::spawn_blocking(move || app.metrics.encode()).await {
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

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;
    use crate::clock::ManualClock;
    use crate::testing;

    const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}\n";

    /// The routes' parts, as the composition root builds them.
    fn app() -> HttpApp {
        let (_, app) = crate::app::server_apps(
            Arc::new(ArcSwap::from_pointee(testing::rules_from(
                "api.yaml", CONFIG,
            ))),
            Arc::new(ConfigStatus::new(None, std::time::SystemTime::now())),
            testing::memory_backend(&ManualClock::new(testing::T0)),
            testing::default_options(),
            Arc::new(Metrics::new()),
            Duration::ZERO,
        );
        app
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
        let router = router(app());
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
        let router = router(app());
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
        let router = router(app());
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
        let (status, body) = send(&router(app()), request).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains(r#""overallCode":"OK""#), "{body}");
    }

    #[tokio::test]
    async fn json_body_over_64_kib_is_refused() {
        let router = router(app());
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
        let router = router(app());
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
        let router = router(app());
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
