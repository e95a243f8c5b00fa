//! `lua/refund.lua` against a real redis-server: what a request consumed
//! (its receipt from `lua/decide.lua`) comes back, and only that.
//!
//! Most tests run one trace on key `a` with the request `R` and its refund,
//! and the same trace without `R` on key `b` ("as if R never happened"),
//! then compare what both keys answer from then on.

use crate::support;
use crate::support::redis::RedisServer;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode, Outcome};
use throttlegate::backends::keys::{HashTag, KeyFormat};
use throttlegate::backends::redis::DECIDE_LUA;
use throttlegate::backends::redis::script::{
    Arg, HeaderArgs, REFUND_LUA, Receipt, RefundArgs, RefundHeader, ReplyIntegers, ScriptLimit,
    argv, decode_refund_reply, decode_reply_with_receipts, invocation, refund_argv,
    refund_invocation, refund_script,
};

/// 20 s into a minute window.
const T0: u64 = 1_700_000_000_000_000;
/// Every limit here: 10 a minute.
const LIMIT: u64 = 10;
const W: u64 = 60_000_000;
/// Keeps keys from expiring in real time while a trace moves its own clock.
const GRACE_MS: u64 = 3_600_000;

fn check(algorithm: Algorithm, cost: u64) -> Check {
    check_in(algorithm, cost, Mode::Enforce)
}

fn check_in(algorithm: Algorithm, cost: u64, mode: Mode) -> Check {
    let params = LimitParams::new(algorithm, LIMIT, W, None).expect("valid params");
    Check { params, cost, mode }
}

/// One request on `key` at `now`, asking for receipts: its outcome and
/// receipt.
async fn decide(
    conn: &mut MultiplexedConnection,
    key: &str,
    now: u64,
    check: Check,
) -> (bool, Outcome, Receipt) {
    let header = HeaderArgs {
        now_us: Some(now),
        grace_ms: GRACE_MS,
        receipts: true,
    };
    let script = redis::Script::new(DECIDE_LUA);
    let ReplyIntegers(reply) = script
        .key(key)
        .arg(argv(&header, &[ScriptLimit::of(&check)]))
        .invoke_async(conn)
        .await
        .expect("decide");
    let (verdict, receipts) = decode_reply_with_receipts(&reply, 1).expect("a reply with receipts");
    (verdict.allowed, verdict.outcomes[0], receipts[0])
}

/// An allowed request's receipt.
async fn take(conn: &mut MultiplexedConnection, key: &str, now: u64, check: Check) -> Receipt {
    let (allowed, _, receipt) = decide(conn, key, now, check).await;
    assert!(allowed, "{key} at {now}: {check:?} allowed");
    assert!(
        !receipt.is_empty(),
        "an enforcing limit that consumed has a receipt"
    );
    receipt
}

/// Refunds `receipt` on `key` at `now`: the units given back.
async fn refund(
    conn: &mut MultiplexedConnection,
    key: &str,
    now: u64,
    check: Check,
    receipt: Receipt,
) -> u64 {
    let header = RefundHeader { now_us: Some(now) };
    let reply: Vec<i64> = redis::Script::new(REFUND_LUA)
        .key(key)
        .arg(refund_argv(&header, &[RefundArgs::of(&check, receipt)]))
        .invoke_async(conn)
        .await
        .expect("refund");
    decode_refund_reply(&reply, 1).expect("a refund reply")[0]
}

/// What a cost-0 check on `key` at `now` reports: (remaining, reset_us).
async fn probe(
    conn: &mut MultiplexedConnection,
    key: &str,
    now: u64,
    algorithm: Algorithm,
) -> (u64, u64) {
    let (_, outcome, receipt) = decide(conn, key, now, check(algorithm, 0)).await;
    assert!(receipt.is_empty(), "a cost-0 check takes nothing");
    (outcome.remaining, outcome.reset_us)
}

