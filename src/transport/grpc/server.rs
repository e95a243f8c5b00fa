//! HTTP/2 connections served with hyper: the settings and limits every
//! connection gets, a deadline on every request, and the graceful stop.
//!
//! tonic's own server would wrap each request in about half a dozen
//! layers (connect info in the request's extensions, a timeout, error
//! recovery, a boxed clone of the whole stack per request); here one
//! service per connection does those jobs directly:
//!
//! - the connection's watchdog learns of each request (its handshake
//!   deadline then no longer applies);
//! - `ShouldRateLimit` goes straight to [`RateLimitService::call_http`],
//!   its body read from hyper's stream as it is, and its answer sent
//!   without a box; every other path goes through the `Services` router
//!   with tonic's body, then through [`layers::decode_failure_statuses`];
//! - each request is bounded by `--grpc-request-timeout-ms`, or by the
//!   client's own `grpc-timeout` when shorter, and answered CANCELLED
//!   ("Timeout expired") when it runs out. The timer is only armed when
//!   the answer is not ready at once.
//!
//! A connection that has sent no request by the handshake deadline gets
//! GOAWAY, so that a client calling at that moment retries on a new
//! connection instead of failing on a closed one; its watchdog closes it
//! a grace later if it still sends none. (A peer that has not finished
//! its TLS or HTTP/2 handshake by then cannot be told anything: it is
//! closed at the same time, without a word.) A connection past
//! `max_connection_age` gets GOAWAY and finishes the requests it has; the
//! listener's lifetime (age plus grace) closes it if they do not. When the stop reaches its closing stage the listener is
//! dropped, every connection gets GOAWAY, and [`serve`] returns once they
//! have all closed.

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::server::Connected;

use super::layers;
use super::rlqs::{ConnectionTag, PeerAddress};
use super::routes::GrpcService;
use super::service::{RateLimitService, Reply, SHOULD_RATE_LIMIT, status_response};
use super::{FIRST_REQUEST_GRACE, GrpcLimits, MAX_LOCAL_ERROR_RESETS, MAX_PENDING_ACCEPT_RESETS};
use crate::transport::listener::Watchdog;
use crate::transport::tls::Io;

/// Serves every connection of `incoming` until `closing` completes, then
/// until the connections still open have finished (each told to stop with
/// GOAWAY).
pub(super) async fn serve<S>(
    incoming: impl Stream<Item = Io>,
    services: S,
    rate_limit: RateLimitService,
    limits: GrpcLimits,
    closing: impl Future<Output = ()>,
) where
    S: GrpcService,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        // A peer that keeps opening streams past the limit (each refused)
        // or resetting them gets GOAWAY (RUSTSEC-2024-0003, CVE-2023-44487).
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        .keep_alive_interval(Some(limits.keepalive_interval))
        .keep_alive_timeout(limits.keepalive_timeout)
        // gRPC has no use for a Date header; it would cost every answer an
        // entry lookup and an HPACK-encoded value.
        .auto_date_header(false);
    // Receivers held by open connections: `closed()` once they have all
    // ended; a send tells them all to stop.
    let (stop, stopping) = tokio::sync::watch::channel(());
    {
        let mut incoming = pin!(incoming);
        let mut closing = pin!(closing);
        loop {
            let io = tokio::select! {
                () = &mut closing => break,
                io = incoming.next() => match io {
                    Some(io) => io,
                    None => break,
                },
            };
            let info = io.connect_info();
            let watchdog = info.watchdog;
            let service = Connection {
                watchdog: watchdog.clone(),
                peer: info.tcp.remote_addr().map(|it| PeerAddress(it.ip())),
                services: services.clone(),
                rate_limit: rate_limit.clone(),
                request_timeout: limits.request_timeout,
            };
            let conn = builder.serve_connection(TokioIo::new(io), service);
            tokio::spawn(serve_connection(
                conn,
                watchdog,
                limits.max_connection_age,
                stopping.clone(),
            ));
        }
        // `incoming` (the listener) is dropped here: no new connection is
        // accepted while the open ones finish.
    }
    let _ = stop.send(());
    drop(stopping);
    stop.closed().await;
}

