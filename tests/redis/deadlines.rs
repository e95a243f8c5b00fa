//! The caller's deadline against a stalled Redis, on the service binary:
//! a call whose client gives up (its `grpc-timeout`, or a cancelled
//! stream) is counted as abandoned at the stage it was at, the decision
//! Redis makes once the stall ends is still counted in the hits, and a
//! call arriving with too little time for Redis is answered at once
//! through the failure mode without reaching Redis.

use std::time::{Duration, Instant};

use tonic::transport::Channel;

use crate::support::process::{Serve, ServiceProcess};
use crate::support::proxy::{Mode, Proxy};
use crate::support::redis::{RedisServer, command_stat, command_stats};
use crate::support::request::{descriptor, request};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = r#"
domain: deadlines
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000, algorithm: fixed_window}
"#;

/// `--redis-timeout-ms`: far longer than the clients' deadlines, as
/// Envoy's 20 ms is far shorter than the default 250 ms.
const REDIS_TIMEOUT_MS: &str = "1000";

/// Envoy's rate-limit filter's timeout.
const ENVOY_TIMEOUT: Duration = Duration::from_millis(20);

struct Setup {
    redis: RedisServer,
    proxy: Proxy,
    service: ServiceProcess,
    channel: Channel,
}

impl Setup {
    async fn start() -> Setup {
        let redis = RedisServer::start();
        let proxy = Proxy::start(([127, 0, 0, 1], redis.port()).into()).await;
        let mut service = Serve::yaml(CONFIG)
            .args(&["--redis-url", &proxy.redis_url()])
            .args(&["--redis-timeout-ms", REDIS_TIMEOUT_MS])
            .args(&["--failure-mode", "error"])
            .spawn();
        let channel = service.connect().await;
        let setup = Setup {
            redis,
            proxy,
            service,
            channel,
        };
        // A first decision: the pooled connection and the code are ready.
        setup.ask("warm", None).await.expect("a decision");
        setup
    }

    fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(self.channel.clone())
    }

    /// One ShouldRateLimit for `user`, with `timeout` as its `grpc-timeout`.
    async fn ask(&self, user: &str, timeout: Option<Duration>) -> Result<(), tonic::Status> {
        let mut call = tonic::Request::new(user_request(user));
        if let Some(timeout) = timeout {
            call.set_timeout(timeout);
        }
        self.client().should_rate_limit(call).await.map(|_| ())
    }

    async fn abandoned(&self, stage: &str) -> f64 {
        self.service
            .metric(&format!(
                "throttlegate_abandoned_calls_total{{method=\"ShouldRateLimit\",stage=\"{stage}\"}}"
            ))
            .await
    }

    async fn hits(&self) -> f64 {
        self.service
            .metric("throttlegate_hits_total{domain=\"deadlines\",rule=\"user\"}")
            .await
    }

    async fn fcalls(&self) -> f64 {
        let mut admin = self.redis.connection().await;
        command_stat(&command_stats(&mut admin).await, "fcall", "calls").unwrap_or(0.0)
    }
}

