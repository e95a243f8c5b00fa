//! The Redis backend against a real redis-server: exactness under
//! concurrency and across instances, key hygiene, failures and recovery.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::keys::{check_on, check_with_burst, counter_key};
use crate::support::redis::{
    RedisServer, backend, backend_with, command_stat, command_stats, hammer, reset_stats, settings,
};
use crate::support::service::T0;
use throttlegate::algorithms::Algorithm::{FixedWindow, Gcra, SlidingWindowLog, TokenBucket};
use throttlegate::algorithms::{Algorithm, Check};
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error, KeyedCheck};
use throttlegate::clock::ManualClock;

fn manual(at: u64) -> (ManualClock, ClockSource) {
    let clock = ManualClock::new(at);
    (clock.clone(), ClockSource::Local(Arc::new(clock)))
}

/// A backend on `server` whose time is a manual clock at [`T0`].
async fn backend_at_t0(server: &RedisServer) -> (ManualClock, RedisBackend) {
    let (clock, source) = manual(T0);
    (clock, backend(server, source).await)
}

async fn allowed(backend: &dyn Backend, checks: &[KeyedCheck]) -> bool {
    backend.decide(checks).await.expect("decide").allowed
}

async fn dbsize(server: &RedisServer) -> u64 {
    let mut conn = server.connection().await;
    redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap()
}

