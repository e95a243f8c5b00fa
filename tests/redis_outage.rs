//! Redis outages and slow replies: fail fast while Redis cannot be reached,
//! wait the full timeout while it is only slow, and never reconnect more
//! than the connection in doubt.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tonic_health::pb::health_check_response::ServingStatus;

use support::redis::{RedisServer, settings};
use support::service::{TestService, default_options, one_entry_request, start_with_config};
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error};
use throttlegate::limiter::{FailureMode, Options};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000}
"#;

/// Envoy's rate-limit filter often gives up after 20 ms; an answer under the
/// failure mode must come well within that.
const FAST: Duration = Duration::from_millis(20);
/// Within this, health and decisions notice an outage and a recovery.
const HEALTH_BOUND: Duration = Duration::from_secs(5);

/// Redis 7 refuses `DEBUG` unless enabled; the tests use `DEBUG SLEEP` to
/// make Redis slow while every connection stays open.
fn start_debuggable() -> RedisServer {
    RedisServer::start_with(&["--enable-debug-command", "local"])
}

/// A connection that waits as long as Redis sleeps (redis-rs gives up after
/// 500 ms by default).
async fn patient_connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(server.url())
        .expect("valid url")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connect to the test redis")
}

async fn client_id(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis::cmd("CLIENT")
        .arg("ID")
        .query_async(conn)
        .await
        .expect("client id")
}

/// Ids of the clients connected to Redis, except `skip`.
async fn client_ids(conn: &mut redis::aio::MultiplexedConnection, skip: &[u64]) -> HashSet<u64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(conn)
        .await
        .expect("client list");
    list.lines()
        .filter_map(|line| {
            line.split_whitespace()
                .next()?
                .strip_prefix("id=")?
                .parse::<u64>()
                .ok()
        })
        .filter(|id| !skip.contains(id))
        .collect()
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

/// Sends 32 concurrent probes, so the pool opens as many connections as it
/// may.
async fn use_concurrently(backend: &Arc<RedisBackend>) {
    let mut tasks = JoinSet::new();
    for _ in 0..32 {
        let backend = backend.clone();
        tasks.spawn(async move { backend.probe().await });
    }
    while let Some(res) = tasks.join_next().await {
        res.expect("probe task").expect("redis answers");
    }
}

/// A probe PING that gets no answer may sit on a half-open connection, so
/// that connection is replaced; the others are healthy and stay, so a slow
/// script never makes the whole pool (of every replica) reconnect at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_timeout_replaces_only_the_probed_connection() {
    const POOL: usize = 4;
    let server = start_debuggable();
    let mut it = settings(&server, ClockSource::Redis);
    it.pool_size = POOL as u32;
    it.timeout_ms = 300;
    let backend = Arc::new(RedisBackend::connect(it).await.unwrap());
    let mut admin = server.connection().await;
    let mut sleeper = patient_connection(&server).await;
    let skip = [client_id(&mut admin).await, client_id(&mut sleeper).await];

    let mut pooled = HashSet::new();
    for _ in 0..50 {
        use_concurrently(&backend).await;
        pooled = client_ids(&mut admin, &skip).await;
        if pooled.len() == POOL {
            break;
        }
    }
    assert_eq!(pooled.len(), POOL, "the pool never filled: {pooled:?}");
    let received_before = connections_received(&mut admin).await;

    // DEBUG SLEEP blocks the whole server: the probe's PING gets no answer.
    let sleep = tokio::spawn(async move {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("1.5")
            .query_async::<()>(&mut sleeper)
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let err = backend.probe().await.expect_err("redis is asleep");
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    sleep.await.expect("sleep task").expect("debug sleep");

    for _ in 0..3 {
        use_concurrently(&backend).await;
    }
    let received = connections_received(&mut admin).await - received_before;
    assert!(
        received <= 1,
        "{received} connections made after one probe timed out"
    );
    let after = client_ids(&mut admin, &skip).await;
    let kept = pooled.intersection(&after).count();
    assert!(kept >= POOL - 1, "kept {kept} of {pooled:?}: now {after:?}");
}

/// A gRPC server over Redis at `server` with a 300 ms timeout.
async fn service(
    server: &RedisServer,
    failure_mode: FailureMode,
) -> (TestService, Arc<RedisBackend>) {
    let mut it = settings(server, ClockSource::Redis);
    it.timeout_ms = 300;
    let backend = Arc::new(RedisBackend::connect(it).await.unwrap());
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
    for _ in 0..100 {
        let started = Instant::now();
        assert_eq!(ask(&service).await, expected);
        latencies.push(started.elapsed());
    }
    latencies.sort();
    let p99 = latencies[98];
    eprintln!(
        "{failure_mode:?} while redis is down: p50 {:?}, p99 {p99:?}, max {:?}",
        latencies[49], latencies[99]
    );
    assert!(p99 < FAST, "p99 {p99:?}: {latencies:?}");
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
    outage_fails_fast_and_recovers(FailureMode::Allow, Answer::FailureOk).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_deny_at_once_and_recovers() {
    outage_fails_fast_and_recovers(FailureMode::Deny, Answer::FailureOverLimit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_unavailable_at_once_and_recovers() {
    outage_fails_fast_and_recovers(FailureMode::Error, Answer::Unavailable).await;
}

/// A Redis that is connected but slow (`DEBUG SLEEP` longer than the
/// timeout) is not an outage: each call still waits the whole timeout for
/// its answer, and the circuit stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_redis_gets_the_full_timeout_and_keeps_the_circuit_closed() {
    let server = start_debuggable();
    let (service, backend) = service(&server, FailureMode::Error).await;
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, HEALTH_BOUND)
        .await;
    // Several pooled connections, as under load: a health probe that times
    // out during the sleep retires one, and the others carry on.
    use_concurrently(&backend).await;
    assert_eq!(ask(&service).await, Answer::Decided);

    let mut sleeper = patient_connection(&server).await;
    let sleep = tokio::spawn(async move {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg("2")
            .query_async::<()>(&mut sleeper)
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..3 {
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
