//! The built binary under floods a client can send: its logs and its memory stay bounded.

use std::time::Duration;

use crate::support;
use crate::support::process::{Serve, ServiceProcess};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

/// `serve` of `yaml` with `extra` flags on free ports, stderr captured.
async fn serve(yaml: &str, extra: &[&str]) -> (ServiceProcess, RateLimitServiceClient<Channel>) {
    let mut server = Serve::yaml(yaml)
        .args(&["--watch-config", "off", "--drain-timeout-ms", "1000"])
        .args(extra)
        .spawn();
    let client = server.client().await;
    (server, client)
}

/// Stops the server with SIGTERM; everything it logged, plain text since
/// stderr is a pipe, not a terminal.
async fn stop(server: ServiceProcess) -> String {
    let stderr = server.stop().await;
    assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");
    stderr
}

/// A request of one descriptor per value, each `key=value`.
fn request(key: &str, values: impl IntoIterator<Item = String>) -> RateLimitRequest {
    support::request::one_descriptor_per_value("api", key, values)
}

/// The integer logged as `field=N` on `line`.
fn field(line: &str, field: &str) -> Option<u64> {
    let at = line.find(&format!("{field}="))? + field.len() + 1;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[tokio::test]
async fn requests_that_can_never_pass_cannot_flood_the_log() {
    let config = "domain: api\ndescriptors:\n  - key: blocked\n    rate_limit: {unit: minute, requests_per_unit: 0}\n";
    let (server, mut client) = serve(config, &[]).await;
    const WARNING: &str = "this request can never pass";
    // 10 requests of 64 distinct counters each: 640 lines without a gate.
    for round in 0..10 {
        let res = client
            .should_rate_limit(request(
                "blocked",
                (0..64).map(|idx| format!("{round}-{idx}")),
            ))
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(res.overall_code, Code::OverLimit as i32);
    }
    // A second later the next one is let through, with the count.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    client
        .should_rate_limit(request("blocked", ["last".to_owned()]))
        .await
        .expect("rpc");
    // An open connection would hold the drain until its deadline.
    drop(client);
    let stderr = stop(server).await;
    let lines: Vec<&str> = stderr.lines().filter(|it| it.contains(WARNING)).collect();
    // At most two lines for the flood (it may straddle a second), then the
    // one after the pause.
    assert!(
        (2..=3).contains(&lines.len()),
        "{} lines:\n{stderr}",
        lines.len()
    );
    let suppressed: Vec<u64> = lines
        .iter()
        .map(|it| field(it, "suppressed").expect("a suppressed count"))
        .collect();
    assert!(*suppressed.last().unwrap() > 0, "{stderr}");
    // Every occurrence is either a line or counted on a later line.
    assert_eq!(
        lines.len() as u64 + suppressed.iter().sum::<u64>(),
        10 * 64 + 1,
        "{stderr}"
    );
}

#[tokio::test]
async fn a_flood_of_fresh_values_stays_within_the_memory_bound() {
    let config = "domain: api\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    const BOUND: u64 = 500;
    let (server, mut client) = serve(
        config,
        &[
            "--memory-max-counters",
            &BOUND.to_string(),
            "--failure-mode",
            "deny",
        ],
    )
    .await;
    // A known client, before the flood.
    let known = || request("ip", ["known".to_owned()]);
    let res = client
        .should_rate_limit(known())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(res.overall_code, Code::Ok as i32);
    let rss_before = server.rss_kib() * 1024;
    // 300 requests of 64 fresh values: 19,200 counters asked for.
    let mut denied = 0;
    for round in 0..300 {
        let res = client
            .should_rate_limit(request("ip", (0..64).map(|idx| format!("{round}.{idx}"))))
            .await
            .expect("always answered")
            .into_inner();
        if res.overall_code == Code::OverLimit as i32 {
            denied += 1;
        }
        if round % 50 == 0 {
            assert!(server.metric("throttlegate_memory_counters").await <= BOUND as f64);
        }
    }
    // The first requests fit, the rest were refused under --failure-mode.
    assert!(denied >= 290, "{denied} denied");
    assert!(server.metric("throttlegate_memory_counters").await <= BOUND as f64);
    assert!(
        server
            .metric("throttlegate_backend_errors_total{backend=\"memory\",kind=\"full\"}")
            .await
            >= 290.0
    );
    // The existing counter keeps working: its second request passes, the
    // third is over its limit.
    let codes: Vec<i32> = [
        client
            .should_rate_limit(known())
            .await
            .unwrap()
            .into_inner(),
        client
            .should_rate_limit(known())
            .await
            .unwrap()
            .into_inner(),
    ]
    .iter()
    .map(|it| it.overall_code)
    .collect();
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    // Generous: the bound holds memory, whatever the allocator keeps.
    let grown = (server.rss_kib() * 1024).saturating_sub(rss_before);
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    drop(client);
    let stderr = stop(server).await;
    let full_lines = stderr
        .lines()
        .filter(|it| it.contains("memory backend full"))
        .count();
    // One line a second at most; the flood takes a few seconds.
    assert!(
        (1..=30).contains(&full_lines),
        "{full_lines} lines:\n{stderr}"
    );
}