/// A limit of 50 that cannot refill while the test runs.
fn slow_check(algorithm: Algorithm) -> KeyedCheck {
    check_on(algorithm, 3_600, &[("user", "alice")], 50, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_on_one_key_admit_exactly_the_limit() {
    let server = RedisServer::start();
    let backend = Arc::new(backend(&server, ClockSource::Redis).await);
    for algorithm in Algorithm::ALL {
        let total = hammer(vec![backend.clone()], vec![slow_check(algorithm)], 256).await;
        assert_eq!(total, 50, "{algorithm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_redis_admit_exactly_the_limit_in_total() {
    let server = RedisServer::start();
    let first = Arc::new(backend(&server, ClockSource::Redis).await);
    let second = Arc::new(backend(&server, ClockSource::Redis).await);
    for algorithm in Algorithm::ALL {
        let total = hammer(
            vec![first.clone(), second.clone()],
            vec![slow_check(algorithm)],
            256,
        )
        .await;
        assert_eq!(total, 50, "{algorithm}");
    }
}

#[tokio::test]
async fn requests_in_the_same_microsecond_are_all_counted() {
    let server = RedisServer::start();
    let (_clock, backend) = backend_at_t0(&server).await;
    // math.random()-style members collided here: 8 of 8 passed on Redis 5/6.
    let limit_5 = [check_on(SlidingWindowLog, 1, &[("u", "a")], 5, 1)];
    let mut admitted = 0;
    for _ in 0..8 {
        admitted += usize::from(allowed(&backend, &limit_5).await);
    }
    assert_eq!(admitted, 5);
    // Cost 5 against 10: a single ZADD per request would admit 6.
    let cost_5 = [check_on(SlidingWindowLog, 1, &[("u", "b")], 10, 5)];
    let mut admitted = 0;
    for _ in 0..6 {
        admitted += usize::from(allowed(&backend, &cost_5).await);
    }
    assert_eq!(admitted, 2);
}

#[tokio::test]
async fn every_key_has_a_ttl_and_idle_keys_vanish() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    for algorithm in Algorithm::ALL {
        for value in ["a", "b:c", "{x}", ""] {
            let checks = [check_on(algorithm, 1, &[("user", value)], 10, 3)];
            assert!(allowed(&backend, &checks).await);
        }
    }
    let keys = server.keys_with_ttl("*").await;
    assert_eq!(keys.len(), 20, "{keys:?}");
    for (key, ttl) in &keys {
        // A sliding-window counter's count is weighed for one more window.
        let bound = if key.contains("sliding_window_counter") {
            2_000
        } else {
            1_000
        };
        assert!(*ttl > 0 && *ttl <= bound, "{key}: pttl {ttl}");
    }
    let deadline = Instant::now() + Duration::from_millis(3_000);
    while dbsize(&server).await > 0 {
        assert!(
            Instant::now() < deadline,
            "keys outlived their windows: {:?}",
            server.keys_with_ttl("*").await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_state_equal_to_fresh_is_deleted() {
    let server = RedisServer::start();
    let (clock, backend) = backend_at_t0(&server).await;
    for algorithm in Algorithm::ALL {
        // A check (cost 0) changes nothing, so nothing is stored.
        let probe = [check_on(algorithm, 60, &[("u", "a")], 10, 0)];
        assert!(allowed(&backend, &probe).await);
    }
    assert_eq!(dbsize(&server).await, 0);
    // A token bucket refilled to full by the time of the next request.
    let take = [check_on(TokenBucket, 60, &[("u", "b")], 10, 1)];
    assert!(allowed(&backend, &take).await);
    assert_eq!(dbsize(&server).await, 1);
    clock.advance(6_000_000);
    let look = [check_on(TokenBucket, 60, &[("u", "b")], 10, 0)];
    let verdict = backend.decide(&look).await.unwrap();
    assert_eq!(verdict.outcomes[0].remaining, 10);
    assert_eq!(dbsize(&server).await, 0);
}

#[tokio::test]
async fn function_flush_while_serving_is_transparent() {
    let server = RedisServer::start();
    let (_clock, backend) = backend_at_t0(&server).await;
    let checks = [check_on(SlidingWindowLog, 60, &[("u", "a")], 4, 1)];
    assert!(allowed(&backend, &checks).await);
    assert!(allowed(&backend, &checks).await);
    let mut conn = server.connection().await;
    support::redis::function_flush(&mut conn).await;
    // Function not found → FUNCTION LOAD → FCALL, and the counter carries
    // on: the call that met no function did not count.
    assert!(allowed(&backend, &checks).await);
    assert!(allowed(&backend, &checks).await);
    assert!(!allowed(&backend, &checks).await);
}

fn assert_bounded(started: Instant, timeout_ms: u64, what: &str) {
    let elapsed = started.elapsed();
    assert!(
        elapsed <= Duration::from_millis(timeout_ms + 250),
        "{what} took {elapsed:?} with a {timeout_ms} ms timeout"
    );
}

#[tokio::test]
async fn killed_redis_fails_fast_and_recovery_needs_no_restart() {
    let mut server = RedisServer::start();
    let (_clock, source) = manual(T0);
    let backend = backend_with(&server, source, |it| it.timeout_ms = 300).await;
    let checks = [check_on(TokenBucket, 60, &[("u", "a")], 10, 1)];
    assert!(allowed(&backend, &checks).await);
    backend.probe().await.expect("healthy");

    server.kill();
    for attempt in 0..3 {
        let started = Instant::now();
        let err = backend.decide(&checks).await.expect_err("redis is down");
        assert_bounded(started, 300, "decide");
        assert!(
            matches!(err, Error::Unavailable(_) | Error::Timeout(_)),
            "attempt {attempt}: {err:?}"
        );
        assert!(err.is_transient());
        if attempt > 0 {
            // Once the dead connections are gone, the reason is the refused
            // reconnect, not a bare timeout.
            assert!(err.to_string().contains("refused"), "{err}");
        }
        let started = Instant::now();
        backend
            .probe()
            .await
            .expect_err("probe must notice the outage");
        assert_bounded(started, 300, "probe");
    }

    server.restart();
    backend
        .probe()
        .await
        .expect("probe recovers on the same backend");
    assert!(allowed(&backend, &checks).await, "decisions resume");
}

#[tokio::test]
async fn dropped_connections_are_replaced() {
    let server = RedisServer::start();
    let (_clock, backend) = backend_at_t0(&server).await;
    let checks = [check_on(Gcra, 60, &[("u", "a")], 100, 1)];
    assert!(allowed(&backend, &checks).await);
    let mut conn = server.connection().await;
    // Kill every client but this one, as a proxy or a failover would.
    let _: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut conn)
        .await
        .unwrap();
    backend
        .probe()
        .await
        .expect("probe replaces the dead connection");
    for _ in 0..5 {
        assert!(allowed(&backend, &checks).await);
    }
}

/// The request that timed out may still run (here: when Redis resumes);
/// a retry would have counted it twice.
#[tokio::test]
async fn paused_redis_times_out_and_the_request_is_not_retried() {
    let server = RedisServer::start();
    let (_clock, source) = manual(T0);
    let backend = backend_with(&server, source, |it| it.timeout_ms = 300).await;
    let checks = [check_on(SlidingWindowLog, 60, &[("u", "a")], 3, 1)];
    // Also loads the library: the timed-out call below is a bare FCALL.
    assert!(allowed(&backend, &checks).await);

    server.pause();
    let started = Instant::now();
    let err = backend.decide(&checks).await.expect_err("redis is paused");
    assert_bounded(started, 300, "decide");
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    server.resume();

    // The timed-out call ran once Redis resumed: one unit left, not zero.
    let mut conn = server.connection().await;
    let key = backend.key_of(&checks[0].key);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        // One member per µs, "<running total>,<cost>": both calls at T0.
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        if members == ["2,2"] {
            break;
        }
        assert!(
            members == ["1,1"] && Instant::now() < deadline,
            "{members:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(allowed(&backend, &checks).await);
    assert!(!allowed(&backend, &checks).await);
}

#[tokio::test]
async fn redis_time_keeps_skewed_replicas_exact() {
    let server = RedisServer::start();
    let bucket = || [check_on(TokenBucket, 60, &[("u", "a")], 10, 1)];

    // Replicas whose clocks are a window apart, each sending its own time.
    let (_early, early) = manual(T0);
    let (_late, late) = manual(T0 + 60_000_000);
    let replicas = [backend(&server, early).await, backend(&server, late).await];
    let mut admitted = 0;
    for idx in 0..100 {
        admitted += usize::from(allowed(&replicas[idx % 2], &bucket()).await);
    }
    assert!(
        admitted > 10,
        "local clocks a window apart refill the bucket: {admitted}"
    );

    let mut conn = server.connection().await;
    let () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let replicas = [
        backend(&server, ClockSource::Redis).await,
        backend(&server, ClockSource::Redis).await,
    ];
    let mut admitted = 0;
    for idx in 0..100 {
        admitted += usize::from(allowed(&replicas[idx % 2], &bucket()).await);
    }
    assert_eq!(admitted, 10);
}

#[tokio::test]
async fn hostile_values_never_share_a_counter() {
    let server = RedisServer::start();
    let (_clock, backend) = backend_at_t0(&server).await;
    let descriptors: [&[(&str, &str)]; 12] = [
        &[("k", ":")],
        &[("k", "_")],
        &[("k", "{")],
        &[("k", "}")],
        &[("k", "{}")],
        &[("k", "")],
        &[("k", "ünï©ødé")],
        &[("k", "%3A")],
        &[("a:b", "c")],
        &[("a", "b:c")],
        &[("a", "b"), ("c", "d")],
        &[("a", "b:c=d")],
    ];
    for entries in descriptors {
        let checks = [check_on(SlidingWindowLog, 60, entries, 1, 1)];
        assert!(
            allowed(&backend, &checks).await,
            "{entries:?} shared a counter"
        );
        assert!(
            !allowed(&backend, &checks).await,
            "{entries:?} was not counted"
        );
    }
    let keys = server.keys_with_ttl("*").await;
    assert_eq!(keys.len(), descriptors.len());
    for (key, _) in keys {
        assert!(!key.contains(['{', '}']), "{key} holds a hash tag");
    }
}

#[tokio::test]
async fn a_denied_request_consumes_nothing_anywhere() {
    let server = RedisServer::start();
    let (_clock, backend) = backend_at_t0(&server).await;
    let wide = check_on(TokenBucket, 60, &[("ip", "1")], 6, 1);
    let narrow = check_on(FixedWindow, 60, &[("user", "u")], 3, 1);
    let both = [wide.clone(), narrow];
    for _ in 0..3 {
        assert!(allowed(&backend, &both).await);
    }
    for _ in 0..3 {
        assert!(!allowed(&backend, &both).await);
    }
    // The token bucket lost 3 tokens for 3 served requests, not 6.
    let look = [KeyedCheck {
        check: Check {
            cost: 0,
            ..wide.check
        },
        ..wide
    }];
    assert_eq!(
        backend.decide(&look).await.unwrap().outcomes[0].remaining,
        3
    );
}

#[tokio::test]
async fn checkouts_send_no_ping() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let checks = [check_on(Gcra, 60, &[("u", "a")], 1_000, 1)];
    let mut conn = server.connection().await;
    // Forget the harness's own readiness PING.
    reset_stats(&mut conn).await;
    for _ in 0..50 {
        allowed(&backend, &checks).await;
    }
    let stats = command_stats(&mut conn).await;
    assert!(!stats.contains("cmdstat_ping"), "{stats}");
    let fcall_calls = command_stat(&stats, "fcall", "calls")
        .unwrap_or_else(|| panic!("no fcall stats in {stats}"));
    // 50 decisions; the library was loaded before the first.
    assert_eq!(fcall_calls, 50.0, "{stats}");
}

#[tokio::test]
async fn unix_socket_and_passwords_work() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let mut conn = server.connection().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("alice")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("+@all")
        .query_async(&mut conn)
        .await
        .unwrap();
    let checks = [check_on(FixedWindow, 60, &[("u", "a")], 3, 1)];
    let urls = [
        server.url(),
        format!("redis://alice:pw@127.0.0.1:{}/", server.port()),
        format!(
            "redis+unix://{}?pass=s3cret",
            server.socket_path().display()
        ),
    ];
    for url in urls {
        let backend = backend_with(&server, ClockSource::Redis, |it| it.url = url.clone()).await;
        backend
            .probe()
            .await
            .unwrap_or_else(|err| panic!("{url}: {err}"));
        assert!(allowed(&backend, &checks).await, "{url}");
    }
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.url = format!("redis://alice:nope@127.0.0.1:{}/", server.port())
    })
    .await;
    let err = backend.probe().await.expect_err("wrong password");
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    assert!(!format!("{backend:?}").contains("nope"), "{backend:?}");
    assert!(!err.to_string().contains("nope"), "{err}");
}

#[tokio::test]
async fn bad_urls_fail_at_connect_and_unreachable_servers_at_probe() {
    let server = RedisServer::start();
    for url in ["", "http://127.0.0.1/", "redis://127.0.0.1:notaport/"] {
        let mut it = settings(&server, ClockSource::Redis);
        it.url = url.to_owned();
        let err = RedisBackend::connect(it).await.expect_err(url);
        assert!(matches!(err, Error::Protocol(_)), "{url}: {err:?}");
    }
    let port = server.port();
    drop(server);
    let mut it = settings_for(&format!("redis://127.0.0.1:{port}/"));
    it.timeout_ms = 200;
    let backend = RedisBackend::connect(it)
        .await
        .expect("unreachable is not a connect error");
    let started = Instant::now();
    let err = backend.probe().await.expect_err("nobody listens");
    assert_bounded(started, 200, "probe");
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
}

/// TLS is compiled in: a `rediss://` URL connects with rustls (and fails
/// cleanly, without a panic, against a server that speaks plain text).
#[tokio::test]
async fn rediss_against_a_plain_server_is_a_clean_error() {
    let server = RedisServer::start();
    let mut it = settings(&server, ClockSource::Redis);
    it.url = format!("rediss://127.0.0.1:{}/#insecure", server.port());
    let backend = RedisBackend::connect(it).await.expect("a valid tls url");
    // Without a rustls crypto provider the connection task panicked (and
    // tokio swallowed it): watch for panics raised inside rustls.
    static RUSTLS_PANICKED: AtomicBool = AtomicBool::new(false);
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info
            .location()
            .is_some_and(|it| it.file().contains("rustls"))
        {
            RUSTLS_PANICKED.store(true, Ordering::SeqCst);
        }
        default_hook(info);
    }));
    for _ in 0..2 {
        let err = backend.probe().await.expect_err("plain server");
        assert!(err.is_transient(), "{err:?}");
    }
    assert!(!RUSTLS_PANICKED.load(Ordering::SeqCst), "rustls panicked");
}

