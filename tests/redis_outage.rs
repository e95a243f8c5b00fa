//! Redis outages and slow replies: fail fast while Redis cannot be reached,
//! wait the full timeout while it is only slow, and never reconnect more
//! than the connection in doubt.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use support::redis::{RedisServer, settings};
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error};
use tokio::task::JoinSet;

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
