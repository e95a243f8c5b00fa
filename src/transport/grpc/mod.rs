//! The gRPC server: the rate-limit service ([`service`]), the rate-limit
//! quota service ([`rlqs`]), health ([`health`]), reflection
//! ([`reflection`]) and the response `layers`,
//! within connection limits, through the stages of a graceful stop; and
//! [`client`], the one call `throttlegate check` makes.

pub mod client;
pub mod health;
mod layers;
pub mod reflection;
pub mod rlqs;
mod routes;
mod server;
pub mod service;
mod threads;
mod traced;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;

use crate::decision::Limiter;
use crate::metrics::Metrics;
use crate::quota::QuotaBook;
use crate::traces::Tracing;
use crate::transport::grpc::health::HealthReports;
use crate::transport::grpc::reflection::{ShortStatus, reflection_v1, reflection_v1alpha};
use crate::transport::grpc::rlqs::QuotaService;
use crate::transport::grpc::routes::{GrpcService, Services};
use crate::transport::grpc::service::RateLimitService;
use crate::transport::health::Health;
use crate::transport::listener::{Conn, Listener};
use crate::transport::tls::{self, Io, TlsAcceptor};

pub use crate::transport::grpc::health::HEALTH_SERVICES;
pub use crate::transport::grpc::reflection::MAX_REFLECTION_STATUS_MESSAGE;
pub use crate::transport::shutdown::{Shutdown, ShutdownControl, ShutdownStage, shutdown_channel};

/// Largest gRPC message accepted; bigger ones are refused before decoding.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Streams refused or reset by the server on one connection before it
/// sends GOAWAY (h2's own default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Streams reset by the peer before being served, at once, before GOAWAY
/// (h2's own default).
const MAX_PENDING_ACCEPT_RESETS: usize = 20;

/// A connection that has sent no request by the handshake deadline gets
/// GOAWAY then, and is closed this much later if it has still sent none.
const FIRST_REQUEST_GRACE: Duration = Duration::from_secs(1);

/// What the server runs.
#[derive(Debug, Clone)]
pub struct GrpcApp {
    pub limiter: Arc<Limiter>,
    /// Where connections and calls in flight are counted.
    pub metrics: Arc<Metrics>,
    /// What `grpc.health.v1.Health` reports, until a stop begins.
    pub health: Health,
    /// The shares of rate-limit quota streams (RLQS).
    pub quota: Arc<QuotaBook>,
    /// How long in-flight RPCs may take to finish once the listener closes.
    pub drain_timeout: Duration,
    /// TLS on every connection (offering ALPN `h2`); `None`: plain text.
    pub tls: Option<TlsAcceptor>,
    /// Traces of `ShouldRateLimit` decisions; `None`: tracing off.
    pub traces: Option<Arc<Tracing>>,
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
    /// headers within this time of being accepted, or it gets GOAWAY (once
    /// its handshakes are done) and is closed [`FIRST_REQUEST_GRACE`] later.
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
    /// Threads serving connections, each with its own single-threaded
    /// runtime (a connection stays on the thread that accepted it); 0:
    /// connections are served on the caller's runtime.
    pub threads: usize,
}

impl GrpcLimits {
    /// The defaults of the `serve` flags, with 4096 connections in place
    /// of the cap `app` derives from the descriptor limit.
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
            threads: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("grpc serving threads could not start: {0}")]
    Threads(std::io::Error),
    #[error("a grpc serving thread stopped unexpectedly")]
    ThreadLost,
}

// === serve ===

/// Serves gRPC on `listener` with [`GrpcLimits::standard`] until `shutdown`
/// completes; see [`serve_limited`].
pub async fn serve(
    listener: TcpListener,
    app: GrpcApp,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let (control, stages) = shutdown_channel();
    let serving = serve_limited(listener, app, GrpcLimits::standard(), stages);
    tokio::pin!(serving);
    tokio::select! {
        res = &mut serving => return res,
        () = shutdown => control.close(),
    }
    serving.await
}

