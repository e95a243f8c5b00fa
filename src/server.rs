//! The gRPC server: rate-limit service, health, reflection, connection limits, graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::codegen::http;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::backends::Backend;
use crate::limiter::Limiter;
use crate::listener::{ConnInfo, Listener};
use crate::service::RateLimitService;

/// Largest gRPC message accepted; bigger ones are refused before decoding.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Streams refused or reset by the server on one connection before it
/// sends GOAWAY (h2's own default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Streams reset by the peer before being served, at once, before GOAWAY
/// (h2's own default).
const MAX_PENDING_ACCEPT_RESETS: usize = 20;

/// Names reported by `grpc.health.v1.Health`: the whole server, the name
/// envoyproxy/ratelimit uses, and the fully qualified service.
pub const HEALTH_SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// How often the backend is probed for health.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// A probe slower than this counts as a failure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// What the server runs.
#[derive(Debug, Clone)]
pub struct App {
    pub limiter: Arc<Limiter>,
    /// How long in-flight RPCs may take to finish after the shutdown signal.
    pub drain_timeout: Duration,
}

/// What one client may hold of the gRPC server: connections, streams, time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcLimits {
    /// Most connections open at once; further clients wait in the backlog.
    pub max_connections: usize,
    /// SETTINGS_MAX_CONCURRENT_STREAMS: streams one connection may have
    /// open; the peer's extra streams are refused (REFUSED_STREAM).
    pub max_concurrent_streams: u32,
    /// A connection must send the HTTP/2 preface and one complete request's
    /// headers within this time of being accepted, or it is closed.
    pub handshake_timeout: Duration,
    /// An HTTP/2 PING is sent after this much silence from the peer...
    pub keepalive_interval: Duration,
    /// ...and the connection closed if it is not acknowledged within this.
    pub keepalive_timeout: Duration,
    /// Past this age a connection gets GOAWAY (clients reconnect; running
    /// requests finish)...
    pub max_connection_age: Duration,
    /// ...and is closed this much later if it still has streams open.
    pub max_connection_age_grace: Duration,
    /// A request not answered within this time (an unfinished body
    /// included) is ended with CANCELLED, freeing its stream.
    pub request_timeout: Duration,
}

