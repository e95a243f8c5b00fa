//! The service binary's connections to Redis across what happens to the
//! server: a restart never costs a decision (no connection made before an
//! outage is used after it, on any serving thread), a replica is backed
//! off from like a refused connect, and the gate bounds what Redis still
//! has to run after a stall without shedding a healthy Redis at a pool of
//! one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::support::ONE_AT_A_TIME;
use crate::support::process::{Serve, ServiceProcess, http_get};
use crate::support::redis::{RedisServer, command_stat, command_stats, reset_stats, user_without};
use crate::support::request::{descriptor, request};
use crate::support::service::connect;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = r#"
domain: conn
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: load
    rate_limit: {unit: hour, requests_per_unit: 1000000000, algorithm: fixed_window}
"#;

/// Within this, health follows Redis going and coming back.
const WITHIN: Duration = Duration::from_secs(10);

/// The documented bound on calls sent to one Redis and not yet answered,
/// per pool (the shared runtime's, and each serving thread's):
/// `MAX_IN_FLIGHT` in `src/backends/redis/gate.rs`, `docs/redis.md`.
const MAX_IN_FLIGHT: f64 = 64.0;

fn user(value: &str) -> RateLimitRequest {
    request("conn", vec![descriptor(&[("user", value)])])
}

fn load_request() -> RateLimitRequest {
    request("conn", vec![descriptor(&[("load", "x")])])
}

/// What one RPC was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ok,
    OverLimit,
    Unavailable,
}

async fn ask(client: &mut RateLimitServiceClient<Channel>, request: RateLimitRequest) -> Answer {
    match client.should_rate_limit(request).await {
        Ok(res) => {
            let res = res.into_inner();
            assert!(
                res.statuses.iter().all(|it| it.current_limit.is_some()),
                "an answer that is not a decision: {res:?}"
            );
            match Code::try_from(res.overall_code) {
                Ok(Code::Ok) => Answer::Ok,
                Ok(Code::OverLimit) => Answer::OverLimit,
                _ => panic!("unexpected answer {res:?}"),
            }
        }
        Err(status) if status.code() == tonic::Code::Unavailable => Answer::Unavailable,
        Err(status) => panic!("unexpected status {status:?}"),
    }
}

