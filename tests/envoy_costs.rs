//! A real Envoy 1.40 in front of throttlegate: what a request costs. Envoy
//! sends a descriptor's `hits_addend` from the filter's own `rate_limits`
//! and from `RateLimitPerRoute.rate_limits`, as a number or as a format
//! resolved per request; it drops the field on a route's own `rate_limits`
//! (every call costs 1); a format that does not resolve to a number makes
//! it skip the call. And the token-limit pattern: check at cost 0 before,
//! charge what the response reports when the stream ends.
//!
//! Without `ENVOY_BIN` these tests print why they are skipped and pass;
//! under `CI=true` they fail instead (see `support::envoy`).

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::envoy::{Envoy, edge, envoy_bin};
use support::process::{HttpRequest, Serve, ServiceProcess};

const RULE: &str = "generic_key_cost";

/// Limit `limit` a minute on ("generic_key", "cost"), in memory.
async fn service(limit: u32) -> ServiceProcess {
    let mut service = Serve::yaml(&format!(
        "domain: edge\ndescriptors:\n  - key: generic_key\n    value: cost\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    ))
    .spawn();
    service.connect().await;
    service
}

/// One `rate_limits` entry on ("generic_key", "cost") with `more` fields.
fn entry(more: &str) -> String {
    format!("{{actions: [{{generic_key: {{descriptor_value: cost}}}}]{more}}}")
}

/// `typed_per_filter_config` giving the route `rate_limits`.
fn per_route(rate_limits: &str) -> String {
    format!(
        "{{envoy.filters.http.ratelimit: {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute, rate_limits: {rate_limits}}}}}"
    )
}

/// The filter with `failure_mode_deny` and `more` fields.
fn filter(more: &str) -> String {
    format!("timeout: 2s, failure_mode_deny: true{more}")
}

async fn hits(service: &ServiceProcess) -> f64 {
    service
        .metric(&format!(
            "throttlegate_hits_total{{domain=\"edge\",rule=\"{RULE}\"}}"
        ))
        .await
}

/// Requests with `x-cost` set to each of `costs` (none for `None`), one
/// after another: their statuses.
async fn with_costs(addr: SocketAddr, costs: &[Option<&str>]) -> Vec<u16> {
    let mut out = Vec::new();
    for cost in costs {
        let mut request = HttpRequest::get("/");
        if let Some(cost) = cost {
            request = request.header("x-cost", cost);
        }
        out.push(request.send(addr).await.status);
    }
    out
}

async fn start(bin: &Path, service: &ServiceProcess, vars: &[(&str, String)]) -> Envoy {
    let mut config = edge(&[service.grpc]);
    for (name, value) in vars {
        config = config.var(name, value);
    }
    config.start(bin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_on_the_filters_rate_limits_is_the_cost_of_each_call() {
    let Some(bin) = envoy_bin("hits_addend number, filter level") else {
        return;
    };
    let service = service(10).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {number: 3}"));
    let envoy = start(
        &bin,
        &service,
        &[("FILTER", filter(&format!(", rate_limits: {rate_limits}")))],
    )
    .await;
    // 3 + 3 + 3 = 9 of 10: the fourth, needing 3, is over.
    let statuses = with_costs(envoy.addr("HTTP"), &[None; 4]).await;
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(hits(&service).await, 12.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (3, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_on_the_filters_rate_limits_costs_what_the_request_says() {
    let Some(bin) = envoy_bin("hits_addend format, filter level") else {
        return;
    };
    let service = service(10).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {format: \"%REQ(x-cost)%\"}"));
    let envoy = start(
        &bin,
        &service,
        &[("FILTER", filter(&format!(", rate_limits: {rate_limits}")))],
    )
    .await;
    // 4 + 4 = 8; 3 more would be 11; 2 more is 10.
    let statuses = with_costs(
        envoy.addr("HTTP"),
        &[Some("4"), Some("4"), Some("3"), Some("2")],
    )
    .await;
    assert_eq!(statuses, [200, 200, 429, 200]);
    assert_eq!(hits(&service).await, 13.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (3, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_route_rate_limits_send_a_number_and_a_format() {
    let Some(bin) = envoy_bin("hits_addend, RateLimitPerRoute") else {
        return;
    };
    // A number.
    let service_number = service(10).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {number: 3}"));
    let envoy = start(
        &bin,
        &service_number,
        &[("PER_ROUTE", per_route(&rate_limits))],
    )
    .await;
    let statuses = with_costs(envoy.addr("HTTP"), &[None; 4]).await;
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(hits(&service_number).await, 12.0);
    drop(envoy);

    // A format.
    let service_format = service(10).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {format: \"%REQ(x-cost)%\"}"));
    let envoy = start(
        &bin,
        &service_format,
        &[("PER_ROUTE", per_route(&rate_limits))],
    )
    .await;
    let statuses = with_costs(envoy.addr("HTTP"), &[Some("6"), Some("5"), Some("4")]).await;
    assert_eq!(statuses, [200, 429, 200]);
    assert_eq!(hits(&service_format).await, 15.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (2, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_reads_the_cost_from_dynamic_metadata() {
    let Some(bin) = envoy_bin("hits_addend format from dynamic metadata") else {
        return;
    };
    // Envoy 1.40 has no metadata or filter-state field in hits_addend: a
    // format reaches them. Here a filter before the rate-limit filter puts
    // x-cost into the dynamic metadata (namespace tg, key cost).
    let service = service(10).await;
    let rate_limits = format!(
        "[{}]",
        entry(", hits_addend: {format: \"%DYNAMIC_METADATA(tg:cost)%\"}")
    );
    let envoy = start(
        &bin,
        &service,
        &[
            ("FILTER", filter(&format!(", rate_limits: {rate_limits}"))),
            (
                "BEFORE_RATELIMIT",
                "- {name: envoy.filters.http.header_to_metadata, typed_config: \
                 {\"@type\": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config, \
                 request_rules: [{header: x-cost, on_header_present: {metadata_namespace: tg, key: cost, type: STRING}}]}}"
                    .to_owned(),
            ),
        ],
    )
    .await;
    let statuses = with_costs(envoy.addr("HTTP"), &[Some("6"), Some("5"), Some("4")]).await;
    assert_eq!(statuses, [200, 429, 200]);
    assert_eq!(hits(&service).await, 15.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (2, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_addend_on_a_routes_own_rate_limits_is_dropped_and_each_call_costs_one() {
    let Some(bin) = envoy_bin("hits_addend on a route's own rate_limits") else {
        return;
    };
    let service = service(3).await;
    // Envoy accepts the field here, and sends nothing of it.
    let envoy = start(
        &bin,
        &service,
        &[(
            "ROUTE_RATE_LIMITS",
            format!("[{}]", entry(", hits_addend: {number: 5}")),
        )],
    )
    .await;
    let statuses = with_costs(envoy.addr("HTTP"), &[None; 4]).await;
    // Cost 5 would have made the first request over a limit of 3.
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(hits(&service).await, 4.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (3, 1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_that_is_not_a_number_makes_envoy_skip_the_call_and_let_the_request_pass() {
    let Some(bin) = envoy_bin("hits_addend format that does not resolve") else {
        return;
    };
    let service = service(1).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {format: \"%REQ(x-cost)%\"}"));
    let envoy = start(
        &bin,
        &service,
        &[("FILTER", filter(&format!(", rate_limits: {rate_limits}")))],
    )
    .await;
    let addr = envoy.addr("HTTP");
    // The one unit taken, then over.
    assert_eq!(with_costs(addr, &[Some("1"), Some("1")]).await, [200, 429]);
    // Not a number, no header, a negative number: unchecked, they pass
    // although the limit is used up, and throttlegate hears nothing.
    let unresolved = [Some("many"), None, Some("-1"), Some("")];
    assert_eq!(with_costs(addr, &unresolved).await, [200, 200, 200, 200]);
    assert_eq!(hits(&service).await, 2.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (
            counters.ok,
            counters.over_limit,
            counters.error,
            counters.failure_mode_allowed
        ),
        (1, 1, 0, 0)
    );
    // Still limited when the cost resolves.
    assert_eq!(with_costs(addr, &[Some("1")]).await, [429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_of_cost_zero_takes_nothing_and_is_over_once_the_limit_is_used_up() {
    let Some(bin) = envoy_bin("hits_addend 0") else {
        return;
    };
    let service = service(2).await;
    let rate_limits = format!("[{}]", entry(", hits_addend: {format: \"%REQ(x-cost)%\"}"));
    let envoy = start(
        &bin,
        &service,
        &[("FILTER", filter(&format!(", rate_limits: {rate_limits}")))],
    )
    .await;
    let addr = envoy.addr("HTTP");
    // Checks of cost 0 take nothing: 1 + 0 + 0 + 1 fits a limit of 2.
    assert_eq!(
        with_costs(addr, &[Some("1"), Some("0"), Some("0"), Some("1")]).await,
        [200, 200, 200, 200]
    );
    // Used up: a check of cost 0 needs room for one unit, and there is none.
    assert_eq!(with_costs(addr, &[Some("0"), Some("1")]).await, [429, 429]);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (4, 2, 0)
    );
}

/// What the token-limit test asserts; its expected failure names it.
const TOKENS_OVER: &str = "requests must be limited once the tokens reported reach the limit";

/// The token-limit pattern of AI gateways: each request is checked at cost
/// 0 before it is sent on, and charged when its response ends with the
/// tokens the response reports (`x-reply-tokens`, which the upstream here
/// copies from the request). 10 tokens a minute, 4 tokens a request: after
/// three requests 12 tokens are used, so the fourth must be limited.
///
/// EXPECTED TO FAIL today: throttlegate refuses a charge larger than the
/// room left (the third charge, 4 with 2 left, is dropped), so usage stays
/// at 8 and every check keeps passing. It turns green once a limit can be
/// charged after the fact (a per-limit charge mode that takes the whole
/// charge even past the limit); remove the `should_panic` marker then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "requests must be limited once the tokens reported reach the limit")]
async fn token_limit_checks_before_and_charges_the_reported_tokens_after() {
    let Some(bin) = envoy_bin("token limit") else {
        // The marker expects this panic when the test cannot run at all.
        panic!("skipped (no Envoy): {TOKENS_OVER}");
    };
    let service = service(10).await;
    let rate_limits = format!(
        "[{}, {}]",
        entry(", hits_addend: {number: 0}"),
        entry(", apply_on_stream_done: true, hits_addend: {format: \"%RESP(x-reply-tokens)%\"}")
    );
    let envoy = start(
        &bin,
        &service,
        &[("FILTER", filter(&format!(", rate_limits: {rate_limits}")))],
    )
    .await;
    let addr = envoy.addr("HTTP");
    let mut statuses = Vec::new();
    for i in 1..=5u32 {
        let response = HttpRequest::get("/")
            .header("x-reply-tokens", "4")
            .send(addr)
            .await;
        statuses.push(response.status);
        if response.status == 200 {
            // The charge is sent after the response: wait until it is
            // counted (hits count every cost asked, granted or not).
            let deadline = Instant::now() + Duration::from_secs(10);
            let charged = f64::from(4 * statuses.iter().filter(|it| **it == 200).count() as u32);
            while hits(&service).await < charged {
                assert!(
                    Instant::now() < deadline,
                    "charge of request {i} not seen:\n{}",
                    envoy.log()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(counters.error, 0, "{counters:?}");
    assert_eq!(statuses, [200, 200, 200, 429, 429], "{TOKENS_OVER}");
}
