//! `lua/decide.lua` called directly against a real redis-server: its
//! argument contract, TTLs, boundaries, injected time and stored bytes.

use crate::support;
use crate::support::redis::{RedisServer, members};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::{Algorithm, Charge, Check, LimitParams, Mode};
use throttlegate::backends::redis::DECIDE_LUA;
use throttlegate::backends::redis::script::{Arg, HeaderArgs, ReplyIntegers, ScriptLimit, argv};

const T0: u64 = 1_700_000_000_000_001;

/// A grace long enough that no key expires in real time while a test steps
/// its injected clock.
const GRACE_MS: u64 = 60_000;

fn log_limit(limit: u64, window_s: u64, cost: u64) -> ScriptLimit {
    ScriptLimit {
        algorithm: "sliding_window_log",
        limit,
        window_us: window_s * 1_000_000,
        capacity: limit,
        per_us: 0,
        scale: 1,
        cost,
        mode: "enforce",
        charge: "if_allowed",
    }
}

fn bucket_limit(limit: u64, window_s: u64, cost: u64) -> ScriptLimit {
    let params =
        LimitParams::new(Algorithm::TokenBucket, limit, window_s * 1_000_000, None).unwrap();
    ScriptLimit::of(&Check {
        params,
        cost,
        mode: Mode::Enforce,
    })
}

/// ARGV as the backend builds it.
fn args(now: Option<u64>, grace_ms: u64, limits: &[ScriptLimit]) -> Vec<Arg> {
    let header = HeaderArgs {
        now_us: now,
        grace_ms,
        receipts: false,
    };
    argv(&header, limits)
}

async fn call(
    conn: &mut MultiplexedConnection,
    keys: &[&str],
    now: Option<u64>,
    limits: &[ScriptLimit],
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
    limits: &[ScriptLimit],
) -> redis::RedisResult<Vec<i64>> {
    let script = redis::Script::new(DECIDE_LUA);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(*key);
    }
    invocation.arg(args(now, grace_ms, limits));
    let reply: redis::RedisResult<ReplyIntegers> = invocation.invoke_async(conn).await;
    reply.map(|it| it.0)
}

/// One limit on the key `k` at `now`, with [`GRACE_MS`]: the reply.
async fn hit(conn: &mut MultiplexedConnection, now: u64, limit: ScriptLimit) -> Vec<i64> {
    call_with_grace(conn, &["k"], Some(now), GRACE_MS, &[limit])
        .await
        .unwrap()
}

/// Writes one log member as an earlier call (or layout) would have.
async fn zadd(conn: &mut MultiplexedConnection, key: &str, score: u64, member: &str) {
    let _: () = redis::cmd("ZADD")
        .arg(key)
        .arg(score)
        .arg(member)
        .query_async(conn)
        .await
        .unwrap();
}

/// A one-argument command on `key`, such as PTTL, GET, EXISTS or ZCARD.
async fn query<T: redis::FromRedisValue>(
    conn: &mut MultiplexedConnection,
    command: &str,
    key: &str,
) -> T {
    redis::cmd(command)
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    query(conn, "PTTL", key).await
}

async fn dbsize(conn: &mut MultiplexedConnection) -> u64 {
    redis::cmd("DBSIZE").query_async(conn).await.unwrap()
}

/// Writes since start-up: unchanged across a call means it wrote nothing.
async fn writes(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("persistence")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("rdb_changes_since_last_save:"))
        .and_then(|it| it.trim().parse().ok())
        .expect("INFO persistence reports rdb_changes_since_last_save")
}

#[tokio::test]
async fn sha_matches_the_embedded_script() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let loaded = support::redis::load_decide_script(&mut conn).await;
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
    assert_eq!(reply, vec![1, 3, 9, 2_000_000]);
    let ttl = pttl(&mut conn, "k").await;
    assert!((1_900..=2_000).contains(&ttl), "pttl {ttl}");
}

#[tokio::test]
async fn boundary_of_the_window_holds() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for idx in 0..10 {
        let reply = hit(&mut conn, T0 + idx, log_limit(10, 1, 1)).await;
        assert_eq!(reply[0], 1, "request {idx}");
    }
    // Full: the oldest entry (T0) leaves at T0 + W exactly, not a µs before.
    let denied = hit(&mut conn, T0 + 999_999, log_limit(10, 1, 1)).await;
    assert_eq!(denied, vec![0, 0, 0, 1]);
    let allowed = hit(&mut conn, T0 + 1_000_000, log_limit(10, 1, 1)).await;
    assert_eq!(allowed[..3], [1, 3, 0]);
}

