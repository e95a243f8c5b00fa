use super::*;

#[test]
fn the_client_timeout_is_read_from_grpc_timeout() {
    let cases = [
        ("1H", Some(Duration::from_secs(3600))),
        ("2M", Some(Duration::from_secs(120))),
        ("3S", Some(Duration::from_secs(3))),
        ("250m", Some(Duration::from_millis(250))),
        ("99999999u", Some(Duration::from_micros(99_999_999))),
        ("7n", Some(Duration::from_nanos(7))),
        ("123456789m", None),
        ("m", None),
        ("", None),
        ("5x", None),
        ("-5m", None),
        ("5 m", None),
    ];
    for (value, expected) in cases {
        let mut headers = http::HeaderMap::new();
        headers.insert(GRPC_TIMEOUT, http::HeaderValue::from_static(value));
        assert_eq!(client_timeout(&headers), expected, "{value:?}");
    }
    assert_eq!(client_timeout(&http::HeaderMap::new()), None);
}

fn status_of(response: &http::Response<Reply>) -> (Option<&[u8]>, Option<&[u8]>) {
    let get = |name| {
        response
            .headers()
            .get(name)
            .map(http::HeaderValue::as_bytes)
    };
    (get("grpc-status"), get("grpc-message"))
}

#[tokio::test]
async fn an_answer_not_ready_in_time_is_cancelled() {
    let ok = || status_response(tonic::Status::ok("")).map(Either::Right);
    let ready = within(Duration::from_millis(1), async { ok() }).await;
    let ready = ready.unwrap_or_else(|never| match never {});
    assert_eq!(status_of(&ready), (Some(&b"0"[..]), None));
    let in_time = within(Duration::from_secs(30), async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        ok()
    })
    .await
    .unwrap_or_else(|never| match never {});
    assert_eq!(status_of(&in_time), (Some(&b"0"[..]), None));
    let never = within(Duration::from_millis(5), std::future::pending()).await;
    let never = never.unwrap_or_else(|never| match never {});
    assert_eq!(
        status_of(&never),
        (Some(&b"1"[..]), Some(&b"Timeout%20expired"[..]))
    );
}
