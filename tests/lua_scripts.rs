//! `lua/decide.lua` called directly against a real redis-server: its
//! argument contract, TTLs, boundaries, injected time and stored bytes.

mod support;

use redis::aio::MultiplexedConnection;
use support::redis::RedisServer;
use throttlegate::backends::redis::DECIDE_LUA;

const T0: u64 = 1_700_000_000_000_001;

/// One limit's ARGV fields: algorithm, limit, window_us, capacity, per_us,
/// scale, cost, mode.
struct Limit {
    algorithm: &'static str,
    limit: u64,
    window_us: u64,
    capacity: u64,
    per_us: u64,
    scale: u64,
    cost: u64,
    mode: &'static str,
}

fn log_limit(limit: u64, window_s: u64, cost: u64) -> Limit {
    Limit {
        algorithm: "sliding_window_log",
        limit,
        window_us: window_s * 1_000_000,
        capacity: limit,
        per_us: 0,
        scale: 1,
        cost,
        mode: "enforce",
    }
}

async fn call(
    conn: &mut MultiplexedConnection,
    keys: &[&str],
    now: Option<u64>,
    limits: &[Limit],
) -> redis::RedisResult<Vec<i64>> {
    call_with_grace(conn, keys, now, 0, limits).await
}

/// `grace_ms` extends every TTL: tests that step an injected clock by
/// microseconds while real milliseconds pass need keys to outlive the
/// real-time expiry of a state that is almost fresh.
async fn call_with_grace(
    conn: &mut MultiplexedConnection,
    keys: &[&str],
    now: Option<u64>,
    grace_ms: u64,
    limits: &[Limit],
) -> redis::RedisResult<Vec<i64>> {
    let script = redis::Script::new(DECIDE_LUA);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(*key);
    }
    invocation.arg(now.map(|it| it.to_string()).unwrap_or_default());
    invocation.arg(grace_ms);
    for it in limits {
        invocation
            .arg(it.algorithm)
            .arg(it.limit)
            .arg(it.window_us)
            .arg(it.capacity)
            .arg(it.per_us)
            .arg(it.scale)
            .arg(it.cost)
            .arg(it.mode);
    }
    invocation.invoke_async(conn).await
}

async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query_async(conn).await.unwrap()
}

#[tokio::test]
async fn sha_matches_the_embedded_script() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let loaded: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(DECIDE_LUA)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(loaded, redis::Script::new(DECIDE_LUA).get_hash());
    let backend =
        support::redis::backend(&server, throttlegate::backends::redis::ClockSource::Redis).await;
    assert_eq!(backend.script_hash(), loaded);
}

#[tokio::test]
async fn first_hit_sets_the_ttl_of_the_window() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let reply = call(&mut conn, &["k"], Some(T0), &[log_limit(10, 2, 1)])
        .await
        .unwrap();
    assert_eq!(reply, vec![1, T0 as i64, 1, 1, 9, 2_000_000]);
    let ttl = pttl(&mut conn, "k").await;
    assert!((1_900..=2_000).contains(&ttl), "pttl {ttl}");
}

#[tokio::test]
async fn boundary_of_the_window_holds() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for idx in 0..10 {
        let reply = call_with_grace(
            &mut conn,
            &["k"],
            Some(T0 + idx),
            60_000,
            &[log_limit(10, 1, 1)],
        )
        .await
        .unwrap();
        assert_eq!(reply[0], 1, "request {idx}");
    }
    // Full: the oldest entry (T0) leaves at T0 + W exactly, not a µs before.
    let denied = call_with_grace(
        &mut conn,
        &["k"],
        Some(T0 + 999_999),
        60_000,
        &[log_limit(10, 1, 1)],
    )
    .await
    .unwrap();
    assert_eq!(denied, vec![0, (T0 + 999_999) as i64, 0, 0, 0, 1]);
    let allowed = call_with_grace(
        &mut conn,
        &["k"],
        Some(T0 + 1_000_000),
        60_000,
        &[log_limit(10, 1, 1)],
    )
    .await
    .unwrap();
    assert_eq!(allowed[..5], [1, (T0 + 1_000_000) as i64, 1, 1, 0]);
}

