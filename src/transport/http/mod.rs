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
mod tests;
