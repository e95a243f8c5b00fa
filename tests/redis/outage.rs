//! Redis outages and slow replies: fail fast while Redis cannot be reached,
//! wait the full timeout while it is only slow, and never reconnect more
//! than the connection in doubt.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::ONE_AT_A_TIME;
use crate::support::redis::{RedisServer, backend_with, client_id, client_ids};
use crate::support::service::{TestService, default_options, one_entry_request, start_with_config};
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error};
use throttlegate::decision::{FailureMode, Options};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;

/// Envoy's rate-limit filter often gives up after 20 ms; an answer under the
/// failure mode must come well within that. On a loaded machine every RPC
/// is late by the same scheduling delays, so the bound applies on top of
/// the p99 of requests that need no backend at all, measured alongside.
const FAST: Duration = Duration::from_millis(20);
/// Within this, health and decisions notice an outage and a recovery.
const HEALTH_BOUND: Duration = Duration::from_secs(5);

/// Redis 7 refuses `DEBUG` unless enabled; the tests use `DEBUG SLEEP` to
/// make Redis slow while every connection stays open.
fn start_debuggable() -> RedisServer {
    RedisServer::start_with(&["--enable-debug-command", "local"])
}

/// `total_connections_received` from `INFO stats`.
async fn connections_received(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .expect("info stats");
    stats
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|it| it.trim().parse().ok())
        .unwrap_or_else(|| panic!("no total_connections_received in {stats}"))
}

/// Makes the empty pool of `backend` open at least two connections and
/// returns the ids of all its connections (every client but `skip`).
///
/// A call holds its pool slot only to clone the connection, so only
/// checkouts that find the pool empty make it open more: while Redis is
/// stopped no connection can complete (the kernel still accepts), so every
/// concurrent checkout finds the pool empty and asks for one.
async fn open_several_connections(
    server: &RedisServer,
    backend: &Arc<RedisBackend>,
    admin: &mut redis::aio::MultiplexedConnection,
    skip: &[u64],
) -> HashSet<u64> {
    server.pause();
    let mut tasks = JoinSet::new();
    for _ in 0..8 {
        let backend = backend.clone();
        tasks.spawn(async move { backend.probe().await });
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.resume();
    while let Some(res) = tasks.join_next().await {
        res.expect("probe task").expect("redis answers");
    }
    let pooled = client_ids(admin, skip).await;
    assert!(
        pooled.len() >= 2,
        "the pool did not open several connections: {pooled:?}"
    );
    pooled
}

/// A probe PING that gets no answer may sit on a half-open connection, so
/// that connection is replaced; the others are healthy and stay, so a slow
/// script never makes the whole pool (of every replica) reconnect at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_timeout_replaces_only_the_probed_connection() {
    let _serial = ONE_AT_A_TIME.lock().await;
    const POOL: usize = 4;
    let server = start_debuggable();
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.pool_size = POOL as u32;
        it.timeout_ms = 300;
    });
    let backend = Arc::new(backend.await);
    let mut admin = server.connection().await;
    let skip = [client_id(&mut admin).await];
    let pooled = open_several_connections(&server, &backend, &mut admin, &skip).await;
    let received_before = connections_received(&mut admin).await;

    // DEBUG SLEEP blocks the whole server: the probe's PING gets no answer.
    let sleep = server.put_to_sleep(1.5).await;
    let err = backend.probe().await.expect_err("redis is asleep");
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    sleep.await.expect("sleep task").expect("debug sleep");

    // One call after another: the pool still has healthy connections to
    // serve them, so none is made (retiring the whole pool made one).
    for _ in 0..2 * POOL {
        backend.probe().await.expect("redis is awake");
    }
    // The sleeper's and the watcher's connections.
    let received = connections_received(&mut admin).await - received_before - 2;
    assert_eq!(
        received,
        0,
        "connections made after one probe timed out with {} pooled",
        pooled.len()
    );
    let after = client_ids(&mut admin, &skip).await;
    let kept = pooled.intersection(&after).count();
    assert!(
        kept >= pooled.len() - 1,
        "kept {kept} of {pooled:?}: now {after:?}"
    );
}

/// A backend on `server` with a 300 ms timeout.
async fn backend(server: &RedisServer) -> Arc<RedisBackend> {
    Arc::new(backend_with(server, ClockSource::Redis, |it| it.timeout_ms = 300).await)
}

/// A gRPC server over Redis at `server` with a 300 ms timeout.
async fn service(
    server: &RedisServer,
    failure_mode: FailureMode,
) -> (TestService, Arc<RedisBackend>) {
    service_on(backend(server).await, failure_mode).await
}

async fn service_on(
    backend: Arc<RedisBackend>,
    failure_mode: FailureMode,
) -> (TestService, Arc<RedisBackend>) {
    let options = Options {
        failure_mode,
        ..default_options()
    };
    let dyn_backend: Arc<dyn Backend> = backend.clone();
    let service = start_with_config(CONFIG, dyn_backend, options).await;
    (service, backend)
}

/// What the service answered: a decision from Redis (with the limit), an
/// answer under the failure mode (without one), or an error status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Decided,
    FailureOk,
    FailureOverLimit,
    Unavailable,
}