#[tokio::test]
async fn injected_time_is_used_and_redis_time_otherwise() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let reply = call(&mut conn, &["a"], Some(42_000_000), &[log_limit(5, 1, 1)])
        .await
        .unwrap();
    assert_eq!(reply[1], 42_000_000);
    let scores: Vec<(String, String)> = redis::cmd("ZRANGE")
        .arg("a")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        scores,
        vec![("42000000:1".to_owned(), "42000000".to_owned())]
    );

    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let before = secs * 1_000_000 + micros;
    let reply = call(&mut conn, &["b"], None, &[log_limit(5, 1, 1)])
        .await
        .unwrap();
    let used = reply[1] as u64;
    assert!(
        used >= before && used < before + 1_000_000,
        "{used} vs {before}"
    );
}

/// Lua's `..` on a number formats with %.14g: a µs timestamp would become
/// `1.7000000000000e+15`, colliding members and shifting scores.
#[tokio::test]
async fn microsecond_timestamps_are_stored_exactly() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    call(&mut conn, &["log"], Some(T0), &[log_limit(5, 1, 2)])
        .await
        .unwrap();
    let members: Vec<(String, String)> = redis::cmd("ZRANGE")
        .arg("log")
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        members,
        vec![
            (
                "1700000000000001:1".to_owned(),
                "1700000000000001".to_owned()
            ),
            (
                "1700000000000001:2".to_owned(),
                "1700000000000001".to_owned()
            ),
        ]
    );
    // A token bucket of 3 per second (scale 1_000_000 / 1 … reduced: per_us
    // 3, scale 1_000_000), one taken.
    let bucket = Limit {
        algorithm: "token_bucket",
        limit: 3,
        window_us: 1_000_000,
        capacity: 3,
        per_us: 3,
        scale: 1_000_000,
        cost: 1,
        mode: "enforce",
    };
    call(&mut conn, &["tb"], Some(T0), &[bucket]).await.unwrap();
    let stored: String = redis::cmd("GET")
        .arg("tb")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, "2000000:1700000000000001:1000000");
}

/// With math.random() as the member suffix, Redis 5/6 reseed the PRNG per
/// script and every member at one timestamp collided: 8 of 8 passed.
#[tokio::test]
async fn same_microsecond_requests_get_distinct_members() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let mut allowed = 0;
    for _ in 0..8 {
        let reply = call(&mut conn, &["k"], Some(T0), &[log_limit(5, 1, 1)])
            .await
            .unwrap();
        allowed += reply[0];
    }
    assert_eq!(allowed, 5);
    let card: u64 = redis::cmd("ZCARD")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(card, 5);
}

/// One ZADD per request would let (limit - cost + 1) requests of cost 5
/// through a limit of 10.
#[tokio::test]
async fn cost_counts_as_cost_in_the_log() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let mut allowed = 0;
    for idx in 0..6 {
        let reply = call(&mut conn, &["k"], Some(T0 + idx), &[log_limit(10, 1, 5)])
            .await
            .unwrap();
        allowed += reply[0];
    }
    assert_eq!(allowed, 2);
    let card: u64 = redis::cmd("ZCARD")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(card, 10);
}

#[tokio::test]
async fn denied_request_writes_nothing_to_the_limit_it_passed() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    call(&mut conn, &["full"], Some(T0), &[log_limit(1, 1, 1)])
        .await
        .unwrap();
    let reply = call(
        &mut conn,
        &["open", "full"],
        Some(T0 + 1),
        &[log_limit(5, 1, 1), log_limit(1, 1, 1)],
    )
    .await
    .unwrap();
    assert_eq!(reply[0], 0);
    assert_eq!(reply[2..6], [1, 0, 5, 0]);
    let exists: u64 = redis::cmd("EXISTS")
        .arg("open")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0);
}