#[tokio::test]
async fn injected_time_is_used_and_redis_time_otherwise() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let reply = call(&mut conn, &["a"], Some(42_000_000), &[log_limit(5, 1, 1)])
        .await
        .unwrap();
    assert_eq!(reply[0], 1);
    let scores: Vec<(String, String)> = members(&mut conn, "a").await;
    assert_eq!(scores, vec![("1,1".to_owned(), "42000000".to_owned())]);

    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let before = secs * 1_000_000 + micros;
    let reply = call(&mut conn, &["b"], None, &[log_limit(5, 1, 1)])
        .await
        .unwrap();
    assert_eq!(reply[0], 1);
    let scores: Vec<(String, u64)> = members(&mut conn, "b").await;
    let used = scores[0].1;
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
    let members: Vec<(String, String)> = members(&mut conn, "log").await;
    assert_eq!(
        members,
        vec![("2,2".to_owned(), "1700000000000001".to_owned())]
    );
    // A token bucket of 3 per second (scale 1_000_000 / 1 … reduced: per_us
    // 3, scale 1_000_000), one taken.
    let bucket = ScriptLimit {
        algorithm: "token_bucket",
        limit: 3,
        window_us: 1_000_000,
        capacity: 3,
        per_us: 3,
        scale: 1_000_000,
        cost: 1,
        mode: "enforce",
        charge: "if_allowed",
    };
    call(&mut conn, &["tb"], Some(T0), &[bucket]).await.unwrap();
    let stored: String = query(&mut conn, "GET", "tb").await;
    assert_eq!(stored, "2000000:1700000000000001:1000000");
}

/// With math.random() as the member suffix, Redis 5/6 reseed the PRNG per
/// script and every member at one timestamp collided: 8 of 8 passed.
/// Requests in one µs now share one member holding their summed cost.
#[tokio::test]
async fn same_microsecond_requests_are_all_counted() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let mut allowed = 0;
    for _ in 0..8 {
        allowed += hit(&mut conn, T0, log_limit(5, 1, 1)).await[0];
    }
    assert_eq!(allowed, 5);
    assert_eq!(members(&mut conn, "k").await, [("5,5".to_owned(), T0)]);
}

/// Counting members instead of units would let (limit - cost + 1)
/// requests of cost 5 through a limit of 10; one member per unit made a
/// request's work and memory grow with its cost. Each request is one member
/// carrying its cost.
#[tokio::test]
async fn cost_counts_as_cost_in_the_log() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let mut allowed = 0;
    for idx in 0..6 {
        allowed += hit(&mut conn, T0 + idx, log_limit(10, 1, 5)).await[0];
    }
    assert_eq!(allowed, 2);
    assert_eq!(
        members(&mut conn, "k").await,
        [("5,5".to_owned(), T0), ("10,5".to_owned(), T0 + 1)]
    );
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
    assert_eq!(reply[1..4], [1, 5, 0]);
    let exists: u64 = query(&mut conn, "EXISTS", "open").await;
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
    assert_eq!(dbsize(&mut conn).await, 0);
}

/// Float refill (0.1 token added ten times is below 1) moved a boundary by
/// one step. Here every take stores a bucket holding a fraction of a token
/// (10 per second: a token every 100 ms), so the fractions must add up to
/// whole tokens exactly.
#[tokio::test]
async fn token_bucket_refill_has_no_float_drift() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let take = bucket_limit(10, 1, 1);
    for _ in 0..10 {
        assert_eq!(hit(&mut conn, T0, take).await[0], 1);
    }
    assert_eq!(hit(&mut conn, T0, take).await[0], 0);
    // 1.1 tokens at +110 ms: one taken, a tenth stored; and so on, each
    // take leaving one more tenth behind.
    for step in 1..10 {
        assert_eq!(
            hit(&mut conn, T0 + step * 110_000, take).await[0],
            1,
            "step {step}"
        );
    }
    // 0.9 stored at +990 ms: the next whole token is at +1000 ms exactly.
    let reply = hit(&mut conn, T0 + 999_999, bucket_limit(10, 1, 0)).await;
    assert_eq!(reply[2], 0, "no whole token a µs early");
    assert_eq!(hit(&mut conn, T0 + 1_000_000, take).await[0], 1);
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
    assert_eq!(reply[2..4], [8, 5_000_000 + 12_000_000]);
    let stored: String = query(&mut conn, "GET", "k").await;
    // 8 tokens at scale 6_000_000 (10 per 60 s is 1 per 6_000_000 µs).
    assert_eq!(stored, format!("48000000:{late}:6000000"));
}

