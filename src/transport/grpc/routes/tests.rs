use super::*;

#[test]
fn the_service_is_the_first_segment_of_a_method_path() {
    let cases = [
        (
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            Some("envoy.service.ratelimit.v3.RateLimitService"),
        ),
        (
            "/grpc.health.v1.Health/Check",
            Some("grpc.health.v1.Health"),
        ),
        ("/grpc.health.v1.Health/a/b", Some("grpc.health.v1.Health")),
        ("/grpc.health.v1.Health/", None),
        ("/grpc.health.v1.Health", None),
        ("grpc.health.v1.Health/Check", None),
        ("/", None),
        ("", None),
    ];
    for (path, expected) in cases {
        assert_eq!(service_name(path), expected, "{path}");
    }
}

#[test]
fn unknown_services_are_unimplemented() {
    let response = unimplemented();
    assert_eq!(response.status(), http::StatusCode::OK);
    let status = response.headers().get("grpc-status").expect("grpc-status");
    assert_eq!(status.as_bytes(), b"12");
}