/// Serves gRPC on `listener` within `limits` through the stages of
/// `shutdown`: health turns NOT_SERVING when it leaves
/// [`ShutdownStage::Serving`] (RPCs are still answered), and at
/// [`ShutdownStage::Closing`] the listener closes, Watch streams end and
/// in-flight RPCs drain for at most `app.drain_timeout`.
pub async fn serve_limited(
    listener: TcpListener,
    app: GrpcApp,
    limits: GrpcLimits,
    shutdown: Shutdown,
) -> Result<(), Error> {
    let health = app.health.clone().following(shutdown.clone());
    let (reports, health_service) = HealthReports::start(health).await;
    let rate_limit = RateLimitService::new(app.limiter.clone(), app.metrics.clone())
        .with_traces(app.traces.clone());
    let services = Services {
        health: health_service,
        reflection_v1: ShortStatus(reflection_v1()),
        reflection_v1alpha: ShortStatus(reflection_v1alpha()),
        quota: QuotaService::new(
            app.limiter.clone(),
            app.quota.clone(),
            &app.metrics,
            shutdown.clone(),
        )
        .into_server(),
    };
    let listener = Listener::new(listener, "grpc", limits.max_connections, &app.metrics);
    // A connection with no request by the handshake deadline gets GOAWAY
    // then (server.rs) and its IO fails a grace later, which bounds the TLS
    // and HTTP/2 handshakes too. GOAWAY goes out at the connection's age
    // (server.rs); at age + grace the connection closes itself, whatever
    // its streams.
    let first_deadline = Some(limits.handshake_timeout + FIRST_REQUEST_GRACE);
    let lifetime = Some(limits.max_connection_age + limits.max_connection_age_grace);
    let conns = listener.into_incoming(first_deadline, lifetime);
    let connections = Connections {
        app: app.clone(),
        limits,
        services,
        rate_limit,
        shutdown: shutdown.clone(),
    };
    if limits.threads == 0 {
        let server = connections.serve(conns);
        return follow_stages(server, reports, &shutdown, app.drain_timeout).await;
    }
    let server = threads::spawn(conns, limits.threads, connections)?;
    follow_stages(server, reports, &shutdown, app.drain_timeout).await
}

/// What serves gRPC connections, on whichever runtime polls
/// [`Connections::serve`]: one per serving thread, or one on the caller's
/// runtime.
#[derive(Clone)]
struct Connections<S> {
    app: GrpcApp,
    limits: GrpcLimits,
    /// The gRPC services, as one ([`Services`]).
    services: S,
    /// `ShouldRateLimit`, which the server calls directly.
    rate_limit: RateLimitService,
    shutdown: Shutdown,
}

impl<S: GrpcService> Connections<S> {
    /// Serves the connections of `conns` until the stop's closing stage,
    /// then until the connections it holds are done.
    async fn serve(self, conns: impl Stream<Item = Conn> + Send + 'static) -> Result<(), Error> {
        let Connections {
            app,
            limits,
            services,
            rate_limit,
            shutdown,
        } = self;
        let incoming: Pin<Box<dyn Stream<Item = Io> + Send>> = match &app.tls {
            None => Box::pin(conns.map(Io::Plain)),
            Some(acceptor) => Box::pin(tls::handshaken(
                conns,
                "grpc",
                acceptor.clone(),
                app.metrics.tls_handshake_errors("grpc"),
            )),
        };
        server::serve(incoming, services, rate_limit, limits, shutdown.closing()).await;
        Ok(())
    }
}

/// Runs `server` through the stages of `shutdown`: NOT_SERVING while it
/// still answers, then (the listener closed) Watch streams end and
/// in-flight RPCs drain for at most `drain_timeout`.
async fn follow_stages(
    server: impl Future<Output = Result<(), Error>>,
    reports: HealthReports,
    shutdown: &Shutdown,
    drain_timeout: Duration,
) -> Result<(), Error> {
    tokio::pin!(server);
    tokio::select! {
        res = &mut server => return res,
        () = shutdown.not_serving() => {}
    }
    // Load balancers must see NOT_SERVING while we still answer; the
    // listener closes only at the next stage.
    let watches = reports.not_serving().await;
    tokio::select! {
        res = &mut server => return res,
        () = shutdown.closing() => {}
    }
    watches.end();
    match tokio::time::timeout(drain_timeout, &mut server).await {
        Ok(res) => res,
        Err(_) => {
            tracing::warn!(
                timeout_ms = drain_timeout.as_millis() as u64,
                "in-flight grpc requests still running at the drain deadline; stopping anyway"
            );
            Ok(())
        }
    }
}
