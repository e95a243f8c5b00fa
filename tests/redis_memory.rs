//! Memory per key and script cost, measured on a real redis-server (the
//! figures in docs/redis.md come from `cargo test --test redis_memory --
//! --nocapture`); the assertions hold the layout to its budget.

mod support;

use std::sync::Arc;

use support::redis::{RedisServer, backend, check, counter_key};
use throttlegate::algorithms::Algorithm;
use throttlegate::backends::Backend;
use throttlegate::backends::redis::{ClockSource, DECIDE_LUA};
use throttlegate::clock::ManualClock;

const T0: u64 = 1_700_000_000_000_000;

async fn memory_usage(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn one_request_costs_a_few_dozen_bytes_per_key() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let backend = backend(&server, ClockSource::Local(Arc::new(clock))).await;
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let key = counter_key(algorithm, 60, &[("remote_address", "10.0.0.1")]);
        let checks = [check(key.clone(), 100, 1)];
        assert!(backend.decide(&checks).await.unwrap().allowed);
        let name = backend.key_of(&key);
        let bytes = memory_usage(&mut conn, &name).await;
        // Then the script's server-side time over 200 more calls.
        let () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut conn)
            .await
            .unwrap();
        for _ in 0..200 {
            backend.decide(&checks).await.unwrap();
        }
        let usec = evalsha_usec_per_call(&mut conn).await;
        println!(
            "{algorithm}: {bytes} B for the {}-byte key {name}, {usec} µs/call",
            name.len()
        );
        assert!(bytes <= 160, "{algorithm}: {bytes} B");
    }
}

async fn evalsha_usec_per_call(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:"))
        .and_then(|rest| {
            rest.split(',')
                .find_map(|it| it.strip_prefix("usec_per_call="))
        })
        .and_then(|it| it.parse().ok())
        .unwrap_or_else(|| panic!("no evalsha stats in {stats}"))
}

/// A sliding log at its limit in steady state: each request lets the
/// oldest entry go and adds one.
async fn sliding_log_at(server: &RedisServer, limit: u64) -> (u64, f64) {
    let mut conn = server.connection().await;
    let window_us = 60_000_000;
    let step = window_us / limit;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(DECIDE_LUA)
        .query_async(&mut conn)
        .await
        .unwrap();
    let evalsha = |now: u64| {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&sha).arg(1).arg("log").arg(now).arg(0);
        cmd.arg("sliding_window_log")
            .arg(limit)
            .arg(window_us)
            .arg(limit)
            .arg(0)
            .arg(1)
            .arg(1)
            .arg("enforce");
        cmd
    };
    // Fill the window with pipelines of 500 calls (the script is loaded,
    // so no NOSCRIPT can hit a pipeline).
    for chunk in (0..limit).collect::<Vec<_>>().chunks(500) {
        let mut fill = redis::pipe();
        for idx in chunk {
            fill.add_command(evalsha(T0 + idx * step)).ignore();
        }
        let () = fill.query_async(&mut conn).await.unwrap();
    }
    let bytes = memory_usage(&mut conn, "log").await;
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();
    let calls = 200;
    for idx in 0..calls {
        let reply: Vec<i64> = evalsha(T0 + window_us + idx * step)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(reply[0], 1, "steady state admits one per step");
    }
    let usec_per_call = evalsha_usec_per_call(&mut conn).await;
    let card: u64 = redis::cmd("ZCARD")
        .arg("log")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(card, limit);
    (bytes, usec_per_call)
}

#[tokio::test]
async fn sliding_log_cost_at_100_and_10_000() {
    let server = RedisServer::start();
    let (small_bytes, small_usec) = sliding_log_at(&server, 100).await;
    let mut conn = server.connection().await;
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let (large_bytes, large_usec) = sliding_log_at(&server, 10_000).await;
    println!(
        "sliding_window_log N=100: {small_bytes} B ({} B/entry), {small_usec} µs/call",
        small_bytes / 100
    );
    println!(
        "sliding_window_log N=10000: {large_bytes} B ({} B/entry), {large_usec} µs/call",
        large_bytes / 10_000
    );
    // listpack up to 128 entries, skiplist beyond (~130 B per entry).
    assert!(small_bytes <= 100 * 60, "{small_bytes}");
    assert!(large_bytes <= 10_000 * 160, "{large_bytes}");
    // Generous: two shared cores, debug client; the server-side time is
    // what is measured.
    assert!(large_usec < 5_000.0, "{large_usec} µs per call");
}
