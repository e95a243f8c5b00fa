//! A real Envoy 1.40 in front of throttlegate, counting: exact counts with
//! two replicas on one Redis, every descriptor action Envoy's route
//! `rate_limits` offer, values that are not UTF-8 or are long, and a config
//! reload under traffic. Each test drives HTTP through Envoy and checks the
//! status codes, Envoy's own `ratelimit.*` counters and throttlegate's
//! metrics.
//!
//! Without `ENVOY_BIN` these tests print why they are skipped and pass;
//! under `CI=true` they fail instead (see `support::envoy`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support::envoy::{Envoy, RateLimitCounters, edge, envoy_bin};
use crate::support::process::{HttpRequest, Serve, ServiceProcess};
use crate::support::redis::RedisServer;

/// `throttlegate_decisions_total` of domain `edge`, rule `rule`, result
/// `result`, as exposed.
fn decisions(rule: &str, result: &str) -> String {
    format!("throttlegate_decisions_total{{domain=\"edge\",rule=\"{rule}\",result=\"{result}\"}}")
}

/// Allowed decisions of `rule`: `ok` plus `near_limit`.
async fn allowed(service: &ServiceProcess, rule: &str) -> f64 {
    service.metric(&decisions(rule, "ok")).await
        + service.metric(&decisions(rule, "near_limit")).await
}

/// Both sides counted the same answers: throttlegate denied `rule`
/// `over_limit` times, and Envoy's filter on the protected cluster saw `ok`
/// OK and `over_limit` OVER_LIMIT answers, and no error.
async fn assert_counted(
    service: &ServiceProcess,
    envoy: &Envoy,
    rule: &str,
    ok: u64,
    over_limit: u64,
) {
    assert_eq!(
        service.metric(&decisions(rule, "over_limit")).await,
        over_limit as f64,
        "throttlegate's over-limit decisions of {rule}"
    );
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        (counters.ok, counters.over_limit, counters.error),
        (ok, over_limit, 0),
        "Envoy's ok, over_limit and error"
    );
}

fn ip(last: [u8; 2]) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, last[0], last[1]))
}

/// A service of `rules` (domain `edge`, in memory) behind an Envoy whose
/// route has `rate_limits`.
async fn start(bin: &Path, rules: &str, rate_limits: &str) -> (ServiceProcess, Envoy) {
    let mut service = Serve::yaml(&format!("domain: edge\ndescriptors:\n{rules}")).spawn();
    service.connect().await;
    let envoy = edge(&[service.grpc])
        .var("ROUTE_RATE_LIMITS", rate_limits)
        .var("FILTER", "timeout: 2s, failure_mode_deny: true")
        .start(bin);
    (service, envoy)
}

