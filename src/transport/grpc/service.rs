//! The gRPC RateLimitService: `ShouldRateLimit` decided by the [`Limiter`],
//! its request and answer mapped by [`crate::transport::wire`].
//!
//! The one method is served by hand rather than through tonic's generated
//! server: a unary call with a message of a few dozen bytes needs no
//! streaming decoder, no per-call codec state and no encoder polling a
//! stream of answers. The request's body is read as it arrives (one DATA
//! frame from every client we know, kept without a copy), decoded once,
//! and answered with one prebuilt frame and `grpc-status: 0` in the
//! trailers. What a client sees is what tonic's server would send: the
//! same headers, frames and trailers, and a status for every refusal
//! (UNIMPLEMENTED for a compressed message, RESOURCE_EXHAUSTED past
//! [`MAX_MESSAGE_BYTES`], INVALID_ARGUMENT for a body that is not one
//! `RateLimitRequest`).

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::Either;
use prost::Message as _;
use tonic::body::Body;
use tonic::codegen::http;

use crate::decision::{self, BackendCall, Caller, Limiter};
use crate::metrics::{Method, Metrics};
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::traces::{DecisionTrace, Tracing};
use crate::transport::grpc::MAX_MESSAGE_BYTES;
use crate::transport::grpc::layers::{MAX_STATUS_MESSAGE, cap_status_message};
use crate::transport::grpc::traced;
use crate::transport::wire::{self, from_wire};

/// The path of the one method served.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The gRPC message prefix: a compression flag and a 4-byte length.
const PREFIX_BYTES: usize = 5;

/// Serves `ShouldRateLimit` through a [`Limiter`].
#[derive(Debug, Clone)]
pub struct RateLimitService {
    limiter: Arc<Limiter>,
    /// Where calls in flight are counted.
    metrics: Arc<Metrics>,
    /// `None`: tracing off, and a call costs nothing for it but this test.
    traces: Option<Arc<Tracing>>,
}

impl RateLimitService {
    pub fn new(limiter: Arc<Limiter>, metrics: Arc<Metrics>) -> Self {
        Self {
            limiter,
            metrics,
            traces: None,
        }
    }

    /// Traces each sampled decision with `traces`.
    pub fn with_traces(mut self, traces: Option<Arc<Tracing>>) -> Self {
        self.traces = traces;
        self
    }

    /// Readies the backend for this thread's first request (see
    /// [`Limiter::warm_up`]).
    pub async fn warm_up(&self) {
        self.limiter.warm_up().await;
    }

    /// The answer to a `ShouldRateLimit` call (its path already matched),
    /// its body read from hyper's stream as the server receives it, due
    /// within `timeout` (the client's `grpc-timeout` or the server's).
    pub(super) fn call_http(
        self,
        request: http::Request<hyper::body::Incoming>,
        timeout: Duration,
    ) -> impl Future<Output = http::Response<Reply>> + Send + 'static {
        let refused = identity_encoding(request.headers()).err();
        let arrived = Instant::now();
        let trace = match &self.traces {
            None => None,
            Some(traces) => traces.begin(request.headers()),
        };
        async move {
            if let Some(status) = refused {
                if let Some(trace) = trace {
                    traced::refused(trace, &status);
                }
                return status_response(status).map(Either::Right);
            }
            self.answer(request.into_body(), arrived, timeout, trace)
                .await
        }
    }

    /// The answer to one `ShouldRateLimit` call whose headers were
    /// accepted at `arrived`: a decision, or the status that says why
    /// there is none. Decided by `arrived + timeout`, through the failure
    /// mode when the backend cannot answer by then.
    async fn answer<B>(
        self,
        body: B,
        arrived: Instant,
        timeout: Duration,
        trace: Option<DecisionTrace>,
    ) -> http::Response<Reply>
    where
        B: http_body::Body<Data = Bytes> + Unpin,
        B::Error: Into<tonic::codegen::StdError>,
    {
        let _in_flight = self.metrics.track_in_flight();
        let refused = |trace: Option<DecisionTrace>, status: tonic::Status| {
            if let Some(trace) = trace {
                traced::refused(trace, &status);
            }
            status_response(status).map(Either::Right)
        };
        let reading = Reading(Some(&self.metrics));
        let message = read_message(body).await;
        reading.done();
        let message = match message {
            Ok(message) => message,
            Err(status) => return refused(trace, status),
        };
        let request = match rls::RateLimitRequest::decode(message) {
            Ok(request) => request,
            Err(error) => return refused(trace, malformed(&error.to_string())),
        };
        let traced = trace.as_ref().map(|_| Arc::new(BackendCall::default()));
        let caller = Caller {
            method: Method::ShouldRateLimit,
            deadline: arrived.checked_add(timeout),
            traced: traced.clone(),
        };
        let request = from_wire(request);
        let decided = self.limiter.decide_within(&request, caller).await;
        self.metrics
            .observe_decision_latency(Method::ShouldRateLimit, arrived.elapsed());
        if let (Some(trace), Some(traced)) = (trace, traced) {
            traced::decided(trace, &request.domain, &decided, &traced);
        }
        match decided {
            Ok(decision) => answer_response(&decision),
            Err(error) => status_response(to_status(error)).map(Either::Right),
        }
    }
}