/// Runs one connection to its end: GOAWAY once it reaches `max_age` or
/// the server stops, its running requests then finished, or when it has
/// sent no request by the handshake deadline (`watchdog`'s deadline less
/// [`FIRST_REQUEST_GRACE`]). hyper sends GOAWAY once the HTTP/2 handshake
/// is done, first with the highest stream id, then, a round trip later,
/// with the last stream it took: a call that crossed it is either served
/// or known by the client to be unprocessed, and retried elsewhere.
async fn serve_connection<S>(
    conn: hyper::server::conn::http2::Connection<TokioIo<Io>, S, TokioExecutor>,
    watchdog: Arc<Watchdog>,
    max_age: Duration,
    mut stopping: tokio::sync::watch::Receiver<()>,
) where
    S: hyper::service::HttpService<Incoming, ResBody = Reply>,
    S::Future: Send + 'static,
{
    let mut conn = pin!(conn);
    let aged = tokio::time::sleep(max_age);
    let mut aged = pin!(aged);
    // gRPC's watchdog holds a deadline until the first request, and none
    // after it.
    let first_request_by = watchdog
        .deadline()
        .and_then(|close| close.checked_sub(FIRST_REQUEST_GRACE));
    let mut awaiting_first = first_request_by.is_some();
    let unasked = tokio::time::sleep_until(first_request_by.unwrap_or_else(Instant::now));
    let mut unasked = pin!(unasked);
    let mut going_away = false;
    loop {
        tokio::select! {
            res = conn.as_mut() => {
                if let Err(err) = res {
                    tracing::debug!(error = %err, "grpc connection ended with an error");
                }
                break;
            }
            () = &mut unasked, if awaiting_first && !going_away => {
                awaiting_first = false;
                if watchdog.deadline().is_some() {
                    going_away = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            () = &mut aged, if !going_away => {
                going_away = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = stopping.changed(), if !going_away => {
                going_away = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// What serves the requests of one connection.
#[derive(Clone)]
struct Connection<S> {
    watchdog: Arc<Watchdog>,
    /// The client's address, for what the quota service bounds per client.
    peer: Option<PeerAddress>,
    services: S,
    rate_limit: RateLimitService,
    request_timeout: Duration,
}

type ReplyFuture = Pin<Box<dyn Future<Output = Result<http::Response<Reply>, Infallible>> + Send>>;

impl<S: GrpcService> hyper::service::Service<http::Request<Incoming>> for Connection<S> {
    type Response = http::Response<Reply>;
    type Error = Infallible;
    type Future = ReplyFuture;

    fn call(&self, request: http::Request<Incoming>) -> ReplyFuture {
        // hyper calls the service once a request's headers are complete:
        // from then on the connection is past its handshake deadline.
        self.watchdog.request_started();
        let timeout = client_timeout(request.headers())
            .map_or(self.request_timeout, |it| it.min(self.request_timeout));
        if request.uri().path() == SHOULD_RATE_LIMIT {
            let answer = self.rate_limit.clone().call_http(request, timeout);
            return Box::pin(within(timeout, answer));
        }
        let mut services = self.services.clone();
        let mut request = request;
        // Streams of the quota service are counted per connection.
        request
            .extensions_mut()
            .insert(ConnectionTag(Arc::as_ptr(&self.watchdog) as usize));
        if let Some(peer) = self.peer {
            request.extensions_mut().insert(peer);
        }
        let answer = async move {
            let response = tower::Service::call(&mut services, request.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            layers::decode_failure_statuses(response).map(Either::Right)
        };
        Box::pin(within(timeout, answer))
    }
}

/// `answer`, or CANCELLED once `timeout` has passed. The answer is polled
/// once before a timer is armed: most are ready at once.
async fn within(
    timeout: Duration,
    answer: impl Future<Output = http::Response<Reply>>,
) -> Result<http::Response<Reply>, Infallible> {
    let mut answer = pin!(answer);
    if let Poll::Ready(response) = poll_fn(|cx| Poll::Ready(answer.as_mut().poll(cx))).await {
        return Ok(response);
    }
    let response = match tokio::time::timeout(timeout, answer).await {
        Ok(response) => response,
        Err(_) => status_response(tonic::Status::cancelled("Timeout expired")).map(Either::Right),
    };
    Ok(response)
}

const GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// The client's deadline from its `grpc-timeout` header (at most 8 digits
/// and a unit: H, M, S, m, u or n); `None` when absent or malformed.
fn client_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let value = headers.get(GRPC_TIMEOUT)?.as_bytes();
    let (digits, unit) = value.split_last().map(|(unit, digits)| (digits, *unit))?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount = digits
        .iter()
        .fold(0u64, |sum, digit| sum * 10 + u64::from(digit - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