/// Keys `a` and `b` answer alike from `now` on (checked at now, a third of
/// a window later and a window later).
async fn assert_alike(
    conn: &mut MultiplexedConnection,
    a: &str,
    b: &str,
    now: u64,
    algorithm: Algorithm,
) {
    assert_late_by(conn, a, b, now, algorithm, 0).await;
}

/// [`assert_alike`], except that `a` is full again `lag_us` after `b`
/// (both full: both 0).
async fn assert_late_by(
    conn: &mut MultiplexedConnection,
    a: &str,
    b: &str,
    now: u64,
    algorithm: Algorithm,
    lag_us: u64,
) {
    for at in [now, now + W / 3, now + W] {
        let (left, left_reset) = probe(conn, a, at, algorithm).await;
        let (right, right_reset) = probe(conn, b, at, algorithm).await;
        let late = if right_reset == 0 && left_reset == 0 {
            0
        } else {
            lag_us
        };
        assert_eq!(
            (left, left_reset),
            (right, right_reset + late),
            "{algorithm} at {at}: {a} (refunded) and {b} (never asked)"
        );
    }
}

/// What a refund `lag_us` of refill after its decision gives back of
/// `cost`: the cost, scaled for buckets and GCRA, less the refill.
fn back_after(algorithm: Algorithm, cost: u64, lag_us: u64) -> u64 {
    let rate = LimitParams::new(algorithm, LIMIT, W, None).unwrap().rate();
    match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => cost * rate.scale - lag_us * rate.per_us,
        _ => cost,
    }
}

async fn exists(conn: &mut MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

async fn dump(conn: &mut MultiplexedConnection, key: &str) -> Option<Vec<u8>> {
    redis::cmd("DUMP").arg(key).query_async(conn).await.unwrap()
}

/// Exact when refunded in the decision's µs, and (GCRA aside) whenever
/// nobody touched the key in between; GCRA, which keeps no time of its last
/// update, gives back the cost less the refill since the decision.
#[tokio::test]
async fn a_refund_with_nobody_in_between_restores_the_limit() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        for at in [T0 + 1_000, T0 + 5_000_000] {
            let (a, b) = (format!("{algorithm}:{at}:a"), format!("{algorithm}:{at}:b"));
            take(&mut conn, &a, T0, check(algorithm, 2)).await;
            take(&mut conn, &b, T0, check(algorithm, 2)).await;
            let (before, _) = probe(&mut conn, &b, T0 + 1_000, algorithm).await;
            let (_, outcome, receipt) =
                decide(&mut conn, &a, T0 + 1_000, check(algorithm, 3)).await;
            assert_eq!(outcome.remaining, before - 3, "{algorithm}: R took 3");
            let lag = if algorithm == Algorithm::Gcra {
                at - (T0 + 1_000)
            } else {
                0
            };
            let given = refund(&mut conn, &a, at, check(algorithm, 3), receipt).await;
            assert_eq!(given, back_after(algorithm, 3, lag), "{algorithm} at {at}");
            if lag == 0 {
                let (after, _) = probe(&mut conn, &a, T0 + 1_000, algorithm).await;
                assert_eq!(after, before, "{algorithm}: refunded at {at}");
            }
            assert_late_by(&mut conn, &a, &b, at, algorithm, lag).await;
        }
    }
}

