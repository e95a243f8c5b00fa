//! The decision as a Redis function library: FCALL on Redis 7, the load
//! after a flush, EVALSHA where the server has no functions, and the
//! library and the script giving the same answers.

mod support;

use redis::aio::MultiplexedConnection;
use support::keys::check_on;
use support::redis::{
    RedisServer, backend, command_stat, command_stats, library_loaded, reset_stats,
};
use throttlegate::algorithms::Algorithm::{self, FixedWindow, SlidingWindowLog, TokenBucket};
use throttlegate::algorithms::{Check, LimitParams, Mode};
use throttlegate::backends::redis::script::{
    self, BATCH_FIELDS, HeaderArgs, LimitArgs, REQUEST_FIELDS, argv,
};
use throttlegate::backends::redis::{ClockSource, DECIDE_LUA};
use throttlegate::backends::{Backend, KeyedCheck};

async fn allowed(backend: &dyn Backend, checks: &[KeyedCheck]) -> bool {
    backend.decide(checks).await.expect("decide").allowed
}

async fn calls(conn: &mut MultiplexedConnection, command: &str) -> f64 {
    let stats = command_stats(conn).await;
    command_stat(&stats, command, "calls").unwrap_or(0.0)
}

#[tokio::test]
async fn decisions_are_fcalls_of_the_library_on_redis_7() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let mut conn = server.connection().await;
    reset_stats(&mut conn).await;
    let checks = [check_on(FixedWindow, 60, &[("u", "a")], 3, 1)];
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(allowed(&backend, &checks).await);
    }
    assert_eq!(answers, [true, true, true, false, false]);
    assert_eq!(calls(&mut conn, "fcall").await, 5.0);
    assert_eq!(calls(&mut conn, "evalsha").await, 0.0);
    assert_eq!(calls(&mut conn, "eval").await, 0.0);
    let library = &script::library().name;
    assert!(library_loaded(&server, library).await);
    assert!(backend.function_name().starts_with("throttlegate_decide_"));
}

#[tokio::test]
async fn after_function_flush_the_library_is_loaded_again_and_the_request_counted_once() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let checks = [check_on(SlidingWindowLog, 60, &[("u", "a")], 3, 1)];
    assert!(allowed(&backend, &checks).await);
    let mut conn = server.connection().await;
    support::redis::function_flush(&mut conn).await;
    assert!(!library_loaded(&server, &script::library().name).await);
    reset_stats(&mut conn).await;
    let verdict = backend.decide(&checks).await.expect("loaded and decided");
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes[0].remaining, 1, "counted once");
    // The FCALL that met no function, the load, the FCALL that decided.
    assert_eq!(calls(&mut conn, "fcall").await, 2.0);
    assert_eq!(calls(&mut conn, "function|load").await, 1.0);
    assert!(library_loaded(&server, &script::library().name).await);
}

#[tokio::test]
async fn a_server_without_functions_is_decided_with_evalsha() {
    let server = RedisServer::start_with(&[
        "--rename-command",
        "FUNCTION",
        "",
        "--rename-command",
        "FCALL",
        "",
    ]);
    let backend = backend(&server, ClockSource::Redis).await;
    let mut conn = server.connection().await;
    reset_stats(&mut conn).await;
    let checks = [
        check_on(TokenBucket, 60, &[("u", "a")], 2, 1),
        check_on(FixedWindow, 60, &[("u", "a")], 5, 1),
    ];
    assert!(allowed(&backend, &checks).await);
    assert!(allowed(&backend, &checks).await);
    let denied = backend.decide(&checks).await.unwrap();
    assert!(!denied.allowed);
    // Stacked: the denied request took nothing from the fixed window.
    assert_eq!(denied.outcomes[1].remaining, 3);
    assert_eq!(calls(&mut conn, "fcall").await, 0.0);
    // 3 decisions, plus the first EVALSHA that met NOSCRIPT.
    assert_eq!(calls(&mut conn, "evalsha").await, 4.0);

    // SCRIPT FLUSH is followed by SCRIPT LOAD, counted once.
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let only_window = [check_on(FixedWindow, 60, &[("u", "a")], 5, 1)];
    let verdict = backend.decide(&only_window).await.unwrap();
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes[0].remaining, 2);
}

/// The same calls through FCALL and through EVAL of the script, on two
/// keys, give the same replies: the library runs the script's code.
#[tokio::test]
async fn the_library_and_the_script_answer_alike() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let _ = backend(&server, ClockSource::Redis).await;
    let library = script::library();
    support::redis::load_library(&mut conn).await;
    let t0 = 1_700_000_000_000_000_u64;
    for algorithm in Algorithm::ALL {
        for step in 0..12_u64 {
            let now = t0 + step * 7_000_000;
            let limit = limit_of(algorithm, 1 + step % 3);
            let args = argv(&header(now), &[limit]);
            let by_function: Vec<i64> = redis::cmd("FCALL")
                .arg(&library.decide)
                .arg(1)
                .arg(format!("f:{algorithm}"))
                .arg(&args)
                .query_async(&mut conn)
                .await
                .unwrap();
            let by_script: Vec<i64> = redis::cmd("EVAL")
                .arg(DECIDE_LUA)
                .arg(1)
                .arg(format!("s:{algorithm}"))
                .arg(&args)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(by_function, by_script, "{algorithm} step {step}");
        }
    }
}