/// The statuses of `requests`, sent one after another.
async fn statuses(addr: SocketAddr, requests: &[HttpRequest<'_>]) -> Vec<u16> {
    let mut out = Vec::new();
    for request in requests {
        out.push(request.send(addr).await.status);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_one_redis_let_exactly_the_limit_through_concurrent_clients() {
    let Some(bin) = envoy_bin("exact counting") else {
        return;
    };
    const LIMIT: usize = 25;
    const CLIENTS: usize = 80;
    let redis = RedisServer::start();
    let rules = format!(
        "domain: edge\ndescriptors:\n  - key: generic_key\n    value: exact\n    rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}\n"
    );
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let mut replica = Serve::yaml(&rules)
            .args(&["--redis-url", &redis.url()])
            .spawn();
        replica.connect().await;
        replicas.push(replica);
    }
    let envoy = edge(&[replicas[0].grpc, replicas[1].grpc])
        .var(
            "ROUTE_RATE_LIMITS",
            "[{actions: [{generic_key: {descriptor_value: exact}}]}]",
        )
        .var("FILTER", "timeout: 5s, failure_mode_deny: true")
        .concurrency(2)
        .start(&bin);
    let addr = envoy.addr("HTTP");

    let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                HttpRequest::get("/").send(addr).await.status
            })
        })
        .collect();
    let mut passed = 0;
    let mut limited = 0;
    for client in clients {
        match client.await.expect("client task") {
            200 => passed += 1,
            429 => limited += 1,
            other => panic!("status {other}: neither allowed nor limited"),
        }
    }
    assert_eq!((passed, limited), (LIMIT, CLIENTS - LIMIT));

    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        counters,
        RateLimitCounters {
            ok: LIMIT as u64,
            over_limit: (CLIENTS - LIMIT) as u64,
            error: 0,
            failure_mode_allowed: 0,
        }
    );
    let rule = "generic_key_exact";
    let mut total_allowed = 0.0;
    let mut total_denied = 0.0;
    for replica in &replicas {
        let allowed = allowed(replica, rule).await;
        let denied = replica.metric(&decisions(rule, "over_limit")).await;
        assert!(
            allowed + denied > 0.0,
            "Envoy sent nothing to replica {}",
            replica.grpc
        );
        total_allowed += allowed;
        total_denied += denied;
    }
    assert_eq!(total_allowed, LIMIT as f64);
    assert_eq!(total_denied, (CLIENTS - LIMIT) as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_address_limits_each_client_address() {
    let Some(bin) = envoy_bin("remote_address") else {
        return;
    };
    let (service, envoy) = start(
        &bin,
        "  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{remote_address: {}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let first = HttpRequest::get("/").from(ip([0, 2]));
    assert_eq!(
        statuses(addr, &[first.clone(), first.clone(), first]).await,
        [200, 200, 429]
    );
    let other = HttpRequest::get("/").from(ip([0, 3]));
    assert_eq!(statuses(addr, &[other]).await, [200]);
    assert_eq!(allowed(&service, "remote_address").await, 3.0);
    assert_counted(&service, &envoy, "remote_address", 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_remote_address_limits_each_network() {
    let Some(bin) = envoy_bin("masked_remote_address") else {
        return;
    };
    // Envoy sends ("masked_remote_address", "127.0.0.0/24").
    let (service, envoy) = start(
        &bin,
        "  - key: masked_remote_address\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{masked_remote_address: {v4_prefix_mask_len: 24}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let requests = [
        HttpRequest::get("/").from(ip([0, 2])),
        HttpRequest::get("/").from(ip([0, 3])),
        // Another address of the same /24: its third request.
        HttpRequest::get("/").from(ip([0, 4])),
        // Another /24.
        HttpRequest::get("/").from(ip([1, 2])),
    ];
    assert_eq!(statuses(addr, &requests).await, [200, 200, 429, 200]);
    assert_counted(&service, &envoy, "masked_remote_address", 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_headers_limit_each_header_value_and_skip_requests_without_it() {
    let Some(bin) = envoy_bin("request_headers") else {
        return;
    };
    let (service, envoy) = start(
        &bin,
        "  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{request_headers: {header_name: x-user, descriptor_key: user}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let alice = HttpRequest::get("/").header("x-user", "alice");
    let bob = HttpRequest::get("/").header("x-user", "bob");
    assert_eq!(
        statuses(addr, &[alice.clone(), alice.clone(), alice, bob]).await,
        [200, 200, 429, 200]
    );
    // No header: no descriptor, so Envoy does not ask at all.
    assert_eq!(statuses(addr, &[HttpRequest::get("/")]).await, [200]);
    assert_eq!(allowed(&service, "user").await, 3.0);
    assert_counted(&service, &envoy, "user", 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_key_limits_every_request_of_the_route() {
    let Some(bin) = envoy_bin("generic_key") else {
        return;
    };
    let (service, envoy) = start(
        &bin,
        "  - key: plan\n    value: free\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{generic_key: {descriptor_key: plan, descriptor_value: free}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let any = HttpRequest::get("/");
    assert_eq!(
        statuses(addr, &[any.clone(), any.clone(), any]).await,
        [200, 200, 429]
    );
    assert_counted(&service, &envoy, "plan_free", 2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_value_match_limits_only_matching_requests() {
    let Some(bin) = envoy_bin("header_value_match") else {
        return;
    };
    // Envoy sends ("header_match", "beta") when x-beta is present.
    let (service, envoy) = start(
        &bin,
        "  - key: header_match\n    value: beta\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{header_value_match: {descriptor_value: beta, headers: [{name: x-beta, present_match: true}]}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let beta = HttpRequest::get("/").header("x-beta", "1");
    let plain = HttpRequest::get("/");
    assert_eq!(
        statuses(
            addr,
            &[beta.clone(), beta.clone(), beta, plain.clone(), plain]
        )
        .await,
        [200, 200, 429, 200, 200]
    );
    assert_counted(&service, &envoy, "header_match_beta", 2, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_parameters_limit_each_parameter_value() {
    let Some(bin) = envoy_bin("query_parameters") else {
        return;
    };
    let (service, envoy) = start(
        &bin,
        "  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{query_parameters: {query_parameter_name: tenant, descriptor_key: tenant}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let acme = HttpRequest::get("/items?tenant=acme");
    let other = HttpRequest::get("/items?tenant=other&page=2");
    assert_eq!(
        statuses(addr, &[acme.clone(), acme.clone(), acme, other]).await,
        [200, 200, 429, 200]
    );
    assert_counted(&service, &envoy, "tenant", 3, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_values_not_utf8_or_over_256_bytes_are_decided_and_kept_apart() {
    let Some(bin) = envoy_bin("non-UTF-8 and long values") else {
        return;
    };
    let (service, envoy) = start(
        &bin,
        "  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        "[{actions: [{request_headers: {header_name: x-user, descriptor_key: user}}]}]",
    )
    .await;
    let addr = envoy.addr("HTTP");
    let latin1 = HttpRequest::get("/").header("x-user", b"caf\xe9");
    let other = HttpRequest::get("/").header("x-user", b"caf\xe8");
    assert_eq!(
        statuses(addr, &[latin1.clone(), latin1.clone(), latin1, other]).await,
        [200, 200, 429, 200]
    );
    // 300 bytes, and another 300 bytes differing only in the last one.
    let long = "a".repeat(300);
    let long_other = format!("{}b", "a".repeat(299));
    let long = HttpRequest::get("/").header("x-user", &long);
    let long_other = HttpRequest::get("/").header("x-user", &long_other);
    assert_eq!(
        statuses(addr, &[long.clone(), long.clone(), long, long_other]).await,
        [200, 200, 429, 200]
    );
    assert_eq!(service.metric(&decisions("user", "over_limit")).await, 2.0);
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!(
        counters,
        RateLimitCounters {
            ok: 6,
            over_limit: 2,
            error: 0,
            failure_mode_allowed: 0,
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_reload_under_traffic_loses_no_request_and_the_new_limit_applies() {
    let Some(bin) = envoy_bin("reload under traffic") else {
        return;
    };
    const RELOADS_OK: &str = "throttlegate_config_reloads_total{result=\"ok\"}";
    let rules = |limit: u32| {
        format!(
            "domain: edge\ndescriptors:\n  - key: generic_key\n    value: steady\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
        )
    };
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let config = dir.path().join("rules.yaml");
    // Both limits under --max-log-entries (10,000), so both are sliding
    // logs and the counter carries over the reload (a rule whose algorithm
    // changes starts a new counter).
    std::fs::write(&config, rules(2_000)).expect("write the rules");
    let mut service = Serve::config(&config).spawn();
    service.connect().await;
    let envoy = edge(&[service.grpc])
        .var(
            "ROUTE_RATE_LIMITS",
            "[{actions: [{generic_key: {descriptor_value: steady}}]}]",
        )
        // A failed or late call would be a 500: nothing passes unchecked.
        .var("FILTER", "timeout: 2s, failure_mode_deny: true")
        .concurrency(2)
        .start(&bin);
    let addr = envoy.addr("HTTP");

    // Two clients, each a request every 5 ms, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let response = HttpRequest::get("/").send(addr).await;
                    seen.push((
                        sent,
                        response.status,
                        response.header("ratelimit-limit").map(str::to_owned),
                    ));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = service.metric(RELOADS_OK).await;
    std::fs::write(&config, rules(5)).expect("rewrite the rules");
    let deadline = Instant::now() + Duration::from_secs(20);
    while service.metric(RELOADS_OK).await <= before {
        assert!(
            Instant::now() < deadline,
            "no reload within 20 s:\n{}",
            service.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reloaded = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);

    let mut seen = Vec::new();
    for client in traffic {
        seen.extend(client.await.expect("client task"));
    }
    let statuses: Vec<u16> = seen.iter().map(|(_, status, _)| *status).collect();
    assert!(
        statuses.iter().all(|it| *it == 200 || *it == 429),
        "a request neither allowed nor limited: {statuses:?}"
    );
    // More than 5 passed before the reload, so every request sent after
    // it is over the new limit of 5.
    let after: Vec<_> = seen.iter().filter(|(at, _, _)| *at > reloaded).collect();
    assert!(!after.is_empty(), "no request after the reload");
    for (_, status, limit) in &after {
        assert_eq!(
            (*status, limit.as_deref()),
            (429, Some("5")),
            "after the reload"
        );
    }
    let passed = statuses.iter().filter(|it| **it == 200).count();
    assert!(passed > 5, "only {passed} passed before the reload");
    let counters = envoy.ratelimit_counters("upstream").await;
    assert_eq!((counters.error, counters.failure_mode_allowed), (0, 0));
    assert_eq!(counters.ok + counters.over_limit, seen.len() as u64);
    assert_eq!(counters.over_limit, (seen.len() - passed) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_builds_its_rate_limit_headers_from_the_answer_and_passes_throttlegates_on() {
    let Some(bin) = envoy_bin("rate-limit headers") else {
        return;
    };
    let mut service = Serve::yaml(
        "domain: edge\ndescriptors:\n  - key: generic_key\n    value: headers\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .spawn();
    service.connect().await;
    let envoy = edge(&[service.grpc])
        .var(
            "ROUTE_RATE_LIMITS",
            "[{actions: [{generic_key: {descriptor_value: headers}}]}]",
        )
        .var(
            "FILTER",
            "timeout: 2s, enable_x_ratelimit_headers: DRAFT_VERSION_03",
        )
        .start(&bin);
    let addr = envoy.addr("HTTP");
    let seconds = |value: Option<&str>| -> u64 {
        value
            .and_then(|it| it.parse().ok())
            .unwrap_or_else(|| panic!("not seconds: {value:?}"))
    };
    let first = HttpRequest::get("/").send(addr).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-ratelimit-limit"), Some("2, 2;w=60"));
    assert_eq!(first.header("x-ratelimit-remaining"), Some("1"));
    assert!((1..=60).contains(&seconds(first.header("x-ratelimit-reset"))));
    assert_eq!(first.header("ratelimit-limit"), Some("2"));
    assert_eq!(first.header("ratelimit-remaining"), Some("1"));
    assert_eq!(first.header("retry-after"), None);

    let second = HttpRequest::get("/").send(addr).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("x-ratelimit-remaining"), Some("0"));

    let denied = HttpRequest::get("/").send(addr).await;
    assert_eq!(denied.status, 429);
    assert_eq!(denied.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(denied.header("x-ratelimit-limit"), Some("2, 2;w=60"));
    assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(denied.header("ratelimit-remaining"), Some("0"));
    let retry = seconds(denied.header("retry-after"));
    assert!((1..=60).contains(&retry), "retry-after {retry}");
    assert_eq!(
        seconds(denied.header("x-ratelimit-reset")),
        seconds(denied.header("ratelimit-reset"))
    );
}
