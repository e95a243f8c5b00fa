//! A real Envoy 1.40 in front of throttlegate: what a request costs. Envoy
//! sends a descriptor's `hits_addend` from the filter's own `rate_limits`
//! and from `RateLimitPerRoute.rate_limits`, as a number or as a format
//! resolved per request; it drops the field on a route's own `rate_limits`
//! (every call costs 1); a format that does not resolve to a number makes
//! it skip the call. And the token-limit pattern: check at cost 0 before,
//! charge what the response reports when the stream ends, on a limit with
//! `charge: always`, in memory and with two replicas on one Redis.
//!
//! Without `ENVOY_BIN` these tests print why they are skipped and pass;
//! under `CI=true` they fail instead (see `support::envoy`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::envoy::{Envoy, edge, envoy_bin};
use crate::support::process::{HttpRequest, Serve, ServiceProcess, http_get};
use crate::support::redis::RedisServer;

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

/// Tokens a minute per API key in the token-limit tests.
const TOKEN_LIMIT: u32 = 10;

/// The token limit per API key, `charge: always` unless `charged_always`
/// is false (today's all-or-nothing, which drops a charge past the room).
fn token_rules(charged_always: bool) -> String {
    let charge = if charged_always {
        ", charge: always"
    } else {
        ""
    };
    format!(
        "domain: edge\ndescriptors:\n  - key: api_key\n    rate_limit: {{unit: minute, requests_per_unit: {TOKEN_LIMIT}{charge}}}\n"
    )
}

/// The filter of an AI gateway: each request checked at cost 0 on its API
/// key before it is sent on, and charged, when its response ends, the
/// tokens the response reports (`x-reply-tokens`, which the upstream here
/// copies from the request); Envoy's X-RateLimit headers on.
fn token_filter() -> String {
    let key = "{request_headers: {header_name: x-api-key, descriptor_key: api_key}}";
    let rate_limits = format!(
        "[{{actions: [{key}], hits_addend: {{number: 0}}}}, \
         {{actions: [{key}], apply_on_stream_done: true, hits_addend: {{format: \"%RESP(x-reply-tokens)%\"}}}}]"
    );
    filter(&format!(
        ", enable_x_ratelimit_headers: DRAFT_VERSION_03, rate_limits: {rate_limits}"
    ))
}

