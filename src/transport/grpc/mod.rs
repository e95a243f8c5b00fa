//! The gRPC server: rate-limit service, health, reflection, connection limits, graceful shutdown.

pub mod service;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

use crate::backends::Backend;
use crate::decision::Limiter;
use crate::transport::grpc::service::RateLimitService;
use crate::transport::listener::{ConnInfo, Listener};

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
    /// How long in-flight RPCs may take to finish once the listener closes.
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

// === shutdown ===

/// Where a graceful stop stands; stages only move forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// No stop asked for.
    Serving,
    /// Health reports NOT_SERVING so that load balancers move away, while
    /// the listeners still accept and every request is answered.
    NotServing,
    /// The listeners are closed and in-flight requests drain.
    Closing,
}

/// Moves every [`Shutdown`] made with it through the [`Stage`]s. Dropping
/// it counts as [`Stage::Closing`], so no server outlives its owner.
#[derive(Debug)]
pub struct ShutdownControl {
    stage: watch::Sender<Stage>,
}

/// What a server follows during a graceful stop; cheap to clone.
#[derive(Debug, Clone)]
pub struct Shutdown {
    stage: watch::Receiver<Stage>,
}

/// A control and the [`Shutdown`] it drives, at [`Stage::Serving`].
pub fn shutdown_channel() -> (ShutdownControl, Shutdown) {
    let (stage_tx, stage_rx) = watch::channel(Stage::Serving);
    (
        ShutdownControl { stage: stage_tx },
        Shutdown { stage: stage_rx },
    )
}

impl ShutdownControl {
    /// Health turns NOT_SERVING; requests are still answered.
    pub fn not_serving(&self) {
        self.advance(Stage::NotServing);
    }

    /// The listeners close and in-flight requests drain (health is
    /// NOT_SERVING too, if it was not yet).
    pub fn close(&self) {
        self.advance(Stage::Closing);
    }

    fn advance(&self, stage: Stage) {
        self.stage.send_if_modified(|current| {
            let later = *current < stage;
            if later {
                *current = stage;
            }
            later
        });
    }
}

impl Shutdown {
    /// The current stage; [`Stage::Closing`] once the control is dropped.
    pub fn stage(&self) -> Stage {
        if self.stage.has_changed().is_err() {
            return Stage::Closing;
        }
        *self.stage.borrow()
    }

    /// Completes when health should turn NOT_SERVING.
    pub async fn not_serving(&self) {
        self.reached(Stage::NotServing).await;
    }

    /// Completes when the listeners should close.
    pub async fn closing(&self) {
        self.reached(Stage::Closing).await;
    }

    async fn reached(&self, stage: Stage) {
        let mut stage_rx = self.stage.clone();
        // An error means the control was dropped, which counts as closing.
        let _ = stage_rx.wait_for(|current| *current >= stage).await;
    }
}

// === serve ===