/// Other requests before and after R keep what they took; a token bucket
/// and GCRA give back R's tokens less the refill since its decision (to
/// the bucket's last update, to now for GCRA).
#[tokio::test]
async fn only_this_requests_share_comes_back_when_others_came_in_between() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let (a, b) = (format!("{algorithm}:a"), format!("{algorithm}:b"));
        take(&mut conn, &a, T0, check(algorithm, 2)).await;
        take(&mut conn, &b, T0, check(algorithm, 2)).await;
        let receipt = take(&mut conn, &a, T0 + 1_000, check(algorithm, 3)).await;
        for (at, cost) in [(T0 + 2_000, 2), (T0 + 3_000, 1)] {
            take(&mut conn, &a, at, check(algorithm, cost)).await;
            take(&mut conn, &b, at, check(algorithm, cost)).await;
        }
        let lag = match algorithm {
            Algorithm::TokenBucket => 2_000,
            Algorithm::Gcra => 3_000,
            _ => 0,
        };
        let given = refund(&mut conn, &a, T0 + 4_000, check(algorithm, 3), receipt).await;
        assert_eq!(given, back_after(algorithm, 3, lag), "{algorithm}");
        assert_late_by(&mut conn, &a, &b, T0 + 4_000, algorithm, lag).await;
    }
}

/// Two windows later (the sliding-window counter's count has stopped
/// weighing in too), a request has nothing left to give back.
#[tokio::test]
async fn a_refund_after_the_window_rolled_gives_back_nothing() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let (a, b) = (format!("{algorithm}:a"), format!("{algorithm}:b"));
        let receipt = take(&mut conn, &a, T0, check(algorithm, 3)).await;
        take(&mut conn, &a, T0 + 2 * W, check(algorithm, 1)).await;
        take(&mut conn, &b, T0 + 2 * W, check(algorithm, 1)).await;
        let given = refund(&mut conn, &a, T0 + 2 * W, check(algorithm, 3), receipt).await;
        assert_eq!(given, 0, "{algorithm}");
        assert_alike(&mut conn, &a, &b, T0 + 2 * W, algorithm).await;
    }
}

/// A fixed window that nobody has moved on since still holds the count, but
/// it no longer matters: nothing comes back. The log's entry has left the
/// window likewise.
#[tokio::test]
async fn a_refund_once_its_window_is_over_gives_back_nothing_even_untouched() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowLog] {
        let key = format!("{algorithm}");
        let receipt = take(&mut conn, &key, T0, check(algorithm, 3)).await;
        let stored = dump(&mut conn, &key).await;
        let given = refund(&mut conn, &key, T0 + W, check(algorithm, 3), receipt).await;
        assert_eq!(given, 0, "{algorithm}");
        assert_eq!(
            dump(&mut conn, &key).await,
            stored,
            "{algorithm}: untouched"
        );
    }
}

/// The sliding-window counter's count moves to `previous` when the next
/// window begins and still weighs in there: that is where it comes back
/// from.
#[tokio::test]
async fn a_sliding_window_counter_refund_reaches_into_the_previous_window() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let algorithm = Algorithm::SlidingWindowCounter;
    take(&mut conn, "a", T0, check(algorithm, 1)).await;
    take(&mut conn, "b", T0, check(algorithm, 1)).await;
    let receipt = take(&mut conn, "a", T0 + 1_000, check(algorithm, 4)).await;
    let next = T0 + W - 20_000_000 + 1_000_000;
    take(&mut conn, "a", next, check(algorithm, 2)).await;
    take(&mut conn, "b", next, check(algorithm, 2)).await;
    assert!(
        probe(&mut conn, "a", next, algorithm).await.0
            < probe(&mut conn, "b", next, algorithm).await.0,
        "R's units still weigh in the next window"
    );
    let given = refund(&mut conn, "a", next + 1, check(algorithm, 4), receipt).await;
    assert_eq!(given, 4);
    assert_alike(&mut conn, "a", "b", next + 1, algorithm).await;
}