fn user_request(user: &str) -> RateLimitRequest {
    request("deadlines", vec![descriptor(&[("user", user)])])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_given_up_during_a_stall_are_counted_and_so_are_their_decisions() {
    let setup = Setup::start().await;
    let hits_before = setup.hits().await;
    setup.proxy.set(Mode::BlackHole);

    // Envoy's way: a 20 ms grpc-timeout. Over at its deadline, not after
    // the Redis timeout.
    let started = Instant::now();
    let status = setup
        .ask("timed-out", Some(ENVOY_TIMEOUT))
        .await
        .expect_err("no decision during the stall");
    let took = started.elapsed();
    // The service answers 2 ms ahead of the deadline; the client's own
    // timer (tonic's, as Envoy's) may still fire first on a busy machine.
    assert!(
        matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    assert!(
        took < Duration::from_millis(200),
        "answered after {took:?}, not at its 20 ms deadline"
    );

    // A client that cancels: its stream reset after 20 ms.
    let cancelled = tokio::time::timeout(ENVOY_TIMEOUT, setup.ask("cancelled", None)).await;
    assert!(
        cancelled.is_err(),
        "answered during the stall: {cancelled:?}"
    );

    // Both were written to Redis (through the black hole): stage backend.
    let deadline = Instant::now() + Duration::from_secs(2);
    while setup.abandoned("backend").await < 2.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(setup.abandoned("backend").await, 2.0);
    assert_eq!(setup.hits().await, hits_before, "nothing decided yet");

    // The stall ends within the Redis timeout: Redis decides both, and
    // both are counted though nobody reads the answers.
    tokio::time::sleep(Duration::from_millis(100)).await;
    setup.proxy.set(Mode::Forward);
    let deadline = Instant::now() + Duration::from_secs(3);
    while setup.hits().await < hits_before + 2.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(setup.hits().await, hits_before + 2.0);
    assert_eq!(
        setup
            .service
            .metric("throttlegate_backend_errors_total{backend=\"redis\",kind=\"timeout\"}")
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_time_for_redis_is_answered_at_once_and_never_sent() {
    let setup = Setup::start().await;
    let fcalls_before = setup.fcalls().await;
    assert!(
        fcalls_before >= 1.0,
        "the first decision went through FCALL"
    );
    let started = Instant::now();
    let status = setup
        .ask("too-late", Some(Duration::from_millis(2)))
        .await
        .expect_err("no time for a decision");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(setup.abandoned("deadline").await, 1.0);
    assert_eq!(setup.fcalls().await, fcalls_before, "never sent to Redis");
    // With time, the same request is decided.
    setup
        .ask("too-late", Some(ENVOY_TIMEOUT * 10))
        .await
        .expect("a decision");
    assert_eq!(setup.fcalls().await, fcalls_before + 1.0);
}

/// With batching and one connection: while Redis sleeps, one call is in
/// flight and two wait for the next batch, one whose caller's `send_by`
/// passes during the sleep and one with time. When the first returns, the
/// late one is answered `Deadline` and never written; the other is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_member_whose_deadline_passed_is_never_written() {
    use crate::support::keys::hourly_check;
    use crate::support::redis::{batched_on_one_connection, reset_stats};
    use throttlegate::backends::{Backend, CallContext, Error, Progress, Stage};

    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = batched_on_one_connection(&server, 3_000).await;
    let checks = hourly_check;
    backend.decide(&checks("warm")).await.expect("decided");
    let mut admin = server.connection().await;
    reset_stats(&mut admin).await;
    let sleep = server.put_to_sleep(0.5).await;
    let first = tokio::spawn({
        let backend = backend.clone();
        let checks = checks("first");
        async move { backend.decide(&checks).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let late_call = CallContext {
        send_by: Some(Instant::now() + Duration::from_millis(100)),
        progress: Progress::new(Stage::Decide),
        late: None,
    };
    let late = tokio::spawn({
        let backend = backend.clone();
        let checks = checks("late");
        let call = late_call.clone();
        async move { backend.decide_within(&checks, &call).await }
    });
    let patient = tokio::spawn({
        let backend = backend.clone();
        let checks = checks("patient");
        async move { backend.decide(&checks).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(late_call.progress.get(), Stage::Queue);
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    first.await.expect("task").expect("the first call decided");
    patient
        .await
        .expect("task")
        .expect("the patient call decided");
    match late.await.expect("task") {
        Err(Error::Deadline) => {}
        other => panic!("expected Deadline, got {other:?}"),
    }
    let stats = command_stats(&mut admin).await;
    // The first call alone, then the patient one alone (a batch of one is
    // an FCALL of `decide`): two calls, the late one never written.
    assert_eq!(command_stat(&stats, "fcall", "calls"), Some(2.0), "{stats}");
    assert!(
        server.keys("*late*").await.is_empty(),
        "the late request reached Redis"
    );
    assert!(!server.keys("*patient*").await.is_empty());
}

/// Each request keeps its own deadline in a batch: with one connection and
/// Redis asleep, an old request whose own moment to be written (a quarter
/// of its timeout left) passes during the sleep waits beside eight young
/// ones. When Redis wakes, the old one alone is left out (answered
/// Timeout, never written) and the young ones are decided in one call:
/// the batch no longer lives by its oldest member's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_member_out_of_time_is_left_out_and_the_others_are_decided() {
    use crate::support::keys::hourly_check;
    use crate::support::redis::{batched_on_one_connection, reset_stats};
    use throttlegate::backends::{Backend, Error};

    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = batched_on_one_connection(&server, 4_000).await;
    let checks = hourly_check;
    let spawn = |user: String| {
        let backend = backend.clone();
        let checks = checks(&user);
        tokio::spawn(async move { backend.decide(&checks).await })
    };
    backend.decide(&checks("warm")).await.expect("decided");
    let mut admin = server.connection().await;
    reset_stats(&mut admin).await;
    // Asleep for longer than three quarters of the timeout.
    let sleep = server.put_to_sleep(3.5).await;
    let first = spawn("first".to_owned());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let old = spawn("old".to_owned());
    // The young ones arrive late enough to have time left after the sleep.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let young: Vec<_> = (0..8).map(|idx| spawn(format!("young{idx}"))).collect();
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    first.await.expect("task").expect("the first call decided");
    for task in young {
        let verdict = task.await.expect("task").expect("a young request decided");
        assert!(verdict.allowed);
    }
    match old.await.expect("task") {
        Err(Error::Timeout(4_000)) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    let stats = command_stats(&mut admin).await;
    // The first call alone, then the eight young ones in one batch.
    assert_eq!(command_stat(&stats, "fcall", "calls"), Some(2.0), "{stats}");
    assert!(
        server.keys("*old*").await.is_empty(),
        "the old request reached Redis"
    );
    assert_eq!(server.keys("*young*").await.len(), 8);
}
