use super::*;
use crate::metrics::ratelimit_names::ResponseTime;

#[test]
fn counters_and_the_response_time_under_the_mapped_names() {
    let stats = RatelimitStats {
        counters: vec![
            (
                "ratelimit.service.rate_limit.api.tenant_\"a\".total_hits".to_owned(),
                4,
            ),
            (
                "ratelimit.service.rate_limit.api.tenant_b.path_x.over_limit".to_owned(),
                2,
            ),
            ("ratelimit.service.config_load_success".to_owned(), 1),
            ("other.thing".to_owned(), 3),
        ],
        response_time: ResponseTime {
            buckets: vec![(1.0, 1), (50.0, 2), (f64::INFINITY, 2)],
            count: 2,
            sum_ms: 30.5,
        },
    };
    let page = render(&stats, &Mapping::envoy_gateway());
    for line in [
        "# TYPE ratelimit_service_rate_limit_total_hits counter",
        "ratelimit_service_rate_limit_total_hits{domain=\"api\",key1=\"tenant_\\\"a\\\"\"} 4",
        "ratelimit_service_rate_limit_over_limit{domain=\"api\",key1=\"tenant_b\",key2=\"path_x\"} 2",
        "ratelimit_service_config_load_success 1",
        "other_thing 3",
        "# TYPE ratelimit_service_response_time_seconds histogram",
        "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"1\"} 1",
        "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"} 2",
        "ratelimit_service_response_time_seconds_sum{grpc_method=\"ShouldRateLimit\"} 30.5",
        "ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\"} 2",
    ] {
        assert!(page.lines().any(|it| it == line), "{line}\n{page}");
    }
    let scaled = Mapping::parse(
        "mappings:\n  - match: ratelimit_server.*.response_time\n    name: rt_seconds\n    scale: 0.001\n",
    )
    .expect("valid");
    let page = render(&stats, &scaled);
    assert!(page.contains("rt_seconds_bucket{le=\"0.05\"} 2"), "{page}");
    assert!(page.contains("rt_seconds_sum 0.0305"), "{page}");
}