// === the sliding log's layout: one member per request ===

/// A request of cost equal to a large limit wrote that many members (a
/// 3,000,000-unit request ran the script for seconds); it is one member,
/// and the key has the window's TTL from its first hit.
#[tokio::test]
async fn a_request_at_the_cap_is_one_member_with_the_window_ttl() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let reply = call(
        &mut conn,
        &["k"],
        Some(T0),
        &[log_limit(10_000, 60, 10_000)],
    )
    .await
    .unwrap();
    assert_eq!(reply, vec![1, 3, 0, 60_000_000]);
    assert_eq!(
        members(&mut conn, "k").await,
        [("10000,10000".to_owned(), T0)]
    );
    let ttl = pttl(&mut conn, "k").await;
    assert!((59_000..=60_000).contains(&ttl), "pttl {ttl}");
    let bytes: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg("k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(bytes < 1_024, "{bytes} bytes");
}

/// Expiry must subtract each leaving entry's cost, not one unit per
/// member, and a denied request waits for exactly the entries it needs.
#[tokio::test]
async fn expiry_subtracts_the_costs_of_the_entries_that_left() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let limit = |cost| log_limit(10, 1, cost);
    for (offset, cost) in [(0, 2), (10, 3), (20, 4)] {
        assert_eq!(hit(&mut conn, T0 + offset, limit(cost)).await[0], 1);
    }
    // 9 of 10 held: a request of 5 waits for the first two entries (5
    // units) to leave, a request of 2 only for the first.
    assert_eq!(
        hit(&mut conn, T0 + 30, limit(5)).await[1..],
        [0, 1, 1_000_010 - 30]
    );
    assert_eq!(
        hit(&mut conn, T0 + 30, limit(2)).await[1..],
        [0, 1, 1_000_000 - 30]
    );
    // The first entry (2 units) leaves at T0 + 1 s exactly.
    assert_eq!(hit(&mut conn, T0 + 999_999, limit(0)).await[2], 1);
    assert_eq!(hit(&mut conn, T0 + 1_000_000, limit(0)).await[2], 3);
    assert_eq!(hit(&mut conn, T0 + 1_000_010, limit(0)).await[2], 6);
    // Consuming removes the expired entries and keeps the running total.
    assert_eq!(
        hit(&mut conn, T0 + 1_000_010, limit(6)).await[..4],
        [1, 3, 0, 1_000_000]
    );
    assert_eq!(
        members(&mut conn, "k").await,
        [
            ("9,4".to_owned(), T0 + 20),
            ("15,6".to_owned(), T0 + 1_000_010)
        ]
    );
}

/// Requests in the same µs never overwrite each other: they join one
/// member. Members of one score sort by their bytes ("10,.." before
/// "5,.."), so separate members at one µs made an older entry look newest
/// and lost the units of the requests after it.
#[tokio::test]
async fn equal_timestamps_never_collide() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for _ in 0..4 {
        assert_eq!(hit(&mut conn, T0, log_limit(20, 1, 5)).await[0], 1);
    }
    assert_eq!(members(&mut conn, "k").await, [("20,20".to_owned(), T0)]);
    let reply = hit(&mut conn, T0, log_limit(20, 1, 1)).await;
    assert_eq!(reply[..3], [0, 0, 0]);
    // Once the window has passed, the expired member goes and a new one
    // starts the running total over.
    let reply = hit(&mut conn, T0 + 1_000_000, log_limit(20, 1, 12)).await;
    assert_eq!(reply[..3], [1, 3, 8]);
    assert_eq!(
        members(&mut conn, "k").await,
        [("12,12".to_owned(), T0 + 1_000_000)]
    );
}