/// A bucket that refilled while R's tokens were out would have wasted the
/// refill had R never come: R gets back only what the bucket could still
/// hold, never filling it past what it would be without R.
#[tokio::test]
async fn a_refund_never_fills_a_bucket_past_what_it_would_hold() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let token = W / LIMIT;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        // After one token's refill, R (3) has 2 to give back; after half a
        // window the bucket would have been full anyway: nothing.
        for (wait, back) in [(token, 2), (W / 2, 0)] {
            let (a, b) = (
                format!("{algorithm}:{wait}:a"),
                format!("{algorithm}:{wait}:b"),
            );
            let receipt = take(&mut conn, &a, T0, check(algorithm, 3)).await;
            take(&mut conn, &a, T0 + wait, check(algorithm, 1)).await;
            take(&mut conn, &b, T0 + wait, check(algorithm, 1)).await;
            let given = refund(&mut conn, &a, T0 + wait, check(algorithm, 3), receipt).await;
            assert_eq!(
                given,
                back_after(algorithm, back, 0),
                "{algorithm} after {wait} µs"
            );
            assert_eq!(
                probe(&mut conn, &a, T0 + wait, algorithm).await.0,
                LIMIT - 1
            );
            assert_alike(&mut conn, &a, &b, T0 + wait, algorithm).await;
        }
        // Nobody came, the bucket refilled in the meantime: full, no more.
        let key = format!("{algorithm}:alone");
        let receipt = take(&mut conn, &key, T0, check(algorithm, 3)).await;
        refund(&mut conn, &key, T0 + W, check(algorithm, 3), receipt).await;
        assert_eq!(probe(&mut conn, &key, T0 + W, algorithm).await, (LIMIT, 0));
        assert!(
            !exists(&mut conn, &key).await,
            "{algorithm}: a full bucket is no key"
        );
    }
}

/// A second refund of a request alone on its counter finds nothing of it:
/// every algorithm gives back once.
#[tokio::test]
async fn a_replayed_refund_of_a_lone_request_gives_back_nothing_more() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let key = format!("{algorithm}");
        let receipt = take(&mut conn, &key, T0, check(algorithm, 3)).await;
        let again = [back_after(algorithm, 3, 0), 0];
        for (round, back) in again.into_iter().enumerate() {
            let given = refund(&mut conn, &key, T0, check(algorithm, 3), receipt).await;
            assert_eq!(given, back, "{algorithm}, refund {round}");
        }
        assert!(
            !exists(&mut conn, &key).await,
            "{algorithm}: back to fresh, no key"
        );
    }
}

/// Removing a log member is idempotent whatever else the log holds (the
/// counters are not: the refund must be sent at most once).
#[tokio::test]
async fn a_replayed_log_refund_gives_back_once_among_other_requests() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let algorithm = Algorithm::SlidingWindowLog;
    take(&mut conn, "a", T0, check(algorithm, 2)).await;
    take(&mut conn, "b", T0, check(algorithm, 2)).await;
    let receipt = take(&mut conn, "a", T0 + 1, check(algorithm, 3)).await;
    take(&mut conn, "a", T0 + 2, check(algorithm, 1)).await;
    take(&mut conn, "b", T0 + 2, check(algorithm, 1)).await;
    assert_eq!(
        refund(&mut conn, "a", T0 + 3, check(algorithm, 3), receipt).await,
        3
    );
    assert_eq!(
        refund(&mut conn, "a", T0 + 4, check(algorithm, 3), receipt).await,
        0
    );
    assert_eq!(
        dump(&mut conn, "a").await,
        dump(&mut conn, "b").await,
        "the same members"
    );
    assert_alike(&mut conn, "a", "b", T0 + 4, algorithm).await;
}

/// Requests in the same µs share one log member: R's units come out of it,
/// the others' stay.
#[tokio::test]
async fn a_log_member_shared_within_a_microsecond_gives_back_only_this_requests_units() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let algorithm = Algorithm::SlidingWindowLog;
    take(&mut conn, "a", T0, check(algorithm, 2)).await;
    let receipt = take(&mut conn, "a", T0, check(algorithm, 3)).await;
    take(&mut conn, "a", T0, check(algorithm, 1)).await;
    take(&mut conn, "a", T0 + 5, check(algorithm, 1)).await;
    for (at, cost) in [(T0, 2), (T0, 1), (T0 + 5, 1)] {
        take(&mut conn, "b", at, check(algorithm, cost)).await;
    }
    assert_eq!(
        refund(&mut conn, "a", T0 + 6, check(algorithm, 3), receipt).await,
        3
    );
    assert_eq!(
        dump(&mut conn, "a").await,
        dump(&mut conn, "b").await,
        "the same members"
    );
    assert_alike(&mut conn, "a", "b", T0 + 6, algorithm).await;
}

