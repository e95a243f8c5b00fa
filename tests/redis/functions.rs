//! The decision as a Redis function library: FCALL on Redis 7, the load
//! after a flush, EVALSHA where the server has no functions, and the
//! library and the script giving the same answers.

use crate::support;
use crate::support::keys::check_on;
use crate::support::redis::{
    RedisServer, backend, command_stat, command_stats, library_loaded, members, reset_stats,
};
use crate::support::rng::Rng;
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::Algorithm::{self, FixedWindow, SlidingWindowLog, TokenBucket};
use throttlegate::algorithms::{Charge, Check, LimitParams, Mode};
use throttlegate::backends::redis::script::{
    self, BATCH_FIELDS, HeaderArgs, REQUEST_FIELDS, ReplyIntegers, ScriptLimit, argv,
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
            let ReplyIntegers(by_function) = redis::cmd("FCALL")
                .arg(&library.decide)
                .arg(1)
                .arg(format!("f:{algorithm}"))
                .arg(&args)
                .query_async(&mut conn)
                .await
                .unwrap();
            let ReplyIntegers(by_script) = redis::cmd("EVAL")
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
                let ReplyIntegers(by_function) = redis::cmd("FCALL")
                    .arg(&library.decide)
                    .arg(suffixes.len())
                    .arg(keys("f"))
                    .arg(args)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let ReplyIntegers(by_script) = redis::cmd("EVAL")
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
    // A limit the library has seen and parsed, then arguments that are
    // not one limit (a field too many or too few, an empty field, two
    // limits' fields in one): refused, and nothing written.
    let seen = "fixed_window:2000:60000000:2000:1:1:1:enforce:if_allowed";
    let bad = [
        "fixed_window:2000:60000000:2000:1:1:1:enforce:if_allowed:",
        "fixed_window:2000:60000000:2000:1:1:1:enforce",
        "fixed_window:2000:60000000:2000:1:1:enforce:if_allowed",
        "fixed_window::60000000:2000:1:1:1:enforce:if_allowed",
        ":fixed_window:2000:60000000:2000:1:1:1:enforce:if_allowed",
        "fixed_window:2000:60000000:2000:1:1:1:enforce:if_allowed:fixed_window:2000:60000000:2000:1:1:1:enforce:if_allowed",
        // A charge that is neither, and a capacity whose debt would leave
        // 53 bits.
        "fixed_window:2000:60000000:2000:1:1:1:enforce:sometimes",
        "fixed_window:2000:60000000:2000:1:1:1:enforce:",
        "fixed_window:4503599627370496:1000000:4503599627370496:1:1:1:enforce:always",
        "",
    ];
    for (idx, limit) in std::iter::once(seen).chain(bad).enumerate() {
        let reply: redis::RedisResult<ReplyIntegers> = redis::cmd("FCALL")
            .arg(&library.decide)
            .arg(1)
            .arg("look-alike")
            .arg(t0)
            .arg(0)
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await;
        if idx == 0 {
            assert!(reply.is_ok(), "{reply:?}");
            let _: () = redis::cmd("DEL")
                .arg("look-alike")
                .query_async(&mut conn)
                .await
                .unwrap();
        } else {
            let err = reply.unwrap_err();
            assert!(
                err.to_string().contains("bad parameters"),
                "{limit:?}: {err}"
            );
            let exists: i64 = redis::cmd("EXISTS")
                .arg("look-alike")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(exists, 0, "{limit:?}");
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

fn limit_of(algorithm: Algorithm, cost: u64) -> ScriptLimit {
    enforced(algorithm, 5, cost)
}

/// A fixed window of `limit` a minute, enforced, at `cost`.
fn fixed(limit: u64, cost: u64) -> ScriptLimit {
    enforced(FixedWindow, limit, cost)
}

fn enforced(algorithm: Algorithm, limit: u64, cost: u64) -> ScriptLimit {
    let params = LimitParams::new(algorithm, limit, 60_000_000, None).unwrap();
    ScriptLimit::of(&Check {
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
    support::redis::load_library(&mut conn).await;
    let now = 1_700_000_000_000_000_u64;
    // Request 1: a (limit 2) takes 2. Request 2: b (limit 10) and a (full):
    // denied, b untouched. Request 3: b alone takes 1.
    let requests = [
        TraceRequest::at(now, &["a"], vec![fixed(2, 2)]),
        TraceRequest::at(now, &["b", "a"], vec![fixed(10, 1), fixed(2, 1)]),
        TraceRequest::at(now, &["b"], vec![fixed(10, 1)]),
    ];
    let ReplyIntegers(reply) = batch_call(&requests, "")
        .query_async(&mut conn)
        .await
        .unwrap();
    let verdicts: Vec<_> = script::parse_batch_reply(&reply, &[1, 2, 1])
        .unwrap()
        .into_iter()
        .map(|it| it.expect("decided"))
        .collect();
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

/// One request of a batch trace: its keys (distinct) and limits.
struct TraceRequest {
    now: u64,
    keys: Vec<String>,
    limits: Vec<ScriptLimit>,
}

impl TraceRequest {
    fn at(now: u64, keys: &[&str], limits: Vec<ScriptLimit>) -> TraceRequest {
        let keys = keys.iter().map(|it| (*it).to_owned()).collect();
        TraceRequest { now, keys, limits }
    }
}

/// One `decide_batch` call of `requests`, in order, each key prefixed by
/// `prefix`.
fn batch_call(requests: &[TraceRequest], prefix: &str) -> redis::Cmd {
    let keys: Vec<_> = requests
        .iter()
        .flat_map(|it| it.keys.iter().map(|key| format!("{prefix}{key}")))
        .collect();
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(&script::library().decide_batch)
        .arg(keys.len())
        .arg(&keys)
        .arg((BATCH_FIELDS[0].value)(&requests.len()));
    for request in requests {
        cmd.arg((REQUEST_FIELDS[0].value)(&request.keys.len()))
            .arg(argv(&header(request.now), &request.limits));
    }
    cmd
}

/// The parameter sets a key of the trace switches between, as reloads
/// would: several limits and windows, and for the first key several
/// algorithms of three-integer states (a key changing algorithm).
fn trace_variants(rng: &mut Rng, slot: usize) -> Vec<(Algorithm, u64, u64)> {
    const ALGORITHMS: [Algorithm; 5] = [
        SlidingWindowLog,
        TokenBucket,
        Algorithm::Gcra,
        Algorithm::SlidingWindowCounter,
        FixedWindow,
    ];
    let mut variants = Vec::new();
    if slot == 0 {
        for algorithm in [
            TokenBucket,
            Algorithm::Gcra,
            Algorithm::SlidingWindowCounter,
        ] {
            variants.push((algorithm, rng.pick(&[3, 10, 100]), rng.pick(&[1, 5, 60])));
        }
        return variants;
    }
    let algorithm = rng.pick(&ALGORITHMS);
    for _ in 0..1 + rng.below(3) {
        variants.push((algorithm, rng.pick(&[3, 10, 100]), rng.pick(&[1, 5, 60])));
    }
    variants
}

fn trace_requests(seed: u64, len: usize) -> Vec<TraceRequest> {
    let mut rng = Rng(seed);
    let slots: Vec<_> = (0..4).map(|slot| trace_variants(&mut rng, slot)).collect();
    let mut now = 1_700_000_000_000_000_u64;
    let mut out = Vec::with_capacity(len);
    for _ in 0..len {
        // Mostly small steps (many requests in one window, several in one
        // µs), sometimes past a window, sometimes a lagging clock.
        let step = rng.pick(&[
            0, 0, 1, 1, 7, 500, 100_000, 1_000_000, 3_000_000, 61_000_000,
        ]);
        now += step;
        let lagging = rng.below(10) == 0;
        let at = if lagging { now - 2_000_000 } else { now };
        let mut keys = Vec::new();
        let mut limits = Vec::new();
        let first = rng.below(4) as usize;
        for slot in (0..4)
            .map(|it| (first + it) % 4)
            .take(1 + rng.below(3) as usize)
        {
            let (algorithm, limit, window_s) = rng.pick(&slots[slot]);
            // A limit charged always carries debt from request to request
            // of a batch as it does between calls. Not the bucket of the key
            // changing algorithm: a level in debt is a bucket's alone, and
            // the others refuse it (keys name their algorithm, so only a
            // foreign write leaves them one).
            let mut charge = rng.pick(&[Charge::IfAllowed, Charge::IfAllowed, Charge::Always]);
            if slot == 0 && algorithm == TokenBucket {
                charge = Charge::IfAllowed;
            }
            let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, None)
                .and_then(|it| it.with_charge(charge))
                .unwrap();
            let capacity = params.capacity();
            let cost = rng.pick(&[
                0,
                1,
                1,
                1,
                2,
                5,
                capacity,
                capacity + 1,
                2 * capacity,
                u64::MAX,
            ]);
            let mode = rng.pick(&[
                Mode::Enforce,
                Mode::Enforce,
                Mode::Enforce,
                Mode::Shadow,
                Mode::Quota,
            ]);
            keys.push(format!("k{slot}"));
            limits.push(ScriptLimit::of(&Check { params, cost, mode }));
        }
        out.push(TraceRequest {
            now: at,
            keys,
            limits,
        });
    }
    out
}

/// A key as a client can see it: its value and when it expires.
async fn key_snapshot(conn: &mut MultiplexedConnection, key: &str) -> (String, Vec<String>, i64) {
    let kind: String = redis::cmd("TYPE").arg(key).query_async(conn).await.unwrap();
    let value: Vec<String> = match kind.as_str() {
        "string" => vec![redis::cmd("GET").arg(key).query_async(conn).await.unwrap()],
        "zset" => members::<String>(conn, key)
            .await
            .into_iter()
            .flat_map(|(member, score)| [member, score])
            .collect(),
        _ => Vec::new(),
    };
    let expires: i64 = redis::cmd("PEXPIRETIME")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap();
    (kind, value, expires)
}

/// Decides `requests` once one by one (`decide`, on keys `one:*`) and once
/// in batches of 1 to 40 (`decide_batch`, on keys `batch:*`), and asserts
/// after each batch the same answers and, for each of `keys`, the same
/// value, with expiries within the real time between the two writes.
async fn assert_batches_match_one_by_one(
    conn: &mut MultiplexedConnection,
    requests: &[TraceRequest],
    keys: &[&str],
    rng: &mut Rng,
    context: &str,
) {
    let library = script::library();
    let mut batches = 0;
    let mut rest = requests;
    while !rest.is_empty() {
        let size = (1 + rng.below(40) as usize).min(rest.len());
        let (batch, after) = rest.split_at(size);
        rest = after;
        let mut one_by_one = Vec::new();
        for request in batch {
            let keys: Vec<_> = request.keys.iter().map(|it| format!("one:{it}")).collect();
            let ReplyIntegers(reply) = redis::cmd("FCALL")
                .arg(&library.decide)
                .arg(keys.len())
                .arg(&keys)
                .arg(argv(&header(request.now), &request.limits))
                .query_async(conn)
                .await
                .unwrap();
            one_by_one.extend(reply);
        }
        let ReplyIntegers(batched) = batch_call(batch, "batch:").query_async(conn).await.unwrap();
        batches += 1;
        assert_eq!(batched, one_by_one, "{context}, batch {batches} of {size}");
        for key in keys {
            let one = key_snapshot(conn, &format!("one:{key}")).await;
            let together = key_snapshot(conn, &format!("batch:{key}")).await;
            let context = format!("{context}, batch {batches}, key {key}");
            assert_eq!((&one.0, &one.1), (&together.0, &together.1), "{context}");
            assert!(
                (one.2 - together.2).abs() <= 500,
                "{context}: expiries {} and {}",
                one.2,
                together.2
            );
        }
    }
    let _: () = redis::cmd("FLUSHDB").query_async(conn).await.unwrap();
}

/// A batch leaves every answer and every key exactly as its requests made
/// one by one would: random traces over four keys (all five algorithms,
/// reloads, a key changing algorithm, costs 0 to capacity + 1, shadow and
/// quota modes, lagging clocks, several requests per µs).
#[tokio::test]
async fn a_batch_leaves_the_answers_and_keys_of_its_requests_decided_one_by_one() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    support::redis::load_library(&mut conn).await;
    for seed in 0..24 {
        let requests = trace_requests(seed, 300);
        let mut rng = Rng(seed ^ 0x5eed);
        let context = format!("seed {seed}");
        assert_batches_match_one_by_one(
            &mut conn,
            &requests,
            &["k0", "k1", "k2", "k3"],
            &mut rng,
            &context,
        )
        .await;
    }
}

/// The same for a log that leaves more expired members than one call
/// removes (LOG_EXPIRE_MAX, 32): 100 entries a µs apart, then requests a
/// window later, in batches, each removing at most 32 of them.
#[tokio::test]
async fn a_batch_on_a_log_with_many_expired_members_leaves_what_one_by_one_leaves() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    support::redis::load_library(&mut conn).await;
    let params = LimitParams::new(SlidingWindowLog, 1_000, 1_000_000, None).unwrap();
    let check = |cost| {
        ScriptLimit::of(&Check {
            params,
            cost,
            mode: Mode::Enforce,
        })
    };
    for seed in 0..8 {
        let t0 = 1_700_000_000_000_000_u64;
        let mut requests: Vec<_> = (0..100)
            .map(|idx| TraceRequest {
                now: t0 + idx,
                keys: vec!["log".into()],
                limits: vec![check(1)],
            })
            .collect();
        requests.extend((0..20).map(|idx| TraceRequest {
            now: t0 + 2_000_000 + idx * 10,
            keys: vec!["log".into()],
            limits: vec![check(1 + idx % 3)],
        }));
        let mut rng = Rng(seed);
        let context = format!("seed {seed}");
        assert_batches_match_one_by_one(&mut conn, &requests, &["log"], &mut rng, &context).await;
    }
}

/// A batch whose later request fails (a key of another type) still leaves
/// what its earlier requests decided: their stores wait for the batch's
/// end and are written before the error is returned.
/// A request of a batch that fails while it is decided (a key of another
/// type) fails alone: the requests before and after it are decided and
/// their stores kept.
#[tokio::test]
async fn a_failing_request_in_a_batch_fails_alone() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    support::redis::load_library(&mut conn).await;
    let _: () = redis::cmd("ZADD")
        .arg("not-a-counter")
        .arg(1)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    let now = 1_700_000_000_000_000_u64;
    let requests: Vec<_> = ["a", "a", "not-a-counter", "a"]
        .iter()
        .map(|key| TraceRequest::at(now, &[key], vec![fixed(10, 1)]))
        .collect();
    let ReplyIntegers(reply) = batch_call(&requests, "")
        .query_async(&mut conn)
        .await
        .unwrap();
    let answers = script::parse_batch_reply(&reply, &[1, 1, 1, 1]).unwrap();
    let remaining: Vec<_> = answers
        .iter()
        .map(|it| it.as_ref().ok().map(|it| it.outcomes[0].remaining))
        .collect();
    assert_eq!(remaining, [Some(9), Some(8), None, Some(7)], "{answers:?}");
    let err = answers[2].as_ref().unwrap_err().to_string();
    assert!(err.contains("failed while deciding"), "{err}");
    let (kind, value, expires) = key_snapshot(&mut conn, "a").await;
    assert_eq!(kind, "string");
    let count = value[0].rsplit(':').next().unwrap();
    assert_eq!(count, "3", "the three requests on a counted: {value:?}");
    assert!(expires > 0, "stored with its expiry");
}