/// Serves gRPC on `listener` with [`GrpcLimits::standard`] until `shutdown`
/// completes; see [`serve_limited`].
pub async fn serve(
    listener: TcpListener,
    app: App,
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
/// `shutdown`: health turns NOT_SERVING when it leaves [`Stage::Serving`]
/// (RPCs are still answered), and at [`Stage::Closing`] the listener
/// closes, Watch streams end and in-flight RPCs drain for at most
/// `app.drain_timeout`.
pub async fn serve_limited(
    listener: TcpListener,
    app: App,
    limits: GrpcLimits,
    shutdown: Shutdown,
) -> Result<(), Error> {
    let reporter = HealthReporter::new();
    let backend = app.limiter.backend().clone();
    // The first answer is known before the first connection is accepted.
    let healthy = probe(&*backend).await;
    set_health(&reporter, healthy).await;
    let monitor = HealthMonitor::spawn(backend, reporter.clone(), healthy);
    let (end_watches, watches_ended) = watch::channel(false);
    let health_service = HealthServer::new(HealthUntilClosed {
        inner: HealthService::from_health_reporter(reporter.clone()),
        shutdown: shutdown.clone(),
        ended: watches_ended,
    });

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
    let closing = shutdown.clone();
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
        .add_service(ShortStatus(reflection_v1()))
        .add_service(ShortStatus(reflection_v1alpha()))
        .add_service(rate_limit)
        .serve_with_incoming_shutdown(incoming, closing.closing());
    tokio::pin!(server);
    tokio::select! {
        res = &mut server => return res.map_err(Error::from),
        () = shutdown.not_serving() => {}
    }
    // Load balancers must see NOT_SERVING while we still answer; the
    // listener closes only at the next stage.
    drop(monitor);
    set_health(&reporter, false).await;
    tokio::select! {
        res = &mut server => return res.map_err(Error::from),
        () = shutdown.closing() => {}
    }
    // Only now: a watcher has been sent NOT_SERVING before its stream ends.
    let _ = end_watches.send(true);
    match tokio::time::timeout(app.drain_timeout, &mut server).await {
        Ok(res) => res.map_err(Error::from),
        Err(_) => {
            tracing::warn!(
                timeout_ms = app.drain_timeout.as_millis() as u64,
                "in-flight grpc requests still running at the drain deadline; stopping anyway"
            );
            Ok(())
        }
    }
}

// === health ===

/// `grpc.health.v1.Health` that answers NOT_SERVING from the moment a
/// stop begins, and whose Watch streams end when the listeners close. A
/// Watch never ends on its own, so an open one would otherwise hold the
/// drain until its deadline.
struct HealthUntilClosed {
    inner: HealthService,
    /// Read by Check itself, so that it never answers SERVING once the stop
    /// has begun, even before the reporter has been told.
    shutdown: Shutdown,
    /// Turns true when every Watch stream is to end.
    ended: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl Health for HealthUntilClosed {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        // Unknown service names stay NOT_FOUND.
        let res = self.inner.check(request).await?;
        if self.shutdown.stage() == Stage::Serving {
            return Ok(res);
        }
        Ok(Response::new(HealthCheckResponse {
            status: tonic_health::pb::health_check_response::ServingStatus::NotServing.into(),
        }))
    }

    type WatchStream = WatchUntilClosed;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut ended = self.ended.clone();
        Ok(Response::new(WatchUntilClosed {
            statuses,
            // An error means the server is gone: end the stream as well.
            ended: Some(Box::pin(async move {
                let _ = ended.wait_for(|it| *it).await;
            })),
            finished: false,
        }))
    }
}

/// The status changes of one Watch call, then UNAVAILABLE when the
/// listeners close, so that the client looks for another server.
struct WatchUntilClosed {
    statuses: tonic_health::server::WatchStream,
    /// Completes when the stream is to end; `None` once it has.
    ended: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    finished: bool,
}

impl Stream for WatchUntilClosed {
    type Item = Result<HealthCheckResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if let Some(ended) = self.ended.as_mut()
            && ended.as_mut().poll(cx).is_ready()
        {
            self.ended = None;
        }
        // A change not yet sent (NOT_SERVING) goes out before the end.
        match Pin::new(&mut self.statuses).poll_next(cx) {
            Poll::Ready(Some(change)) => Poll::Ready(Some(change)),
            Poll::Ready(None) => {
                self.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending if self.ended.is_none() => {
                self.finished = true;
                Poll::Ready(Some(Err(Status::unavailable("server is shutting down"))))
            }
            Poll::Pending => Poll::Pending,
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

// === reflection ===

/// Longest `grpc-message` a reflection service sends, in bytes as sent.
/// Its errors quote the symbol or file name asked for, which a client can
/// make as long as a whole message: a trailer that big is refused by
/// clients.
pub const MAX_REFLECTION_STATUS_MESSAGE: usize = 256;

/// Every service this server answers, in both reflection versions, so that
/// `grpcurl list` shows them whichever version the tool speaks.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
}

/// `grpc.reflection.v1`.
fn reflection_v1() -> tonic_reflection::server::v1::ServerReflectionServer<
    impl tonic_reflection::server::v1::ServerReflection,
> {
    reflection_builder()
        .build_v1()
        .expect("the embedded descriptor sets are valid")
}

/// `grpc.reflection.v1alpha`, still the only version older grpcurl,
/// Postman and Evans speak.
fn reflection_v1alpha() -> tonic_reflection::server::v1alpha::ServerReflectionServer<
    impl tonic_reflection::server::v1alpha::ServerReflection,
> {
    reflection_builder()
        .build_v1alpha()
        .expect("the embedded descriptor sets are valid")
}

/// A gRPC service whose status messages, in headers or trailers, are cut
/// to [`MAX_REFLECTION_STATUS_MESSAGE`].
#[derive(Debug, Clone)]
struct ShortStatus<S>(S);

impl<S: NamedService> NamedService for ShortStatus<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for ShortStatus<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let (mut parts, body) = response.await?.into_parts();
            shorten_status_message(&mut parts.headers);
            Ok(http::Response::from_parts(
                parts,
                tonic::body::Body::new(ShortStatusBody(body)),
            ))
        })
    }
}