#[tokio::test]
async fn the_same_counter_twice_in_one_request_is_refused() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis).await;
    let it = check_on(FixedWindow, 60, &[("u", "a")], 3, 1);
    let err = backend
        .decide(&[it.clone(), it])
        .await
        .expect_err("duplicate");
    assert!(matches!(err, Error::Protocol(_)), "{err:?}");
}

#[tokio::test]
async fn the_key_prefix_namespaces_every_key() {
    let server = RedisServer::start();
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.key_prefix = "custom-prefix".to_owned()
    })
    .await;
    let checks = [check_on(Gcra, 60, &[("u", "a")], 5, 1)];
    assert!(allowed(&backend, &checks).await);
    let keys = server.keys_with_ttl("*").await;
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].0, "custom-prefix:test:rule:gcra.60s:u=a");
}

fn settings_for(url: &str) -> throttlegate::backends::redis::RedisSettings {
    throttlegate::backends::redis::RedisSettings {
        url: url.to_owned(),
        sentinel: None,
        pool_size: 2,
        timeout_ms: 5_000,
        key_prefix: "tg".to_owned(),
        clock: ClockSource::Redis,
        expiry_grace_ms: 0,
        batch: None,
        tls: Default::default(),
    }
}

#[tokio::test]
async fn rediss_talks_tls_to_a_tls_server() {
    let server = RedisServer::start_tls();
    let backend = backend(&server, ClockSource::Redis).await;
    backend.probe().await.expect("tls probe");
    let checks = [check_on(TokenBucket, 60, &[("u", "a")], 2, 1)];
    assert!(allowed(&backend, &checks).await);
    assert!(allowed(&backend, &checks).await);
    assert!(!allowed(&backend, &checks).await);
}

