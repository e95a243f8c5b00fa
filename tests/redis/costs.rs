//! Costs through the real gRPC server on Redis and on memory: any uint64
//! hits_addend is decided alike by both backends, and a sliding log's
//! request at the cap is one entry that stalls no other client.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::config::every_algorithm;
use crate::support::redis::{RedisServer, backend_with, settings};
use crate::support::service::{TestService, default_options, start_with_config};
use throttlegate::algorithms::Algorithm;
use throttlegate::backends::Backend;
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::redis::ClockSource;
use throttlegate::clock::ManualClock;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// Costs a double cannot hold exactly, up to the largest uint64.
const HUGE_COSTS: [u64; 4] = [(1 << 53) - 1, 1 << 53, 1 << 63, u64::MAX];

fn descriptor(key: &str, value: &str, hits_addend: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend,
        ..support::request::descriptor(&[(key, value)])
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>, hits_addend: u32) -> RateLimitRequest {
    RateLimitRequest {
        hits_addend,
        ..support::request::request("api", descriptors)
    }
}

async fn ask(service: &TestService, request: &RateLimitRequest) -> RateLimitResponse {
    service
        .client()
        .should_rate_limit(request.clone())
        .await
        .unwrap_or_else(|status| panic!("{request:?}: {status}"))
        .into_inner()
}

/// Every `throttlegate_backend_errors_total` series is 0 (or none exists).
fn assert_no_backend_error(service: &TestService) {
    let text = service.limiter.metrics().encode();
    for line in text.lines() {
        if line.starts_with("throttlegate_backend_errors_total") {
            assert!(line.ends_with(" 0"), "{line}");
        }
    }
}

/// Costs 2^53 - 1, 2^53, 2^63 and 2^64 - 1 on a descriptor, twice on one
/// counter, and the largest request-level cost, on every algorithm: the
/// same answer from both backends, OVER_LIMIT, and no backend error. The
/// script refused costs from 2^53 as bad parameters, so Redis failed the
/// RPC with UNAVAILABLE where memory answered OVER_LIMIT.
#[tokio::test]
async fn huge_costs_are_over_limit_on_both_backends_without_an_error() {
    let server = RedisServer::start();
    let clock = ManualClock::new(support::service::T0);
    let memory: Arc<dyn Backend> = Arc::new(MemoryBackend::new(Arc::new(clock.clone())));
    let local = ClockSource::Local(Arc::new(clock.clone()));
    let redis = backend_with(&server, local, |it| it.key_prefix = "costs".to_owned()).await;
    let redis: Arc<dyn Backend> = Arc::new(redis);
    let config = every_algorithm(10);
    let on_memory = start_with_config(&config, memory, default_options()).await;
    let on_redis = start_with_config(&config, redis, default_options()).await;

    for algorithm in Algorithm::ALL {
        let algorithm = algorithm.name();
        let mut requests = Vec::new();
        // One unit first, so that the huge costs meet a stored state.
        requests.push(request(vec![descriptor(algorithm, "a", None)], 0));
        for cost in HUGE_COSTS {
            requests.push(request(vec![descriptor(algorithm, "a", Some(cost))], 0));
            requests.push(request(
                vec![
                    descriptor(algorithm, "a", Some(cost)),
                    descriptor(algorithm, "a", Some(cost)),
                ],
                0,
            ));
            // A cost no limit allows beside a cost-1 one on another value.
            requests.push(request(
                vec![
                    descriptor(algorithm, "b", Some(1)),
                    descriptor(algorithm, "a", Some(cost)),
                ],
                0,
            ));
        }
        requests.push(request(vec![descriptor(algorithm, "a", None)], u32::MAX));
        for (idx, it) in requests.iter().enumerate() {
            let expected = ask(&on_memory, it).await;
            let actual = ask(&on_redis, it).await;
            assert_eq!(actual, expected, "{algorithm} request {idx}: {it:?}");
            let code = if idx == 0 { Code::Ok } else { Code::OverLimit };
            assert_eq!(
                actual.overall_code, code as i32,
                "{algorithm} request {idx}"
            );
        }
        // Nothing was consumed by the denied requests: 9 of 10 left.
        let last = request(vec![descriptor(algorithm, "a", None)], 0);
        let expected = ask(&on_memory, &last).await;
        assert_eq!(ask(&on_redis, &last).await, expected, "{algorithm}");
        assert_eq!(expected.statuses[0].limit_remaining, 8, "{algorithm}");
    }
    assert_no_backend_error(&on_memory);
    assert_no_backend_error(&on_redis);
}

const AT_THE_CAP: &str = r#"
domain: api
descriptors:
  - key: big
    rate_limit: {unit: hour, requests_per_unit: 10000, algorithm: sliding_window_log}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100000, algorithm: gcra}
"#;

/// A sliding log at the cap (10,000 per hour) taking its whole limit in one
/// request wrote 10,000 members (3,000,000 ran the script for seconds and
/// left a 369 MB key). It is one member now: answered within the Redis
/// timeout, the key a few hundred bytes, and clients on other keys are
/// served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_request_at_the_cap_is_one_entry_and_stalls_no_one() {
    let server = RedisServer::start();
    let service = support::redis::service(&server, AT_THE_CAP).await;
    let timeout = Duration::from_millis(settings(&server, ClockSource::Redis).timeout_ms);

    // Other clients, each on its own key, timing every answer.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut others = Vec::new();
    for idx in 0..4 {
        let mut client = service.client();
        let stop = stop.clone();
        others.push(tokio::spawn(async move {
            let request = request(vec![descriptor("user", &format!("u{idx}"), None)], 0);
            let mut slowest = Duration::ZERO;
            let mut answered = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || answered == 0 {
                let started = Instant::now();
                let res = client
                    .should_rate_limit(request.clone())
                    .await
                    .expect("rpc");
                assert_eq!(res.into_inner().overall_code, Code::Ok as i32);
                slowest = slowest.max(started.elapsed());
                answered += 1;
            }
            slowest
        }));
    }

    let mut elapsed = Vec::new();
    for (value, expected) in [("a", Code::Ok), ("a", Code::OverLimit), ("b", Code::Ok)] {
        let it = request(vec![descriptor("big", value, Some(10_000))], 0);
        let started = Instant::now();
        let res = ask(&service, &it).await;
        elapsed.push(started.elapsed());
        assert_eq!(res.overall_code, expected as i32, "{value}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for it in others {
        let slowest = it.await.expect("client task");
        // Generous for two loaded cores; a script running for seconds
        // (Redis answers nothing else meanwhile) would exceed it.
        assert!(
            slowest < Duration::from_secs(2),
            "another client waited {slowest:?}"
        );
    }
    for it in elapsed {
        assert!(it < timeout, "answered in {it:?}");
    }

    let keys = server.keys("tg:api:big:*").await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    let mut conn = server.connection().await;
    for key in keys {
        let members: u64 = redis::cmd("ZCARD")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(members, 1, "{key}");
        let bytes: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(bytes < 1_024, "{key}: {bytes} bytes");
    }
    assert_no_backend_error(&service);
}