/// The library keeps the limits it parsed from call to call (by their
/// fields joined with ':', up to a bound): past that bound, with the same
/// limit on several keys of one request, and for look-alike fields that
/// hold the separator, it answers as the script, which parses every call
/// afresh.
#[tokio::test]
async fn remembered_limits_answer_as_the_script_does() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let _ = backend(&server, ClockSource::Redis).await;
    let library = script::library();
    support::redis::load_library(&mut conn).await;
    let t0 = 1_700_000_000_000_000_u64;
    // 300 distinct limits (more than the library keeps), twice over, each
    // request twice the same limit on two keys, then alone on a third.
    for round in 0..2_u64 {
        for cost in 0..300_u64 {
            let now = t0 + round * 1_000 + cost;
            let limit = fixed(2_000, cost);
            let pair = argv(&header(now), &[limit, limit]);
            let one = argv(&header(now), &[limit]);
            let key = cost % 7;
            for (suffixes, args) in [(&["a", "b"][..], &pair), (&["c"][..], &one)] {
                let keys = |side: &str| -> Vec<String> {
                    suffixes
                        .iter()
                        .map(|it| format!("{side}:{key}:{it}"))
                        .collect()
                };
                let by_function: Vec<i64> = redis::cmd("FCALL")
                    .arg(&library.decide)
                    .arg(suffixes.len())
                    .arg(keys("f"))
                    .arg(args)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let by_script: Vec<i64> = redis::cmd("EVAL")
                    .arg(DECIDE_LUA)
                    .arg(suffixes.len())
                    .arg(keys("s"))
                    .arg(args)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                assert_eq!(by_function, by_script, "round {round} cost {cost}");
            }
        }
    }
    // A limit the library has seen, its fields shifted across the ':'
    // that joins them: refused, and nothing written.
    let seen = [
        "fixed_window",
        "2000",
        "60000000",
        "2000",
        "1",
        "1",
        "1",
        "enforce",
    ];
    let shifted = [
        "fixed_window:2000",
        "60000000",
        "2000",
        "1",
        "1",
        "1",
        "enforce",
        "",
    ];
    for fields in [&seen, &shifted] {
        let reply: redis::RedisResult<Vec<i64>> = redis::cmd("FCALL")
            .arg(&library.decide)
            .arg(1)
            .arg("look-alike")
            .arg(t0)
            .arg(0)
            .arg(0)
            .arg(&fields[..])
            .query_async(&mut conn)
            .await;
        if fields == &seen {
            assert!(reply.is_ok(), "{reply:?}");
            let _: () = redis::cmd("DEL")
                .arg("look-alike")
                .query_async(&mut conn)
                .await
                .unwrap();
        } else {
            let err = reply.unwrap_err();
            assert!(err.to_string().contains("bad parameters"), "{err}");
            let exists: i64 = redis::cmd("EXISTS")
                .arg("look-alike")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(exists, 0);
        }
    }
}

fn header(now: u64) -> HeaderArgs {
    HeaderArgs {
        now_us: Some(now),
        grace_ms: 60_000,
        receipts: false,
    }
}

fn limit_of(algorithm: Algorithm, cost: u64) -> LimitArgs {
    enforced(algorithm, 5, cost)
}

/// A fixed window of `limit` a minute, enforced, at `cost`.
fn fixed(limit: u64, cost: u64) -> LimitArgs {
    enforced(FixedWindow, limit, cost)
}

fn enforced(algorithm: Algorithm, limit: u64, cost: u64) -> LimitArgs {
    let params = LimitParams::new(algorithm, limit, 60_000_000, None).unwrap();
    LimitArgs::of(&Check {
        params,
        cost,
        mode: Mode::Enforce,
    })
}

/// A batch's requests are decided in order, each all or nothing: an
/// allowed one, a denied one whose other limit had room (and took
/// nothing), and an allowed one after it.
#[tokio::test]
async fn a_batch_decides_each_request_on_its_own_in_order() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    let library = script::library();
    support::redis::load_library(&mut conn).await;
    let now = 1_700_000_000_000_000_u64;
    // Request 1: a (limit 2) takes 2. Request 2: b (limit 10) and a (full):
    // denied, b untouched. Request 3: b alone takes 1.
    let requests: [(&[&str], Vec<LimitArgs>); 3] = [
        (&["a"], vec![fixed(2, 2)]),
        (&["b", "a"], vec![fixed(10, 1), fixed(2, 1)]),
        (&["b"], vec![fixed(10, 1)]),
    ];
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(&library.decide_batch).arg(4);
    for (keys, _) in &requests {
        cmd.arg(*keys);
    }
    cmd.arg((BATCH_FIELDS[0].value)(&requests.len()));
    for (keys, limits) in &requests {
        cmd.arg((REQUEST_FIELDS[0].value)(&keys.len()))
            .arg(argv(&header(now), limits));
    }
    let reply: Vec<i64> = cmd.query_async(&mut conn).await.unwrap();
    let verdicts = script::parse_batch_reply(&reply, &[1, 2, 1]).unwrap();
    assert!(verdicts[0].allowed);
    assert_eq!(verdicts[0].outcomes[0].remaining, 0);
    assert!(!verdicts[1].allowed);
    assert!(verdicts[1].outcomes[0].has_room && !verdicts[1].outcomes[0].consumed);
    assert!(!verdicts[1].outcomes[1].has_room);
    assert!(verdicts[2].allowed);
    assert_eq!(
        verdicts[2].outcomes[0].remaining, 9,
        "b: only request 3 counted"
    );
}