/// redis-rs's connections time out after 500 ms by default; a longer
/// configured timeout must be the one that applies.
#[tokio::test]
async fn a_timeout_longer_than_the_client_default_is_honoured() {
    let server = RedisServer::start();
    let backend = backend_with(&server, ClockSource::Redis, |it| it.timeout_ms = 900).await;
    backend.probe().await.expect("healthy");
    server.pause();
    let started = Instant::now();
    let err = backend.probe().await.expect_err("paused");
    let elapsed = started.elapsed();
    server.resume();
    assert!(matches!(err, Error::Timeout(900)), "{err:?}");
    assert!(
        elapsed >= Duration::from_millis(850),
        "gave up after {elapsed:?}"
    );
    assert_bounded(started, 900, "probe");
}

/// GCRA decides exactly as a continuous token bucket with the same rate and
/// burst (both exact, on integers), event for event.
#[tokio::test]
async fn gcra_and_token_bucket_make_the_same_decisions() {
    let server = RedisServer::start();
    let (clock, source) = manual(T0);
    let backend = backend_with(&server, source, |it| it.expiry_grace_ms = 3_600_000).await;
    let mut seed: u64 = 12_345;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for (limit, window_s, burst) in [(10, 1, None), (7, 60, Some(3)), (100, 3_600, Some(250))] {
        let make = |algorithm: Algorithm, cost: u64| {
            let key = counter_key(algorithm, window_s, &[("u", &format!("{limit}"))]);
            check_with_burst(key, limit, cost, burst)
        };
        for event in 0..1_000 {
            clock.advance(random(3 * window_s * 1_000_000 / limit));
            let cost = random(3);
            let bucket = backend.decide(&[make(TokenBucket, cost)]).await.unwrap();
            let gcra = backend.decide(&[make(Gcra, cost)]).await.unwrap();
            assert_eq!(
                (bucket.allowed, bucket.outcomes[0].remaining),
                (gcra.allowed, gcra.outcomes[0].remaining),
                "{limit}/{window_s}s burst {burst:?}, event {event}"
            );
        }
    }
}