/// Running totals wrap at 2^53 (exact in a double); the units in the
/// window are a wrapped difference, and the wrapped ends stay distinct.
#[tokio::test]
async fn running_totals_wrap_at_two_to_the_53() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let top = (1u64 << 53) - 2;
    zadd(&mut conn, "k", T0, &format!("{top},3")).await;
    let reply = hit(&mut conn, T0 + 1, log_limit(10, 1, 4)).await;
    assert_eq!(reply[..3], [1, 3, 3]);
    assert_eq!(
        members(&mut conn, "k").await,
        [(format!("{top},3"), T0), ("2,4".to_owned(), T0 + 1)]
    );
    // 7 held: a request of 5 waits for the first entry, one of 8 for both.
    for (cost, reset) in [(5, 1_000_000 - 2), (8, 1_000_001 - 2)] {
        let reply = hit(&mut conn, T0 + 2, log_limit(10, 1, cost)).await;
        assert_eq!(reply[1..], [0, 3, reset], "cost {cost}");
    }
}

/// A key written in layout 0 (one "<µs>:<seq>" member per unit), alone or
/// among members of layout 1, is rewritten in layout 1: each µs keeps its
/// own units and time, the expired members go. Collapsing them into one
/// member counted by members read a mixed log short.
#[tokio::test]
async fn a_log_of_the_older_layout_keeps_each_units_time() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    zadd(
        &mut conn,
        "k",
        T0 - 2_000_000,
        &format!("{}:1", T0 - 2_000_000),
    )
    .await;
    for (seq, at) in [(1, T0), (2, T0), (1, T0 + 5)] {
        zadd(&mut conn, "k", at, &format!("{at}:{seq}")).await;
    }
    zadd(&mut conn, "k", T0 + 7, "9,4").await;
    let reply = hit(&mut conn, T0 + 10, log_limit(9, 1, 1)).await;
    assert_eq!(reply[..3], [1, 3, 1]);
    assert_eq!(
        members(&mut conn, "k").await,
        [
            ("2,2".to_owned(), T0),
            ("3,1".to_owned(), T0 + 5),
            ("7,4".to_owned(), T0 + 7),
            ("8,1".to_owned(), T0 + 10)
        ]
    );
    assert!(pttl(&mut conn, "k").await > 0);
    // 8 units held: a request of 4 needs 3 to leave, the 2 of T0 and the
    // one of T0 + 5, which each kept its own time.
    let reply = hit(&mut conn, T0 + 20, log_limit(9, 1, 4)).await;
    assert_eq!(reply[1..], [0, 1, 1_000_005 - 20]);
}

/// Costs at and above 2^53 (a descriptor's uint64 hits_addend) were refused
/// as bad parameters, an error the service answers with UNAVAILABLE; a cost
/// above the capacity is denied and, on a limit never used, writes nothing.
#[tokio::test]
async fn costs_up_to_two_to_the_64_are_denied_without_a_write() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let costs = [(1 << 53) - 1, 1 << 53, 1 << 63, u64::MAX];
    for limit in [log_limit(5, 1, 0), bucket_limit(5, 1, 0)] {
        for cost in costs {
            let before = writes(&mut conn).await;
            let reply = call(
                &mut conn,
                &["k"],
                Some(T0),
                &[ScriptLimit { cost, ..limit }],
            )
            .await
            .unwrap();
            assert_eq!(reply, vec![0, 0, 5, 1_000_000], "{cost}");
            assert_eq!(writes(&mut conn).await, before, "{cost}");
        }
    }
    assert_eq!(dbsize(&mut conn).await, 0);
}

/// The expiry grace (the header's grace_ms) is added to the TTL of every
/// written key.
#[tokio::test]
async fn the_expiry_grace_extends_every_ttl() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for limit in [log_limit(10, 2, 1), bucket_limit(10, 2, 1)] {
        let key = limit.algorithm;
        call_with_grace(&mut conn, &[key], Some(T0), 30_000, &[limit])
            .await
            .unwrap();
        let ttl = pttl(&mut conn, key).await;
        // The log's state lasts 2 s, the bucket's 0.2 s, each plus 30 s.
        assert!((30_100..=32_000).contains(&ttl), "{key}: pttl {ttl}");
    }
}

