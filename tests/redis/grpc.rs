//! The real gRPC server over the Redis backend: exact under concurrency,
//! across two server instances, and health that follows Redis.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic_health::pb::health_check_response::ServingStatus;

use crate::support;
use crate::support::ONE_AT_A_TIME;
use crate::support::redis::{RedisServer, backend_with};
use crate::support::service::{TestService, call, default_options, start_with_config};
use throttlegate::backends::Backend;
use throttlegate::backends::redis::ClockSource;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

const CONFIG: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 50}
  - key: bucket
    rate_limit: {unit: hour, requests_per_unit: 50, algorithm: token_bucket}
"#;

fn request(key: &str, value: &str) -> RateLimitRequest {
    support::service::one_entry_request("api", key, value)
}

async fn redis_service(server: &RedisServer) -> TestService {
    support::redis::service(server, CONFIG).await
}

/// 64 tasks, spread over `services`, send `requests` in total; returns how
/// many were answered OK.
async fn hammer(services: &[&TestService], key: &str, requests: usize) -> usize {
    let clients = (0..64).map(|task| services[task % services.len()].client());
    race(clients.collect(), key, requests / 64).await
}

/// Each client sends `each` requests for alice under `key`, all at once;
/// how many were answered OK (every other answer OVER_LIMIT).
async fn race(clients: Vec<RateLimitServiceClient<Channel>>, key: &str, each: usize) -> usize {
    let mut tasks = Vec::new();
    for mut client in clients {
        let request = request(key, "alice");
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..each {
                let res = client
                    .should_rate_limit(request.clone())
                    .await
                    .expect("rpc")
                    .into_inner();
                if res.overall_code == Code::Ok as i32 {
                    ok += 1;
                } else {
                    assert_eq!(res.overall_code, Code::OverLimit as i32);
                }
            }
            ok
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("task");
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_admits_exactly_the_limit_under_concurrency() {
    let server = RedisServer::start();
    let service = redis_service(&server).await;
    assert_eq!(hammer(&[&service], "user", 256).await, 50);
    assert_eq!(hammer(&[&service], "bucket", 256).await, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_redis_admit_exactly_the_limit_in_total() {
    let server = RedisServer::start();
    let first = redis_service(&server).await;
    let second = redis_service(&server).await;
    assert_eq!(hammer(&[&first, &second], "user", 256).await, 50);
    assert_eq!(hammer(&[&first, &second], "bucket", 256).await, 50);
}

/// Script calls Redis ran to the end since the last `CONFIG RESETSTAT`,
/// whichever way the decision script is invoked (a call refused because
/// the script was not loaded yet is a failed call).
async fn script_calls(server: &RedisServer) -> f64 {
    let stats = support::redis::command_stats(&mut server.connection().await).await;
    let stat = |command: &str, field: &str| {
        support::redis::command_stat(&stats, command, field).unwrap_or(0.0)
    };
    ["evalsha", "eval", "fcall"]
        .iter()
        .map(|command| stat(command, "calls") - stat(command, "failed_calls"))
        .sum()
}

fn cache_hits(service: &TestService) -> f64 {
    let text = service.limiter.metrics().encode();
    support::service::sample(&text, "throttlegate_over_limit_cache_hits_total").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_far_over_its_limit_is_denied_without_redis_calls() {
    let server = RedisServer::start();
    let first = redis_service(&server).await;
    let second = redis_service(&server).await;
    support::redis::reset_stats(&mut server.connection().await).await;
    // 64 tasks over two instances, 4,096 requests on a limit of 50 an
    // hour: exactly 50 allowed, and once each instance has seen the key
    // full, it answers without Redis until the hour has passed.
    for key in ["user", "bucket"] {
        assert_eq!(hammer(&[&first, &second], key, 4_096).await, 50, "{key}");
    }
    let calls = script_calls(&server).await;
    let hits = cache_hits(&first) + cache_hits(&second);
    assert_eq!(calls + hits, 2.0 * 4_096.0, "every request decided once");
    // At most 64 requests in flight per instance and key can miss the
    // cache before the first denial comes back.
    assert!(
        calls <= 2.0 * (50.0 + 2.0 * 64.0),
        "{calls} script calls for 8,192 requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_redis_down_and_back_without_a_restart() {
    let mut server = RedisServer::start();
    let backend = backend_with(&server, ClockSource::Redis, |it| it.timeout_ms = 300).await;
    let backend: Arc<dyn Backend> = Arc::new(backend);
    let service = start_with_config(CONFIG, backend, default_options()).await;
    for name in ["", "ratelimit"] {
        service
            .wait_for_health(name, ServingStatus::Serving, Duration::from_secs(5))
            .await;
    }
    let ok = call(&service, request("user", "bob")).await;
    assert_eq!(ok.overall_code, Code::Ok as i32);

    server.kill();
    let started = Instant::now();
    let status = service
        .client()
        .should_rate_limit(request("user", "bob"))
        .await
        .expect_err("redis is down and the failure mode is error");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_millis(300 + 500),
        "answered after {:?}",
        started.elapsed()
    );
    service
        .wait_for_health(
            "ratelimit",
            ServingStatus::NotServing,
            Duration::from_secs(5),
        )
        .await;

    server.restart();
    service
        .wait_for_health("ratelimit", ServingStatus::Serving, Duration::from_secs(5))
        .await;
    // Decisions resume.
    let ok = call(&service, request("user", "bob")).await;
    assert_eq!(ok.overall_code, Code::Ok as i32);
}

/// The connections the first requests would wait for (one for the shared
/// runtime, one per serving thread) and the function library on the
/// server exist once the service has started, before any request.
#[tokio::test]
async fn a_started_service_connects_and_loads_its_code_before_the_first_request() {
    for threads in [0usize, 2] {
        let server = RedisServer::start();
        let url = server.url();
        let threads_flag = threads.to_string();
        let mut process = support::process::Serve::yaml(CONFIG)
            .args(&["--redis-url", &url, "--grpc-threads", &threads_flag])
            .spawn();
        // The port is open; no request is sent.
        process.connect().await;
        let mut admin = server.connection().await;
        let own = support::redis::client_id(&mut admin).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let clients = support::redis::client_ids(&mut admin, &[own]).await.len();
            let libraries: Vec<::redis::Value> = ::redis::cmd("FUNCTION")
                .arg("LIST")
                .query_async(&mut admin)
                .await
                .unwrap();
            if clients > threads && !libraries.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{threads} serving threads: {clients} connections, {} libraries\n{}",
                libraries.len(),
                process.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Two processes run as an operator runs them with `--grpc-threads 2`,
/// each serving thread with its own Redis connections: 64 clients on
/// separate connections, spread over both processes and so over four
/// serving threads, racing on one key, get exactly the limit between
/// them; both stop cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serving_threads_with_their_own_redis_connections_admit_exactly_the_limit() {
    // Two processes and 64 clients load both cores.
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = RedisServer::start();
    let url = server.url();
    let flags = ["--redis-url", &url, "--grpc-threads", "2"];
    let mut processes = [
        support::process::Serve::yaml(CONFIG).args(&flags).spawn(),
        support::process::Serve::yaml(CONFIG).args(&flags).spawn(),
    ];
    for key in ["user", "bucket"] {
        let mut clients = Vec::with_capacity(64);
        for client in 0..64 {
            // A fresh channel each: one connection per client, dealt to
            // the process's serving threads in turn.
            clients.push(processes[client % 2].client().await);
        }
        assert_eq!(race(clients, key, 4).await, 50, "{key}: 256 requests");
    }
    for process in &mut processes {
        process.signal("TERM");
        let (status, log) = process.exit(Duration::from_secs(15)).await;
        assert!(status.success(), "{status}\n{log}");
    }
}