/// A call whose message is being read: dropped before [`Reading::done`]
/// (the client reset the stream, the connection ended, the deadline
/// passed), it is counted as abandoned at the stage `read`.
struct Reading<'a>(Option<&'a Metrics>);

impl Reading<'_> {
    fn done(mut self) {
        self.0 = None;
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        if let Some(metrics) = self.0 {
            metrics.record_abandoned(Method::ShouldRateLimit, crate::backends::Stage::Read);
        }
    }
}

/// The one place a limiter error becomes a gRPC status.
///
/// Envoy's rate-limit filter treats any error (and `Code::UNKNOWN` in the
/// response) as "the service could not decide" and then applies its own
/// `failure_mode_deny` (default: allow). So an infrastructure failure must be
/// a real error status, and a clear one: `UNAVAILABLE` tells operators and
/// retry policies that the backend is down, not that the request was bad.
/// A malformed request is `INVALID_ARGUMENT`: retrying it cannot help.
pub fn to_status(error: decision::Error) -> tonic::Status {
    match error {
        decision::Error::InvalidArgument(message) => tonic::Status::invalid_argument(message),
        decision::Error::Backend(error) => tonic::Status::unavailable(error.to_string()),
        error @ decision::Error::NoConfig => tonic::Status::unavailable(error.to_string()),
    }
}

// === the request ===

/// A request's `grpc-encoding` must be absent or `identity`: this server
/// accepts no compression, and says so in `grpc-accept-encoding`, as
/// tonic's server does.
fn identity_encoding(headers: &http::HeaderMap) -> Result<(), tonic::Status> {
    let Some(encoding) = headers.get("grpc-encoding") else {
        return Ok(());
    };
    if encoding.as_bytes() == b"identity" {
        return Ok(());
    }
    let name = String::from_utf8_lossy(encoding.as_bytes());
    let mut status = tonic::Status::unimplemented(format!(
        "Content is compressed with `{name}` which isn't supported"
    ));
    status.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Err(status)
}

/// What of a request's message has arrived: nothing, one frame's bytes
/// (kept as they came), or several frames' copied together.
enum Received {
    Nothing,
    One(Bytes),
    Joined(BytesMut),
}

impl Received {
    fn add(&mut self, data: Bytes) {
        *self = match std::mem::replace(self, Received::Nothing) {
            Received::Nothing => Received::One(data),
            Received::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.len());
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                Received::Joined(joined)
            }
            Received::Joined(mut joined) => {
                joined.extend_from_slice(&data);
                Received::Joined(joined)
            }
        };
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Received::Nothing => &[],
            Received::One(bytes) => bytes,
            Received::Joined(bytes) => bytes,
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Received::Nothing => Bytes::new(),
            Received::One(bytes) => bytes,
            Received::Joined(bytes) => bytes.freeze(),
        }
    }
}

