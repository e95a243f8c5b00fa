//! A restart of Redis costs no decision: Redis killed, the circuit open
//! (health NOT_SERVING), Redis started again, health SERVING: from then on
//! every request is decided by Redis, on every serving thread. On a limit
//! of 2 a minute the next three requests, dealt over the threads, are OK,
//! OK, OVER_LIMIT, each with the limit's figures, never an answer of the
//! failure mode. Many restarts in a row, with one and with several serving
//! threads.

use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::support::process::{Serve, ServiceProcess};
use crate::support::redis::RedisServer;
use crate::support::request::{descriptor, request};
use crate::support::service::connect;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = r#"
domain: restart
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

/// `--redis-timeout-ms`: short, so that a call that must first connect
/// and load the library on a thread's cold pool after the restart does
/// not fit in it, while a call on a ready connection does (a decision
/// takes about a millisecond here).
const TIMEOUT_MS: &str = "40";

/// Restarts per test; `THROTTLEGATE_RESTART_RUNS` runs more or fewer.
fn runs() -> usize {
    std::env::var("THROTTLEGATE_RESTART_RUNS")
        .ok()
        .and_then(|it| it.parse().ok())
        .unwrap_or(20)
}

/// What one request was answered: the code, and whether it carried the
/// limit's figures (a decision) or not (the failure mode's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Decided(Code),
    FailureMode(Code),
}

async fn wait_health(channel: &Channel, expected: ServingStatus, service: &ServiceProcess) {
    let started = Instant::now();
    loop {
        let status = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()
            .map(|it| it.into_inner().status());
        if status == Some(expected) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "health is {status:?}, not {expected:?} within 10 s; log:\n{}",
            service.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn ask(client: &mut RateLimitServiceClient<Channel>, user: &str) -> Answer {
    let res = client
        .should_rate_limit(request("restart", vec![descriptor(&[("user", user)])]))
        .await
        .expect("failure mode allow answers every call")
        .into_inner();
    let code = Code::try_from(res.overall_code).expect("a known code");
    match res.statuses.iter().all(|it| it.current_limit.is_some()) {
        true => Answer::Decided(code),
        false => Answer::FailureMode(code),
    }
}

/// [`runs`] restarts of Redis under a service with `threads` serving
/// threads (0: the shared runtime only), one client per thread
/// (connections are dealt to the threads in turn); after each restart the
/// three requests, one per client in turn.
async fn every_request_after_a_restart_is_decided(threads: usize) {
    let mut redis = RedisServer::start();
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.url()])
        .args(&["--redis-timeout-ms", TIMEOUT_MS])
        .args(&["--failure-mode", "allow"])
        .args(&["--grpc-threads", &threads.to_string()])
        .spawn();
    let channel = service.connect().await;
    let mut clients = vec![RateLimitServiceClient::new(channel.clone())];
    for _ in 1..threads.max(1) {
        clients.push(RateLimitServiceClient::new(connect(service.grpc).await));
    }
    wait_health(&channel, ServingStatus::Serving, &service).await;
    let expected = [
        Answer::Decided(Code::Ok),
        Answer::Decided(Code::Ok),
        Answer::Decided(Code::OverLimit),
    ];
    let mut failed = Vec::new();
    for run in 0..runs() {
        tokio::task::block_in_place(|| redis.kill());
        wait_health(&channel, ServingStatus::NotServing, &service).await;
        tokio::task::block_in_place(|| redis.restart());
        wait_health(&channel, ServingStatus::Serving, &service).await;
        let user = format!("u{run}");
        let mut answers = Vec::new();
        for idx in 0..3 {
            let n = clients.len();
            answers.push(ask(&mut clients[(run + idx) % n], &user).await);
        }
        if answers != expected {
            failed.push((run, answers));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} restarts left a request undecided (expected {expected:?}): {failed:?}",
        failed.len(),
        runs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_after_a_restart_is_decided_on_the_shared_runtime() {
    every_request_after_a_restart_is_decided(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_after_a_restart_is_decided_on_one_serving_thread() {
    every_request_after_a_restart_is_decided(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_after_a_restart_is_decided_on_several_serving_threads() {
    every_request_after_a_restart_is_decided(3).await;
}
