//! Layers around every gRPC service: the handshake watchdog learns of each
//! request, and tonic's decode failures get the status codes Envoy
//! operators expect.

use tonic::codegen::http;

use crate::transport::listener::ConnInfo;

/// hyper calls the service once a request's headers are complete: from
/// then on the connection is past its handshake deadline.
pub(super) fn request_received<B>(request: http::Request<B>) -> http::Request<B> {
    if let Some(info) = request.extensions().get::<ConnInfo>() {
        info.watchdog.request_started();
    }
    request
}

/// tonic refuses an oversized message with OUT_OF_RANGE; Envoy operators
/// expect RESOURCE_EXHAUSTED for "too big". Nothing else in this server
/// answers OUT_OF_RANGE, and decode errors are sent as trailers-only
/// responses, so the status is in the headers.
pub(super) fn oversized_is_resource_exhausted<B>(
    mut response: http::Response<B>,
) -> http::Response<B> {
    replace_status(
        response.headers_mut(),
        tonic::Code::OutOfRange,
        tonic::Code::ResourceExhausted,
    );
    response
}

/// tonic answers INTERNAL when a request cannot be decoded (not protobuf, a
/// truncated frame, a bad compression flag, no message at all). That is a
/// malformed request, not a server fault: INVALID_ARGUMENT says so, and
/// nothing this server decides is ever INTERNAL. Our handlers never answer
/// INTERNAL, and decode errors are sent as trailers-only responses, so the
/// status is in the headers. tonic's reason is kept after our own prefix
/// (`grpc-message` is percent-encoded, so a plain ASCII prefix keeps it valid).
pub(super) fn undecodable_is_invalid_argument<B>(
    mut response: http::Response<B>,
) -> http::Response<B> {
    let headers = response.headers_mut();
    if !replace_status(headers, tonic::Code::Internal, tonic::Code::InvalidArgument) {
        return response;
    }
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

/// Sets the `grpc-status` header to `to` if it is `from`; true if it was.
fn replace_status(headers: &mut http::HeaderMap, from: tonic::Code, to: tonic::Code) -> bool {
    let from = (from as i32).to_string();
    if headers
        .get("grpc-status")
        .is_none_or(|it| it.as_bytes() != from.as_bytes())
    {
        return false;
    }
    headers.insert("grpc-status", http::HeaderValue::from(to as i32));
    true
}
