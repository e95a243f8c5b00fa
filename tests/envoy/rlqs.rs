//! Real Envoy 1.40 proxies with the rate-limit quota filter
//! (`envoy.filters.http.rate_limit_quota`) enforcing the assignments
//! throttlegate streams them over RLQS: one budget shared by three
//! proxies by their demand, a reload lowering it, DENY_ALL for a limit of
//! 0, ALLOW_ALL for a bucket no rule matches. Every test prints the
//! numbers it asserts.
//!
//! Without `ENVOY_BIN` these tests print why they are skipped and pass;
//! under `CI=true` they fail instead (see `support::envoy`).

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::envoy::{Envoy, envoy_bin, grpc_cluster, http_cluster, upstream_listener};
use crate::support::process::{HttpRequest, Serve, ServiceProcess};
use crate::support::redis::RedisServer;

/// The limit shared by the proxies: `PER_MINUTE` requests a minute.
const PER_MINUTE: u64 = 300;
/// A bucket's burst: a twelfth of its share (docs/rlqs.md).
const BURST_PARTS: u64 = 12;

fn rules(per_minute: u64) -> String {
    format!(
        "domain: rlqs
descriptors:
  - key: name
    value: shared
    rate_limit: {{unit: minute, requests_per_unit: {per_minute}}}
  - key: name
    value: blocked
    rate_limit: {{unit: minute, requests_per_unit: 0}}
"
    )
}