/// A request meeting a log whose entries all expired removed every one of
/// them in one call (64 such logs in one request made one slow script);
/// at most 32 go per call, the rest are skipped and the answer is exact.
#[tokio::test]
async fn expired_entries_are_removed_a_bounded_number_per_call() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let sha = support::redis::load_decide_script(&mut conn).await;
    let mut fill = redis::pipe();
    for idx in 0..300u64 {
        fill.cmd("EVALSHA")
            .arg(&sha)
            .arg(1)
            .arg("k")
            .arg(args(Some(T0 + idx), GRACE_MS, &[log_limit(1_000, 1, 1)]))
            .ignore();
    }
    let () = fill.query_async(&mut conn).await.unwrap();
    assert_eq!(query::<u64>(&mut conn, "ZCARD", "k").await, 300);
    let later = T0 + 2_000_000;
    let reply = hit(&mut conn, later, log_limit(1_000, 1, 1)).await;
    assert_eq!(reply[..3], [1, 3, 999]);
    assert_eq!(query::<u64>(&mut conn, "ZCARD", "k").await, 300 - 32 + 1);
    let reply = hit(&mut conn, later + 1, log_limit(1_000, 1, 1)).await;
    assert_eq!(reply[..3], [1, 3, 998]);
    assert_eq!(query::<u64>(&mut conn, "ZCARD", "k").await, 300 - 64 + 2);
}

fn limit_of(algorithm: Algorithm, limit: u64, cost: u64, mode: &'static str) -> ScriptLimit {
    let params = LimitParams::new(algorithm, limit, 60_000_000, None).unwrap();
    let mut args = ScriptLimit::of(&Check {
        params,
        cost,
        mode: Mode::Enforce,
    });
    args.mode = mode;
    args
}

/// Units 1 and 3 of layout 1 with one of layout 0 between them.
async fn mixed(conn: &mut MultiplexedConnection, key: &str) {
    zadd(conn, key, T0 - 30, "1,1").await;
    zadd(conn, key, T0 - 20, &format!("{}:1", T0 - 20)).await;
    zadd(conn, key, T0 - 10, "4,3").await;
}

/// A log both layouts wrote, with a member of layout 0 between two of
/// layout 1 (a version of layout 0 whose clock lagged): found before any
/// write and converted, so its unit counts. Before, it was either not
/// counted (admitting over the limit) or met by the search for a denial's
/// reset and refused, an error after an earlier limit had consumed.
#[tokio::test]
async fn a_layout_0_member_between_two_of_layout_1_counts_and_never_fails_the_request() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let fixed = limit_of(Algorithm::FixedWindow, 10, 2, "enforce");
    mixed(&mut conn, "a").await;
    let shadow = limit_of(Algorithm::SlidingWindowLog, 3, 2, "shadow");
    let reply = call(&mut conn, &["k1", "a"], Some(T0), &[fixed, shadow])
        .await
        .expect("decided, not an error");
    // Allowed (the log limit only shadows), the log had no room.
    assert_eq!(reply[0], 1);
    assert_eq!(reply[4], 0, "5 units held of 3: {reply:?}");
    let held: String = query(&mut conn, "GET", "k1").await;
    assert!(held.ends_with(":2"), "{held}");
    for (key, limit, cost) in [("b", 3, 2), ("c", 5, 1)] {
        mixed(&mut conn, key).await;
        let log = limit_of(Algorithm::SlidingWindowLog, limit, cost, "enforce");
        let reply = call(&mut conn, &[key], Some(T0), &[log])
            .await
            .expect("decided, not an error");
        assert_eq!(reply[..3], [0, 0, 0], "{key}: denied, 5 units held");
    }
}

/// A string state whose integers a double cannot hold exactly (2^53 or
/// more, or -2^53 or less), or with a negative field where only a token
/// bucket's level may be negative, is refused before any write, never read
/// rounded, with the key shown.
#[tokio::test]
async fn string_states_past_two_to_the_53_or_negative_out_of_place_are_refused() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let cases = [
        (Algorithm::SlidingWindowCounter, "99999999999999999999:0:1"),
        (Algorithm::FixedWindow, "9007199254740992:1"),
        (Algorithm::TokenBucket, "-99999999999999999999:0:1"),
        (Algorithm::Gcra, "-5:0:1"),
        (Algorithm::Gcra, &format!("-1:{T0}:0")),
        (Algorithm::SlidingWindowCounter, "-5:0:0"),
        (
            Algorithm::SlidingWindowCounter,
            &format!("-60000000:{T0}:0"),
        ),
        (Algorithm::FixedWindow, "-5:0"),
    ];
    for (algorithm, value) in cases {
        let _: () = redis::cmd("SET")
            .arg("state-key")
            .arg(value)
            .query_async(&mut conn)
            .await
            .unwrap();
        let limit = limit_of(algorithm, 10, 1, "enforce");
        let err = call(&mut conn, &["state-key"], Some(T0), &[limit])
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("stored layout refused at state-key: not "),
            "{algorithm:?} {value}: {err}"
        );
        let held: String = query(&mut conn, "GET", "state-key").await;
        assert_eq!(held, value, "{algorithm:?}");
    }
}

