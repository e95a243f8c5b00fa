//! A charge is never lost while Redis can take it: `charge: always`
//! requests (each of cost 1, as Envoy's stream-done call sends the usage
//! a response reported) through `--redis-timeout-ms 250` while Redis stalls
//! three times for a second (`DEBUG SLEEP`). Callers are answered through
//! the failure mode during the stalls; every charge the service received
//! is still recorded by Redis once it wakes (written late, or sent again
//! after its caller's time), none twice, and none counted lost. Batching
//! on and off.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::support::process::{Serve, ServiceProcess};
use crate::support::redis::RedisServer;
use crate::support::request::{descriptor, request};
use crate::support::service::connect;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

/// A limit charged always that never denies in a test: the Redis counter
/// is the number of charges recorded.
const CONFIG: &str = r#"
domain: usage
descriptors:
  - key: api_key
    rate_limit: {unit: day, requests_per_unit: 1000000000, algorithm: fixed_window, charge: always}
"#;

/// Concurrent callers, over [`CONNECTIONS`] gRPC connections.
const CALLERS: usize = 32;
const CONNECTIONS: usize = 4;

/// Each caller's deadline (sent as `grpc-timeout`, as Envoy sends its
/// filter's timeout).
const CALLER_TIMEOUT: Duration = Duration::from_millis(300);

/// Stalls of Redis during the run, each this long.
const STALLS: usize = 3;
const STALL_S: f64 = 1.0;

/// The charges counted by Redis: the fixed window's count (its state is
/// `window_start:count`), 0 while absent.
async fn recorded(redis: &RedisServer) -> u64 {
    let mut conn = redis.connection().await;
    let mut total = 0;
    for key in redis.keys("tg:usage:*").await {
        let state: String = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("GET");
        total += state
            .rsplit(':')
            .next()
            .and_then(|it| it.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("not a fixed window state: {state:?}"));
    }
    total
}

/// Charges sent and charges answered (any answer: the service got them).
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    answered: AtomicU64,
}

/// Callers sending charges in a loop until `stop`.
async fn callers(
    service: &ServiceProcess,
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    let mut channels = Vec::new();
    for _ in 0..CONNECTIONS {
        channels.push(connect(service.grpc).await);
    }
    for idx in 0..CALLERS {
        let mut client = RateLimitServiceClient::new(channels[idx % CONNECTIONS].clone());
        let (stop, tally) = (stop.clone(), tally.clone());
        tasks.spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let key = format!("k{}", idx % 8);
                let mut call = tonic::Request::new(request(
                    "usage",
                    vec![descriptor(&[("api_key", key.as_str())])],
                ));
                // The deadline the service answers by; not enforced here,
                // so every call gets the service's answer.
                let timeout = format!("{}m", CALLER_TIMEOUT.as_millis());
                call.metadata_mut()
                    .insert("grpc-timeout", timeout.parse().expect("a header value"));
                tally.sent.fetch_add(1, Ordering::SeqCst);
                let res =
                    tokio::time::timeout(Duration::from_secs(5), client.should_rate_limit(call))
                        .await;
                // An answer, or the service's own status at its deadline:
                // either way the service got the charge.
                if res.is_ok() {
                    tally.answered.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
    }
    tasks
}

async fn no_charge_is_lost_while_redis_stalls(batch: &str) {
    let redis = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.url()])
        .args(&["--redis-key-prefix", "tg"])
        .args(&["--redis-timeout-ms", "250"])
        .args(&["--redis-batch", batch])
        .args(&["--failure-mode", "allow"])
        .spawn();
    service.connect().await;
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut tasks = callers(&service, &stop, &tally).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..STALLS {
        let sleep = redis.put_to_sleep(STALL_S).await;
        sleep.await.expect("sleep task").expect("DEBUG SLEEP");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stop.store(true, Ordering::SeqCst);
    while tasks.join_next().await.is_some() {}
    let sent = tally.sent.load(Ordering::SeqCst);
    let answered = tally.answered.load(Ordering::SeqCst);
    // Charges still being sent again, or late replies, settle within the
    // bounds (10 s each); stop once Redis has counted every answered one
    // and the count holds still.
    let deadline = Instant::now() + Duration::from_secs(25);
    let mut count = recorded(&redis).await;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = recorded(&redis).await;
        if (now >= answered && now == count) || Instant::now() >= deadline {
            count = now;
            break;
        }
        count = now;
    }
    let lost = service.metric("throttlegate_charges_lost_total").await;
    let resent = service.metric("throttlegate_charges_resent_total").await;
    let late = service.metric("throttlegate_late_replies_total").await;
    eprintln!(
        "batch {batch}: {sent} charges sent, {answered} answered, {count} recorded by Redis; \
         {resent} sent again, {late} late replies, {lost} counted lost"
    );
    assert_eq!(
        answered, sent,
        "batch {batch}: every charge is answered in time"
    );
    assert_eq!(
        count, sent,
        "batch {batch}: {sent} charges sent and answered, {count} recorded \
         ({resent} sent again, {late} late replies, {lost} counted lost)"
    );
    assert_eq!(lost, 0.0, "batch {batch}: charges counted lost");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_charge_is_lost_while_redis_stalls_with_batching() {
    no_charge_is_lost_while_redis_stalls("on").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_charge_is_lost_while_redis_stalls_without_batching() {
    no_charge_is_lost_while_redis_stalls("off").await;
}