#[tokio::test]
async fn every_limit_that_consumed_if_allowed_carries_a_receipt() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let limits = [
            check_in(algorithm, 2, Mode::Enforce),
            check_in(algorithm, 2, Mode::Shadow),
            check_in(algorithm, 2, Mode::Quota),
            check_in(algorithm, 0, Mode::Enforce),
        ];
        let keys: Vec<String> = (0..limits.len())
            .map(|it| format!("{algorithm}:{it}"))
            .collect();
        let reply = call_decide(&mut conn, &keys, T0, &limits, true).await;
        let (verdict, receipts) = decode_reply_with_receipts(&reply, limits.len()).unwrap();
        assert!(verdict.allowed);
        let empty: Vec<bool> = receipts.iter().map(Receipt::is_empty).collect();
        // Shadow and quota limits too: a request denied by another slot
        // gives back what they took.
        assert_eq!(empty, [false, false, false, true], "{algorithm}");
        // Denied: nothing consumed, nothing to give back.
        let over = [check(algorithm, 2), check(algorithm, LIMIT + 1)];
        let reply = call_decide(&mut conn, &keys[..2], T0, &over, true).await;
        let (verdict, receipts) = decode_reply_with_receipts(&reply, 2).unwrap();
        assert!(!verdict.allowed);
        assert!(receipts.iter().all(Receipt::is_empty), "{algorithm}");
        // Without the flag the reply is the decision alone.
        let reply = call_decide(&mut conn, &keys[..1], T0, &limits[..1], false).await;
        assert_eq!(reply.len(), 4, "{algorithm}");
    }
}

async fn call_decide(
    conn: &mut MultiplexedConnection,
    keys: &[String],
    now: u64,
    checks: &[Check],
    receipts: bool,
) -> Vec<i64> {
    let header = HeaderArgs {
        now_us: Some(now),
        grace_ms: GRACE_MS,
        receipts,
    };
    let limits: Vec<_> = checks.iter().map(ScriptLimit::of).collect();
    let script = redis::Script::new(DECIDE_LUA);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(key);
    }
    invocation.arg(argv(&header, &limits));
    let ReplyIntegers(reply) = invocation.invoke_async(conn).await.expect("decide");
    reply
}

#[tokio::test]
async fn a_refund_never_creates_a_key_and_never_extends_its_expiry() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let key = format!("{algorithm}");
        take(&mut conn, &key, T0, check(algorithm, 2)).await;
        let receipt = take(&mut conn, &key, T0 + 1, check(algorithm, 3)).await;
        let before: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        refund(&mut conn, &key, T0 + 2, check(algorithm, 3), receipt).await;
        let after: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(
            0 < after && after <= before,
            "{algorithm}: pttl {before} then {after}"
        );
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let given = refund(&mut conn, &key, T0 + 3, check(algorithm, 3), receipt).await;
        assert_eq!(given, 0, "{algorithm}");
        assert!(!exists(&mut conn, &key).await, "{algorithm}: no key made");
    }
}