#[tokio::test]
async fn bad_arguments_are_refused_before_any_write() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let mut bad = log_limit(5, 1, 1);
    bad.algorithm = "leaky";
    let err = call(&mut conn, &["k"], Some(T0), &[bad]).await.unwrap_err();
    assert!(err.to_string().contains("bad parameters"), "{err}");
    let mut fractional = log_limit(5, 1, 1);
    fractional.window_us = 0;
    assert!(
        call(&mut conn, &["k"], Some(T0), &[fractional])
            .await
            .is_err()
    );
    let err = call(&mut conn, &["k"], Some(T0), &[]).await.unwrap_err();
    assert!(err.to_string().contains("arguments"), "{err}");
    let err = call(&mut conn, &["k"], Some(u64::MAX), &[log_limit(5, 1, 1)])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("bad time"), "{err}");
    let size: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(size, 0);
}

fn bucket_limit(limit: u64, window_s: u64, cost: u64) -> Limit {
    let params = throttlegate::algorithms::LimitParams::new(
        throttlegate::algorithms::Algorithm::TokenBucket,
        limit,
        window_s * 1_000_000,
        None,
    )
    .unwrap();
    let rate = params.rate();
    Limit {
        algorithm: "token_bucket",
        limit,
        window_us: window_s * 1_000_000,
        capacity: params.capacity(),
        per_us: rate.per_us,
        scale: rate.scale,
        cost,
        mode: "enforce",
    }
}

/// Float refill (0.1 token added ten times is below 1) moved a boundary by
/// one step. Here every call stores the refilled state, so ten refills of a
/// tenth of a token each must make exactly one token.
#[tokio::test]
async fn token_bucket_refill_has_no_float_drift() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let grace = 60_000;
    let take = |now| call_with_grace_owned(&server, now, grace, bucket_limit(10, 1, 1));
    for _ in 0..10 {
        assert_eq!(take(T0).await[0], 1);
    }
    assert_eq!(take(T0).await[0], 0);
    // 10 per second: a tenth of a token every 10 ms, stored each time.
    for step in 1..10 {
        let reply = call_with_grace(
            &mut conn,
            &["k"],
            Some(T0 + step * 10_000),
            grace,
            &[bucket_limit(10, 1, 0)],
        )
        .await
        .unwrap();
        assert_eq!(reply[4], 0, "step {step}: no whole token yet");
    }
    assert_eq!(take(T0 + 99_999).await[0], 0);
    assert_eq!(take(T0 + 100_000).await[0], 1);
}

/// A request whose clock lags the stored state never moves its timestamp
/// back (it would hand out the same tokens twice).
#[tokio::test]
async fn a_lagging_clock_never_moves_a_stored_timestamp_back() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let late = T0 + 5_000_000;
    call(&mut conn, &["k"], Some(late), &[bucket_limit(10, 60, 1)])
        .await
        .unwrap();
    let reply = call(&mut conn, &["k"], Some(T0), &[bucket_limit(10, 60, 1)])
        .await
        .unwrap();
    assert_eq!(reply[0], 1);
    // 8 tokens left, 2 × 6 s to refill, counted from the stored time: the
    // lagging request waits the 5 s of lag on top.
    assert_eq!(reply[4..6], [8, 5_000_000 + 12_000_000]);
    let stored: String = redis::cmd("GET")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    // 8 tokens at scale 6_000_000 (10 per 60 s is 1 per 6_000_000 µs).
    assert_eq!(stored, format!("48000000:{late}:6000000"));
}

async fn call_with_grace_owned(
    server: &RedisServer,
    now: u64,
    grace: u64,
    limit: Limit,
) -> Vec<i64> {
    let mut conn = server.connection().await;
    call_with_grace(&mut conn, &["k"], Some(now), grace, &[limit])
        .await
        .unwrap()
}
