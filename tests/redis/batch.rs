//! Batching on the single-server backend: concurrent requests share calls,
//! each decided all-or-nothing with its own answer; an idle request goes
//! at once; a failed batch fails each of its requests and nothing after it.

use std::sync::Arc;
use std::time::Duration;

use crate::support::keys::check_on;
use crate::support::redis::{
    RedisServer, backend_with, command_stat, command_stats, hammer, reset_stats,
};
use throttlegate::algorithms::Algorithm::{self, FixedWindow, TokenBucket};
use throttlegate::backends::redis::{BatchSettings, ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error, KeyedCheck};

const BATCH: BatchSettings = BatchSettings {
    max_requests: 64,
    max_keys: 512,
};

/// A backend with batching on, a pool of `pool_size` (so as many calls in
/// flight) and `timeout_ms`.
async fn batching(server: &RedisServer, pool_size: u32, timeout_ms: u64) -> RedisBackend {
    backend_with(server, ClockSource::Redis, |it| {
        it.batch = Some(BATCH);
        it.pool_size = pool_size;
        it.timeout_ms = timeout_ms;
    })
    .await
}

async fn fcalls(server: &RedisServer) -> f64 {
    let mut conn = server.connection().await;
    let stats = command_stats(&mut conn).await;
    command_stat(&stats, "fcall", "calls").unwrap_or(0.0)
}

/// A limit of 50 that cannot refill while the test runs.
fn slow_check(algorithm: Algorithm) -> KeyedCheck {
    check_on(algorithm, 3_600, &[("user", "alice")], 50, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_on_one_key_admit_exactly_the_limit_in_fewer_calls() {
    let server = RedisServer::start();
    let backend = Arc::new(batching(&server, 2, 5_000).await);
    for algorithm in Algorithm::ALL {
        let mut conn = server.connection().await;
        reset_stats(&mut conn).await;
        let total = hammer(vec![backend.clone()], vec![slow_check(algorithm)], 512).await;
        assert_eq!(total, 50, "{algorithm}");
        let calls = fcalls(&server).await;
        assert!(calls < 512.0, "{algorithm}: {calls} calls for 512 requests");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_allowed_and_denied_stacked_requests_answers_each_and_denied_take_nothing() {
    let server = RedisServer::start();
    // A pool of 2: 320 requests at once fit in its queue (256 per pooled
    // connection; beyond it requests are shed, see tests/redis/faults.rs).
    let backend = Arc::new(batching(&server, 2, 5_000).await);
    // Every request: a wide limit of 1,000 and a narrow one of 10 on its
    // own user; 40 requests per user, 8 users, all at once.
    let requests: Vec<Vec<KeyedCheck>> = (0..320)
        .map(|idx| {
            let user = format!("u{}", idx % 8);
            vec![
                check_on(TokenBucket, 3_600, &[("all", "x")], 1_000, 1),
                check_on(FixedWindow, 3_600, &[("user", &user)], 10, 1),
            ]
        })
        .collect();
    let mut conn = server.connection().await;
    reset_stats(&mut conn).await;
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|checks| {
            let backend = backend.clone();
            tokio::spawn(async move { backend.decide(&checks).await.expect("decide") })
        })
        .collect();
    let mut allowed = 0;
    for task in tasks {
        let verdict = task.await.unwrap();
        if verdict.allowed {
            allowed += 1;
            assert!(verdict.outcomes.iter().all(|it| it.consumed));
        } else {
            // Denied by the narrow limit alone: the wide one had room and
            // took nothing.
            assert!(verdict.outcomes[0].has_room && !verdict.outcomes[0].consumed);
            assert!(!verdict.outcomes[1].has_room);
        }
    }
    assert_eq!(allowed, 80, "10 per user");
    let calls = fcalls(&server).await;
    assert!(calls < 320.0, "{calls} calls: nothing was batched");
    // The wide limit counted the 80 allowed requests only.
    let look = [check_on(TokenBucket, 3_600, &[("all", "x")], 1_000, 0)];
    let verdict = backend.decide(&look).await.unwrap();
    assert_eq!(verdict.outcomes[0].remaining, 920);
}

/// With nothing in flight a request is sent at once, alone: sequential
/// requests are one call each, and none waits for company.
#[tokio::test]
async fn an_idle_request_is_sent_at_once() {
    let server = RedisServer::start();
    let backend = batching(&server, 1, 5_000).await;
    let checks = [check_on(FixedWindow, 60, &[("u", "a")], 5, 1)];
    assert!(backend.decide(&checks).await.unwrap().allowed);
    let mut conn = server.connection().await;
    reset_stats(&mut conn).await;
    for _ in 0..10 {
        let started = std::time::Instant::now();
        backend.decide(&checks).await.unwrap();
        // Far below the timeout: a batch never waits for a timer.
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    assert_eq!(fcalls(&server).await, 10.0);
}

/// Redis killed while a batch is in flight: each of its requests gets the
/// same error; after a restart requests are decided again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_batch_fails_each_request_and_later_ones_succeed() {
    let mut server = RedisServer::start();
    let backend = Arc::new(batching(&server, 1, 1_500).await);
    let checks = vec![check_on(FixedWindow, 60, &[("u", "a")], 100, 1)];
    assert!(backend.decide(&checks).await.unwrap().allowed);
    server.pause();
    // The first takes the only slot and times out at 1.5 s; the others,
    // queued at 0.8 s, then leave as one batch to the stopped server,
    // which is killed with the batch in flight.
    let first = {
        let (backend, checks) = (backend.clone(), checks.clone());
        tokio::spawn(async move { backend.decide(&checks).await })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let queued: Vec<_> = (0..8)
        .map(|_| {
            let (backend, checks) = (backend.clone(), checks.clone());
            tokio::spawn(async move { backend.decide(&checks).await })
        })
        .collect();
    assert!(first.await.unwrap().is_err(), "the stopped server answered");
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.kill();
    let mut errors = Vec::new();
    for task in queued {
        let err = task
            .await
            .unwrap()
            .expect_err("the batch cannot have been answered");
        // Not a timeout of its own: the batch was sent, and the kill ended it.
        assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
        errors.push(err.to_string());
    }
    assert!(
        errors.iter().all(|it| *it == errors[0]),
        "one error for the whole batch: {errors:?}"
    );
    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match backend.decide(&checks).await {
            Ok(verdict) => {
                assert!(verdict.allowed);
                break;
            }
            Err(err) => assert!(
                std::time::Instant::now() < deadline,
                "no decision after the restart: {err}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