/// A token bucket's level may be negative: in debt (charged always), read
/// as such; a debt past what the limit now carries (one capacity charged
/// always, none otherwise: a reload may lower the limit) is read and
/// forgiven down to it, never refused.
#[tokio::test]
async fn a_token_bucket_in_debt_is_read_and_debt_past_one_capacity_forgiven() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let always = |limit| {
        let params = LimitParams::new(Algorithm::TokenBucket, limit, 60_000_000, None)
            .and_then(|it| it.with_charge(Charge::Always))
            .unwrap();
        let scale = params.rate().scale;
        (
            ScriptLimit::of(&Check {
                params,
                cost: 1,
                mode: Mode::Enforce,
            }),
            scale,
        )
    };
    let level = |held: &str| -> i64 { held.split(':').next().unwrap().parse().unwrap() };
    // 5 units of debt, then 1 more charged: 6.
    let (limit, scale) = always(10);
    let scale = scale as i64;
    let _: () = redis::cmd("SET")
        .arg("t")
        .arg(format!("{}:{T0}:{scale}", -5 * scale))
        .query_async(&mut conn)
        .await
        .unwrap();
    let reply = call(&mut conn, &["t"], Some(T0), &[limit]).await.unwrap();
    assert_eq!(reply[..2], [0, 0], "denied: {reply:?}");
    let held: String = query(&mut conn, "GET", "t").await;
    assert_eq!(level(&held), -6 * scale, "{held}");
    // 50 units of debt on a limit of 10: forgiven to 10.
    let _: () = redis::cmd("SET")
        .arg("t")
        .arg(format!("{}:{T0}:{scale}", -50 * scale))
        .query_async(&mut conn)
        .await
        .unwrap();
    let reply = call(&mut conn, &["t"], Some(T0), &[limit]).await.unwrap();
    assert_eq!(reply[..2], [0, 0], "denied: {reply:?}");
    let held: String = query(&mut conn, "GET", "t").await;
    assert_eq!(level(&held), -10 * scale, "{held}");
}

/// What a refused state holds is shown with bytes outside printable
/// ASCII escaped: the error text is logged.
#[tokio::test]
async fn a_refused_state_is_shown_printable() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let _: () = redis::cmd("SET")
        .arg("p")
        .arg(&b"1:\x1b[2J\n"[..])
        .query_async(&mut conn)
        .await
        .unwrap();
    let limit = limit_of(Algorithm::FixedWindow, 10, 1, "enforce");
    let err = call(&mut conn, &["p"], Some(T0), &[limit])
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(r"1:\x1b[2J\x0a"), "{err}");
    assert!(!err.contains('\x1b') && !err.contains('\n'), "{err}");
}

/// A layout-0 member hidden among costs above one (too few members to
/// tell) goes uncounted, but a denial's reset search meeting it answers
/// the newest entry's time rather than failing the request.
#[tokio::test]
async fn a_reset_search_meeting_a_hidden_layout_0_member_still_denies() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    zadd(&mut conn, "h", T0 - 40, "1,1").await;
    zadd(&mut conn, "h", T0 - 30, "3,2").await;
    zadd(&mut conn, "h", T0 - 20, &format!("{}:1", T0 - 20)).await;
    zadd(&mut conn, "h", T0 - 10, "8,5").await;
    let log = limit_of(Algorithm::SlidingWindowLog, 10, 4, "enforce");
    let reply = call(&mut conn, &["h"], Some(T0), &[log])
        .await
        .expect("denied, not an error");
    assert_eq!(reply, [0, 0, 2, 60_000_000 - 10]);
}