/// An Envoy whose `edge` listener (`${PORT_HTTP}`) forwards to its own
/// upstream listener behind the quota filter of domain `rlqs`: a request
/// with `x-deny-first: X` is in bucket `{name: X}` and denied until the
/// server assigns it something, one with `x-allow-first: X` in the same
/// bucket but let through until then.
const EDGE: &str = r#"
static_resources:
  listeners:
    - ${UPSTREAM_LISTENER}
    - name: edge
      address: {socket_address: {address: 127.0.0.1, port_value: ${PORT_HTTP}}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: edge
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes: [{match: {prefix: "/"}, route: {cluster: upstream}}]
                http_filters:
                  - name: envoy.filters.http.rate_limit_quota
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
                      domain: rlqs
                      rlqs_server: {envoy_grpc: {cluster_name: throttlegate}}
                      bucket_matchers:
                        matcher_list:
                          matchers:
                            - ${MATCHER_DENY}
                            - ${MATCHER_ALLOW}
                  - name: envoy.filters.http.router
                    typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
    - ${RLQS_CLUSTER}
    - ${UPSTREAM_CLUSTER}
"#;

/// A matcher putting requests with header `header` in bucket `{name:
/// <its value>}`, with `fallback` until an assignment arrives.
fn matcher(header: &str, fallback: &str) -> String {
    let input = format!(
        "{{name: {header}, typed_config: {{\"@type\": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput, header_name: {header}}}}}"
    );
    format!(
        "{{predicate: {{single_predicate: {{input: {input}, value_match: {{safe_regex: {{google_re2: {{}}, regex: \".+\"}}}}}}}}, \
         on_match: {{action: {{name: rate_limit_quota, typed_config: \
         {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings, \
         bucket_id_builder: {{bucket_id_builder: {{name: {{custom_value: {input}}}}}}}, \
         reporting_interval: 5s, deny_response_settings: {{http_status: {{code: 429}}}}, \
         no_assignment_behavior: {{fallback_rate_limit: {{blanket_rule: {fallback}}}}}}}}}}}}}"
    )
}

fn start_envoy(bin: &Path, rlqs: &[SocketAddr]) -> Envoy {
    start_envoy_with(bin, grpc_cluster("throttlegate", rlqs, ""))
}

/// A quota cluster of `primary`, failing over to `standby` when gRPC
/// health checks (every second) find `primary` down.
fn failover_cluster(primary: SocketAddr, standby: SocketAddr) -> String {
    let endpoint = |addr: SocketAddr, priority: u32| {
        format!(
            "{{priority: {priority}, lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}]}}",
            addr.ip(),
            addr.port()
        )
    };
    format!(
        "{{name: throttlegate, type: STATIC, connect_timeout: 1s, \
         typed_extension_protocol_options: {{envoy.extensions.upstreams.http.v3.HttpProtocolOptions: \
         {{\"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions, \
         explicit_http_config: {{http2_protocol_options: {{}}}}}}}}, \
         health_checks: [{{timeout: 1s, interval: 1s, no_traffic_interval: 1s, unhealthy_threshold: 1, healthy_threshold: 1, grpc_health_check: {{}}}}], \
         load_assignment: {{cluster_name: throttlegate, endpoints: [{}, {}]}}}}",
        endpoint(primary, 0),
        endpoint(standby, 1)
    )
}

fn start_envoy_with(bin: &Path, cluster: String) -> Envoy {
    start_envoy_matching(bin, cluster, matcher("x-allow-first", "ALLOW_ALL"))
}

/// [`start_envoy_with`], `allow` in place of the `x-allow-first` matcher.
fn start_envoy_matching(bin: &Path, cluster: String, allow: String) -> Envoy {
    Envoy::config(EDGE)
        .var("UPSTREAM_LISTENER", upstream_listener(&[]))
        .var(
            "UPSTREAM_CLUSTER",
            http_cluster("upstream", "PORT_UPSTREAM"),
        )
        .var("RLQS_CLUSTER", cluster)
        .var("MATCHER_DENY", matcher("x-deny-first", "DENY_ALL"))
        .var("MATCHER_ALLOW", allow)
        .concurrency(1)
        .start(bin)
}

/// A service of `yaml`, written to a file of its own that a test may
/// rewrite (then SIGHUP).
async fn start_service(yaml: &str) -> (ServiceProcess, tempfile::TempDir) {
    start_service_with(yaml, &[]).await
}

async fn start_service_with(yaml: &str, args: &[&str]) -> (ServiceProcess, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("rules.yaml");
    std::fs::write(&path, yaml).expect("write the rules");
    let mut service = Serve::config(&path).args(args).spawn();
    service.connect().await;
    (service, dir)
}

/// One request's second (since the run started) and status.
type Sent = Vec<(f64, u16)>;

/// Sends `per_second` requests a second in bucket `bucket` (denied until
/// assigned) through `addr` until `until`, each on its own connection and
/// without waiting for the ones before, so the rate does not depend on
/// how fast answers come.
async fn drive(
    addr: SocketAddr,
    bucket: &'static str,
    per_second: f64,
    start: Instant,
    until: Instant,
) -> Sent {
    let mut requests = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while Instant::now() < until {
        tick.tick().await;
        let at = start.elapsed().as_secs_f64();
        requests.push(tokio::spawn(async move {
            let status = HttpRequest::get("/")
                .header("x-deny-first", bucket)
                .send(addr)
                .await
                .status;
            (at, status)
        }));
    }
    let mut sent = Vec::new();
    for request in requests {
        sent.push(request.await.expect("the request ran"));
    }
    sent
}

/// (admitted, denied) of `sent` between seconds `from` and `to`.
fn counted(sent: &Sent, from: f64, to: f64) -> (u64, u64) {
    let within = sent.iter().filter(|(at, _)| (from..to).contains(at));
    let admitted = within.clone().filter(|(_, status)| *status == 200).count() as u64;
    let denied = within.filter(|(_, status)| *status == 429).count() as u64;
    (admitted, denied)
}

/// Quota streams open on `service`.
async fn streams(service: &ServiceProcess) -> u64 {
    service.metric("throttlegate_rlqs_streams").await as u64
}

/// Assignments of rule `name_shared` that changed a proxy's bucket.
async fn changed_assignments(service: &ServiceProcess) -> u64 {
    service
        .metric("throttlegate_rlqs_assignments_total{domain=\"rlqs\",rule=\"name_shared\",kind=\"changed\"}")
        .await as u64
}

/// The largest burst a share of the budget `per_minute` can carry.
fn max_burst(per_minute: u64) -> u64 {
    (per_minute / BURST_PARTS).max(1)
}

#[tokio::test]
async fn three_envoys_share_one_budget_by_their_demand() {
    let Some(bin) = envoy_bin("three_envoys_share_one_budget_by_their_demand") else {
        return;
    };
    let (service, _dir) = start_service(&rules(PER_MINUTE)).await;
    let envoys: Vec<Envoy> = (0..3).map(|_| start_envoy(&bin, &[service.grpc])).collect();
    // 60, 240 and 480 a minute against a budget of 300: max-min fair
    // shares of 60, 120 and 120.
    let rates = [1.0, 4.0, 8.0];
    let run = Duration::from_secs(45);
    let warm_up = 10.0;
    let start = Instant::now();
    let until = start + run;
    let mut changed_at_warm_up = None;
    let drivers: Vec<_> = envoys
        .iter()
        .zip(rates)
        .map(|(envoy, rate)| tokio::spawn(drive(envoy.addr("HTTP"), "shared", rate, start, until)))
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(warm_up)).await;
    changed_at_warm_up.get_or_insert(changed_assignments(&service).await);
    let mut sent = Vec::new();
    for driver in drivers {
        sent.push(driver.await.expect("the client ran"));
    }
    let end = run.as_secs_f64();
    let changed_total = changed_assignments(&service).await;
    let changed_steady = changed_total - changed_at_warm_up.unwrap_or(0);

    // The whole run is shorter than the window: at most L, plus what each
    // changed assignment can add (its new burst and the old one's).
    let total: u64 = sent.iter().map(|it| counted(it, 0.0, end).0).sum();
    let run_bound = PER_MINUTE + changed_total * 2 * max_burst(PER_MINUTE);
    // After the warm-up: the budget's rate over the time, plus the bursts
    // the buckets start with, plus what changes added.
    let steady: Vec<(u64, u64)> = sent.iter().map(|it| counted(it, warm_up, end)).collect();
    let steady_total: u64 = steady.iter().map(|it| it.0).sum();
    let steady_seconds = end - warm_up;
    let steady_bound = (PER_MINUTE as f64 * steady_seconds / 60.0).ceil() as u64
        + max_burst(PER_MINUTE)
        + changed_steady * 2 * max_burst(PER_MINUTE)
        + 3;
    println!(
        "admitted in {end} s: {total} (bound {run_bound}: limit {PER_MINUTE} + {changed_total} changed assignments); \
         after {warm_up} s: {steady_total} in {steady_seconds} s (bound {steady_bound}, {changed_steady} changes); \
         per proxy (admitted, denied) after warm-up at 1, 4, 8 per second: {steady:?}"
    );
    assert!(total <= run_bound, "{total} admitted, bound {run_bound}");
    assert!(
        steady_total <= steady_bound,
        "{steady_total} admitted after the warm-up, bound {steady_bound}"
    );
    // Each follows its demand: the small one gets what it asks, the two
    // others split the rest evenly and are denied the excess.
    let [(small, small_denied), (mid, mid_denied), (big, big_denied)] = steady[..] else {
        unreachable!()
    };
    assert!(
        small_denied * 10 <= small + small_denied,
        "the proxy asking less than its share was denied {small_denied} of {}",
        small + small_denied
    );
    assert!(mid_denied > 0 && big_denied > 0, "{steady:?}");
    assert!(
        mid * 10 >= small * 14 && big * 10 >= small * 14,
        "{steady:?}"
    );
    let (low, high) = (mid.min(big), mid.max(big));
    assert!(
        low * 10 >= high * 7,
        "the two proxies over their share differ: {steady:?}"
    );
    // Few changes once demand is steady: a new assignment refills a bucket.
    assert!(
        changed_steady <= 6,
        "{changed_steady} assignments changed after the warm-up"
    );
}