#[tokio::test]
async fn bad_receipts_are_refused_before_any_write() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let algorithm = Algorithm::FixedWindow;
    let receipt = take(&mut conn, "k", T0, check(algorithm, 3)).await;
    let stored = dump(&mut conn, "k").await;
    let mut args = refund_argv(
        &RefundHeader { now_us: Some(T0) },
        &[RefundArgs::of(&check(algorithm, 3), receipt)],
    );
    let script = redis::Script::new(REFUND_LUA);
    let short: redis::RedisResult<Vec<i64>> = script
        .key("k")
        .arg(&args[..args.len() - 1])
        .invoke_async(&mut conn)
        .await;
    assert!(short.unwrap_err().to_string().contains("arguments"));
    args[7] = Arg::Text("-3");
    let negative: redis::RedisResult<Vec<i64>> =
        script.key("k").arg(&args).invoke_async(&mut conn).await;
    assert!(negative.unwrap_err().to_string().contains("bad receipt"));
    // The decision's flag is 0 or 1, checked before anything is read.
    let header = HeaderArgs {
        now_us: Some(T0 + 1),
        grace_ms: GRACE_MS,
        receipts: true,
    };
    let mut args = argv(&header, &[ScriptLimit::of(&check(algorithm, 1))]);
    args[2] = Arg::Text("2");
    let flag: redis::RedisResult<ReplyIntegers> = redis::Script::new(DECIDE_LUA)
        .key("k")
        .arg(&args)
        .invoke_async(&mut conn)
        .await;
    assert!(flag.unwrap_err().to_string().contains("bad receipts flag"));
    assert_eq!(dump(&mut conn, "k").await, stored);
}

/// The API the Cluster path uses: a group decided through `invocation` with
/// receipts, refunded through `refund_invocation`, is back to fresh: no
/// key left, whatever the algorithms.
#[tokio::test]
async fn a_group_decided_and_refunded_through_the_api_is_back_to_fresh() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let checks: Vec<_> = Algorithm::ALL
        .into_iter()
        .map(|algorithm| support::keys::check_on(algorithm, 60, &[("user", "u1")], LIMIT, 4))
        .collect();
    let header = HeaderArgs {
        now_us: None,
        grace_ms: 0,
        receipts: true,
    };
    let decide_script = redis::Script::new(DECIDE_LUA);
    let ReplyIntegers(reply) = invocation(
        &decide_script,
        &KeyFormat::new("tg", HashTag::None),
        &header,
        &checks,
    )
    .unwrap()
    .invoke_async(&mut conn)
    .await
    .unwrap();
    let (verdict, receipts) = decode_reply_with_receipts(&reply, checks.len()).unwrap();
    assert!(verdict.allowed);
    assert_eq!(server.keys("tg:*").await.len(), checks.len());
    let script = refund_script();
    let refund = refund_invocation(
        &script,
        "tg",
        &RefundHeader { now_us: None },
        &checks,
        &receipts,
    )
    .unwrap()
    .expect("something to give back");
    let reply: Vec<i64> = refund.invoke_async(&mut conn).await.unwrap();
    let given = decode_refund_reply(&reply, checks.len()).unwrap();
    assert!(given.iter().all(|it| *it > 0), "{given:?}");
    assert_eq!(server.keys("tg:*").await, Vec::<String>::new());
    let nothing = [Receipt::NONE; 5];
    assert!(
        refund_invocation(
            &script,
            "tg",
            &RefundHeader { now_us: None },
            &checks,
            &nothing
        )
        .unwrap()
        .is_none()
    );
}

