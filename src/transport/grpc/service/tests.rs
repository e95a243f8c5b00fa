use http_body::Body as _;

use super::*;

#[test]
fn backend_failure_is_unavailable_never_unknown() {
    let cases = [
        crate::backends::Error::Timeout(250),
        crate::backends::Error::Unavailable("refused".to_owned()),
        crate::backends::Error::Protocol("bad reply".to_owned()),
    ];
    for error in cases {
        let status = to_status(decision::Error::Backend(error));
        assert_eq!(status.code(), tonic::Code::Unavailable);
    }
    let status = to_status(decision::Error::InvalidArgument("empty domain".to_owned()));
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(status.message(), "empty domain");
}

/// A body that yields the given frames, in order.
struct Frames(std::collections::VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Poll::Ready(self.get_mut().0.pop_front().map(Ok))
    }
}

fn body(chunks: &[&[u8]]) -> Body {
    let mut frames: std::collections::VecDeque<_> = chunks
        .iter()
        .map(|chunk| Frame::data(Bytes::copy_from_slice(chunk)))
        .collect();
    frames.push_back(Frame::trailers(http::HeaderMap::new()));
    Body::new(Frames(frames))
}

fn framed(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn read(chunks: &[&[u8]]) -> Result<Bytes, tonic::Status> {
    futures_util::FutureExt::now_or_never(read_message(body(chunks))).expect("ready")
}

#[test]
fn a_message_is_read_in_one_frame_or_split_anywhere() {
    let whole = framed(b"hello");
    assert_eq!(read(&[&whole]).expect("read"), &b"hello"[..]);
    for cut in 1..whole.len() {
        let (head, tail) = whole.split_at(cut);
        assert_eq!(read(&[head, tail]).expect("split"), &b"hello"[..], "{cut}");
    }
    let bytes: Vec<&[u8]> = whole.chunks(1).collect();
    assert_eq!(read(&bytes).expect("bytes"), &b"hello"[..]);
    assert_eq!(read(&[&framed(b"")]).expect("empty"), &b""[..]);
}

#[test]
fn bodies_that_are_not_one_message_are_refused() {
    let whole = framed(b"hello");
    let mut two = whole.clone();
    two.extend_from_slice(&framed(b"again"));
    let mut compressed = whole.clone();
    compressed[0] = 1;
    let mut flagged = whole.clone();
    flagged[0] = 7;
    let cases: [(&str, Vec<&[u8]>, &str); 6] = [
        ("empty", vec![], "no request message"),
        ("prefix cut", vec![&whole[..3]], "ends inside"),
        ("message cut", vec![&whole[..7]], "ends inside"),
        ("two messages", vec![&two], "more than one message"),
        ("compressed", vec![&compressed], "compressed message"),
        ("a bad flag", vec![&flagged], "invalid compression flag 7"),
    ];
    for (what, chunks, reason) in cases {
        let status = read(&chunks).expect_err(what);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{what}");
        assert!(
            status.message().starts_with("malformed request: "),
            "{what}"
        );
        assert!(status.message().contains(reason), "{what}: {status:?}");
    }
}

#[test]
fn an_oversized_message_is_refused_from_its_prefix() {
    let mut prefix = vec![0];
    prefix.extend_from_slice(&(MAX_MESSAGE_BYTES as u32 + 1).to_be_bytes());
    let status = read(&[&prefix]).expect_err("oversized");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    let mut at_limit = vec![0];
    at_limit.extend_from_slice(&(MAX_MESSAGE_BYTES as u32).to_be_bytes());
    at_limit.resize(PREFIX_BYTES + MAX_MESSAGE_BYTES, b'x');
    assert_eq!(
        read(&[&at_limit]).expect("at limit").len(),
        MAX_MESSAGE_BYTES
    );
}

#[test]
fn compression_other_than_identity_is_unimplemented() {
    let mut headers = http::HeaderMap::new();
    assert!(identity_encoding(&headers).is_ok());
    headers.insert("grpc-encoding", http::HeaderValue::from_static("identity"));
    assert!(identity_encoding(&headers).is_ok());
    headers.insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
    let status = identity_encoding(&headers).expect_err("gzip");
    assert_eq!(status.code(), tonic::Code::Unimplemented);
    assert_eq!(
        status
            .metadata()
            .get("grpc-accept-encoding")
            .map(|it| it.to_str().ok()),
        Some(Some("identity"))
    );
}

#[test]
fn a_long_encoding_name_gets_a_capped_message() {
    let mut headers = http::HeaderMap::new();
    let name = "x".repeat(15 * 1024);
    headers.insert("grpc-encoding", name.parse().expect("ascii"));
    let status = identity_encoding(&headers).expect_err("not identity");
    assert!(status.message().len() > 15 * 1024);
    let response = status_response(status);
    let headers = response.headers();
    assert_eq!(
        headers.get("grpc-status").map(|it| it.as_bytes()),
        Some(&b"12"[..])
    );
    let message = headers.get("grpc-message").expect("grpc-message");
    assert!(message.len() <= MAX_STATUS_MESSAGE, "{}", message.len());
    assert!(
        message
            .as_bytes()
            .starts_with(b"Content is compressed with `xxx")
    );
    assert!(message.as_bytes().ends_with(b"xxx..."));
    assert_eq!(
        headers.get("grpc-accept-encoding").map(|it| it.as_bytes()),
        Some(&b"identity"[..])
    );
}

#[test]
fn an_answer_has_no_exact_size_so_no_content_length() {
    let decision = decision::Decision {
        overall: decision::Code::Ok,
        statuses: Vec::new(),
        headers: Vec::new(),
    };
    let response = answer_response(&decision);
    assert_eq!(response.headers().len(), 1, "{:?}", response.headers());
    let hint = response.body().size_hint();
    assert_eq!(hint.exact(), None);
    assert_eq!(
        hint.lower(),
        (PREFIX_BYTES + wire::encoded_len(&decision)) as u64
    );
}

#[test]
fn an_answer_is_one_message_frame_then_status_ok() {
    let decision = decision::Decision {
        overall: decision::Code::OverLimit,
        statuses: Vec::new(),
        headers: vec![("RateLimit-Limit".to_owned(), "10".to_owned())],
    };
    let response = answer_response(&decision);
    assert_eq!(
        response.headers().get(http::header::CONTENT_TYPE),
        Some(&GRPC_CONTENT_TYPE)
    );
    let mut body = response.into_body();
    let mut next = || {
        futures_util::FutureExt::now_or_never(poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)))
            .expect("ready")
    };
    let data = next()
        .expect("data")
        .expect("ok")
        .into_data()
        .expect("a data frame");
    let answer = crate::transport::wire::to_wire(decision);
    assert_eq!(&data[..], &framed(&answer.encode_to_vec())[..]);
    let trailers = next()
        .expect("trailers")
        .expect("ok")
        .into_trailers()
        .expect("trailers");
    assert_eq!(
        trailers.get("grpc-status").map(|it| it.as_bytes()),
        Some(&b"0"[..])
    );
    assert!(next().is_none());
}
