use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt;

use super::*;
use crate::clock::ManualClock;
use crate::testing;

const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}\n";

/// The routes' parts, as the composition root builds them.
fn app() -> HttpApp {
    let (_, app) = crate::app::server_apps(
        Arc::new(ArcSwap::from_pointee(testing::rules_from(
            "api.yaml", CONFIG,
        ))),
        Arc::new(ConfigStatus::new(None, std::time::SystemTime::now())),
        testing::memory_backend(&ManualClock::new(testing::T0)),
        testing::default_options(),
        Arc::new(Metrics::new()),
        Duration::ZERO,
    );
    app
}

async fn send(router: &Router, request: Request<Body>) -> (StatusCode, String) {
    let res = router.clone().oneshot(request).await.unwrap();
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn post_json(body: &str) -> Request<Body> {
    Request::post("/json")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

#[tokio::test]
async fn json_decides_in_camel_case_and_accepts_snake_case() {
    let router = router(app());
    let camel = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}],"hitsAddend":1}"#;
    let (status, body) = send(&router, post_json(camel)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        value,
        serde_json::json!({
            "overallCode": "OK",
            "statuses": [{
                "code": "OK",
                "currentLimit": {"requestsPerUnit": 2, "unit": "MINUTE", "name": "per_user"},
                "limitRemaining": 1,
                "durationUntilReset": "60s",
            }],
            "responseHeadersToAdd": [
                {"key": "RateLimit-Limit", "value": "2"},
                {"key": "RateLimit-Remaining", "value": "1"},
                {"key": "RateLimit-Reset", "value": "60"},
            ],
        })
    );
    // snake_case, and a 64-bit number written as a string.
    let snake = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}],"hits_addend":"1"}],"hits_addend":5}"#;
    let (status, body) = send(&router, post_json(snake)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains(r#""code":"OK""#), "{body}");
    // Now exhausted: 429 with the OVER_LIMIT answer.
    let (status, body) = send(&router, post_json(camel)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(body.contains(r#""overallCode":"OVER_LIMIT""#), "{body}");
    assert!(
        body.contains(r#"{"key":"Retry-After","value":"60"}"#),
        "{body}"
    );
}

#[tokio::test]
async fn json_override_by_unit_name_and_bad_requests() {
    let router = router(app());
    let with_override = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"b"}],"limit":{"requestsPerUnit":7,"unit":"HOUR"}}]}"#;
    let (status, body) = send(&router, post_json(with_override)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(
        body.contains(r#""currentLimit":{"requestsPerUnit":7,"unit":"HOUR"}"#),
        "{body}"
    );
    let cases = [
        (r#"{"domain":"","descriptors":[]}"#, "empty domain"),
        (r#"{"domain":"api"}"#, "no descriptors"),
        (r#"{"domain":"api","descriptor":[]}"#, "unknown field"),
        (r#"{"domain":"api","#, ""),
    ];
    for (body, reason) in cases {
        let (status, text) = send(&router, post_json(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {text}");
        assert!(text.contains(reason), "{body}: {text}");
    }
}

#[tokio::test]
async fn json_decides_values_of_any_length() {
    let router = router(app());
    let long = "v".repeat(2_000);
    let body = format!(
        r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"user","value":"{long}"}}]}}]}}"#
    );
    for remaining in [1, 0] {
        let (status, text) = send(&router, post_json(&body)).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            value["statuses"][0]["limitRemaining"].as_u64().unwrap_or(0),
            remaining
        );
    }
    let (status, _) = send(&router, post_json(&body)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn json_reads_a_body_sent_without_a_json_content_type() {
    // What `curl -d` sends.
    let request = Request::post("/json")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(
            r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#,
        ))
        .unwrap();
    let (status, body) = send(&router(app()), request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains(r#""overallCode":"OK""#), "{body}");
}

#[tokio::test]
async fn json_body_over_64_kib_is_refused() {
    let router = router(app());
    let huge = format!(
        r#"{{"domain":"api","descriptors":[{{"entries":[{{"key":"user","value":"{}"}}]}}]}}"#,
        "v".repeat(70 * 1024)
    );
    let (status, _) = send(&router, post_json(&huge)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let small = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#;
    let (status, body) = send(&router, post_json(small)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn metrics_expose_the_decisions_made_over_json() {
    let router = router(app());
    let body = r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#;
    for _ in 0..3 {
        send(&router, post_json(body)).await;
    }
    let res = router
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        res.headers().get("content-type").unwrap(),
        crate::metrics::CONTENT_TYPE
    );
    let text = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    let text = String::from_utf8(text.to_vec()).unwrap();
    // 2 per minute: remaining 1 is ok, 0 is near the limit, then over.
    for (result, count) in [("ok", 1), ("near_limit", 1), ("over_limit", 1)] {
        let line = format!(
            "throttlegate_decisions_total{{domain=\"api\",rule=\"user\",result=\"{result}\"}} {count}\n"
        );
        assert!(text.contains(&line), "{line}{text}");
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}

#[tokio::test]
async fn healthcheck_and_rlconfig() {
    let router = router(app());
    let (status, body) = send(
        &router,
        Request::get("/healthcheck").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "OK\n"));
    let (status, body) = send(
        &router,
        Request::get("/rlconfig").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("domain api"), "{body}");
    assert!(body.contains("2/minute"), "{body}");
}