/// The API-key rule's series of counter `name`, summed over `replicas`
/// (0 where a replica has none yet).
async fn api_key_metric(replicas: &[ServiceProcess], name: &str) -> f64 {
    let series = format!("{name}{{domain=\"edge\",rule=\"api_key\"}} ");
    let mut total = 0.0;
    for replica in replicas {
        let text = http_get(replica.http, "/metrics").await;
        total += text
            .lines()
            .find_map(|line| line.strip_prefix(&series))
            .and_then(|value| value.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
    }
    total
}

/// Tokens charged so far on the API-key rule (hits count every cost
/// asked, allowed or not; a check costs 0).
async fn tokens_counted(replicas: &[ServiceProcess]) -> f64 {
    api_key_metric(replicas, "throttlegate_hits_total").await
}

/// What one request of a token run got.
#[derive(Debug)]
struct TokenReply {
    status: u16,
    /// Seconds until the limit has room, from Envoy's X-RateLimit-Reset.
    reset_s: Option<u64>,
}

/// Requests on API key `key`, one after another, the n-th reporting
/// `usage[n]` tokens. After each admitted one, waits until its charge is
/// counted (`counted`: the tokens charged before the run), so the next
/// check sees it whatever the load.
async fn token_run(
    addr: SocketAddr,
    replicas: &[ServiceProcess],
    envoy: &Envoy,
    key: &str,
    usage: &[u32],
    counted: &mut f64,
) -> Vec<TokenReply> {
    let mut replies = Vec::new();
    for (idx, tokens) in usage.iter().enumerate() {
        let response = HttpRequest::get("/")
            .header("x-api-key", key)
            .header("x-reply-tokens", tokens.to_string())
            .send(addr)
            .await;
        if response.status == 200 {
            *counted += f64::from(*tokens);
            let deadline = Instant::now() + Duration::from_secs(20);
            while tokens_counted(replicas).await < *counted {
                assert!(
                    Instant::now() < deadline,
                    "charge of request {idx} ({tokens} tokens) not seen:\n{}",
                    envoy.log()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let reset_s = response
            .header("x-ratelimit-reset")
            .and_then(|it| it.parse().ok());
        replies.push(TokenReply {
            status: response.status,
            reset_s,
        });
    }
    replies
}

/// The token-limit run, asserted: responses reporting 3, 4, 2, 4, then 1
/// token each, on one API key with 10 tokens a minute. The first four
/// pass (3 + 4 + 2 = 9 leave room for a check; the fourth reports 4, so 13
/// tokens were admitted: past the limit by less than one response's
/// usage), and every request after them gets 429 with a reset within the
/// minute, cost-0 checks included. Another API key is not touched.
async fn assert_token_limit(addr: SocketAddr, replicas: &[ServiceProcess], envoy: &Envoy) {
    let usage = [3, 4, 2, 4, 1, 1, 1, 1];
    let mut counted = 0.0;
    let replies = token_run(addr, replicas, envoy, "alice", &usage, &mut counted).await;
    let statuses: Vec<u16> = replies.iter().map(|it| it.status).collect();
    let admitted: Vec<u32> = usage
        .iter()
        .zip(&statuses)
        .filter(|(_, status)| **status == 200)
        .map(|(tokens, _)| *tokens)
        .collect();
    let tokens: u32 = admitted.iter().sum();
    let largest = admitted.iter().copied().max().unwrap_or(0);
    assert!(
        tokens <= TOKEN_LIMIT + largest,
        "{tokens} tokens admitted: more than one response past {TOKEN_LIMIT} ({statuses:?})"
    );
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 429, 429, 429, 429],
        "requests must be limited once the tokens reported reach the limit"
    );
    for reply in &replies[4..] {
        let reset = reply.reset_s.expect("a 429 says when to come back");
        assert!((1..=60).contains(&reset), "{reply:?}");
    }
    // The charge past the room was recorded: 13 tokens, 3 past the limit.
    assert_eq!(tokens_counted(replicas).await, 13.0);
    let overdraft = api_key_metric(replicas, "throttlegate_overdraft_units_total").await;
    assert_eq!(overdraft, 3.0);
    // Per API key: another key has its own 10 tokens.
    let other = token_run(addr, replicas, envoy, "bob", &[5], &mut counted).await;
    assert_eq!(other[0].status, 200);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(counters.error, 0, "{counters:?}");
    assert_eq!(counters.failure_mode_allowed, 0, "{counters:?}");
}

/// The token-limit pattern of AI gateways, on one throttlegate in memory:
/// the stream-done charge with `charge: always` records usage past the
/// limit, and the checks after it are denied. Without `charge: always` the
/// charge of 4 with 1 token left is dropped, usage stays at 9 and the
/// checks keep passing: this test fails (checked by hand).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limit_checks_before_and_charges_the_reported_tokens_after() {
    let Some(bin) = envoy_bin("token limit") else {
        return;
    };
    let mut service = Serve::yaml(&token_rules(true)).spawn();
    service.connect().await;
    let envoy = edge(&[service.grpc])
        .var("FILTER", token_filter())
        .start(&bin);
    let replicas = [service];
    assert_token_limit(envoy.addr("HTTP"), &replicas, &envoy).await;
}

/// The same with two throttlegate replicas on one Redis behind a
/// two-worker Envoy: checks and charges reach either replica, and the
/// debt a charge leaves in Redis denies the checks of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limit_holds_across_two_replicas_on_one_redis() {
    let Some(bin) = envoy_bin("token limit on Redis") else {
        return;
    };
    let redis = RedisServer::start();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut replica = Serve::yaml(&token_rules(true))
            .args(&["--redis-url", &redis.url()])
            .spawn();
        replica.connect().await;
        replicas.push(replica);
    }
    let envoy = edge(&[replicas[0].grpc, replicas[1].grpc])
        .var("FILTER", token_filter())
        .concurrency(2)
        .start(&bin);
    assert_token_limit(envoy.addr("HTTP"), &replicas, &envoy).await;
    for replica in &replicas {
        let text = http_get(replica.http, "/metrics").await;
        assert!(
            text.contains("throttlegate_decisions_total{domain=\"edge\",rule=\"api_key\""),
            "Envoy sent nothing to replica {}",
            replica.grpc
        );
    }
}

/// A rate-limit service that answers OK to every call and records, per
/// call, the value of its first descriptor entry and the `hits_addend`
/// Envoy sent (`None` when the field is absent).
#[derive(Clone, Default)]
struct RecordingRls {
    calls: std::sync::Arc<std::sync::Mutex<Vec<Recorded>>>,
}

