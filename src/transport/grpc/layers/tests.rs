use super::*;

#[test]
fn code_digits_are_the_numbers_of_the_codes() {
    for number in 0..=16 {
        let code = tonic::Code::from_i32(number);
        assert_eq!(code as i32, number);
        assert_eq!(code_digits(code), number.to_string());
    }
}

fn trailers_only(code: tonic::Code, message: Option<&str>) -> http::Response<()> {
    let mut response = http::Response::new(());
    response
        .headers_mut()
        .insert(GRPC_STATUS, http::HeaderValue::from(code as i32));
    if let Some(message) = message {
        let value = http::HeaderValue::from_str(message).expect("ascii");
        response.headers_mut().insert(GRPC_MESSAGE, value);
    }
    response
}

fn status_of(response: &http::Response<()>) -> (Option<&str>, Option<&str>) {
    let text = |name| {
        response
            .headers()
            .get(name)
            .map(|it: &http::HeaderValue| it.to_str().expect("ascii"))
    };
    (text(GRPC_STATUS), text(GRPC_MESSAGE))
}

#[test]
fn decode_failures_get_the_codes_envoy_operators_expect() {
    let oversized = decode_failure_statuses(trailers_only(tonic::Code::OutOfRange, Some("big")));
    assert_eq!(status_of(&oversized), (Some("8"), Some("big")));
    let undecodable =
        decode_failure_statuses(trailers_only(tonic::Code::Internal, Some("bad%20frame")));
    assert_eq!(
        status_of(&undecodable),
        (Some("3"), Some("malformed request: bad%20frame"))
    );
    let no_reason = decode_failure_statuses(trailers_only(tonic::Code::Internal, None));
    assert_eq!(
        status_of(&no_reason),
        (Some("3"), Some("malformed request"))
    );
    for code in [tonic::Code::Unavailable, tonic::Code::InvalidArgument] {
        let kept = decode_failure_statuses(trailers_only(code, Some("m")));
        assert_eq!(status_of(&kept), (Some(code_digits(code)), Some("m")));
    }
    let decided = decode_failure_statuses(http::Response::new(()));
    assert_eq!(status_of(&decided), (None, None));
}

/// The `grpc-message` left after capping `message` (sent encoded, as
/// tonic sends it) at `max`, decoded as a client decodes it.
fn capped(message: &str, max: usize) -> Option<String> {
    let mut headers = http::HeaderMap::new();
    let encoded = encode_status_message(message);
    headers.insert(GRPC_MESSAGE, encoded.parse().unwrap());
    cap_status_message(&mut headers, max);
    let value = headers.get(GRPC_MESSAGE)?;
    assert!(value.len() <= max, "{value:?}");
    let decoded = percent_encoding::percent_decode(value.as_bytes())
        .decode_utf8()
        .expect("whole characters are kept");
    Some(decoded.into_owned())
}

#[test]
fn long_status_messages_are_cut_at_a_character() {
    for limit in [MAX_STATUS_MESSAGE, 256] {
        let check = |message: &str, expected: &str| {
            assert_eq!(
                capped(message, limit).as_deref(),
                Some(expected),
                "{limit}: {message}"
            );
        };
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

#[test]
fn every_status_message_through_the_layers_is_capped() {
    let long = "z".repeat(20 * 1024);
    let kept = decode_failure_statuses(trailers_only(tonic::Code::Unavailable, Some(&long)));
    let (status, message) = status_of(&kept);
    assert_eq!(status, Some("14"));
    let message = message.expect("grpc-message");
    assert!(message.len() <= MAX_STATUS_MESSAGE, "{}", message.len());
    assert!(message.starts_with("zzz") && message.ends_with("..."));
    let undecodable = decode_failure_statuses(trailers_only(tonic::Code::Internal, Some(&long)));
    let (status, message) = status_of(&undecodable);
    assert_eq!(status, Some("3"));
    let message = message.expect("grpc-message");
    assert!(message.len() <= MAX_STATUS_MESSAGE, "{}", message.len());
    assert!(message.starts_with("malformed request: zzz"), "{message}");
}