/// The request's one message, read to the end of the body: refused as
/// soon as its prefix shows it compressed or over [`MAX_MESSAGE_BYTES`],
/// or when more bytes follow it, so that no more than one message's
/// bytes are ever held. Request trailers are read and ignored.
async fn read_message<B>(mut body: B) -> Result<Bytes, tonic::Status>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<tonic::codegen::StdError>,
{
    let mut received = Received::Nothing;
    let mut expected = None;
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(|err| tonic::Status::from_error(err.into()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        received.add(data);
        let bytes = received.bytes();
        if expected.is_none() && bytes.len() >= PREFIX_BYTES {
            expected = Some(PREFIX_BYTES + message_length(bytes)?);
        }
        if let Some(expected) = expected
            && bytes.len() > expected
        {
            return Err(malformed("more than one message in a unary call"));
        }
    }
    match expected {
        None if received.bytes().is_empty() => Err(malformed("no request message")),
        Some(expected) if received.bytes().len() == expected => {
            Ok(received.into_bytes().slice(PREFIX_BYTES..))
        }
        _ => Err(malformed("the body ends inside the request message")),
    }
}

/// The length in a message prefix, within the server's limit, of a
/// message sent uncompressed.
fn message_length(prefix: &[u8]) -> Result<usize, tonic::Status> {
    match prefix[0] {
        0 => {}
        1 => return Err(malformed("a compressed message with no grpc-encoding")),
        flag => return Err(malformed(&format!("invalid compression flag {flag}"))),
    }
    let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if length > MAX_MESSAGE_BYTES {
        return Err(tonic::Status::resource_exhausted(format!(
            "request message of {length} bytes, over the limit of {MAX_MESSAGE_BYTES}"
        )));
    }
    Ok(length)
}

/// A body that is not one `RateLimitRequest`: retrying cannot help.
fn malformed(reason: &str) -> tonic::Status {
    tonic::Status::invalid_argument(format!("malformed request: {reason}"))
}

// === the answer ===

const GRPC_CONTENT_TYPE: http::HeaderValue = http::HeaderValue::from_static("application/grpc");

/// A decided call: `content-type` (the one header, as from tonic's
/// server), the answer in one message frame (a `RateLimitResponse` written
/// straight from the decision, `wire::encode`), and `grpc-status: 0` in
/// the trailers.
fn answer_response(decision: &decision::Decision) -> http::Response<Reply> {
    let length = wire::encoded_len(decision);
    let mut frame = BytesMut::with_capacity(PREFIX_BYTES + length);
    frame.put_u8(0);
    // An answer is far under 4 GiB: a few statuses and headers, each
    // bounded by the request's own limits.
    frame.put_u32(length as u32);
    wire::encode(decision, &mut frame);
    let mut response = http::Response::new(Either::Left(Answer {
        frame: Some(frame.freeze()),
        trailers: true,
    }));
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE);
    response
}

/// A call answered with a status and no message: gRPC's trailers-only
/// form, the status in the response headers, its `grpc-message` cut to
/// [`MAX_STATUS_MESSAGE`] (a message can quote what the client sent).
pub(super) fn status_response(status: tonic::Status) -> http::Response<Body> {
    let (mut parts, ()) = status.into_http::<()>().into_parts();
    cap_status_message(&mut parts.headers, MAX_STATUS_MESSAGE);
    http::Response::from_parts(parts, Body::empty())
}

/// A decided call's body: its message frame, then its trailers.
pub(super) struct Answer {
    frame: Option<Bytes>,
    /// Whether the trailers are still to be sent.
    trailers: bool,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        if let Some(frame) = this.frame.take() {
            return Poll::Ready(Some(Ok(Frame::data(frame))));
        }
        if std::mem::take(&mut this.trailers) {
            let mut trailers = http::HeaderMap::with_capacity(1);
            trailers.insert(
                tonic::Status::GRPC_STATUS,
                http::HeaderValue::from_static("0"),
            );
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.frame.is_none() && !self.trailers
    }

    /// At least the frame, never an exact size: hyper turns an exact size
    /// into `content-length`, which tonic's server never sends with a
    /// message and some clients hand to the application as metadata.
    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        hint.set_lower(self.frame.as_ref().map_or(0, Bytes::len) as u64);
        hint
    }
}

/// A response body as the server sends it: a decided call's [`Answer`]
/// (`Left`), or any other (a refusal, another service's answer) in tonic's
/// body (`Right`).
pub(super) type Reply = Either<Answer, Body>;

#[cfg(test)]
mod tests;