/// A response body whose trailers go through [`shorten_status_message`].
struct ShortStatusBody(tonic::body::Body);

impl http_body::Body for ShortStatusBody {
    type Data = tonic::codegen::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.0).poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame.map(|mut frame| {
                    if let Some(trailers) = frame.trailers_mut() {
                        shorten_status_message(trailers);
                    }
                    frame
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// Cuts a `grpc-message` longer than [`MAX_REFLECTION_STATUS_MESSAGE`]
/// bytes: whole characters are kept, and `...` marks the cut.
fn shorten_status_message(headers: &mut http::HeaderMap) {
    let Some(value) = headers.get("grpc-message") else {
        return;
    };
    if value.len() <= MAX_REFLECTION_STATUS_MESSAGE {
        return;
    }
    let message = percent_encoding::percent_decode(value.as_bytes()).decode_utf8_lossy();
    let mut short = String::new();
    for it in message.chars() {
        let mut buf = [0; 4];
        let encoded = encode_status_message(it.encode_utf8(&mut buf));
        // Room for the closing "...".
        if short.len() + encoded.len() + 3 > MAX_REFLECTION_STATUS_MESSAGE {
            break;
        }
        short.push_str(&encoded);
    }
    short.push_str("...");
    match http::HeaderValue::from_str(&short) {
        Ok(it) => {
            headers.insert("grpc-message", it);
        }
        // Cannot happen (the encoding leaves only visible ASCII), but a
        // status without a message beats an oversized one.
        Err(_) => {
            headers.remove("grpc-message");
        }
    }
}

/// The percent-encoding gRPC asks for in `grpc-message`: every byte
/// outside printable ASCII, and `%` itself.
fn encode_status_message(text: &str) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');
    percent_encoding::utf8_percent_encode(text, SET).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `grpc-message` left after shortening `message` (sent encoded,
    /// as tonic sends it), decoded as a client decodes it.
    fn shortened(message: &str) -> Option<String> {
        let mut headers = http::HeaderMap::new();
        let encoded = encode_status_message(message);
        headers.insert("grpc-message", encoded.parse().unwrap());
        shorten_status_message(&mut headers);
        let value = headers.get("grpc-message")?;
        assert!(value.len() <= MAX_REFLECTION_STATUS_MESSAGE, "{value:?}");
        let decoded = percent_encoding::percent_decode(value.as_bytes())
            .decode_utf8()
            .expect("whole characters are kept");
        Some(decoded.into_owned())
    }

    fn check(message: &str, expected: &str) {
        assert_eq!(shortened(message).as_deref(), Some(expected), "{message}");
    }

    #[test]
    fn long_status_messages_are_cut_at_a_character() {
        let limit = MAX_REFLECTION_STATUS_MESSAGE;
        check("symbol 'a.b' not found", "symbol 'a.b' not found");
        check(&"x".repeat(limit), &"x".repeat(limit));
        check(
            &"x".repeat(limit + 1),
            &format!("{}...", "x".repeat(limit - 3)),
        );
        // "é" is sent as %C3%A9: 6 bytes, never split.
        check(
            &"é".repeat(limit),
            &format!("{}...", "é".repeat((limit - 3) / 6)),
        );
        // "%" is sent as %25.
        check(
            &"%".repeat(limit),
            &format!("{}...", "%".repeat((limit - 3) / 3)),
        );
        check(
            &format!("symbol '{}' not found", "y".repeat(60 * 1024)),
            &format!("symbol '{}...", "y".repeat(limit - 3 - 8)),
        );
    }
}