/// After a probe timed out (a hung or half-open connection), the pool
/// reconnects: the next probe, once Redis answers, succeeds.
#[tokio::test]
async fn a_probe_timeout_replaces_the_connection() {
    let server = RedisServer::start();
    let backend = backend_with(&server, ClockSource::Redis, |it| it.timeout_ms = 300).await;
    backend.probe().await.expect("healthy");
    let mut conn = server.connection().await;
    let id_before = support::redis::client_id(&mut conn).await;
    server.pause();
    let err = backend.probe().await.expect_err("paused");
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    server.resume();
    backend.probe().await.expect("recovers");
    // The backend now talks over a connection made after the pause.
    let clients = support::redis::client_ids(&mut conn, &[]).await;
    let newest = clients.iter().copied().max().unwrap();
    assert!(newest > id_before, "{clients:?}");
}

/// A request whose clock lags the last consumption sees a debt above the
/// burst; the script saturates (denies) where the reference's `u64`
/// subtraction underflows (docs/redis.md, known differences).
#[tokio::test]
async fn gcra_with_a_lagging_clock_never_admits_beyond_the_burst() {
    let server = RedisServer::start();
    let (clock, backend) = backend_at_t0(&server).await;
    let checks = [check_on(Gcra, 1, &[("u", "a")], 10, 1)];
    for _ in 0..10 {
        assert!(allowed(&backend, &checks).await);
    }
    clock.set(T0 - 1_000);
    let verdict = backend.decide(&checks).await.unwrap();
    assert!(!verdict.allowed, "{verdict:?}");
    assert_eq!(verdict.outcomes[0].remaining, 0);
    // One emission interval (100 ms) after T0, counted from the lagging clock.
    assert_eq!(verdict.outcomes[0].reset_us, 100_000 + 1_000);
}

/// Warming up makes the connection the first decision uses and loads the
/// function library, so that decision makes no connection of its own.
/// Against a server that is down it ends within the timeout, and the next
/// decision fails as it would have without it.
#[tokio::test]
async fn warm_up_makes_the_first_decisions_connection_and_never_hangs() {
    let mut server = RedisServer::start();
    let backend = backend_with(&server, ClockSource::Redis, |_| {}).await;
    let mut admin = server.connection().await;
    let own = support::redis::client_id(&mut admin).await;
    backend.warm_up().await;
    let warmed = support::redis::client_ids(&mut admin, &[own]).await;
    assert_eq!(warmed.len(), 1, "{warmed:?}");
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(libraries.len(), 1, "{libraries:?}");
    let checks = [check_on(FixedWindow, 60, &[("u", "a")], 10, 1)];
    assert!(allowed(&backend, &checks).await);
    assert_eq!(support::redis::client_ids(&mut admin, &[own]).await, warmed);

    server.kill();
    let down = backend_with(&server, ClockSource::Redis, |it| it.timeout_ms = 300).await;
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), down.warm_up())
        .await
        .expect("warm-up ends");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let err = down.decide(&checks).await.expect_err("down");
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
}
