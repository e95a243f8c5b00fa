//! Many clients racing on one key through the real gRPC server.

use std::time::Duration;

use crate::support::process::Serve;
use crate::support::service::{
    connect, default_options, one_entry_request, start_on_memory, start_on_memory_threaded,
};
use throttlegate::algorithms::Algorithm;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const LIMIT: usize = 100;
const TASKS: usize = 64;
const PER_TASK: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_the_limit_is_allowed_under_contention() {
    race_every_algorithm(0).await;
}

/// The same race with the connections dealt to serving threads, as the
/// binary serves by default: requests on one key decided on different
/// threads still admit exactly the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_the_limit_is_allowed_across_serving_threads() {
    race_every_algorithm(3).await;
}

async fn race_every_algorithm(threads: usize) {
    for algorithm in Algorithm::ALL {
        let config = format!(
            "domain: race\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}, algorithm: {algorithm}}}\n"
        );
        // The manual clock stands still: nothing refills during the race.
        let service = if threads == 0 {
            start_on_memory(&config, default_options()).await
        } else {
            start_on_memory_threaded(&config, default_options(), threads).await
        };
        let mut tasks = Vec::with_capacity(TASKS);
        for _ in 0..TASKS {
            // Separate clients, one shared HTTP/2 connection per task.
            let mut client = RateLimitServiceClient::new(connect(service.addr).await);
            tasks.push(tokio::spawn(async move {
                let mut allowed = 0;
                for _ in 0..PER_TASK {
                    let request = one_entry_request("race", "k", "same");
                    let res = client
                        .should_rate_limit(request)
                        .await
                        .expect("rpc")
                        .into_inner();
                    if res.overall_code == Code::Ok as i32 {
                        allowed += 1;
                    } else {
                        assert_eq!(res.overall_code, Code::OverLimit as i32);
                    }
                }
                allowed
            }));
        }
        let mut allowed = 0;
        for task in tasks {
            allowed += task.await.expect("client task");
        }
        assert_eq!(allowed, LIMIT, "{algorithm}: {} requests", TASKS * PER_TASK);
    }
}

/// `serve --grpc-threads 2` as an operator runs it: both serving threads
/// exist, clients on separate connections racing on one key get exactly
/// the limit between them, and SIGTERM still ends the process cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_binary_with_serving_threads_allows_exactly_the_limit_and_stops() {
    let config = format!(
        "domain: race\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {LIMIT}}}\n"
    );
    let mut server = Serve::yaml(&config).args(&["--grpc-threads", "2"]).spawn();
    let mut clients = Vec::with_capacity(TASKS);
    for _ in 0..TASKS {
        // A fresh channel each: one connection per client.
        clients.push(server.client().await);
    }
    let threads = thread_names(server.pid());
    for name in ["grpc-0", "grpc-1"] {
        assert!(threads.iter().any(|it| it == name), "{threads:?}");
    }
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                let mut allowed = 0;
                for _ in 0..PER_TASK {
                    let request = one_entry_request("race", "k", "same");
                    let res = client.should_rate_limit(request).await.expect("rpc");
                    if res.into_inner().overall_code == Code::Ok as i32 {
                        allowed += 1;
                    }
                }
                allowed
            })
        })
        .collect();
    let mut allowed = 0;
    for task in tasks {
        allowed += task.await.expect("client task");
    }
    assert_eq!(allowed, LIMIT, "{} requests", TASKS * PER_TASK);
    server.signal("TERM");
    let (status, log) = server.exit(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}\n{log}");
}

/// The names of the threads of process `pid`.
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the process's tasks")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .collect()
}