async fn wait_health(channel: &Channel, expected: ServingStatus) {
    let started = Instant::now();
    loop {
        let status = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()
            .map(|it| it.into_inner().status());
        if status == Some(expected) {
            return;
        }
        assert!(
            started.elapsed() < WITHIN,
            "health is {status:?}, not {expected:?} within {WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `field` of `INFO stats`.
async fn info_stat(conn: &mut redis::aio::MultiplexedConnection, field: &str) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .expect("INFO stats");
    let prefix = format!("{field}:");
    stats
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|it| it.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {stats}"))
}

/// The sum of every sample of `/metrics` whose series starts with `series`;
/// 0 when there is none.
async fn metric_sum(service: &ServiceProcess, series: &str) -> f64 {
    http_get(service.http, "/metrics")
        .await
        .lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One client per serving thread: connections are dealt to the threads in
/// turn, so client `i` is served by thread `i`.
async fn clients(
    service: &mut ServiceProcess,
    n: usize,
) -> (Channel, Vec<RateLimitServiceClient<Channel>>) {
    let first = service.connect().await;
    let mut clients = vec![RateLimitServiceClient::new(first.clone())];
    for _ in 1..n {
        clients.push(RateLimitServiceClient::new(connect(service.grpc).await));
    }
    (first, clients)
}

/// Redis stopped until the circuit opens (health NOT_SERVING), started
/// again on the same port, health back: the next three requests on a
/// 2/minute limit, spread over the serving threads, are OK, OK,
/// OVER_LIMIT. Every thread's pool holds a connection made before the
/// outage; none may be used after it. With `ask_during_outage`, each
/// thread also meets the outage itself (its calls answered UNAVAILABLE).
async fn a_restart_costs_no_decision(threads: usize, ask_during_outage: bool) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let mut redis = RedisServer::start();
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.url()])
        .args(&["--grpc-threads", &threads.to_string()])
        // Generous: the first call on each thread after the restart connects
        // and loads the library within it, on two loaded cores.
        .args(&["--redis-timeout-ms", "3000"])
        .args(&["--failure-mode", "error"])
        .spawn();
    let (channel, mut clients) = clients(&mut service, threads.max(1)).await;
    wait_health(&channel, ServingStatus::Serving).await;
    for (idx, client) in clients.iter_mut().enumerate() {
        let answer = ask(client, user(&format!("warm{idx}"))).await;
        assert_eq!(answer, Answer::Ok, "before the outage, thread {idx}");
    }

    tokio::task::block_in_place(|| redis.kill());
    wait_health(&channel, ServingStatus::NotServing).await;
    if ask_during_outage {
        for client in &mut clients {
            assert_eq!(ask(client, user("outage")).await, Answer::Unavailable);
        }
    }
    tokio::task::block_in_place(|| redis.restart());
    wait_health(&channel, ServingStatus::Serving).await;

    let mut answers = Vec::new();
    for idx in 0..3 {
        let n = clients.len();
        answers.push(ask(&mut clients[idx % n], user("alice")).await);
    }
    assert_eq!(
        answers,
        [Answer::Ok, Answer::Ok, Answer::OverLimit],
        "after the restart, {threads} serving threads; log:\n{}",
        service.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_next_requests_are_decided_with_one_serving_thread() {
    a_restart_costs_no_decision(1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_next_requests_are_decided_with_several_serving_threads() {
    a_restart_costs_no_decision(3, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_seen_by_every_thread_the_next_requests_are_decided() {
    a_restart_costs_no_decision(3, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_next_requests_are_decided_on_the_shared_runtime() {
    a_restart_costs_no_decision(0, false).await;
}

/// `concurrency` tasks over `channels` connections sending `load_request()` in
/// a loop until `stop`, each RPC with the deadline `rpc_timeout` if any;
/// every answer tallied: decided, UNAVAILABLE, anything else (a deadline
/// passed, a status the service must not give: kept by message).
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    tasks: JoinSet<Tally>,
}

#[derive(Debug, Default)]
struct Tally {
    decided: u64,
    unavailable: u64,
    deadline: u64,
    other: Vec<String>,
}

impl Load {
    async fn start(
        service: &ServiceProcess,
        channels: usize,
        concurrency: usize,
        rpc_timeout: Option<Duration>,
    ) -> Load {
        let mut load = Load {
            stop: Arc::default(),
            sent: Arc::default(),
            tasks: JoinSet::new(),
        };
        let mut clients = Vec::new();
        for _ in 0..channels {
            clients.push(RateLimitServiceClient::new(connect(service.grpc).await));
        }
        for task in 0..concurrency {
            let mut client = clients[task % channels].clone();
            let (stop, sent) = (load.stop.clone(), load.sent.clone());
            load.tasks.spawn(async move {
                let mut tally = Tally::default();
                while !stop.load(Ordering::SeqCst) {
                    let mut rpc = tonic::Request::new(load_request());
                    if let Some(timeout) = rpc_timeout {
                        rpc.set_timeout(timeout);
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    match client.should_rate_limit(rpc).await {
                        Ok(res) if res.get_ref().overall_code == Code::Ok as i32 => {
                            tally.decided += 1;
                        }
                        Err(status) if status.code() == tonic::Code::Unavailable => {
                            tally.unavailable += 1;
                        }
                        Err(status) if status.code() == tonic::Code::DeadlineExceeded => {
                            tally.deadline += 1;
                            // A caller that gave up asks again soon after,
                            // as Envoy's next request would.
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(status) if status.code() == tonic::Code::Cancelled => {
                            tally.deadline += 1;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        other => tally.other.push(format!("{other:?}")),
                    }
                }
                tally
            });
        }
        load
    }

    async fn finish(mut self) -> Tally {
        self.stop.store(true, Ordering::SeqCst);
        let mut total = Tally::default();
        while let Some(res) = self.tasks.join_next().await {
            let tally = res.expect("load task");
            total.decided += tally.decided;
            total.unavailable += tally.unavailable;
            total.deadline += tally.deadline;
            total.other.extend(tally.other);
        }
        total
    }
}

/// Pointed at a replica (every write refused with READONLY), 64 requests
/// in flight: the circuit opens as for a refused connect and the service
/// reconnects with the circuit's backoff: under 10 connections a second
/// reach the replica, and neither the library nor a decision is ever sent
/// to it. Every request is answered under the failure mode. With
/// `without_role`, the service's user may not use ROLE (an admin command
/// that ACLs often refuse): the role is read from HELLO instead.
async fn a_replica_is_backed_off(without_role: bool) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let master = RedisServer::start();
    let replica =
        RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port().to_string()]);
    let mut admin = replica.connection().await;
    let url = match without_role {
        false => replica.url(),
        true => user_without(&replica, "-role").await,
    };
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &url])
        .args(&["--grpc-threads", "2"])
        .args(&["--redis-timeout-ms", "500"])
        .args(&["--failure-mode", "error"])
        .spawn();
    let channel = service.connect().await;
    wait_health(&channel, ServingStatus::NotServing).await;

    let load = Load::start(&service, 8, 64, None).await;
    // Counted once the load runs: connections per second while it lasts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = info_stat(&mut admin, "total_connections_received").await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = info_stat(&mut admin, "total_connections_received").await;
    let elapsed = started.elapsed().as_secs_f64();
    let tally = load.finish().await;

    let per_second = (after - before) as f64 / elapsed;
    eprintln!("{tally:?}; {per_second:.1} connections/s to the replica");
    assert!(
        tally.other.is_empty(),
        "{:?}",
        &tally.other[..3.min(tally.other.len())]
    );
    assert_eq!(tally.decided, 0, "decided on a replica");
    assert!(tally.unavailable > 100, "{tally:?}");
    assert!(
        per_second < 10.0,
        "{per_second:.1} connections/s to the replica; log:\n{}",
        service.log()
    );
    let stats = command_stats(&mut admin).await;
    for command in ["function|load", "fcall", "evalsha"] {
        let sent = command_stat(&stats, command, "calls").unwrap_or(0.0)
            + command_stat(&stats, command, "rejected_calls").unwrap_or(0.0);
        assert_eq!(sent, 0.0, "{command} sent to the replica:\n{stats}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_backed_off_from_like_a_refused_connect() {
    a_replica_is_backed_off(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_backed_off_from_when_role_is_not_allowed() {
    a_replica_is_backed_off(true).await;
}

/// Redis stalls (`DEBUG SLEEP 2`) while 64 callers with Envoy's 20 ms
/// deadline keep asking, for at least 700 ms: every call written holds its
/// place until Redis answers it, so after the stall Redis runs at most the
/// documented number of calls (64 per pool; here the shared runtime's
/// pool alone), however many requests gave up meanwhile.
async fn a_stall_leaves_at_most_the_bound_to_run(extra: &[&str]) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let redis = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.url()])
        .args(&["--redis-timeout-ms", "250"])
        .args(&["--failure-mode", "error"])
        .args(extra)
        .spawn();
    let channel = service.connect().await;
    wait_health(&channel, ServingStatus::Serving).await;
    let mut client = RateLimitServiceClient::new(channel.clone());
    assert_eq!(ask(&mut client, load_request()).await, Answer::Ok);
    let mut admin = redis.connection().await;
    reset_stats(&mut admin).await;

    let sleep = redis.put_to_sleep(2.0).await;
    let stalled = Instant::now();
    let load = Load::start(&service, 8, 64, Some(Duration::from_millis(20))).await;
    // Callers give up and ask again over several of the service's 250 ms
    // timeouts (when places used to come back), and until they have asked
    // for several times the bound, however loaded the machine; always
    // well before the stall ends.
    tokio::time::sleep(Duration::from_millis(700)).await;
    while load.sent.load(Ordering::SeqCst) < 4 * MAX_IN_FLIGHT as u64
        && stalled.elapsed() < Duration::from_millis(1_600)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sent = load.sent.load(Ordering::SeqCst);
    let tally = load.finish().await;
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    // What was written during the stall runs now; then nothing more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stats = command_stats(&mut admin).await;
    let ran = command_stat(&stats, "fcall", "calls").unwrap_or(0.0)
        + command_stat(&stats, "evalsha", "calls").unwrap_or(0.0);
    eprintln!("{extra:?}: {sent} requests sent during the stall ({tally:?}); {ran} calls ran");
    assert!(
        tally.other.is_empty(),
        "{:?}",
        &tally.other[..3.min(tally.other.len())]
    );
    assert!(
        sent > 2 * MAX_IN_FLIGHT as u64,
        "only {sent} requests during the stall"
    );
    assert!(ran >= 1.0, "no call was written during the stall:\n{stats}");
    assert!(
        ran <= MAX_IN_FLIGHT,
        "{ran} calls ran after the stall, over the bound of {MAX_IN_FLIGHT}:\n{stats}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_leaves_at_most_the_bound_to_run_one_call_per_request() {
    a_stall_leaves_at_most_the_bound_to_run(&["--redis-batch", "off"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_leaves_at_most_the_bound_to_run_with_batches() {
    // One batch in flight per pooled connection: 64 connections, so that
    // calls, not the batcher's slots, meet the bound.
    a_stall_leaves_at_most_the_bound_to_run(&["--redis-batch", "on", "--redis-pool-size", "64"])
        .await;
}

/// A pool of one connection and 500 requests in flight against a healthy
/// Redis: nothing is shed, every request is decided. (The bound once grew
/// with the pool size: 8 calls in flight and 256 waiting per connection
/// shed most of them.)
async fn a_pool_of_one_sheds_nothing(batch: &str) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let redis = RedisServer::start();
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.url()])
        .args(&["--redis-pool-size", "1"])
        .args(&["--redis-batch", batch])
        // Generous: two shared cores run the debug build, Redis and 500
        // clients; the question is shedding, not speed.
        .args(&["--redis-timeout-ms", "5000"])
        .args(&["--failure-mode", "error"])
        .spawn();
    let channel = service.connect().await;
    wait_health(&channel, ServingStatus::Serving).await;
    let load = Load::start(&service, 10, 500, None).await;
    // Three requests per client, however slow the machine: the 500 are
    // in flight together for most of the run.
    let started = Instant::now();
    while load.sent.load(Ordering::SeqCst) < 1_500 && started.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tally = load.finish().await;
    let shed = metric_sum(
        &service,
        "throttlegate_backend_errors_total{backend=\"redis\",kind=\"shed\"}",
    )
    .await;
    eprintln!("pool 1, batch {batch}, 500 in flight: {tally:?}, {shed} shed");
    assert!(
        tally.other.is_empty(),
        "{:?}",
        &tally.other[..3.min(tally.other.len())]
    );
    assert_eq!(shed, 0.0, "{tally:?}");
    assert_eq!(tally.unavailable, 0, "{tally:?}");
    assert_eq!(tally.deadline, 0, "{tally:?}");
    assert!(tally.decided >= 1_500, "{tally:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_one_sheds_nothing_one_call_per_request() {
    a_pool_of_one_sheds_nothing("off").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_one_sheds_nothing_with_batches() {
    a_pool_of_one_sheds_nothing("on").await;
}
