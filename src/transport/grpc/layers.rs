//! The answers of tonic's generated services (health, reflection), with
//! tonic's decode failures given the status codes Envoy operators expect,
//! and the one function that bounds a status message.

use tonic::codegen::http;

/// Longest `grpc-message` the server sends, in bytes as sent. A status
/// message can quote what the client sent (an encoding name, a descriptor
/// value) and a client can make that as long as its headers or a whole
/// message; clients refuse headers much bigger than this.
pub(super) const MAX_STATUS_MESSAGE: usize = 1024;

/// The status codes tonic's own decode failures are answered with, mapped
/// to those Envoy operators expect, in one pass over the response headers
/// (a decode failure is sent as a trailers-only response, so its status is
/// in the headers; a decided call has none there and costs one lookup).
///
/// - tonic refuses an oversized message with OUT_OF_RANGE; Envoy operators
///   expect RESOURCE_EXHAUSTED for "too big". Nothing else in this server
///   answers OUT_OF_RANGE.
/// - tonic answers INTERNAL when a request cannot be decoded (not protobuf,
///   a truncated frame, a bad compression flag, no message at all). That is
///   a malformed request, not a server fault: INVALID_ARGUMENT says so, and
///   nothing this server decides is ever INTERNAL (our handlers never
///   answer it). tonic's reason is kept after our own prefix
///   (`grpc-message` is percent-encoded, so a plain ASCII prefix keeps it
///   valid).
pub(super) fn decode_failure_statuses<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let Some(status) = headers.get(GRPC_STATUS) else {
        return response;
    };
    let status = status.as_bytes();
    if status == code_digits(tonic::Code::OutOfRange).as_bytes() {
        set_status(headers, tonic::Code::ResourceExhausted);
    } else if status == code_digits(tonic::Code::Internal).as_bytes() {
        set_status(headers, tonic::Code::InvalidArgument);
        let mut message = b"malformed request: ".to_vec();
        if let Some(reason) = headers.get(GRPC_MESSAGE) {
            message.extend_from_slice(reason.as_bytes());
        } else {
            message.truncate(message.len() - 2);
        }
        if let Ok(value) = http::HeaderValue::from_bytes(&message) {
            headers.insert(GRPC_MESSAGE, value);
        }
    }
    cap_status_message(headers, MAX_STATUS_MESSAGE);
    response
}

/// Cuts a `grpc-message` longer than `max` bytes (as sent, percent-encoded)
/// to at most `max`: whole characters are kept, and `...` marks the cut.
/// Costs one lookup when the message is short or absent.
pub(super) fn cap_status_message(headers: &mut http::HeaderMap, max: usize) {
    let Some(value) = headers.get(GRPC_MESSAGE) else {
        return;
    };
    if value.len() <= max {
        return;
    }
    let message = percent_encoding::percent_decode(value.as_bytes()).decode_utf8_lossy();
    let mut short = String::new();
    for it in message.chars() {
        let mut buf = [0; 4];
        let encoded = encode_status_message(it.encode_utf8(&mut buf));
        // Room for the closing "...".
        if short.len() + encoded.len() + 3 > max {
            break;
        }
        short.push_str(&encoded);
    }
    short.push_str("...");
    match http::HeaderValue::from_str(&short) {
        Ok(it) => {
            headers.insert(GRPC_MESSAGE, it);
        }
        // Cannot happen (the encoding leaves only visible ASCII), but a
        // status without a message beats an oversized one.
        Err(_) => {
            headers.remove(GRPC_MESSAGE);
        }
    }
}

/// The percent-encoding gRPC asks for in `grpc-message`: every byte
/// outside printable ASCII, and `%` itself.
fn encode_status_message(text: &str) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');
    percent_encoding::utf8_percent_encode(text, SET).to_string()
}

const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");

/// gRPC status codes as `grpc-status` writes them, by number.
const CODE_DIGITS: [&str; 17] = [
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
];

fn code_digits(code: tonic::Code) -> &'static str {
    CODE_DIGITS[code as usize]
}

fn set_status(headers: &mut http::HeaderMap, code: tonic::Code) {
    headers.insert(
        GRPC_STATUS,
        http::HeaderValue::from_static(code_digits(code)),
    );
}

#[cfg(test)]
mod tests;