/// One descriptor of a call: its first entry's value, and its `hits_addend`.
type Recorded = (String, Option<u64>);

#[tonic::async_trait]
impl throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService
    for RecordingRls
{
    async fn should_rate_limit(
        &self,
        request: tonic::Request<
            throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest,
        >,
    ) -> Result<
        tonic::Response<throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse>,
        tonic::Status,
    > {
        use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
        use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
        let request = request.into_inner();
        for descriptor in &request.descriptors {
            let value = descriptor
                .entries
                .first()
                .map(|it| String::from_utf8_lossy(&it.value).into_owned())
                .unwrap_or_default();
            let hits = descriptor.hits_addend;
            self.calls.lock().expect("calls").push((value, hits));
        }
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        }))
    }
}

impl RecordingRls {
    /// Serves it on an ephemeral port.
    async fn serve(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the recording service");
        let addr = listener.local_addr().expect("its address");
        let service = throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    /// The `hits_addend` of every call made for descriptor value `value`.
    fn costs_of(&self, value: &str) -> Vec<Option<u64>> {
        let calls = self.calls.lock().expect("calls");
        calls
            .iter()
            .filter(|(it, _)| it == value)
            .map(|(_, hits)| *hits)
            .collect()
    }
}

/// What Envoy 1.40 sends as the cost of a stream-done charge for the
/// usage values an upstream may report in `x-reply-tokens`, recorded by a
/// rate-limit service of the test's own: `None` when Envoy skips the call.
/// A value above 1e9 is skipped (a huge report is free); NaN is sent as
/// 2^63 (a whole debt); a number is read as C's `strtod` would and cut to
/// an integer. docs/token-limits.md states this table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_envoy_sends_for_odd_usage_values() {
    let Some(bin) = envoy_bin("stream-done usage values") else {
        return;
    };
    let rls = RecordingRls::default();
    let addr = rls.serve().await;
    let key = "{request_headers: {header_name: x-api-key, descriptor_key: api_key}}";
    let rate_limits = format!(
        "[{{actions: [{key}], apply_on_stream_done: true, hits_addend: {{format: \"%RESP(x-reply-tokens)%\"}}}}]"
    );
    let envoy = edge(&[addr])
        .var("FILTER", filter(&format!(", rate_limits: {rate_limits}")))
        .start(&bin);
    let http = envoy.addr("HTTP");
    let cases: [(Option<&str>, Option<u64>); 16] = [
        (Some("1000000000"), Some(1_000_000_000)),
        (Some("1000000001"), None),
        (Some("5000000000"), None),
        (Some("1e3"), Some(1000)),
        (Some("0x40"), Some(64)),
        (Some("12.9"), Some(12)),
        (Some(" 30"), Some(30)),
        (Some("inf"), None),
        (None, None),
        (Some(""), None),
        (Some("-1"), None),
        (Some("abc"), None),
        (Some("nan"), Some(1 << 63)),
        (Some("NaN"), Some(1 << 63)),
        (Some("-nan"), Some(1 << 63)),
        (Some("7"), Some(7)),
    ];
    let mut seen = Vec::new();
    for (idx, (value, _)) in cases.iter().enumerate() {
        let api_key = format!("k{idx}");
        let mut call = HttpRequest::get("/").header("x-api-key", &api_key);
        if let Some(value) = value {
            call = call.header("x-reply-tokens", value);
        }
        assert_eq!(call.send(http).await.status, 200);
        // A marker charge after it; once the marker is recorded, and a
        // moment more, a call Envoy made for the value is recorded too.
        let marker = format!("marker{idx}");
        let call = HttpRequest::get("/")
            .header("x-api-key", &marker)
            .header("x-reply-tokens", "1");
        assert_eq!(call.send(http).await.status, 200);
        let deadline = Instant::now() + Duration::from_secs(10);
        while rls.costs_of(&marker).is_empty() {
            assert!(Instant::now() < deadline, "the marker charge never came");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let costs = rls.costs_of(&api_key);
        assert!(costs.len() <= 1, "{value:?}: {costs:?}");
        seen.push((*value, costs.first().map(|it| it.unwrap_or(1))));
    }
    assert_eq!(seen, cases, "(reported, cost Envoy sent)");
}