impl GrpcLimits {
    /// The defaults of the `serve` flags, with 4096 connections in place
    /// of the cap `main` derives from the descriptor limit.
    pub const fn standard() -> Self {
        Self {
            max_connections: 4096,
            max_concurrent_streams: 1000,
            handshake_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            max_connection_age: Duration::from_secs(3600),
            max_connection_age_grace: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("grpc server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves gRPC on `listener` with [`GrpcLimits::standard`]; see
/// [`serve_limited`].
pub async fn serve(
    listener: TcpListener,
    app: App,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    serve_limited(listener, app, GrpcLimits::standard(), shutdown).await
}

/// Serves gRPC on `listener` within `limits` until `shutdown` completes,
/// then reports NOT_SERVING, stops accepting and drains in-flight RPCs for
/// at most `app.drain_timeout`.
pub async fn serve_limited(
    listener: TcpListener,
    app: App,
    limits: GrpcLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let backend = app.limiter.backend().clone();
    // The first answer is known before the first connection is accepted.
    let healthy = probe(&*backend).await;
    set_health(&reporter, healthy).await;
    let monitor = HealthMonitor::spawn(backend, reporter.clone(), healthy);

    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor set is valid");
    let rate_limit = RateLimitService::new(app.limiter.clone())
        .into_server()
        .max_decoding_message_size(MAX_MESSAGE_BYTES);

    let incoming = Listener::new(
        listener,
        "grpc",
        limits.max_connections,
        app.limiter.metrics(),
    )
    // tonic's own grace period skips the GOAWAY when set (it only closes
    // the connection at age + grace), so the connection closes itself.
    .into_incoming(
        Some(limits.handshake_timeout),
        Some(limits.max_connection_age + limits.max_connection_age_grace),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        // tonic's unset default turns hyper's limits off; a peer that keeps
        // opening streams past the limit (each refused) or resetting them
        // gets GOAWAY instead (RUSTSEC-2024-0003, CVE-2023-44487).
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .max_connection_age(limits.max_connection_age)
        .timeout(limits.request_timeout)
        .layer(tower::util::MapRequestLayer::new(request_received))
        .layer(tower::util::MapResponseLayer::new(
            oversized_is_resource_exhausted,
        ))
        .layer(tower::util::MapResponseLayer::new(
            undecodable_is_invalid_argument,
        ))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(rate_limit)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        res = &mut server => return res.map_err(Error::from),
        () = shutdown => {}
    }
    // Order matters: load balancers see NOT_SERVING before connections close.
    drop(monitor);
    set_health(&reporter, false).await;
    let _ = stop_tx.send(());
    match tokio::time::timeout(app.drain_timeout, &mut server).await {
        Ok(res) => res.map_err(Error::from),
        Err(_) => {
            tracing::warn!(
                timeout_ms = app.drain_timeout.as_millis() as u64,
                "in-flight requests still running at the drain deadline; stopping anyway"
            );
            Ok(())
        }
    }
}

/// Probes the backend, for health.
async fn probe(backend: &dyn Backend) -> bool {
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, backend.probe()).await,
        Ok(Ok(()))
    )
}

async fn set_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in HEALTH_SERVICES {
        reporter.set_service_status(name, status).await;
    }
}

/// Probes the backend every second and keeps health in step; the task
/// stops when this guard is dropped, so it never outlives the server.
struct HealthMonitor {
    task: JoinHandle<()>,
}

impl HealthMonitor {
    fn spawn(backend: Arc<dyn Backend>, reporter: HealthReporter, mut healthy: bool) -> Self {
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(PROBE_INTERVAL);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick completes at once; the initial probe was just made.
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let now_healthy = probe(&*backend).await;
                if now_healthy != healthy {
                    if now_healthy {
                        tracing::info!(backend = backend.name(), "backend recovered: serving");
                    } else {
                        tracing::warn!(
                            backend = backend.name(),
                            "backend probe failed: not serving"
                        );
                    }
                    set_health(&reporter, now_healthy).await;
                    healthy = now_healthy;
                }
            }
        });
        Self { task }
    }
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// hyper calls the service once a request's headers are complete: from
/// then on the connection is past its handshake deadline.
fn request_received<B>(request: http::Request<B>) -> http::Request<B> {
    if let Some(info) = request.extensions().get::<ConnInfo>() {
        info.watchdog.request_started();
    }
    request
}

/// tonic refuses an oversized message with OUT_OF_RANGE; Envoy operators
/// expect RESOURCE_EXHAUSTED for "too big". Nothing else in this server
/// answers OUT_OF_RANGE, and decode errors are sent as trailers-only
/// responses, so the status is in the headers.
fn oversized_is_resource_exhausted<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let out_of_range = (tonic::Code::OutOfRange as i32).to_string();
    if headers
        .get("grpc-status")
        .is_some_and(|it| it.as_bytes() == out_of_range.as_bytes())
    {
        headers.insert(
            "grpc-status",
            http::HeaderValue::from(tonic::Code::ResourceExhausted as i32),
        );
    }
    response
}

/// tonic answers INTERNAL when a request cannot be decoded (not protobuf, a
/// truncated frame, a bad compression flag, no message at all). That is a
/// malformed request, not a server fault: INVALID_ARGUMENT says so, and
/// nothing this server decides is ever INTERNAL. Our handlers never answer
/// INTERNAL, and decode errors are sent as trailers-only responses, so the
/// status is in the headers. tonic's reason is kept after our own prefix
/// (`grpc-message` is percent-encoded, so a plain ASCII prefix keeps it valid).
fn undecodable_is_invalid_argument<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let internal = (tonic::Code::Internal as i32).to_string();
    if headers
        .get("grpc-status")
        .is_none_or(|it| it.as_bytes() != internal.as_bytes())
    {
        return response;
    }
    headers.insert(
        "grpc-status",
        http::HeaderValue::from(tonic::Code::InvalidArgument as i32),
    );
    let mut message = b"malformed request: ".to_vec();
    if let Some(reason) = headers.get("grpc-message") {
        message.extend_from_slice(reason.as_bytes());
    } else {
        message.truncate(message.len() - 2);
    }
    if let Ok(value) = http::HeaderValue::from_bytes(&message) {
        headers.insert("grpc-message", value);
    }
    response
}