/// The oldest member of a full log of 10,000 (the default cap) refunded:
/// every later member's running total moves down by its cost, and the log
/// answers as one that never held it. Prints the script's own time.
#[tokio::test]
async fn refunding_the_oldest_member_of_a_full_log_keeps_the_window_exact() {
    const N: u64 = 10_000;
    let server = RedisServer::start();
    let mut conn = server.patient_connection(None).await;
    let params = LimitParams::new(Algorithm::SlidingWindowLog, N, W, None).unwrap();
    let one = Check {
        params,
        cost: 1,
        mode: Mode::Enforce,
    };
    let mut fill = redis::pipe();
    for idx in 1..=N {
        fill.cmd("ZADD")
            .arg("a")
            .arg(T0 + idx)
            .arg(format!("{idx},1"))
            .ignore();
        if idx > 1 {
            fill.cmd("ZADD")
                .arg("b")
                .arg(T0 + idx)
                .arg(format!("{},1", idx - 1))
                .ignore();
        }
    }
    fill.cmd("PEXPIRE").arg("a").arg(GRACE_MS).ignore();
    fill.cmd("PEXPIRE").arg("b").arg(GRACE_MS).ignore();
    let () = fill.query_async(&mut conn).await.unwrap();
    // The receipt the decision gave the first request.
    let (_, _, receipt) = decide(&mut conn, "c", T0 + 1, one).await;
    support::redis::reset_stats(&mut conn).await;
    assert_eq!(refund(&mut conn, "a", T0 + N, one, receipt).await, 1);
    let stats = support::redis::command_stats(&mut conn).await;
    let usec = support::redis::command_stat(&stats, "evalsha", "usec").unwrap_or(f64::NAN);
    eprintln!("refund of the oldest of {N} members: {usec} µs in Redis");
    assert_eq!(dump(&mut conn, "a").await, dump(&mut conn, "b").await);
    let (allowed, outcome, _) = decide(&mut conn, "a", T0 + N, one).await;
    assert!(allowed, "one unit of room again");
    assert_eq!(outcome.remaining, 0);
}

/// One step of a trace: µs to wait, then a request of `cost` or (cost 0)
/// the refund of an outstanding request picked by `pick`.
type Step = (u64, u64, usize);

fn arb_trace() -> impl Strategy<Value = (usize, Vec<Step>)> {
    let step = (
        prop_oneof![Just(0u64), 1u64..2_000_000, 1u64..(W / 2)],
        0u64..5,
        0usize..16,
    );
    (0..Algorithm::ALL.len(), prop::collection::vec(step, 1..40))
}

/// Interleaved requests and refunds on `a`; then the requests allowed and
/// never refunded, replayed alone on `b`. Each must pass there (nothing was
/// ever allowed over the limit, even with refunds pending), and `a` must
/// answer as `b` does: exactly for the windows and the log, never with more
/// room for the bucket and GCRA (whose refunds may give back less when
/// other requests kept the bucket from filling).
async fn run_trace(
    conn: &mut MultiplexedConnection,
    case: u64,
    algorithm: Algorithm,
    trace: &[Step],
) -> Result<(), TestCaseError> {
    let (a, b) = (format!("{case}:a"), format!("{case}:b"));
    let mut now = T0;
    let mut kept: Vec<(u64, u64)> = Vec::new();
    let mut outstanding: Vec<(usize, u64, Receipt)> = Vec::new();
    for &(wait, cost, pick) in trace {
        now += wait;
        if cost == 0 {
            if outstanding.is_empty() {
                continue;
            }
            let (idx, cost, receipt) = outstanding.remove(pick % outstanding.len());
            refund(conn, &a, now, check(algorithm, cost), receipt).await;
            kept[idx].1 = 0;
            continue;
        }
        let (allowed, outcome, receipt) = decide(conn, &a, now, check(algorithm, cost)).await;
        prop_assert!(outcome.remaining <= LIMIT);
        if allowed {
            outstanding.push((kept.len(), cost, receipt));
            kept.push((now, cost));
        }
    }
    for &(at, cost) in kept.iter().filter(|it| it.1 > 0) {
        let (allowed, _, _) = decide(conn, &b, at, check(algorithm, cost)).await;
        prop_assert!(
            allowed,
            "{algorithm}: a request kept at {at} passes without the refunded ones"
        );
    }
    for at in [now, now + W / 3, now + W] {
        let left = probe(conn, &a, at, algorithm).await;
        let right = probe(conn, &b, at, algorithm).await;
        if matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra) {
            prop_assert!(
                left.0 <= right.0,
                "{algorithm} at {at}: {left:?} vs {right:?}"
            );
        } else {
            prop_assert_eq!(left, right, "{} at {}", algorithm, at);
        }
    }
    Ok(())
}

