//! Decisions whose reply comes after `--redis-timeout-ms`, on the service
//! binary against a Redis made slow with `DEBUG SLEEP`: each request is
//! answered at its timeout through `--failure-mode`, and what Redis
//! decided once it woke is still counted in `throttlegate_hits_total`,
//! `throttlegate_decisions_total` and `throttlegate_late_replies_total`,
//! so the hits equal what Redis counted. Batching on and off.

use std::time::{Duration, Instant};

use tonic::transport::Channel;

use crate::support::process::{Serve, ServiceProcess};
use crate::support::redis::RedisServer;
use crate::support::request::{descriptor, request};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = r#"
domain: late
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000, algorithm: fixed_window}
"#;

/// `--redis-timeout-ms`: far shorter than the stall.
const TIMEOUT: Duration = Duration::from_millis(200);

/// How long Redis sleeps: past every request's timeout, well within the
/// grace a late reply is awaited for (10 s).
const STALL_S: f64 = 1.5;

struct Setup {
    redis: RedisServer,
    service: ServiceProcess,
    channel: Channel,
}

impl Setup {
    async fn start(batch: &str) -> Setup {
        let redis = RedisServer::start_with(&["--enable-debug-command", "local"]);
        let timeout_ms = TIMEOUT.as_millis().to_string();
        let mut service = Serve::yaml(CONFIG)
            .args(&["--redis-url", &redis.url()])
            .args(&["--redis-timeout-ms", &timeout_ms])
            .args(&["--redis-batch", batch])
            // One connection: with batching on, requests behind the first
            // wait for its slot and go together.
            .args(&["--redis-pool-size", "1"])
            .args(&["--failure-mode", "deny"])
            .spawn();
        let channel = service.connect().await;
        let setup = Setup {
            redis,
            service,
            channel,
        };
        let warm = setup.ask("warm").await;
        assert_eq!(warm.overall_code, Code::Ok as i32, "a decision");
        setup
    }

    async fn ask(&self, user: &str) -> RateLimitResponse {
        let call = tonic::Request::new(request("late", vec![descriptor(&[("user", user)])]));
        RateLimitServiceClient::new(self.channel.clone())
            .should_rate_limit(call)
            .await
            .expect("answered")
            .into_inner()
    }

    async fn metric(&self, series: &str) -> f64 {
        self.service.metric(series).await
    }

    async fn hits(&self) -> f64 {
        self.metric("throttlegate_hits_total{domain=\"late\",rule=\"user\"}")
            .await
    }

    /// What Redis counted for `user` (its fixed window's count).
    async fn counted_in_redis(&self, user: &str) -> u64 {
        let keys = self.redis.keys(&format!("*{user}*")).await;
        let mut conn = self.redis.connection().await;
        let mut total = 0;
        for key in keys {
            let value: String = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("GET");
            // `window_start:count`.
            let count = value.rsplit(':').next().expect("a fixed window's state");
            total += count.parse::<u64>().expect("a fixed window's count");
        }
        total
    }
}

/// Requests sent during a stall longer than the timeout, a few ms apart,
/// each answered through the failure mode (`deny`) at its timeout, not
/// at the stall's end; once Redis has woken and answered, the hits count
/// exactly what Redis consumed, each late decision counted once.
async fn late_replies_are_counted(batch: &str) {
    let setup = Setup::start(batch).await;
    let hits_before = setup.hits().await;
    let sleep = setup.redis.put_to_sleep(STALL_S).await;
    let slept_at = Instant::now();
    let mut asked = Vec::new();
    for _ in 0..6 {
        let client = RateLimitServiceClient::new(setup.channel.clone());
        asked.push(tokio::spawn(async move {
            let call = tonic::Request::new(request("late", vec![descriptor(&[("user", "slow")])]));
            let started = Instant::now();
            let answer = client
                .clone()
                .should_rate_limit(call)
                .await
                .expect("answered")
                .into_inner();
            (answer, started.elapsed())
        }));
        tokio::time::sleep(TIMEOUT / 3).await;
    }
    for task in asked {
        let (answer, took) = task.await.expect("task");
        assert_eq!(
            answer.overall_code,
            Code::OverLimit as i32,
            "answered through --failure-mode deny"
        );
        assert!(took < TIMEOUT * 3, "answered at its timeout, took {took:?}");
    }
    assert!(
        slept_at.elapsed() < Duration::from_secs_f64(STALL_S),
        "the answers came before Redis woke"
    );
    let timeouts = setup
        .metric("throttlegate_backend_errors_total{backend=\"redis\",kind=\"timeout\"}")
        .await;
    assert_eq!(timeouts, 6.0);
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    let counted = setup.counted_in_redis("slow").await;
    assert!(counted > 0, "no request reached Redis");
    // The late replies are counted as they come, in tasks of their own.
    let deadline = Instant::now() + Duration::from_secs(5);
    while setup.hits().await - hits_before < counted as f64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        setup.hits().await - hits_before,
        counted as f64,
        "hits equal what Redis counted"
    );
    let late = setup.metric("throttlegate_late_replies_total").await;
    assert_eq!(late, counted as f64, "one late reply per request Redis ran");
    let decisions = setup
        .metric("throttlegate_decisions_total{domain=\"late\",rule=\"user\",result=\"ok\"}")
        .await;
    assert_eq!(
        decisions,
        1.0 + counted as f64,
        "the warm-up and the late ones"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_replies_are_counted_without_batching() {
    late_replies_are_counted("off").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_replies_are_counted_with_batching() {
    late_replies_are_counted("on").await;
}

/// In a batch each request keeps its own timeout: one whose timeout ends
/// before the batch's reply comes is answered Timeout, and its decision is
/// handed over as late when the reply comes; the batch's other request,
/// still in time, gets its verdict as usual and is not handed over. The
/// call ahead of the batch, timed out during the stall, is handed over
/// too. Driven on the backend, one connection, Redis asleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_member_out_of_time_has_its_late_decision_handed_over() {
    use crate::support::keys::hourly_check;
    use crate::support::redis::batched_on_one_connection;
    use std::sync::{Arc, Mutex};
    use throttlegate::backends::{Backend, CallContext, Error, LateVerdict, Progress, Stage};

    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = batched_on_one_connection(&server, 1_000).await;
    let checks = hourly_check;
    backend.decide(&checks("warm")).await.expect("decided");
    let handed: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let ask = |user: &'static str| {
        let handed = handed.clone();
        let call = CallContext {
            send_by: None,
            progress: Progress::new(Stage::Decide),
            late: Some(LateVerdict::new(move |verdict| {
                assert!(verdict.allowed);
                handed.lock().expect("lock").push(user);
            })),
        };
        let backend = backend.clone();
        let checks = checks(user);
        tokio::spawn(async move { backend.decide_within(&checks, &call).await })
    };
    // Timeline (ms from the sleep): `ahead` alone, due at 1,000; `early`
    // (due 1,300) and `in_time` (due 1,600) queued, written together when
    // `ahead` times out; Redis wakes at about 1,450.
    let sleep = server.put_to_sleep(1.45).await;
    let ahead = ask("ahead");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let early = ask("early");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let in_time = ask("in_time");
    assert!(matches!(ahead.await.expect("task"), Err(Error::Timeout(_))));
    assert!(matches!(early.await.expect("task"), Err(Error::Timeout(_))));
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    let verdict = in_time.await.expect("task").expect("decided in time");
    assert!(verdict.allowed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut handed = handed.lock().expect("lock").clone();
    handed.sort_unstable();
    assert_eq!(handed, ["ahead", "early"]);
}