/// A request in a domain without rules: answered without a backend call.
async fn ask_without_backend(service: &TestService) {
    let res = service
        .client()
        .should_rate_limit(one_entry_request("elsewhere", "user", "alice"))
        .await
        .expect("answered without the backend")
        .into_inner();
    assert_eq!(res.overall_code, Code::Ok as i32);
}

fn p99(mut latencies: Vec<Duration>) -> Duration {
    latencies.sort();
    latencies[latencies.len() * 99 / 100 - 1]
}

async fn ask(service: &TestService) -> Answer {
    let res = service
        .client()
        .should_rate_limit(one_entry_request("api", "user", "alice"))
        .await;
    match res {
        Ok(res) => {
            let res = res.into_inner();
            let status = &res.statuses[0];
            match (status.current_limit.is_some(), res.overall_code) {
                (true, code) if code == Code::Ok as i32 => Answer::Decided,
                (false, code) if code == Code::Ok as i32 => Answer::FailureOk,
                (false, code) if code == Code::OverLimit as i32 => Answer::FailureOverLimit,
                _ => panic!("unexpected answer {res:?}"),
            }
        }
        Err(status) if status.code() == tonic::Code::Unavailable => Answer::Unavailable,
        Err(status) => panic!("unexpected status {status:?}"),
    }
}

/// Redis killed (connections refused): once the circuit is open, every
/// answer comes at once under the failure mode; Redis started again on the
/// same port: decisions and health come back without a restart.
async fn outage_fails_fast_and_recovers(failure_mode: FailureMode, expected: Answer) {
    let mut server = RedisServer::start();
    let (service, backend) = service(&server, failure_mode).await;
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, HEALTH_BOUND)
        .await;
    assert_eq!(ask(&service).await, Answer::Decided);

    server.kill();
    let started = Instant::now();
    while !backend.circuit_open() {
        assert!(
            started.elapsed() < HEALTH_BOUND,
            "the circuit did not open within {HEALTH_BOUND:?}"
        );
        assert_eq!(ask(&service).await, expected);
    }
    let mut latencies = Vec::with_capacity(100);
    let mut baseline = Vec::with_capacity(100);
    for _ in 0..100 {
        let started = Instant::now();
        assert_eq!(ask(&service).await, expected);
        latencies.push(started.elapsed());
        let started = Instant::now();
        ask_without_backend(&service).await;
        baseline.push(started.elapsed());
    }
    let (p99, baseline_p99) = (p99(latencies), p99(baseline));
    eprintln!(
        "{failure_mode:?} while redis is down: p99 {p99:?}; without a backend call: p99 {baseline_p99:?}"
    );
    assert!(
        p99 < FAST + baseline_p99,
        "p99 {p99:?} while redis is down, {baseline_p99:?} without a backend call"
    );
    service
        .wait_for_health("ratelimit", ServingStatus::NotServing, HEALTH_BOUND)
        .await;

    server.restart();
    let restarted = Instant::now();
    loop {
        if ask(&service).await == Answer::Decided {
            break;
        }
        assert!(
            restarted.elapsed() < HEALTH_BOUND,
            "no decision within {HEALTH_BOUND:?} of redis coming back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!backend.circuit_open());
    let left = HEALTH_BOUND.saturating_sub(restarted.elapsed());
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, left)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_allow_at_once_and_recovers() {
    let _serial = ONE_AT_A_TIME.lock().await;
    outage_fails_fast_and_recovers(FailureMode::Allow, Answer::FailureOk).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_deny_at_once_and_recovers() {
    let _serial = ONE_AT_A_TIME.lock().await;
    outage_fails_fast_and_recovers(FailureMode::Deny, Answer::FailureOverLimit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_unavailable_at_once_and_recovers() {
    let _serial = ONE_AT_A_TIME.lock().await;
    outage_fails_fast_and_recovers(FailureMode::Error, Answer::Unavailable).await;
}

/// A Redis that is connected but slow (`DEBUG SLEEP` longer than the
/// timeout) is not an outage: each call still waits the whole timeout for
/// its answer, and the circuit stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_gets_the_full_timeout_and_keeps_the_circuit_closed() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = start_debuggable();
    // Several pooled connections, as under load: a health probe that times
    // out during the sleep retires one (at most one probe a second, and the
    // sleep is shorter), and the others carry on.
    let backend = backend(&server).await;
    let mut admin = server.connection().await;
    let skip = [client_id(&mut admin).await];
    open_several_connections(&server, &backend, &mut admin, &skip).await;
    let (service, backend) = service_on(backend, FailureMode::Error).await;
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, HEALTH_BOUND)
        .await;
    assert_eq!(ask(&service).await, Answer::Decided);

    let sleep = server.put_to_sleep(0.95).await;
    for _ in 0..2 {
        let started = Instant::now();
        assert_eq!(ask(&service).await, Answer::Unavailable);
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(290),
            "answered after {elapsed:?}, before the 300 ms timeout"
        );
        assert!(
            elapsed < Duration::from_millis(300 + 1_000),
            "answered after {elapsed:?} with a 300 ms timeout"
        );
        assert!(!backend.circuit_open(), "a slow reply opened the circuit");
    }
    sleep.await.expect("sleep task").expect("debug sleep");
    assert_eq!(ask(&service).await, Answer::Decided);
    assert!(!backend.circuit_open());
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, HEALTH_BOUND)
        .await;
}