#[test]
fn interleaved_refunds_never_admit_over_the_limit_and_end_as_if_never_asked() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let conn = runtime.block_on(server.connection());
    let mut runner = TestRunner::new(Config {
        cases: 96,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let res = runner.run(&arb_trace(), |(algorithm, trace)| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(run_trace(
            &mut conn.clone(),
            case,
            Algorithm::ALL[algorithm],
            &trace,
        ))
    });
    if let Err(err) = res {
        panic!("{err}");
    }
}

/// A refund meeting a state in no layout it reads (a log member after the
/// request's of neither layout, a string that is not the algorithm's
/// integers) is refused before it writes anything, on any key: every key
/// is read before the first refund is written, so a valid receipt of an
/// earlier limit is not refunded either.
#[tokio::test]
async fn a_refund_meeting_a_state_of_no_known_layout_changes_nothing() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let key = format!("{algorithm}:odd");
        let receipt = take(&mut conn, &key, T0, check(algorithm, 2)).await;
        let () = if algorithm == Algorithm::SlidingWindowLog {
            take(&mut conn, &key, T0 + 1, check(algorithm, 1)).await;
            redis::cmd("ZADD")
                .arg(&key)
                .arg(T0 + 2)
                .arg("7;7")
                .query_async(&mut conn)
                .await
        } else {
            redis::cmd("SET")
                .arg(&key)
                .arg("1:2:3:4")
                .arg("KEEPTTL")
                .query_async(&mut conn)
                .await
        }
        .unwrap();
        // A valid receipt on another key before it: never refunded.
        let fine = format!("{algorithm}:fine");
        let fine_receipt = take(&mut conn, &fine, T0, check(algorithm, 2)).await;
        let fine_before = dump(&mut conn, &fine).await;
        let before = dump(&mut conn, &key).await;
        let err = redis::Script::new(REFUND_LUA)
            .key(&fine)
            .key(&key)
            .arg(refund_argv(
                &RefundHeader {
                    now_us: Some(T0 + 3),
                },
                &[
                    RefundArgs::of(&check(algorithm, 2), fine_receipt),
                    RefundArgs::of(&check(algorithm, 2), receipt),
                ],
            ))
            .invoke_async::<Vec<i64>>(&mut conn)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("stored layout refused"),
            "{algorithm}: {err}"
        );
        assert_eq!(dump(&mut conn, &key).await, before, "{algorithm}");
        assert_eq!(
            dump(&mut conn, &fine).await,
            fine_before,
            "{algorithm}: the first limit was refunded"
        );
    }
}

/// A limit charged always keeps its charge whatever the verdict, so a
/// request split over hash slots never has it refunded: its receipt is
/// empty even when it consumed (allowed), and when it went into debt.
#[tokio::test]
async fn a_limit_charged_always_gets_no_receipt() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    for algorithm in Algorithm::ALL {
        let params = LimitParams::new(algorithm, LIMIT, W, None)
            .and_then(|it| it.with_charge(throttlegate::algorithms::Charge::Always))
            .expect("valid params");
        let key = format!("always:{algorithm}");
        let charged = |cost| Check {
            params,
            cost,
            mode: Mode::Enforce,
        };
        let (allowed, outcome, receipt) = decide(&mut conn, &key, T0, charged(4)).await;
        assert!(allowed && outcome.consumed, "{algorithm}");
        assert!(receipt.is_empty(), "{algorithm}: {receipt:?}");
        let (allowed, outcome, receipt) = decide(&mut conn, &key, T0, charged(9)).await;
        assert!(
            !allowed && outcome.overdraft == 3,
            "{algorithm}: {outcome:?}"
        );
        assert!(receipt.is_empty(), "{algorithm}: {receipt:?}");
        // The same limit charged only when allowed has one.
        let other = format!("if_allowed:{algorithm}");
        take(&mut conn, &other, T0, check(algorithm, 4)).await;
    }
}