#[tokio::test]
async fn a_reload_lowering_the_limit_takes_effect_within_a_report_cycle() {
    let Some(bin) = envoy_bin("a_reload_lowering_the_limit_takes_effect_within_a_report_cycle")
    else {
        return;
    };
    let (service, dir) = start_service(&rules(PER_MINUTE)).await;
    let envoy = start_envoy(&bin, &[service.grpc]);
    let start = Instant::now();
    let lowered = 60;
    let reload_at = 15.0;
    let until = start + Duration::from_secs(40);
    let driver = tokio::spawn(drive(envoy.addr("HTTP"), "shared", 10.0, start, until));
    tokio::time::sleep(Duration::from_secs_f64(reload_at)).await;
    std::fs::write(dir.path().join("rules.yaml"), rules(lowered)).expect("rewrite the rules");
    service.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while service
        .metric("throttlegate_config_reloads_total{result=\"ok\"}")
        .await
        < 1.0
    {
        assert!(Instant::now() < deadline, "the reload did not happen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reloaded = start.elapsed().as_secs_f64();
    let sent = driver.await.expect("the client ran");
    // One report cycle (5 s) after the reload, plus a second of slack.
    let from = reloaded + 6.0;
    let end = 40.0;
    let (before, _) = counted(&sent, 5.0, reload_at);
    let (after, denied) = counted(&sent, from, end);
    let bound = (lowered as f64 * (end - from) / 60.0).ceil() as u64 + max_burst(lowered) + 1;
    println!(
        "before the reload {before} admitted in {} s ({PER_MINUTE}/min); from {from:.1} s \
         (reload at {reloaded:.1} s + one report cycle) to {end} s: {after} admitted, {denied} denied \
         (bound {bound} at {lowered}/min)",
        reload_at - 5.0
    );
    assert!(
        after <= bound,
        "{after} admitted after the lower limit, bound {bound}"
    );
    assert!(after > 0, "the lower limit still admits");
}

/// Sends requests with `header: bucket` until one is answered `status`
/// (for at most 20 s), then ten more, all of which must be.
async fn settles_on(addr: SocketAddr, header: &str, bucket: &str, status: u16) -> usize {
    settles_with(addr, &[(header, bucket)], status).await
}

/// [`settles_on`] with requests carrying `headers`.
async fn settles_with(addr: SocketAddr, headers: &[(&str, &str)], status: u16) -> usize {
    let request = || {
        headers
            .iter()
            .fold(HttpRequest::get("/"), |it, (name, value)| {
                it.header(name, value)
            })
    };
    let bucket = format!("{headers:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut before = 0;
    loop {
        let got = request().send(addr).await.status;
        if got == status {
            break;
        }
        before += 1;
        assert!(
            Instant::now() < deadline,
            "bucket {bucket} never answered {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for _ in 0..10 {
        let got = request().send(addr).await.status;
        assert_eq!(got, status, "bucket {bucket}");
    }
    before
}

#[tokio::test]
async fn a_zero_limit_denies_all_and_an_unmatched_bucket_allows_all() {
    let Some(bin) = envoy_bin("a_zero_limit_denies_all_and_an_unmatched_bucket_allows_all") else {
        return;
    };
    let (service, _dir) = start_service(&rules(PER_MINUTE)).await;
    let envoy = start_envoy(&bin, &[service.grpc]);
    let addr = envoy.addr("HTTP");
    // Let through until assigned, then DENY_ALL from the limit of 0.
    let allowed_first = settles_on(addr, "x-allow-first", "blocked", 429).await;
    // Denied until assigned, then ALLOW_ALL: no rule has `name: nobody`.
    let denied_first = settles_on(addr, "x-deny-first", "nobody", 200).await;
    let deny_all = service
        .metric("throttlegate_rlqs_assignments_total{domain=\"rlqs\",rule=\"name_blocked\",kind=\"deny_all\"}")
        .await;
    let allow_all = service
        .metric("throttlegate_rlqs_assignments_total{domain=\"rlqs\",rule=\"_unmatched\",kind=\"allow_all\"}")
        .await;
    println!(
        "blocked: {allowed_first} let through before DENY_ALL arrived, then 10 of 10 denied; \
         nobody: {denied_first} denied before ALLOW_ALL arrived, then 10 of 10 let through; \
         assignments deny_all {deny_all}, allow_all {allow_all}"
    );
    assert!(deny_all >= 1.0 && allow_all >= 1.0);
}

/// deploy/envoy/rlqs.yaml with its addresses pointed at this test's
/// service and upstream (its admin block left to `support::envoy`).
fn deploy_example(rlqs: SocketAddr) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("deploy/envoy/rlqs.yaml")).expect("the example");
    let (_, resources) = text
        .split_once("static_resources:")
        .expect("static_resources in the example");
    let replace = |text: String, from: &str, to: &str| {
        assert!(text.contains(from), "{from} not in the example");
        text.replace(from, to)
    };
    let text = format!("static_resources:{resources}");
    let text = replace(
        text,
        "  listeners:\n",
        "  listeners:\n    - ${UPSTREAM_LISTENER}\n",
    );
    let text = replace(
        text,
        "{address: 0.0.0.0, port_value: 10002}",
        "{address: 127.0.0.1, port_value: ${PORT_HTTP}}",
    );
    let text = replace(
        text,
        "{address: throttlegate-a, port_value: 8081}",
        &format!("{{address: {}, port_value: {}}}", rlqs.ip(), rlqs.port()),
    );
    replace(
        text,
        "{address: upstream, port_value: 8000}",
        "{address: 127.0.0.1, port_value: ${PORT_UPSTREAM}}",
    )
}

#[tokio::test]
async fn the_deploy_example_enforces_the_tenant_budget() {
    let Some(bin) = envoy_bin("the_deploy_example_enforces_the_tenant_budget") else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut service = Serve::config(root.join("deploy/config")).spawn();
    service.connect().await;
    let envoy = Envoy::config(&deploy_example(service.grpc))
        .var("UPSTREAM_LISTENER", upstream_listener(&[]))
        .concurrency(1)
        .start(&bin);
    let addr = envoy.addr("HTTP");
    // 5 a second for 12 s against 60 a minute for tenant acme.
    let seconds = 12.0;
    let start = Instant::now();
    let mut statuses = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    while start.elapsed().as_secs_f64() < seconds {
        tick.tick().await;
        statuses.push(
            HttpRequest::get("/")
                .header("x-tenant", "acme")
                .send(addr)
                .await
                .status,
        );
    }
    let admitted = statuses.iter().filter(|it| **it == 200).count() as u64;
    let denied = statuses.iter().filter(|it| **it == 429).count() as u64;
    let bound = (60.0 * seconds / 60.0_f64).ceil() as u64 + max_burst(60);
    println!(
        "deploy example: tenant acme {admitted} admitted, {denied} denied of {} in {seconds} s (bound {bound} at 60/min)",
        statuses.len()
    );
    assert!(admitted >= 1 && admitted <= bound, "{admitted} admitted");
    assert_eq!(admitted + denied, statuses.len() as u64, "{statuses:?}");
    // A tenant with a limit of 0 is denied once assigned.
    settles_on(addr, "x-tenant", "blocked", 429).await;
}

#[tokio::test]
async fn two_instances_on_one_redis_share_the_budget_and_survive_a_stop() {
    let Some(bin) = envoy_bin("two_instances_on_one_redis_share_the_budget_and_survive_a_stop")
    else {
        return;
    };
    let redis = RedisServer::start();
    let rules = rules(PER_MINUTE);
    let (a, _dir_a) = start_service_with(&rules, &["--redis-url", &redis.url()]).await;
    let (b, _dir_b) = start_service_with(&rules, &["--redis-url", &redis.url()]).await;
    // Two proxies on A, one on B; each fails over to the other instance.
    let envoys = [
        start_envoy_with(&bin, failover_cluster(a.grpc, b.grpc)),
        start_envoy_with(&bin, failover_cluster(b.grpc, a.grpc)),
        start_envoy_with(&bin, failover_cluster(a.grpc, b.grpc)),
    ];
    // The two proxies over their share on different instances: each
    // instance handing out the whole budget would admit 600 a minute.
    let rates = [1.0, 8.0, 8.0];
    let run = Duration::from_secs(50);
    let (warm_up, stop_at) = (10.0, 25.0);
    let start = Instant::now();
    let until = start + run;
    let drivers: Vec<_> = envoys
        .iter()
        .zip(rates)
        .map(|(envoy, rate)| tokio::spawn(drive(envoy.addr("HTTP"), "shared", rate, start, until)))
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(stop_at)).await;
    let split = (streams(&a).await, streams(&b).await);
    let changed_a = changed_assignments(&a).await;
    drop(a);
    // The proxies of A reconnect to B.
    let deadline = Instant::now() + Duration::from_secs(20);
    while streams(&b).await < 3 {
        assert!(Instant::now() < deadline, "the proxies did not move to B");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let moved_after = start.elapsed().as_secs_f64() - stop_at;
    let mut sent = Vec::new();
    for driver in drivers {
        sent.push(driver.await.expect("the client ran"));
    }
    let end = run.as_secs_f64();
    let changed = changed_a + changed_assignments(&b).await;
    // Before the stop, with the proxies on both instances: the budget's
    // rate, the buckets' bursts, and what changes added. Each instance
    // handing out the whole budget would admit about twice the rate.
    let before: u64 = sent.iter().map(|it| counted(it, warm_up, stop_at).0).sum();
    let before_bound =
        (PER_MINUTE as f64 * (stop_at - warm_up) / 60.0).ceil() as u64 + 2 * max_burst(PER_MINUTE);
    let total: u64 = sent.iter().map(|it| counted(it, 0.0, end).0).sum();
    let total_bound = PER_MINUTE + changed * 2 * max_burst(PER_MINUTE);
    let after: Vec<(u64, u64)> = sent
        .iter()
        .map(|it| counted(it, stop_at + 20.0, end))
        .collect();
    println!(
        "streams on A and B before the stop: {split:?}; from {warm_up} s to the stop at {stop_at} s: \
         {before} admitted (bound {before_bound}); the proxies were all on B {moved_after:.1} s after it; \
         in {end} s: {total} admitted (bound {total_bound}: {changed} changed assignments); \
         per proxy (admitted, denied) in the last {} s: {after:?}",
        end - stop_at - 20.0
    );
    assert_eq!(split, (2, 1), "two proxies on A, one on B");
    assert!(
        before <= before_bound,
        "{before} admitted, bound {before_bound}"
    );
    assert!(
        total <= total_bound,
        "{total} admitted, bound {total_bound}"
    );
    assert!(after.iter().all(|(admitted, _)| *admitted > 0), "{after:?}");
}

/// A matcher putting requests with `x-tenant` in bucket `{tenant: <its
/// value>, path: <x-path's>}`, let through until assigned.
fn tenant_path_matcher() -> String {
    let input = |header: &str| {
        format!(
            "{{name: {header}, typed_config: {{\"@type\": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput, header_name: {header}}}}}"
        )
    };
    let (tenant, path) = (input("x-tenant"), input("x-path"));
    format!(
        "{{predicate: {{single_predicate: {{input: {tenant}, value_match: {{safe_regex: {{google_re2: {{}}, regex: \".+\"}}}}}}}}, \
         on_match: {{action: {{name: rate_limit_quota, typed_config: \
         {{\"@type\": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings, \
         bucket_id_builder: {{bucket_id_builder: {{tenant: {{custom_value: {tenant}}}, path: {{custom_value: {path}}}}}}}, \
         reporting_interval: 5s, deny_response_settings: {{http_status: {{code: 429}}}}, \
         no_assignment_behavior: {{fallback_rate_limit: {{blanket_rule: ALLOW_ALL}}}}}}}}}}}}"
    )
}

/// A rule nesting `path` under `tenant`: Envoy's bucket `{tenant, path}`
/// sorted by key would be `[path, tenant]` and match nothing (ALLOW_ALL);
/// with `bucket_key_order: [tenant, path]` it reaches the limit of 0.
#[tokio::test]
async fn bucket_key_order_matches_a_nested_rule_under_envoy() {
    let Some(bin) = envoy_bin("bucket_key_order_matches_a_nested_rule_under_envoy") else {
        return;
    };
    let yaml = "domain: rlqs
bucket_key_order: [tenant, path]
descriptors:
  - key: tenant
    descriptors:
      - key: path
        value: /blocked
        rate_limit: {unit: minute, requests_per_unit: 0}
";
    let (service, _dir) = start_service(yaml).await;
    let cluster = grpc_cluster("throttlegate", &[service.grpc], "");
    let envoy = start_envoy_matching(&bin, cluster, tenant_path_matcher());
    let addr = envoy.addr("HTTP");
    let blocked = [("x-tenant", "acme"), ("x-path", "/blocked")];
    let before = settles_with(addr, &blocked, 429).await;
    // Another path of the tenant: no rule, ALLOW_ALL.
    settles_with(addr, &[("x-tenant", "acme"), ("x-path", "/open")], 200).await;
    let deny_all = service
        .metric("throttlegate_rlqs_assignments_total{domain=\"rlqs\",rule=\"tenant.path_/blocked\",kind=\"deny_all\"}")
        .await;
    println!(
        "tenant acme, path /blocked: {before} let through before DENY_ALL arrived; deny_all {deny_all}"
    );
    assert!(deny_all >= 1.0);
}

// === what the field brings: a Redis restart, an instance restart, a
// window-only reload ===

/// Admitted requests of `sent` per `step` seconds from `from` to `to`.
fn per_step(sent: &Sent, from: f64, to: f64, step: f64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut at = from;
    while at < to {
        out.push(counted(sent, at, (at + step).min(to)).0);
        at += step;
    }
    out
}

/// Reports bucket `{name: shared}` of domain `rlqs` `count` times at once
/// on a stream of its own that asks nothing (so its share is 0): the pool
/// has made that many more decisions, as one that lived for hours has.
/// The stream stays open (its answers read) until the handle is dropped.
async fn add_decisions(service: &mut ServiceProcess, count: usize) -> tokio::task::JoinHandle<()> {
    use throttlegate::proto::envoy::service::rate_limit_quota::v3 as rlqs;
    use tokio_stream::StreamExt;
    let (send, reports) = tokio::sync::mpsc::channel(count + 1);
    let report = rlqs::RateLimitQuotaUsageReports {
        domain: "rlqs".to_owned(),
        bucket_quota_usages: vec![rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage {
            bucket_id: Some(rlqs::BucketId {
                bucket: [("name".to_owned(), "shared".to_owned())].into(),
            }),
            time_elapsed: Some(prost_types::Duration {
                seconds: 5,
                nanos: 0,
            }),
            num_requests_allowed: 0,
            num_requests_denied: 0,
            last_report: None,
        }],
    };
    for _ in 0..count {
        send.send(report.clone()).await.expect("queued");
    }
    let mut answers = rlqs::rate_limit_quota_service_client::RateLimitQuotaServiceClient::new(
        service.connect().await,
    )
    .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(reports))
    .await
    .expect("stream opened")
    .into_inner();
    tokio::spawn(async move {
        let _send = send;
        while let Some(Ok(_)) = answers.next().await {}
    })
}

/// Redis restarts empty (no persistence) under a pool that made many
/// decisions: the proxy's next report rebuilds the pool and is answered,
/// so the proxy keeps admitting at the budget's rate.
#[tokio::test]
async fn a_redis_restart_costs_a_proxy_no_admissions() {
    let Some(bin) = envoy_bin("a_redis_restart_costs_a_proxy_no_admissions") else {
        return;
    };
    let mut redis = RedisServer::start();
    let (mut service, _dir) =
        start_service_with(&rules(PER_MINUTE), &["--redis-url", &redis.url()]).await;
    let envoy = start_envoy(&bin, &[service.grpc]);
    let start = Instant::now();
    let (end, restart_at) = (50.0, 15.0);
    let until = start + Duration::from_secs_f64(end);
    // 8 a second against 300 a minute (5 a second).
    let driver = tokio::spawn(drive(envoy.addr("HTTP"), "shared", 8.0, start, until));
    tokio::time::sleep(Duration::from_secs(8)).await;
    let pump = add_decisions(&mut service, 150).await;
    tokio::time::sleep(Duration::from_secs_f64(
        restart_at - start.elapsed().as_secs_f64(),
    ))
    .await;
    redis.restart();
    let sent = driver.await.expect("the client ran");
    pump.abort();
    let unanswered = service
        .metric_or_zero(
            "throttlegate_rlqs_unanswered_reports_total{domain=\"rlqs\",rule=\"name_shared\"}",
        )
        .await;
    let steps = per_step(&sent, 5.0, end, 5.0);
    // After the old assignment would have expired (15 s) and one report
    // cycle more: only a pool rebuilt and answered admits then.
    let from = restart_at + 16.0;
    let (after, denied) = counted(&sent, from, end);
    let expected = (PER_MINUTE as f64 * (end - from) / 60.0) as u64;
    println!(
        "admitted per 5 s from 5 s (Redis restarted at {restart_at} s, after 150 extra decisions): {steps:?}; \
         from {from} s to {end} s: {after} admitted, {denied} denied (the budget's rate: {expected}); \
         {unanswered} reports unanswered"
    );
    assert!(
        after * 10 >= expected * 8,
        "{after} admitted after the restart, the budget's rate is {expected}"
    );
}

/// An instance stops gracefully (SIGTERM) while its proxy, alone over
/// the budget, admits at the budget's rate: the proxy reconnects to the
/// other instance and keeps admitting, its share taken over rather than
/// held against it.
#[tokio::test]
async fn an_instance_restart_costs_its_proxy_no_admissions() {
    let Some(bin) = envoy_bin("an_instance_restart_costs_its_proxy_no_admissions") else {
        return;
    };
    let redis = RedisServer::start();
    let rules = rules(PER_MINUTE);
    let (a, _dir_a) = start_service_with(&rules, &["--redis-url", &redis.url()]).await;
    let (b, _dir_b) = start_service_with(&rules, &["--redis-url", &redis.url()]).await;
    let envoy = start_envoy_with(&bin, failover_cluster(a.grpc, b.grpc));
    let start = Instant::now();
    let (end, stop_at) = (45.0, 15.0);
    let until = start + Duration::from_secs_f64(end);
    let driver = tokio::spawn(drive(envoy.addr("HTTP"), "shared", 8.0, start, until));
    tokio::time::sleep(Duration::from_secs_f64(stop_at)).await;
    a.stop().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while streams(&b).await < 1 {
        assert!(Instant::now() < deadline, "the proxy did not move to B");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let moved = start.elapsed().as_secs_f64();
    let sent = driver.await.expect("the client ran");
    let steps = per_step(&sent, 5.0, end, 5.0);
    let (after, denied) = counted(&sent, moved + 1.0, moved + 11.0);
    let (before, _) = counted(&sent, 5.0, stop_at);
    println!(
        "admitted per 5 s from 5 s (A stopped at {stop_at} s, the proxy on B at {moved:.1} s): {steps:?}; \
         {before} admitted in the 10 s before the stop; from 1 s to 11 s after the move: {after} admitted, \
         {denied} denied (the budget's rate: 50)"
    );
    assert!(after >= 35, "{after} admitted in 10 s after the move");
}

/// A reload that changes only the window (300 a minute, then 300 an
/// hour): the proxy enforces the new bucket within a report cycle.
#[tokio::test]
async fn a_reload_changing_only_the_window_reaches_envoy() {
    let Some(bin) = envoy_bin("a_reload_changing_only_the_window_reaches_envoy") else {
        return;
    };
    let (service, dir) = start_service(&rules(PER_MINUTE)).await;
    let envoy = start_envoy(&bin, &[service.grpc]);
    let start = Instant::now();
    let reload_at = 15.0;
    let end = 40.0;
    let until = start + Duration::from_secs_f64(end);
    let driver = tokio::spawn(drive(envoy.addr("HTTP"), "shared", 10.0, start, until));
    tokio::time::sleep(Duration::from_secs_f64(reload_at)).await;
    let hourly = rules(PER_MINUTE).replace(
        "unit: minute, requests_per_unit: 300",
        "unit: hour, requests_per_unit: 300",
    );
    assert_ne!(hourly, rules(PER_MINUTE));
    std::fs::write(dir.path().join("rules.yaml"), hourly).expect("rewrite the rules");
    service.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while service
        .metric("throttlegate_config_reloads_total{result=\"ok\"}")
        .await
        < 1.0
    {
        assert!(Instant::now() < deadline, "the reload did not happen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reloaded = start.elapsed().as_secs_f64();
    let sent = driver.await.expect("the client ran");
    let from = reloaded + 6.0;
    let (before, _) = counted(&sent, 5.0, reload_at);
    let (after, denied) = counted(&sent, from, end);
    // 300 an hour: its rate over the time, one burst, one of rounding.
    let bound =
        (PER_MINUTE as f64 * (end - from) / 3600.0).ceil() as u64 + max_burst(PER_MINUTE) + 1;
    println!(
        "before the reload {before} admitted in {} s (300/min); from {from:.1} s (reload at {reloaded:.1} s \
         + one report cycle) to {end} s: {after} admitted, {denied} denied (bound {bound} at 300/hour)",
        reload_at - 5.0
    );
    assert!(
        after <= bound,
        "{after} admitted after 300/hour, bound {bound}"
    );
}
